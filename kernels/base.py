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

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where every sequence's tokens are, built once per batch on the host."""

    q_lens: list[int]           # new tokens per sequence
    kv_lens: list[int]          # tokens in cache after this step (prefix + new)
    page_table: torch.Tensor    # [B, max_pages] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: page * S + offset of each new token
    page_size: int

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
        # Plain Python lists and one tensor each: per-sequence tensor ops cost more than
        # the arithmetic at decode batch sizes on a CPU.
        width = max((len(p) for p in page_tables), default=1) or 1
        table = torch.tensor([p + [0] * (width - len(p)) for p in page_tables], dtype=torch.int32) \
            if page_tables else torch.zeros((0, width), dtype=torch.int32)
        slots = [pages[pos // page_size] * page_size + pos % page_size
                 for pages, q, kv in zip(page_tables, q_lens, kv_lens) for pos in range(kv - q, kv)]
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        return AttentionMetadata(
            q_lens=list(q_lens), kv_lens=list(kv_lens), page_table=table.to(device),
            slot_mapping=slot_mapping.to(device), page_size=page_size)


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
