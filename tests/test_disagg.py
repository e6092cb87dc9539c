"""Prefill and decode engines joined by real NIXL transports (in this process):
exact output, layer-pipelined writes, and every failure path with both KV
pools whole afterwards."""
import queue
import threading
import time

import pytest
import torch

from backends.config import EngineConfig
from backends.disagg import protocol
from backends.disagg.config import DisaggConfig
from backends.disagg.pipeline import layer_group_size, layer_groups
from backends.engine import Engine
from backends.request import SamplingParams
from backends.disagg.local import Pair, drain
from tests.engine_utils import collect, idle_pages, small_engine, token_ids
from client.triton_server import free_port
from tests.test_model_parity import prompts

PARAMS = SamplingParams(max_tokens=20, min_tokens=20)


# ---- the adaptive layer-group size ---------------------------------------------------
@pytest.mark.parametrize("layers, tokens, knobs, expected", [
    (80, 3072, {}, 8),            # at the threshold: max_iters (10) groups
    (32, 3072, {}, 3),            # any depth: 32 // 10
    (80, 9216, {}, 20),           # saturated (3x threshold): min_iters (4) groups
    (80, 50000, {}, 20),          # beyond saturation stays at min_iters
    (80, 6144, {}, 11),           # halfway: 7 groups -> 80 // 7
    (80, 3071, {}, 0),            # below the threshold: one write after the forward
    (80, 9216, {"pipeline_group_size": 10}, 10),  # fixed override
    (8, 9216, {"pipeline_group_size": 10}, 8),    # override capped at the layer count
    (80, 100, {"pipeline_group_size": 10}, 10),   # a fixed size wins over the threshold
    (3, 100, {"pipeline_group_size": 1}, 1),      # and over the small-model rule
    (5, 3072, {}, 1),             # never below one layer
    (4, 9216, {}, 0),             # 4 layers or fewer: one write after the forward
    (2, 3072, {}, 0),
    (80, 9216, {"pipeline": "off"}, 0),
    (80, 9216, {"pipeline": "off", "pipeline_group_size": 10}, 0),
    (80, 0, {"pipeline_min_tokens": 0}, 8),       # threshold 0: every step pipelined, no division by zero
    (80, 2, {"pipeline_min_tokens": 0}, 11),
    (80, 5000, {"pipeline_min_tokens": 0}, 20),
])
def test_layer_group_size(layers, tokens, knobs, expected):
    cfg = DisaggConfig(**{"pipeline_min_tokens": 3072, **knobs})
    assert layer_group_size(layers, tokens, cfg) == expected


@pytest.mark.parametrize("name, value", [
    ("pipeline_min_tokens", "-1"), ("pipeline_group_size", "-2"), ("pipeline_min_iters", "0"),
    ("pipeline_max_iters", "x"), ("pipeline_saturation", "1"), ("transfer_timeout_s", "0"),
    ("handshake_timeout_s", "-1"), ("meta_slots", "0"), ("decode_reserve_tokens", "-1"),
    ("nixl_port", "70000"), ("pipeline", "sometimes"), ("prefill_before_destination", "on"),
])
def test_bad_knobs_are_refused_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=name):
        DisaggConfig.from_params({name: value})


