"""CPU serving backend: every token row of a batch through one C kernel (csrc/paged_attention.c).

A decode is one row and a prefill chunk of n tokens is n rows of one sequence, each
attending causally to the positions up to its own; the new K/V are stored first
(one C copy per token, csrc/layer_ops.c), so the kernel reads every row's context
from the pages in place. That replaced a padded-SDPA decode that copied the pages
out (a quarter of the engine's time at 16 streams) and a torch SDPA call per
prefill chunk (twice the kernel's time at 128 and 512 tokens). The kernels are
built on first use (kernels.cbuild); `auto` falls back to the torch backend where
they cannot be, and a dtype or layout the kernel does not take (bf16 queries, a
non-contiguous cache) goes through TorchAttention. The cache may hold bf16 under fp32
queries (kv_cache_dtype bfloat16): the kernel widens its rows as it loads them.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from kernels import cbuild, layer_ops
from kernels.base import AttentionBackend, AttentionMetadata
from kernels.layer_ops import CpuOps
from kernels.torch_ref import TorchAttention, TorchPlan

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# q, q_stride, k_cache, v_cache, pages, max_pages, seqs, lens, rows, Hq, Hkv, D, page size, scale, kv_bf16, out
ARGTYPES = (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, _ptr)
SIGNATURES = {"paged_attention_f32": ARGTYPES}


def available() -> bool:
    return cbuild.available("paged_attention", SIGNATURES) and cbuild.available("layer_ops", layer_ops.SIGNATURES)


@dataclass
class RowPlan:
    meta: AttentionMetadata
    pages: torch.Tensor  # [B, Pm] int64: page tables cut to the longest sequence's pages
    seqs: torch.Tensor   # [T] int64: each token row's sequence (its row of `pages`)
    lens: torch.Tensor   # [T] int64: positions each row attends to, its own included
    fallback: TorchPlan | None = None  # TorchAttention's plan, made when a layer needs it


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self):
        self._kernel = cbuild.load("paged_attention", SIGNATURES).paged_attention_f32
        self._ops = CpuOps()

    def plan(self, meta: AttentionMetadata) -> RowPlan:
        """The arrays through numpy: each torch call cost 5-20x its warm time right after a step's
        weights went through the caches, numpy's a few microseconds (docs/cpu.md, session 39)."""
        seqs, lens = [], []
        for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
            seqs += [i] * q_len
            lens += range(kv_len - q_len + 1, kv_len + 1)
        width = -(-max(meta.kv_lens, default=1) // meta.page_size)
        pages = meta.page_table.numpy()[:, :width].astype(np.int64)  # a copy: contiguous int64
        return RowPlan(meta, torch.from_numpy(pages), torch.from_numpy(np.array(seqs, dtype=np.int64)),
                       torch.from_numpy(np.array(lens, dtype=np.int64)))

    def store_kv(self, k, v, k_cache, v_cache, plan: RowPlan) -> None:
        """One copy per token into its slot (two index_copy_ calls were 0.5 ms of a 26 ms step)."""
        heads_contiguous = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        if k.dtype != torch.float32 or k.device.type != "cpu" or not heads_contiguous \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return super().store_kv(k, v, k_cache, v_cache, plan)
        self._ops.store_kv(k, v, k_cache, v_cache, plan.meta.slot_mapping)

    # The interface's own order (store the new K/V, then attend over the pages), not
    # TorchAttention's, which attends over the new K/V of a fresh prompt directly.
    forward = AttentionBackend.forward

    def attend(self, q, k_cache, v_cache, plan: RowPlan, scale: float) -> torch.Tensor:
        rows, hq, dim = q.shape
        if q.dtype != torch.float32 or q.device.type != "cpu" or q.stride(2) != 1 or q.stride(1) != dim \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            if plan.fallback is None:
                plan.fallback = super().plan(plan.meta)
            return self._attend(q, k_cache, v_cache, plan.fallback, scale)
        out = torch.empty((rows, hq, dim), dtype=q.dtype)
        rc = self._kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), plan.pages.data_ptr(),
                          plan.pages.shape[1], plan.seqs.data_ptr(), plan.lens.data_ptr(), rows, hq,
                          k_cache.shape[2], dim, k_cache.shape[1], scale, int(k_cache.dtype == torch.bfloat16),
                          out.data_ptr())
        if rc != 0:
            raise MemoryError("paged attention: no memory for its task list or scores buffer")
        return out
