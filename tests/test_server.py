"""Through a real tritonserver and real gRPC: the `llm` model on the default
checkpoint against transformers, cancellation, bad input."""
import concurrent.futures
import functools
import os
import queue
import time

import numpy as np
import pytest
import torch

from client.stream import StreamResult, absorb, build_inputs, stream_events, stream_generate

pytestmark = pytest.mark.server
PROMPTS = ["What is the capital of France?", "Écris une phrase sur le café crème.",
           "東京について一文で説明してください。", "Describe this emoji: 🚀🙂", "List three colors:"]
MAX_TOKENS = 40


@functools.lru_cache(maxsize=1)
def _hf_default():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from client.triton_server import DEFAULT_MODEL
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return tok, AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def greedy_ids(prompt: str, max_tokens: int = MAX_TOKENS, chat: bool = True) -> list[int]:
    """transformers' greedy ids for the default model."""
    tok, model = _hf_default()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True) \
        if chat else tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_tokens, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def greedy_reference(prompt: str, max_tokens: int = MAX_TOKENS, chat: bool = True) -> str:
    """transformers' greedy text for the default model."""
    return _hf_default()[0].decode(greedy_ids(prompt, max_tokens, chat), skip_special_tokens=True)


@pytest.fixture(scope="module")
def hf(default_model):
    return lambda prompt, chat=True, max_tokens=MAX_TOKENS: greedy_reference(prompt, max_tokens, chat)


def test_france_is_answered_with_paris(llm_server):
    result = stream_generate(llm_server.grpc_url, "llm", PROMPTS[0], max_tokens=MAX_TOKENS, chat=True)
    assert result.error is None and "Paris" in result.text


def test_concurrent_streams_equal_transformers(llm_server, hf):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: stream_generate(llm_server.grpc_url, "llm", p, max_tokens=MAX_TOKENS,
                                                          chat=True), PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.error is None
        assert len(result.pieces) > 1, "streaming must send more than one response"
        # An output cut by max_tokens inside a multi-byte character ends as transformers'
        # decode shows it (U+FFFD), in the last response only.
        assert result.text == hf(prompt), prompt
        assert all("\ufffd" not in piece for piece in result.pieces[:-1])
    assert llm_server.wait_kv_full("llm")


def test_constant_outputs_only_on_first_and_last_response(llm_server):
    """Middle responses carry text_output and output_ids only; the counts and the finish
    reason come with the first and the last."""
    events = list(stream_events(llm_server.grpc_url, "llm", build_inputs("Count to five.", max_tokens=8, chat=True)))
    outputs = [o for error, o in events if error is None]
    assert len(outputs) == len(events) >= 3
    every = {"text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens"}
    assert set(outputs[0]) == every and set(outputs[-1]) == every
    assert all(set(o) == {"text_output", "output_ids"} for o in outputs[1:-1])
    assert int(outputs[0]["num_input_tokens"][0]) > 0 and outputs[-1]["finish_reason"][0] == b"length"
    assert int(outputs[-1]["num_output_tokens"][0]) == sum(len(o["output_ids"]) for o in outputs) == 8


def test_non_streaming_and_raw_prompt(llm_server, hf):
    result = stream_generate(llm_server.grpc_url, "llm", "The capital of Italy is", max_tokens=12,
                             stream=False, chat=False)
    assert result.error is None and len(result.pieces) == 1
    assert result.text == hf("The capital of Italy is", chat=False, max_tokens=12)
    assert result.num_output_tokens == len(result.token_ids) <= 12


def test_sampling_parameters_json(llm_server):
    sp = np.array([b'{"max_tokens":"6","min_tokens":"6","temperature":"0.7","seed":"1"}'], dtype=np.object_)
    result = stream_generate(llm_server.grpc_url, "llm", "Once upon a time", chat=False, sampling_parameters=sp)
    assert result.error is None and len(result.token_ids) == 6 and result.finish_reason == "length"


