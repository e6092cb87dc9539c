"""The decode role: requests reserve KV here, have the prefill engine write
their prompt's KV into it, then join the running decode batch without a
forward (a prebuilt batch: the first token comes from the metadata).

    prealloc (handshake, wait for KV) -> transfer (wait for `done`)
        -> prebuilt (first token from the metadata) -> running

The prealloc queue has no timeout (an overloaded engine queues, it does not
fail): transfer_timeout_s counts from the moment KV is reserved. A request that
fails while the prefill engine may still be writing into its pages leaves them
in quarantine until the prefill side says `released` (or the timeout passes).

Each request names the prefill engine that writes its KV (`prefill_agent`, set
by the router; none: prefill_address). Decode keeps one NIXL peer per prefill
agent, dialed when a request first needs it (again after it failed: a
restarted engine comes back under its name), and pinged while ready. A peer
that fails fails only its own rooms.

With prefix caching (auto), decode keeps the KV it received and decoded: a
prompt's full pages found in its cache are taken (a reference each, held until
the request ends), the `dest` message says how many prompt tokens decode holds
(`cached_tokens`, page-aligned), and prefill writes only the pages after them.
The received pages enter the cache once `done` says they have landed, never
while prefill may write them.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from backends.disagg import protocol
from backends.disagg.config import DisaggConfig
from backends.disagg.prefill import prefill_agent_name
from backends.disagg.transport import KVTransport
from backends.disagg.worker import TransferWorker
from backends.kv_cache import Match
from backends.request import Request, Status
from backends.role import EngineFacts, EngineOps, KeepPages
from backends.triton_io import split_agent

log = logging.getLogger("tandem.decode")
PING_S = 0.5


@dataclass
class Peer:
    """A prefill engine's NIXL agent, as this decode engine sees it."""

    name: str
    host: str
    port: int
    state: str = "new"      # new | connecting | ready | failed
    error: str = ""
    last_ping: float = 0.0


@dataclass
class Quarantined:
    """A failed room's pages: they go back once its prefill peer says `released`."""

    released: threading.Event
    num_pages: int
    slot: int | None
    since: float
    peer: str


