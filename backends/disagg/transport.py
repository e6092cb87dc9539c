"""KV-cache hand-off between engine processes over NIXL (UCX backend).

One `KVTransport` per engine process. It owns a NIXL agent whose listen thread
serves this process's NIXL metadata on a TCP port, registers the engine's KV
buffer and metadata buffer, and posts one-sided WRITEs of KV pages and
metadata rows into a peer's buffers.

Handshake: `connect()` fetches the peer's NIXL metadata, pushes ours, then
sends a HELLO control message with our layout and buffer base addresses; the
peer answers with its own. Each side compares layouts and refuses a mismatch.
A peer counts as connected only once its NIXL metadata is loaded here too (a
redial drops it; an answer to the HELLO before the redial may arrive first).
`connect(wait=False)` lets an engine loop start a handshake and keep working.
Knowing the peer's base addresses, a writer builds remote descriptors from
plain page indices, so a request's destination is a page list and a slot.

Control messages and application messages share NIXL notifications; a one-byte
prefix tells them apart. Every NIXL call runs in the caller's thread (nothing
runs behind the engine's back): the passive side answers a HELLO whenever its
owner calls `messages()`, which the engine loop does every step.

Names are NIXL agent names and must be unique among connected processes. A peer
that comes back under the same name is accepted: its new HELLO replaces the
dead incarnation's metadata.

Measured here (host memory, two processes, see --bench): UCX does the copy
inside `transfer()` (GIL released), so a WRITE usually completes in the post;
NIXL does not merge adjacent descriptors, hence the run coalescing below.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from backends.config import dtype_name

log = logging.getLogger(__name__)

_APP = b"A"  # application message or write notification
_CTL = b"C"  # transport control (handshake, goodbye)
_REPLY_WINDOW_S = 30.0  # how long a HELLO reply may wait for the peer's NIXL metadata
_BIND_TRIES = 8


class TransferError(RuntimeError):
    """Peer unreachable, handshake refused, peer gone, or a transfer failed."""


@dataclass(frozen=True)
class KVLayout:
    """What both sides of a hand-off must agree on (pool sizes may differ)."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_bytes: int
    meta_width: int
    meta_dtype: str

    @classmethod
    def of(cls, kv: torch.Tensor, meta: torch.Tensor) -> "KVLayout":
        layers, _, _, page_size, heads, head_dim = kv.shape
        page_bytes = page_size * heads * head_dim * kv.element_size()
        return cls(layers, page_size, heads, head_dim, dtype_name(kv.dtype), page_bytes,
                   meta.shape[1], dtype_name(meta.dtype))

    def mismatches(self, peer: "KVLayout") -> list[str]:
        return [f"{f.name} {getattr(self, f.name)} here vs {getattr(peer, f.name)} on peer"
                for f in fields(self) if getattr(self, f.name) != getattr(peer, f.name)]


@dataclass(frozen=True)
class Region:
    """A registered buffer: base address, device id, NIXL memory type, row count."""

    addr: int
    dev: int
    mem: str
    count: int

    @classmethod
    def of(cls, t: torch.Tensor, count: int) -> "Region":
        dev = (t.device.index or 0) if t.is_cuda else 0
        return cls(t.data_ptr(), dev, "VRAM" if t.is_cuda else "DRAM", count)


@dataclass(frozen=True)
class PeerInfo:
    """What a handshake tells about the other side."""

    layout: KVLayout
    kv: Region  # count = num_pages
    meta: Region  # count = num_slots

    def to_json(self) -> dict:
        return {"layout": asdict(self.layout), "kv": asdict(self.kv), "meta": asdict(self.meta)}

    @classmethod
    def from_json(cls, d: dict) -> "PeerInfo":
        return cls(KVLayout(**d["layout"]), Region(**d["kv"]), Region(**d["meta"]))


