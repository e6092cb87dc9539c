"""The `llm` model served by the real tritonserver on the GPU, for client.bench_gpu --serve.

Writes a model repository holding only `llm` (this repository's model, its config.pbtxt
with the benchmark's engine settings), starts the tritonserver of the nvidia-pytriton wheel
(carried as a trimmed tree: scripts/gpu_serve_prepare.sh), and streams each level's
requests over Triton's HTTP generate_stream endpoint, `streams` at once, from a few client
processes (urllib: nothing to install on a bare GPU box). Prompts are the in-process levels'
token ids written as the word-level tokenizer's words, so the server computes the same
prompts.
"""
from __future__ import annotations

import filecmp
import json
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request

from client.triton_server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The load's client processes: a quarter of the cores (4 on a 16-core GPU box), one at least.
CLIENT_PROCESSES = max(1, (os.cpu_count() or 1) // 4)


def write_repository(path: str, settings: dict[str, str]) -> str:
    """A repository with `llm` only, its parameters set to `settings`."""
    repo = os.path.join(path, "repository")
    shutil.copytree(os.path.join(ROOT, "model_repository", "llm"), os.path.join(repo, "llm"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = os.path.join(repo, "llm", "config.pbtxt")
    text = open(config).read()
    for key, value in settings.items():
        text, n = re.subn(rf'(key: "{key}"\s*value: {{ string_value: )"[^"]*"', rf'\g<1>"{value}"', text)
        if n != 1:
            raise ValueError(f"llm's config.pbtxt has no parameter {key!r}")
    with open(config, "w") as f:
        f.write(text)
    return repo


def stub_venv(stub_path: str, scratch: str) -> str:
    """The bin/ of a virtual environment for the server's Python stub: stub_path's packages (a
    numpy < 2: the 2.51 stub reads BYTES inputs wrongly under numpy 2) in its site-packages, the
    packages of this Python after them (a .pth). The stub ignores PYTHONPATH; it takes its
    site-packages from the first python on PATH (../shared/PLATFORM.md)."""
    venv = os.path.join(scratch, "stub-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    shutil.copytree(stub_path, site, dirs_exist_ok=True)
    with open(os.path.join(site, "outer.pth"), "w") as f:
        f.write("\n".join([*outer_site_packages(), ROOT]) + "\n")
    check_stub_imports(os.path.join(venv, "bin", "python"), site)
    return os.path.join(venv, "bin")


def check_stub_imports(python: str, site: str, tries: int = 6) -> list[str]:
    """What the model imports, imported by the stub's packages beforehand: transformers hides
    the cause of a failed lazy import ("Could not import module 'AutoTokenizer'"), this shows it.
    A package of the outer Python that fails to import under the stub's numpy (built for
    numpy 2) is hidden from the stub (None in sys.modules: transformers then finds it absent),
    one at a time; the hidden packages are returned."""
    probe = "import numpy, torch, transformers.models.auto.tokenization_auto, backends.engine"
    hidden: list[str] = []
    for _ in range(tries):
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        if done.returncode == 0:
            return hidden
        culprit = failing_package(done.stderr, outer_site_packages())
        if culprit is None or culprit in ("numpy", "torch", "transformers", "backends") or culprit in hidden:
            break
        print(f"  stub: hiding {culprit} (it cannot be imported under the stub's numpy)", flush=True)
        hidden.append(culprit)
        with open(os.path.join(site, "hidden.pth"), "w") as f:
            f.write(f"import sys; sys.modules.update(dict.fromkeys({hidden!r}))\n")
    raise RuntimeError(f"the stub's packages cannot import the model (hidden: {hidden}): {done.stderr[-2500:]}")


def failing_package(stderr: str, site_dirs: list[str]) -> str | None:
    """The top-level package of the innermost frame in `site_dirs` outside numpy, in the first
    traceback printed (the root cause of a chain: transformers re-raises it as its own)."""
    root_cause = re.split(r"\n(?:The above exception|During handling of the above exception)", stderr)[0]
    for path in reversed(re.findall(r'File "([^"]+)"', root_cause)):
        for site_dir in site_dirs:
            if path.startswith(site_dir.rstrip("/") + "/"):
                top = path[len(site_dir.rstrip("/")) + 1:].split("/")[0]
                name = top.split(".")[0]
                if name != "numpy":
                    return name
    return None


def outer_site_packages() -> list[str]:
    import site
    return [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]


def start_server(server_dir: str, repo: str, log_path: str, stub_path: str, port: int) -> subprocess.Popen:
    """tritonserver from the trimmed wheel tree, with the environment its Python stub needs."""
    stub_dir = os.path.join(server_dir, "backends", "python")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = os.path.join(server_dir, "python_backend_stubs", version, "triton_python_backend_stub")
    here = os.path.join(stub_dir, "triton_python_backend_stub")
    if not os.path.exists(here) or not filecmp.cmp(stub, here, shallow=False):
        shutil.copy(stub, stub_dir)  # the stub of this Python
    libs = os.path.join(os.path.dirname(os.path.dirname(server_dir)), "nvidia_pytriton.libs")
    python_bin = stub_venv(stub_path, os.path.dirname(repo)) if stub_path else os.path.dirname(sys.executable)
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=f"{python_bin}:{os.environ['PATH']}",
               LD_LIBRARY_PATH=":".join([sysconfig.get_config_var("LIBDIR"), libs, stub_dir,
                                         os.environ.get("LD_LIBRARY_PATH", "")]))
    cmd = [os.path.join(server_dir, "bin", "tritonserver"), "--backend-directory", os.path.join(server_dir, "backends"),
           "--model-repository", repo, "--http-port", str(port), "--grpc-port", str(free_port()),
           "--metrics-port", str(free_port())]
    return subprocess.Popen(cmd, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_ready(server: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tritonserver exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://localhost:{port}/v2/models/llm/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"llm not ready after {timeout_s:.0f} s")


def stream_one(port: int, ids: list[int], output_tokens: int) -> dict:
    """One streamed request: its submit time, the arrival time of every response that carried
    text, and the tokens the last response counted. Reads what has arrived at once (read1),
    not a line at a time (urllib's readline over a chunked stream: 67-85 against 56-68 us of
    the client's Python a response, 2-core EPYC)."""
    body = json.dumps({"text_input": " ".join(f"t{i}" for i in ids), "max_tokens": output_tokens, "stream": True,
                       "min_tokens": output_tokens,
                       "sampling_parameters": json.dumps({"ignore_eos": True})}).encode()
    req = urllib.request.Request(f"http://localhost:{port}/v2/models/llm/generate_stream", body,
                                 {"Content-Type": "application/json"})
    t0, stamps, tokens, pending = time.perf_counter(), [], 0, b""
    with urllib.request.urlopen(req, timeout=600) as r:
        while chunk := r.read1(1 << 16):
            now = time.perf_counter()
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                if event.get("text_output"):
                    stamps.append(now)
                tokens = max(tokens, int(event.get("num_output_tokens", 0)))
    return dict(t0=t0, stamps=stamps, tokens=tokens)


_barrier = None  # a client process's: its level starts when every client process is at it


def _join_clients(barrier) -> None:
    global _barrier
    _barrier = barrier


def stream_group(port: int, prompts: list[list[int]], output_tokens: int) -> list[dict]:
    """A client process's share of a level: one thread a stream."""
    _barrier.wait()
    results: list[dict] = [None] * len(prompts)
    errors: list[str] = []

    def worker(i: int) -> None:
        try:
            results[i] = stream_one(port, prompts[i], output_tokens)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    return results


def client_pool():
    """CLIENT_PROCESSES processes that start each level together (a process waiting at the
    barrier takes no second share, so every process takes one)."""
    context = multiprocessing.get_context("spawn")
    return context.Pool(CLIENT_PROCESSES, _join_clients, (context.Barrier(CLIENT_PROCESSES),))


def run_level(pool, port: int, prompts: list[list[int]], output_tokens: int) -> dict:
    """A level's streams, all at once, spread over the client processes of `pool`: in one
    Python their reading shares one interpreter lock, and at 64 streams of a GPU's tokens
    (50-85 us of the client's Python a response) the client would measure itself
    (perf_counter is the same clock in every process)."""
    n = CLIENT_PROCESSES
    groups = pool.starmap(stream_group, [(port, prompts[i::n], output_tokens) for i in range(n)], chunksize=1)
    results = [r for group in groups for r in group]
    start = min(r["t0"] for r in results)
    wall = max(r["stamps"][-1] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    itl = [(r["stamps"][-1] - r["stamps"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return dict(tok_s=tokens / wall, tokens=tokens,
                ttft_p50_ms=1e3 * statistics.median(r["stamps"][0] - r["t0"] for r in results),
                itl_p50_ms=1e3 * statistics.median(itl))


def serve_levels(server_dir: str, checkpoint: str, settings: dict[str, str], levels: dict, output_tokens: int,
                 out: str, stub_path: str = "", name: str = "") -> dict:
    """{"STREAMSxPROMPT": figures} through tritonserver (levels: {(streams, prompt): prompts}),
    or {"error": ...} with the server log's tail. name: this run's, for its log and repository."""
    log_path = os.path.join(out, f"tritonserver{'-' + name if name else ''}.log")
    scratch = os.path.join(os.path.dirname(checkpoint), name or "served")
    os.makedirs(scratch, exist_ok=True)
    repo = write_repository(scratch, {"model_path": checkpoint, **settings})
    server, port = None, free_port()
    try:
        server = start_server(server_dir, repo, log_path, stub_path, port)
        t0 = time.perf_counter()
        wait_ready(server, port, 180)
        rows = {"load_s": time.perf_counter() - t0}
        stream_one(port, levels[min(levels)][0], 4)  # the first request of a fresh server
        with client_pool() as pool:
            for level, prompts in levels.items():
                name = "x".join(map(str, level))
                rows[name] = run_level(pool, port, prompts, output_tokens)
                print(f"  tritonserver {name}: {rows[name]}", flush=True)
        return rows
    except Exception as exc:
        tail = open(log_path).read()[-3000:] if os.path.exists(log_path) else ""
        return {"error": f"{type(exc).__name__}: {exc}", "log_tail": tail}
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)  # a server whose stub died waits out its 30 s exit timeout
            except subprocess.TimeoutExpired:
                server.kill()
