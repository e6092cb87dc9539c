"""Prefix caching on the engine (issue 34): greedy output is the same with the cache on
and off in every scenario that shares pages (prefixes ending mid-page and on a page
boundary, inside a chunk, overlap on, preemption of a request whose pages others share,
a cancel during such a request's prefill, eviction, salts, block diffusion), the cache is
really used (hits counted), and after every scenario the KV manager's integrity check
passes (every page free, cached or held; counts equal holders)."""
import queue
import threading

import pytest

from backends.config import EngineConfig
from backends.engine import Engine
from backends.request import SamplingParams
from tests.engine_utils import assert_pool_whole, collect, small_engine, token_ids

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(max_tokens=10, min_tokens=10)
PAGE = 4   # small_engine's page size; its chunk is 16 tokens


def ids(seed: int, n: int) -> list[int]:
    return [(37 * i + 101 * seed) % 480 + 5 for i in range(n)]


def family(prefix_len: int, tails: list[int], seed: int) -> list[list[int]]:
    """Prompts that share their first prefix_len tokens, then differ."""
    prefix = ids(seed, prefix_len)
    return [prefix + ids(seed * 10 + k + 1, n) for k, n in enumerate(tails)]


def run(engine: Engine, batch: list[list[int]], params=GREEDY, salts=None):
    """All at once; (token ids, num_cached_tokens) per prompt."""
    salts = salts or [None] * len(batch)
    queues = [queue.Queue() for _ in batch]
    for prompt, salt, q in zip(batch, salts, queues):
        engine.generate(prompt, params, q.put, cache_salt=salt)
    out = []
    for q in queues:
        outs = []
        while not (outs and outs[-1].finished):
            outs.append(q.get(timeout=120))
        assert outs[-1].error is None, outs[-1].error
        assert len({o.num_cached_tokens for o in outs}) == 1   # the same in every response
        out.append((token_ids(outs), outs[-1].num_cached_tokens))
    return out


def shared_batches():
    """A first wave (one per prefix, so its pages get cached), then a concurrent wave: the
    prefix ends mid-page (22), on a page boundary (24), inside a chunk of a prompt longer
    than chunk_size (37 of 45), and an exact repeat of a first-wave prompt."""
    mid, edge, long = family(22, [3, 5, 7], 1), family(24, [2, 6], 2), family(37, [8, 11], 3)
    first = [mid[0], edge[0], long[0]]
    return first, mid[1:] + edge[1:] + long[1:] + [list(mid[0])]


@pytest.fixture(scope="module")
def references(checkpoint):
    """Greedy ids of every prompt with the cache off, per architecture."""
    done: dict = {}

    def get(arch: str):
        if arch not in done:
            eng = small_engine(checkpoint(arch), prefix_caching="off")
            try:
                first, second = shared_batches()
                done[arch] = ([t for t, _ in run(eng, first)], [t for t, _ in run(eng, second)])
                assert eng.stats()["prefix_cache_queries"] == 0 and eng.stats()["kv_pages_cached"] == 0
            finally:
                eng.stop()
        return done[arch]
    return get


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_the_same_with_the_cache_on_and_off(checkpoint, references, arch, overlap):
    first, second = shared_batches()
    eng = small_engine(checkpoint(arch), overlap=overlap)
    try:
        got_first, got_second = run(eng, first), run(eng, second)
        assert_pool_whole(eng)
        stats = eng.stats()
    finally:
        eng.stop()
    assert ([t for t, _ in got_first], [t for t, _ in got_second]) == references(arch)
    assert [c for _, c in got_first] == [0, 0, 0]
    # whole pages of the shared prefix; the repeat: every page but the one with its last token
    assert [c for _, c in got_second] == [20, 20, 24, 36, 24]
    assert stats["prefix_cache_queries"] == sum(map(len, first + second))
    assert stats["prefix_cache_hits"] == 20 + 20 + 24 + 36 + 24


def test_concurrent_requests_with_one_prefix_equal_the_cache_off(checkpoint, references):
    """Everything at once: which request finds which page depends on timing, the output not."""
    first, second = shared_batches()
    eng = small_engine(checkpoint("llama"), overlap="on")
    try:
        got = run(eng, first + second)
        assert_pool_whole(eng)
    finally:
        eng.stop()
    expected = references("llama")
    assert [t for t, _ in got] == expected[0] + expected[1]