class DecodeRole:
    carries_logprobs = False
    ends_text = True
    decodes = True

    def __init__(self, cfg: DisaggConfig, facts: EngineFacts, engine: EngineOps):
        self.cfg, self.facts, self.engine, self.pool = cfg, facts, engine, facts.kv_manager
        host, port = cfg.prefill_host_port
        self.default_peer = f"{prefill_agent_name(port)}@{host}:{port}"
        self.peers: dict[str, Peer] = {}   # agent name -> its peer
        self.prealloc: list[Request] = []
        self.landed: collections.deque = collections.deque()  # (request, first token, logprob): KV here, no room yet
        self.transfer: dict[int, Request] = {}            # room -> request whose KV is on its way
        self.quarantine: dict[int, Quarantined] = {}   # room -> its pages, waiting for `released`
        self.announced: set[int] = set()   # prealloc rooms the prefill side was told are queued
        self.num_failed = 0
        self.bytes_reused = 0   # prompt KV prefill did not send: decode held it
        self.meta = protocol.new_meta_buffer(cfg.meta_slots)
        self.slots = protocol.SlotPool(cfg.meta_slots)
        kv = facts.kv   # [layers, 2, pages, ...]: a page's KV in every layer
        self.page_bytes = kv[:, :, 0].numel() * kv.element_size()
        transport = KVTransport(f"tandem-decode-{uuid.uuid4().hex[:8]}", kv, self.meta, listen_port=None)
        self.worker = TransferWorker(transport, facts.wake, cfg.transfer_timeout_s,
                                     expecting=lambda: bool(self.transfer))

    def close(self) -> None:
        self.worker.stop()

    def identity(self) -> dict:
        return {}

    # ---- the loop's hooks ----------------------------------------------------------
    def admit(self, req: Request) -> bool:
        if req.room is None:
            raise ValueError("a decode request needs a bootstrap room")
        problem = self._pair(req)
        if problem:
            self.engine.finish(req, "error", error=problem)
            return True
        self.engine.hold(req, Status.PREALLOCATING)
        self.prealloc.append(req)
        return True

    def _pair(self, req: Request) -> str | None:
        """Make the request's prefill peer known (its prefill_agent, or the default); or say why not."""
        req.prefill_agent = req.prefill_agent or self.default_peer
        try:
            name, host, port = split_agent(req.prefill_agent)
        except ValueError as exc:
            return str(exc)
        peer = self.peers.get(name)
        if peer is None or (peer.host, peer.port) != (host, port):
            if peer is not None and peer.state in ("connecting", "ready"):
                return f"prefill agent {name} is at {peer.host}:{peer.port}, not {host}:{port}"
            self.peers[name] = Peer(name, host, port)  # new, or moved while not in use
        return None

    def _peer(self, req: Request) -> Peer:
        """The prefill agent that writes this request's KV (admit made it known)."""
        return self.peers[req.prefill_agent.partition("@")[0]]

    def advance(self) -> None:
        for event in self.worker.take_events():
            try:
                self._on_event(*event)
            except Exception:  # one bad message must not lose the events after it
                log.exception("handling %s failed", event[0])
        for name in {self._peer(req).name for req in self.prealloc}:
            if self.peers[name].state in ("new", "failed"):
                self._dial(self.peers[name])
        self._join_landed()
        self._allocate()
        self._expire()
        self._ping()

    def layer_hook(self, batch) -> None:
        return None

    def on_sampled(self, req: Request) -> bool:
        return False

    def on_preempt(self, req: Request) -> None:
        """Nothing to keep: a running request's KV has all landed, nothing else touches its pages."""
        return None

    def on_abort(self, req: Request) -> KeepPages | None:
        if req in self.prealloc:
            self.prealloc.remove(req)
        self.landed = collections.deque(entry for entry in self.landed if entry[0] is not req)
        keep = None
        if self.transfer.pop(req.room, None) is not None:
            keep = self._quarantine(req)
            self._send("abort", req)
        elif req.room in self.announced:
            self._send("abort", req)  # the prefill side waits for its destination without a timeout
        self.announced.discard(req.room)
        return keep

    def _quarantine(self, req: Request) -> KeepPages:
        """Prefill may still write into the pages it was given: they go back once it says
        released. The prompt's cached pages (its first cached_pages) it never writes."""
        released = threading.Event()
        self.quarantine[req.room] = Quarantined(released, len(req.pages) - req.cached_pages, req.meta_slot,
                                                time.monotonic(), self._peer(req).name)
        req.meta_slot = None
        return KeepPages(released.is_set, first=req.cached_pages)

    # ---- prealloc ------------------------------------------------------------------
    def _dial(self, peer: Peer) -> None:
        peer.state = "connecting"
        self.worker.connect(peer.name, peer.host, peer.port, self.cfg.handshake_timeout_s)

    def _allocate(self) -> None:
        """KV for the queued requests whose prefill peer is ready, in order: the first that
        does not fit waits, and those behind it with it."""
        for req in [r for r in self.prealloc if self._peer(r).state == "ready"]:
            now, later = self._pages_needed(req)
            if now > self.pool.num_pages:
                self.prealloc.remove(req)
                self._fail(req, f"the prompt needs {now} KV pages, the decode engine has {self.pool.num_pages}")
                continue
            if not self._reserve(req, now, later):
                break  # the head waits for KV; requests keep their order
        for req in self.prealloc:
            # so that the prefill side waits for it as long as it takes
            if req.room not in self.announced and self._peer(req).state == "ready":
                self.announced.add(req.room)
                self._send("queued", req)

    def _reserve(self, req: Request, now: int, later: int) -> bool:
        """The prompt's KV (the full pages this engine holds already, then new pages) and a
        metadata slot, and its destination to prefill; False if they are not free."""
        held = self._match(req)
        slot = None
        if self.pool.num_available - self._reserved() < now - len(held.pages) + later \
                or (slot := self.slots.take()) is None:
            self.pool.release(held.pages)
            return False
        self.prealloc.remove(req)
        self.announced.discard(req.room)
        self.engine.give_pages(req, held, self.pool.allocate(now - len(held.pages)))
        req.meta_slot = slot
        req.admitted_at = time.monotonic()  # the transfer timeout counts from here
        self.meta[slot].zero_()
        self.transfer[req.room] = req
        self.engine.hold(req, Status.RECEIVING)
        self._send("dest", req, pages=req.pages[len(held.pages):], slot=slot, prompt_len=len(req.prompt_ids),
                   cached_tokens=held.num_tokens)
        return True

    def _match(self, req: Request) -> Match:
        """The prompt's full pages in this engine's cache (all of them may match: the first token
        comes from prefill, nothing is computed here), a reference taken on each."""
        full = len(req.prompt_ids) // self.pool.page_size if self.facts.prefix_caching else 0
        return self.pool.match(req.prompt_ids[:full * self.pool.page_size], req.cache_salt, full)

    def _pages_needed(self, req: Request) -> tuple[int, int]:
        """Pages for the prompt now, and the reserve for the tokens it will decode (no more
        than the pool can hold beside the prompt: the head of the queue must fit some day)."""
        now = self.pool.pages_for(len(req.prompt_ids))
        future = min(req.params.max_tokens, self.cfg.decode_reserve_tokens)
        later = self.pool.pages_for(len(req.prompt_ids) + future) - now
        return now, max(0, min(later, self.pool.num_pages - now))

    def _send(self, kind: str, req: Request, **fields) -> None:
        """A message about the request to its prefill peer (none to a peer that is not ready:
        its rooms failed with it)."""
        peer = self._peer(req)
        if peer.state == "ready":
            self.worker.send(peer.name, protocol.encode(kind, req.room, **fields), req.room)

    def _reserved(self) -> int:
        """KV that admitted requests will still claim for their decode reserve."""
        total = 0
        held = list(self.transfer.values()) + [entry[0] for entry in self.landed] + self.engine.scheduled()
        for req in held:
            left = min(req.params.max_tokens - len(req.output_ids), self.cfg.decode_reserve_tokens)
            total += max(0, self.pool.pages_for(req.num_tokens + max(left, 0)) - len(req.pages))
        return total

    # ---- events from the transfer worker ---------------------------------------------
    def _on_event(self, kind: str, *args) -> None:
        if kind == "connected" and args[0] in self.peers:
            self.peers[args[0]].state = "ready"
        elif kind == "connect_failed" and args[0] in self.peers:
            peer = self.peers[args[0]]
            self._lose(peer, args[1], f"prefill engine unreachable at {peer.host}:{peer.port}: {args[1]}")
        elif kind == "send_failed" and args[0] in self.peers:
            self._lose(self.peers[args[0]], args[2], f"lost the prefill engine: {args[2]}")
        elif kind == "message":
            self._on_message(*args)

    def _lose(self, peer: Peer, error: str, message: str) -> None:
        """The peer failed: so do its rooms (queued or transferring); its quarantined pages come
        back (a dead peer has no write in flight). The next request for it dials again."""
        log.warning("prefill peer %s at %s:%d failed: %s", peer.name, peer.host, peer.port, error)
        peer.state, peer.error = "failed", error
        self._fail_all(message, [r for r in self.prealloc + list(self.transfer.values()) if self._peer(r) is peer])
        for room in [room for room, q in self.quarantine.items() if q.peer == peer.name]:
            self._unquarantine(room)

    def _on_message(self, peer: str, msg: dict) -> None:
        room, kind = msg["room"], msg["kind"]
        if room in self.quarantine:
            # `done` too: the metadata is written after the last KV write finished. An
            # `error` says nothing about writes still in flight: `released` follows it.
            if kind in ("released", "done") and self.quarantine[room].peer == peer:
                self._unquarantine(room)
            return
        req = self.transfer.get(room)
        if req is None or self._peer(req).name != peer:
            log.info("ignoring %s for room %s from %s", kind, room, peer)
        elif kind == "done":
            self._prebuild(req)
        elif kind == "error":
            del self.transfer[room]
            # writes it posted before it failed may still be landing
            self._fail(req, msg.get("msg", "the prefill engine failed"), self._quarantine(req))

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
        self.bytes_reused += req.cached_pages * self.page_bytes
        self._cache_prompt(req)
        self.landed.append((req, token, logprob))
        self._join_landed()

    def _cache_prompt(self, req: Request) -> None:
        """The prompt's KV has landed: its full pages enter the cache (the scheduler caches the
        pages it decodes, as it does for any request)."""
        if self.facts.prefix_caching:
            self.engine.cache_pages(req, len(req.prompt_ids))

    def _join_landed(self) -> None:
        """Requests whose KV landed join the running batch while it has room
        (max_running_requests); the others keep their pages and wait, in order."""
        while self.landed and self.engine.has_room():
            req, token, logprob = self.landed.popleft()
            self.engine.join_running(req, len(req.prompt_ids))
            self.engine.append_token(req, token, logprob, self.engine.stop_ids(req))

    def _fail(self, req: Request, message: str, keep: KeepPages | None = None) -> None:
        """keep: the pages prefill may still write (the room is quarantined)."""
        self.num_failed += 1
        self.transfer.pop(req.room, None)
        if req.meta_slot is not None:
            self.slots.give(req.meta_slot)
            req.meta_slot = None
        self.engine.finish(req, "error", error=message, keep=keep)

    def _fail_all(self, message: str, requests: list[Request]) -> None:
        for req in list(requests):
            if req in self.prealloc:
                self.prealloc.remove(req)
            self._fail(req, message)

    def _unquarantine(self, room: int) -> None:
        held = self.quarantine.pop(room)
        held.released.set()
        self.pool.collect()
        if held.slot is not None:
            self.slots.give(held.slot)

    def _expire(self) -> None:
        now, limit = time.monotonic(), self.cfg.transfer_timeout_s
        for req in [r for r in self.transfer.values() if now - r.admitted_at > limit]:
            del self.transfer[req.room]
            keep = self._quarantine(req)
            self._send("abort", req)
            self._fail(req, f"KV transfer not done within {limit:g}s", keep)
        for room, held in list(self.quarantine.items()):
            if now - held.since > limit:  # the prefill side never answered: it is gone or stuck
                self._unquarantine(room)

    def _ping(self) -> None:
        """Notice a prefill engine that died (no message would come), idle or not: the next
        request for it then handshakes again, with whatever listens there now (a restarted engine)."""
        now = time.monotonic()
        for peer in self.peers.values():
            if peer.state == "ready" and now - peer.last_ping > PING_S:
                peer.last_ping = now
                self.worker.send(peer.name, protocol.encode("ping", 0), 0)

    def stats(self) -> dict:
        return {"prealloc": len(self.prealloc), "transferring": len(self.transfer), "landed": len(self.landed),
                "quarantined_pages": sum(q.num_pages for q in self.quarantine.values()),
                "transfer_failures": self.num_failed, "kv_bytes_reused": self.bytes_reused}
