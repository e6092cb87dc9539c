"""The scheduler and its one event loop, whatever the role.

    loop:
        take new requests and aborts          (_take_inbox)
        role-specific queues advance          (role.advance)
        batch = schedule()                    (decodes and prefill chunks in one token budget)
        hidden = runner.run(batch)
        process(batch, hidden)                (sample, stream, finish, free)

Roles (colocated, prefill, decode) differ only in where requests come from and
where finished prefills go (`backends.roles`); they plug into this loop.
"""
from __future__ import annotations

import collections
import logging
import threading
import traceback
from typing import Callable

import torch

from backends.config import EngineConfig
from backends.request import Request, RequestOutput, Status
from backends.runner import Batch, ModelRunner
from backends.sampler import RowsFailed, sample

log = logging.getLogger("tandem.scheduler")


class ColocatedRole:
    """Requests come from the adapter and decode here after their prefill."""

    carries_logprobs = False   # whether sampled tokens need their logprob (a hand-off carries it)
    ends_text = True           # whether a request's last output here is the end of its text

    def attach(self, scheduler: "Scheduler") -> None:
        pass

    def admit(self, req: Request) -> bool:
        """Return True when the role holds a new request itself (else it waits to be scheduled)."""
        return False

    def advance(self) -> None:
        pass

    def on_sampled(self, req: Request) -> bool:
        """Return True when the role took the request over (it leaves this engine)."""
        return False

    def on_abort(self, req: Request) -> None:
        pass

    def on_preempt(self, req: Request) -> None:
        """Called before a preempted request's pages go back to the pool; a role whose
        queued work still reads them takes them over (req.pages = [])."""

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


