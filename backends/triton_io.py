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

# tensor name -> (SamplingParams field, python type)
SCALAR_INPUTS = {
    "max_tokens": ("max_tokens", int),
    "min_tokens": ("min_tokens", int),
    "min_length": ("min_tokens", int),   # TensorRT-LLM's name, sent by genai-perf
    "temperature": ("temperature", float),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "seed": ("seed", int),
    "end_id": ("end_id", int),
}
JSON_KEYS = {"max_tokens": int, "min_tokens": int, "temperature": float, "top_k": int,
             "top_p": float, "seed": int, "ignore_eos": bool, "stop": list}
OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens")
PER_TOKEN_OUTPUTS = ("text_output", "output_ids")   # in every streamed response; the rest in the first and last


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    chat: bool
    room: int | None = None   # bootstrap room, set by the router for prefill and decode


def control_room(get: Callable[[str], np.ndarray | None]) -> int | None:
    """The room a `cancel_room` control request (router -> prefill/decode) aborts, if it is one."""
    arr = get("cancel_room")
    return None if arr is None else int(_scalar(arr, "cancel_room"))


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


def _json_params(raw: str) -> dict:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("sampling_parameters must be a JSON object")
    out = {}
    for key, kind in JSON_KEYS.items():
        if key not in data or data[key] is None:
            continue
        value = data[key]
        try:
            if kind is list:
                out["stop"] = (value,) if isinstance(value, str) else tuple(str(s) for s in value)
            elif kind is bool:
                out[key] = _bool(value)
            else:
                out[key] = kind(float(value)) if kind is int else kind(value)
        except (TypeError, ValueError, OverflowError):
            raise InvalidRequest(f"sampling_parameters.{key} must be a {kind.__name__}, got {value!r}") from None
    return out


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
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    flag = lambda name, default: _bool(_scalar(get(name), name)) if get(name) is not None else default
    room = get("bootstrap_room")
    return GenerateRequest(prompt=prompt, params=params, stream=flag("stream", False),
                           exclude_input=flag("exclude_input_in_output", False),
                           chat=flag("apply_chat_template", False),
                           room=None if room is None else int(_scalar(room, "bootstrap_room")))


def output_arrays(text: str, token_ids: list[int], finish_reason: str | None,
                  num_input: int, num_output: int, wanted: tuple[str, ...] = OUTPUTS) -> dict[str, np.ndarray]:
    """The response tensors, only those the client asked for (all when it named none)."""
    make = {
        "text_output": lambda: np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": lambda: np.array(token_ids, dtype=np.int32),
        "finish_reason": lambda: np.array([(finish_reason or "").encode()], dtype=np.object_),
        "num_input_tokens": lambda: np.array([num_input], dtype=np.int32),
        "num_output_tokens": lambda: np.array([num_output], dtype=np.int32),
    }
    return {name: make[name]() for name in wanted if name in make}