def test_layer_groups_cover_every_layer_once():
    assert layer_groups(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert layer_groups(7, 0) == [range(0, 7)]


# ---- on a GPU the transfer thread, not the forward, waits for each group's KV -----------
class FakeEvent:
    """torch.cuda.Event on a CPU: says whether it was recorded and which threads waited on it."""

    def __init__(self):
        self.recorded, self.waits = False, []

    def record(self):
        self.recorded = True

    def synchronize(self):
        self.waits.append(threading.current_thread().name)


def test_a_cuda_prefill_records_an_event_per_layer_group_and_never_waits_for_the_stream(monkeypatch):
    from types import SimpleNamespace

    import torch

    from backends.disagg.prefill import PrefillRole
    from backends.kv_cache import KVManager
    from backends.request import Request
    from backends.role import EngineFacts
    from backends.runner import Batch
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: made.append(FakeEvent()) or made[-1])

    def stream():
        raise AssertionError("the forward waited for the whole stream")
    monkeypatch.setattr(torch.cuda, "current_stream", stream)
    pool, writes = KVManager(16, 4), []
    facts = EngineFacts(kv=None, num_layers=6, device_type="cuda", kv_manager=pool, prefix_caching=False,
                        wake=lambda: None)
    worker = SimpleNamespace(trace=None, write=lambda *args: writes.append(args))
    role = PrefillRole(DisaggConfig(pipeline_group_size=2), facts, engine=None, worker=worker)
    req = Request("r", list(range(12)), SamplingParams(), None, None, room=5)
    req.pages = pool.allocate(3)
    role.dests[5] = ("peer", {"pages": [7, 8, 9]}, 0.0)
    hook = role.layer_hook(Batch([(req, 12)]))
    assert hook.after == (1, 3, 5)
    for layer in hook.after:
        hook.run(layer)
    assert [w[2] for w in writes] == layer_groups(6, 2)  # (room, peer, layers, local, remote, ready)
    assert all(w[3] == req.pages and w[4] == [7, 8, 9] for w in writes)
    assert [w[5] for w in writes] == made and len(made) == 3 and all(e.recorded for e in made)


def test_the_transfer_thread_waits_for_the_event_before_nixl_reads_the_pages():
    from types import SimpleNamespace

    from backends.disagg.worker import TransferWorker
    order = []

    class Transport:
        def write_kv(self, peer, local, remote, layers):
            order.append(("write_kv", threading.current_thread().name))
            return SimpleNamespace(nbytes=1, released=False)

        def messages(self):
            return []

        def poll(self, handle):
            return "PROC"

        def close(self):
            pass
    event, worker = FakeEvent(), TransferWorker(Transport(), lambda: None, 30)
    try:
        worker.write(1, "peer", range(0, 2), [1], [2], event)
        assert wait_for(lambda: order)
    finally:
        worker.stop()
    assert event.waits == ["tandem-transfer"] and order == [("write_kv", "tandem-transfer")]


def test_the_transfer_thread_reads_notifications_often_while_its_role_awaits_one():
    """Reading NIXL's notifications every 20 ms when idle cost each awaited destination (or
    KV landing) up to 20 ms; while the role awaits one, the thread reads every 2 ms."""
    from backends.disagg.worker import POLL_S, TransferWorker
    reads, awaiting = [], [False]

    class Transport:
        def messages(self):
            reads.append(time.monotonic())
            return []

        def close(self):
            pass
    def rate(window: float) -> float:  # reads a second over a window timed here (a sleep may overrun)
        start = time.monotonic()
        time.sleep(window)
        end = time.monotonic()
        return sum(start <= t < end for t in list(reads)) / (end - start)
    worker = TransferWorker(Transport(), lambda: None, 30, expecting=lambda: awaiting[0])
    try:
        time.sleep(0.05)
        idle = rate(0.3)                            # every 10 x POLL_S: about 50 a second
        awaiting[0] = True
        time.sleep(0.05)
        hot = rate(0.3)                             # every POLL_S: about 500 a second
    finally:
        worker.stop()
    assert idle <= 1 / (10 * POLL_S) + 10 and hot >= 3 / (10 * POLL_S), (idle, hot)


# ---- exact output ------------------------------------------------------------------
@pytest.fixture(scope="module", params=["off", "on"], ids=["overlap-off", "overlap-on"])
def pair(checkpoint, request):
    # 1 layer per group above 8 tokens: every chunk of the long prompts is pipelined
    p = Pair(checkpoint("llama"), pipeline_min_tokens=8, pipeline_group_size=1, transfer_timeout_s=5,
             engine_overrides={"overlap": request.param})
    yield p
    p.close()


def test_disaggregated_equals_colocated(pair, colocated):
    batch = prompts(6)  # 3 to 50 tokens: short ones and several 16-token chunks
    expected = [token_ids(o) for o in collect(colocated, batch, PARAMS)]
    results = pair.run(batch, PARAMS)
    for (dec, pre), want in zip(results, expected):
        assert dec[-1].error is None and token_ids(dec) == want
        assert [t for o in pre for t in o.token_ids] == want[:1]  # prefill streams the first token itself
    assert pair.wait_kv_whole()
    assert pair.prefill.stats()["kv_bytes_sent"] > 0


