"""Triton-language kernels for paged attention (KV store, decode, extend).

Set TRITON_INTERPRET=1 *before* importing it (or kernels.triton_ops, the layer ops) to
run the kernels on CPU tensors (triton decides at decoration time whether a kernel is
compiled or interpreted).

Shapes (as in kernels.base): q [T, Hq, D]; k, v [T, Hkv, D]; one layer's
k_cache / v_cache [P, S, Hkv, D]. The last dimension of every tensor must be
contiguous; the other strides are passed to the kernels.

Every block dimension is at least 16 because tl.dot needs that on GPUs; a head
dim that is not a power of two is padded with masked lanes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))


def _block(n: int, minimum: int = 16) -> int:
    return max(minimum, triton.next_power_of_2(max(int(n), 1)))


def _check(cond: bool, what: str, expected, got) -> None:
    if not cond:
        raise ValueError(f"{what}: expected {expected}, got {got}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check(k_cache.dim() == 4, "k_cache", "[P, S, Hkv, D]", tuple(k_cache.shape))
    _check(v_cache.shape == k_cache.shape, "v_cache", tuple(k_cache.shape), tuple(v_cache.shape))
    _check(k_cache.stride() == v_cache.stride(), "v_cache strides", k_cache.stride(), v_cache.stride())
    _check(k_cache.stride(-1) == 1, "k_cache last stride", 1, k_cache.stride(-1))


def _check_attention_args(q, out, k_cache, v_cache, page_table) -> tuple[int, int, int, int]:
    """Shapes shared by the decode and extend entry points; returns page_size, Hkv, D, Hq."""
    _check_cache(k_cache, v_cache)
    _, page_size, hkv, dim = k_cache.shape
    _, hq, qd = q.shape
    _check(qd == dim and hq % hkv == 0, "q", f"[T, k*{hkv}, {dim}]", tuple(q.shape))
    _check(out.shape == q.shape, "out", tuple(q.shape), tuple(out.shape))
    _check(q.stride(-1) == 1 and out.stride(-1) == 1, "q/out last stride", 1, (q.stride(-1), out.stride(-1)))
    _check(page_table.dim() == 2 and page_table.stride(1) == 1, "page_table", "[B, pages], last stride 1",
           (tuple(page_table.shape), page_table.stride()))
    return page_size, hkv, dim, hq


# --------------------------------------------------------------------------- store K/V


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cp, stride_cs, stride_ch, page_size,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok)
    d = tl.arange(0, BLOCK_D)
    # A negative slot marks a padding token (e.g. a padded CUDA-graph batch): skip it.
    mask = (d < HEAD_DIM) & ((d * 0 + slot) >= 0)  # broadcast first: the interpreter rejects scalar & block
    dst = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs + head * stride_ch + d
    k = tl.load(k_ptr + tok * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the cache slots slot_mapping [T] (page * S + offset)."""
    _check_cache(k_cache, v_cache)
    _, page_size, hkv, dim = k_cache.shape
    t = slot_mapping.shape[0]
    _check(k.shape == (t, hkv, dim), "k", (t, hkv, dim), tuple(k.shape))
    _check(v.shape == k.shape, "v", tuple(k.shape), tuple(v.shape))
    _check(k.stride(-1) == 1 and v.stride(-1) == 1, "k/v last stride", 1, (k.stride(-1), v.stride(-1)))
    if t == 0:
        return
    _store_kv_kernel[(t, hkv)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_size,
        HEAD_DIM=dim, BLOCK_D=_block(dim))


# True when TRITON_INTERPRET=1 was set before this module was imported: the
# kernels then run on CPU tensors (slowly, for tests); otherwise they need CUDA.
INTERPRETED = type(_store_kv_kernel).__name__ == "InterpretedFunction"


# --------------------------------------------------------------------------- decode


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b in fp32. UPCAST (interpreter only): its tl.dot multiplies the raw
    uint16 bits of bf16 operands, so they are converted to fp32 first."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


# Integers that change from step to step (the page table's width, the split length and the
# partial buffers' strides, which follow the split count) are not specialized on: Triton
# would otherwise compile a new variant whenever one of them turns divisible by 16 or 1.
@triton.jit(do_not_specialize=["stride_tb", "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh",
                               "split_len"])
