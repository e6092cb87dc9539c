"""The OpenAI-compatible service (client.openai_server) in front of a real tritonserver with
`llm` and `router`, called with the official `openai` package (and raw HTTP where the wire
format itself is the subject)."""
import http.client
import json
import os
import subprocess

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from client.stream import build_inputs, stream_events, stream_generate
from tests.openai_service import OpenAIService
from client.triton_server import DEFAULT_MODEL, ROOT, TritonServer, free_port
from tests.test_router import disagg_parameters

pytestmark = pytest.mark.server
MODELS = ["llm", "router"]
PAGED = ("llm", "prefill", "decode")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def triton(default_model, tmp_path_factory):
    server = TritonServer(str(tmp_path_factory.mktemp("repo_openai")), models=["llm", "prefill", "decode", "router"],
                          parameters=disagg_parameters(free_port()))
    with server:
        yield server


@pytest.fixture(scope="module")
def service(triton, tmp_path_factory):
    with OpenAIService(triton.grpc_url, str(tmp_path_factory.mktemp("openai") / "service.log")) as svc:
        yield svc


@pytest.fixture(autouse=True)
def pages_given_back(request):
    """Every test that reached the engines leaves every KV page free."""
    yield
    if "triton" in request.fixturenames:
        server = request.getfixturevalue("triton")
        for model in PAGED:
            assert server.wait_kv_full(model, timeout_s=15), f"{model} still holds KV pages"


@pytest.fixture(scope="module")
def api(service):
    return openai.OpenAI(base_url=service.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def test_models_lists_the_entry_models(api):
    assert sorted(m.id for m in api.models.list().data) == ["llm", "router"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_grpc(api, triton, tokenizer, model, stream):
    ref = stream_generate(triton.grpc_url, model, QUESTION, max_tokens=24, chat=True, temperature=0.0)
    assert ref.error is None
    messages = [{"role": "user", "content": QUESTION}]
    if stream:
        chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        [finish] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
        assert len(chunks) > 3   # streamed piece by piece
    else:
        out = api.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
        text, finish, usage = out.choices[0].message.content, out.choices[0].finish_reason, out.usage
    assert text == ref.text and text
    assert usage.prompt_tokens == len(chat_ids(tokenizer, messages))
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish == ref.finish_reason == ("length" if len(ref.token_ids) == 24 else "stop")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_grpc(api, triton, tokenizer, model, stream):
    prompt = "The three largest cities of Italy are"
    ref = stream_generate(triton.grpc_url, model, prompt, max_tokens=16, temperature=0.0)
    assert ref.error is None and len(ref.token_ids) == 16
    if stream:
        chunks = list(api.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        out = api.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        text, finish, usage = out.choices[0].text, out.choices[0].finish_reason, out.usage
    assert text == ref.text
    assert finish == "length"
    assert usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert usage.completion_tokens == 16


def test_multi_turn_chat_uses_the_chat_template(api, tokenizer):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Capital of Spain?"},
                {"role": "assistant", "content": "Madrid."},
                {"role": "user", "content": [{"type": "text", "text": "And of Portugal?"}]}]
    out = api.chat.completions.create(model="llm", messages=messages, max_tokens=8, temperature=0)
    flat = messages[:3] + [{"role": "user", "content": "And of Portugal?"}]
    assert out.usage.prompt_tokens == len(chat_ids(tokenizer, flat))


def test_sampling_fields_reach_the_model(api, triton):
    """seed, temperature, top_p, top_k, stop as the model takes them over gRPC: same text."""
    grpc = stream_generate(triton.grpc_url, "llm", QUESTION, max_tokens=12, chat=True, temperature=0.9,
                           top_p=np.array([0.95], dtype=np.float32), top_k=np.array([40], dtype=np.int32),
                           seed=np.array([1234], dtype=np.uint64))
    out = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                                      temperature=0.9, top_p=0.95, seed=1234, extra_body={"top_k": 40})
    assert out.choices[0].message.content == grpc.text
    # Omitted temperature is OpenAI's default, 1 (the checkpoint's generation_config sets none).
    grpc1 = stream_generate(triton.grpc_url, "llm", QUESTION, max_tokens=12, chat=True, temperature=1.0,
                            seed=np.array([99], dtype=np.uint64))
    out1 = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=12, seed=99)
    assert out1.choices[0].message.content == grpc1.text
    greedy = stream_generate(triton.grpc_url, "llm", QUESTION, max_tokens=12, chat=True, temperature=0.0).text
    word = greedy.split()[3]
    stopped = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0, stop=[word])
    assert stopped.choices[0].message.content == greedy[:greedy.index(word)]
    assert stopped.choices[0].finish_reason == "stop"


