"""Streaming over Triton gRPC: one function shared by the CLI, tests and tools."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backends.grpc_stream import numpy_inputs, stream_events

__all__ = ["StreamResult", "absorb", "build_inputs", "numpy_inputs", "stream_events", "stream_generate"]


@dataclass
class StreamResult:
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def build_inputs(prompt: str, max_tokens: int | None = None, stream: bool = True, chat: bool = False,
                 temperature: float | None = None, stop: list[str] | None = None, **extra):
    """tritonclient InferInputs for the `llm` / `router` tensor interface."""
    values = {"text_input": np.array([prompt.encode()], dtype=np.object_),
              "stream": np.array([stream]), "exclude_input_in_output": np.array([True]),
              "apply_chat_template": np.array([chat])}
    if max_tokens is not None:
        values["max_tokens"] = np.array([max_tokens], dtype=np.int32)
    if temperature is not None:
        values["temperature"] = np.array([temperature], dtype=np.float32)
    if stop:
        values["stop_words"] = np.array([s.encode() for s in stop], dtype=np.object_)
    values.update(extra)
    return numpy_inputs(values)


def stream_generate(url: str, model: str, prompt: str, **kwargs) -> StreamResult:
    result = StreamResult()
    for error, outputs in stream_events(url, model, build_inputs(prompt, **kwargs)):
        if error:
            result.error = error
            break
        absorb(result, outputs)
    return result


def absorb(result: StreamResult, outputs: dict) -> None:
    if "text_output" in outputs:
        result.pieces.append(outputs["text_output"][0].decode("utf-8"))
    if "output_ids" in outputs:
        result.token_ids.extend(int(t) for t in outputs["output_ids"])
    if "finish_reason" in outputs and outputs["finish_reason"][0]:
        result.finish_reason = outputs["finish_reason"][0].decode()
    if "num_output_tokens" in outputs:
        result.num_output_tokens = int(outputs["num_output_tokens"][0])
