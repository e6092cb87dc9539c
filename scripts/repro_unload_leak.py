"""Upstream, not Tandem: tritonserver 2.51 with a 10-line decoupled Python model, one streamed
request, the client's stream stopped with cancel_requests=True after the final response,
then SIGTERM. Now and then the model is never finalized: the server logs "Found 1 live
models" until its exit timeout. With cancel_requests=False every model unloads.

    .venv/bin/python scripts/repro_unload_leak.py cancel 30
    .venv/bin/python scripts/repro_unload_leak.py nocancel 30
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from client.triton_server import TRITONSERVER, free_port  # noqa: E402

CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""
MODEL = """import numpy as np
import triton_python_backend_utils as pb


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sender.send(pb.InferenceResponse([pb.Tensor("OUT", np.array([1], dtype=np.int32))]))
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        print("echo finalize", flush=True)
"""


def repository(root: str) -> str:
    os.makedirs(os.path.join(root, "echo", "1"))
    with open(os.path.join(root, "echo", "config.pbtxt"), "w") as f:
        f.write(CONFIG)
    with open(os.path.join(root, "echo", "1", "model.py"), "w") as f:
        f.write(MODEL)
    return root


def one_request(port: int, cancel: bool) -> None:
    import tritonclient.grpc as grpcclient
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"localhost:{port}")
    client.start_stream(callback=lambda result, error: events.put(result))
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    client.async_stream_infer("echo", [tensor], enable_empty_final_response=True)
    while not (final := events.get(timeout=30).get_response().parameters.get("triton_final_response")) \
            or not final.bool_param:
        pass
    client.stop_stream(cancel_requests=cancel)
    client.close()


def cycle(repo: str, log_path: str, cancel: bool) -> tuple[float, bool]:
    """(seconds from SIGTERM to exit, whether the model was finalized and unloaded)."""
    http, grpc, metrics = free_port(), free_port(), free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen([TRITONSERVER, "--model-repository", repo, "--http-port", str(http), "--grpc-port",
                                   str(grpc), "--metrics-port", str(metrics), "--exit-timeout-secs", "10"],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            try:
                if urllib.request.urlopen(f"http://localhost:{http}/v2/health/ready", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        one_request(grpc, cancel)
        start = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    text = open(log_path).read()
    return time.monotonic() - start, "echo finalize" in text and "successfully unloaded 'echo'" in text


def main() -> None:
    cancel, cycles = sys.argv[1] == "cancel", int(sys.argv[2]) if len(sys.argv) > 2 else 20
    root = tempfile.mkdtemp(prefix="unload-leak-")
    repo = repository(os.path.join(root, "repo"))
    results = [cycle(repo, os.path.join(root, f"{i}.log"), cancel) for i in range(cycles)]
    stuck = [round(t, 1) for t, ok in results if not ok]
    print(f"cancel_requests={cancel}: {len(results) - len(stuck)} of {len(results)} stops unloaded the model; "
          f"the others exited after {stuck} s (exit timeout 10 s); logs in {root}")


if __name__ == "__main__":
    main()
