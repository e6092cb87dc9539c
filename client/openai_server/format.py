"""The model's pieces as OpenAI's response bodies and stream chunks, for each endpoint."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from client.openai_server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                           ChatCompletionChunk, ChatLogprobs, Completion, CompletionChoice,
                                           CompletionLogprobs, Delta, PromptTokensDetails, TokenLogprob,
                                           TopLogprob, Usage)
from client.openai_server.upstream import Piece


@dataclass
class Totals:
    """What a whole response reports: token counts as the model reports them (in its first
    and last response), the finish reason; with `keep`, the text and logprobs too."""
    keep: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        if piece.prompt_tokens is not None:
            self.prompt_tokens = piece.prompt_tokens
        if piece.completion_tokens is not None:
            self.completion_tokens = piece.completion_tokens
        if piece.cached_tokens is not None:
            self.cached_tokens = piece.cached_tokens
        if piece.finish_reason:
            self.finish_reason = piece.finish_reason
        if self.keep:
            self.texts.append(piece.text)
            self.token_ids += piece.token_ids or []
            self.logprobs += piece.logprobs or []

    def usage(self) -> Usage:
        details = None if self.cached_tokens is None else PromptTokensDetails(cached_tokens=self.cached_tokens)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens, prompt_tokens_details=details)

    def piece(self) -> Piece:
        """Everything kept, as one piece."""
        return Piece("".join(self.texts), self.finish_reason, token_ids=self.token_ids, logprobs=self.logprobs)


class Format:
    """One response's id and time, and its bodies. With include_usage every chunk carries
    "usage": null and a last chunk, with no choices, the usage (as OpenAI streams it).
    top_logprobs: None, or how many alternatives each token's logprobs list."""
    prefix = ""

    def __init__(self, model: str, include_usage: bool, top_logprobs: int | None):
        self.model, self.include_usage, self.top_logprobs = model, include_usage, top_logprobs
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _json(self, body) -> str:
        return body.model_dump_json(exclude=None if self.include_usage else {"usage"})

    def _tokens(self, piece: Piece):
        """Per new token: (its text, its logprob, the top alternatives as (text, logprob))."""
        for token, entry in zip(piece.token_ids or (), piece.logprobs or ()):
            own = entry[str(token)]
            top = sorted((v for v in entry.values() if 1 <= v["rank"] <= self.top_logprobs), key=lambda v: v["rank"])
            yield own["decoded_token"], own["logprob"], [(v["decoded_token"], v["logprob"]) for v in top]

    def opening(self) -> str | None:
        """The chunk before the first piece, if any."""
        return None

    def chunk(self, piece: Piece) -> str:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> str:
        raise NotImplementedError

    def whole(self, totals: Totals):
        raise NotImplementedError


class ChatFormat(Format):
    prefix = "chatcmpl"

    def _chunk(self, delta: Delta, finish_reason: str | None, logprobs=None, usage: Usage | None = None) -> str:
        choices = [] if usage else [ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)]
        return self._json(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                              choices=choices, usage=usage))

    def _logprobs(self, piece: Piece) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()),
                         top_logprobs=[TopLogprob(token=t, logprob=p, bytes=list(t.encode())) for t, p in top])
            for text, lp, top in self._tokens(piece)])

    def opening(self) -> str:
        return self._chunk(Delta(role="assistant", content=""), None)

    def chunk(self, piece: Piece) -> str:
        return self._chunk(Delta(content=piece.text) if piece.text else Delta(), piece.finish_reason,
                           self._logprobs(piece))

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk(Delta(), None, usage=usage)

    def whole(self, totals: Totals) -> ChatCompletion:
        piece = totals.piece()
        choice = ChatChoice(message=AssistantMessage(content=piece.text), logprobs=self._logprobs(piece),
                            finish_reason=piece.finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=totals.usage(),
                              choices=[choice])


class CompletionFormat(Format):
    prefix = "cmpl"

    def __init__(self, model: str, include_usage: bool, top_logprobs: int | None, echo: str = ""):
        super().__init__(model, include_usage, top_logprobs)
        self.echo = echo   # the prompt, written before the text when the request asks to echo it
        self.offset = 0    # where the next token's text starts in the completion

    def _logprobs(self, piece: Piece) -> CompletionLogprobs | None:
        if self.top_logprobs is None:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for text, lp, top in self._tokens(piece):
            out.tokens.append(text)
            out.token_logprobs.append(lp)
            out.top_logprobs.append({text: lp} | dict(top))
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out

    def _chunk(self, text: str, finish_reason: str | None, logprobs=None, usage: Usage | None = None) -> str:
        choices = [] if usage else [CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)]
        return self._json(Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                                     usage=usage))

    def chunk(self, piece: Piece) -> str:
        text, self.echo = self.echo + piece.text, ""
        return self._chunk(text, piece.finish_reason, self._logprobs(piece))

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk("", None, usage=usage)

    def whole(self, totals: Totals) -> Completion:
        piece = totals.piece()
        choice = CompletionChoice(text=self.echo + piece.text, logprobs=self._logprobs(piece),
                                  finish_reason=piece.finish_reason)
        return Completion(id=self.id, created=self.created, model=self.model, usage=totals.usage(), choices=[choice])
