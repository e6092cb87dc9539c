"""Paged KV memory: one buffer for all layers, a free list of pages.

Layout [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]: page p of
layer l is one contiguous block per K and V, so a run of consecutive pages is
one NIXL descriptor in the disaggregated hand-off.
"""
from __future__ import annotations

import torch


class PagePool:
    """Answers "here are your pages" or "no"; the scheduler decides whom to preempt."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)

    def check_integrity(self) -> None:
        if len(self._free) + len(self._used) != self.num_pages or set(self._free) & self._used:
            raise RuntimeError(f"page pool corrupt: {len(self._free)} free + {len(self._used)} used "
                               f"!= {self.num_pages}")


def allocate_kv_buffer(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim),
                       dtype=dtype, device=device)