def test_cancel_mid_stream_frees_kv(llm_server):
    import tritonclient.grpc as grpcclient
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(llm_server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    inputs = build_inputs("Tell me a very long story.", max_tokens=500, chat=True,
                          min_tokens=np.array([500], dtype=np.int32))
    client.async_stream_infer("llm", inputs, enable_empty_final_response=True)
    try:
        for _ in range(3):
            result, error = events.get(timeout=60)
            assert error is None
        assert llm_server.wait_kv_used("llm")  # the request holds KV while it streams
    finally:  # a failure here must not leave the 500-token request running for the next test
        client.stop_stream(cancel_requests=True)
        client.close()
    assert llm_server.wait_kv_full("llm", timeout_s=10)
    assert stream_generate(llm_server.grpc_url, "llm", "Hi", max_tokens=4).error is None


def raw_request(url, tensors: dict, model: str = "llm") -> StreamResult:
    """Send exactly these tensors (no defaults added)."""
    import tritonclient.grpc as grpcclient
    inputs = []
    for name, (dtype, array) in tensors.items():
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    result = StreamResult()
    for error, outputs in stream_events(url, model, inputs, timeout_s=60):
        if error:
            result.error = error
            break
        absorb(result, outputs)
    return result


TEXT = ("BYTES", np.array([b"hello"], dtype=np.object_))
BAD = {
    "missing prompt": ({"max_tokens": ("INT32", np.array([4], dtype=np.int32))}, "text_input"),
    "empty prompt": ({"text_input": ("BYTES", np.array([b""], dtype=np.object_))}, "empty"),
    "wrong type": ({"text_input": TEXT, "max_tokens": ("FP32", np.array([4.0], dtype=np.float32))}, "data-type"),
    "too long": ({"text_input": ("BYTES", np.array([b"hello " * 1100], dtype=np.object_))}, "context"),
    "zero max_tokens": ({"text_input": TEXT, "max_tokens": ("INT32", np.array([0], dtype=np.int32))}, "max_tokens"),
    "negative max_tokens": ({"text_input": TEXT, "max_tokens": ("INT32", np.array([-3], dtype=np.int32))},
                            "max_tokens"),
    "bad json": ({"text_input": TEXT, "sampling_parameters": ("BYTES", np.array([b"{oops"], dtype=np.object_))},
                 "JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_error(llm_server, case):
    tensors, message = BAD[case]
    result = raw_request(llm_server.grpc_url, tensors)
    assert result.error is not None and message in result.error, result.error
    assert llm_server.wait_kv_full("llm")
    ok = stream_generate(llm_server.grpc_url, "llm", "Hi", max_tokens=3)
    assert ok.error is None and ok.token_ids


def test_client_cli(llm_server):
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "client", "--url", llm_server.grpc_url, "--max-tokens", "24",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "Paris" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "client", "--url", llm_server.grpc_url, "--model", "nope", "x"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_metrics_scrape(llm_server):
    """Engine gauges and latency histograms on Triton's metrics port."""
    stream_generate(llm_server.grpc_url, "llm", "Say hello.", max_tokens=8, chat=True)
    # the watcher observes queued latencies every 0.1 s
    assert llm_server.wait_metric('tandem_itl_seconds_count{model="llm"}', lambda n: n >= 1)
    m = llm_server.metrics()
    assert m['tandem_kv_pages_total{model="llm"}'] == 512
    assert m['tandem_ttft_seconds_count{model="llm"}'] >= 1
    assert m['tandem_itl_seconds_count{model="llm"}'] >= 1
    assert 0 < m['tandem_ttft_seconds_sum{model="llm"}'] < 60


# ---- conventions: what text_output holds, HTTP, bad values at the door ------------------

PROMPT = "What is the capital of France?"
RAW_PROMPT = "The capital of Italy is"


def _flags(**values) -> dict:
    types = {bool: "BOOL", int: "INT32", float: "FP32"}
    tensors = {"text_input": TEXT_OF(RAW_PROMPT), "max_tokens": ("INT32", np.array([8], dtype=np.int32))}
    for name, value in values.items():
        dtype = {bool: np.bool_, int: np.int32, float: np.float32}[type(value)]
        tensors[name] = (types[type(value)], np.array([value], dtype=dtype))
    return tensors


def TEXT_OF(text: str):
    return ("BYTES", np.array([text.encode()], dtype=np.object_))


@pytest.mark.parametrize("flags, with_prompt", [
    ({"stream": True}, False),
    ({"stream": True, "exclude_input_in_output": False}, False),   # ignored while streaming
    ({"stream": True, "exclude_input_in_output": True}, False),
    ({}, True),                                                     # one response: TensorRT-LLM's default
    ({"exclude_input_in_output": True}, False),
    ({"stream": False, "exclude_input_in_output": False}, True),
])
def test_text_output_per_flag_and_stream(llm_server, flags, with_prompt):
    """A stream carries new text only, whatever exclude_input_in_output says; one response
    prepends the prompt unless exclude_input_in_output is true."""
    new_text = greedy_reference(RAW_PROMPT, 8, chat=False)
    result = raw_request(llm_server.grpc_url, _flags(**flags))
    assert result.error is None and len(result.token_ids) == 8
    assert result.text == (RAW_PROMPT + new_text if with_prompt else new_text)
    assert len(result.pieces) > 1 if flags.get("stream") else len(result.pieces) == 1


def test_a_character_cut_by_max_tokens_ends_as_decode_shows_it(llm_server):
    """The last response flushes a character that max_tokens cut, so the text equals
    tokenizer.decode(ids); no earlier piece carries a broken character."""
    tok, _ = _hf_default()
    prompt = "Describe this emoji: 🚀🙂"
    ids = greedy_ids(prompt, 12)
    cut = max(n for n in range(1, 13) if tok.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd"))
    for stream in (True, False):
        result = stream_generate(llm_server.grpc_url, "llm", prompt, max_tokens=cut, chat=True, stream=stream)
        assert result.error is None and result.token_ids == ids[:cut]
        assert result.text == tok.decode(ids[:cut], skip_special_tokens=True)
        assert all("\ufffd" not in piece for piece in result.pieces[:-1])


def test_http_generate_and_generate_stream_equal_grpc(llm_server):
    """Triton's HTTP generate extension: generate_stream's events carry the same pieces as
    gRPC's stream (no prompt in the first), generate the same text in one answer."""
    from tests.http_generate import generate, generate_stream
    grpc = stream_generate(llm_server.grpc_url, "llm", PROMPT, max_tokens=12, chat=True)
    body = {"text_input": PROMPT, "max_tokens": 12, "apply_chat_template": True}
    events = generate_stream(llm_server.http_port, "llm", {**body, "stream": True})
    assert [e["text_output"] for e in events if "text_output" in e] == grpc.pieces
    assert events[-1]["finish_reason"] == grpc.finish_reason != ""
    status, answer = generate(llm_server.http_port, "llm", {**body, "exclude_input_in_output": True})
    assert status == 200 and answer["text_output"] == grpc.text
    status, answer = generate(llm_server.http_port, "llm", body)
    assert status == 200 and answer["text_output"] == PROMPT + grpc.text
    status, answer = generate(llm_server.http_port, "llm", {**body, "temperature": float("inf")})
    assert status == 400 and "temperature must be a finite number" in answer["error"]


@pytest.mark.parametrize("tensors, message", [
    ({"text_input": ("BYTES", np.array([b"caf\xe9 au lait"], dtype=np.object_))}, "text_input is not valid UTF-8"),
    ({"text_input": TEXT, "temperature": ("FP32", np.array([np.nan], dtype=np.float32))},
     "temperature must be a finite number"),
    ({"text_input": TEXT, "top_p": ("FP32", np.array([np.inf], dtype=np.float32))}, "top_p must be a finite number"),
    ({"text_input": TEXT, "end_id": ("INT32", np.array([10 ** 6], dtype=np.int32))}, "end_id 1000000 is not a token"),
])
def test_bad_values_are_refused_at_the_door_while_neighbours_stream(llm_server, tensors, message):
    """A poisoned request among live ones gets its own clear error; every other stream is exact."""
    expected = [greedy_reference(p, 16) for p in PROMPTS[:4]]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        good = [pool.submit(stream_generate, llm_server.grpc_url, "llm", p, max_tokens=16, chat=True)
                for p in PROMPTS[:4]]
        time.sleep(0.3)   # the good ones are running when the bad one arrives
        bad = pool.submit(raw_request, llm_server.grpc_url, tensors).result(timeout=60)
        results = [f.result(timeout=120) for f in good]
    assert bad.error is not None and message in bad.error, bad.error
    assert [r.text for r in results] == expected
    assert llm_server.wait_kv_full("llm")


def _segfault_lines() -> set[str] | None:
    """The kernel's segfault lines so far (None: dmesg not readable)."""
    import subprocess
    out = subprocess.run(["dmesg"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return {line for line in out.stdout.splitlines() if "]: segfault" in line}


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_stubs_exit_without_a_segfault(default_model, tmp_path):
    """Metrics freed after the stub's IPC is down crash the stub at exit (Triton 2.51):
    finalize frees them first, so a server that served and stopped leaves no segfault."""
    from client.triton_server import TritonServer
    before = _segfault_lines()
    if before is None:
        pytest.skip("dmesg is not readable here")
    engine = {"max_context": "1024", "num_pages": "256"}
    with TritonServer(str(tmp_path), models=["llm", "prefill", "decode", "router"],
                      parameters={m: engine for m in ("llm", "prefill", "decode")}) as server:
        for model in ("llm", "router", "router"):
            assert stream_generate(server.grpc_url, model, "Hi", max_tokens=4).error is None
        time.sleep(0.5)  # the watchers have set the gauges and observed the latencies
        pids = {pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _group_of(pid) == server.proc.pid}
    assert len(pids) >= 5   # the server and its four stubs
    time.sleep(1)
    new = _segfault_lines() - before   # new lines only: a pid may be one an old, crashed process had
    assert [line for line in new if any(f"[{pid}]: segfault" in line for pid in pids)] == []
