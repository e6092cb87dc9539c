"""What a role is to the scheduler's one loop: where requests come from, what happens
after a sample, and what a step does besides its forward.

A role is built once the engine is assembled (`backends.engine.make_role`), from two
things: `EngineFacts`, what it may know of the engine (the KV tensor, the layer count,
the KV manager...), and `EngineOps`, the scheduler operations it may ask for. It reads
nothing else of the scheduler: it moves requests between its own queues and the
scheduler's only through those operations, and never writes a request's status.
The loop calls the role's hooks on its own thread; where a hook decides something
about a request's pages (keep them while a transfer reads them), it returns the
decision and the scheduler carries it out.

Roles: colocated (here), prefill and decode (`backends.disagg`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from backends.request import Request, Status, TokenLogprob

# A condition that pages wait for before they go back to the KV manager
# (backends.kv_cache.Fence): true once nothing reads or writes them any more.
Fence = Callable[[], bool]


@dataclass(frozen=True)
class EngineFacts:
    """What a role knows of the engine it serves, fixed once the engine is assembled."""

    kv: Any                  # the KV tensor, [layers, 2, pages, ...]: what KV transfers read and write
    num_layers: int
    device_type: str         # "cuda" or "cpu"
    kv_manager: Any          # backends.kv_cache.KVManager: the pages; a role allocates and releases there
    prefix_caching: bool     # whether full pages enter the prefix cache
    wake: Callable[[], None]  # wakes the loop (a transfer event came)


@dataclass(frozen=True)
class KeepPages:
    """A hook's decision: the role's transfers still touch a request's pages from `first`
    on; those go back only once `until` passes (and the forward that reads them is done),
    the ones before at once."""

    until: Fence
    first: int = 0


class EngineOps(Protocol):
    """The scheduler operations a role may ask for (on the loop's thread)."""

    def enqueue(self, req: Request) -> None:
        """A request the role held is ready for its prefill."""

    def join_running(self, req: Request, num_computed: int) -> None:
        """A request whose KV for `num_computed` tokens is here (prebuilt) joins the decode batch."""

    def hold(self, req: Request, status: Status) -> None:
        """The role holds the request in its own queue (`status` names which): it is not
        scheduled here, or no longer; its pages stay with it."""

    def finish(self, req: Request, reason: str, error: str | None = None, keep: KeepPages | None = None) -> None:
        """End the request; `keep`: which of its pages the role's transfers still touch (a role
        that ends a request itself decides that as on_abort would)."""

    def emit(self, req: Request) -> None:
        """Stream what the request has output so far."""

    def append_token(self, req: Request, token: int, logprob: TokenLogprob | None, stop_ids: list[int]) -> None: ...

    def stop_ids(self, req: Request) -> list[int]: ...

    def has_room(self) -> bool:
        """Whether the running batch takes another request."""

    def scheduled(self) -> list[Request]:
        """Requests running or waiting for a step (read only)."""

    def after_step(self, step: int) -> Fence | None:
        """The fence "step's forward is done" (None: it is)."""

    def give_pages(self, req: Request, held: Any, new: list[int]) -> None:
        """The request's KV pages: `held`, a kv_manager.match of its prompt (cached pages, a
        reference on each), then `new` pages from kv_manager.allocate."""

    def cache_pages(self, req: Request, end: int) -> None:
        """The full pages of its first `end` positions, their KV written, enter the prefix cache."""


class Role(Protocol):
    carries_logprobs: bool   # sampled tokens need their logprob (a hand-off carries it)
    ends_text: bool          # a request's last output here is the end of its text
    decodes: bool            # requests decode here after their first token (else they leave)

    def admit(self, req: Request) -> bool:
        """True when the role holds a new request itself (else it waits to be scheduled)."""

    def advance(self) -> None:
        """Between steps: the role's own queues move (transfers, hand-offs, timeouts)."""

    def layer_hook(self, batch) -> Any:
        """What the batch's forward runs between layers, a backends.model.LayerHook or None
        (on the forward thread)."""

    def on_sampled(self, req: Request) -> bool:
        """True when the role took the request over (it leaves this engine)."""

    def on_abort(self, req: Request) -> KeepPages | None:
        """The request ends with an abort or an error; which of its pages the role's transfers
        still touch (None: none)."""

    def on_preempt(self, req: Request) -> Fence | None:
        """The request is preempted: when its pages may go back (None: at once; a role whose
        queued work still reads them says until when)."""

    def stats(self) -> dict: ...

    def identity(self) -> dict:
        """What a router needs to pair requests with this engine (a prefill engine's agent)."""

    def close(self) -> None: ...


class ColocatedRole:
    """Requests come from the adapter and decode here after their prefill."""

    carries_logprobs = False
    ends_text = True
    decodes = True

    def admit(self, req: Request) -> bool:
        return False

    def advance(self) -> None:
        pass

    def layer_hook(self, batch) -> None:
        return None

    def on_sampled(self, req: Request) -> bool:
        return False

    def on_abort(self, req: Request) -> None:
        return None

    def on_preempt(self, req: Request) -> None:
        return None

    def stats(self) -> dict:
        return {}

    def identity(self) -> dict:
        return {}

    def close(self) -> None:
        pass
