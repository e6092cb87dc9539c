"""Plain-torch paged attention: the reference every kernel is checked against,
and the CPU serving path.

Decodes (q_len 1) of a batch are gathered into one padded SDPA call over whole
pages; each sequence with several new tokens (a prefill chunk) gets one SDPA
call: causal over its new K/V when it has no cached prefix, else over its
gathered slots with a causal mask shifted by the prefix length. No per-token
Python work: the gather indices and masks are built once per batch in `plan`,
with a handful of tensor ops whatever the batch size (on a 2-core CPU every op
per sequence or per layer counts).
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


def causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device, block_size: int = 0) -> torch.Tensor:
    """[q_len, kv_len] additive mask: new token j (position p = kv_len - q_len + j) sees the
    positions <= p; with a block size B, the positions of its own block and those before
    (block-causal: i sees j iff j // B <= i // B, as a block-diffusion model attends)."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    k_pos = torch.arange(kv_len, device=device)
    if block_size:
        q_pos, k_pos = q_pos // block_size, k_pos // block_size
    blocked = k_pos[None, :] > q_pos[:, None]
    return torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill_(blocked, float("-inf"))


@dataclass
class _Decodes:
    rows: torch.Tensor | slice  # token rows of the decodes in q (a slice when they are contiguous)
    pages: torch.Tensor         # [Bd * Pm] page ids, row after row, padded with page 0
    lens: torch.Tensor          # [Bd] cached tokens per decode
    num_pages: int              # Pm: pages of the longest decode

    def mask(self, page_size: int, dtype: torch.dtype) -> torch.Tensor:
        """[Bd, 1, 1, Pm*S] additive: 0 on cached positions, -inf on the padding after them."""
        pos = torch.arange(self.num_pages * page_size, device=self.lens.device)
        blocked = pos[None, :] >= self.lens[:, None]
        mask = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device)
        return mask.masked_fill_(blocked, float("-inf"))[:, None, None, :]


@dataclass
class _Extend:
    start: int                 # first token row in q
    length: int                # new tokens (q_len)
    slots: torch.Tensor | None  # [kv_len] cached slots; None when there is no cached prefix
    kv_len: int


@dataclass
class TorchPlan:
    meta: AttentionMetadata
    decodes: _Decodes | None
    extends: list[_Extend]
    masks: dict  # dtype -> decode mask / (extend index, dtype) -> extend mask, made on first use
    block_size: int = 0  # block-causal attention (block-diffusion models), else 0: causal


class TorchAttention(AttentionBackend):
    """block_size > 0: block-causal attention for block-diffusion models (every sequence
    then takes the extend path, whose mask is built for it)."""

    name = "torch"
    block_size = 0

    def __init__(self, block_size: int = 0):
        self.block_size = block_size

    def plan(self, meta: AttentionMetadata) -> TorchPlan:
        dec_rows, dec_idx, extends = [], [], []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            if q_len == 1 and not self.block_size:
                dec_rows.append(start)
                dec_idx.append(i)
            elif q_len > 1 or self.block_size:
                slots = None if q_len == kv_len else kv_slots(meta.page_table[i], kv_len, meta.page_size)
                extends.append(_Extend(start, q_len, slots, kv_len))
            start += q_len
        return TorchPlan(meta, self._plan_decodes(meta, dec_rows, dec_idx), extends, {}, self.block_size)

    @staticmethod
    def _plan_decodes(meta: AttentionMetadata, rows: list[int], idx: list[int]) -> _Decodes | None:
        if not rows:
            return None
        device = meta.page_table.device
        lens = [meta.kv_lens[i] for i in idx]
        num_pages = -(-max(lens) // meta.page_size)
        table = meta.page_table[idx[0]:idx[-1] + 1] if idx[-1] - idx[0] + 1 == len(idx) \
            else meta.page_table[torch.tensor(idx, device=device)]
        contiguous = rows[-1] - rows[0] + 1 == len(rows)
        return _Decodes(slice(rows[0], rows[-1] + 1) if contiguous else torch.tensor(rows, device=device),
                        table[:, :num_pages].reshape(-1).long(),
                        torch.tensor(lens, device=device), num_pages)

    def store_kv(self, k, v, k_cache, v_cache, plan: TorchPlan) -> None:
        slots = plan.meta.slot_mapping
        if slots.numel():
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))  # a bf16 cache: rounded
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))

    def forward(self, q, k, v, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
        self.store_kv(k, v, k_cache, v_cache, plan)
        return self._attend(q, k_cache, v_cache, plan, scale, k, v)

    def attend(self, q, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
        return self._attend(q, k_cache, v_cache, plan, scale)

    def _attend(self, q, k_cache, v_cache, plan: TorchPlan, scale: float, k_new=None, v_new=None):
        d = plan.decodes
        if d is not None and not plan.extends and isinstance(d.rows, slice) and d.rows.stop == q.shape[0]:
            return self._decode(q, k_cache, v_cache, plan, scale)  # a pure decode step: no copy out
        out = torch.empty_like(q)
        if d is not None:
            out[d.rows] = self._decode(q[d.rows], k_cache, v_cache, plan, scale)
        for i, e in enumerate(plan.extends):
            rows = slice(e.start, e.start + e.length)
            new_kv = (k_new[rows], v_new[rows]) if k_new is not None else None
            out[rows] = self._extend(q[rows], k_cache, v_cache, plan, i, scale, new_kv)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
        """q [Bd, Hq, D] -> [Bd, Hq, D]. Whole pages are gathered (page-sized memcpys) and the
        query heads of one KV head form the rows of one [G, L] problem, so no K/V repeat."""
        d, (bd, hq, dim), hkv = plan.decodes, q.shape, k_cache.shape[2]
        mask = plan.masks.get(q.dtype)
        if mask is None:
            mask = plan.masks[q.dtype] = d.mask(k_cache.shape[1], q.dtype)
        kd = k_cache.index_select(0, d.pages).view(bd, -1, hkv, dim).transpose(1, 2)  # [Bd, Hkv, L, D]
        vd = v_cache.index_select(0, d.pages).view(bd, -1, hkv, dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.reshape(bd, hkv, hq // hkv, dim), kd, vd, attn_mask=mask,
                                           scale=scale)
        return o.reshape(bd, hq, dim)

    @staticmethod
    def _extend(q, k_cache, v_cache, plan: TorchPlan, i: int, scale: float, new_kv) -> torch.Tensor:
        """q [n, Hq, D] of one sequence -> [n, Hq, D]."""
        e, gqa = plan.extends[i], q.shape[1] != k_cache.shape[2]
        qe = q.transpose(0, 1)[None]                                   # [1, Hq, n, D]
        if e.slots is None and new_kv is not None and not plan.block_size:  # the new K/V are the whole context
            ke, ve = (t.transpose(0, 1)[None] for t in new_kv)
            o = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale, enable_gqa=gqa)
            return o[0].transpose(0, 1)
        # attend() without the new K/V and no prefix: the context is the new tokens' own slots
        slots = e.slots if e.slots is not None else plan.meta.slot_mapping[e.start:e.start + e.length]
        ke = k_cache.view(-1, *k_cache.shape[2:])[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
        ve = v_cache.view(-1, *v_cache.shape[2:])[slots].transpose(0, 1)[None]
        key = (i, q.dtype)
        if key not in plan.masks:
            plan.masks[key] = causal_mask(e.length, e.kv_len, q.dtype, q.device, plan.block_size)
        o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=plan.masks[key], scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)
