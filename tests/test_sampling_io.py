"""Sampling fields at the door: every vLLM key and TensorRT-LLM tensor either taken with its
meaning or refused with a message naming it; the logprob outputs in both conventions."""
import json

import numpy as np
import pytest

from backends.request import InvalidRequest, RequestOutput
from backends.triton_io import (FIXED_KEYS, JSON_KEYS, OUTPUTS, output_arrays, parse_request, parse_vllm_logprobs,
                                vllm_logprobs_json)
from backends.triton_stream import ResponseStream
from tests.test_triton_io import getter


def sp(**keys):
    return parse_request(getter(text_input="hi", sampling_parameters=json.dumps(keys)), 16)


def test_every_vllm_key_is_taken():
    p = sp(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty="0.25", min_p=0.1,
           stop_token_ids=[5, "7"], include_stop_str_in_output="true", skip_special_tokens=False, logprobs=3,
           n=1, best_of=None, detokenize=True, spaces_between_special_tokens=True, prompt_logprobs=None,
           use_beam_search=False, top_k=-1).params
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p) == (1.2, -0.5, 0.25, 0.1)
    assert (p.stop_token_ids, p.include_stop_str_in_output, p.skip_special_tokens, p.logprobs) == ((5, 7), True,
                                                                                                     False, 3)
    assert p.top_k == 0 and p.penalised   # vLLM's top_k -1 is "no limit"


