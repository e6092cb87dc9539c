"""The decoder's small ops between its matmuls, picked once per device and dtype like
`kernels.linear`: residual add + RMSNorm, rotary embedding, and the SiLU gate.

`TorchOps` is the reference and the path of half precision on a CPU; GPUs run
`kernels.triton_ops.TritonOps` (the same arithmetic, one launch each). On a CPU in fp32
`CpuOps` runs them as csrc/layer_ops.c, one call each instead of about twenty torch
ops a layer (see that file for the why and the numbers). Both keep transformers' order
of operations; the C norm sums its squares in another order (within ~1e-7 relative).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = {  # the arguments of each function of csrc/layer_ops.c, in order
    "add_rms_norm_f32": (_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32),  # residual, h, weight, out, rows, dim, eps
    "rope_f32": (_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr),          # x, ld, rows, heads, dim, cos, signed_sin
    # k, k_ld, v, v_ld, slots, rows, width, k_cache, v_cache
    "store_kv_f32": (_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr),
    "store_kv_bf16": (_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr),
    "silu_mul_f32": (_ptr, _i64, _i64, _ptr),                        # gate_up, rows, inter, out
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused op, bit-identical to the composite below in fp32 (checked), a third faster.
        return F.rms_norm(x, weight.shape, weight, eps)
    # Same order of operations as transformers' LlamaRMSNorm (fp32 variance, cast, then weight).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, signed_sin [T, 1, D] (sin with its first half negated).

    transformers computes x * cos + cat(-x2, x1) * sin; with sin's first half negated
    once per step, cat(-x2, x1) * sin == roll(x, D/2) * signed_sin bit for bit, in
    four ops instead of seven. (No addcmul: its fused multiply-add rounds differently.)"""
    rotated = x.roll(x.shape[-1] // 2, -1).mul_(signed_sin)
    return rotated.add_(x * cos)


class TorchOps:
    name = "torch"

    def add_rms_norm(self, residual: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += h in place (h None: nothing to add); returns rms_norm(residual) * weight."""
        if h is not None:
            residual.add_(h)
        return rms_norm(residual, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (a view of the fused qkv rows); returns it rotated, maybe in place."""
        return apply_rope(x, cos, signed_sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)  # gate is a view of a temporary


class CpuOps(TorchOps):
    name = "cpu"

    def __init__(self):
        from kernels import cbuild

        self._lib = cbuild.load("layer_ops", SIGNATURES)

    def add_rms_norm(self, residual, h, weight, eps):
        rows, dim = residual.shape
        if not (residual.is_contiguous() and (h is None or h.is_contiguous())):
            return super().add_rms_norm(residual, h, weight, eps)
        out = torch.empty_like(residual)
        self._lib.add_rms_norm_f32(residual.data_ptr(), None if h is None else h.data_ptr(), weight.data_ptr(),
                                   out.data_ptr(), rows, dim, eps)
        return out

    def rope(self, x, cos, signed_sin):
        t, heads, dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != dim:
            return super().rope(x, cos, signed_sin)
        self._lib.rope_f32(x.data_ptr(), x.stride(0), t, heads, dim, cos.data_ptr(), signed_sin.data_ptr())
        return x

    def silu_mul(self, gate_up):
        rows, width = gate_up.shape
        if not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._lib.silu_mul_f32(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k_cache[slot] = k[t], v_cache[slot] = v[t] for the slot of each token t; k, v [T, Hkv, D]
        with their heads contiguous, the caches [P, S, Hkv, D] contiguous, fp32 or bf16 (rounded
        as torch rounds)."""
        store = self._lib.store_kv_bf16 if k_cache.dtype == torch.bfloat16 else self._lib.store_kv_f32
        store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), k.shape[0],
              k.shape[1] * k.shape[2], k_cache.data_ptr(), v_cache.data_ptr())


def pick_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    if device.type == "cuda":
        from kernels.triton_ops import TritonOps

        return TritonOps()
    if device.type == "cpu" and dtype == torch.float32:
        from kernels import cbuild

        if cbuild.available("layer_ops", SIGNATURES):
            return CpuOps()
    return TorchOps()