def test_prefill_refusing_the_room(pair):
    room = 4242
    _, d, _ = pair.submit(prompts(2)[1], PARAMS, room=room, to_prefill=False)
    p = queue.Queue()
    pair.prefill.generate(prompts(2)[1][:-3], PARAMS, p.put, request_id=f"room-{room}", room=room)
    dec, pre = drain(d, 10), drain(p, 10)
    assert "prompt length differs" in dec[-1].error and "refused" in pre[-1].error
    assert pair.wait_kv_whole()


def test_transfer_timeout(checkpoint):
    pair = Pair(checkpoint("llama"), transfer_timeout_s=1.0)
    try:
        start = time.monotonic()
        _, d, _ = pair.submit(prompts(1)[0], PARAMS, to_prefill=False)  # prefill never hears of it
        dec = drain(d, 10)
        assert "not done within 1s" in dec[-1].error and time.monotonic() - start < 5
        assert pair.wait_kv_whole()
    finally:
        pair.close()


def test_transfer_error_reported_and_engines_go_on(pair, monkeypatch):
    transport = pair.prefill.scheduler.role.worker.transport
    monkeypatch.setattr(transport, "poll", lambda h: "ERR")
    [(dec, pre)] = pair.run([prompts(2)[1]], PARAMS)
    assert "failed" in dec[-1].error and pre[-1].error
    monkeypatch.undo()
    assert pair.wait_kv_whole()
    [(dec, _)] = pair.run([prompts(2)[1]], PARAMS)
    assert dec[-1].error is None and len(token_ids(dec)) == 20


def writes_in_flight(pair, monkeypatch) -> threading.Event:
    """The prefill side's KV writes look in flight (NIXL says PROC) until the returned
    gate is set, as over RDMA, where a write ends long after its post."""
    gate = threading.Event()
    transport = pair.prefill.scheduler.role.worker.transport
    poll = transport.poll
    monkeypatch.setattr(transport, "poll", lambda h: poll(h) if gate.is_set() else "PROC")
    return gate


