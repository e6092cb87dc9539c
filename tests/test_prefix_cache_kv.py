"""The KV manager alone (backends.kv_cache): references, the page index with its token
comparison, LRU eviction, fenced releases and the integrity check. No model."""
import threading

import pytest

from backends.kv_cache import KVManager

P = 4


def tokens(*pages):
    """Token ids of whole pages, each page named by one number."""
    return [t for n in pages for t in [n] * P]


def cache_all(kv: KVManager, pages: list[int], ids: list[int], salt=None):
    parent = ("salt", salt)
    for i, page in enumerate(pages):
        parent = kv.cache(page, parent, ids[i * P:(i + 1) * P])


def computed(kv: KVManager, ids: list[int], salt=None) -> list[int]:
    """A request that computed `ids` (whole pages) and finished: its pages end up cached."""
    pages = kv.allocate(len(ids) // P)
    cache_all(kv, pages, ids, salt)
    kv.release(pages)
    return pages


def test_allocate_release_and_the_counts():
    kv = KVManager(8, P)
    pages = kv.allocate(3)
    assert pages == [0, 1, 2] and kv.num_free == 5 and kv.num_cached == 0
    kv.check_integrity([pages])
    assert kv.allocate(6) is None and kv.num_free == 5  # "no" takes nothing
    kv.release(pages)
    assert kv.num_free == 8
    kv.check_integrity()
    with pytest.raises(RuntimeError, match="released more often"):
        kv.release([1])


def test_a_released_written_page_is_cached_and_matched_with_a_reference():
    kv = KVManager(8, P)
    pages = computed(kv, tokens(1, 2, 3))
    assert kv.num_cached == 3 and kv.num_free == 5 and kv.num_available == 8
    kv.check_integrity()
    found = kv.match(tokens(1, 2, 3, 4), None, max_pages=4)
    assert found.pages == pages and found.num_tokens == 3 * P
    assert kv.num_cached == 0  # held again: no longer evictable
    kv.check_integrity([found.pages])
    other = kv.match(tokens(1, 2), None, max_pages=2)   # a second holder of the first two
    kv.check_integrity([found.pages, other.pages])
    kv.release(found.pages)
    assert kv.num_cached == 1   # the first two are still held by `other`
    kv.release(other.pages)
    kv.check_integrity()
    assert kv.num_cached == 3


def test_the_match_stops_at_max_pages_the_first_difference_and_a_multiple():
    kv = KVManager(8, P)
    computed(kv, tokens(1, 2, 3))
    for ids, limit, want in [(tokens(1, 2, 3), 2, 2), (tokens(1, 9, 3), 3, 1), (tokens(9, 2, 3), 3, 0)]:
        found = kv.match(ids, None, max_pages=limit)
        assert found.num_tokens == want * P
        kv.release(found.pages)
    found = kv.match(tokens(1, 2, 3), None, max_pages=3, multiple=2)
    assert found.num_tokens == 2 * P
    whole = kv.match(tokens(1, 2, 3), None, max_pages=3)
    follow = kv.allocate(1)  # the next page's key hangs off the second page: it is the third's
    assert kv.cache(follow[0], found.parent, tokens(3)) == whole.parent
    kv.check_integrity([found.pages, whole.pages, follow])


def test_tokens_are_compared_on_a_hit():
    """(-1,) and (-2,) hash alike in CPython: the index still tells them apart."""
    assert hash((("salt", None), (-1,) * P)) == hash((("salt", None), (-2,) * P))
    kv = KVManager(4, P)
    computed(kv, [-1] * P)
    assert kv.match([-2] * P, None, max_pages=1).num_tokens == 0
    assert kv.match([-1] * P, None, max_pages=1).num_tokens == P


def test_a_page_matches_only_after_its_own_parent():
    """The same page content after a different first page is another key; and once the
    first page is evicted, the second cannot be reached, even if a new page caches the same
    first tokens later (a parent is named by a number never given twice)."""
    kv = KVManager(3, P)
    computed(kv, tokens(1, 2))
    assert kv.match(tokens(7, 2), None, max_pages=2).num_tokens == 0
    taken = kv.allocate(2)   # 1 free page, then the oldest cached page: the head (tail went first)
    assert kv.num_cached == 1
    kv.release(taken)
    computed(kv, tokens(1))
    assert kv.match(tokens(1, 2), None, max_pages=2).num_tokens == P


def test_salts_never_match_each_other():
    kv = KVManager(8, P)
    computed(kv, tokens(1, 2), salt=b"tenant-a")
    assert kv.match(tokens(1, 2), None, 2).num_tokens == 0
    assert kv.match(tokens(1, 2), b"tenant-b", 2).num_tokens == 0
    found = kv.match(tokens(1, 2), b"tenant-a", 2)
    assert found.num_tokens == 2 * P
    kv.release(found.pages)
    kv.check_integrity()


def test_eviction_is_least_recently_used_and_never_takes_a_held_page():
    kv = KVManager(4, P)
    old = computed(kv, tokens(1))
    new = computed(kv, tokens(2))
    held = kv.match(tokens(1), None, 1).pages   # the oldest, but held
    fresh = kv.allocate(2)                         # the 2 free pages
    assert set(fresh).isdisjoint(old + new)
    more = kv.allocate(1)
    assert more == new and kv.allocate(1) is None  # the held page is never taken
    kv.check_integrity([held, fresh, more])
    assert kv.match(tokens(2), None, 1).num_tokens == 0  # evicted: its key is gone


def test_a_prompt_tail_is_evicted_before_its_head():
    kv = KVManager(3, P)
    head, middle, tail = computed(kv, tokens(1, 2, 3))
    assert kv.allocate(1) == [tail]
    assert kv.match(tokens(1, 2, 3), None, 3).num_tokens == 2 * P


def test_the_same_content_computed_twice_is_indexed_once():
    kv = KVManager(4, P)
    a, b = kv.allocate(1), kv.allocate(1)
    first = kv.cache(a[0], ("salt", None), tokens(5))
    assert kv.cache(b[0], ("salt", None), tokens(5)) == first   # the chain goes on from the first
    kv.release(a)
    kv.release(b)
    assert kv.num_cached == 1 and kv.num_free == 3
    kv.check_integrity()


def test_a_fenced_release_waits_and_counts_as_a_holder():
    kv = KVManager(4, P)
    pages = kv.allocate(2)
    gate = threading.Event()
    kv.release(pages, gate.is_set)
    assert kv.num_available == 2 and kv.num_fenced == 2
    kv.check_integrity()   # the pending release is the pages' holder
    kv.collect()
    assert kv.num_available == 2
    gate.set()
    kv.collect()
    assert kv.num_available == 4 and kv.num_fenced == 0
    kv.check_integrity()
    kv.release(kv.allocate(1), lambda: True)   # a fence already passed: at once
    assert kv.num_free == 4


def test_the_integrity_check_finds_what_is_wrong():
    kv = KVManager(4, P)
    pages = kv.allocate(2)
    with pytest.raises(RuntimeError, match="count 1, 0 holders"):
        kv.check_integrity([pages[:1]])       # a holder the caller lost track of
    with pytest.raises(RuntimeError, match="count 1, 2 holders"):
        kv.check_integrity([pages, pages[:1]])  # one reference, two holders
    kv._free.append(pages[0])                  # corrupt: held and free
    with pytest.raises(RuntimeError, match="held and also free"):
        kv.check_integrity([pages])


def test_clear_cache_frees_only_what_no_one_holds():
    kv = KVManager(4, P)
    computed(kv, tokens(1, 2))
    held = kv.match(tokens(1), None, 1).pages
    assert kv.clear_cache() == 1 and kv.num_free == 3
    kv.check_integrity([held])
