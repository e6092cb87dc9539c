"""Prefill and decode engines joined by real NIXL transports (in this process):
exact output, layer-pipelined writes, and every failure path with both KV
pools whole afterwards."""
import queue
import threading
import time

import pytest

from backends.config import EngineConfig
from backends.disagg.config import DisaggConfig
from backends.disagg.decode import DecodeRole
from backends.disagg.pipeline import layer_group_size, layer_groups
from backends.engine import Engine
from backends.request import SamplingParams
from backends.disagg.local import Pair, drain
from tests.engine_utils import collect, small_engine, token_ids
from tests.server import free_port
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
    (4, 3072, {}, 1),             # never below one layer
    (80, 9216, {"pipeline": "off"}, 0),
])
def test_layer_group_size(layers, tokens, knobs, expected):
    cfg = DisaggConfig(pipeline_min_tokens=3072, **knobs)
    assert layer_group_size(layers, tokens, cfg) == expected


def test_layer_groups_cover_every_layer_once():
    assert layer_groups(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert layer_groups(7, 0) == [range(0, 7)]


# ---- exact output ------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(checkpoint):
    # 1 layer per group above 8 tokens: every chunk of the long prompts is pipelined
    p = Pair(checkpoint("llama"), pipeline_min_tokens=8, pipeline_group_size=1, transfer_timeout_s=5)
    yield p
    p.close()


@pytest.fixture(scope="module")
def colocated(checkpoint):
    engine = small_engine(checkpoint("llama"))
    yield engine
    engine.stop()


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


def test_cancel_during_prealloc(checkpoint):
    # the decode pool cannot hold this request's reserve, so it waits in prealloc
    pair = Pair(checkpoint("llama"), engine_overrides={"num_pages": 12})
    try:
        room, d, p = pair.submit(prompts(4)[3], SamplingParams(max_tokens=200))
        time.sleep(0.5)
        assert pair.decode.stats()["prealloc"] == 1
        pair.decode.abort(f"room-{room}")
        pair.prefill.abort(f"room-{room}")
        assert drain(d, 10)[-1].finish_reason == "abort" and drain(p, 10)[-1].finish_reason == "abort"
        assert pair.wait_kv_whole()
    finally:
        pair.close()


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
                    role=DecodeRole(cfg)).start()
    try:
        q = queue.Queue()
        engine.generate(prompts(1)[0], PARAMS, q.put, request_id="room-1", room=1)
        out = drain(q, 15)
        assert "unreachable" in out[-1].error
        assert engine.stats()["kv_pages_free"] == engine.stats()["kv_pages_total"]
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


# ---- layer pipelining is real --------------------------------------------------------
@pytest.mark.parametrize("pipeline", ["auto", "off"])
def test_early_layer_groups_land_before_the_last_layer(default_model, pipeline):
    pair = Pair(default_model, engine_overrides={"page_size": 16, "num_pages": 128, "chunk_size": 512,
                                                 "max_batch_tokens": 512, "threads": 2},
                pipeline=pipeline, pipeline_min_tokens=64, pipeline_group_size=5)
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
