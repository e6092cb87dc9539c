"""Prefix caching with dp_size > 1 (issue 34): each rank has its own cache, and the stub
sends a request to the rank that likely holds its prefix unless that rank has clearly more
to compute than another."""
from types import SimpleNamespace

from backends.dp_group import RankPrefixes, choose_rank, page_chain
from backends.request import SamplingParams
from tests.engine_utils import collect, small_engine, token_ids
from tests.test_dp import dp_group, fresh_stats, pools_whole

P = 4


def rank(load: int, capacity: int = 100):
    r = SimpleNamespace(load=load, prefixes=RankPrefixes())
    r.prefixes.capacity = capacity
    return r


def test_the_page_chain_names_a_page_by_everything_before_it():
    a, b = page_chain(list(range(10)), None, P), page_chain([99] + list(range(1, 10)), None, P)
    assert len(a) == 2 and a[1] != b[1]                       # same second page, different first
    assert page_chain(list(range(10)), b"s", P) != a          # a salt changes every page
    assert page_chain(list(range(3)), None, P) == []          # no full page


def test_a_request_goes_where_its_prefix_is_unless_that_rank_is_clearly_busier():
    chain = page_chain(list(range(40)), None, P)             # 10 pages: worth 40 tokens
    r0, r1 = rank(30), rank(0)
    r0.prefixes.add(chain)
    assert choose_rank([r0, r1], chain, P) == (r0, 40)       # 30 - 40 < 0
    r0.load = 50
    assert choose_rank([r0, r1], chain, P) == (r1, 0)        # busier by more than the prefix is worth
    assert choose_rank([rank(5), rank(2)], chain, P)[1] == 0  # no prefix anywhere: the least loaded
    assert choose_rank([r1, rank(0)], chain, P)[0] is r1     # equals: the first


def test_the_record_of_a_rank_keeps_its_pool_size_most_recent_first():
    prefixes = RankPrefixes()
    prefixes.capacity = 3
    first, second = page_chain(list(range(12)), None, P), page_chain(list(range(100, 108)), None, P)
    prefixes.add(first)
    prefixes.add(second)
    assert prefixes.matched(second) == 2 and prefixes.matched(first) == 0  # first's head dropped first


def test_two_ranks_keep_a_conversation_on_its_rank_and_output_equals_one_engine(checkpoint):
    """A 48-token prefix served by rank 0; then, while rank 0 runs another request worth 30
    tokens (dispatch by load alone would pick idle rank 1), the next prompt with that prefix
    goes to rank 0 and finds it cached. Ids equal one engine's; the pools are whole after."""
    import queue
    path = checkpoint("llama")
    prefix = [(31 * i) % 400 + 5 for i in range(48)]
    first, second, other = prefix + [7, 8, 9], prefix + [10, 11, 12, 13], [(17 * i) % 400 + 5 for i in range(10)]
    params, long = SamplingParams(max_tokens=6, min_tokens=6), SamplingParams(max_tokens=20, min_tokens=20)
    whole = small_engine(path, prefix_caching="off")
    try:
        want = [token_ids(collect(whole, [p], params)[0]) for p in (first, second)]
    finally:
        whole.stop()
    group = dp_group(path)
    try:
        got = [collect(group, [first], params)[0]]
        busy: queue.Queue = queue.Queue()
        group.generate(other, long, busy.put)
        got.append(collect(group, [second], params)[0])
        while not busy.get(timeout=60).finished:
            pass
        stats = fresh_stats(group)
        assert pools_whole(group)
    finally:
        group.stop()
    assert [token_ids(o) for o in got] == want
    assert [o[-1].num_cached_tokens for o in got] == [0, 48]
    assert [s["prefix_cache_hits"] for s in stats] == [48, 0]