def wait_for(done, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


# ---- a prompt that does not wait for its destination ---------------------------------------
@pytest.mark.parametrize("knob", ["auto", "off"])
def test_a_short_prompt_runs_while_its_destination_is_on_the_way(checkpoint, colocated, monkeypatch, knob):
    """Decode sends each destination 1 s late. With auto, prompts below pipeline_min_tokens
    (256 by default, so these) sample their first token before the first destination leaves,
    and their KV follows it; with off, each prompt runs after its destination. Output and KV
    are the colocated engine's either way, and both pools end whole."""
    pair = Pair(checkpoint("llama"), prefill_before_destination=knob)
    try:
        decode, prefill = pair.decode.scheduler.role, pair.prefill.scheduler.role
        send, sampled, dest_sent, sampled_at = decode._send, prefill.on_sampled, {}, {}

        def late_dest(kind, req, **fields):
            if kind == "dest":
                time.sleep(1.0)
                dest_sent[req.room] = time.monotonic()
            send(kind, req, **fields)

        def record_sampled(req):
            sampled_at[req.room] = time.monotonic()
            return sampled(req)
        monkeypatch.setattr(decode, "_send", late_dest)
        monkeypatch.setattr(prefill, "on_sampled", record_sampled)
        batch = prompts(3)
        expected = [token_ids(o) for o in collect(colocated, batch, PARAMS)]
        for (dec, pre), want in zip(pair.run(batch, PARAMS, timeout_s=30), expected):
            assert dec[-1].error is None and token_ids(dec) == want
            assert pre[-1].error is None and token_ids(pre) == want[:1]
        if knob == "auto":
            assert max(sampled_at.values()) < min(dest_sent.values()), "a prompt waited for its destination"
        else:
            assert all(sampled_at[room] > dest_sent[room] for room in sampled_at)
        assert pair.wait_kv_whole()
    finally:
        pair.close()


# ---- preemption on the prefill side ----------------------------------------------------
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_preempted_pages_stay_out_of_the_pool_while_writes_read_them(checkpoint, colocated, monkeypatch, overlap):
    # 20 prefill pages cannot hold both prompts (13 + 10 pages): the later one is preempted.
    # Prompts wait for their destination, so the preempted one has writes in flight.
    pair = Pair(checkpoint("llama"), prefill_engine={"num_pages": 20}, pipeline_min_tokens=8,
                pipeline_group_size=1, transfer_timeout_s=20, engine_overrides={"overlap": overlap},
                prefill_before_destination="off")
    gate = writes_in_flight(pair, monkeypatch)
    try:
        role, pool = pair.prefill.scheduler.role, pair.prefill.scheduler.pool
        events, posted, freed_early = [], set(), []
        write, idle, preempt = role.worker.write, pool._idle, role.on_preempt

        def record_write(room, peer, layers, local, remote, ready=None):
            events.append(("write", room, tuple(remote)))
            posted.update(local)
            write(room, peer, layers, local, remote, ready)

        def record_idle(page):  # its last reference went: free or cached, another request may take it
            if not gate.is_set() and page in posted:  # every write posted so far is still in flight
                freed_early.append(page)
            idle(page)

        def record_preempt(req):
            events.append(("preempt", req.room, ()))
            return preempt(req)
        monkeypatch.setattr(role.worker, "write", record_write)
        monkeypatch.setattr(pool, "_idle", record_idle)
        monkeypatch.setattr(role, "on_preempt", record_preempt)

        batch = [prompts(4)[3], prompts(2)[1]]
        handles = [pair.submit(ids, PARAMS) for ids in batch]
        assert wait_for(lambda: pair.prefill.stats()["preemptions"] > 0)
        time.sleep(1.0)  # longer than a preemption waits for the writes
        assert not freed_early, "pages went back to the pool while writes still read them"
        gate.set()
        expected = [token_ids(o) for o in collect(colocated, batch, PARAMS)]
        for (_, d, p), want in zip(handles, expected):
            dec = drain(d, 30)
            assert dec[-1].error is None and token_ids(dec) == want and drain(p, 30)[-1].error is None
        assert pair.wait_kv_whole()
        for room in {room for kind, room, _ in events if kind == "preempt"}:
            mine = [(kind, pages) for kind, r, pages in events if r == room]
            last = max(i for i, (kind, _) in enumerate(mine) if kind == "preempt")
            assert mine[0][0] == "write", "the preempted request must have had writes in flight"
            every = {p for kind, pages in mine if kind == "write" for p in pages}
            again = {p for kind, pages in mine[last:] if kind == "write" for p in pages}
            assert again == every, "a recomputed request must send all of its KV again"
    finally:
        gate.set()
        pair.close()


# ---- the decode quarantine ---------------------------------------------------------------
def message_log(pair, monkeypatch) -> tuple[dict, dict]:
    """(kind, room) of every message each side's transport sent, and of every message each
    side's role has handled."""
    sent, handled = {"prefill": [], "decode": []}, {"prefill": [], "decode": []}
    for side, engine in (("prefill", pair.prefill), ("decode", pair.decode)):
        role = engine.scheduler.role
        send, on_message = role.worker.transport.send_message, role._on_message

        def record_send(peer, data, side=side, send=send):
            msg = protocol.decode(data)
            sent[side].append((msg["kind"], msg["room"]))
            return send(peer, data)

        def record_handled(peer, msg, side=side, on_message=on_message):
            on_message(peer, msg)
            handled[side].append((msg["kind"], msg["room"]))
        monkeypatch.setattr(role.worker.transport, "send_message", record_send)
        monkeypatch.setattr(role, "_on_message", record_handled)
    return sent, handled


@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_quarantine_holds_until_prefill_says_released(pair, monkeypatch, who):
    sent, handled = message_log(pair, monkeypatch)
    gate = writes_in_flight(pair, monkeypatch)
    try:
        room, d, p = pair.submit(prompts(2)[1], PARAMS)
        assert wait_for(lambda: pair.prefill.stats()["shipping"] == 1)  # every KV write posted
        (pair.prefill if who == "prefill" else pair.decode).abort(f"room-{room}")
        assert drain(d, 10)[-1].finish_reason == ("error" if who == "prefill" else "abort")
        assert drain(p, 10)[-1].finish_reason == "abort"
        # the abort has crossed (prefill's `error`, or decode's `abort`), prefill's transfer
        # thread has gone round once after it (what it would send for the room is sent),
        # and decode has handled every message prefill sent about the room
        message, log = (("error", room), handled["decode"]) if who == "prefill" else (("abort", room), handled["prefill"])
        assert wait_for(lambda: message in log)
        worker, turned = pair.prefill.scheduler.role.worker, threading.Event()
        worker.call(lambda: worker.call(turned.set))   # the inner one runs after the next poll
        of_room = lambda msgs: [m for m in msgs if m[1] == room]
        assert wait_for(lambda: turned.is_set() and of_room(handled["decode"]) == of_room(sent["prefill"]))
        assert pair.decode.stats()["quarantined_pages"] > 0, "decode freed pages prefill may still write"
        assert not pair.kv_whole()
    finally:
        gate.set()
    assert pair.wait_kv_whole()
    [(dec, _)] = pair.run([prompts(2)[1]], PARAMS)
    assert dec[-1].error is None


# ---- overload and cancels on decode ------------------------------------------------------
def blocked_pair(checkpoint, monkeypatch, **knobs):
    """A pair whose decode pool is taken by a long request: the next ones wait in prealloc (with
    the prefix cache off: the same prompt would share the blocker's pages on decode)."""
    pair = Pair(checkpoint("llama"), engine_overrides={"num_pages": 128, "prefix_caching": "off"},
                decode_reserve_tokens=400, **knobs)
    run = pair.decode.scheduler.runner.forward
    monkeypatch.setattr(pair.decode.scheduler.runner, "forward", lambda *a: (time.sleep(0.02), run(*a))[1])
    room, d, _ = pair.submit(prompts(4)[3], SamplingParams(max_tokens=400, min_tokens=400))  # 8 s of decode
    d.get(timeout=30)
    return pair, room, d


def test_overload_queues_past_the_transfer_timeout(checkpoint, monkeypatch):
    pair, blocker, blocked = blocked_pair(checkpoint, monkeypatch, transfer_timeout_s=1.0)
    try:
        # prefill gets the request once decode has said it is queued (sent together, a loaded
        # machine can take longer than the 1 s timeout to carry that word)
        room, d, _ = pair.submit(prompts(4)[3], PARAMS, to_prefill=False)
        assert wait_for(lambda: room in pair.prefill.scheduler.role.decode_queued)
        p = queue.Queue()
        pair.prefill.generate(prompts(4)[3], PARAMS, p.put, request_id=f"room-{room}", room=room)
        time.sleep(2.5)
        # prefill may have streamed its first token (the prompt runs before the destination comes)
        early = [p.get_nowait() for _ in range(p.qsize())]
        assert pair.decode.stats()["prealloc"] == 1 and d.empty() and not any(o.finished for o in early), \
            "a queued request failed"
        pair.decode.abort(f"room-{blocker}")
        assert drain(blocked, 10)[-1].finish_reason == "abort"
        dec, pre = drain(d, 30), early + drain(p, 30)
        assert dec[-1].error is None and len(token_ids(dec)) == 20 and pre[-1].error is None
        assert pair.wait_kv_whole()
    finally:
        pair.close()


def test_a_request_that_can_never_fit_is_refused_at_once(checkpoint):
    pair = Pair(checkpoint("llama"), engine_overrides={"num_pages": 8})  # 32 tokens, the prompt has 50
    try:
        room, d, p = pair.submit(prompts(4)[3], PARAMS, to_prefill=False)
        assert "needs 13 KV pages" in drain(d, 10)[-1].error
    finally:
        pair.close()


def test_cancel_during_prealloc(checkpoint, monkeypatch):
    pair, blocker, _ = blocked_pair(checkpoint, monkeypatch)
    try:
        room, d, p = pair.submit(prompts(4)[3], PARAMS)
        assert wait_for(lambda: pair.decode.stats()["prealloc"] == 1)
        pair.decode.abort(f"room-{room}")
        pair.prefill.abort(f"room-{room}")
        assert drain(d, 10)[-1].finish_reason == "abort" and drain(p, 10)[-1].finish_reason == "abort"
        pair.decode.abort(f"room-{blocker}")
        assert pair.wait_kv_whole()
    finally:
        pair.close()


def test_decode_cancel_reaches_a_prefill_request_that_comes_later(checkpoint, monkeypatch):
    pair, blocker, _ = blocked_pair(checkpoint, monkeypatch, transfer_timeout_s=5.0)
    sent, handled = message_log(pair, monkeypatch)
    try:
        room, d, _ = pair.submit(prompts(4)[3], PARAMS, to_prefill=False)
        assert wait_for(lambda: pair.decode.stats()["prealloc"] == 1)
        pair.decode.abort(f"room-{room}")
        assert drain(d, 10)[-1].finish_reason == "abort"
        of_room = lambda msgs: [m for m in msgs if m[1] == room]   # prefill has handled all decode sent
        assert wait_for(lambda: ("abort", room) in handled["prefill"]
                        and of_room(handled["prefill"]) == of_room(sent["decode"]))
        p = queue.Queue()
        start = time.monotonic()
        pair.prefill.generate(prompts(4)[3], PARAMS, p.put, request_id=f"room-{room}", room=room)
        assert drain(p, 10)[-1].finish_reason == "abort" and time.monotonic() - start < 2
        pair.decode.abort(f"room-{blocker}")
        assert pair.wait_kv_whole()
    finally:
        pair.close()


def test_cancel_before_the_request_arrives(checkpoint):
    # the router sends a cancel as a request of its own: it can overtake the one it cancels
    engine = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=64, role="decode"),
                    disagg=DisaggConfig(prefill_address=f"127.0.0.1:{free_port()}")).start()
    try:
        engine.abort("room-7")
        q = queue.Queue()
        engine.generate(prompts(1)[0], PARAMS, q.put, request_id="room-7", room=7)
        out = drain(q, 5)
        assert out[-1].finish_reason == "abort"
    finally:
        engine.stop()


