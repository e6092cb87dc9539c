"""A real tritonserver process on free ports, over a copy of model_repository/
with some parameters changed. Used by the load tools and the tests."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request

from backends.ports import free_port  # noqa: F401 (the load tools and tests take it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
TRITONSERVER = os.path.join(ROOT, ".venv", "bin", "tritonserver")


def set_parameters(config: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        pattern = re.compile(r'(key: "%s"\s*value: \{ string_value: ")[^"]*(")' % re.escape(key))
        config, count = pattern.subn(lambda m: m.group(1) + value + m.group(2), config)
        if count == 0:
            config += f'parameters {{\n  key: "{key}"\n  value: {{ string_value: "{value}" }}\n}}\n'
    return config


def metric_value(metrics: dict[str, float], name: str, **labels) -> float | None:
    """The sum of the series of `name` that carry these labels (in any order), from
    TritonServer.metrics(); None when no series does."""
    values = [value for key, value in metrics.items() if key.startswith(name + "{")
              and all(f'{label}="{text}"' in key for label, text in labels.items())]
    return sum(values) if values else None


class TritonServer:
    def __init__(self, repo_dir: str, models: list[str], parameters: dict[str, dict[str, str]] | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 480):
        self.repo_dir, self.models = repo_dir, models
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        for name in models:
            src, dst = os.path.join(ROOT, "model_repository", name), os.path.join(repo_dir, name)
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            path = os.path.join(dst, "config.pbtxt")
            with open(path) as f:
                text = set_parameters(f.read(), (parameters or {}).get(name, {}))
            with open(path, "w") as f:
                f.write(text)
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = os.path.join(repo_dir, "tritonserver.log")
        self.proc: subprocess.Popen | None = None
        self.log = None   # the server's output, reopened by each launch

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for attempt in range(3):
            self._launch()
            if self._wait_ready():
                return
            if attempt == 2 or "already in use" not in self.log_tail():
                raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.log_tail()}")
            # Another process bound one of our ports first: take new ones.
            self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()

    def _launch(self) -> None:
        cmd = [TRITONSERVER, "--model-repository", self.repo_dir, "--grpc-port", str(self.grpc_port),
               "--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port),
               "--exit-timeout-secs", "10"]
        if self.log is not None:
            self.log.close()  # a launch before it, on ports another process took
        self.log = open(self.log_path, "w")
        # Its own process group, so stop() can also reap Python backend stubs that
        # outlive a server which did not unload a model within its exit timeout.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def _wait_ready(self) -> bool:
        """True once ready; False when the server exited."""
        deadline = time.time() + self.ready_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            if self._ready():
                return True
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {self.ready_timeout_s}s:\n{self.log_tail()}")

    def _ready(self) -> bool:
        """Ready, and the metrics endpoint up: tritonserver starts that one after HTTP, so a
        test reading a gauge right after /v2/health/ready could find its port still closed."""
        try:
            with urllib.request.urlopen(f"http://localhost:{self.http_port}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self._ready()

    def log_tail(self, lines: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server, if still up, and any stub left behind
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()

    # ---- metrics -------------------------------------------------------------------
    def wait_metric(self, name: str, done, timeout_s: float = 20) -> bool:
        """Whether done(the metric's value, 0 while it is absent) comes true within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(self.metrics().get(name, 0.0)):
                return True
            time.sleep(0.02)
        return False

    def metrics(self) -> dict[str, float]:
        """Tandem's gauges and counters: {'tandem_kv_pages_free{model="llm"}': 512.0, ...}."""
        with urllib.request.urlopen(f"http://localhost:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("tandem_"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def metric(self, name: str, **labels) -> float | None:
        """One of Tandem's metrics now (see metric_value)."""
        return metric_value(self.metrics(), name, **labels)

    def kv_pages(self, model: str) -> tuple[float, float]:
        """(pages no request holds: free or cached, pages in the pool)."""
        m = self.metrics()
        idle = m[f'tandem_kv_pages_free{{model="{model}"}}'] + m.get(f'tandem_kv_pages_cached{{model="{model}"}}', 0)
        return idle, m[f'tandem_kv_pages_total{{model="{model}"}}']

    def wait_kv_full(self, model: str, timeout_s: float = 10) -> bool:
        """True once no request holds a KV page of the model (each is free or cached)."""
        return self._wait_kv(model, lambda free, total: free == total, timeout_s)

    def wait_kv_used(self, model: str, timeout_s: float = 5) -> bool:
        """True once the gauges show some KV page of the model in use (they are published
        every 0.1 s, so a request can stream a few tokens before they do)."""
        return self._wait_kv(model, lambda free, total: free < total, timeout_s)

    def _wait_kv(self, model: str, done, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if done(*self.kv_pages(model)):
                return True
            time.sleep(0.05)
        return False
