"""The OpenAI-compatible service (python -m client.openai_server) as a real process on a free port."""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

from client.triton_server import ROOT, free_port


class OpenAIService:
    def __init__(self, grpc_url: str, log_path: str, ready_timeout_s: float = 120):
        self.grpc_url, self.log_path, self.ready_timeout_s = grpc_url, log_path, ready_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "OpenAIService":
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "client.openai_server", "--url", self.grpc_url,
                                      "--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.ready_timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI service exited ({self.proc.returncode}):\n{self.log_tail()}")
            if self._listening():
                return self
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the OpenAI service did not start in {self.ready_timeout_s}s:\n{self.log_tail()}")

    def _listening(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                return True
        except urllib.error.HTTPError:
            return True   # it answers (the Triton server behind it may be down: 503)
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