class Scheduler:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, eos_ids: tuple[int, ...],
                 role: ColocatedRole | None = None):
        self.cfg, self.runner, self.pool = cfg, runner, runner.pool
        self.eos_ids = list(eos_ids)
        self.role = role or ColocatedRole()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Aborts of ids not seen yet: a cancel can overtake its request (the router sends it as
        # a request of its own), and the request is then ended as soon as it arrives.
        self.early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self.num_preemptions = 0
        # Called after each forward, before its outputs go to the sinks (and when the loop
        # idles): the Triton adapter waits there for the previous step's sends, so they overlap
        # this step's forward yet a stream's responses keep their order.
        self.before_process: Callable[[], None] | None = None
        self.role.attach(self)

    # ---- called from other threads -------------------------------------------------
    def submit(self, req: Request) -> None:
        self._inbox.append(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # ---- the loop ------------------------------------------------------------------
    def step(self, wait_s: float = 0.05) -> bool:
        """One turn of the loop; returns whether a batch ran."""
        self._wake.clear()
        self._take_inbox()
        self.role.advance()
        batch = self.schedule()
        if batch is None:
            self._wake.wait(wait_s)  # new requests, aborts and transfer events wake it early
            return False
        try:
            with torch.inference_mode():
                hidden = self.runner.run(batch, self.role_layer_hook(batch))
                if self.before_process is not None:
                    self.before_process()
                self.process(batch, hidden)
        except Exception as exc:  # a bad batch must not take the engine down
            log.error("step failed: %s", traceback.format_exc())
            for req, _ in batch.items:
                self.finish(req, "error", error=f"internal error: {exc}")
        return True

    def role_layer_hook(self, batch: Batch):
        hook = getattr(self.role, "layer_hook", None)
        return hook(batch) if hook else None

    def _take_inbox(self) -> None:
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                self.requests[item.id] = item
                if item.id in self.early_aborts:
                    del self.early_aborts[item.id]
                    self.finish(item, "abort")
                elif not self.role.admit(item):
                    self.waiting.append(item)
            elif item in self.requests:
                self.finish(self.requests[item], "abort")
            else:
                self.early_aborts[item] = None
                while len(self.early_aborts) > 10_000:  # aborts of requests that had already finished
                    self.early_aborts.popitem(last=False)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> Batch | None:
        budget = self.cfg.step_budget(sum(1 for req in self.running if req.num_pending == 1))
        items = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted by an earlier request of this step
            n = min(req.num_pending, budget, self.cfg.chunk_size)
            if n > 0 and self._grow(req, n, preempt=True):
                items.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            n = min(req.num_pending, budget, self.cfg.chunk_size)
            if not self._grow(req, n, preempt=False):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            items.append((req, n))
            budget -= n
        return Batch(items) if items else None

    def _grow(self, req: Request, n: int, preempt: bool) -> bool:
        """Give req pages for n more tokens; preempt the latest running requests if needed."""
        need = self.pool.pages_for(req.num_computed + n) - len(req.pages)
        while need > self.pool.num_free:
            if not preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        """Free its KV and queue it again at the front; it recomputes prompt + output."""
        log.info("preempting %s (%d tokens) for lack of KV pages", req.id, req.num_tokens)
        self.num_preemptions += 1
        self.running.remove(req)
        self.role.on_preempt(req)
        self.pool.free(req.pages)
        req.pages, req.num_computed, req.status = [], 0, Status.WAITING
        self.waiting.appendleft(req)

    # ---- results -------------------------------------------------------------------
    def process(self, batch: Batch, hidden) -> None:
        for req, n in batch.items:
            req.num_computed += n
        samples = batch.samples
        if not samples:
            return
        stop_ids = [self.stop_ids(r) for r in samples]
        errors = {}
        try:
            tokens, logprobs = sample(self.runner.model, hidden, samples, stop_ids, self.role.carries_logprobs)
        except RowsFailed as exc:  # one row's failure must not cost its neighbours their token
            tokens, logprobs, errors = exc.tokens, exc.logprobs, exc.errors
        for row, (req, token, ids) in enumerate(zip(samples, tokens, stop_ids)):
            if row in errors:
                log.warning("request %s could not be sampled: %s", req.id, errors[row])
                self.finish(req, "error", error=f"sampling this request failed: {errors[row]}")
            else:
                self.append_token(req, token, logprobs[row] if logprobs else None, ids)

    def append_token(self, req: Request, token: int, logprob: float | None, stop_ids: list[int]) -> None:
        """Take a sampled token; a failure here (detokenizing, a stop check, a role's hand-off)
        ends only this request."""
        try:
            self._append_token(req, token, logprob, stop_ids)
        except Exception as exc:
            log.error("request %s failed after sampling: %s", req.id, traceback.format_exc())
            self.finish(req, "error", error=f"internal error: {exc}")

    def stop_ids(self, req: Request) -> list[int]:
        if req.params.ignore_eos:
            return []
        return [req.params.end_id] if req.params.end_id is not None else self.eos_ids

    def _append_token(self, req: Request, token: int, logprob: float | None, stop_ids: list[int]) -> None:
        req.output_ids.append(token)
        req.last_logprob = logprob
        if self.role.on_sampled(req):
            return
        reason = None
        if token in stop_ids:
            reason = "stop"
        else:
            req.detok.add(token)
            if req.detok.stopped:
                reason = "stop"
        if reason is None and (len(req.output_ids) >= req.params.max_tokens
                               or req.num_tokens >= self.runner.max_context):
            reason = "length"
        if reason:
            self.finish(req, reason)
        else:
            self.emit(req)

    def emit(self, req: Request, final: bool = False, reason: str | None = None,
             error: str | None = None) -> None:
        text = req.detok.take(final, flush=self.role.ends_text)
        if not (text or final):
            return  # a token that ends inside a character waits for the next one
        ids = req.output_ids[req.emitted_ids:]
        req.emitted_ids = len(req.output_ids)
        req.sink(RequestOutput(
            request_id=req.id, text=text, token_ids=ids, finished=final, finish_reason=reason,
            error=error, num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids)))

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request for any reason: free everything it holds, send its last output."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if reason in ("abort", "error"):
            self.role.on_abort(req)
        if req.pages:
            self.pool.free(req.pages)
            req.pages = []
        req.status = Status.FINISHED
        self.requests.pop(req.id, None)
        try:
            self.emit(req, final=True, reason=reason, error=error)
        except Exception:  # a sink that fails (client gone) must not stop the loop
            log.warning("could not deliver the end of %s: %s", req.id, traceback.format_exc())

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_pages_free": self.pool.num_free, "kv_pages_total": self.pool.num_pages,
                "preemptions": self.num_preemptions, **self.role.stats()}
