"""KV transport (backends/disagg/transport.py) over real NIXL/UCX on the CPU.

Pure parts (run coalescing, descriptor addresses, layout comparison) are checked
directly. Everything else runs between this process and spawned peer processes,
each with its own KVTransport, as prefill and decode engines would: a peer
serves commands sent over a pipe and keeps draining its transport between them.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

nixl = pytest.importorskip("nixl")

from backends.disagg.transport import (  # noqa: E402
    KVLayout, KVTransport, Region, TransferError, coalesce_pairs, coalesce_runs, page_descs,
)
from backends.disagg import protocol  # noqa: E402
from backends.disagg.worker import TransferWorker  # noqa: E402
from tests.test_disagg import wait_for  # noqa: E402

SENTINEL = -1.0
SHAPE = dict(num_layers=4, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8)
META_WIDTH = 6


def make_buffers(num_layers, num_pages, page_size, num_kv_heads, head_dim, slots=4):
    kv = torch.full((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), SENTINEL)
    return kv, torch.full((slots, META_WIDTH), -1, dtype=torch.int64)


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize("pages, runs", [
    ([], []),
    ([5], [(5, 1)]),
    ([1, 2, 3, 7, 8, 10], [(1, 3), (7, 2), (10, 1)]),
    ([3, 2, 1], [(3, 1), (2, 1), (1, 1)]),  # descending is not contiguous
    ([4, 4, 5], [(4, 1), (4, 2)]),  # a repeat breaks the run
    ([9, 10, 0, 1, 2], [(9, 2), (0, 3)]),  # order is kept, not sorted
])
def test_coalesce_runs(pages, runs):
    assert coalesce_runs(pages) == runs


def test_coalesce_pairs_needs_both_sides_consecutive():
    assert coalesce_pairs([1, 2, 3, 4], [7, 8, 9, 10]) == [(1, 7, 4)]
    assert coalesce_pairs([1, 2, 3, 4], [7, 8, 2, 3]) == [(1, 7, 2), (3, 2, 2)]
    assert coalesce_pairs([1, 5, 6], [0, 1, 2]) == [(1, 0, 1), (5, 1, 2)]
    with pytest.raises(ValueError):
        coalesce_pairs([1, 2], [1])


def test_page_descs_addresses():
    region = Region(addr=1000, dev=0, mem="DRAM", count=10)
    d = page_descs(region, 10, 100, [1, 3], np.array([2, 7]), np.array([3, 1]))
    expect = [(1000 + ((2 * l + c) * 10 + p) * 100, n * 100, 0)
              for l in (1, 3) for c in (0, 1) for p, n in ((2, 3), (7, 1))]
    assert [tuple(int(x) for x in row) for row in d] == expect


def test_layout_mismatches_name_the_fields():
    a = KVLayout.of(*make_buffers(**SHAPE))
    b = KVLayout.of(*make_buffers(**{**SHAPE, "page_size": 8, "num_pages": 3}))
    assert a.mismatches(a) == []
    diffs = a.mismatches(b)
    assert any(d.startswith("page_size 4 here vs 8 on peer") for d in diffs)
    assert any(d.startswith("page_bytes") for d in diffs) and len(diffs) == 2


# ---------------------------------------------------------------- peer processes


def _peer_main(conn, name, shape, port=None):
    kv, meta = make_buffers(**shape)
    snapshot = kv.numel() < 1 << 20
    with KVTransport(name, kv, meta, listen_port=port) as t:
        conn.send(("ok", t.port))
        inbox, deadline = [], time.monotonic() + 300
        while time.monotonic() < deadline:
            for peer, m in t.messages():
                # copy at arrival: proves the data was in place when the notification came
                inbox.append((peer, m, kv.numpy().copy() if snapshot else None, meta.numpy().copy()))
            if not conn.poll(0.002):
                continue
            try:
                cmd, *args = conn.recv()
            except EOFError:
                return
            if cmd == "exit":
                return
            try:
                conn.send(("ok", _serve(t, kv, meta, inbox, cmd, args)))
            except Exception as e:  # report to the test, keep serving
                conn.send(("err", f"{type(e).__name__}: {e}"))


def _serve(t, kv, meta, inbox, cmd, args):
    if cmd == "connect":
        peer, port, timeout = args
        return t.connect(peer, "127.0.0.1", port, timeout_s=timeout) and None
    if cmd == "wait":
        n, timeout = args
        deadline = time.monotonic() + timeout
        while len(inbox) < n and time.monotonic() < deadline:
            inbox.extend((p, m, kv.numpy().copy(), meta.numpy().copy()) for p, m in t.messages())
            time.sleep(0.002)
        out, inbox[:] = inbox[:n], inbox[n:]
        return out
    if cmd == "meta":
        return meta.numpy().copy()
    if cmd == "reset":
        kv.fill_(SENTINEL)
        meta.fill_(-1)
        return None
    if cmd == "send":
        return t.send_message(*args)
    if cmd == "peer_error":
        return t.peer_error(*args)
    raise ValueError(f"unknown command {cmd}")


class Peer:
    """A KVTransport in a spawned process, driven over a pipe."""

    def __init__(self, name, port=None, **shape):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.name = name
        self.proc = ctx.Process(target=_peer_main, args=(child, name, {**SHAPE, **shape}, port), daemon=True)
        self.proc.start()
        self.inbox = []  # what `pump` drained from the local transport while waiting
        self.port = self._result(60, None)

    def call(self, *cmd, pump: KVTransport | None = None, timeout: float = 30):
        """Run a command in the peer; keep `pump`'s transport answering meanwhile."""
        self.conn.send(cmd)
        return self._result(timeout, pump)

    def _result(self, timeout, pump):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.002):
            if pump is not None:
                self.inbox.extend(pump.messages())
            if time.monotonic() > deadline or not self.proc.is_alive():
                raise TimeoutError(f"peer {self.name} gave no answer")
        status, value = self.conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def wait_done(t, h, timeout=10.0):
    while t.poll(h) == "PROC" and h.age_s < timeout:
        time.sleep(0.001)
    return h.state


