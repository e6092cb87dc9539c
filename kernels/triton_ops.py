"""The decoder's small ops as Triton kernels, one launch each (the GPU's `ops`, kernels.layer_ops).

Run eagerly or inside a decode CUDA graph, the torch composites cost about 31 launches a
layer (add + RMSNorm nine, rope four, SiLU-mul two, the KV store): on an H100 an 8B
model's decode graph spent 7.2 ms against a 5.0 ms roofline at batch 1 (docs/gpu.md).
These run the same arithmetic as `TorchOps` in one launch each, and rotate q and k and
store k and v into their KV slots in one more:

    add_rms_norm   residual += h (rounded to its dtype), then transformers' RMSNorm
    silu_mul       silu(gate) * up, each product rounded as torch rounds it
    rope_store     q and k heads rotated in place (cos / signed sin looked up by position),
                   k and v written to the slots of the KV cache (a negative slot: none)

Like kernels.triton_kernels, set TRITON_INTERPRET=1 before importing to run them on CPU
tensors (the tests compare them there with `TorchOps`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layer_ops import TorchOps


@triton.jit
def _add_rms_norm_kernel(res_ptr, h_ptr, w_ptr, out_ptr, stride_r, stride_h, stride_o, dim, eps,
                         HAS_H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_H:
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + h.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, r, mask=mask)
    x = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = (x * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, stride_t,
                       stride_cp, stride_cs, stride_ch, page_size,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    d = tl.arange(0, BLOCK_D)
    in_d = d < D
    heads = tl.arange(0, BLOCK_H)
    rotated = (heads < HQ + HKV)[:, None] & in_d[None, :]
    base = qkv_ptr + tok * stride_t + heads[:, None] * D
    x = tl.load(base + d[None, :], mask=rotated, other=0.0)
    x_roll = tl.load(base + ((d + D // 2) % D)[None, :], mask=rotated, other=0.0)  # roll by D/2
    cos = tl.load(cos_ptr + pos * D + d, mask=in_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + d, mask=in_d, other=0.0).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    a = (x_roll.to(tl.float32) * sin[None, :]).to(dt)
    b = (x.to(tl.float32) * cos[None, :]).to(dt)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(dt)
    tl.store(base + d[None, :], y, mask=rotated)
    slot = tl.load(slot_ptr + tok)
    page, offset = slot // page_size, slot % page_size
    dst = page * stride_cp + offset * stride_cs + d[None, :]
    written = (heads * 0 + slot >= 0)[:, None] & rotated  # broadcast first: the interpreter wants blocks
    is_k = (heads >= HQ)[:, None] & written
    tl.store(kc_ptr + dst + (heads - HQ)[:, None] * stride_ch, y.to(kc_ptr.dtype.element_ty), mask=is_k)
    is_v = (heads < HKV)[:, None] & written
    v = tl.load(qkv_ptr + tok * stride_t + (HQ + HKV + heads)[:, None] * D + d[None, :], mask=is_v, other=0.0)
    tl.store(vc_ptr + dst + heads[:, None] * stride_ch, v.to(vc_ptr.dtype.element_ty), mask=is_v)


class TritonOps(TorchOps):
    name = "triton"

    def add_rms_norm(self, residual, h, weight, eps):
        rows, dim = residual.shape
        if residual.stride(-1) != 1 or (h is not None and h.stride(-1) != 1):
            return super().add_rms_norm(residual, h, weight, eps)
        out = torch.empty_like(residual)
        if rows:
            block = triton.next_power_of_2(dim)
            _add_rms_norm_kernel[(rows,)](residual, residual if h is None else h, weight, out, residual.stride(0),
                                          0 if h is None else h.stride(0), out.stride(0), dim, eps,
                                          HAS_H=h is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)))
        return out

    def silu_mul(self, gate_up):
        rows, width = gate_up.shape
        if gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up)
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(width // 2))
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                    width // 2, BLOCK=block, num_warps=4)
        return out

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   signed_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
        """qkv [T, (heads + 2 kv_heads) * D] (rows may be strided, each row contiguous): q and k
        rotated in place by the tables' rows [max_position, D] at `positions`, then k and v
        written to k_cache / v_cache [P, S, Hkv, D] at `slots` [T] (page * S + offset; < 0: no write)."""
        t = qkv.shape[0]
        dim = cos.shape[-1]
        if t == 0:
            return
        if qkv.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("rope_store: qkv rows and the caches' head dim must be contiguous, k and v caches alike")
        _rope_store_kernel[(t,)](qkv, positions, cos, signed_sin, k_cache, v_cache, slots, qkv.stride(0),
                                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
                                 HQ=heads, HKV=kv_heads, D=dim, BLOCK_H=triton.next_power_of_2(heads + kv_heads),
                                 BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
