"""The attention-backend interface: plan once per batch, then run per layer.

Shapes (T = new tokens in the batch, B = sequences, P = pages in the pool,
S = page size, Hq / Hkv = query / KV heads, D = head dim):

    q:        [T, Hq, D]    new tokens of all sequences, sequence after sequence
    k, v:     [T, Hkv, D]
    k_cache:  [P, S, Hkv, D]  one layer's key pages (v_cache alike)

A sequence's new tokens sit at its last positions: token j of sequence i has
position kv_lens[i] - q_lens[i] + j and attends causally to every cached or new
position <= its own. A sequence with q_len 1 is a decode; an empty batch (B = 0)
is valid and does nothing.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from kernels.host_pack import IntPack


@dataclass(frozen=True)
class AttentionMetadata:
    """Where every sequence's tokens are, built once per batch on the host."""

    q_lens: list[int]           # new tokens per sequence
    kv_lens: list[int]          # tokens in cache after this step (prefix + new)
    page_table: torch.Tensor    # [B, max_pages] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: page * S + offset of each new token; -1: a padding token
    page_size: int
    # The batch's layout on the device, for kernels that read it there (the Triton backend);
    # made in the step's one copy with the rest (kernels.host_pack).
    seq_lens: torch.Tensor      # [B] int32: kv_lens
    cu_q: torch.Tensor          # [B + 1] int32: first token row of every sequence, then T
    decode_seqs: torch.Tensor   # [Bd] int32: the sequences with q_len 1 ...
    decode_rows: torch.Tensor   # [Bd] int32: ... and their token rows
    extend_seqs: torch.Tensor   # [Be] int32: the sequences with q_len > 1

    def __post_init__(self):
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError(f"q_lens has {len(self.q_lens)} entries, kv_lens {len(self.kv_lens)}")
        if self.page_table.dim() != 2 or self.page_table.shape[0] != len(self.q_lens):
            raise ValueError(f"expected page_table [B={len(self.q_lens)}, pages], got {tuple(self.page_table.shape)}")
        if self.slot_mapping.shape != (self.num_tokens,):
            raise ValueError(f"expected slot_mapping [{self.num_tokens}], got {tuple(self.slot_mapping.shape)}")
        if any(q > kv for q, kv in zip(self.q_lens, self.kv_lens)):
            raise ValueError("a sequence has more new tokens than cached tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @staticmethod
    def build(q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]],
              page_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata from per-sequence page lists (the scheduler's view)."""
        pack = IntPack(device)
        AttentionMetadata.add_to(pack, q_lens, kv_lens, page_tables, page_size)
        return AttentionMetadata.from_pack(q_lens, kv_lens, page_size, pack.send())

    @staticmethod
    def add_to(pack: IntPack, q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]],
               page_size: int, width: int = 0, pad: int = 0, table_rows: list[int] | None = None) -> None:
        """The batch's integer arrays into `pack`, to travel in one copy with the step's others.
        width: the page table's (0 = the longest sequence's pages; pages past a sequence's
        own are never read); pad: padding sequences
        after the real ones (a CUDA graph's bucket), each one decode token with one cached
        position, no page (row of page 0) and slot -1 (no KV write). table_rows: each
        sequence's row of a page table already on the device (a decode graph's,
        backends.page_table), sent instead of the table."""
        # Plain Python lists: per-sequence tensor ops cost more than the arithmetic at decode
        # batch sizes on a CPU. The page table is the exception (page_table_array).
        if table_rows is None:
            width = width or max((len(p) for p in page_tables), default=1) or 1
            pack.add("page_table", page_table_array(page_tables, width, pad), torch.int32, (len(q_lens) + pad, width))
        else:
            pack.add("table_rows", table_rows, torch.long)
        slots = [pages[pos // page_size] * page_size + pos % page_size
                 for pages, q, kv in zip(page_tables, q_lens, kv_lens) for pos in range(kv - q, kv)] + [-1] * pad
        q_lens, kv_lens = list(q_lens) + [1] * pad, list(kv_lens) + [1] * pad
        cu_q = [0]
        for q in q_lens:
            cu_q.append(cu_q[-1] + q)
        decodes = [i for i, q in enumerate(q_lens) if q == 1]
        pack.add("slot_mapping", slots, torch.int64)
        pack.add("seq_lens", kv_lens, torch.int32)
        pack.add("cu_q", cu_q, torch.int32)
        pack.add("decode_seqs", decodes, torch.int32)
        pack.add("decode_rows", [cu_q[i] for i in decodes], torch.int32)
        pack.add("extend_seqs", [i for i, q in enumerate(q_lens) if q > 1], torch.int32)

    @staticmethod
    def from_pack(q_lens: list[int], kv_lens: list[int], page_size: int,
                  tensors: dict[str, torch.Tensor]) -> "AttentionMetadata":
        """The metadata over the arrays add_to packed (`IntPack.send`'s or `views`' result)."""
        return AttentionMetadata(q_lens=list(q_lens), kv_lens=list(kv_lens), page_size=page_size,
                                 **{name: tensors[name] for name in DEVICE_ARRAYS})


def page_table_array(page_tables: list[list[int]], width: int, pad: int) -> torch.Tensor:
    """The table [(B + pad) * width] int32, each row a sequence's pages then zeros, written a
    row at a time into zeros (entry by entry in Python cost 40x more at 64 x 8192 pages:
    docs/gpu.md). Decode graphs keep theirs on the device instead (backends.page_table)."""
    table = np.zeros((len(page_tables) + pad, width), dtype=np.int32)
    for row, pages in enumerate(page_tables):
        table[row, :len(pages)] = pages[:width]
    return torch.from_numpy(table.reshape(-1))


DEVICE_ARRAYS = ("page_table", "slot_mapping", "seq_lens", "cu_q", "decode_seqs", "decode_rows", "extend_seqs")


class AttentionBackend(ABC):
    """One per engine. `plan` runs once per batch; `forward` once per layer."""

    name: str = "base"

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> object:
        """Precompute whatever every layer of this batch shares (indices, masks, splits)."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, plan: object) -> None:
        """Write the new tokens' K/V [T, Hkv, D] into their slots of one layer's pages."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               plan: object, scale: float) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the pages (new K/V already stored): [T, Hq, D]."""

    def forward(self, q, k, v, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, plan)
        return self.attend(q, k_cache, v_cache, plan, scale)