def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, kv_lens_ptr, rows_ptr, seqs_ptr,
                           part_o_ptr, part_lse_ptr, qk_scale,
                           stride_qt, stride_qh, stride_cp, stride_cs, stride_ch, stride_tb,
                           stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                           page_size, split_len,
                           GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Phase 1: one program = (decode, kv head, split). All GROUP q heads that share
    the kv head are rows of one tile, so each K/V page is read once per group."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b)
    seq = tl.load(seqs_ptr + b)
    kv_len = tl.load(kv_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D)
    hmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        page = tl.load(table_ptr + seq * stride_tb + pos // page_size, mask=nmask, other=0)
        off = page.to(tl.int64) * stride_cp + (pos % page_size) * stride_cs + kvh * stride_ch
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m = m_new

    # A split past the end of a short sequence is empty: weight 0 in the reduce.
    nonempty = l > 0
    o = acc / tl.where(nonempty, l, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    o_ptrs = part_o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptrs, o, mask=hmask[:, None] & dmask[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh"])
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, rows_ptr, num_splits,
                          stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                          stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Phase 2: one program = (decode, q head); merges the splits' partial softmaxes."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + b)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    smask = sp < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + sp, mask=smask, other=float("-inf"))
    o = tl.load(part_o_ptr + b * stride_pb + h * stride_ph + sp[:, None] * stride_ps + d[None, :],
                mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty (kv_len >= 1), so max is finite
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_num_splits(num_decodes: int, num_kv_heads: int, max_kv_len: int, block_n: int,
                      target_programs: int, min_split_len: int = 256) -> int:
    """Split long contexts only as far as needed to give the GPU enough programs."""
    per_split = num_decodes * num_kv_heads
    wanted = max(1, -(-target_programs // max(per_split, 1)))
    most = max(1, -(-max_kv_len // max(min_split_len, block_n)))
    return min(wanted, most)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page_table: torch.Tensor, kv_lens: torch.Tensor, rows: torch.Tensor,
                 seqs: torch.Tensor, max_kv_len: int, scale: float, out: torch.Tensor,
                 num_splits: int = 1, block_n: int = 32, num_warps: int = 4, num_stages: int = 3) -> None:
    """Decode attention, written into out[rows] (same shape as q).

    q [T, Hq, D]; rows [Bd] int32 token row of each decode in q; seqs [Bd] int32
    its sequence (row of page_table [B, max_pages] int32 and of kv_lens [B] int32).
    The context of every decode is cut into num_splits equal spans (phase 1),
    merged by their log-sum-exp (phase 2).
    """
    page_size, hkv, dim, hq = _check_attention_args(q, out, k_cache, v_cache, page_table)
    _check(rows.shape == seqs.shape and rows.dim() == 1, "rows/seqs", "[Bd] each",
           (tuple(rows.shape), tuple(seqs.shape)))
    bd = rows.shape[0]
    if bd == 0:
        return
    group = hq // hkv
    split_len = triton.cdiv(triton.cdiv(max(max_kv_len, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(max_kv_len, 1), split_len)
    part_o = torch.empty((bd, hq, num_splits, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((bd, hq, num_splits), dtype=torch.float32, device=q.device)
    block_d = _block(dim)
    _decode_partial_kernel[(bd, hkv, num_splits)](
        q, k_cache, v_cache, page_table, kv_lens, rows, seqs, part_o, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1), page_size, split_len,
        GROUP=group, HEAD_DIM=dim, BLOCK_H=_block(group), BLOCK_N=block_n, BLOCK_D=block_d,
        UPCAST=INTERPRETED, num_warps=num_warps, num_stages=num_stages)
    _decode_reduce_kernel[(bd, hq)](
        part_o, part_lse, out, rows, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=dim, BLOCK_SPLITS=_block(num_splits, 2), BLOCK_D=block_d)


# --------------------------------------------------------------------------- extend / prefill


@triton.jit(do_not_specialize=["stride_tb"])
def _extend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, kv_lens_ptr, cu_q_ptr, seqs_ptr,
                   qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_cp, stride_cs, stride_ch, stride_tb, page_size,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """One program = (sequence, q head, block of BLOCK_M new tokens). The new K/V are
    already in the pages, so one loop over the cache covers prefix and new tokens."""
    e = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    seq = tl.load(seqs_ptr + e)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    prefix = kv_len - q_len
    kvh = h // GROUP

    m_idx = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m_idx < q_len
    q_pos = prefix + m_idx
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_ptrs = q_ptr + (q_start + m_idx)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=mmask[:, None] & dmask[None, :], other=0.0)

    # Causal: this block's last token sees positions < prefix + (mblk + 1) * BLOCK_M.
    hi = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)
    hi = tl.where(mblk * BLOCK_M < q_len, hi, 0)  # programs past the sequence do nothing
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < hi
        page = tl.load(table_ptr + seq * stride_tb + pos // page_size, mask=nmask, other=0)
        off = page.to(tl.int64) * stride_cp + (pos % page_size) * stride_cs + kvh * stride_ch
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale
        # Every row keeps position 0, so no row is all -inf (no NaN from exp2).
        s = tl.where(nmask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    out_ptrs = out_ptr + (q_start + m_idx)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 page_table: torch.Tensor, kv_lens: torch.Tensor, cu_q: torch.Tensor,
                 seqs: torch.Tensor, max_q_len: int, scale: float, out: torch.Tensor,
                 block_m: int = 32, block_n: int = 32, num_warps: int = 4, num_stages: int = 3) -> None:
    """Causal attention of the new tokens of sequences `seqs` [Be] int32 over their
    cached prefix and themselves, written into out (same shape as q [T, Hq, D]).

    cu_q [B + 1] int32: first row in q of every sequence (varlen batch);
    kv_lens [B] int32; page_table [B, max_pages] int32; max_q_len bounds the grid.
    """
    page_size, hkv, dim, hq = _check_attention_args(q, out, k_cache, v_cache, page_table)
    _check(cu_q.shape == (kv_lens.shape[0] + 1,), "cu_q", (kv_lens.shape[0] + 1,), tuple(cu_q.shape))
    be = seqs.shape[0]
    if be == 0 or max_q_len == 0:
        return
    grid = (be, hq, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, kv_lens, cu_q, seqs, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), page_size,
        GROUP=hq // hkv, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block(dim),
        UPCAST=INTERPRETED, num_warps=num_warps, num_stages=num_stages)
