"""Paged attention with the Triton kernels of kernels.triton_kernels.

plan() takes the batch's small int32 arrays on the cache's device from the
metadata (kv_lens, cu_seqlens of q, which sequences decode and which extend), so
every layer launches at most three kernels with no host work: the split-KV
decode (two phases) for the q_len 1 sequences and the varlen extend kernel for
the others. On CPU the kernels only run under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kernels import triton_kernels as tk
from kernels.base import AttentionBackend, AttentionMetadata


@dataclass
class TritonPlan:
    meta: AttentionMetadata
    page_table: torch.Tensor   # [B, max_pages] int32, last stride 1
    kv_lens: torch.Tensor      # [B] int32
    cu_q: torch.Tensor         # [B + 1] int32: first row in q of every sequence
    dec_rows: torch.Tensor     # [Bd] int32: row in q of every decode
    dec_seqs: torch.Tensor     # [Bd] int32: its sequence
    max_dec_kv: int
    ext_seqs: torch.Tensor     # [Be] int32: sequences with q_len > 1
    max_ext_q: int


# Tile sizes and launch shapes picked by a sweep on an H200 (bf16, 32 q / 8 KV heads, head dim
# 128; docs/kernels.md, `python -m kernels.tune`): decode at batch 16-64 x 4K-16K read 2.7-3.4
# TB/s of KV before and 3.9-4.2 after, extend went from 78-97 to 217-246 TFLOP/s; on an H100 the
# decode gain is smaller and nothing got slower. The interpreter ignores warps and stages.
DECODE_BLOCK_N, DECODE_WARPS, DECODE_STAGES, DECODE_PROGRAMS_PER_SM = 64, 4, 2, 4
EXTEND_BLOCK_M, EXTEND_BLOCK_N, EXTEND_WARPS, EXTEND_STAGES = 64, 128, 4, 1


@lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    """Programs a decode launch should have to keep HBM busy: a few per SM on a GPU;
    1 elsewhere (the CPU interpreter runs programs one by one, so splitting only costs)."""
    if device.type == "cuda":
        return DECODE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, num_splits: int | None = None, block_n: int | None = None, block_m: int | None = None):
        """num_splits forces the decode split count, block_n / block_m the tiles of both
        kernels (tests); None: the split count per batch, the tuned tiles."""
        self.num_splits = num_splits
        self.decode_block_n = block_n or DECODE_BLOCK_N
        self.extend_block_n = block_n or EXTEND_BLOCK_N
        self.block_m = block_m or EXTEND_BLOCK_M

    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        """No tensor of its own: the arrays came with the metadata, in the step's one copy."""
        decodes = [kv for q, kv in zip(meta.q_lens, meta.kv_lens) if q == 1]
        return TritonPlan(
            meta=meta, page_table=meta.page_table.contiguous(), kv_lens=meta.seq_lens, cu_q=meta.cu_q,
            dec_rows=meta.decode_rows, dec_seqs=meta.decode_seqs, max_dec_kv=max(decodes, default=0),
            ext_seqs=meta.extend_seqs, max_ext_q=max((q for q in meta.q_lens if q > 1), default=0))

    def store_kv(self, k, v, k_cache, v_cache, plan: TritonPlan) -> None:
        tk.store_kv(k, v, k_cache, v_cache, plan.meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, plan: TritonPlan, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        if plan.dec_rows.numel():
            tk.paged_decode(q, k_cache, v_cache, plan.page_table, plan.kv_lens, plan.dec_rows,
                            plan.dec_seqs, plan.max_dec_kv, scale, out,
                            num_splits=self._num_splits(plan, k_cache), block_n=self.decode_block_n,
                            num_warps=DECODE_WARPS, num_stages=DECODE_STAGES)
        if plan.ext_seqs.numel():
            tk.paged_extend(q, k_cache, v_cache, plan.page_table, plan.kv_lens, plan.cu_q,
                            plan.ext_seqs, plan.max_ext_q, scale, out,
                            block_m=self.block_m, block_n=self.extend_block_n,
                            num_warps=EXTEND_WARPS, num_stages=EXTEND_STAGES)
        return out

    def _num_splits(self, plan: TritonPlan, k_cache: torch.Tensor) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return tk.decode_num_splits(plan.dec_rows.numel(), k_cache.shape[2], plan.max_dec_kv,
                                    self.decode_block_n, _target_programs(k_cache.device))