def test_penalties_and_min_p_reach_the_model(api, triton):
    """OpenAI's penalties and vLLM's repetition_penalty / min_p, as the model's tensors: the same
    text as over gRPC with those tensors, and not the plain greedy text (they took effect)."""
    plain = stream_generate(triton.grpc_url, "llm", "Count: one, two, one, two,", max_tokens=24, temperature=0.0)
    tensors = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "min_p": 0.05}
    grpc = stream_generate(triton.grpc_url, "llm", "Count: one, two, one, two,", max_tokens=24, temperature=0.0,
                           **{k: np.array([v], dtype=np.float32) for k, v in tensors.items()})
    out = api.completions.create(model="llm", prompt="Count: one, two, one, two,", max_tokens=24, temperature=0,
                                 presence_penalty=1.5, frequency_penalty=1.0,
                                 extra_body={"repetition_penalty": 1.3, "min_p": 0.05})
    assert out.choices[0].text == grpc.text != plain.text


def logprobs_over_grpc(url: str, model: str, prompt: str, max_tokens: int, top: int) -> list[dict]:
    inputs = build_inputs(prompt, max_tokens=max_tokens, chat=True, temperature=0.0,
                          return_logprobs=np.array([True]),
                          sampling_parameters=np.array([json.dumps({"logprobs": top}).encode()], dtype=np.object_))
    entries = []
    for error, outputs in stream_events(url, model, inputs):
        assert error is None, error
        if "logprobs" in outputs:
            entries += json.loads(outputs["logprobs"][0]) or []
    return entries


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_models(api, triton, model, stream):
    ref = logprobs_over_grpc(triton.grpc_url, model, QUESTION, 8, 3)
    args = dict(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0,
                logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(api.chat.completions.create(stream=True, **args))
        content = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                   for c in chunk.choices[0].logprobs.content]
    else:
        content = api.chat.completions.create(**args).choices[0].logprobs.content
    assert len(content) == len(ref) > 0
    for got, entry in zip(content, ref):
        [(own_id, own)] = list(entry.items())[:1]   # the sampled token's entry comes first
        assert (got.token, got.logprob, got.bytes) == (own["decoded_token"], own["logprob"],
                                                       list(own["decoded_token"].encode()))
        top = sorted((v for v in entry.values() if 1 <= v["rank"] <= 3), key=lambda v: v["rank"])
        assert [(t.token, t.logprob) for t in got.top_logprobs] == [(v["decoded_token"], v["logprob"]) for v in top]
        assert len(got.top_logprobs) == 3 and got.top_logprobs[0].logprob == got.logprob   # greedy: the top one


def test_completion_logprobs(api):
    out = api.completions.create(model="llm", prompt="The capital of France is", max_tokens=6, temperature=0,
                                 logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob == max(top.values()) and len(top) == 2


def test_cache_salt_and_cached_tokens(api):
    """usage.prompt_tokens_details.cached_tokens is the model's num_cached_tokens: a second request
    with the same long prompt reuses its full KV pages; one with another cache_salt does not."""
    messages = [{"role": "user", "content": "Summarize: " + " ".join(f"item {i} is blue." for i in range(40))}]
    args = dict(model="llm", messages=messages, max_tokens=2, temperature=0)
    first = api.chat.completions.create(**args, extra_body={"cache_salt": "a"}).usage
    again = api.chat.completions.create(**args, extra_body={"cache_salt": "a"}).usage
    other = api.chat.completions.create(**args, extra_body={"cache_salt": "b"}).usage
    page = 16
    assert first.prompt_tokens_details.cached_tokens == 0
    # whole pages of the prompt, never the page with its last token (it is computed, for logits)
    assert again.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // page * page > 0
    assert other.prompt_tokens_details.cached_tokens == 0


def test_min_tokens_ignore_eos_and_max_completion_tokens(api):
    out = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Say hi."}], temperature=0,
                                      max_completion_tokens=20, max_tokens=5, extra_body={"min_tokens": 20})
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"
    out = api.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Say hi."}], temperature=0,
                                      max_tokens=16, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


