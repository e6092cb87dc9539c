"""The disaggregated path through real tritonserver processes: `router` over
`prefill` and `decode` (one server, and two servers as two hosts would run it)."""
import concurrent.futures
import os
import queue
import signal
import time

import numpy as np
import pytest

from client.stream import build_inputs, stream_generate
from tests.server import TritonServer, free_port

pytestmark = pytest.mark.server
ENGINE = {"max_context": "2048", "num_pages": "256", "chunk_size": "256", "max_batch_tokens": "256"}
LONG = "Summarize the following text. " + " ".join(f"Item {i} is a {'red' if i % 2 else 'blue'} box." for i in range(120))
PROMPTS = ["What is the capital of France?", "Écris un mot.", "東京はどこ？", LONG, "Count to five:"]


def disagg_parameters(nixl_port: int, timeout_s: str = "20") -> dict:
    knobs = {"pipeline_min_tokens": "128", "transfer_timeout_s": timeout_s, "handshake_timeout_s": "5"}
    return {"prefill": {**ENGINE, **knobs, "nixl_port": str(nixl_port)},
            "decode": {**ENGINE, **knobs, "prefill_address": f"127.0.0.1:{nixl_port}"},
            "llm": ENGINE}


@pytest.fixture(scope="module")
def router_server(default_model, tmp_path_factory):
    server = TritonServer(str(tmp_path_factory.mktemp("repo_router")), models=["llm", "prefill", "decode", "router"],
                          parameters=disagg_parameters(free_port()))
    with server:
        yield server


def run_all(url: str, model: str, prompts: list[str]):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: stream_generate(url, model, p, max_tokens=32, chat=True), prompts))


def test_router_equals_llm_and_transformers(router_server):
    from tests.test_server import greedy_reference
    routed = run_all(router_server.grpc_url, "router", PROMPTS)
    colocated = run_all(router_server.grpc_url, "llm", PROMPTS)
    for prompt, r, c in zip(PROMPTS, routed, colocated):
        assert r.error is None and c.error is None
        assert r.token_ids == c.token_ids and r.text == c.text, prompt[:40]
        assert r.text == greedy_reference(prompt, 32).rstrip("\ufffd")
        assert len(r.pieces) > 1
    for model in ("prefill", "decode"):
        assert router_server.wait_kv_full(model)
    assert router_server.metrics()['tandem_kv_bytes_sent{model="prefill"}'] > 0


def test_router_cancel_frees_kv_on_both_sides(router_server):
    import tritonclient.grpc as grpcclient
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(router_server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer("router", build_inputs("Tell me a long story.", max_tokens=400, chat=True,
                                                     min_tokens=np.array([400], dtype=np.int32)))
    for _ in range(3):
        assert events.get(timeout=60)[1] is None
    client.stop_stream(cancel_requests=True)
    client.close()
    for model in ("prefill", "decode"):
        assert router_server.wait_kv_full(model, timeout_s=15), model
    assert stream_generate(router_server.grpc_url, "router", "Hi", max_tokens=4).error is None


def test_router_bad_input(router_server):
    too_long = stream_generate(router_server.grpc_url, "router", "word " * 3000, max_tokens=4)
    assert too_long.error and "context" in too_long.error
    bad = stream_generate(router_server.grpc_url, "router", "x", max_tokens=0)
    assert bad.error and "max_tokens" in bad.error
    for model in ("prefill", "decode"):
        assert router_server.wait_kv_full(model, timeout_s=15), model
    assert stream_generate(router_server.grpc_url, "router", "Hi", max_tokens=4).error is None


def test_two_servers_and_a_prefill_killed_mid_transfer(default_model, tmp_path_factory):
    """Server B runs prefill; server A runs router + decode and reaches B over gRPC
    and NIXL, as two hosts would (addresses in config.pbtxt)."""
    nixl_port = free_port()
    params = disagg_parameters(nixl_port, timeout_s="10")
    b = TritonServer(str(tmp_path_factory.mktemp("host_b")), models=["prefill"], parameters=params)
    with b:
        a_params = {**params, "router": {"prefill_url": b.grpc_url}}
        a = TritonServer(str(tmp_path_factory.mktemp("host_a")), models=["decode", "router"], parameters=a_params)
        with a:
            ok = stream_generate(a.grpc_url, "router", PROMPTS[0], max_tokens=32, chat=True)
            assert ok.error is None and "Paris" in ok.text
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(stream_generate, a.grpc_url, "router", LONG * 3, max_tokens=8)
                time.sleep(0.3)  # the long prompt is in prefill now
                os.killpg(b.proc.pid, signal.SIGKILL)  # the server and its prefill engine process
                start = time.monotonic()
                result = pending.result(timeout=60)
            assert result.error, "a request whose prefill died must end with an error"
            assert time.monotonic() - start < 15
            assert a.wait_kv_full("decode", timeout_s=15)
            assert a.alive()
            after = stream_generate(a.grpc_url, "router", "Hi", max_tokens=4)
            assert after.error  # no prefill any more: a clear error, not a hang