def test_a_page_enters_the_cache_only_once_its_forward_is_done(checkpoint, monkeypatch):
    """Overlap on, a 40-token prompt in chunks of 16: while a chunk's forward is held, none
    of its pages is indexed, and a request sent then with the same prompt waits while the
    pages it shares are computed, then matches every one of them."""
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=PAGE, num_pages=64, chunk_size=16,
                              max_batch_tokens=16, threads=1, overlap="on"))
    forward, gate = eng.runner.forward, threading.Event()
    try:  # not started: the test turns the loop
        prompt = ids(7, 40)
        outs_a, outs_b = [], []
        eng.generate(prompt, GREEDY, outs_a.append)
        monkeypatch.setattr(eng.runner, "forward", lambda *a: (gate.wait(30), forward(*a))[1])
        assert eng.scheduler.step() and eng.scheduler.in_flight.number == 0   # chunk 0, held
        assert eng.runner.pool.num_indexed == 0
        eng.scheduler.check_kv()
        gate.set()
        assert eng.scheduler.step()   # chunk 1 launched, chunk 0 completed: its 4 pages indexed
        assert eng.runner.pool.num_indexed == 4
        eng.scheduler.in_flight.result.result(timeout=30)   # chunk 1's forward is done, not completed
        b = eng.generate(prompt, GREEDY, outs_b.append)
        assert eng.scheduler.step()   # chunk 2 launched, chunk 1 completed; b waits for a's pages
        assert eng.scheduler.requests[b].num_cached_tokens is None and eng.runner.pool.num_indexed == 8
        eng.scheduler.check_kv()
        while not (outs_a and outs_a[-1].finished and outs_b and outs_b[-1].finished):
            eng.scheduler.step(wait_s=0)
            eng.scheduler.check_kv()
        assert eng.scheduler.stats()["prefix_cache_hits"] == 36   # b: every full page but its last token's
        assert token_ids(outs_a) == token_ids(outs_b)
    finally:
        gate.set()
        eng.stop()
    assert_pool_whole(eng)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_requests_sent_together_compute_their_shared_prefix_once(checkpoint, overlap):
    """Four prompts with one 32-token prefix at once, with room to admit them all in one step:
    one computes the prefix, the others wait for its pages and match them (8 pages each)."""
    prompts = family(32, [4, 5, 6, 7], 4)
    settings = dict(chunk_size=64, max_batch_tokens=256)
    off = small_engine(checkpoint("llama"), prefix_caching="off", **settings)
    try:
        expected = [t for t, _ in run(off, prompts)]
    finally:
        off.stop()
    eng = small_engine(checkpoint("llama"), overlap=overlap, **settings)
    try:
        got = run(eng, prompts)
        assert_pool_whole(eng)
        hits = eng.stats()["prefix_cache_hits"]
    finally:
        eng.stop()
    assert [t for t, _ in got] == expected
    assert sorted(c for _, c in got) == [0, 32, 32, 32] and hits == 96


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_preempting_a_request_whose_pages_others_share(checkpoint, overlap):
    """A pool too small for the batch: requests sharing a 24-token prefix get preempted
    while others hold the same pages; outputs equal the cache off, with a big pool."""
    batch = family(24, [9, 13, 5, 11, 7, 3], 4)
    params = SamplingParams(max_tokens=24, min_tokens=24)
    off = small_engine(checkpoint("llama"), prefix_caching="off")
    try:
        expected = [t for t, _ in run(off, batch, params)]
    finally:
        off.stop()
    tight = small_engine(checkpoint("llama"), num_pages=34, overlap=overlap)
    try:
        run(tight, batch[:1], params)   # its pages cached: the rest share them from the start
        got = run(tight, batch, params)
        assert tight.stats()["preemptions"] > 0 and all(c == 24 for _, c in got[1:])
        assert_pool_whole(tight)
    finally:
        tight.stop()
    assert [t for t, _ in got] == expected


