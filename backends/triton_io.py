"""Triton request tensors <-> engine requests, without importing Triton.

The tensor names are those of Triton's TensorRT-LLM ensemble (`text_input`,
`max_tokens`, `stream`, ... -> `text_output`, ...); the vLLM backend's
`sampling_parameters` JSON is accepted too (genai-perf sends its numbers as
strings). Explicit tensors win over the JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from backends.request import InvalidRequest, SamplingParams

# TensorRT-LLM-style input tensor -> (SamplingParams field, python type)
SCALAR_INPUTS = {
    "max_tokens": ("max_tokens", int),
    "min_tokens": ("min_tokens", int),
    "min_length": ("min_tokens", int),   # TensorRT-LLM's name, sent by genai-perf
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "seed": ("seed", int),
    "random_seed": ("seed", int),        # TensorRT-LLM's name
    "end_id": ("end_id", int),
    "repetition_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}
# vLLM sampling_parameters key -> python type (each is the SamplingParams field of its name)
JSON_KEYS = {"max_tokens": int, "min_tokens": int, "temperature": float, "top_k": int, "top_p": float,
             "min_p": float, "seed": int, "ignore_eos": bool, "stop": str, "stop_token_ids": int,
             "include_stop_str_in_output": bool, "skip_special_tokens": bool, "repetition_penalty": float,
             "presence_penalty": float, "frequency_penalty": float, "logprobs": int}
LIST_KEYS = {"stop", "stop_token_ids"}   # a list of their type (stop: a single string too)
# vLLM keys taken only at the value that is what Tandem does (null means that value too)
FIXED_KEYS = {"n": (1, "Tandem returns one sequence per request"),
              "best_of": (1, "Tandem returns one sequence per request"),
              "use_beam_search": (False, "Tandem does not search beams"),
              "detokenize": (True, "Tandem always returns text"),
              "spaces_between_special_tokens": (True, "Tandem decodes with the fast tokenizer's spacing"),
              "prompt_logprobs": (None, "prompt logprobs are not computed")}
# input flag -> the outputs it turns on: TensorRT-LLM's, then the vLLM backend's
LOGPROB_FLAGS = {"return_log_probs": ("output_log_probs", "cum_log_probs"),
                 "return_logprobs": ("logprobs",),
                 "return_cumulative_logprob": ("cumulative_logprob",)}
OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens", "num_cached_tokens")
# in every streamed response; the rest in the first and last
LOGPROB_OUTPUTS = ("output_log_probs", "cum_log_probs", "logprobs", "cumulative_logprob")
PER_TOKEN_OUTPUTS = ("text_output", "output_ids", "output_log_probs", "cum_log_probs", "logprobs", "cumulative_logprob")


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    chat: bool
    room: int | None = None   # bootstrap room, set by the router for prefill and decode
    logprob_outputs: tuple[str, ...] = ()   # the logprob outputs its flags turned on
    cache_salt: bytes | None = None   # prompts of different salts never share cached KV (vLLM's name)
    prefill_agent: str | None = None  # decode: "name@host:port", the prefill NIXL agent the router paired it with

    def wanted(self, requested: tuple[str, ...]) -> tuple[str, ...]:
        """The outputs to send: those the client named (Triton names every output when the client
        names none), else the usual ones; a logprob output only where its flag turned it on, as
        the vLLM and TensorRT-LLM backends gate them."""
        names = requested or OUTPUTS + self.logprob_outputs
        return tuple(n for n in names if n not in LOGPROB_OUTPUTS or n in self.logprob_outputs)


def control_room(get: Callable[[str], np.ndarray | None]) -> int | None:
    """The room a `cancel_room` control request (router -> prefill/decode) aborts, if it is one."""
    arr = get("cancel_room")
    return None if arr is None else int(_scalar(arr, "cancel_room"))


def is_describe(get: Callable[[str], np.ndarray | None]) -> bool:
    """A `describe` control request (the router's health check): the model answers who it is."""
    return _flag(get, "describe")


def split_agent(text: str) -> tuple[str, str, int]:
    """"name@host:port" as (name, host, port); ValueError names what is wrong."""
    name, at, address = text.partition("@")
    host, _, port = address.rpartition(":")
    if not (name and at and host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"prefill_agent must be name@host:port, got {text!r}")
    return name, host, int(port)


def _agent(array: np.ndarray | None) -> str | None:
    if array is None:
        return None
    text = _text(_scalar(array, "prefill_agent"), "prefill_agent")
    try:
        split_agent(text)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return text


def _text(value, name: str = "text_input") -> str:
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{name} is not valid UTF-8") from None


def _scalar(array: np.ndarray, name: str):
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"input {name!r} must hold one value, got {flat.size}")
    return flat[0]


def _number(value, kind, name: str):
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(f"input {name!r} must be a finite {kind.__name__}, got {value!r}") from None


def _bool(value) -> bool:
    if isinstance(value, (bytes, str)):
        return _text(value, "a boolean input").strip().lower() in ("1", "true", "yes")
    return bool(value)


def _json_value(value, kind):
    """One JSON value as `kind` (genai-perf sends numbers and booleans as strings); ValueError if it is not one."""
    if kind is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1")
        raise ValueError
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    number = float(value)
    if kind is int:
        if not number.is_integer():
            raise ValueError
        return int(value) if isinstance(value, int) else int(number)
    return number


def _json_field(key: str, value):
    kind = JSON_KEYS[key]
    name = "a list of strings" if key == "stop" else "a list of ints" if key in LIST_KEYS else f"a {kind.__name__}"
    try:
        if key in LIST_KEYS:
            if key == "stop" and isinstance(value, str):
                return (value,)
            if not isinstance(value, list):
                raise ValueError
            return tuple(_json_value(v, kind) for v in value)
        value = _json_value(value, kind)
    except (TypeError, ValueError, OverflowError):
        raise InvalidRequest(f"sampling_parameters.{key} must be {name}, got {value!r}") from None
    return 0 if key == "top_k" and value == -1 else value   # vLLM's -1: no limit