def test_cancel_during_transfer_quarantines_until_released(pair):
    room, d, _ = pair.submit(prompts(2)[1], PARAMS, to_prefill=False)
    deadline = time.time() + 5
    while pair.decode.stats()["transferring"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert pair.decode.stats()["transferring"] == 1
    pair.decode.abort(f"room-{room}")
    assert drain(d, 10)[-1].finish_reason == "abort"
    assert pair.wait_kv_whole()  # prefill answered `released` for the room it never served


def test_cancel_during_decode(pair):
    room, d, p = pair.submit(prompts(2)[1], SamplingParams(max_tokens=400, min_tokens=400))
    outs = [d.get(timeout=30) for _ in range(3)]
    pair.decode.abort(f"room-{room}")
    outs += drain(d, 10)
    assert outs[-1].finish_reason == "abort" and len(token_ids(outs)) < 400
    drain(p, 10)
    assert pair.wait_kv_whole()


def test_prefill_unreachable(checkpoint):
    cfg = DisaggConfig(prefill_address=f"127.0.0.1:{free_port()}", handshake_timeout_s=1.0)
    engine = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=64, role="decode"),
                    disagg=cfg).start()
    try:
        q = queue.Queue()
        engine.generate(prompts(1)[0], PARAMS, q.put, request_id="room-1", room=1)
        out = drain(q, 15)
        assert "unreachable" in out[-1].error
        assert idle_pages(engine.stats()) == engine.stats()["kv_pages_total"]
    finally:
        engine.stop()


