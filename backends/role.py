"""What a role is to the scheduler's one loop: where requests come from, what happens
after a sample, and what a step does besides its forward. The loop calls these hooks on
its own thread; a role moves requests only through the scheduler's methods (enqueue,
join_running, leave, finish), never by editing its queues.

Roles: colocated (here), prefill and decode (`backends.disagg`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from backends.request import Request

if TYPE_CHECKING:
    from backends.model import LayerHook
    from backends.runner import Batch
    from backends.scheduler import Scheduler


class Role(Protocol):
    carries_logprobs: bool   # sampled tokens need their logprob (a hand-off carries it)
    ends_text: bool          # a request's last output here is the end of its text
    decodes: bool            # requests decode here after their first token (else they leave)

    def attach(self, scheduler: "Scheduler") -> None: ...

    def admit(self, req: Request) -> bool:
        """True when the role holds a new request itself (else it waits to be scheduled)."""

    def advance(self) -> None:
        """Between steps: the role's own queues move (transfers, hand-offs, timeouts)."""

    def layer_hook(self, batch: "Batch") -> "LayerHook | None":
        """What the batch's forward runs between layers (on the forward thread)."""

    def on_sampled(self, req: Request) -> bool:
        """True when the role took the request over (it leaves this engine)."""

    def on_abort(self, req: Request) -> None: ...

    def on_preempt(self, req: Request) -> None:
        """Before a preempted request's pages go back to the pool; a role whose queued work
        still reads them takes them over (req.pages = [])."""

    def stats(self) -> dict: ...

    def identity(self) -> dict:
        """What a router needs to pair requests with this engine (a prefill engine's agent)."""

    def close(self) -> None: ...


class ColocatedRole:
    """Requests come from the adapter and decode here after their prefill."""

    carries_logprobs = False
    ends_text = True
    decodes = True

    def attach(self, scheduler: "Scheduler") -> None:
        pass

    def admit(self, req: Request) -> bool:
        return False

    def advance(self) -> None:
        pass

    def layer_hook(self, batch: "Batch") -> None:
        return None

    def on_sampled(self, req: Request) -> bool:
        return False

    def on_abort(self, req: Request) -> None:
        pass

    def on_preempt(self, req: Request) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def identity(self) -> dict:
        return {}

    def close(self) -> None:
        pass

