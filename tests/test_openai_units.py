"""The OpenAI service's parts without a server: request -> tensors, pieces -> bodies and events
(the model's side faked by plain iterators)."""
import asyncio
import json

import numpy as np
import pytest

from client.openai_server.app import events
from client.openai_server.errors import APIError
from client.openai_server.format import ChatFormat, CompletionFormat, Totals
from client.openai_server.protocol import ChatCompletionRequest, CompletionRequest
from client.openai_server.translate import Defaults, logprobs_wanted, model_inputs
from client.openai_server.upstream import EntryModel, Piece, _model_error

FULL = EntryModel("llm", frozenset({"text_input", "max_tokens", "temperature", "top_p", "top_k", "seed",
                                    "presence_penalty", "return_logprobs", "sampling_parameters"}),
                  frozenset({"text_output", "logprobs"}), 0)
BARE = EntryModel("old", frozenset({"text_input", "max_tokens", "temperature"}), frozenset({"text_output"}), 0)


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="llm", messages=[{"role": "user", "content": "hi"}], **fields)


def test_neutral_values_are_not_sent_and_others_need_the_models_tensor():
    values = model_inputs(chat_request(presence_penalty=0, top_k=-1, max_completion_tokens=7, max_tokens=3),
                          "p", Defaults(), BARE, None)
    assert "presence_penalty" not in values and "top_k" not in values
    assert values["max_tokens"].tolist() == [7] and values["temperature"].tolist() == [1.0]   # OpenAI's default
    with pytest.raises(APIError) as info:
        model_inputs(chat_request(presence_penalty=0.5), "p", Defaults(), BARE, None)
    assert info.value.status == 400 and info.value.param == "presence_penalty" and "`old`" in info.value.message
    values = model_inputs(chat_request(presence_penalty=0.5, seed=2 ** 63), "p", Defaults(), FULL, None)
    assert values["presence_penalty"].dtype == np.float32 and values["seed"].tolist() == [2 ** 63]


def test_out_of_range_integers_are_refused_by_name():
    for fields, param in (({"seed": -1}, "seed"), ({"max_tokens": 2 ** 31}, "max_tokens")):
        with pytest.raises(APIError) as info:
            model_inputs(chat_request(**fields), "p", Defaults(), FULL, None)
        assert info.value.param == param


def test_logprobs_fields():
    assert logprobs_wanted(chat_request(logprobs=True, top_logprobs=4)) == 4
    assert logprobs_wanted(chat_request(logprobs=True)) == 0
    assert logprobs_wanted(chat_request(logprobs=False)) is None
    assert logprobs_wanted(CompletionRequest(model="llm", prompt="x", logprobs=0)) == 0
    with pytest.raises(APIError):
        logprobs_wanted(chat_request(logprobs=True, top_logprobs=21))
    values = model_inputs(chat_request(logprobs=True, ignore_eos=True), "p", Defaults(), FULL, 2)
    assert json.loads(values["sampling_parameters"][0]) == {"ignore_eos": True, "logprobs": 2}
    assert values["return_logprobs"].tolist() == [True]
    with pytest.raises(APIError) as info:
        model_inputs(chat_request(logprobs=True), "p", Defaults(), BARE, 0)
    assert info.value.param == "logprobs"


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    values = model_inputs(chat_request(), "p", Defaults.from_checkpoint(str(tmp_path)), FULL, None)
    assert values["temperature"].tolist() == pytest.approx([0.6]) and values["top_p"].tolist() == pytest.approx([0.9])
    values = model_inputs(chat_request(temperature=0), "p", Defaults.from_checkpoint(str(tmp_path)), FULL, None)
    assert values["temperature"].tolist() == [0.0]


def test_a_models_error_is_400_before_output_and_500_after_or_for_the_servers_faults():
    assert _model_error("llm", "max_tokens must be >= 1, got 0", started=False).status == 400
    assert _model_error("llm", "internal error: boom", started=False).status == 500
    assert _model_error("llm", "Stub process 'llm_0_0' is not healthy.", started=False).status == 500
    assert _model_error("llm", "anything", started=True).status == 500
    assert _model_error("llm", "Request for unknown model: 'llm' is not found", started=False).status == 404


async def pieces_then(error: APIError | None, *pieces: Piece):
    for piece in pieces:
        yield piece
    if error:
        raise error


def collect_events(first: Piece, rest, fmt) -> list[str]:
    async def run():
        return [e.decode() async for e in events(first, rest, fmt)]
    return asyncio.run(run())


def test_a_stream_that_fails_midway_ends_with_an_error_event_then_done():
    fmt = ChatFormat("llm", include_usage=False, top_logprobs=None)
    out = collect_events(Piece("Hel"), pieces_then(APIError(500, "decode lost its peer"), Piece("lo")), fmt)
    assert out[-1] == "data: [DONE]\n\n"
    assert json.loads(out[-2][len("data: "):]) == {"error": {"message": "decode lost its peer", "type": "server_error",
                                                             "param": None, "code": None}}
    assert [json.loads(e[6:])["choices"][0]["delta"] for e in out[:-2]] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}]


def test_usage_chunk_and_finish_reason():
    fmt = CompletionFormat("llm", include_usage=True, top_logprobs=None, echo="Say: ")
    out = collect_events(Piece("a", prompt_tokens=3, completion_tokens=1),
                         pieces_then(None, Piece("b", "length", 3, 2, cached_tokens=0)), fmt)
    chunks = [json.loads(e[6:]) for e in out[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Say: a", "b"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}


def test_whole_chat_body_has_no_cached_tokens_when_the_model_reports_none():
    totals = Totals(keep=True)
    for piece in (Piece("Hi", prompt_tokens=2, completion_tokens=1), Piece("!", "stop", 2, 2)):
        totals.add(piece)
    body = json.loads(ChatFormat("llm", False, None).whole(totals).model_dump_json())
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "stop"
