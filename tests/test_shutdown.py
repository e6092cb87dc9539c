"""A server that stops when told: SIGTERM to tritonserver with the default repository (its
four models, the NIXL port moved to a free one) exits within 5 s with every model unloaded,
right after load and after serving, cycle after cycle; and after serving with the router's
health checks at their fastest."""
import os
import signal
import subprocess
import time

import pytest

from client.stream import stream_generate
from client.triton_server import TritonServer, free_port

pytestmark = pytest.mark.server
MODELS = ["llm", "prefill", "decode", "router"]
CYCLES = 10
EXIT_S = 5.0


def repository(tmp_path, router: dict[str, str] | None = None) -> TritonServer:
    port = free_port()
    return TritonServer(str(tmp_path), models=MODELS,
                        parameters={"prefill": {"nixl_port": str(port)},
                                    "decode": {"prefill_address": f"127.0.0.1:{port}"}, "router": router or {}})


def stop(server: TritonServer) -> float:
    """SIGTERM, then the seconds until the server has exited. A server still up after EXIT_S
    has its stubs write every thread's stack to its log (SIGUSR1, faulthandler)."""
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=EXIT_S)
    except subprocess.TimeoutExpired:
        stubs = subprocess.run(["pgrep", "-g", str(server.proc.pid), "-f", "triton_python_backend_stub"],
                               capture_output=True, text=True).stdout.split()
        for pid in stubs:
            os.kill(int(pid), signal.SIGUSR1)
        try:
            server.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
    took = time.monotonic() - start
    server.stop()   # reaps whatever is left if it hung
    server.log.close()
    return took


@pytest.mark.parametrize("cycle", range(CYCLES))
def test_sigterm_unloads_every_model_within_5_s(default_model, tmp_path, cycle):
    server = repository(tmp_path)
    server.start()
    if cycle % 2:  # odd cycles serve first; even ones stop right after load
        for model in ("llm", "router"):
            assert stream_generate(server.grpc_url, model, "Hi", max_tokens=4).error is None
    took = stop(server)
    log = open(server.log_path, errors="replace").read()
    unloaded = [m for m in MODELS if f"successfully unloaded '{m}'" in log]
    assert unloaded == MODELS and "Exit timeout expired" not in log, log[-12000:]
    assert server.proc.returncode == 0 and took < EXIT_S, f"exit took {took:.1f} s, rc {server.proc.returncode}"


@pytest.mark.parametrize("cycle", range(4))
def test_sigterm_after_serving_with_health_checks_every_20_ms(default_model, tmp_path, cycle):
    """When the router's health thread sent its local models checks (describe), one sent as the
    server began to stop was never answered, and tritonserver crashed unloading the router
    (Signal 11) in 5 of 8 such stops at this interval; local models are now checked on the
    request path only."""
    server = repository(tmp_path, router={"health_interval_s": "0.02"})
    server.start()
    assert stream_generate(server.grpc_url, "router", "Hi", max_tokens=4).error is None
    time.sleep(0.3 + 0.1 * cycle)   # the stop at a different point of the checks' 20 ms rounds each cycle
    took = stop(server)
    log = open(server.log_path, errors="replace").read()
    unloaded = [m for m in MODELS if f"successfully unloaded '{m}'" in log]
    assert unloaded == MODELS and "Signal (" not in log.split("Signal (15)")[-1], log[-12000:]
    assert server.proc.returncode == 0 and took < EXIT_S, f"exit took {took:.1f} s, rc {server.proc.returncode}"
