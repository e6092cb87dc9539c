"""Paged attention with flashinfer's wrappers (GPU only).

The engine's page table maps directly onto flashinfer's CSR page layout for
separate K/V caches in NHD layout ([P, S, Hkv, D] each, as kernels.base):

    indptr [B + 1]       prefix sum of the pages each sequence uses
    indices [indptr[-1]] those pages, sequence after sequence (rows of page_table)
    last_page_len [B]    tokens in each sequence's last page, 1..S

A batch of decodes only (q_len 1) uses BatchDecodeWithPagedKVCacheWrapper; any
other batch uses BatchPrefillWithPagedKVCacheWrapper with causal=True, whose
mask is aligned to the end of the KV (new tokens after the cached prefix) and
which also handles the q_len 1 rows of a mixed batch.

flashinfer needs the head counts, dtype and softmax scale at plan time, which
our plan() does not know yet, so the wrapper is planned on the first attend()
of a batch (the first layer) and reused by the others.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.base import AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's documented default


@dataclass
class FlashinferPlan:
    """Host (CPU) tensors: flashinfer's plan() reads them on the host and copies
    them to the GPU itself, so keeping them here avoids a device-to-host sync."""
    meta: AttentionMetadata
    batch_id: int                 # tells the wrapper's current plan apart from older ones
    qo_indptr: torch.Tensor       # [B + 1] int32
    kv_indptr: torch.Tensor       # [B + 1] int32
    kv_indices: torch.Tensor      # [pages used] int32
    last_page_len: torch.Tensor   # [B] int32


class FlashinferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(f"the flashinfer attention backend needs a CUDA device, got {device}; "
                               "use attention_backend 'torch' on CPU")
        import flashinfer  # lazily: GPU-only package, JIT-compiles CUDA

        self.device = device
        self._flashinfer = flashinfer
        # Zeroed: some flashinfer backends (trtllm-gen) require it on first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = {}  # use_tensor_cores -> decode wrapper, made on first use
        self._batch_ids = itertools.count()
        self._active = None   # the wrapper last planned ...
        self._planned = None  # ... and for which (batch_id, heads, dims, dtypes, scale)

    def plan(self, meta: AttentionMetadata) -> FlashinferPlan:
        size = meta.page_size
        kv_lens = torch.tensor(meta.kv_lens, dtype=torch.int32)
        num_pages = (kv_lens + size - 1) // size
        table = meta.page_table.to("cpu", torch.int32)
        used = torch.arange(table.shape[1])[None, :] < num_pages[:, None]  # [B, max_pages]

        def cumsum0(x):
            return torch.cat([torch.zeros(1, dtype=torch.int32), x.cumsum(0).to(torch.int32)])

        return FlashinferPlan(
            meta=meta, batch_id=next(self._batch_ids),
            qo_indptr=cumsum0(torch.tensor(meta.q_lens, dtype=torch.int32)),
            kv_indptr=cumsum0(num_pages),
            kv_indices=table[used],  # row-major: sequence after sequence
            last_page_len=(kv_lens - (num_pages - 1) * size).to(torch.int32))

    def store_kv(self, k, v, k_cache, v_cache, plan: FlashinferPlan) -> None:
        slots = plan.meta.slot_mapping
        if slots.numel():
            k_cache.view(-1, *k_cache.shape[2:])[slots] = k
            v_cache.view(-1, *v_cache.shape[2:])[slots] = v

    def attend(self, q, k_cache, v_cache, plan: FlashinferPlan, scale: float) -> torch.Tensor:
        if plan.meta.num_tokens == 0:
            return torch.empty_like(q)
        _, page_size, hkv, dim = k_cache.shape
        key = (q.shape[1], hkv, dim, q.dtype, k_cache.dtype, float(scale))
        if self._planned != (plan.batch_id, key):
            self._active = self._plan_wrapper(plan, key, page_size)
            self._planned = (plan.batch_id, key)
        return self._active.run(q, (k_cache, v_cache))

    def _plan_wrapper(self, plan: FlashinferPlan, key: tuple, page_size: int):
        hq, hkv, dim, q_dtype, kv_dtype, scale = key
        common = dict(sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype)
        if plan.meta.is_decode:
            wrapper = self._decode_wrapper(use_tensor_cores=hq // hkv >= 4)
            wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.last_page_len, hq, hkv, dim,
                         page_size, **common)
            return wrapper
        self._prefill.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len,
                           hq, hkv, dim, page_size, causal=True, **common)
        return self._prefill

    def _decode_wrapper(self, use_tensor_cores: bool):
        # Tensor cores pay off once several q heads share a KV head (flashinfer's advice).
        if use_tensor_cores not in self._decode:
            self._decode[use_tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=use_tensor_cores)
        return self._decode[use_tensor_cores]
