"""The scheduler and its one event loop, whatever the role.

    loop:
        take new requests and aborts          (_take_inbox)
        role-specific queues advance          (role.advance)
        batch = schedule()                    (decodes and prefill chunks in one token budget)
        launch(batch)                         (inputs built; forward + sample)
        complete(step)                        (stream, finish, free)

With `overlap` off a step is launched and completed in one turn. With it on, the
forward and the sampling run on a forward thread: the loop launches step N+1, then
completes step N while N+1 computes. A decode's input token in step N+1 is the token
step N is still sampling (a future, `Request.futures`), resolved on the forward thread
when N+1 starts, so no token waits on the loop. When every row of step N is a plain
greedy pick, N+1 takes N's tokens where they were computed (on a GPU, without waiting for
them to reach the host), so the forwards follow each other with no wait between. A
request that finishes at step N drops what N+1 computed for it, and its pages go back
only after N+1's forward has ended (on the device too).

Roles (colocated, prefill, decode) differ only in where requests come from and
where finished prefills go (`backends.role`); they plug into this loop. A role asks
the scheduler for what it may (`EngineOps`: the methods under "what roles call"), and
its hooks return decisions the scheduler carries out (which pages to keep, and until when).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from backends import dllm
from backends.config import EngineConfig
from backends.cuda_graphs import GraphHead
from backends.kv_cache import Fence, Match
from backends.request import Request, RequestOutput, Status, TokenLogprob
from backends.role import ColocatedRole, KeepPages, Role
from backends.runner import Batch, ModelRunner, StepInputs
from backends.sampler import LogitsRows, RowsFailed, sample
from kernels.greedy_head import DeviceGreedyHead, PendingTokens, launch_argmax

log = logging.getLogger("tandem.scheduler")
KEPT_STEPS = 4   # steps whose sampled tokens the forward thread keeps for later steps' futures


@dataclass
class Step:
    """A launched batch: its number, and its result once the forward thread has it:
    (tokens, logprobs, per-row errors) or the exception that failed the step."""

    number: int
    batch: Batch
    result: Future
    epochs: list[int]   # each item's kv_epoch at the launch (a preemption since makes its pages others)


# How often a loop that waits for the cores looks again (new requests and transfer events
# wake it sooner)
TURN_POLL_S = 0.005
# A DP rank's idle turn: a request that arrives at another rank waits for it (TTFT)
DP_IDLE_TURN_S = 0.005


class Scheduler:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, eos_ids: tuple[int, ...]):
        self.cfg, self.runner, self.pool = cfg, runner, runner.pool
        self.eos_ids = list(eos_ids)
        # The engine puts its role here once the scheduler exists: a role is built from the
        # scheduler's operations (backends.engine.make_role)
        self.role: Role = ColocatedRole()
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Aborts of ids not seen yet: a cancel can overtake its request (the router sends it as
        # a request of its own), and the request is then ended as soon as it arrives.
        self.early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self.num_preemptions = 0
        # Prefix cache: prompt tokens of admitted requests looked up, and found (vLLM's counters)
        self.caching = cfg.caches_prefixes
        self.prefix_queries = self.prefix_hits = 0
        # A block-diffusion model (backends.dllm): its block size, else 0.
        self.dllm_block, self.mask_id = runner.model.cfg.dllm_block_size, runner.model.cfg.mask_token_id
        self.last_dllm_mode = "prefill"
        self.dp = None  # backends.dp.DpStep when this engine is one rank of a DP-attention group
        self.overlap = cfg.overlaps and not self.dllm_block
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-forward") if self.overlap else None
        self.in_flight: Step | None = None
        self.steps_launched = 0
        self.forward_done = -1     # the last step whose forward has finished (on the device too)
        self._done_lock = threading.Lock()
        # step -> its tokens, on the host or pending on the device (forward thread only)
        self.sampled: dict[int, list[int] | PendingTokens] = {}

    # ---- called from other threads -------------------------------------------------
    def submit(self, req: Request) -> None:
        self._inbox.append(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        if self._forward_thread is not None:
            self._forward_thread.shutdown(wait=True)

    # ---- what roles call (backends.role.EngineOps, on the loop's thread) ----------------
    def enqueue(self, req: Request) -> None:
        """A request the role held is ready for its prefill."""
        req.status = Status.WAITING
        self.waiting.append(req)

    def join_running(self, req: Request, num_computed: int) -> None:
        """A request whose KV for num_computed tokens is already here (prebuilt) joins the decode batch."""
        req.status, req.num_computed = Status.RUNNING, num_computed
        self.running.append(req)

    def has_room(self) -> bool:
        return len(self.running) < self.cfg.max_running_requests

    def hold(self, req: Request, status: Status) -> None:
        """The role holds a request in its own queue (status says which): it is not scheduled
        here, or no longer (pages stay with it)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status

    def after_step(self, step: int) -> Fence | None:
        """The fence "step's forward is done" (None: it is)."""
        return None if step <= self.forward_done else (lambda: self.forward_done >= step)

    def check_kv(self) -> None:
        """The KV manager's integrity check, the holders being the live requests."""
        self.pool.check_integrity([req.pages for req in self.requests.values()])

    def scheduled(self) -> list[Request]:
        """Requests running or waiting for a step, in that order (read only)."""
        return self.running + list(self.waiting)

    # ---- the loop ------------------------------------------------------------------
    def step(self, wait_s: float = 0.05) -> bool:
        """One turn of the loop; returns whether a step was launched or completed."""
        self._wake.clear()
        self._take_inbox()
        self.role.advance()
        self._wait_for_cores()
        self._free_deferred()
        batch = self.schedule()
        if self.dp is not None:  # every rank takes this turn: an idle batch keeps the collectives in step
            batch = self.dp.agree(batch)
        launched = self._launch(batch) if batch is not None else None
        if self.runner.turns is not None and (launched is None or launched.result.done()):
            self.runner.turns.unmark()   # a wait with no forward after it must not hold prefill back
        done, self.in_flight = (self.in_flight, launched) if self.overlap else (launched, None)
        if done is not None:
            self._complete(done)
        elif launched is None:
            # new requests, aborts and transfer events wake it early; a DP rank cannot be woken
            # by another rank's request, and every rank takes every turn: short turns
            self._wake.wait(wait_s if self.dp is None else min(wait_s, DP_IDLE_TURN_S))
        return done is not None or launched is not None

    def _wait_for_cores(self) -> None:
        """Where engines take turns at the cores (backends.cores) and another engine's forward
        holds them, a forward launched now would only wait, and the loop with it. Wait here
        instead, taking new requests and the role's events as they come: decode hands out KV
        destinations at once, and requests whose KV landed join the next step. (Blocked in the
        turn, decode took a new request 117 ms after the router sent it, p50 at 8 streams.)
        Not for an engine that goes first (prefill): its place in the queue is held by
        waiting inside the turn. The wait is marked (backends.cores), so a burst of prompts
        does not hold this engine's requests back for the whole burst."""
        turns = self.runner.turns
        if turns is None or turns.first or self.in_flight is not None or not (self.running or self.waiting):
            return
        if turns.busy():
            turns.mark_waiting()   # the next prefill forward lets this engine's forward go first
        while turns.busy():
            self._wake.wait(TURN_POLL_S)
            self._wake.clear()
            self._take_inbox()
            self.role.advance()

    def _launch(self, batch: Batch) -> Step:
        """Inputs built here; the forward and sampling run now (overlap off) or on the
        forward thread (on). Progress counts from the launch, so the next schedule sees it."""
        number, self.steps_launched = self.steps_launched, self.steps_launched + 1
        hook = self.role.layer_hook(batch)
        epochs = [req.kv_epoch for req, _ in batch.items]
        banned = [] if self.dllm_block else [self._banned(req) for req in batch.samples]
        try:
            inputs = self.runner.prepare(batch)
        except Exception as exc:
            result = Future()
            result.set_exception(exc)
            return Step(number, batch, result, epochs)
        for row, req in enumerate(batch.samples if not self.dllm_block else []):  # a block has no futures
            req.futures.append((number, row))
        for req, n in batch.items:
            req.num_computed += n
            req.last_step = number
        args = (number, batch, inputs, hook, banned)
        if self._forward_thread is not None:
            return Step(number, batch, self._forward_thread.submit(self._forward, *args), epochs)
        result = Future()
        try:
            result.set_result(self._forward(*args))
        except Exception as exc:
            result.set_exception(exc)
        return Step(number, batch, result, epochs)

    def _forward(self, number: int, batch: Batch, inputs: StepInputs, hook, banned: list[list[int]]):
        """Resolve the futures, run the forward, sample (the forward thread when overlap is on).
        A step whose tokens feed the next on the device returns them pending: its forward ends
        on the device later (`_wait_pending`)."""
        pending = None
        try:
            self._take_futures(inputs)
            if self.dp is not None:
                self.dp.begin_forward(batch)
            # sampling (the lm_head: a fifth of the default model's weights) is compute too:
            # the core turn covers it, or it would run beside another engine's forward
            with torch.inference_mode(), self.runner.turns or contextlib.nullcontext():
                hidden = self.runner.forward(inputs, hook)
                if not batch.samples:
                    return [], None, {}
                if self.dllm_block:  # every position of each block: the reveal is the loop's
                    return self.runner.model.logits(hidden), None, {}
                if self._feeds_on_device(batch):
                    pending = self._launch_greedy(hidden, inputs.head, batch.samples, banned)
                    tokens, logprobs, errors = pending, None, {}
                else:
                    # a step that a graph ran has its logits: sample those, not the head again
                    head = inputs.head
                    model, rows = (LogitsRows(head.logits, head.tokens), head.logits) if head is not None \
                        else (self.runner.model, hidden)
                    try:
                        tokens, logprobs = sample(model, rows, batch.samples, banned, self.role.carries_logprobs)
                        errors = {}
                    except RowsFailed as exc:  # one row's failure must not cost its neighbours their token
                        tokens, logprobs, errors = exc.tokens, exc.logprobs, exc.errors
            self.sampled[number] = tokens
            self.sampled.pop(number - KEPT_STEPS, None)
            return tokens, logprobs, errors
        finally:
            if pending is None or pending.done is None:
                self._forward_finished(number)

    def _take_futures(self, inputs: StepInputs) -> None:
        """Each input token that an earlier step was still sampling: written from its tokens on
        the host, or fed from its tokens on the device when that step left them pending."""
        host, fed = [], {}
        for index, (step, row) in inputs.futures:
            tokens = self.sampled.get(step)
            if isinstance(tokens, PendingTokens):
                _, indices, rows = fed.setdefault(step, (tokens.device, [], []))
                indices.append(index)
                rows.append(row)
                continue
            # a failed step sampled nothing; its requests are finished and these rows dropped
            inputs.ids[index] = tokens[row] if tokens is not None else 0
            host.append((index, (step, row)))
        inputs.futures, inputs.fed = host, list(fed.values())

    def _feeds_on_device(self, batch: Batch) -> bool:
        """Overlap's fast path: every row a plain greedy pick (no logprobs, no penalties: nothing
        the host must know before the next step samples), so the next step takes these tokens
        where they are computed and no step waits for the host between two forwards."""
        return self.overlap and self.dp is None and not self.role.carries_logprobs and \
            all(req.params.plain_greedy for req in batch.samples)

    def _launch_greedy(self, hidden: torch.Tensor, graph_head: GraphHead | None, samples: list[Request],
                       banned: list[list[int]]) -> PendingTokens:
        if graph_head is not None:  # the graph took the logits' argmax already
            return launch_argmax(graph_head.logits, banned, graph_head.tokens)
        head = self.runner.model.greedy_head
        if isinstance(head, DeviceGreedyHead):
            return head.launch(hidden, banned)
        tokens, _ = sample(self.runner.model, hidden, samples, banned, False)  # done when it returns
        return PendingTokens(torch.tensor(tokens, dtype=torch.long))

    def _forward_finished(self, number: int) -> None:
        with self._done_lock:  # the forward thread and the loop both move it, forward only
            self.forward_done = max(self.forward_done, number)

    def _wait_pending(self, number: int, pending: PendingTokens) -> list[int]:
        try:
            return pending.wait()
        finally:
            self._forward_finished(number)

    def _wait_forward(self, step: Step) -> None:
        """Until the step's forward has ended, on the device too."""
        if step.result.exception() is None and isinstance(tokens := step.result.result()[0], PendingTokens):
            self._wait_pending(step.number, tokens)

    def _banned(self, req: Request) -> list[int]:
        """Its stop ids until min_tokens (counting tokens still being sampled)."""
        ids = self.stop_ids(req)
        return ids if ids and req.num_generated < req.params.min_tokens else []

    def _complete(self, step: Step) -> None:
        try:
            tokens, logprobs, errors = step.result.result()
            if isinstance(tokens, PendingTokens):
                tokens = self._wait_pending(step.number, tokens)
        except Exception as exc:  # a bad batch must not take the engine down
            log.error("step failed: %s", "".join(traceback.format_exception(exc)))
            self._forget(step)
            for req, _ in step.batch.items:
                self.finish(req, "error", error=f"internal error: {exc}")
            return
        self._cache_written(step)
        self._free_deferred()
        self.process(step, tokens, logprobs, errors)

    def _forget(self, step: Step) -> None:
        for req in step.batch.samples:
            req.futures = [f for f in req.futures if f[0] != step.number]

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
        if self.dllm_block:
            return self._schedule_dllm()
        budget = self.cfg.step_budget(sum(1 for req in self.running if req.num_pending == 1))
        items = []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING or not self._wants_step(req):
                continue  # preempted by an earlier request of this step, or nothing to compute
            n = min(req.num_pending, budget, self.cfg.chunk_size)
            if n > 0 and self._grow(req, n, preempt=True):
                items.append((req, n))
                budget -= n
        later = []   # waiting for pages a running request is computing
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            self._match(req, len(req.prompt_ids) + len(req.output_ids) - 1)
            if self._computing_its_prefix(req):
                self._unmatch(req)
                later.append(self.waiting.popleft())
                continue
            n = min(req.num_pending, budget, self.cfg.chunk_size)
            if not self._grow(req, n, preempt=False):
                self._unmatch(req)
                break
            items.append((self._admit(), n))
            budget -= n
        self.waiting.extendleft(reversed(later))
        return Batch(items) if items else None

    def _admit(self) -> Request:
        """The head of the waiting queue joins the running batch."""
        req = self.waiting.popleft()
        req.status = Status.RUNNING
        self.running.append(req)
        if req.num_cached_tokens is None:  # its first admission (a preempted request was counted)
            req.num_cached_tokens = req.num_computed
            if self.caching:
                self.prefix_queries += len(req.prompt_ids)
                self.prefix_hits += req.num_computed
        return req

    # ---- the prefix cache ------------------------------------------------------------
    def _match(self, req: Request, limit: int, multiple: int = 1) -> None:
        """Before its admission: the longest cached run of full pages (a multiple of
        `multiple`) of its first `limit` tokens (never all of its tokens: the last one is
        computed, so there are logits to sample from) becomes its first pages; it computes
        from there."""
        if req.pages:
            return
        pages = max(0, limit) // self.pool.page_size if self.caching else 0
        found = self.pool.match(req.token_slice(0, pages * self.pool.page_size), req.cache_salt, pages, multiple)
        req.pages, req.num_computed = found.pages, found.num_tokens
        req.cached_pages, req.cache_parent = len(found.pages), found.parent

    def _computing_its_prefix(self, req: Request) -> bool:
        """True while a running request computes full pages of this request's prompt that the
        cache does not hold yet. It waits for them (a step or a few) rather than computing
        them again: requests that arrive together with one system prompt compute it once."""
        if not self.caching:
            return False
        size, matched = self.pool.page_size, req.cached_pages
        limit = (len(req.prompt_ids) + len(req.output_ids) - 1) // size
        for other in self.running:
            if other.cache_salt != req.cache_salt or other.cached_pages >= limit or other.block is not None:
                continue
            have = max(matched, other.cached_pages)   # pages the cache holds (or will not)
            if have < min(limit, other.num_tokens // size):   # other computes a page past them
                past = (have + 1) * size                       # and it is this request's next one
                if req.token_slice(0, past) == other.token_slice(0, past):
                    return True
        return False

    def _unmatch(self, req: Request) -> None:
        """Not admitted after all: it holds nothing while it waits."""
        self.pool.release(req.pages)
        req.pages, req.num_computed, req.cached_pages = [], 0, 0

    def _cache_written(self, step: Step) -> None:
        """Full pages whose KV this step's forward completed enter the cache (the forward is
        done: never while it is in flight). A diffusion block's positions count once final."""
        if not self.caching:
            return
        for (req, n), start, epoch in zip(step.batch.items, step.batch.starts, step.epochs):
            if req.status is Status.FINISHED or req.kv_epoch != epoch:
                continue  # its pages went back, or it was preempted after the launch
            self.cache_pages(req, start + n if req.block is None else min(start + n, req.block_start))

    def cache_pages(self, req: Request, end: int) -> None:
        """The full pages of its first `end` positions, their KV written, enter the cache."""
        size = self.pool.page_size
        while req.cached_pages < min(end // size, len(req.pages)):
            i = req.cached_pages
            tokens = req.token_slice(i * size, (i + 1) * size)
            if any(isinstance(t, tuple) for t in tokens):
                break  # a token still being sampled (cannot be: its step ended before this one)
            req.cache_parent = self.pool.cache(req.pages[i], req.cache_parent, tokens)
            req.cached_pages += 1

    def give_pages(self, req: Request, held: Match, new: list[int]) -> None:
        """A role's request gets its KV pages: the cached ones it matched, then new ones."""
        req.pages = held.pages + new
        req.cached_pages, req.cache_parent = len(held.pages), held.parent

    def _schedule_dllm(self) -> Batch | None:
        """Block diffusion: denoising work and prefill work (whole prompt blocks) never share a
        step; with both waiting they take turns, and a kind that cannot run this step (no
        pages) leaves the step to the other. dllm_mixed_batches on puts them together, kept
        to measure what mixing costs."""
        if self.cfg.dllm_mixed_batches == "on":
            kinds = ["both"]
        else:
            kinds = ["decode", "prefill"] if self.last_dllm_mode == "prefill" else ["prefill", "decode"]
        for kind in kinds:
            items = self._dllm_items(kind)
            if items:
                self.last_dllm_mode = kind
                return Batch(items)
        return None

    def _dllm_items(self, kind: str) -> list[tuple[Request, int]]:
        block = self.dllm_block
        budget = self.cfg.step_budget(sum(r.num_pending for r in self.running if not dllm.in_prefill(r, block)))
        wanted = lambda req: kind == "both" or dllm.in_prefill(req, block) == (kind == "prefill")
        size = lambda req: self._dllm_chunk(req, budget) if dllm.in_prefill(req, block) else req.num_pending
        items = []
        for req in list(self.running):
            if req.status is Status.RUNNING and wanted(req) and 0 < (n := size(req)) <= budget \
                    and self._grow(req, n, preempt=True):
                items.append((req, n))
                budget -= n
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if req.block is None:
                dllm.start(req, block, self.mask_id)
            self._match(req, *dllm.reusable_prefix(req, block, self.pool.page_size))
            if not wanted(req) or not 0 < (n := size(req)) <= budget or not self._grow(req, n, preempt=False):
                self._unmatch(req)
                break
            items.append((self._admit(), n))
            budget -= n
        return items

    def _dllm_chunk(self, req: Request, budget: int) -> int:
        """Prompt tokens of a prefill step: whole blocks, so a block is never cut."""
        block = self.dllm_block
        n = min(dllm.prefill_end(req, block) - req.num_computed, self.cfg.chunk_size, budget)
        return max(n // block * block, block if budget >= block else 0)

    def _wants_step(self, req: Request) -> bool:
        """Whether computing its next token can matter: not when a sample in flight already
        ends it (max_tokens, the context) or leaves this engine (a role that does not decode)."""
        if not req.futures:
            return True
        return self.role.decodes and req.num_generated < req.params.max_tokens \
            and req.num_tokens < self.runner.max_context

    def _grow(self, req: Request, n: int, preempt: bool) -> bool:
        """Give req pages for n more tokens; preempt the latest running requests if needed."""
        need = self.pool.pages_for(req.num_computed + n) - len(req.pages)
        while need > self.pool.num_available:
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
        if self.in_flight is not None and req.last_step > self.forward_done:
            self._wait_forward(self.in_flight)  # its pages are still read: let that forward end
        self.pool.release(req.pages, self.role.on_preempt(req))  # a role's transfer may still read them
        req.pages, req.num_computed, req.status = [], 0, Status.WAITING
        req.cached_pages, req.kv_epoch = 0, req.kv_epoch + 1
        self.waiting.appendleft(req)

    def _free_deferred(self) -> None:
        self.pool.collect()

    # ---- results -------------------------------------------------------------------
    def process(self, step: Step, tokens: list[int], logprobs: list[TokenLogprob | None] | None, errors: dict) -> None:
        if self.dllm_block:
            return self._process_dllm(step, tokens)
        for row, (req, token) in enumerate(zip(step.batch.samples, tokens)):
            if (step.number, row) in req.futures:
                req.futures.remove((step.number, row))
            if req.status is Status.FINISHED:
                continue  # ended while this step was in flight: its token is dropped
            if row in errors:
                log.warning("request %s could not be sampled: %s", req.id, errors[row])
                self.finish(req, "error", error=f"sampling this request failed: {errors[row]}")
            else:
                self.append_token(req, token, logprobs[row] if logprobs else None, self.stop_ids(req))

    def _process_dllm(self, step: Step, logits: torch.Tensor) -> None:
        """Reveal each block's confident positions; a block without masks is output."""
        offset = 0
        for req in step.batch.samples:
            rows, offset = logits[offset:offset + len(req.block)], offset + len(req.block)
            if req.status is Status.FINISHED:
                continue
            req.num_computed = req.block_start  # the block's own KV counts once the block is final
            try:
                req.block = dllm.reveal(rows, req.block, self.mask_id, self.cfg.dllm_threshold)
                if dllm.block_done(req.block, self.mask_id):
                    self._dllm_output(req)
            except Exception as exc:
                log.error("request %s failed after its step: %s", req.id, traceback.format_exc())
                self.finish(req, "error", error=f"internal error: {exc}")

    def _dllm_output(self, req: Request) -> None:
        """A finished block: its tokens after the prompt are output (up to eos, max_tokens, a
        stop string), one response; then the next block starts."""
        stop_ids = self.stop_ids(req)
        for token in req.block[max(0, len(req.prompt_ids) - req.block_start):]:
            if token in stop_ids:
                return self.finish(req, "stop")  # the end id is not output (the definition)
            req.output_ids.append(token)
            if reason := self._end_reason(req, token):
                return self.finish(req, reason)
        self.emit(req)
        req.block_start += len(req.block)
        req.block = [self.mask_id] * self.dllm_block

    def append_token(self, req: Request, token: int, logprob: TokenLogprob | None, stop_ids: list[int]) -> None:
        """Take a sampled token; a failure here (detokenizing, a stop check, a role's hand-off)
        ends only this request."""
        try:
            self._append_token(req, token, logprob, stop_ids)
        except Exception as exc:
            log.error("request %s failed after sampling: %s", req.id, traceback.format_exc())
            self.finish(req, "error", error=f"internal error: {exc}")

    def stop_ids(self, req: Request) -> list[int]:
        """end_id or the model's EOS ids (none with ignore_eos), and the request's stop_token_ids."""
        p = req.params
        eos = [] if p.ignore_eos else [p.end_id] if p.end_id is not None else self.eos_ids
        return eos + list(p.stop_token_ids) if p.stop_token_ids else eos

    def _append_token(self, req: Request, token: int, logprob: TokenLogprob | None, stop_ids: list[int]) -> None:
        req.output_ids.append(token)
        req.last_logprob = logprob
        if req.params.logprobs is not None:
            req.output_logprobs.append(logprob.as_vllm(token, req.detok.token_text))
        if self.role.on_sampled(req):
            return
        if token in stop_ids and req.params.include_stop_str_in_output:
            req.detok.add(token)   # its text stays (vLLM: include_stop_str_in_output covers stop ids too)
        reason = "stop" if token in stop_ids else self._end_reason(req, token)
        if reason:
            self.finish(req, reason)
        else:
            self.emit(req)

    def _end_reason(self, req: Request, token: int) -> str | None:
        """Why the request ends with `token`, just appended and not a stop id (None: it goes on)."""
        req.detok.add(token)
        if req.detok.stopped:
            return "stop"
        if len(req.output_ids) >= req.params.max_tokens \
                or len(req.prompt_ids) + len(req.output_ids) >= self.runner.max_context:
            return "length"
        return None

    def emit(self, req: Request, final: bool = False, reason: str | None = None,
             error: str | None = None) -> None:
        text = req.detok.take(final, flush=self.role.ends_text)
        if not (text or final):
            return  # a token that ends inside a character waits for the next one
        ids = req.output_ids[req.emitted_ids:]
        logprobs = req.output_logprobs[req.emitted_ids:] if req.params.logprobs is not None else None
        req.emitted_ids = len(req.output_ids)
        req.sink(RequestOutput(
            request_id=req.id, text=text, token_ids=ids, finished=final, finish_reason=reason,
            error=error, num_prompt_tokens=len(req.prompt_ids), num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached_tokens or 0, logprobs=logprobs))

    def finish(self, req: Request, reason: str, error: str | None = None, keep: KeepPages | None = None) -> None:
        """End a request for any reason: free everything it holds, send its last output.
        keep: the pages the role's transfers still touch (a role that ends a request itself
        says so here; for aborts and errors the role's on_abort says it too)."""
        if req.status is Status.FINISHED:
            return
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if reason in ("abort", "error"):
            keep = self.role.on_abort(req) or keep
        self._release(req, keep)
        req.status = Status.FINISHED
        self.requests.pop(req.id, None)
        try:
            self.emit(req, final=True, reason=reason, error=error)
        except Exception:  # a sink that fails (client gone) must not stop the loop
            log.warning("could not deliver the end of %s: %s", req.id, traceback.format_exc())

    def _release(self, req: Request, keep: KeepPages | None) -> None:
        """Its pages go back once the last forward that reads them is done, and those the role
        keeps once its transfers are done with them too."""
        forward = self.after_step(req.last_step)
        first = len(req.pages) if keep is None else keep.first
        if req.pages[:first]:
            self.pool.release(req.pages[:first], forward)
        if req.pages[first:]:
            until = keep.until
            self.pool.release(req.pages[first:], until if forward is None else lambda: until() and forward())
        req.pages = []

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_pages_free": self.pool.num_free, "kv_pages_total": self.pool.num_pages,
                "kv_pages_cached": self.pool.num_cached, "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits,
                "preemptions": self.num_preemptions, **self.role.stats(),
                **(self.dp.stats() if self.dp is not None else {})}