def test_cancel_during_the_prefill_of_a_request_that_shares_pages(checkpoint):
    """The loop turned by hand: A (a 24-token cached prefix, then 40 tokens of its own) is
    cancelled in the middle of its prefill while B holds the same prefix pages. The
    integrity check (holders: the live requests) holds at every step; B's output is the
    cache-off output; the pool is whole after."""
    prefix = ids(5, 24)
    a_prompt, b_prompt = prefix + ids(51, 40), prefix + ids(52, 6)
    params = SamplingParams(max_tokens=16, min_tokens=16)
    off = small_engine(checkpoint("llama"), prefix_caching="off")
    try:
        expected_b = run(off, [b_prompt], params)[0][0]
    finally:
        off.stop()
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=PAGE, num_pages=64, chunk_size=16,
                              max_batch_tokens=24, threads=1))
    try:
        warm: list = []
        eng.generate(prefix + ids(50, 3), params, warm.append)
        while not (warm and warm[-1].finished):
            eng.scheduler.step(wait_s=0)
        outs_a, outs_b = [], []
        a = eng.generate(a_prompt, params, outs_a.append)
        eng.generate(b_prompt, params, outs_b.append)
        eng.scheduler.step(wait_s=0)
        req_a = eng.scheduler.requests[a]
        shared = set(req_a.pages[:6])
        assert req_a.num_cached_tokens == 24 and 24 < req_a.num_computed < len(a_prompt)  # in its prefill
        assert any(shared & set(r.pages) for r in eng.scheduler.running if r.id != a)
        eng.scheduler.check_kv()
        eng.abort(a)
        while not (outs_b and outs_b[-1].finished):
            eng.scheduler.step(wait_s=0)
            eng.scheduler.check_kv()
        assert outs_a[-1].finish_reason == "abort"
        assert token_ids(outs_b) == expected_b and outs_b[-1].num_cached_tokens == 24
    finally:
        eng.stop()
    assert_pool_whole(eng)


def test_eviction_in_a_pool_that_cannot_keep_much(checkpoint):
    """Twelve requests over three prefixes, through a pool of 24 pages (a request takes
    about 11): cached pages are evicted every few requests, hits still happen, and every
    output equals the cache-off one."""
    batch = [family(16, [3 + k], 20 + k % 3)[0] for k in range(12)]
    off = small_engine(checkpoint("llama"), prefix_caching="off")
    try:
        expected = [run(off, [p])[0][0] for p in batch]
    finally:
        off.stop()
    eng = small_engine(checkpoint("llama"), num_pages=24)
    try:
        got = [run(eng, [p])[0] for p in batch]
        assert eng.runner.pool.num_evicted > len(batch)
        assert sum(c for _, c in got) > 0 and eng.stats()["prefix_cache_hits"] > 0
        assert_pool_whole(eng)
    finally:
        eng.stop()
    assert [t for t, _ in got] == expected


def test_a_cache_salt_prevents_a_match(checkpoint):
    """And a repeated prompt that ends on a page boundary is never matched whole: its last
    page is computed again, so there are logits to sample from."""
    prompt = ids(9, 32)
    eng = small_engine(checkpoint("llama"))
    try:
        first = run(eng, [prompt], salts=[b"tenant-a"])[0]
        other_salt, no_salt = run(eng, [prompt], salts=[b"tenant-b"])[0], run(eng, [prompt])[0]
        same_salt = run(eng, [prompt], salts=[b"tenant-a"])[0]
        assert_pool_whole(eng)
    finally:
        eng.stop()
    assert first[1] == other_salt[1] == no_salt[1] == 0 and same_salt[1] == 28
    assert first[0] == other_salt[0] == no_salt[0] == same_salt[0]


def test_the_cache_is_on_for_every_role_unless_off_and_the_setting_is_checked(checkpoint):
    path = checkpoint("llama")
    for role in ("colocated", "prefill", "decode"):   # decode: see tests/test_decode_prefix.py
        assert EngineConfig(model_path=path, role=role).caches_prefixes
        assert not EngineConfig(model_path=path, role=role, prefix_caching="off").caches_prefixes
    with pytest.raises(ValueError, match="prefix_caching must be auto, on or off"):
        EngineConfig(model_path=path, prefix_caching="yes")


@pytest.mark.parametrize("block_size", [4, 8])
def test_block_diffusion_reuses_whole_committed_prompt_blocks(tmp_path_factory, block_size):
    """A block-diffusion checkpoint: the cached prefix is cut to whole blocks of the prompt's
    prefill phase that are whole pages; output equals the cache off."""
    from tests.test_dllm import dllm_checkpoint, dllm_engine
    path = dllm_checkpoint(str(tmp_path_factory.mktemp(f"dllm{block_size}")), block_size=block_size)
    first, second = family(22, [3], 6), family(22, [14, 19, 2], 6)[1:]
    params = SamplingParams(max_tokens=12)
    results = {}
    for setting in ("off", "on"):
        eng = dllm_engine(path, 0.5, prefix_caching=setting)
        try:
            results[setting] = (run(eng, first, params), run(eng, second, params))
            assert_pool_whole(eng)
        finally:
            eng.stop()
    strip = lambda res: [[t for t, _ in wave] for wave in res]
    assert strip(results["on"]) == strip(results["off"])
    # the 22 shared tokens hold 5 whole pages; with blocks of 8, whole blocks: 2 of them
    cached = [c for _, c in results["on"][1]]
    assert cached == ([20] * 2 if block_size == 4 else [16] * 2), cached
