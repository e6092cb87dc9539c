"""Penalties, stop ids and logprobs through a real tritonserver, for `llm` and `router`, in
both conventions (TensorRT-LLM tensors, the vLLM backend's sampling_parameters and flags),
against transformers on the default checkpoint; unknown keys refused by name."""
import functools
import json

import numpy as np
import pytest
import torch

from client.stream import build_inputs, stream_events
from client.triton_server import TritonServer, free_port
from tests.test_router import disagg_parameters

pytestmark = pytest.mark.server
PROMPT = "List three colors and then list them again:"
MAX_TOKENS = 24
MODELS = ["llm", "router"]


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    server = TritonServer(str(tmp_path_factory.mktemp("repo_sampling")), models=["llm", "prefill", "decode", "router"],
                          parameters=disagg_parameters(free_port()))
    with server:
        yield server


@functools.lru_cache(maxsize=1)
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from client.triton_server import DEFAULT_MODEL
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    return tok, AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def prompt_ids() -> list[int]:
    return hf()[0].apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)


@functools.lru_cache(maxsize=None)
def reference(repetition_penalty: float = 1.0) -> list[int]:
    tok, model = hf()
    ids = prompt_ids()
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=tok.eos_token_id,
                         repetition_penalty=repetition_penalty)
    return out[0, len(ids):].tolist()


def reference_logprobs(tokens: list[int]) -> torch.Tensor:
    ids = prompt_ids()
    with torch.no_grad():
        logits = hf()[1](torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
    return logits.log_softmax(-1)


def run(server, model: str, **extra) -> tuple[str | None, list[dict]]:
    inputs = build_inputs(PROMPT, max_tokens=MAX_TOKENS, chat=True, **extra)
    responses = []
    for error, outputs in stream_events(server.grpc_url, model, inputs, timeout_s=120):
        if error:
            return error, responses
        responses.append(outputs)
    return None, responses


def ids_of(responses: list[dict]) -> list[int]:
    return [int(t) for r in responses for t in r.get("output_ids", [])]


@pytest.mark.parametrize("model", MODELS)
def test_trtllm_repetition_penalty_and_log_probs(server, model):
    """repetition_penalty as a tensor: greedy ids equal transformers'; output_log_probs of
    every new token within 1e-4 of transformers' log-softmax, cum_log_probs their sum."""
    expected = reference(1.3)
    assert expected != reference(), "the penalty must change this run for the test to mean anything"
    error, responses = run(server, model, repetition_penalty=np.array([1.3], dtype=np.float32),
                           return_log_probs=np.array([True]))
    assert error is None
    assert ids_of(responses) == expected
    logprobs = [v for r in responses for v in r["output_log_probs"].reshape(-1).tolist()]
    want = reference_logprobs(expected).gather(1, torch.tensor(expected)[:, None])[:, 0]
    assert len(logprobs) == len(expected) and torch.allclose(torch.tensor(logprobs), want, atol=1e-4)
    assert all(r["output_log_probs"].shape == (1, len(r["output_ids"])) for r in responses)
    assert responses[-1]["cum_log_probs"][0] == pytest.approx(sum(logprobs), abs=1e-3)


@pytest.mark.parametrize("model", MODELS)
def test_vllm_keys_and_logprobs(server, model):
    """The same through sampling_parameters: the top 3 per token as the vLLM backend sends
    them (JSON per response, the new tokens only), cumulative_logprob their sum."""
    expected = reference(1.3)
    params = json.dumps({"repetition_penalty": 1.3, "logprobs": 3, "n": 1, "top_k": -1})
    error, responses = run(server, model, sampling_parameters=np.array([params.encode()], dtype=np.object_),
                           return_logprobs=np.array([True]), return_cumulative_logprob=np.array([True]))
    assert error is None and ids_of(responses) == expected
    entries = [e for r in responses for e in json.loads(r["logprobs"][0])]
    assert all(len(json.loads(r["logprobs"][0])) == len(r["output_ids"]) for r in responses)
    ref = reference_logprobs(expected)
    tok = hf()[0]
    for row, token, entry in zip(ref, expected, entries):
        assert list(entry)[0] == str(token)
        assert abs(entry[str(token)]["logprob"] - row[token].item()) < 1e-4
        top = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] <= 3 and int(t) in row.topk(3).indices)
        assert [t for _, t in top] == row.topk(3).indices.tolist()
        assert all(v["decoded_token"] == tok.decode([int(t)]) for t, v in entry.items())
    total = sum(e[str(t)]["logprob"] for e, t in zip(entries, expected))
    assert responses[-1]["cumulative_logprob"][0] == pytest.approx(total, abs=1e-3)


@pytest.mark.parametrize("model", MODELS)
def test_stop_token_ids(server, model):
    plain = reference()
    at = next(i for i, t in enumerate(plain) if i >= 3 and t not in plain[:i] and hf()[0].decode([t]).strip())
    params = json.dumps({"stop_token_ids": [plain[at]]})
    error, responses = run(server, model, sampling_parameters=np.array([params.encode()], dtype=np.object_))
    assert error is None and ids_of(responses) == plain[:at + 1]
    assert responses[-1]["finish_reason"][0] == b"stop"
    text = "".join(r["text_output"][0].decode() for r in responses)
    assert text == hf()[0].decode(plain[:at], skip_special_tokens=True)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("keys, message", [
    ({"temprature": 0.5}, "sampling_parameters.temprature is not supported by Tandem"),
    ({"n": 2}, "sampling_parameters.n must be 1"),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
])
def test_unknown_keys_and_n_are_refused_by_name(server, model, keys, message):
    error, responses = run(server, model, sampling_parameters=np.array([json.dumps(keys).encode()], dtype=np.object_))
    assert error is not None and message in error and not responses, error
    assert run(server, model)[0] is None   # and the model serves the next request


def test_a_bad_tensor_is_refused_by_name(server):
    error, _ = run(server, "llm", beam_width=np.array([2], dtype=np.int32))
    assert error is not None and "beam_width' must be 1" in error
    error, _ = run(server, "router", repetition_penalty=np.array([0.0], dtype=np.float32))
    assert error is not None and "repetition_penalty must be > 0" in error
