"""The FastAPI application: /v1/models, /v1/completions, /v1/chat/completions."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from client.openai_server.chat import ChatTemplate
from client.openai_server.errors import APIError, bad_request
from client.openai_server.format import ChatFormat, CompletionFormat, Format, Totals
from client.openai_server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from client.openai_server.translate import (Defaults, check_messages, check_supported, completion_prompt,
                                            logprobs_wanted, model_inputs)
from client.openai_server.upstream import Piece, Upstream

log = logging.getLogger("tandem.openai")
DONE = b"data: [DONE]\n\n"


def create_app(url: str, tokenizer_path: str) -> FastAPI:
    template = ChatTemplate(tokenizer_path)
    defaults = Defaults.from_checkpoint(tokenizer_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.upstream = Upstream(url)   # its gRPC channel belongs to the server's event loop
        yield
        await app.state.upstream.close()

    app = FastAPI(title="Tandem OpenAI-compatible API", lifespan=lifespan)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        await app.state.upstream.refresh()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> ModelList:
        found = await app.state.upstream.refresh()
        return ModelList(data=[ModelCard(id=m.name, created=m.created) for m in found.values()])

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_supported(req)
        prompt = completion_prompt(req)
        logprobs = logprobs_wanted(req)
        fmt = CompletionFormat(req.model, include_usage(req), logprobs, echo=prompt if req.echo else "")
        return await respond(request, req, prompt, fmt, logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        check_supported(req)
        check_messages(req)
        logprobs = logprobs_wanted(req)
        fmt = ChatFormat(req.model, include_usage(req), logprobs)
        return await respond(request, req, template.render(req.messages), fmt, logprobs)

    async def respond(request: Request, req, prompt: str, fmt: Format, logprobs: int | None) -> Response:
        upstream: Upstream = app.state.upstream
        model = await upstream.model(req.model)
        values = model_inputs(req, prompt, defaults, model, logprobs)
        pieces = upstream.generate(model, values, model.wanted(logprobs is not None))
        try:
            # The first piece decides the status: a request the model refuses is a 400, not a
            # stream that fails. A client gone meanwhile cancels the request.
            first = await unless_disconnected(request, anext(pieces))
        except BaseException:
            await pieces.aclose()
            raise
        if first is None:
            await pieces.aclose()
            return Response(status_code=499)
        if not req.stream:
            totals = await unless_disconnected(request, collect(first, pieces))
            if totals is None:
                return Response(status_code=499)
            return Response(fmt.whole(totals).model_dump_json(), media_type="application/json")
        return StreamingResponse(events(first, pieces, fmt), media_type="text/event-stream")

    return app


def include_usage(req) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


async def collect(first: Piece, pieces: AsyncIterator[Piece]) -> Totals:
    totals = Totals(keep=True)
    totals.add(first)
    async for piece in pieces:
        totals.add(piece)
    return totals


async def events(first: Piece, pieces: AsyncIterator[Piece], fmt: Format):
    """Server-sent events: OpenAI's chunks, the usage chunk if asked for, then [DONE]. An error
    after the first piece is sent as an event with OpenAI's error body (the client raises it)."""
    totals = Totals()
    try:
        opening = fmt.opening()
        if opening:
            yield event(opening)
        piece = first
        while piece is not None:
            totals.add(piece)
            if piece.text or piece.finish_reason or piece.token_ids:
                yield event(fmt.chunk(piece))
            piece = await anext(pieces, None)
        if fmt.include_usage:
            yield event(fmt.usage_chunk(totals.usage()))
    except APIError as exc:
        log.warning("stream failed: %s", exc.message)
        yield event(exc.body().model_dump_json())
    finally:
        await pieces.aclose()   # on a disconnect too: cancels the request on the server
    yield DONE


def event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"


async def unless_disconnected(request: Request, awaitable):
    """The awaitable's result, or None (the awaitable cancelled) if the client goes away first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})   # it unwinds first: the request is cancelled on the server
    if task.cancelled():
        return None
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        log.exception("request failed")
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a body pydantic refused, named as OpenAI names it."""
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unrecognized_argument")
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if err.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {err.get('msg')}", None, "invalid_json")
    return bad_request(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)
