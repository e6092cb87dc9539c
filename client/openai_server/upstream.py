"""The tritonserver behind the service, over gRPC (tritonclient.grpc.aio): which entry models
it has loaded, and one streamed generation as pieces of text."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from backends.grpc_stream import numpy_inputs
from client.openai_server.errors import APIError, bad_request, model_not_found, unavailable

WANTED = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens")
CACHED = "num_cached_tokens"   # sent by models with prefix caching
LOGPROBS = ("output_ids", "logprobs")   # the vLLM backend's logprobs: a JSON list per response
# A model's error before its first output is the request's fault (the engines refuse bad
# input that way) unless it names a fault of the server; the Triton stream carries only the
# message, no status code.
SERVER_FAULT = re.compile(r"internal error|not healthy|failed|not done within|within \d|unreachable|"
                          r"lost its|stub|timed out|no free", re.IGNORECASE)
UNKNOWN_MODEL = re.compile(r"unknown model|is not found|has no available versions", re.IGNORECASE)


@dataclass(frozen=True)
class EntryModel:
    name: str
    inputs: frozenset[str]
    outputs: frozenset[str]
    created: int

    def wanted(self, logprobs: bool) -> tuple[str, ...]:
        """The outputs to ask for: only these are built and sent."""
        return WANTED + ((CACHED,) if CACHED in self.outputs else ()) + (LOGPROBS if logprobs else ())


@dataclass
class Piece:
    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    token_ids: list[int] | None = None
    logprobs: list[dict] | None = None   # per new token: {token id: {logprob, rank, decoded_token}}


class Upstream:
    def __init__(self, url: str):
        self.url = url
        self.client = grpcclient.InferenceServerClient(url)
        self.models: dict[str, EntryModel] = {}

    async def close(self) -> None:
        await self.client.close()

    async def refresh(self) -> dict[str, EntryModel]:
        """The loaded models that take requests (`text_input`, no `bootstrap_room`): `llm`,
        `router` and any renamed copy of them; `prefill` and `decode` are not entry points."""
        index = await self._call(self.client.get_model_repository_index, as_json=True, client_timeout=10)
        ready = {m["name"] for m in index.get("models", []) if m.get("state") == "READY"}
        models = {}
        for name in sorted(ready):
            if name in self.models:
                models[name] = self.models[name]
                continue
            config = (await self._call(self.client.get_model_config, name, as_json=True, client_timeout=10))["config"]
            inputs = frozenset(i["name"] for i in config.get("input", []))
            outputs = frozenset(o["name"] for o in config.get("output", []))
            if "text_input" in inputs and "bootstrap_room" not in inputs and set(WANTED) <= outputs:
                models[name] = EntryModel(name, inputs, outputs, int(time.time()))
        self.models = models
        return models

    async def model(self, name: str) -> EntryModel:
        if name not in self.models:
            await self.refresh()
        if name not in self.models:
            raise model_not_found(name)
        return self.models[name]

    async def _call(self, method, *args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except InferenceServerException as exc:
            if "UNAVAILABLE" in str(exc.status()) or "DEADLINE" in str(exc.status()):
                raise unavailable(self.url, exc.message()) from None
            raise APIError(500, f"the Triton server answered: {exc.message()}") from None

    async def generate(self, model: EntryModel, values: dict[str, np.ndarray],
                       outputs: tuple[str, ...]) -> AsyncIterator[Piece]:
        """The pieces of one request until its last; closing the iterator cancels the request
        on the server (its KV is freed)."""
        async def requests():
            yield {"model_name": model.name, "inputs": numpy_inputs(values),
                   "outputs": [grpcclient.InferRequestedOutput(n) for n in outputs],
                   "parameters": {"triton_enable_empty_final_response": True}}

        call = self.client.stream_infer(requests())
        started = False
        try:
            async for result, error in call:
                if error is not None:
                    raise _model_error(model.name, error.message(), started)
                response = result.get_response()
                piece = _piece(result, response)
                if piece is not None:
                    started = True
                    yield piece
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return
            raise APIError(500, f"the stream of {model.name} ended without its final response")
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise unavailable(self.url, exc.details() or str(exc.code())) from None
            raise APIError(500, f"the Triton stream failed: {exc.details()}") from None
        finally:
            call.cancel()


def _piece(result, response) -> Piece | None:
    names = {o.name for o in response.outputs}
    if not names:
        return None
    scalar = lambda name: int(result.as_numpy(name)[0]) if name in names else None
    reason = result.as_numpy("finish_reason")[0].decode() if "finish_reason" in names else ""
    text = result.as_numpy("text_output")[0].decode("utf-8") if "text_output" in names else ""
    piece = Piece(text, reason or None, scalar("num_input_tokens"), scalar("num_output_tokens"), scalar(CACHED))
    if "logprobs" in names:
        piece.token_ids = [int(t) for t in result.as_numpy("output_ids")]
        piece.logprobs = json.loads(result.as_numpy("logprobs")[0]) or []
    return piece


def _model_error(model: str, message: str, started: bool) -> APIError:
    if UNKNOWN_MODEL.search(message):
        return model_not_found(model)
    if started or SERVER_FAULT.search(message):
        return APIError(500, message)
    return bad_request(message)
