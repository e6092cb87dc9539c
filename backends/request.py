"""A request's state inside the engine, counted in tokens (not phases).

`num_computed` tokens have their KV in the cache; the request needs
`len(tokens) - num_computed` more before it can sample. A prefill chunk, a
decode step and KV that arrived from another engine are all just progress of
that counter.
"""
from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from backends.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    import torch


class InvalidRequest(ValueError):
    """Bad input from a client: reported to that client only."""


MAX_LOGPROBS = 20   # vLLM's default max_logprobs
# name -> (whether a value is in range, what the message says); the bounds are vLLM's
FLOAT_RANGES = {"repetition_penalty": (lambda v: v > 0, "> 0"),
                "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
                "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
                "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]")}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0           # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    end_id: int | None = None  # overrides the model's EOS ids when set
    ignore_eos: bool = False
    # Penalties and min_p as vLLM defines them: repetition over prompt and output (positive
    # logits divided, negative multiplied), frequency x count + presence over output tokens.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()   # stop ids besides the model's EOS (ignore_eos keeps these)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None   # None: none; 0: each new token's own; N: and the top N

    def __post_init__(self):
        for name in ("temperature", "top_p", *FLOAT_RANGES):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name, (valid, text) in FLOAT_RANGES.items():
            if not valid(getattr(self, name)):
                raise ValueError(f"{name} must be {text}, got {getattr(self, name)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.end_id is not None and self.end_id < 0:
            raise ValueError(f"end_id must be >= 0, got {self.end_id}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy, no logprobs, no penalties: the greedy head's token is the whole answer."""
        return self.greedy and self.logprobs is None and not self.penalised


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log probability: log-softmax of the model's logits before penalties,
    temperature and filters (vLLM's default, raw_logprobs); its rank in the vocabulary (1 =
    most likely; ties count as ahead) and the top N (id, logprob), most likely first."""

    logprob: float
    rank: int = 0
    top: tuple[tuple[int, float], ...] = ()

    def as_vllm(self, token: int, text_of: Callable[[int], str]) -> dict[int, tuple[float, int, str]]:
        """vLLM's Logprob dict of a position: the sampled token first, then the top N (ranks 1..N)."""
        out = {token: (self.logprob, self.rank, text_of(token))}
        for rank, (tid, logprob) in enumerate(self.top, 1):
            out[tid] = (logprob, rank, out[tid][2] if tid in out else text_of(tid))
        return out


@dataclass
class RequestOutput:
    request_id: str
    text: str = ""                 # new text since the previous output
    token_ids: list[int] = field(default_factory=list)  # new tokens since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0     # prompt tokens whose KV came from the prefix cache
    # Where the request asked for logprobs: one entry per new token, as vLLM's Logprob dicts
    # ({token id: (logprob, rank, decoded token)}, the sampled token's included).
    logprobs: list[dict[int, tuple[float, int, str]]] | None = None


def merged(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """A stream's outputs in order, each run of ones without an error joined into one (the
    tokens and text of all, the counts and ending of the last)."""
    joined: list[RequestOutput] = []
    for out in outputs:
        last = joined[-1] if joined else None
        if last is None or last.error or out.error or last.finished:
            joined.append(out)
            continue
        logprobs = None if last.logprobs is None and out.logprobs is None else \
            [*(last.logprobs or ()), *(out.logprobs or ())]
        joined[-1] = replace(out, text=last.text + out.text, token_ids=last.token_ids + out.token_ids,
                             logprobs=logprobs)
    return joined


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Held by a disaggregation role (backends.disagg), the hand-off's own states:
    BOOTSTRAPPING = "bootstrapping"   # prefill: decode has not yet said where its KV goes
    SHIPPING = "shipping"             # prefill: first token sampled, KV on its way to decode
    PREALLOCATING = "preallocating"   # decode: waiting for the peer or for pages to receive into
    RECEIVING = "receiving"           # decode: pages given, prefill's KV writes landing
    FINISHED = "finished"


_arrival = itertools.count()


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 sink: Callable[[RequestOutput], None], detokenizer: IncrementalDetokenizer,
                 room: int | None = None, cache_salt: bytes | None = None, prefill_agent: str | None = None):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.sink = sink
        self.detok = detokenizer
        self.num_computed = 0
        # Tokens sampled by a step still in flight (overlap), as (step, row) of that step's
        # samples: the next step's input, resolved on the forward thread when it starts.
        self.futures: list[tuple[int, int]] = []
        self.last_step = -1   # the latest step whose forward reads this request's pages
        # Block diffusion (backends.dllm): the block being denoised (mask ids where not yet
        # revealed), from position block_start; None for an autoregressive request.
        self.block: list[int] | None = None
        self.block_start = 0
        # Its KV pages. The list only grows in place or is replaced by another list (never
        # changed in the middle): the device page table (backends.page_table) writes by that.
        self.pages: list[int] = []
        # Prefix cache (backends.kv_cache): requests of different salts never share KV. Its
        # first `cached_pages` pages are indexed (matched or cached), the last of them named
        # `cache_parent`; `kv_epoch` counts preemptions (a step launched before one caches nothing).
        self.cache_salt = cache_salt
        self.cached_pages = 0
        self.cache_parent: object = None
        self.kv_epoch = 0
        self.num_cached_tokens: int | None = None   # set at its first admission
        self.status = Status.WAITING
        self.arrival = next(_arrival)
        self.generator: torch.Generator | None = None   # made by the sampler, on its device, from params.seed
        self.emitted_ids = 0   # output tokens already sent to the sink
        self.last_logprob: TokenLogprob | None = None   # where a hand-off carries it or the request asks
        # Where the request asks for logprobs (params.logprobs): one per output token, as RequestOutput's
        self.output_logprobs: list[dict[int, tuple[float, int, str]]] = []
        self.history = None   # made by the sampler where penalties read it (backends.sampler.History)
        # disaggregated hand-off: the bootstrap room pairs the prefill and decode halves
        self.room = room
        self.prefill_agent = prefill_agent   # decode: "name@host:port" of the agent writing its KV (None: the default)
        self.meta_slot: int | None = None
        self.admitted_at = 0.0

    @property
    def num_tokens(self) -> int:
        if self.block is not None:
            return self.block_start + len(self.block)
        return len(self.prompt_ids) + len(self.output_ids) + len(self.futures)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, those of a step in flight included."""
        return len(self.output_ids) + len(self.futures)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, end: int) -> list[int | tuple[int, int]]:
        """Token ids of positions [start, end); a token still being sampled is its (step, row)."""
        n = len(self.prompt_ids)
        if end <= n and (self.block is None or end <= self.block_start):
            return self.prompt_ids[start:end]
        if self.block is not None:
            return ((self.prompt_ids + self.output_ids)[:self.block_start] + self.block)[start:end]
        known = self.prompt_ids + self.output_ids
        return (known + self.futures)[start:end] if end > len(known) else known[start:end]