def test_layout_mismatch_is_refused(checkpoint):
    pair = Pair(checkpoint("llama"), prefill_engine={"page_size": 8}, handshake_timeout_s=3.0)
    try:
        room, d, p = pair.submit(prompts(1)[0], PARAMS)
        assert "page_size" in drain(d, 20)[-1].error
        pair.prefill.abort(f"room-{room}")  # as the router does when one child fails
        assert drain(p, 10)[-1].finish_reason == "abort"
        assert pair.wait_kv_whole()
    finally:
        pair.close()


def test_bf16_kv_hand_off_equals_colocated_bf16_kv(checkpoint):
    """kv_cache_dtype bfloat16 on both sides: the pages travel as bf16 (half the bytes) and
    decode continues exactly as one engine with a bf16 cache; a side with an fp32 cache is refused
    at the handshake, naming the dtype."""
    knobs = {"kv_cache_dtype": "bfloat16"}
    batch = prompts(4)
    one = small_engine(checkpoint("llama"), **knobs)
    try:
        expected = [token_ids(o) for o in collect(one, batch, PARAMS)]
    finally:
        one.stop()
    pair = Pair(checkpoint("llama"), engine_overrides=knobs, pipeline_min_tokens=8, pipeline_group_size=1)
    try:
        assert [token_ids(dec) for dec, _ in pair.run(batch, PARAMS)] == expected
        assert pair.wait_kv_whole() and pair.prefill.runner.kv.dtype == torch.bfloat16
    finally:
        pair.close()
    pair = Pair(checkpoint("llama"), prefill_engine={"kv_cache_dtype": "auto"}, engine_overrides=knobs,
                handshake_timeout_s=3.0)
    try:
        room, d, p = pair.submit(prompts(1)[0], PARAMS)
        assert "dtype bfloat16 here vs float32 on peer" in drain(d, 20)[-1].error
        pair.prefill.abort(f"room-{room}")
        assert drain(p, 10)[-1].finish_reason == "abort"
        assert pair.wait_kv_whole()
    finally:
        pair.close()


