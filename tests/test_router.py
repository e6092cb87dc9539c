"""The disaggregated path through real tritonserver processes: `router` over
`prefill` and `decode` (one server, and two servers as two hosts would run it)."""
import concurrent.futures
import os
import queue
import signal
import subprocess
import time

import numpy as np
import pytest

from client.stream import build_inputs, stream_generate
from client.triton_server import TritonServer, free_port, set_parameters

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


def run_all(url: str, model: str, prompts: list[str], max_tokens: int = 32):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: stream_generate(url, model, p, max_tokens=max_tokens, chat=True), prompts))


def assert_llm_and_router_equal_transformers(server) -> None:
    """Every prompt at once through `llm` and through `router`: transformers' greedy ids;
    afterwards every engine's KV pool is whole."""
    from tests.test_server import greedy_ids
    for model in ("llm", "router"):
        for prompt, result in zip(PROMPTS, run_all(server.grpc_url, model, PROMPTS)):
            assert result.error is None and result.token_ids == greedy_ids(prompt, 32), (model, prompt[:40])
    for model in ("llm", "prefill", "decode"):
        assert server.wait_kv_full(model), model


def test_router_equals_llm_and_transformers(router_server):
    from tests.test_server import greedy_reference
    routed = run_all(router_server.grpc_url, "router", PROMPTS)
    colocated = run_all(router_server.grpc_url, "llm", PROMPTS)
    for prompt, r, c in zip(PROMPTS, routed, colocated):
        assert r.error is None and c.error is None
        assert r.token_ids == c.token_ids and r.text == c.text, prompt[:40]
        assert r.text == greedy_reference(prompt, 32)
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
    and NIXL, as two hosts would (addresses in config.pbtxt). B dies while a prompt's
    KV is on its way, then comes back on the same ports: A serves again, unrestarted."""
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
                pending = pool.submit(stream_generate, a.grpc_url, "router", LONG, max_tokens=8)
                # decode has reserved the KV and sent its destination: prefill is writing into it
                assert a.wait_metric('tandem_transferring{model="decode"}', lambda n: n >= 1, timeout_s=60)
                os.killpg(b.proc.pid, signal.SIGKILL)  # the server and its prefill engine process
                start = time.monotonic()
                result = pending.result(timeout=60)
            assert result.error, "a request whose prefill died must end with an error"
            assert time.monotonic() - start < 10, "the error must come within transfer_timeout_s"
            assert a.wait_kv_full("decode", timeout_s=15)
            assert a.alive()
            gone = stream_generate(a.grpc_url, "router", "Hi", max_tokens=4)
            assert gone.error  # no prefill any more: a clear error, not a hang
            b.start()  # same gRPC, HTTP, metrics and NIXL ports: the same address for A
            assert wait_endpoint_health(a, b.grpc_url, 1.0), "the restarted prefill server must rejoin"
            again = stream_generate(a.grpc_url, "router", PROMPTS[0], max_tokens=32, chat=True)
            assert again.error is None and again.text == ok.text
            assert a.wait_kv_full("decode") and b.wait_kv_full("prefill")


def wait_endpoint_health(server: TritonServer, endpoint: str, healthy: float, timeout_s: float = 30,
                         model: str = "router") -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metric("tandem_router_endpoint_healthy", endpoint=endpoint, model=model) == healthy:
            return True
        time.sleep(0.1)
    return False


def stub_pid(server: TritonServer, model: str) -> int:
    """The process id of a model's Python backend stub in this server."""
    found = subprocess.run(["pgrep", "-f", f"{server.repo_dir}/{model}/1/model.py"], capture_output=True, text=True)
    return int(found.stdout.split()[0])


def test_router_sends_each_token_without_waiting_for_the_next(router_server):
    """Decode is frozen (SIGSTOP) the moment the client holds token n-1, before it can compute
    token n: nothing may reach the client until decode runs again. A router that holds each
    decode response until the next one arrives has token n already and sends it at once, in
    every try; one try in three may see token n computed before the stop (a loaded machine
    can take longer than a decode step to bring token n-1 to the client)."""
    assert any(token_n_waits_for_decode(router_server) for _ in range(3)), \
        "token n reached the client while decode was stopped, in every try: the router had held it"


def token_n_waits_for_decode(server: TritonServer, n: int = 6) -> bool:
    """Whether nothing reached the client in the second decode was stopped after token n-1."""
    import tritonclient.grpc as grpcclient
    decode = stub_pid(server, "decode")
    tokens: list[int] = []
    events: queue.Queue = queue.Queue()

    def on_response(result, error):
        if error is None:
            tokens.extend(result.as_numpy("output_ids").tolist())
            if len(tokens) == n - 1:
                os.kill(decode, signal.SIGSTOP)  # within a millisecond; a decode step takes ten or more
        events.put(error)

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer("router", build_inputs("Count from one to twenty:", max_tokens=n, chat=True,
                                                         min_tokens=np.array([n], dtype=np.int32)))
        while len(tokens) < n - 1:
            assert events.get(timeout=60) is None
        assert len(tokens) == n - 1, "one response a token (an ASCII answer) makes token n-1 observable"
        time.sleep(1.0)
        waited = events.empty()
    finally:
        os.kill(decode, signal.SIGCONT)
    while len(tokens) < n:
        assert events.get(timeout=30) is None
    client.stop_stream()
    client.close()
    return waited


def channel_sockets(server: TritonServer) -> int:
    """Unix sockets named after the router stub's token channel: its listener, and each decode
    connection it accepted (backends.token_channel)."""
    from backends.triton_stream import process_identity
    name = "@tandem-tokens-" + process_identity(stub_pid(server, "router"))
    with open("/proc/net/unix") as f:
        return sum(line.rstrip().endswith(name) for line in f)