@pytest.fixture(scope="module")
def prefill():
    kv, meta = make_buffers(**SHAPE)
    kv.copy_(torch.randn(kv.shape))
    meta.copy_(torch.arange(meta.numel()).reshape(meta.shape))
    with KVTransport("prefill-test", kv, meta) as t:
        yield t


@pytest.fixture(scope="module")
def decode(prefill):
    peer = Peer("decode-test")
    # non-blocking, by host name: the handshake advances inside messages()
    assert prefill.connect(peer.name, "localhost", peer.port, timeout_s=20, wait=False) is None
    while not prefill.is_connected(peer.name):
        assert prefill.messages() == [] and prefill.peer_error(peer.name) is None
        time.sleep(0.005)
    yield peer
    peer.stop()


def test_connect_reports_peer(prefill, decode):
    assert prefill.port > 0 and prefill.is_connected(decode.name)
    info = prefill.connect(decode.name, "127.0.0.1", decode.port)  # idempotent
    assert info.layout == prefill.layout and info.kv.count == SHAPE["num_pages"]


def test_layer_group_lands_in_exactly_the_destination_pages(prefill, decode):
    decode.call("reset")
    local, remote, layers = [3, 4, 5, 9, 0], [10, 11, 12, 2, 7], [1, 2]
    h = prefill.write_kv(decode.name, local, remote, layers, notif=b"room7/g0")
    assert h.ndescs == 2 * len(layers) * 3  # runs (3,10,3) (9,2,1) (0,7,1)
    assert wait_done(prefill, h) == "DONE"
    prefill.release(h)
    [(peer, msg, kv, _)] = decode.call("wait", 1, 10)
    assert (peer, msg) == (prefill.name, b"room7/g0")
    src = prefill.kv.numpy()
    expect = np.full_like(src, SENTINEL)
    for l in layers:
        expect[l, :, remote] = src[l, :, local]
    np.testing.assert_array_equal(kv, expect)


