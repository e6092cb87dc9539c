"""The worker half of the KV hand-off: one thread owns the NIXL transport.

The engine loop (the scheduler half) decides what moves for whom and queues
commands; this thread posts them, polls them, and hands results back as events,
waking the loop. On a CPU, UCX copies inside the post with the GIL released, so
a layer group's write here overlaps the next layers' compute in the engine
thread. Every NIXL call happens in this thread.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from backends.disagg import protocol
from backends.disagg.transport import KVTransport, TransferError, XferHandle

log = logging.getLogger("tandem.transfer")
POLL_S = 0.002
FIRST_DIAL_S = 1.0


@dataclass
class Shipment:
    """One request's outgoing KV (prefill side), owned by the worker thread."""

    room: int
    peer: str
    handles: list[XferHandle] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    meta: tuple | None = None            # (local_slot, remote_slot) once the last KV write is queued
    meta_handle: XferHandle | None = None
    cancelled: bool = False
    bytes_sent: int = 0


@dataclass
class Dial:
    """A handshake in progress (decode side); `retry_s` is the second try's time, None once used."""

    host: str
    port: int
    retry_s: float | None


class TransferWorker:
    def __init__(self, transport: KVTransport, wake: Callable[[], None], timeout_s: float,
                 expecting: Callable[[], bool] = lambda: False):
        """expecting: whether the role awaits a message (prefill: a destination; decode: KV
        landing). The thread then reads NIXL's notifications every POLL_S, as it does while
        shipping; otherwise every 10 x POLL_S, which cost each awaited message up to 20 ms."""
        self.transport, self.wake, self.timeout_s, self.expecting = transport, wake, timeout_s, expecting
        self.commands: queue.Queue = queue.Queue()
        self.events: collections.deque = collections.deque()
        self.shipments: dict[int, Shipment] = {}
        self.dials: dict[str, Dial] = {}   # peer -> its handshake in progress (see connect())
        self.fences: list[tuple[list[XferHandle], threading.Event]] = []  # see drain()
        # Rooms that failed or were cancelled: later writes for them are dropped,
        # since the decode side may already have given their pages to another request.
        self.closed: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.write_seconds = 0.0   # time spent posting KV writes (bandwidth = bytes / this)
        self.trace: list[tuple] | None = None  # (what, detail, monotonic time) when a test turns it on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-transfer", daemon=True)
        self._thread.start()

    # ---- engine thread side --------------------------------------------------------
    def call(self, fn: Callable[[], None]) -> None:
        self.commands.put(fn)

    def take_events(self) -> list[tuple]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.transport.close()

    # ---- worker thread -------------------------------------------------------------
    def _emit(self, *event) -> None:
        self.events.append(event)
        self.wake()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                hot = self.shipments or self.dials or self.expecting()
                fn = self.commands.get(timeout=POLL_S if hot else 10 * POLL_S)
                fn()
                while not self.commands.empty():
                    self.commands.get_nowait()()
            except queue.Empty:
                pass
            except Exception:
                log.error("transfer command failed: %s", traceback.format_exc())
            try:
                self._pump()
            except Exception:
                log.error("transfer poll failed: %s", traceback.format_exc())

    def _pump(self) -> None:
        for peer, data in self.transport.messages():
            msg = protocol.decode(data)
            if msg is None:
                log.warning("dropping a malformed message from %s", peer)
                continue
            self._emit("message", peer, msg)
        for ship in list(self.shipments.values()):
            self._advance(ship)
        self._advance_dials()
        self._check_fences()

    def _check_fences(self) -> None:
        waiting = []
        for handles, done in self.fences:
            # a released handle was cancelled by NIXL (a failed or timed-out shipment)
            if any(not h.released and self.transport.poll(h) == "PROC" for h in handles):
                waiting.append((handles, done))
            else:
                done.set()
                self.wake()
        self.fences = waiting

    # ---- prefill side: shipments ---------------------------------------------------
    def write(self, room: int, peer: str, layers: range, local: list[int], remote: list[int],
              ready=None) -> None:
        """Queue a write of these layers' pages (runs in the worker thread); `ready` (a CUDA
        event, None on a CPU) has passed once the forward has stored them."""
        def post():
            if room in self.closed or not local:
                return
            ship = self.shipments.setdefault(room, Shipment(room, peer))
            if ship.cancelled:
                return
            if ready is not None:
                ready.synchronize()
            start = time.perf_counter()
            try:
                h = self.transport.write_kv(peer, local, remote, layers)
            except (TransferError, ValueError) as exc:
                self._fail(ship, f"KV write to the decode engine failed: {exc}")
                return
            self.write_seconds += time.perf_counter() - start  # on a CPU, UCX copies inside the post
            ship.handles.append(h)
            ship.bytes_sent += h.nbytes
            if self.trace is not None:
                self.trace.append(("posted", (layers.start, layers.stop), time.monotonic()))
        self.call(post)

    def finish(self, room: int, peer: str, local_slot: int, remote_slot: int) -> None:
        """After the queued KV writes are done, write the metadata row (its notification says done)."""
        def mark():
            if room in self.closed:
                self._emit("failed", room, "the KV transfer of this request had already failed")
                return
            self.shipments.setdefault(room, Shipment(room, peer)).meta = (local_slot, remote_slot)
        self.call(mark)

    def cancel(self, room: int, peer: str) -> None:
        """Drop the room's later writes; once none is in flight, tell the decode peer
        `released` (it frees the pages it held for the room) and emit `released`."""
        def mark():
            ship = self.shipments.get(room)
            if ship is None:
                self._remember_closed(room)
                self._release(room, peer, 0)
            else:
                ship.cancelled = True
        self.call(mark)

    def drain(self, room: int) -> threading.Event:
        """An event set once every write queued so far for the room has finished."""
        done = threading.Event()

        def fence():  # runs after the writes queued before it: the commands keep their order
            ship = self.shipments.get(room)
            self.fences.append((list(ship.handles) if ship else [], done))
        self.call(fence)
        return done

    def _advance(self, ship: Shipment) -> None:
        states = [self.transport.poll(h) for h in ship.handles]
        meta_busy = ship.meta_handle is not None and self.transport.poll(ship.meta_handle) == "PROC"
        late = time.monotonic() - ship.started > self.timeout_s
        if "ERR" in states:
            self._fail(ship, "a KV write to the decode engine failed (NIXL reported an error)")
        elif ("PROC" in states or meta_busy) and late:
            self._fail(ship, f"KV transfer not done within {self.timeout_s:g}s")
        elif "PROC" in states:
            return
        elif ship.cancelled:
            if not meta_busy:  # the metadata write still reads its slot
                self._close(ship)
                self._release(ship.room, ship.peer, ship.bytes_sent)
        elif ship.meta is not None:
            self._send_meta(ship)
        elif late:
            self._fail(ship, f"prefill not finished within {self.timeout_s:g}s")

    def _send_meta(self, ship: Shipment) -> None:
        if ship.meta_handle is None:
            if self.trace is not None:
                self.trace.append(("kv_done", ship.room, time.monotonic()))
            local, remote = ship.meta
            try:
                ship.meta_handle = self.transport.write_meta(ship.peer, local, remote,
                                                             protocol.encode("done", ship.room))
            except TransferError as exc:
                self._fail(ship, f"metadata write to the decode engine failed: {exc}")
            return
        state = self.transport.poll(ship.meta_handle)
        if state == "DONE":
            self._close(ship)
            self._emit("shipped", ship.room, ship.bytes_sent + ship.meta_handle.nbytes)
        elif state == "ERR":
            self._fail(ship, "metadata write to the decode engine failed (NIXL reported an error)")

    def _fail(self, ship: Shipment, message: str) -> None:
        log.warning("room %d: %s", ship.room, message)
        self._close(ship)  # releasing the handles cancels whatever was still in flight
        for kind, fields in (("error", {"msg": message}), ("released", {})):
            try:
                self.transport.send_message(ship.peer, protocol.encode(kind, ship.room, **fields))
            except Exception:
                break  # the peer may be the reason we failed
        self._emit("failed", ship.room, message)

    def _release(self, room: int, peer: str, bytes_sent: int) -> None:
        try:
            self.transport.send_message(peer, protocol.encode("released", room))
        except Exception as exc:
            log.info("could not tell %s that room %d is released: %s", peer, room, exc)
        self._emit("released", room, bytes_sent)

    def _close(self, ship: Shipment) -> None:
        for h in ship.handles + ([ship.meta_handle] if ship.meta_handle else []):
            self.transport.release(h)
        self.shipments.pop(ship.room, None)
        self._remember_closed(ship.room)

    def _remember_closed(self, room: int) -> None:
        self.closed[room] = None
        while len(self.closed) > 100_000:
            self.closed.popitem(last=False)

    # ---- both sides: control messages ----------------------------------------------
    def send(self, peer: str, data: bytes, room: int) -> None:
        """Post a message; a failure emits ("send_failed", peer, room, why)."""
        def post():
            try:
                self.transport.send_message(peer, data)
            except Exception as exc:
                self._emit("send_failed", peer, room, f"message to {peer} failed: {exc}")
        self.call(post)

    def connect(self, peer: str, host: str, port: int, timeout_s: float) -> None:
        """Handshake with the peer afresh (whatever an earlier incarnation left is dropped);
        emits ("connected", peer, "") or ("connect_failed", peer, why). The first try is short:
        when the peer has restarted, NIXL sends our first metadata request over its socket to
        the dead process and loses it (then closes that socket), so a second try, with the rest
        of the time, goes through. The handshake does not block this thread: other peers'
        transfers and messages go on while one peer is dialed (a dead one takes the timeout)."""
        def dial():
            first = min(FIRST_DIAL_S, timeout_s / 2)
            self.dials[peer] = Dial(host, port, timeout_s - first)
            self._try_dial(peer, first)
        self.call(dial)

    def _try_dial(self, peer: str, limit_s: float) -> None:
        dial = self.dials[peer]
        try:
            self.transport.disconnect(peer)
            self.transport.connect(peer, dial.host, dial.port, timeout_s=limit_s, wait=False)
        except Exception as exc:
            del self.dials[peer]
            self._emit("connect_failed", peer, str(exc))

    def _advance_dials(self) -> None:
        """The transport advances each handshake as it reads its notifications (see _pump)."""
        for peer, dial in list(self.dials.items()):
            error = self.transport.peer_error(peer)
            if self.transport.is_connected(peer):
                del self.dials[peer]
                self._emit("connected", peer, "")
            elif error is not None and dial.retry_s is not None:
                retry_s, dial.retry_s = dial.retry_s, None
                self._try_dial(peer, retry_s)
            elif error is not None:
                del self.dials[peer]
                self._emit("connect_failed", peer, error)
