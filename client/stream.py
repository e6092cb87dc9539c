"""Streaming over Triton gRPC: one function shared by the CLI, tests and tools."""
from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np


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


def numpy_inputs(values: dict[str, np.ndarray]):
    """tritonclient InferInputs from numpy arrays, the Triton datatype read off each array."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream_events(url: str, model: str, inputs, request_id: str = "", timeout_s: float = 300
                  ) -> Iterator[tuple[str | None, dict | None]]:
    """Yields (error, outputs) per response of one streamed request until the final one."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()

    def callback(result, error):
        events.put((result, error))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        while True:
            result, error = events.get(timeout=timeout_s)
            if error is not None:
                yield str(error), None
                return
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if outputs:
                yield None, outputs
            if final is not None and final.bool_param:
                return
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


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
