"""The decode role: requests reserve KV here, have the prefill engine write
their prompt's KV into it, then join the running decode batch without a
forward (a prebuilt batch: the first token comes from the metadata).

    prealloc (handshake, wait for KV) -> transfer (wait for `done`)
        -> prebuilt (first token from the metadata) -> running

The prealloc queue has no timeout (an overloaded engine queues, it does not
fail): transfer_timeout_s counts from the moment KV is reserved. A request that
fails while the prefill engine may still be writing into its pages leaves them
in quarantine until the prefill side says `released` (or the timeout passes).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import uuid

from backends.disagg import protocol
from backends.disagg.config import DisaggConfig
from backends.disagg.prefill import prefill_agent_name
from backends.disagg.transport import KVTransport
from backends.disagg.worker import TransferWorker
from backends.request import Request, Status

log = logging.getLogger("tandem.decode")
PING_S = 0.5


class DecodeRole:
    carries_logprobs = False
    ends_text = True
    decodes = True

    def __init__(self, cfg: DisaggConfig):
        self.cfg = cfg
        self.host, self.port = cfg.prefill_host_port
        self.peer = prefill_agent_name(self.port)
        self.peer_state = "new"        # new | connecting | ready | failed
        self.peer_error = ""
        self.prealloc: list[Request] = []
        self.landed: collections.deque = collections.deque()  # (request, first token, logprob): KV here, no room yet
        self.transfer: dict[int, Request] = {}            # room -> request whose KV is on its way
        # room -> (set once prefill writes no more, pages, slot, since): its pages wait for it
        self.quarantine: dict[int, tuple[threading.Event, int, int | None, float]] = {}
        self.announced: set[int] = set()   # prealloc rooms the prefill side was told are queued
        self.last_ping = 0.0
        self.num_failed = 0

    def attach(self, scheduler) -> None:
        self.scheduler, self.pool = scheduler, scheduler.pool
        self.meta = protocol.new_meta_buffer(self.cfg.meta_slots)
        self.slots = protocol.SlotPool(self.cfg.meta_slots)
        transport = KVTransport(f"tandem-decode-{uuid.uuid4().hex[:8]}", scheduler.runner.kv, self.meta,
                                listen_port=None)
        self.worker = TransferWorker(transport, scheduler.wake, self.cfg.transfer_timeout_s,
                                     expecting=lambda: bool(self.transfer))

    def close(self) -> None:
        self.worker.stop()

    def identity(self) -> dict:
        return {}

    # ---- the loop's hooks ----------------------------------------------------------
    def admit(self, req: Request) -> bool:
        if req.room is None:
            raise ValueError("a decode request needs a bootstrap room")
        req.status = Status.PREALLOCATING
        self.prealloc.append(req)
        return True

    def advance(self) -> None:
        for event in self.worker.take_events():
            try:
                self._on_event(*event)
            except Exception:  # one bad message must not lose the events after it
                log.exception("handling %s failed", event[0])
        if self.prealloc and self.peer_state in ("new", "failed"):
            self._dial()
        self._join_landed()
        if self.peer_state == "ready":
            self._allocate()
        self._expire()
        self._ping()

    def layer_hook(self, batch) -> None:
        return None

    def on_sampled(self, req: Request) -> bool:
        return False

    def on_preempt(self, req: Request) -> None:
        """Nothing to do: a running request's KV has all landed, nothing else touches its pages."""

    def on_abort(self, req: Request) -> None:
        if req in self.prealloc:
            self.prealloc.remove(req)
        self.landed = collections.deque(entry for entry in self.landed if entry[0] is not req)
        if self.transfer.pop(req.room, None) is not None:
            self._hold(req)
            self._send("abort", req.room)
        elif req.room in self.announced:
            self._send("abort", req.room)  # the prefill side waits for its destination without a timeout
        self.announced.discard(req.room)

    def _hold(self, req: Request) -> None:
        """Prefill may still write into these pages: they go back once it says released."""
        released = threading.Event()
        self.pool.release(req.pages, released.is_set)
        self.quarantine[req.room] = (released, len(req.pages), req.meta_slot, time.monotonic())
        req.pages, req.meta_slot = [], None

    # ---- prealloc ------------------------------------------------------------------
    def _dial(self) -> None:
        self.peer_state = "connecting"
        self.worker.connect(self.peer, self.host, self.port, self.cfg.handshake_timeout_s)

    def _allocate(self) -> None:
        while self.prealloc:
            req = self.prealloc[0]
            now, later = self._pages_needed(req)
            if now > self.pool.num_pages:
                self.prealloc.pop(0)
                self._fail(req, f"the prompt needs {now} KV pages, the decode engine has {self.pool.num_pages}")
                continue
            if self.pool.num_available - self._reserved() < now + later:
                break  # the head waits for KV; requests keep their order
            slot = self.slots.take()
            if slot is None:
                break
            self.prealloc.pop(0)
            self.announced.discard(req.room)
            req.pages, req.meta_slot = self.pool.allocate(now), slot
            req.admitted_at = time.monotonic()  # the transfer timeout counts from here
            self.meta[slot].zero_()
            self.transfer[req.room] = req
            req.status = Status.RECEIVING
            self._send("dest", req.room, pages=req.pages, slot=slot, prompt_len=len(req.prompt_ids))
        for req in self.prealloc:
            if req.room not in self.announced:  # so that the prefill side waits for it as long as it takes
                self.announced.add(req.room)
                self._send("queued", req.room)

    def _pages_needed(self, req: Request) -> tuple[int, int]:
        """Pages for the prompt now, and the reserve for the tokens it will decode (no more
        than the pool can hold beside the prompt: the head of the queue must fit some day)."""
        now = self.pool.pages_for(len(req.prompt_ids))
        future = min(req.params.max_tokens, self.cfg.decode_reserve_tokens)
        later = self.pool.pages_for(len(req.prompt_ids) + future) - now
        return now, max(0, min(later, self.pool.num_pages - now))

    def _send(self, kind: str, room: int, **fields) -> None:
        self.worker.send(self.peer, protocol.encode(kind, room, **fields), room)

    def _reserved(self) -> int:
        """KV that admitted requests will still claim for their decode reserve."""
        total = 0
        held = list(self.transfer.values()) + [entry[0] for entry in self.landed] + self.scheduler.scheduled()
        for req in held:
            left = min(req.params.max_tokens - len(req.output_ids), self.cfg.decode_reserve_tokens)
            total += max(0, self.pool.pages_for(req.num_tokens + max(left, 0)) - len(req.pages))
        return total

    # ---- events from the transfer worker ---------------------------------------------
    def _on_event(self, kind: str, *args) -> None:
        if kind == "connected":
            self.peer_state = "ready"
        elif kind == "connect_failed":
            self.peer_state, self.peer_error = "failed", args[1]
            self._fail_all(f"prefill engine unreachable at {self.host}:{self.port}: {args[1]}", self.prealloc)
        elif kind == "send_failed":
            self.peer_state, self.peer_error = "failed", args[1]
            self._fail_all(f"lost the prefill engine: {args[1]}", list(self.transfer.values()))
            for room in list(self.quarantine):  # a dead peer has no write in flight
                self._unquarantine(room)
        elif kind == "message":
            self._on_message(*args)

    def _on_message(self, peer: str, msg: dict) -> None:
        room, kind = msg["room"], msg["kind"]
        if room in self.quarantine:
            # `done` too: the metadata is written after the last KV write finished. An
            # `error` says nothing about writes still in flight: `released` follows it.
            if kind in ("released", "done"):
                self._unquarantine(room)
            return
        req = self.transfer.get(room)
        if req is None:
            log.info("ignoring %s for unknown room %s", kind, room)
        elif kind == "done":
            self._prebuild(req)
        elif kind == "error":
            del self.transfer[room]
            self._hold(req)  # writes it posted before it failed may still be landing
            self._fail(req, msg.get("msg", "the prefill engine failed"))

    def _prebuild(self, req: Request) -> None:
        """KV and metadata have landed: join the running batch without a forward."""
        del self.transfer[req.room]
        room, token, logprob, prompt_len = protocol.read_meta_row(self.meta, req.meta_slot)
        self.slots.give(req.meta_slot)
        req.meta_slot = None
        if room != req.room or prompt_len != len(req.prompt_ids):
            self._fail(req, f"metadata mismatch: slot holds room {room} ({prompt_len} tokens), "
                            f"expected room {req.room} ({len(req.prompt_ids)} tokens)")
            return
        req.num_computed = prompt_len
        self.landed.append((req, token, logprob))
        self._join_landed()

    def _join_landed(self) -> None:
        """Requests whose KV landed join the running batch while it has room
        (max_running_requests); the others keep their pages and wait, in order."""
        while self.landed and self.scheduler.has_room():
            req, token, logprob = self.landed.popleft()
            self.scheduler.join_running(req)
            self.scheduler.append_token(req, token, logprob, self.scheduler.stop_ids(req))

    def _fail(self, req: Request, message: str) -> None:
        self.num_failed += 1
        self.transfer.pop(req.room, None)
        if req.meta_slot is not None:
            self.slots.give(req.meta_slot)
            req.meta_slot = None
        self.scheduler.finish(req, "error", error=message)

    def _fail_all(self, message: str, requests: list[Request]) -> None:
        for req in list(requests):
            if req in self.prealloc:
                self.prealloc.remove(req)
            self._fail(req, message)

    def _unquarantine(self, room: int) -> None:
        released, _, slot, _ = self.quarantine.pop(room)
        released.set()
        self.pool.collect()
        if slot is not None:
            self.slots.give(slot)

    def _expire(self) -> None:
        now, limit = time.monotonic(), self.cfg.transfer_timeout_s
        for req in [r for r in self.transfer.values() if now - r.admitted_at > limit]:
            del self.transfer[req.room]
            self._hold(req)
            self._send("abort", req.room)
            self._fail(req, f"KV transfer not done within {limit:g}s")
        for room, (_, _, _, since) in list(self.quarantine.items()):
            if now - since > limit:  # the prefill side never answered: it is gone or stuck
                self._unquarantine(room)

    def _ping(self) -> None:
        """Notice a prefill engine that died (no message would come), idle or not: the next
        request then handshakes again, with whatever listens there now (a restarted engine)."""
        if self.peer_state == "ready" and time.monotonic() - self.last_ping > PING_S:
            self.last_ping = time.monotonic()
            self._send("ping", 0)

    def stats(self) -> dict:
        return {"prealloc": len(self.prealloc), "transferring": len(self.transfer), "landed": len(self.landed),
                "quarantined_pages": sum(n for _, n, _, _ in self.quarantine.values()),
                "transfer_failures": self.num_failed}
