"""Decode graphs' page table, kept on the device and written only where it changes.

A CUDA graph's page table is as wide as the longest context. Built on the host for every
step, it cost a row per sequence in Python and its bytes in the step's copy (bucket x width
int32: 2 MB at 64 sequences of a 128K context). Here every request that a graph step runs
holds a row of one table on the device; a step sends only its requests' row numbers and
the entries that changed since they were last written (a new page every page_size tokens
of a decode), and the graph gathers its rows from the table (on the device, microseconds).

A request's pages change in two ways only (backends.request.Request.pages): the list grows
in place (the scheduler's _grow), or the request is given a new list (admission with a
prefix match, a hand-off's pages, preemption). A row remembers the list it was written
from and how much of it: a grown list writes its new entries, another list the whole row.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kernels.host_pack import scatter


@dataclass
class _Row:
    req: object          # held, so that id(req) is not reused while the row is its
    index: int
    pages: list[int]     # the list object the row was written from
    written: int         # its first `written` entries are on the device


class DevicePageTable:
    """`rows` rows of `width` pages on `device`, and one more of zeros for padding decodes."""

    def __init__(self, rows: int, width: int, device: torch.device | str):
        self.width, self.padding = width, rows
        self.table = torch.zeros(rows + 1, width, dtype=torch.int32, device=device)
        self._rows: OrderedDict[int, _Row] = OrderedDict()   # id(request) -> its row, least recent first
        self._free = list(range(rows))

    def assign(self, reqs: list, pad: int = 0) -> tuple[list[int], list[int], list[int]]:
        """Each request's row (then `pad` padding rows), and the writes that bring their rows
        up to date: flat indices into the table and the pages to write there. Rows of
        requests not in this batch are taken back, least recently used first, as new ones
        need them; the writes (`write`) must follow, on the stream, every step launched before."""
        if len(reqs) > self.padding:
            raise ValueError(f"{len(reqs)} sequences for a page table of {self.padding} rows")
        for req in reqs:   # first mark the batch's own rows used, so that none of them is taken back
            if id(req) in self._rows:
                self._rows.move_to_end(id(req))
        indices, at, pages = [], [], []
        for req in reqs:
            row = self._rows.get(id(req)) or self._take(req)
            first = row.written if row.pages is req.pages else 0
            new = req.pages[first:self.width]
            if new:
                at.extend(range(row.index * self.width + first, row.index * self.width + first + len(new)))
                pages.extend(new)
            row.pages, row.written = req.pages, first + len(new)
            indices.append(row.index)
        return indices + [self.padding] * pad, at, pages

    def reset(self) -> None:
        """Forget every row (a step's writes may not have reached the device): each request's
        next step writes its whole row."""
        self._rows.clear()
        self._free = list(range(self.padding))

    def _take(self, req) -> _Row:
        if self._free:
            index = self._free.pop()
        else:
            _, oldest = self._rows.popitem(last=False)
            index = oldest.index
        row = self._rows[id(req)] = _Row(req, index, req.pages, 0)
        return row

    def write(self, at: list[int], pages: list[int], packed: bool) -> None:
        """The writes `assign` gave, in one copy and one scatter on the current stream."""
        if at:
            scatter(self.table.view(-1), at, pages, packed)

    def gather(self, indices: torch.Tensor) -> torch.Tensor:
        """[len(indices), width] int32: the rows of a step's sequences (on the device)."""
        return self.table.index_select(0, indices)
