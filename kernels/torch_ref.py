"""Plain-torch paged attention: the reference every kernel is checked against,
and the CPU serving path.

Decodes (q_len 1) of a batch are gathered into one padded SDPA call; each
sequence with several new tokens (a prefill chunk over its cached prefix) gets
one SDPA call with a causal mask shifted by its prefix length. No per-token
Python work: the gather indices and masks are built once per batch in `plan`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.base import AttentionBackend, AttentionMetadata


def kv_slots(page_table_row: torch.Tensor, kv_len: int, page_size: int) -> torch.Tensor:
    """Flat slot of every cached position 0..kv_len-1 of one sequence."""
    pos = torch.arange(kv_len, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


@dataclass
class _Decodes:
    rows: torch.Tensor    # [Bd] token rows of the decodes in q
    slots: torch.Tensor   # [Bd, L] cached slots, padded with slot 0
    mask: torch.Tensor    # [Bd, 1, 1, L] True where a slot is real


@dataclass
class _Extend:
    start: int            # first token row in q
    slots: torch.Tensor   # [kv_len] cached slots
    mask: torch.Tensor    # [q_len, kv_len] causal, shifted by the prefix


@dataclass
class TorchPlan:
    meta: AttentionMetadata
    decodes: _Decodes | None
    extends: list[_Extend]


class TorchAttention(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> TorchPlan:
        table, size = meta.page_table, meta.page_size
        dec_rows, dec_slots, extends = [], [], []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            slots = kv_slots(table[i], kv_len, size)
            if q_len == 1:
                dec_rows.append(start)
                dec_slots.append(slots)
            elif q_len > 1:
                q_pos = torch.arange(kv_len - q_len, kv_len, device=table.device)
                k_pos = torch.arange(kv_len, device=table.device)
                extends.append(_Extend(start, slots, k_pos[None, :] <= q_pos[:, None]))
            start += q_len
        return TorchPlan(meta, self._plan_decodes(dec_rows, dec_slots, table.device), extends)

    @staticmethod
    def _plan_decodes(rows, slots, device) -> _Decodes | None:
        if not rows:
            return None
        width = max(len(s) for s in slots)
        padded = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        mask = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
        for i, s in enumerate(slots):
            padded[i, :len(s)] = s
            mask[i, :len(s)] = True
        return _Decodes(torch.tensor(rows, device=device), padded, mask[:, None, None, :])

    def store_kv(self, k, v, k_cache, v_cache, plan: TorchPlan) -> None:
        slots = plan.meta.slot_mapping
        if slots.numel():
            k_cache.view(-1, *k_cache.shape[2:])[slots] = k
            v_cache.view(-1, *v_cache.shape[2:])[slots] = v

    def attend(self, q, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [P*S, Hkv, D]
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        gqa = q.shape[1] != k_cache.shape[2]
        if plan.decodes is not None:
            d = plan.decodes
            qd = q[d.rows].unsqueeze(2)                       # [Bd, Hq, 1, D]
            kd = k_flat[d.slots].transpose(1, 2)              # [Bd, Hkv, L, D]
            vd = v_flat[d.slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale, enable_gqa=gqa)
            out[d.rows] = o.squeeze(2)
        for e in plan.extends:
            n = e.mask.shape[0]
            qe = q[e.start:e.start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
            ke = k_flat[e.slots].transpose(0, 1)[None]         # [1, Hkv, L, D]
            ve = v_flat[e.slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=e.mask, scale=scale, enable_gqa=gqa)
            out[e.start:e.start + n] = o[0].transpose(0, 1)
        return out