def test_metadata_waits_for_a_kv_write_in_flight():
    """The worker posts the metadata row (decode's `done`) only once every KV write of the
    room has finished: while NIXL still reports a KV write in flight, decode is not told
    done and its slot stays untouched, however often the worker looks; once the write
    finishes, the metadata follows and the KV under it is there."""
    kv, meta = make_buffers(**SHAPE)
    kv.copy_(torch.randn(kv.shape))
    meta.copy_(torch.arange(meta.numel()).reshape(meta.shape))
    transport = KVTransport("prefill-held", kv, meta)
    held, kv_handles, looks = threading.Event(), [], []
    real_poll, real_write_kv = transport.poll, transport.write_kv

    def write_kv(*args, **kwargs):
        kv_handles.append(real_write_kv(*args, **kwargs))
        return kv_handles[-1]

    def poll(handle):
        if handle in kv_handles and not held.is_set():
            looks.append(handle)
            return "PROC"   # the write is held in flight, whatever NIXL says
        return real_poll(handle)

    transport.write_kv, transport.poll = write_kv, poll
    worker = TransferWorker(transport, wake=lambda: None, timeout_s=30)
    peer = Peer("decode-held")
    try:
        worker.connect(peer.name, "127.0.0.1", peer.port, timeout_s=10)
        assert _next_event(worker, {"connected", "connect_failed"}, 10)[0] == "connected"
        worker.write(7, peer.name, range(SHAPE["num_layers"]), [6, 7], [0, 1])
        worker.finish(7, peer.name, 1, 3)
        deadline = time.monotonic() + 10
        while (len(looks) < 20 or real_poll(kv_handles[0]) != "DONE") and time.monotonic() < deadline:
            time.sleep(0.002)   # until NIXL has finished the write and the worker saw it held 20 times
        assert len(looks) >= 20 and real_poll(kv_handles[0]) == "DONE"
        assert peer.call("wait", 1, 0) == [] and (peer.call("meta")[3] == -1).all()   # not told done
        held.set()
        [(_, message, landed_kv, landed_meta)] = peer.call("wait", 1, 10)
        assert message == protocol.encode("done", 7)
        np.testing.assert_array_equal(landed_meta[3], meta[1].numpy())
        np.testing.assert_array_equal(landed_kv[:, :, [0, 1]], kv.numpy()[:, :, [6, 7]])
        assert _next_event(worker, {"shipped"}, 10)[1] == 7
    finally:
        peer.stop()
        worker.stop()


def test_messages_both_ways_and_bad_indices(prefill, decode):
    prefill.send_message(decode.name, b"pages please")
    [(peer, msg, _, _)] = decode.call("wait", 1, 10)
    assert (peer, msg) == (prefill.name, b"pages please")
    decode.call("send", prefill.name, b"room 9: pages 1,2 slot 0", pump=prefill)
    deadline = time.monotonic() + 10
    while not decode.inbox and time.monotonic() < deadline:
        decode.inbox.extend(prefill.messages())
    assert decode.inbox.pop(0) == (decode.name, b"room 9: pages 1,2 slot 0")
    with pytest.raises(ValueError):
        prefill.write_kv(decode.name, [0], [SHAPE["num_pages"]], [0])
    with pytest.raises(ValueError):
        prefill.write_kv(decode.name, [0], [0], [SHAPE["num_layers"]])
    with pytest.raises(TransferError, match="not connected"):
        prefill.write_kv("nobody", [0], [0], [0])