# ---- layer pipelining is real --------------------------------------------------------
@pytest.mark.parametrize("pipeline", ["auto", "off"])
def test_early_layer_groups_land_before_the_last_layer(default_model, pipeline):
    # the prompt waits for its destination with pipeline off too, so its layers are traced
    pair = Pair(default_model, engine_overrides={"page_size": 16, "num_pages": 128, "chunk_size": 512,
                                                 "max_batch_tokens": 512, "threads": 2},
                pipeline=pipeline, pipeline_min_tokens=64, pipeline_group_size=5, prefill_before_destination="off")
    try:
        trace = pair.prefill.scheduler.role.worker.trace = []
        ids = list(range(1000, 1400))  # 400 tokens in one chunk, 30 layers in 6 groups
        [(dec, _)] = pair.run([ids], SamplingParams(max_tokens=2))
        assert dec[-1].error is None
        last_layer = max(t for what, i, t in trace if what == "layer" and i == 29)
        posted = sorted((t, span) for what, span, t in trace if what == "posted")
        if pipeline == "auto":
            assert [s for _, s in posted] == [(g, g + 5) for g in range(0, 30, 5)]
            assert posted[0][0] < last_layer, "the first group's KV must land while later layers compute"
        else:
            assert [s for _, s in posted] == [(0, 30)] and posted[0][0] > last_layer
    finally:
        pair.close()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_landed_requests_wait_for_room_in_the_running_batch(checkpoint, colocated, monkeypatch, overlap):
    """KV that lands while decode runs max_running_requests waits with its pages; the running
    batch never grows past the cap, and every output is exact."""
    pair = Pair(checkpoint("llama"), engine_overrides={"max_running_requests": 2, "overlap": overlap})
    sizes = []
    run = pair.decode.scheduler.runner.forward
    monkeypatch.setattr(pair.decode.scheduler.runner, "forward",
                        lambda *a: (sizes.append(len(pair.decode.scheduler.running)), run(*a))[1])
    try:
        batch = prompts(5)
        expected = [token_ids(o) for o in collect(colocated, batch, PARAMS)]
        results = pair.run(batch, PARAMS)
        assert [token_ids(dec) for dec, _ in results] == expected
        assert max(sizes) == 2
        assert pair.wait_kv_whole()
    finally:
        pair.close()