@pytest.mark.parametrize("keys, message", [
    ({"temprature": 0.5}, r"sampling_parameters\.temprature is not supported by Tandem"),
    ({"logit_bias": {"5": 1}}, r"sampling_parameters\.logit_bias is not supported"),
    ({"guided_decoding": {}}, r"sampling_parameters\.guided_decoding is not supported"),
    ({"n": 2}, r"sampling_parameters\.n must be 1 \(Tandem returns one sequence per request\), got 2"),
    ({"best_of": 3}, r"sampling_parameters\.best_of must be 1"),
    ({"use_beam_search": True}, r"use_beam_search must be false"),
    ({"prompt_logprobs": 1}, r"prompt_logprobs must be null \(prompt logprobs are not computed\)"),
    ({"detokenize": False}, r"detokenize must be true"),
    ({"spaces_between_special_tokens": False}, r"spaces_between_special_tokens must be true"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be > 0, got 0"),
    ({"repetition_penalty": "NaN"}, r"repetition_penalty must be a finite number"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": "Infinity"}, r"frequency_penalty must be a finite number"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"min_p": "much"}, r"sampling_parameters\.min_p must be a float"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"logprobs": True}, r"sampling_parameters\.logprobs must be a int"),
    ({"logprobs": 1.5}, r"sampling_parameters\.logprobs must be a int"),
    ({"stop_token_ids": 5}, r"stop_token_ids must be a list of ints"),
    ({"stop_token_ids": [-1]}, r"stop_token_ids must be token ids"),
    ({"stop_token_ids": ["x"]}, r"stop_token_ids must be a list of ints"),
    ({"stop": [1]}, r"sampling_parameters\.stop must be a list of strings"),
    ({"ignore_eos": "maybe"}, r"sampling_parameters\.ignore_eos must be a bool"),
    ({"skip_special_tokens": 2}, r"skip_special_tokens must be a bool"),
])
def test_a_bad_or_unknown_key_is_refused_by_name(keys, message):
    with pytest.raises(InvalidRequest, match=message):
        sp(**keys)


def test_the_refusal_lists_what_is_supported():
    with pytest.raises(InvalidRequest) as exc:
        sp(lora_name="x")
    assert all(key in str(exc.value) for key in (*JSON_KEYS, *FIXED_KEYS))


def test_trtllm_tensors():
    r = parse_request(getter(text_input="hi", repetition_penalty=np.float32(1.5), presence_penalty=np.float32(0.5),
                             frequency_penalty=np.float32(-1), min_p=np.float32(0.2), random_seed=np.uint64(9),
                             beam_width=np.int32(1), return_log_probs=True), 16)
    p = r.params
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.seed) == (1.5, 0.5, -1.0, 9)
    assert p.min_p == pytest.approx(0.2) and p.logprobs == 0
    assert r.logprob_outputs == ("output_log_probs", "cum_log_probs")
    assert r.wanted(()) == OUTPUTS + ("output_log_probs", "cum_log_probs")
    assert r.wanted(("text_output",)) == ("text_output",)


@pytest.mark.parametrize("tensors, message", [
    ({"beam_width": np.int32(4)}, r"input 'beam_width' must be 1 \(Tandem does not search beams\), got 4"),
    ({"repetition_penalty": np.float32(-1)}, "repetition_penalty must be > 0"),
    ({"min_p": np.float32("nan")}, "min_p must be a finite number"),
    ({"presence_penalty": np.float32(9)}, r"presence_penalty must be in \[-2, 2\]"),
])
def test_bad_trtllm_tensors_are_refused_by_name(tensors, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(getter(text_input="hi", **tensors), 16)


def test_vllm_flags_follow_the_vllm_backend():
    """return_logprobs without sampling_parameters.logprobs sends null (nothing computed);
    return_cumulative_logprob computes the sampled tokens' logprobs."""
    r = parse_request(getter(text_input="hi", return_logprobs=True), 16)
    assert r.params.logprobs is None and r.logprob_outputs == ("logprobs",)
    r = parse_request(getter(text_input="hi", return_logprobs=True, return_cumulative_logprob=True,
                             sampling_parameters='{"logprobs": 2}'), 16)
    assert r.params.logprobs == 2 and r.logprob_outputs == ("logprobs", "cumulative_logprob")
    assert parse_request(getter(text_input="hi", return_cumulative_logprob=True), 16).params.logprobs == 0


LOGPROBS = [{7: (-0.25, 1, " a")}, {9: (-2.0, 3, "b"), 4: (-0.5, 1, "c"), 1: (-1.0, 2, "<s>")}]


def test_logprob_outputs_in_both_conventions():
    arrays = output_arrays("ab", [7, 9], None, 3, 2, ("output_log_probs", "cum_log_probs", "logprobs",
                                                      "cumulative_logprob"), LOGPROBS, -2.25)
    assert arrays["output_log_probs"].dtype == np.float32 and arrays["output_log_probs"].tolist() == [[-0.25, -2.0]]
    assert arrays["cum_log_probs"].tolist() == [-2.25] and arrays["cumulative_logprob"].tolist() == [-2.25]
    data = json.loads(arrays["logprobs"][0])
    assert data == [{"7": {"logprob": -0.25, "rank": 1, "decoded_token": " a"}},
                    {"9": {"logprob": -2.0, "rank": 3, "decoded_token": "b"},
                     "4": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
                     "1": {"logprob": -1.0, "rank": 2, "decoded_token": "<s>"}}]
    assert parse_vllm_logprobs(arrays["logprobs"][0].decode()) == LOGPROBS
    assert vllm_logprobs_json(None) == "null" and parse_vllm_logprobs("null") is None


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append(response)


class PB:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.tensors = {t.name: t.array for t in output_tensors}


@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_sums_the_cumulative_logprob_and_gathers_a_whole_response(stream):
    req = parse_request(getter(text_input="hi", stream=stream, return_log_probs=True, return_logprobs=True,
                               sampling_parameters='{"logprobs": 2}'), 16)
    sender = Sender()
    out = ResponseStream(PB, sender, req, req.wanted(()), lambda _id: None)
    out(RequestOutput("r", " a", [7], logprobs=LOGPROBS[:1]))
    out(RequestOutput("r", "b", [9], finished=True, finish_reason="length", logprobs=LOGPROBS[1:]))
    got = [r.tensors for r in sender.sent]
    if stream:
        assert [g["output_log_probs"].tolist() for g in got] == [[[-0.25]], [[-2.0]]]
        assert [g["cum_log_probs"].tolist() for g in got] == [[-0.25], [-2.25]]
        assert [parse_vllm_logprobs(g["logprobs"][0].decode()) for g in got] == [LOGPROBS[:1], LOGPROBS[1:]]
    else:
        [whole] = got
        assert whole["output_log_probs"].tolist() == [[-0.25, -2.0]] and whole["cum_log_probs"].tolist() == [-2.25]
        assert parse_vllm_logprobs(whole["logprobs"][0].decode()) == LOGPROBS