def test_completion_echo(api, triton):
    prompt = "Once upon a time"
    ref = stream_generate(triton.grpc_url, "llm", prompt, max_tokens=8, temperature=0.0)
    out = api.completions.create(model="llm", prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert out.choices[0].text == prompt + ref.text
    chunks = list(api.completions.create(model="llm", prompt=prompt, max_tokens=8, temperature=0, echo=True,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + ref.text


def test_stream_wire_format(service):
    """The bytes on the wire: `data: {json}` events, the usage chunk last, then `data: [DONE]`."""
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=60)
    body = {"model": "router", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    conn.close()
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(c["usage"] is None for c in chunks[:-1])


def error_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.response.json()
    assert "Traceback" not in info.value.response.text
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return info.value.status_code, body["error"]


def chat(api, **kwargs):
    args = {"model": "llm", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **kwargs}
    return lambda: api.chat.completions.create(**args)


def test_unknown_model_is_404(api):
    status, err = error_of(chat(api, model="gpt-4o"))
    assert status == 404 and err["code"] == "model_not_found" and "gpt-4o" in err["message"]
    status, err = error_of(lambda: api.completions.create(model="prefill", prompt="x", max_tokens=2))
    assert status == 404   # an engine behind the router, not an entry point


@pytest.mark.parametrize("field, value", [("n", 2), ("tools", [{"type": "function", "function": {"name": "f"}}]),
                                          ("tool_choice", "required"), ("response_format", {"type": "json_object"}),
                                          ("logit_bias", {"1": 5}), ("modalities", ["text", "audio"])])
def test_unsupported_fields_are_refused_by_name(api, field, value):
    status, err = error_of(chat(api, **{field: value}))
    assert status == 400 and err["param"] == field and field in err["message"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_parameter"


def test_inconsistent_fields_are_400(api):
    status, err = error_of(chat(api, top_logprobs=2))
    assert status == 400 and err["param"] == "top_logprobs"
    status, err = error_of(chat(api, stream_options={"include_usage": True}))
    assert status == 400 and err["param"] == "stream_options"
    status, err = error_of(lambda: api.completions.create(model="llm", prompt="x", best_of=3))
    assert status == 400 and err["param"] == "best_of"


def test_neutral_values_of_unsupported_fields_pass(api):
    """What LangChain and others send by default: n=1, zero penalties, logprobs false."""
    out = chat(api, n=1, presence_penalty=0, frequency_penalty=0, logprobs=False, tool_choice="none")()
    assert out.choices[0].message.content


def test_unknown_and_malformed_fields_are_400(api, service):
    status, err = error_of(chat(api, extra_body={"temprature": 0.5}))
    assert status == 400 and err["param"] == "temprature" and "Unrecognized request argument" in err["message"]
    status, err = error_of(chat(api, max_tokens="many"))
    assert status == 400 and err["param"] == "max_tokens"
    status, err = error_of(lambda: api.chat.completions.create(model="llm", messages=[]))
    assert status == 400 and err["param"] == "messages"
    status, err = error_of(lambda: api.completions.create(model="llm", prompt=[1, 2, 3]))
    assert status == 400 and err["param"] == "prompt"
    conn = http.client.HTTPConnection("127.0.0.1", service.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", "{not json", {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and "error" in json.loads(resp.read())
    conn.close()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [False, True])
def test_model_refusals_are_400_with_the_models_message(api, model, stream):
    status, err = error_of(chat(api, model=model, max_tokens=0, stream=stream))
    assert status == 400 and "max_tokens must be >= 1" in err["message"]
    status, err = error_of(chat(api, model=model, temperature=-1, stream=stream))
    assert status == 400 and "temperature must be >= 0" in err["message"]
    long = [{"role": "user", "content": "word " * 3000}]
    status, err = error_of(chat(api, model=model, messages=long, stream=stream))
    assert status == 400 and "context" in err["message"]


def test_server_down_is_503(tmp_path):
    with OpenAIService(f"127.0.0.1:{free_port()}", str(tmp_path / "service.log")) as down:
        api = openai.OpenAI(base_url=down.base_url, api_key="unused", max_retries=0, timeout=30)
        status, err = error_of(chat(api))
        assert status == 503 and "not reachable" in err["message"]
        status, _ = error_of(lambda: api.models.list())
        assert status == 503


def streaming_request(port: int, model: str, stream: bool) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 1500, "min_tokens": 1500, "temperature": 0, "stream": stream}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_frees_kv(api, service, triton, model, stream):
    """A client that goes away mid-generation (1500 tokens: tens of seconds here) cancels its
    request: the engines' pages come back within seconds, and the service keeps serving."""
    engine = "llm" if model == "llm" else "decode"
    conn = streaming_request(service.port, model, stream)
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        for _ in range(5):
            assert resp.readline().startswith(b"data: ")
            assert resp.readline() == b"\n"
    assert triton.wait_kv_used(engine, timeout_s=30)
    conn.sock.shutdown(2)
    conn.close()
    for name in ((engine,) if model == "llm" else ("prefill", "decode")):
        assert triton.wait_kv_full(name, timeout_s=10), f"{name} kept the KV of a request whose client left"
    assert chat(api, model=model)().choices[0].message.content


def test_genai_perf_chat_endpoint(service, default_model, tmp_path):
    tokens = 8
    binary = os.path.join(ROOT, ".venv", "bin")
    out = subprocess.run([os.path.join(binary, "genai-perf"), "profile", "-m", "llm", "--endpoint-type", "chat",
                          "--streaming", "-u", f"127.0.0.1:{service.port}", "--tokenizer", default_model,
                          "--synthetic-input-tokens-mean", "16", "--output-tokens-mean", str(tokens),
                          "--extra-inputs", f"min_tokens:{tokens}", "--extra-inputs", "temperature:0",
                          "--concurrency", "2", "--request-count", "4", "--warmup-request-count", "0",
                          "--artifact-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PATH": binary + os.pathsep + os.environ["PATH"]})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [run_dir] = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("llm-")]
    summary = json.loads((run_dir / "profile_export_genai_perf.json").read_text())
    osl = summary["output_sequence_length"]
    assert (osl["min"], osl["avg"], osl["max"]) == (tokens, tokens, tokens)
    assert summary["request_count"]["avg"] == 4
