"""CPU serving backend: TorchAttention with decodes run by a C kernel (csrc/decode_attention.c).

The padded-SDPA decode of TorchAttention copies every decode's pages out before
it attends (index_select), which on the default model at 16 streams was a
quarter of the engine's time; the kernel reads the pages in place. Prefill
chunks keep TorchAttention's SDPA path (compute-bound, already one call each).
The K/V store is one C copy per token (csrc/layer_ops.c). The kernels are built
on first use (kernels.cbuild); `auto` falls back to the torch backend where they
cannot be.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cbuild, layer_ops
from kernels.layer_ops import CpuOps
from kernels.torch_ref import TorchAttention, TorchPlan

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# q, q_stride, k_cache, v_cache, pages, max_pages, lens, batch, Hq, Hkv, D, page size, scale, out
ARGTYPES = (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr)


def available() -> bool:
    return cbuild.available("decode_attention", {"decode_attention_f32": ARGTYPES}) \
        and cbuild.available("layer_ops", layer_ops.SIGNATURES)


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self):
        self._kernel = cbuild.load("decode_attention", {"decode_attention_f32": ARGTYPES}).decode_attention_f32
        self._ops = CpuOps()

    def store_kv(self, k, v, k_cache, v_cache, plan: TorchPlan) -> None:
        """One copy per token into its slot (two index_copy_ calls were 0.5 ms of a 26 ms step)."""
        heads_contiguous = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        if k.dtype != torch.float32 or k.device.type != "cpu" or not heads_contiguous \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return super().store_kv(k, v, k_cache, v_cache, plan)
        self._ops.store_kv(k, v, k_cache, v_cache, plan.meta.slot_mapping)

    def _decode(self, q, k_cache, v_cache, plan: TorchPlan, scale: float) -> torch.Tensor:
        bd, hq, dim = q.shape
        if q.dtype != torch.float32 or q.device.type != "cpu" or q.stride(2) != 1 or q.stride(1) != dim \
                or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return TorchAttention._decode(q, k_cache, v_cache, plan, scale)
        d = plan.decodes
        out = torch.empty((bd, hq, dim), dtype=q.dtype)
        rc = self._kernel(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), d.pages.data_ptr(),
                          d.num_pages, d.lens.data_ptr(), bd, hq, k_cache.shape[2], dim, k_cache.shape[1],
                          scale, out.data_ptr())
        if rc != 0:
            raise MemoryError("decode attention: no memory for the scores buffer")
        return out
