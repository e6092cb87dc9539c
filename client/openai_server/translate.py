"""An OpenAI request as the input tensors of `llm` / `router` (TensorRT-LLM's names, and the
vLLM backend's `sampling_parameters` JSON for what has no tensor).

Values are passed on as sent: the model checks their ranges and its message comes back as a
400. What this module refuses is what the models cannot do at all, by the field's name.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from client.openai_server.errors import bad_request, unsupported
from client.openai_server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from client.openai_server.upstream import EntryModel

INT32_MAX = 2 ** 31 - 1


def _set(value) -> bool:
    return value is not None and value is not False and value != [] and value != {}


# OpenAI fields the models have no counterpart for: refused whenever a request uses them.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v not in (None, 1), "only n=1 is supported"),
    "best_of": (lambda v: v not in (None, 1), "only best_of=1 is supported"),
    "suffix": (_set, "suffix (insertion) is not supported"),
    "tools": (_set, "tool calling is not supported"),
    "tool_choice": (lambda v: v not in (None, "none"), "tool calling is not supported"),
    "functions": (_set, "function calling is not supported"),
    "function_call": (lambda v: v not in (None, "none"), "function calling is not supported"),
    "response_format": (lambda v: v is not None and v.get("type") != "text",
                        "structured output (json_object, json_schema) is not supported"),
    "logit_bias": (_set, "logit_bias is not supported"),
    "store": (_set, "stored completions are not supported"),
    "modalities": (lambda v: v not in (None, ["text"]), "only the text modality is supported"),
    "audio": (_set, "audio output is not supported"),
    "prediction": (_set, "predicted outputs are not supported"),
    "reasoning_effort": (_set, "reasoning_effort is not supported"),
    "web_search_options": (_set, "web search is not supported"),
    "service_tier": (lambda v: v not in (None, "auto", "default"), "service tiers are not supported"),
}

# OpenAI / vLLM field -> (the model's input tensor, its dtype, values that change nothing).
# A field set to another value on a model that does not declare its tensor is refused.
TENSOR_FIELDS: dict[str, tuple[str, type, tuple]] = {
    "max_tokens": ("max_tokens", np.int32, (None,)),
    "min_tokens": ("min_tokens", np.int32, (None, 0)),
    "temperature": ("temperature", np.float32, (None,)),
    "top_p": ("top_p", np.float32, (None,)),
    "top_k": ("top_k", np.int32, (None, -1, 0)),   # vLLM's -1 and Tandem's 0: no limit
    "min_p": ("min_p", np.float32, (None, 0)),
    "seed": ("seed", np.uint64, (None,)),
    "repetition_penalty": ("repetition_penalty", np.float32, (None, 1)),
    "presence_penalty": ("presence_penalty", np.float32, (None, 0)),
    "frequency_penalty": ("frequency_penalty", np.float32, (None, 0)),
    "cache_salt": ("cache_salt", np.object_, (None, "")),
}
# Fields sent in the `sampling_parameters` JSON under their own name (vLLM's keys; no tensor).
JSON_FIELDS = ("ignore_eos", "stop_token_ids")
MAX_TOP_LOGPROBS = 20   # OpenAI's and vLLM's limit


def check_supported(req: SamplingFields) -> None:
    for name, (in_use, why) in UNSUPPORTED.items():
        if in_use(getattr(req, name, None)):
            raise unsupported(name, why)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_messages(req: ChatCompletionRequest) -> None:
    for i, m in enumerate(req.messages):
        for name in ("tool_calls", "function_call", "audio"):
            if _set(getattr(m, name)):
                raise unsupported(f"messages[{i}].{name}", "tool calling and audio are not supported")


def completion_prompt(req: CompletionRequest) -> str:
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise unsupported("prompt", "only one prompt, as text, is supported (not a batch, not token ids)")
        prompt = prompt[0]
    return prompt


@dataclass(frozen=True)
class Defaults:
    """Sampling defaults when a request omits them: the checkpoint's generation_config.json
    where it sets them (as vLLM does), else OpenAI's (temperature 1, top_p 1)."""
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_checkpoint(cls, path: str) -> "Defaults":
        try:
            with open(os.path.join(path, "generation_config.json")) as f:
                gen = json.load(f)
        except (OSError, ValueError):
            return cls()
        return cls(temperature=gen.get("temperature", 1.0), top_p=gen.get("top_p"), top_k=gen.get("top_k"))


def logprobs_wanted(req: SamplingFields) -> int | None:
    """How many top alternatives per token (0: the sampled token's own only), None: no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is not None and req.echo:
        raise unsupported("echo", "echo with logprobs needs the prompt's logprobs, which are not computed")
    return req.logprobs


def model_inputs(req: SamplingFields, prompt: str, defaults: Defaults, model: EntryModel,
                 logprobs: int | None) -> dict[str, np.ndarray]:
    """The tensors of one request. A non-streaming request is one response of the model
    (`stream` false), with the generated text only."""
    values = {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_),
              "stream": np.array([bool(req.stream)]), "exclude_input_in_output": np.array([True])}
    fields = {name: getattr(req, name, None) for name in TENSOR_FIELDS}
    if getattr(req, "max_completion_tokens", None) is not None:
        fields["max_tokens"] = req.max_completion_tokens
    for name, value in (("temperature", defaults.temperature), ("top_p", defaults.top_p), ("top_k", defaults.top_k)):
        if fields[name] is None:
            fields[name] = value
    for name, value in fields.items():
        tensor, dtype, neutral = TENSOR_FIELDS[name]
        if value in neutral:
            continue
        if tensor not in model.inputs:
            raise unsupported(name, f"the model `{model.name}` does not take it")
        values[tensor] = _array(name, value, dtype)
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if stop:
        values["stop_words"] = np.array([s.encode("utf-8") for s in stop], dtype=np.object_)
    extra = {name: getattr(req, name) for name in JSON_FIELDS if _set(getattr(req, name))}
    if logprobs is not None:
        if "return_logprobs" not in model.inputs or "logprobs" not in model.outputs:
            raise unsupported("logprobs", f"the model `{model.name}` does not return logprobs")
        extra["logprobs"] = logprobs
        values["return_logprobs"] = np.array([True])
    if extra:
        values["sampling_parameters"] = np.array([json.dumps(extra).encode()], dtype=np.object_)
    return values


def _array(name: str, value, dtype) -> np.ndarray:
    if dtype is np.object_:
        return np.array([str(value).encode("utf-8")], dtype=np.object_)
    if dtype is np.int32 and abs(value) > INT32_MAX:
        raise bad_request(f"{name} must be at most {INT32_MAX}, got {value}", name)
    if dtype is np.uint64 and not 0 <= value < 2 ** 64:
        raise bad_request(f"{name} must be in [0, 2**64), got {value}", name)
    return np.array([value], dtype=dtype)