class XferHandle:
    """One posted WRITE. `state` is the last polled state; `posted_at` is time.monotonic()."""

    __slots__ = ("_h", "peer", "nbytes", "ndescs", "posted_at", "state", "released")

    def __init__(self, h, peer: str, nbytes: int, ndescs: int):
        self._h, self.peer, self.nbytes, self.ndescs = h, peer, nbytes, ndescs
        self.posted_at, self.state, self.released = time.monotonic(), "PROC", False

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.posted_at

    def __repr__(self) -> str:
        return f"XferHandle(peer={self.peer!r}, {self.nbytes} B in {self.ndescs} descs, {self.state})"


# ---------------------------------------------------------------- pure helpers


def _pair_runs(local: Sequence[int], remote: Sequence[int]):
    """Vectorised core of coalesce_pairs: arrays (local_starts, remote_starts, counts)."""
    loc = np.asarray(local, dtype=np.int64).reshape(-1)
    rem = np.asarray(remote, dtype=np.int64).reshape(-1)
    if loc.shape != rem.shape:
        raise ValueError(f"{loc.size} local pages but {rem.size} remote pages")
    if loc.size == 0:
        return loc, rem, loc
    starts = np.ones(loc.size, dtype=bool)
    starts[1:] = (np.diff(loc) != 1) | (np.diff(rem) != 1)
    idx = np.flatnonzero(starts)
    counts = np.diff(np.append(idx, loc.size))
    return loc[idx], rem[idx], counts


def coalesce_pairs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs (local_start, remote_start, count) in order; a run grows only while both
    the local and the remote index go up by exactly one."""
    ls, rs, ns = _pair_runs(local, remote)
    return [(int(a), int(b), int(c)) for a, b, c in zip(ls, rs, ns)]


def coalesce_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """Maximal runs (start, count) of consecutive ascending page indices, in order."""
    return [(a, c) for a, _, c in coalesce_pairs(pages, pages)]


def page_descs(region: Region, num_pages: int, page_bytes: int, layers: Sequence[int],
               starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Nx3 uint64 (addr, len, dev) for page runs of the given layers, K then V per layer.

    Byte offset of (layer l, k/v c, page p) in [L, 2, P, ...] is ((2l + c) * P + p) * page_bytes.
    """
    blocks = (np.asarray(layers, dtype=np.int64)[:, None] * 2 + np.arange(2)).reshape(-1)
    offs = (blocks[:, None] * num_pages + np.asarray(starts)[None, :]) * page_bytes
    out = np.empty((offs.size, 3), dtype=np.uint64)
    out[:, 0] = region.addr + offs.reshape(-1)
    out[:, 1] = np.broadcast_to(np.asarray(counts) * page_bytes, offs.shape).reshape(-1)
    out[:, 2] = region.dev
    return out


def _check_span(starts: np.ndarray, counts: np.ndarray, limit: int, what: str) -> None:
    if starts.size and (starts.min() < 0 or (starts + counts).max() > limit):
        raise ValueError(f"{what} index out of range [0, {limit})")