def test_mismatched_layout_is_refused_by_both_sides(prefill):
    peer = Peer("decode-wide", page_size=8)
    try:
        # the decode side starts the handshake; the prefill side answers from messages()
        with pytest.raises(RuntimeError, match="page_size 8 here vs 4 on peer"):
            peer.call("connect", prefill.name, prefill.port, 10, pump=prefill)
        assert "page_size 4 here vs 8 on peer" in prefill.peer_error(peer.name)
        with pytest.raises(TransferError, match="page_size"):
            prefill.write_kv(peer.name, [0], [0], [0])
        with pytest.raises(TransferError, match="page_size"):
            prefill.connect(peer.name, "127.0.0.1", peer.port, timeout_s=10)
    finally:
        peer.stop()


def test_connect_where_nobody_listens_times_out(prefill):
    import socket

    with socket.socket() as s:  # a port that is free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="nothing listening"):
        prefill.connect("ghost", "127.0.0.1", port, timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0
    assert prefill.connect("ghost", "127.0.0.1", port, timeout_s=0.5, wait=False) is None
    while prefill.peer_error("ghost") is None and time.monotonic() - t0 < 5.0:
        prefill.messages()
    assert "nothing listening" in prefill.peer_error("ghost")
    with pytest.raises(TransferError, match="cannot reach"):
        prefill.connect("ghost", "no-such-host.invalid", port, timeout_s=0.5)


def _write_until_failure(t, peer, pages, limit_s=10.0):
    """Keep writing to `peer` until a write fails, or time out a transfer stuck in PROC."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        try:
            h = t.write_kv(peer, pages, pages, range(SHAPE["num_layers"]))
        except TransferError as e:
            return f"raised: {e}"
        state = wait_done(t, h, timeout=2.0)
        t.release(h)
        if state != "DONE":
            return state  # ERR, or PROC past our deadline: the caller gives up either way
    return None


def test_peer_killed_before_transfer_then_restarted(prefill):
    peer = Peer("decode-crash")
    try:
        peer.call("connect", prefill.name, prefill.port, 20, pump=prefill)
        assert prefill.is_connected(peer.name)
        peer.kill()
        t0 = time.monotonic()
        assert _write_until_failure(prefill, peer.name, [0, 1]) is not None
        assert time.monotonic() - t0 < 10
        with pytest.raises(TransferError):
            prefill.send_message(peer.name, b"are you there")
        assert "went away" in prefill.peer_error(peer.name)
        assert not prefill.is_connected(peer.name)
    finally:
        peer.stop()
    # Same name again, as a restarted engine would come back, and the survivor is
    # not told anything: the new HELLO must replace the dead peer's metadata.
    again = Peer("decode-crash")
    try:
        again.call("connect", prefill.name, prefill.port, 20, pump=prefill)
        h = prefill.write_kv(again.name, [2, 3], [4, 5], [0], notif=b"after restart")
        assert wait_done(prefill, h) == "DONE"
        prefill.release(h)
        [(_, msg, kv, _)] = again.call("wait", 1, 10)
        assert msg == b"after restart"
        np.testing.assert_array_equal(kv[0][:, [4, 5]], prefill.kv.numpy()[0][:, [2, 3]])
    finally:
        again.stop()


def _next_event(worker, kinds, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in worker.take_events():
            if event[0] in kinds:
                return event
        time.sleep(0.01)
    return None


def test_worker_dials_a_restarted_listener_again():
    # Decode's view of a prefill engine that restarts: the peer it dialed dies, and a new
    # process comes back on the same port under the same name; dialing again must work.
    kv, meta = make_buffers(**SHAPE)
    worker = TransferWorker(KVTransport("dialer", kv, meta), wake=lambda: None, timeout_s=10)
    first = Peer("listener-restart")
    try:
        worker.connect(first.name, "127.0.0.1", first.port, timeout_s=5)
        assert _next_event(worker, {"connected", "connect_failed"}, 10)[0] == "connected"
        first.kill()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and not _next_event(worker, {"send_failed"}, 0.1):
            worker.send(first.name, b"are you there", 0)  # as decode pings: UCX notices the death
        assert time.monotonic() - t0 < 10
        again = Peer("listener-restart", port=first.port)
        try:
            start = time.monotonic()
            worker.connect(again.name, "127.0.0.1", again.port, timeout_s=5)
            event = _next_event(worker, {"connected", "connect_failed"}, 10)
            assert event[0] == "connected", event
            assert time.monotonic() - start < 5
            worker.send(again.name, b"after restart", 0)
            assert again.call("wait", 1, 10)[0][1] == b"after restart"
        finally:
            again.stop()
    finally:
        first.stop()
        worker.stop()


def test_peer_killed_mid_transfer_survivor_moves_on():
    big = {**SHAPE, "num_pages": 1 << 16}  # 128 MiB per side: one write takes tens of ms
    kv, meta = make_buffers(**big)
    with KVTransport("prefill-big", kv, meta) as t:
        victim = Peer("decode-victim", num_pages=1 << 16)
        try:
            t.connect(victim.name, "127.0.0.1", victim.port, timeout_s=20)
            threading.Timer(0.3, victim.kill).start()
            t0 = time.monotonic()
            assert _write_until_failure(t, victim.name, list(range(1 << 16))) is not None
            assert time.monotonic() - t0 < 15
            t.disconnect(victim.name)  # must not raise on a dead peer
        finally:
            victim.stop()
        fresh = Peer("decode-fresh")  # a different pool size: only the layout must match
        try:
            t.connect(fresh.name, "127.0.0.1", fresh.port, timeout_s=20)
            h = t.write_kv(fresh.name, [1], [1], [3], notif=b"ok")
            assert wait_done(t, h) == "DONE"
            t.release(h)
            assert fresh.call("wait", 1, 10)[0][1] == b"ok"
        finally:
            fresh.stop()


def _pumped(done, *transports):
    """done(), asked after each transport has read its notifications (they advance handshakes)."""
    def check():
        for t in transports:
            t.messages()
        return done()
    return check


def test_a_handshake_answer_after_a_redial_waits_for_the_metadata():
    """The worker redials a peer whose first try ran out (a loaded machine): the redial drops
    the peer's NIXL metadata and fetches it again. The answer to the first try's HELLO may
    be read after that; the peer must not count as connected until its metadata is back, or
    the first message to it fails with NIXL_ERR_NOT_FOUND (seen in CI)."""
    (kv_a, meta_a), (kv_b, meta_b) = make_buffers(**SHAPE), make_buffers(**SHAPE)
    with KVTransport("redialer", kv_a, meta_a) as a, KVTransport("answerer", kv_b, meta_b) as b:
        held, read = [], a._agent.get_new_notifs

        def hold_back():  # UCX still progresses; the answer is read only when we say
            notifs = read()
            if notifs:
                held.append(notifs)
            return {}

        a.connect(b.name, "127.0.0.1", b.port, timeout_s=10, wait=False)
        assert wait_for(_pumped(lambda: a._dials[b.name].hello_sent, a))
        a._agent.get_new_notifs = hold_back
        assert wait_for(_pumped(lambda: any(b.name in n for n in held), a, b))  # b's answer is here
        a.disconnect(b.name)  # what the worker's second try does first: b's metadata is gone
        assert not a._agent.check_remote_metadata(b.name)
        a._agent.get_new_notifs = lambda: held.pop(0) if held else read()
        a.messages()  # the answer to the first try is read now
        assert not a.is_connected(b.name), "connected to a peer whose metadata is not loaded"
        a.connect(b.name, "127.0.0.1", b.port, timeout_s=10, wait=False)
        assert wait_for(_pumped(lambda: a.is_connected(b.name), a, b))
        a.send_message(b.name, b"after the redial")
        got = []
        assert wait_for(lambda: got.extend(b.messages()) or (a.name, b"after the redial") in got)
