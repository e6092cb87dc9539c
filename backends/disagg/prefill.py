"""The prefill role: requests run their prompt (chunked when long) in the
normal loop and write each layer group's KV into the decode engine's pages as
soon as it is computed; the metadata follows the last write, then the request
leaves this engine.

    bootstrap (no `dest` yet) -> the scheduler's waiting queue -> prefill steps
        (layer hook: post KV writes per group) -> first token sampled
        -> shipping (worker: KV done -> metadata write) -> finished, pages freed

A prompt whose KV is written once, after its forward (shorter than
pipeline_min_tokens, see pipeline.py), runs while its destination is still on
the way (prefill_before_destination auto): decode admits requests only between
its forwards, so on a busy machine the destination comes 30-50 ms after the
request and the forward would wait for it. The KV goes out once both the
forward and the destination are done. Longer prompts wait in bootstrap for the
destination, so that their layer groups can be written while later layers
compute; so does every prompt with prefill_before_destination off.

Decode may hold the first pages of the prompt already (its prefix cache): its
destination then says how many tokens (`cached_tokens`, whole pages) and lists
pages for the rest only, and only those are written; on a full hit just the
metadata goes. This engine's own prefix cache (which pages it computes) is
independent of what decode holds.
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time

import torch

from backends.disagg import protocol
from backends.disagg.config import DisaggConfig
from backends.disagg.pipeline import SMALL_MODEL_LAYERS, layer_group_size, layer_groups
from backends.disagg.transport import KVTransport
from backends.disagg.worker import TransferWorker
from backends.model import LayerHook
from backends.request import Request, Status
from backends.role import EngineFacts, EngineOps, Fence, KeepPages
from backends.runner import Batch

log = logging.getLogger("tandem.prefill")
# How long a preemption waits for the writes still reading the victim's pages. On a
# CPU they finish as soon as the transfer thread has posted them; the scheduler needs
# the pages now, or it preempts more requests (the requester itself last).
PREEMPT_DRAIN_S = 0.5


def kv_written() -> "torch.cuda.Event":
    """An event on the forward's stream after the layer group's KV stores: NIXL may read the
    pages once it has passed. (A stream synchronize here kept the forward from launching the
    next group's kernels until the GPU had caught up.)"""
    event = torch.cuda.Event()
    event.record()
    return event


def prefill_agent_name(port: int, hostname: str | None = None) -> str:
    """Unique among the prefill engines of a deployment: one listens per host and port."""
    return f"tandem-prefill-{hostname or socket.gethostname()}-{port}"


class PrefillRole:
    carries_logprobs = True   # the first token's logprob travels with the KV
    ends_text = False         # decode streams the rest: a character cut here is not the end
    decodes = False           # after its first token a request leaves for the decode engine

    def __init__(self, cfg: DisaggConfig, facts: EngineFacts, engine: EngineOps,
                 worker: TransferWorker | None = None):
        """worker: a stand-in for the transfer worker (tests); by default one over a NIXL
        agent of this engine's own, listening on nixl_port."""
        self.cfg, self.facts, self.engine, self.pool = cfg, facts, engine, facts.kv_manager
        self.bootstrap: dict[int, Request] = {}         # room -> request whose destination has not come
        self.dests: dict[int, tuple[str, dict, float]] = {}  # room -> (decode peer, dest msg, arrival)
        self.shipping: dict[int, Request] = {}          # room -> request whose KV is on its way
        self.sent_pages: dict[int, int] = {}            # room -> pages already queued for writing
        self.holding: dict[int, threading.Event] = {}   # room -> set once no write reads its pages
        self.decode_queued: set[int] = set()            # rooms decode holds in its queue until KV is free
        # Rooms decode gave up before their request reached this engine; it is dropped on arrival.
        self.aborted: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.bytes_shipped = 0
        self.num_failed = 0
        self.fallback_logged = False
        self.meta = protocol.new_meta_buffer(cfg.meta_slots)
        self.slots = protocol.SlotPool(cfg.meta_slots)
        self.worker = worker or self._start_worker()

    def _start_worker(self) -> TransferWorker:
        transport = KVTransport(prefill_agent_name(self.cfg.nixl_port), self.facts.kv, self.meta,
                                listen_port=self.cfg.nixl_port)
        log.info("prefill NIXL agent %s listening on port %d", transport.name, transport.port)
        return TransferWorker(transport, self.facts.wake, self.cfg.transfer_timeout_s,
                              expecting=lambda: bool(self.bootstrap))

    def close(self) -> None:
        self.worker.stop()

    def identity(self) -> dict:
        """What a router pairs decode requests with: this engine's NIXL agent and port."""
        return {"agent": self.worker.transport.name, "nixl_port": self.worker.transport.port}

    # ---- the loop's hooks ----------------------------------------------------------
    def admit(self, req: Request) -> bool:
        if req.room is None:
            raise ValueError("a prefill request needs a bootstrap room")
        self.engine.hold(req, Status.BOOTSTRAPPING)
        self.bootstrap[req.room] = req
        req.admitted_at = time.monotonic()
        if req.room in self.aborted:  # decode gave it up before it got here
            del self.aborted[req.room]
            self.engine.finish(req, "abort")
        elif self._runs_before_destination(req):
            self.engine.enqueue(req)
        return True

    def _runs_before_destination(self, req: Request) -> bool:
        """Its KV is written after the forward anyway, so the forward need not wait for the destination."""
        return (self.cfg.prefill_before_destination == "auto"
                and layer_group_size(self.facts.num_layers, len(req.prompt_ids), self.cfg) == 0)

    def advance(self) -> None:
        for event in self.worker.take_events():
            try:
                self._on_event(*event)
            except Exception:  # one bad message must not lose the events after it
                log.exception("handling %s failed", event[0])
        for room in [r for r in self.bootstrap if r in self.dests]:
            self._on_dest(self.bootstrap.pop(room))
        self._expire()

    def on_sampled(self, req: Request) -> bool:
        """First token sampled: stream it, then ship the request (once its destination is here)."""
        self.engine.hold(req, Status.SHIPPING)
        if req.output_ids[-1] not in self.engine.stop_ids(req):
            req.detok.add(req.output_ids[-1])
        self.engine.emit(req)
        if req.room not in self.bootstrap:
            self._ship(req)
        return True

    def on_preempt(self, req: Request) -> Fence | None:
        """The request recomputes its prompt, so its KV is sent again (all that decode lacks); the writes
        queued so far still read its pages, which go back to the pool only once they finish."""
        if self.sent_pages.pop(req.room, None) is None:
            return None  # nothing was queued from these pages
        drained = self.worker.drain(req.room)
        if drained.wait(PREEMPT_DRAIN_S):
            return None
        log.warning("room %d preempted with KV writes in flight: its pages wait for them", req.room)
        return drained.is_set

    def on_abort(self, req: Request) -> KeepPages | None:
        self.bootstrap.pop(req.room, None)
        self.decode_queued.discard(req.room)
        dest = self.dests.pop(req.room, None)
        if dest is None:
            return None  # decode never gave a destination: nothing was written
        # writes may still read these pages: they go back once the worker says released
        self.shipping[req.room] = req
        released = self.holding[req.room] = threading.Event()
        self._give_up(dest[0], req.room, "the prefill engine aborted the request")
        return KeepPages(released.is_set)

    def layer_hook(self, batch: Batch):
        """Post each layer group's KV writes as soon as the group is computed."""
        plans = [p for p in (self._pages_to_send(req, n) for req, n in batch.items) if p]
        if not plans:
            return None
        avg = batch.num_tokens / len(batch.items)
        num_layers = self.facts.num_layers
        size = layer_group_size(num_layers, avg, self.cfg)
        if size == 0 and not self.fallback_logged:
            log.info("KV written after the forward for steps under %d tokens per request and for models of "
                     "%d layers or fewer (pipeline=%s, pipeline_group_size=%d, %d layers)",
                     self.cfg.pipeline_min_tokens, SMALL_MODEL_LAYERS, self.cfg.pipeline,
                     self.cfg.pipeline_group_size, num_layers)
            self.fallback_logged = True
        ends = {g.stop - 1: g for g in layer_groups(num_layers, size)}
        on_gpu = self.facts.device_type == "cuda"
        trace = self.worker.trace

        def after_group(i: int) -> None:
            if trace is not None:
                trace.append(("layer", i, time.monotonic()))
            ready = kv_written() if on_gpu else None  # the transfer thread waits for it, the forward goes on
            for room, peer, local, remote in plans:
                self.worker.write(room, peer, ends[i], local, remote, ready)
        return LayerHook(tuple(sorted(ends)), after_group)

    # ---- internals -----------------------------------------------------------------
    def _pages_to_send(self, req: Request, n: int):
        """Pages completed by this step (all remaining ones on the last chunk), each sent once."""
        if req.room in self.bootstrap:
            return None  # no destination yet: _ship writes these pages
        peer, dest, _ = self.dests[req.room]
        end = req.num_computed + n
        last = end >= len(req.prompt_ids)
        upto = self.pool.pages_for(end) if last else end // self.pool.page_size
        held = self._decode_holds(dest)   # dest["pages"] starts after them
        start = self.sent_pages.get(req.room, held)
        self.sent_pages[req.room] = max(start, upto)
        if upto <= start:
            return None
        return req.room, peer, req.pages[start:upto], dest["pages"][start - held:upto - held]

    def _decode_holds(self, dest: dict) -> int:
        """Prompt pages decode has in its cache: they are not sent."""
        return dest.get("cached_tokens", 0) // self.pool.page_size

    def _on_dest(self, req: Request) -> None:
        """Its destination came: check it, then run the prompt (or ship it, if it has run)."""
        peer, dest, _ = self.dests[req.room]
        held, pool = dest.get("cached_tokens", 0), self.pool
        problem = None
        if dest.get("prompt_len") != len(req.prompt_ids):
            problem = f"prompt length differs: {len(req.prompt_ids)} tokens here, {dest.get('prompt_len')} on decode"
        elif not (isinstance(held, int) and 0 <= held <= len(req.prompt_ids) and held % pool.page_size == 0):
            problem = f"decode holds {held!r} prompt tokens: not whole pages of the prompt"
        elif len(dest.get("pages", [])) < (need := pool.pages_for(len(req.prompt_ids)) - held // pool.page_size):
            problem = f"decode gave {len(dest.get('pages', []))} pages, the prompt needs {need}"
        if problem:
            self.dests.pop(req.room)
            self._give_up(peer, req.room, f"prefill refused the room: {problem}")
            self.engine.finish(req, "error", error=f"prefill refused room {req.room}: {problem}")
        elif req.output_ids:
            self._ship(req)
        elif req.status is Status.BOOTSTRAPPING:
            self.engine.enqueue(req)

    def _ship(self, req: Request) -> None:
        """Write the pages the layer hook has not (the prompt ran before its destination
        came), then the metadata after the last KV write."""
        slot = self.slots.take()
        if slot is None:
            self.engine.finish(req, "error", error="no free metadata slot on the prefill engine")
            return
        req.meta_slot = slot
        protocol.write_meta_row(self.meta, slot, req.room, req.output_ids[-1], req.last_logprob,
                                len(req.prompt_ids))
        peer, dest, _ = self.dests[req.room]
        rest = self._pages_to_send(req, 0)  # the whole prompt is computed: every page not queued yet
        if rest is not None:
            _, _, local, remote = rest
            self.worker.write(req.room, peer, range(self.facts.num_layers), local, remote)
        self.shipping[req.room] = req
        self.worker.finish(req.room, peer, slot, dest["slot"])

    def _on_event(self, kind: str, *args) -> None:
        if kind == "message":
            peer, msg = args
            self._on_message(peer, msg)
        elif kind in ("shipped", "released", "failed"):
            room, detail = args
            req = self.shipping.pop(room, None)
            self.sent_pages.pop(room, None)
            self.dests.pop(room, None)
            if req is None and kind == "failed":  # a write failed while the prompt still runs
                req = self._running(room)
                if req is not None:
                    self.num_failed += 1
                    self.engine.finish(req, "error", error=detail)
                return
            if req is None:
                return
            self._release(req)
            if kind == "shipped":
                self.bytes_shipped += detail
                self.engine.finish(req, "stop")
            elif kind == "failed":
                self.num_failed += 1
                self.engine.finish(req, "error", error=detail)

    def _on_message(self, peer: str, msg: dict) -> None:
        room, kind = msg["room"], msg["kind"]
        if kind == "dest":
            self.decode_queued.discard(room)
            self.dests[room] = (peer, msg, time.monotonic())
        elif kind == "queued":
            self.decode_queued.add(room)
        elif kind == "abort":
            self.decode_queued.discard(room)
            req = self.bootstrap.get(room) or self._running(room) or self.shipping.get(room)
            if req is not None:
                self.engine.finish(req, "abort")
                return
            if self.dests.pop(room, None) is None:
                self._remember_aborted(room)
            self.worker.cancel(room, peer)  # says released (at once: nothing of it is in flight)

    def _give_up(self, peer: str, room: int, message: str) -> None:
        """Tell decode the room failed, then `released` once no write for it is in flight:
        until then decode keeps the pages it gave the room."""
        self.worker.send(peer, protocol.encode("error", room, msg=message), room)
        self.worker.cancel(room, peer)

    def _remember_aborted(self, room: int) -> None:
        self.aborted[room] = None
        while len(self.aborted) > 10_000:
            self.aborted.popitem(last=False)

    def _running(self, room: int) -> Request | None:
        return next((r for r in self.engine.scheduled() if r.room == room), None)

    def _release(self, req: Request) -> None:
        if req.meta_slot is not None:
            self.slots.give(req.meta_slot)
            req.meta_slot = None
        released = self.holding.pop(req.room, None)
        if released is not None:
            released.set()

    def _expire(self) -> None:
        now, limit = time.monotonic(), self.cfg.transfer_timeout_s
        for room, req in list(self.bootstrap.items()):
            if now - req.admitted_at > limit and room not in self.decode_queued:  # a queued room waits
                self.bootstrap.pop(room)
                self.engine.finish(req, "error", error=f"no KV destination from the decode engine within {limit:g}s")
        # A destination for a request this engine never got: decode's own timer, started before it
        # sent the destination, fails the request and aborts the room; this is the backstop for a
        # decode that went silent, so it waits twice as long and never speaks first.
        for room, (peer, _, at) in list(self.dests.items()):
            if now - at > 2 * limit and room not in self.shipping and self._running(room) is None \
                    and room not in self.bootstrap:
                self.dests.pop(room)
                self._give_up(peer, room, "the prefill engine never got this request")

    def stats(self) -> dict:
        return {"kv_bytes_sent": self.bytes_shipped, "kv_write_seconds": self.worker.write_seconds,
                "transfer_failures": self.num_failed,
                "bootstrapping": len(self.bootstrap), "shipping": len(self.shipping)}