def _as_layers(layers: Iterable[int], num_layers: int) -> list[int]:
    out = [int(x) for x in layers]
    if not out:
        raise ValueError("no layers to write")
    if min(out) < 0 or max(out) >= num_layers:
        raise ValueError(f"layer index out of range [0, {num_layers}): {out}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _local_ip_towards(host: str) -> str:
    """The address of this machine that `host` would see us on (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _quiet_nixl_logger() -> None:
    # NIXL's Python logger prints INFO lines to stdout for every agent/backend
    # created; keep warnings and errors unless the user asked for a level.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


def _make_agent(name: str, port: int | None):
    from nixl._api import nixl_agent, nixl_agent_config

    _quiet_nixl_logger()
    last: Exception | None = None
    # NIXL has no way to report an ephemeral listen port, so pick one ourselves and
    # retry if another process takes it in between (NIXL raises on a failed bind).
    for _ in range(1 if port else _BIND_TRIES):
        p = port or _free_port()
        # No progress thread: it spins (60% of a core per idle agent here), and our
        # worker thread polls transfers and notifications, which drives progress.
        cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=True,
                                listen_port=p, backends=["UCX"])
        try:
            agent = nixl_agent(name, cfg)
        except RuntimeError as e:
            last = e
            continue
        if "UCX" not in agent.backends:
            raise TransferError("NIXL has no UCX backend plugin on this machine")
        return agent, p
    raise TransferError(f"NIXL agent {name!r} could not listen on port {port or 'any'}: {last}")


def _check_buffers(kv: torch.Tensor, meta: torch.Tensor) -> None:
    if kv.dim() != 6 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, pages, page_size, kv_heads, head_dim], got {tuple(kv.shape)}")
    if meta.dim() != 2:
        raise ValueError(f"meta must be [slots, width], got {tuple(meta.shape)}")
    if not (kv.is_contiguous() and meta.is_contiguous()):
        raise ValueError("kv and meta must be contiguous")


# ---------------------------------------------------------------- transport


@dataclass
class _Dial:
    """A handshake this side started: waiting for metadata, then for the HELLO reply."""

    host: str
    port: int
    timeout_s: float
    deadline: float
    hello_sent: bool = False

    def timeout_message(self, peer: str) -> str:
        where = f"{peer!r} at {self.host}:{self.port}"
        if self.hello_sent:
            return f"{where} did not answer the handshake within {self.timeout_s}s"
        return f"no NIXL metadata from {where} within {self.timeout_s}s (nothing listening there, or wrong name)"


class KVTransport:
    """One per engine process: NIXL agent + registered kv/meta + handshaken peers.

    Drive it from one thread (the engine loop): its Python state is not locked.
    """

    def __init__(self, name: str, kv: torch.Tensor, meta: torch.Tensor, listen_port: int | None = None):
        _check_buffers(kv, meta)
        self.name, self.kv, self.meta = name, kv, meta
        self.layout = KVLayout.of(kv, meta)
        self.info = PeerInfo(self.layout, Region.of(kv, kv.shape[2]), Region.of(meta, meta.shape[0]))
        self._agent, self.port = _make_agent(name, listen_port)
        self._regs = [self._agent.register_memory(kv), self._agent.register_memory(meta)]
        self._peers: dict[str, PeerInfo] = {}
        self._failed: dict[str, str] = {}  # peer -> why it cannot be used
        self._dials: dict[str, _Dial] = {}  # handshakes this side started
        # peer -> (deadline for answering its HELLO, its PeerInfo; None if refused)
        self._replies: dict[str, tuple[float, PeerInfo | None]] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._leaked: list = []  # handles NIXL would not release yet; retried at close()

    # ---- peers

    def connect(self, peer: str, host: str, port: int, timeout_s: float = 10.0,
                wait: bool = True) -> PeerInfo | None:
        """Handshake with `peer` whose transport listens at host:port.

        wait=True: block (serving this transport meanwhile) until done; return the
        peer's PeerInfo, or raise TransferError if it is unreachable within timeout_s
        or its layout differs. wait=False: return at once (PeerInfo if already
        connected, else None); messages() advances the handshake; watch
        is_connected(peer) and peer_error(peer)."""
        if peer in self._peers:
            return self._peers[peer]
        if peer == self.name:
            raise ValueError(f"cannot connect {peer!r} to itself")
        if peer not in self._dials:
            self._dial(peer, host, port, timeout_s)
        if not wait:
            return None
        self._wait(lambda: peer not in self._dials)
        if peer in self._failed:
            raise TransferError(self._failed[peer])
        return self._peers[peer]

    def is_connected(self, peer: str) -> bool:
        """True once the handshake with `peer` succeeded (either side may have started it)."""
        return peer in self._peers

    def peer_error(self, peer: str) -> str | None:
        """Why `peer` cannot be used (unreachable, layouts differ), if so."""
        return self._failed.get(peer)

    def disconnect(self, peer: str) -> None:
        """Tell `peer` goodbye (best effort) and drop its metadata; safe on a dead peer."""
        if self._agent is None:
            return
        if peer in self._peers:
            try:
                self._send_ctl(peer, {"op": "bye"})
            except TransferError:
                pass  # it is gone already; dropping it is all that is left
        self._forget(peer)

    # ---- data

    def kv_descs(self, layers: Iterable[int], pages: Sequence[int], *, coalesce: bool = True) -> np.ndarray:
        """Nx3 (addr, len, dev) of this side's pages for those layers; runs of
        consecutive pages become one descriptor per (layer, K/V) unless coalesce=False."""
        layers = _as_layers(layers, self.layout.num_layers)
        pages = np.asarray(pages, dtype=np.int64)
        starts, _, counts = _pair_runs(pages, pages) if coalesce else (pages, pages, np.ones_like(pages))
        _check_span(starts, counts, self.info.kv.count, "local page")
        return page_descs(self.info.kv, self.info.kv.count, self.layout.page_bytes, layers, starts, counts)

    def write_kv(self, peer: str, local_pages: Sequence[int], remote_pages: Sequence[int],
                 layers: Iterable[int], notif: bytes | None = None) -> XferHandle:
        """Post a WRITE of `layers` of local_pages[i] into the peer's remote_pages[i].
        `notif` reaches the peer's messages() after the data has landed.
        Raises TransferError if the peer is unknown, refused or gone; ValueError on bad indices."""
        info = self._ready(peer)
        layers = _as_layers(layers, self.layout.num_layers)
        ls, rs, ns = _pair_runs(local_pages, remote_pages)
        if ns.size == 0:
            raise ValueError("no pages to write")
        _check_span(ls, ns, self.info.kv.count, "local page")
        _check_span(rs, ns, info.kv.count, f"page of {peer!r}")
        pb = self.layout.page_bytes
        local = page_descs(self.info.kv, self.info.kv.count, pb, layers, ls, ns)
        remote = page_descs(info.kv, info.kv.count, pb, layers, rs, ns)
        return self._post(peer, local, self.info.kv.mem, remote, info.kv.mem, notif)

    def write_meta(self, peer: str, local_slot: int, remote_slot: int, notif: bytes | None = None) -> XferHandle:
        """Post a WRITE of one metadata row. Post it only after the request's KV
        handles are DONE: separate WRITEs are not ordered with respect to each other."""
        info = self._ready(peer)
        for slot, limit, what in ((local_slot, self.info.meta.count, "local"), (remote_slot, info.meta.count, "remote")):
            if not 0 <= slot < limit:
                raise ValueError(f"{what} meta slot {slot} out of range [0, {limit})")
        row = self.meta[0].nbytes
        local = np.array([[self.info.meta.addr + local_slot * row, row, self.info.meta.dev]], dtype=np.uint64)
        remote = np.array([[info.meta.addr + remote_slot * row, row, info.meta.dev]], dtype=np.uint64)
        return self._post(peer, local, self.info.meta.mem, remote, info.meta.mem, notif)

    def poll(self, handle: XferHandle) -> str:
        """'DONE', 'PROC' or 'ERR'. A transfer to a peer that died may stay 'PROC':
        the caller times it out with handle.age_s."""
        if handle.state in ("DONE", "ERR") or handle.released:
            return handle.state
        try:
            handle.state = self._agent.check_xfer_state(handle._h)
        except Exception as e:  # includes a closed transport (no agent)
            log.warning("transfer to %s failed: %s", handle.peer, e)
            self._note_failure(handle.peer, e)
            handle.state = "ERR"
        return handle.state

    def release(self, handle: XferHandle) -> None:
        """Free the handle (cancels it if still in flight). Never raises."""
        if handle.released:
            return
        handle.released = True
        try:
            handle._h.release()
        except Exception as e:
            log.warning("NIXL kept a transfer to %s it could not cancel: %s", handle.peer, e)
            self._leaked.append(handle._h)

    # ---- messages

    def send_message(self, peer: str, data: bytes) -> None:
        """Small message to a connected peer (no data transfer); TransferError if it is gone."""
        self._ready(peer)
        try:
            self._agent.send_notif(peer, _APP + bytes(data))
        except Exception as e:
            self._note_failure(peer, e)
            raise TransferError(f"message to {peer!r} failed: {e}") from e

    def messages(self) -> list[tuple[str, bytes]]:
        """Drain (peer, bytes) messages and write notifications, in arrival order per peer.
        Also serves handshakes, so call it regularly."""
        self._pump()
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        """Say goodbye to peers, deregister memory, stop the agent (and its listen port)."""
        if self._agent is None:
            return
        for peer in list(self._peers):
            self.disconnect(peer)
        for h in self._leaked:
            try:
                h.release()
            except Exception:
                pass
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("deregister failed: %s", e)
        self._agent = None  # the C++ agent (and its threads) go when the last handle does

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals

    def _ready(self, peer: str) -> PeerInfo:
        if self._agent is None:
            raise TransferError("transport is closed")
        if peer in self._failed:
            raise TransferError(self._failed[peer])
        info = self._peers.get(peer)
        if info is None:
            raise TransferError(f"not connected to {peer!r}")
        return info

    def _post(self, peer: str, local: np.ndarray, lmem: str, remote: np.ndarray, rmem: str,
              notif: bytes | None) -> XferHandle:
        a = self._agent
        msg = b"" if notif is None else _APP + bytes(notif)  # empty = NIXL sends no notification
        try:
            h = a.initialize_xfer("WRITE", a.get_xfer_descs(local, lmem), a.get_xfer_descs(remote, rmem), peer, msg)
        except Exception as e:
            raise TransferError(f"cannot prepare write to {peer!r}: {type(e).__name__} {e}") from e
        handle = XferHandle(h, peer, int(local[:, 1].sum()), len(local))
        try:
            # On host memory UCX copies inside this call (GIL released) and
            # usually returns DONE; over RDMA it returns PROC at once.
            handle.state = a.transfer(h)
            failure = "NIXL returned ERR"
        except Exception as e:
            handle.state, failure = "ERR", f"{type(e).__name__} {e}"
            self._note_failure(peer, e)
        if handle.state == "ERR":
            self.release(handle)
            raise TransferError(f"write to {peer!r} failed when posted: {failure}")
        return handle

    def _note_failure(self, peer: str, exc: Exception) -> None:
        # NIXL (UCX) detects a dead peer's endpoint at once; remember it so the engine
        # can fail everything bound to that peer. A restarted peer's HELLO clears it.
        if type(exc).__name__ == "nixlRemoteDisconnectError" and peer in self._peers:
            del self._peers[peer]
            self._failed[peer] = f"{peer!r} went away (NIXL: remote disconnected)"

    def _hello(self, reply: bool, host: str = "") -> dict:
        return {"op": "hello", "reply": reply, "host": host, "port": self.port, **self.info.to_json()}

    def _send_ctl(self, peer: str, msg: dict) -> None:
        try:
            self._agent.send_notif(peer, _CTL + json.dumps(msg).encode())
        except Exception as e:
            raise TransferError(f"control message to {peer!r} failed: {e}") from e

    def _wait(self, done: Callable[[], bool]) -> None:
        # Every dial has its own deadline, enforced by _advance_dials, so this ends.
        pause = 0.0005
        while not done():
            self._pump()
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _dial(self, peer: str, host: str, port: int, timeout_s: float) -> None:
        self._forget(peer)  # metadata of an earlier incarnation would shadow the new one
        try:
            ip = socket.gethostbyname(host)  # NIXL takes numeric IPv4 addresses only
            self._agent.fetch_remote_metadata(peer, ip, port)
            self._agent.send_local_metadata(ip, port)
        except Exception as e:
            self._failed[peer] = f"cannot reach {peer!r} at {host}:{port}: {e}"
            return
        self._dials[peer] = _Dial(ip, port, timeout_s, time.monotonic() + timeout_s)

    def _advance_dials(self) -> None:
        for peer, d in list(self._dials.items()):
            if peer in self._peers or peer in self._failed:
                del self._dials[peer]
            elif not d.hello_sent and self._agent.check_remote_metadata(peer):
                d.hello_sent = True  # their metadata is here: we can message them
                try:
                    self._send_ctl(peer, self._hello(reply=True, host=_local_ip_towards(d.host)))
                except TransferError as e:
                    del self._dials[peer]
                    self._failed[peer] = str(e)
            elif time.monotonic() > d.deadline:
                del self._dials[peer]
                self._failed[peer] = d.timeout_message(peer)

    def _pump(self) -> None:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:
            log.warning("reading NIXL notifications failed: %s", e)
            notifs = {}
        for peer, msgs in notifs.items():
            for m in msgs:
                if m[:1] == _APP:
                    self._inbox.append((peer, m[1:]))
                elif m[:1] == _CTL:
                    self._on_control(peer, m[1:])
                else:
                    log.warning("dropping a notification from %s this transport did not send", peer)
        self._answer_hellos()
        self._advance_dials()

    def _on_control(self, peer: str, body: bytes) -> None:
        try:
            msg = json.loads(body)
            if msg["op"] == "bye":
                self._forget(peer)
                return
            info, reply = PeerInfo.from_json(msg), bool(msg["reply"])
        except (ValueError, KeyError, TypeError) as e:
            log.warning("malformed control message from %s: %s", peer, e)
            return
        if reply and (peer in self._peers or peer in self._failed):
            self._rehandshake(peer, msg)
        diffs = self.layout.mismatches(info.layout)
        if diffs:
            self._peers.pop(peer, None)
            self._failed[peer] = f"KV layout of {self.name!r} and {peer!r} differ: " + "; ".join(diffs)
            log.warning("%s", self._failed[peer])
        if reply:
            self._replies[peer] = (time.monotonic() + _REPLY_WINDOW_S, None if diffs else info)
        elif not diffs:
            if self._agent.check_remote_metadata(peer):
                self._admit(peer, info)
            else:
                # An answer to a HELLO sent before a redial dropped the peer's metadata: NIXL
                # cannot message the peer until the refetch lands, when the redial says HELLO
                # again and the peer answers that one.
                log.info("%s answered an earlier handshake; waiting for its metadata again", peer)

    def _admit(self, peer: str, info: PeerInfo) -> None:
        """A handshaken peer whose NIXL metadata is loaded: messages and writes to it can go."""
        self._failed.pop(peer, None)
        self._peers[peer] = info

    def _rehandshake(self, peer: str, msg: dict) -> None:
        # A known peer says HELLO again: it restarted (same name) or reconnected. Its
        # fresh metadata push is ignored while the old one is loaded, so drop the old
        # one and fetch again from the address it gave.
        self._forget(peer)
        if msg.get("host"):
            try:
                self._agent.fetch_remote_metadata(peer, msg["host"], int(msg["port"]))
            except Exception as e:
                log.warning("re-fetching metadata of %s failed: %s", peer, e)

    def _answer_hellos(self) -> None:
        for peer, (deadline, info) in list(self._replies.items()):
            if self._agent.check_remote_metadata(peer):
                del self._replies[peer]
                if info is not None:
                    self._admit(peer, info)
                try:
                    self._send_ctl(peer, self._hello(reply=False))
                except TransferError as e:
                    log.warning("could not answer handshake of %s: %s", peer, e)
            elif time.monotonic() > deadline:
                del self._replies[peer]
                log.warning("gave up answering %s: its NIXL metadata never arrived", peer)

    def _forget(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._failed.pop(peer, None)
        self._dials.pop(peer, None)
        self._replies.pop(peer, None)
        try:
            if self._agent.check_remote_metadata(peer):
                self._agent.remove_remote_agent(peer)
        except Exception as e:
            log.warning("dropping metadata of %s failed: %s", peer, e)
