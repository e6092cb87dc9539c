"""Prefix-aware hand-off (in this process, real NIXL): decode matches the prompt
in its own cache, prefill sends only the pages decode lacks (none on a full hit:
just the metadata), output stays the colocated engine's, and both pools stay
whole, also when a request with matched pages is aborted while KV is in flight."""
import queue
import random

import pytest

from backends.disagg import protocol
from backends.disagg.local import Pair, drain
from backends.request import SamplingParams
from tests.engine_utils import collect, token_ids
from tests.test_disagg import wait_for, writes_in_flight
from tests.test_model_parity import prompts

PARAMS = SamplingParams(max_tokens=20, min_tokens=20)
PAGE = 4                                     # Pair's page size
META_BYTES = protocol.META_WIDTH * 8         # the metadata row that follows every request's KV


def page_bytes(pair: Pair) -> int:
    return pair.decode.scheduler.role.page_bytes


def run(pair: Pair, ids: list[int], salt: bytes | None = None) -> tuple[list[int], int, int]:
    """One request: (its output, KV bytes prefill sent for it, KV bytes decode reused)."""
    sent, reused = pair.prefill.stats()["kv_bytes_sent"], pair.decode.stats()["kv_bytes_reused"]
    room, d, p = random.getrandbits(62) + 1, queue.Queue(), queue.Queue()
    pair.decode.generate(ids, PARAMS, d.put, request_id=f"room-{room}", room=room, cache_salt=salt)
    pair.prefill.generate(ids, PARAMS, p.put, request_id=f"room-{room}", room=room, cache_salt=salt)
    dec, pre = drain(d, 60), drain(p, 60)
    assert dec[-1].error is None and pre[-1].error is None
    return (token_ids(dec), pair.prefill.stats()["kv_bytes_sent"] - sent,
            pair.decode.stats()["kv_bytes_reused"] - reused)