def _json_params(raw: str) -> dict:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    out = {}
    for key, value in data.items():
        if key in FIXED_KEYS:
            fixed, why = FIXED_KEYS[key]
            if value is not None and value != fixed:
                raise InvalidRequest(f"sampling_parameters.{key} must be {json.dumps(fixed)} ({why}), "
                                     f"got {json.dumps(value)}")
        elif key not in JSON_KEYS:
            raise InvalidRequest(f"sampling_parameters.{key} is not supported by Tandem (supported keys: "
                                 f"{', '.join(sorted(JSON_KEYS | FIXED_KEYS))})")
        elif value is not None:
            out[key] = _json_field(key, value)
    return out


def _flag(get: Callable[[str], np.ndarray | None], name: str, default: bool = False) -> bool:
    arr = get(name)
    return _bool(_scalar(arr, name)) if arr is not None else default


def parse_request(get: Callable[[str], np.ndarray | None], default_max_tokens: int) -> GenerateRequest:
    """`get(name)` returns the input tensor as a numpy array, or None if absent."""
    raw = get("text_input")
    if raw is None:
        raise InvalidRequest("missing input 'text_input'")
    prompt = _text(_scalar(raw, "text_input"), "text_input")
    if not prompt.strip():
        raise InvalidRequest("the prompt ('text_input') is empty")
    fields: dict = {"max_tokens": default_max_tokens}
    sp = get("sampling_parameters")
    if sp is not None:
        fields.update(_json_params(_text(_scalar(sp, "sampling_parameters"), "sampling_parameters")))
    for name, (field, kind) in SCALAR_INPUTS.items():
        arr = get(name)
        if arr is not None:
            fields[field] = _number(_scalar(arr, name).item(), kind, name)
    words = get("stop_words")
    if words is not None:
        fields["stop"] = tuple(w for w in (_text(w, "stop_words") for w in np.asarray(words).reshape(-1)) if w)
    beams = get("beam_width")
    if beams is not None and (width := _number(_scalar(beams, "beam_width").item(), int, "beam_width")) != 1:
        raise InvalidRequest(f"input 'beam_width' must be 1 (Tandem does not search beams), got {width}")
    outputs = tuple(out for flag, outs in LOGPROB_FLAGS.items() if _flag(get, flag) for out in outs)
    if fields.get("logprobs") is None and set(outputs) - {"logprobs"}:
        fields["logprobs"] = 0   # the sampled tokens' own logprobs
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    room = get("bootstrap_room")
    return GenerateRequest(prompt=prompt, params=params, stream=_flag(get, "stream"),
                           exclude_input=_flag(get, "exclude_input_in_output"),
                           chat=_flag(get, "apply_chat_template"),
                           room=None if room is None else int(_scalar(room, "bootstrap_room")),
                           logprob_outputs=outputs, cache_salt=_salt(get("cache_salt")),
                           prefill_agent=_agent(get("prefill_agent")))


def _salt(array: np.ndarray | None) -> bytes | None:
    """The cache_salt input's bytes (an empty one is no salt)."""
    if array is None:
        return None
    value = _scalar(array, "cache_salt")
    return (value if isinstance(value, bytes) else str(value).encode()) or None


def output_arrays(text: str, token_ids: list[int], finish_reason: str | None, num_input: int, num_output: int,
                  wanted: tuple[str, ...] = OUTPUTS, logprobs: list[dict] | None = None,
                  cumulative: float = 0.0, num_cached: int = 0) -> dict[str, np.ndarray]:
    """The response tensors, only those wanted. logprobs: the new tokens' (RequestOutput.logprobs),
    cumulative: the sum of every sampled token's logprob so far."""
    make = {
        "text_output": lambda: np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": lambda: np.array(token_ids, dtype=np.int32),
        "finish_reason": lambda: np.array([(finish_reason or "").encode()], dtype=np.object_),
        "num_input_tokens": lambda: np.array([num_input], dtype=np.int32),
        "num_output_tokens": lambda: np.array([num_output], dtype=np.int32),
        "num_cached_tokens": lambda: np.array([num_cached], dtype=np.int32),
        # TensorRT-LLM's: [beams = 1, new tokens] and [beams = 1]
        "output_log_probs": lambda: np.array([[d[t][0] for t, d in zip(token_ids, logprobs or ())]], dtype=np.float32),
        "cum_log_probs": lambda: np.array([cumulative], dtype=np.float32),
        # the vLLM backend's: the new tokens' Logprob dicts as JSON ("null" when logprobs was not asked)
        "logprobs": lambda: np.array([vllm_logprobs_json(logprobs).encode()], dtype=np.object_),
        "cumulative_logprob": lambda: np.array([cumulative], dtype=np.float32),
    }
    return {name: make[name]() for name in wanted if name in make}


def vllm_logprobs_json(logprobs: list[dict] | None) -> str:
    if logprobs is None:
        return "null"
    return json.dumps([{str(tid): {"logprob": lp, "rank": rank, "decoded_token": text}
                        for tid, (lp, rank, text) in entry.items()} for entry in logprobs])


def parse_vllm_logprobs(raw: str) -> list[dict[int, tuple[float, int, str]]] | None:
    """vllm_logprobs_json's text back to RequestOutput.logprobs (the router reads its children's)."""
    data = json.loads(raw)
    if data is None:
        return None
    return [{int(tid): (v["logprob"], v["rank"], v["decoded_token"]) for tid, v in entry.items()} for entry in data]