def test_decode_streams_its_tokens_by_the_router_channel(router_server):
    assert stream_generate(router_server.grpc_url, "router", "Hi", max_tokens=4).error is None
    assert channel_sockets(router_server) >= 2, "the router listens and decode's stub is connected"


def test_router_without_token_channel_streams_over_bls(default_model, tmp_path_factory):
    parameters = disagg_parameters(free_port())
    server = TritonServer(str(tmp_path_factory.mktemp("repo_bls")), models=["llm", "prefill", "decode", "router"],
                          parameters={**parameters, "router": {"token_channel": "false"}})
    with server:
        assert_llm_and_router_equal_transformers(server)
        assert channel_sockets(server) == 0


@pytest.mark.parametrize("children", ["bls", "grpc"])
def test_router_stub_crash_frees_its_childrens_kv(default_model, tmp_path_factory, children):
    """The router's stub dies (SIGSEGV) with three streams on decode: their requests on decode
    and prefill must end and give their KV back. Children over gRPC (prefill_url / decode_url
    set to this same server) see their stream cancelled when the stub's connections close;
    BLS children see that the parent process named on their requests is gone (Triton cancels
    nothing, and a send to the dead stub never returns)."""
    import tritonclient.grpc as grpcclient
    server = TritonServer(str(tmp_path_factory.mktemp(f"crash_{children}")), models=["prefill", "decode", "router"],
                          parameters=disagg_parameters(free_port()))
    if children == "grpc":
        path = os.path.join(server.repo_dir, "router", "config.pbtxt")
        with open(path) as f:
            config = set_parameters(f.read(), {"prefill_url": server.grpc_url, "decode_url": server.grpc_url})
        with open(path, "w") as f:
            f.write(config)
    with server:
        clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(3)]
        for i, client in enumerate(clients):
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("router", build_inputs(f"Tell me story number {i}.", max_tokens=400, chat=True,
                                                             min_tokens=np.array([400], dtype=np.int32)))
        assert server.wait_metric('tandem_running{model="decode"}', lambda n: n == 3, timeout_s=60)
        os.kill(stub_pid(server, "router"), signal.SIGSEGV)
        try:
            for model in ("decode", "prefill"):
                assert server.wait_kv_full(model, timeout_s=20), (model, server.kv_pages(model))
            assert server.metrics()['tandem_running{model="decode"}'] == 0
        finally:
            for client in clients:
                client.stop_stream(cancel_requests=True)
                client.close()


# ---- the conventions through `router` (issue 20): the same text_output as `llm` ---------

def test_router_stream_never_echoes_the_prompt_and_one_response_does(router_server):
    """No exclude_input_in_output: a stream carries new text only, one response the prompt too."""
    from tests.test_server import RAW_PROMPT, _flags, greedy_reference, raw_request
    new_text = greedy_reference(RAW_PROMPT, 8, chat=False)
    for flags, expected in (({"stream": True}, new_text), ({"stream": True, "exclude_input_in_output": False}, new_text),
                            ({}, RAW_PROMPT + new_text), ({"exclude_input_in_output": True}, new_text)):
        result = raw_request(router_server.grpc_url, _flags(**flags), model="router")
        assert result.error is None and result.text == expected, flags


def test_router_cut_character_and_http_equal_llm(router_server):
    """A character cut by max_tokens ends as decode shows it; HTTP generate_stream carries
    the gRPC stream's pieces; generate the whole text."""
    from tests.http_generate import generate, generate_stream
    from tests.test_server import _hf_default, greedy_ids
    tok, _ = _hf_default()
    prompt = "Describe this emoji: 🚀🙂"
    ids = greedy_ids(prompt, 12)
    for cut in [n for n in range(1, 13) if tok.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd")]:
        routed = stream_generate(router_server.grpc_url, "router", prompt, max_tokens=cut, chat=True)
        assert routed.error is None and routed.token_ids == ids[:cut], cut
        assert routed.text == tok.decode(ids[:cut], skip_special_tokens=True), cut
        assert all("\ufffd" not in piece for piece in routed.pieces[:-1])
    grpc = stream_generate(router_server.grpc_url, "router", PROMPTS[0], max_tokens=12, chat=True)
    body = {"text_input": PROMPTS[0], "max_tokens": 12, "apply_chat_template": True}
    events = generate_stream(router_server.http_port, "router", {**body, "stream": True})
    assert [e["text_output"] for e in events if "text_output" in e] == grpc.pieces
    status, answer = generate(router_server.http_port, "router", {**body, "exclude_input_in_output": True})
    assert status == 200 and answer["text_output"] == grpc.text


@pytest.mark.parametrize("tensors, message", [
    ({"text_input": ("BYTES", np.array([b"caf\xe9"], dtype=np.object_))}, "text_input is not valid UTF-8"),
    ({"text_input": ("BYTES", np.array([b"hi"], dtype=np.object_)),
      "temperature": ("FP32", np.array([np.nan], dtype=np.float32))}, "temperature must be a finite number"),
])
def test_router_refuses_bad_values_while_neighbours_stream(router_server, tensors, message):
    from tests.test_server import raw_request
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(stream_generate, router_server.grpc_url, "router", p, max_tokens=16, chat=True)
                for p in PROMPTS[:3]]
        time.sleep(0.3)
        bad = raw_request(router_server.grpc_url, tensors, model="router")
        results = [f.result(timeout=120) for f in good]
    assert bad.error is not None and message in bad.error, bad.error
    alone = run_all(router_server.grpc_url, "llm", PROMPTS[:3], max_tokens=16)
    assert [r.text for r in results] == [a.text for a in alone]
    for model in ("prefill", "decode"):
        assert router_server.wait_kv_full(model, timeout_s=15), model