def conversation(engine_answer, turns: int = 3) -> list[list[int]]:
    """Each turn's prompt: the last prompt, its answer, and new text."""
    new_text = prompts(6, seed=7)
    prompt, asked = list(prompts(4)[3]), []
    for turn in range(turns):
        asked.append(prompt)
        prompt = prompt + engine_answer(prompt) + new_text[turn][:9]
    return asked


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_later_turns_send_only_the_pages_decode_lacks(checkpoint, colocated, overlap):
    pair = Pair(checkpoint("llama"), engine_overrides={"overlap": overlap})
    try:
        size, results = page_bytes(pair), []

        def answer(ids):
            results.append(run(pair, ids))
            return results[-1][0]
        asked = conversation(answer)
        expected = [token_ids(collect(colocated, [ids], PARAMS)[0]) for ids in asked]
        assert [out for out, _, _ in results] == expected
        first_sent, first_reused = results[0][1:]
        assert first_reused == 0 and first_sent == -(-len(asked[0]) // PAGE) * size + META_BYTES
        for before, ids, (_, sent, reused) in zip(asked, asked[1:], results[1:]):
            # decode holds the last prompt and the answer's KV (all but the last token's) in full pages
            assert reused >= (len(before) + PARAMS.max_tokens - 1) // PAGE * size
            assert sent + reused == -(-len(ids) // PAGE) * size + META_BYTES, "a page sent and reused, or neither"
            assert sent - META_BYTES <= 0.2 * reused, "a later turn must send at least 80 % fewer KV bytes"
        assert pair.wait_kv_whole()
    finally:
        pair.close()


@pytest.fixture
def pair(checkpoint):
    p = Pair(checkpoint("llama"))
    yield p
    p.close()


def test_a_repeated_prompt_sends_only_the_metadata(pair, colocated):
    aligned = prompts(4)[3][:48]   # 12 whole pages: decode holds every one
    want = token_ids(collect(colocated, [aligned], PARAMS)[0])
    out, sent, reused = run(pair, aligned)
    assert out == want and reused == 0 and sent == 12 * page_bytes(pair) + META_BYTES
    out, sent, reused = run(pair, aligned)
    assert out == want and sent == META_BYTES and reused == 12 * page_bytes(pair)
    # a prompt that ends inside a page: that page is sent (decode holds its full pages only)
    ragged = aligned + [7, 8]
    out, sent, reused = run(pair, ragged)
    assert out == token_ids(collect(colocated, [ragged], PARAMS)[0])
    assert sent == page_bytes(pair) + META_BYTES and reused == 12 * page_bytes(pair)
    # another cache salt matches nothing
    out, sent, reused = run(pair, aligned, salt=b"other tenant")
    assert out == want and reused == 0 and sent == 12 * page_bytes(pair) + META_BYTES
    assert pair.wait_kv_whole()


@pytest.mark.parametrize("cached_on", ["prefill", "decode"])
def test_what_decode_holds_and_what_prefill_computes_are_independent(checkpoint, colocated, cached_on):
    """Only prefill caches: it computes one page of the repeated prompt, yet sends all of them
    (decode holds none). Only decode caches: prefill computes the whole prompt, and sends
    only the pages decode lacks."""
    if cached_on == "prefill":
        pair = Pair(checkpoint("llama"), engine_overrides={"prefix_caching": "off"},
                    prefill_engine={"prefix_caching": "auto"})
    else:
        pair = Pair(checkpoint("llama"), prefill_engine={"prefix_caching": "off"})
    try:
        ids = prompts(4)[3]   # 50 tokens: 13 pages, 12 of them full
        want = token_ids(collect(colocated, [ids], PARAMS)[0])
        full = 13 * page_bytes(pair) + META_BYTES
        assert run(pair, ids) == (want, full, 0)
        hits = pair.prefill.stats()["prefix_cache_hits"]
        out, sent, reused = run(pair, ids)
        assert out == want
        if cached_on == "prefill":
            assert pair.prefill.stats()["prefix_cache_hits"] - hits == 48 and (sent, reused) == (full, 0)
        else:
            assert pair.prefill.stats()["prefix_cache_hits"] == 0
            assert (sent, reused) == (page_bytes(pair) + META_BYTES, 12 * page_bytes(pair))
        assert pair.wait_kv_whole()
    finally:
        pair.close()


def test_an_abort_in_flight_quarantines_only_the_pages_prefill_writes(pair, colocated, monkeypatch):
    """The turn's matched pages go back at once (prefill never writes them; still cached for the
    next prompt); the pages being written wait in quarantine until prefill says released."""
    first = prompts(4)[3]
    answer, _, _ = run(pair, first)
    turn = first + answer + prompts(2, seed=7)[1][:9]
    gate = writes_in_flight(pair, monkeypatch)
    try:
        room, d, p = random.getrandbits(62) + 1, queue.Queue(), queue.Queue()
        pair.decode.generate(turn, PARAMS, d.put, request_id=f"room-{room}", room=room)
        pair.prefill.generate(turn, PARAMS, p.put, request_id=f"room-{room}", room=room)
        assert wait_for(lambda: pair.prefill.stats()["shipping"] == 1)   # every KV write posted
        role = pair.decode.scheduler.role
        [req] = role.transfer.values()
        held, written = req.cached_pages, len(req.pages) - req.cached_pages
        assert held >= (len(first) + len(answer) - 1) // PAGE and written >= 1
        pair.decode.abort(f"room-{room}")
        assert drain(d, 10)[-1].finish_reason == "abort"
        assert wait_for(lambda: pair.decode.stats()["quarantined_pages"] == written)
        pair.decode.scheduler.check_kv()   # the quarantined pages are held by their pending release
        assert not pair.kv_whole()
    finally:
        gate.set()
    drain(p, 10)
    assert pair.wait_kv_whole()
    out, sent, reused = run(pair, turn)
    assert out == token_ids(collect(colocated, [turn], PARAMS)[0]) and reused >= held * page_bytes(pair)
    assert pair.wait_kv_whole()


# ---- through tritonserver: `router` over `prefill` and `decode`, the metric on its port ----
@pytest.mark.server
def test_a_conversation_through_the_router_reuses_decode_kv(default_model, tmp_path):
    from client.stream import stream_generate
    from client.triton_server import TritonServer, free_port
    from tests.test_router import LONG, disagg_parameters
    server = TritonServer(str(tmp_path / "repo"), models=["llm", "prefill", "decode", "router"],
                          parameters=disagg_parameters(free_port()))
    with server:
        counters = lambda: (server.metrics().get('tandem_kv_bytes_sent{model="prefill"}', 0),
                            server.metrics().get('tandem_kv_bytes_reused{model="decode"}', 0))

        def turn(prompt: str) -> tuple[str, float, float]:
            """The router's answer (the same as llm's), and the KV bytes sent and reused for it."""
            before = counters()
            routed = stream_generate(server.grpc_url, "router", prompt, max_tokens=24)
            local = stream_generate(server.grpc_url, "llm", prompt, max_tokens=24)
            assert routed.error is None and routed.token_ids == local.token_ids, prompt[-60:]
            assert wait_for(lambda: counters()[0] > before[0])   # counters are published every 0.1 s
            assert wait_for(lambda: all(server.wait_kv_full(m, 1) for m in ("prefill", "decode")))
            after = counters()
            return routed.text, after[0] - before[0] - META_BYTES, after[1] - before[1]

        prompt = LONG
        answer, first_sent, first_reused = turn(prompt)
        assert first_reused == 0 and first_sent > 0
        for follow_up in (" What colour is item 7?", " And item 8?"):
            prompt = prompt + answer + follow_up
            answer, sent, reused = turn(prompt)
            assert reused > 0 and sent <= 0.2 * (sent + reused), "a later turn must send 80 % fewer KV bytes"
        _, sent, reused = turn(prompt)   # the same prompt again: at most its last, partial page goes
        assert sent <= (sent + reused) / 20


def test_a_preempted_request_gives_its_matched_pages_back(checkpoint, colocated):
    """40 decode pages, no decode reserve: two turns that share a cached 12-page prefix and
    decode 60 tokens each outgrow the pool, and one is preempted (it recomputes here). Output
    is the colocated engine's, and every reference comes back."""
    pair = Pair(checkpoint("llama"), engine_overrides={"num_pages": 40}, prefill_engine={"num_pages": 256},
                decode_reserve_tokens=0)
    long = SamplingParams(max_tokens=60, min_tokens=60)
    try:
        first = prompts(4)[3][:48]
        run(pair, first)
        turns = [first + tail[:4] for tail in prompts(6, seed=7)[1:3]]
        results = pair.run(turns, long)
        expected = [token_ids(o) for o in collect(colocated, turns, long)]
        assert [token_ids(dec) for dec, _ in results] == expected
        assert pair.decode.stats()["preemptions"] > 0 and pair.decode.stats()["kv_bytes_reused"] > 0
        assert pair.wait_kv_whole()
    finally:
        pair.close()
