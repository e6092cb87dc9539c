"""Paged KV memory: one buffer for all layers, and the KV manager that owns its pages.

Layout [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]: page p of
layer l is one contiguous block per K and V, so a run of consecutive pages is
one NIXL descriptor in the disaggregated hand-off.

Every page is in exactly one of three states:

    free      no KV worth keeping
    cached    a full page whose KV is completely written, indexed by its tokens,
              held by no one; kept in LRU order and evicted when pages are needed
    held      referenced by requests (a count per page) or by a pending release

A request holds references: pages it allocated and pages of a cached prefix it
matched. A cached page is found by its key, (the key's id of the page before it, this
page's token ids); the first page's parent is the request's cache salt. Keys are
dict keys, so the token ids are compared on a hit, and a parent is named by a number
never given twice (not by a hash), so a match can never be another prompt's KV.

References go back through `release` only, at once or after a fence (a callable that
turns true once no forward or KV write touches the pages any more); `collect` lets the
fenced ones go. A page whose last reference goes becomes cached if it has a key, else
free.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

Fence = Callable[[], bool]


@dataclass
class Match:
    """A cached prefix: its pages (one reference each taken), the tokens they hold, and
    the key id of its last page (the parent of the next page's key)."""

    pages: list[int]
    num_tokens: int
    parent: object


class KVManager:
    """Answers "here are your pages" or "no"; the scheduler decides whom to preempt."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, oldest first
        self._index: dict[tuple, int] = {}     # key -> page
        self._key: dict[int, tuple] = {}       # page -> its key
        self._key_id: dict[int, int] = {}      # page -> its key's id (the parent of the next page's key)
        self._ids = itertools.count()
        self._pending: list[tuple[Fence, list[int]]] = []
        self.num_evicted = 0

    # ---- counts ----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages with no KV worth keeping."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Cached pages no one holds (evicted when needed)."""
        return len(self._lru)

    @property
    def num_indexed(self) -> int:
        """Pages that a prompt can match (cached, held or not)."""
        return len(self._index)

    @property
    def num_available(self) -> int:
        """What an allocation may take now: free pages, then cached ones."""
        return len(self._free) + len(self._lru)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- taking and giving back ----------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """`count` pages of its own for the caller (free ones first, then the least
        recently used cached ones), or None when fewer are available."""
        if count > self.num_available:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                self._forget(page)
                self.num_evicted += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def release(self, pages: list[int], fence: Fence | None = None) -> None:
        """Give back one reference to each page, now or once `fence()` is true. Pages are
        given back last first, so a prompt's tail is evicted before its head."""
        if fence is not None and not fence():
            self._pending.append((fence, list(pages)))
            return
        for page in reversed(pages):
            if self._refs[page] < 1:
                raise RuntimeError(f"page {page} released more often than it was held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._idle(page)

    def _idle(self, page: int) -> None:
        """Its last reference went: cached if its KV is indexed, else free."""
        if page in self._key:
            self._lru[page] = None
        else:
            self._free.append(page)

    def collect(self) -> None:
        """Release the pages whose fence has passed."""
        if not self._pending:
            return
        due = [entry for entry in self._pending if entry[0]()]
        for entry in due:
            self._pending.remove(entry)
            self.release(entry[1])

    @property
    def num_fenced(self) -> int:
        """Pages waiting for a fence before their reference goes back."""
        return sum(len(pages) for _, pages in self._pending)

    # ---- the prefix cache --------------------------------------------------------------
    def match(self, tokens: list[int], salt: bytes | None, max_pages: int, multiple: int = 1) -> Match:
        """The longest run of cached full pages that starts `tokens` (at most max_pages, a
        multiple of `multiple` pages), one reference taken on each."""
        parent: object = ("salt", salt)
        pages: list[int] = []
        size = self.page_size
        while len(pages) < max_pages:
            start = len(pages) * size
            page = self._index.get((parent, tuple(tokens[start:start + size])))
            if page is None:
                break
            pages.append(page)
            parent = self._key_id[page]
        if len(pages) % multiple:
            pages = pages[:len(pages) // multiple * multiple]
            parent = self._key_id[pages[-1]] if pages else ("salt", salt)
        for page in pages:
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
        return Match(pages, len(pages) * size, parent)

    def cache(self, page: int, parent: object, tokens: list[int]) -> object:
        """Index a held page whose KV is completely written; returns the id that names
        this content as the next page's parent. When the same content is cached already
        (computed twice at once), that page stays the one found and this one is not indexed."""
        key = (parent, tuple(tokens))
        found = self._index.get(key)
        if found is not None:
            return self._key_id[found]
        if page in self._key:
            raise RuntimeError(f"page {page} is cached already")
        self._index[key], self._key[page] = page, key
        self._key_id[page] = next(self._ids)
        return self._key_id[page]

    def _forget(self, page: int) -> None:
        del self._index[self._key.pop(page)]
        del self._key_id[page]

    def clear_cache(self) -> int:
        """Forget every cached page no one holds (they become free); returns how many."""
        count = len(self._lru)
        for page in self._lru:
            self._forget(page)
            self._free.append(page)
        self._lru.clear()
        return count

    # ---- integrity -------------------------------------------------------------------
    def check_integrity(self, holders: Iterable[list[int]] = ()) -> None:
        """Every page is free, cached or held, once; each page's count equals its holders:
        the page lists given (the requests') plus the pending releases."""
        counts = collections.Counter()
        for pages in itertools.chain(holders, (p for _, p in self._pending)):
            counts.update(pages)
        problems = []
        free, cached = set(self._free), set(self._lru)
        if len(free) != len(self._free):
            problems.append("a page is on the free list twice")
        if free & cached:
            problems.append(f"pages both free and cached: {sorted(free & cached)[:8]}")
        for page in range(self.num_pages):
            refs, held = self._refs[page], counts.get(page, 0)
            if refs != held:
                problems.append(f"page {page}: count {refs}, {held} holders")
            elif refs == 0 and (page in free) == (page in cached):
                problems.append(f"page {page} is held by no one yet neither free nor cached (or both)")
            elif refs > 0 and (page in free or page in cached):
                problems.append(f"page {page} is held and also {'free' if page in free else 'cached'}")
            if (page in cached or page in free) and (page in free) == (page in self._key):
                problems.append(f"page {page}: free pages have no key, cached pages have one")
        if len(self._index) != len(self._key) or len(self._key) != len(self._key_id):
            problems.append("the cache index and the page keys disagree")
        if problems:
            raise RuntimeError("KV pages corrupt: " + "; ".join(problems[:10]))


def allocate_kv_buffer(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim),
                       dtype=dtype, device=device)
