"""Attention kernels against references.

* TorchAttention (kernels.torch_ref) against a naive dense per-sequence causal
  attention, so the reference has its own check.
* Every Triton kernel against TorchAttention / plain torch. Without CUDA they run
  on CPU tensors under TRITON_INTERPRET=1 (set below, before triton is imported);
  with CUDA the same tests run on the GPU (marked gpu).
* FlashinferAttention against TorchAttention (gpu, skipped without flashinfer).

Tolerances: fp32 1e-5 (abs and rel; 1e-4 on GPU, whose reductions run in another
order); fp16 1e-2 and bf16 3e-2, both against the reference run in fp32 on the
same (already rounded) inputs: the kernels round the softmax weights to the
input dtype before P @ V, as flash attention does.
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from kernels.base import AttentionMetadata  # noqa: E402
from kernels.torch_ref import TorchAttention  # noqa: E402
from kernels import triton_kernels as tk  # noqa: E402
from kernels.triton_backend import TritonAttention  # noqa: E402

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not tk.INTERPRETED, reason="triton kernels were imported compiled: set TRITON_INTERPRET=1 first")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def tol(dtype, device):
    return 1e-4 if dtype == torch.float32 and device == "cuda" else TOL[dtype]


# --------------------------------------------------------------------------- batch building


def make_meta(q_lens, kv_lens, page_size, num_pages, shared_prefix_pages=0, seed=0, device="cpu"):
    """Metadata with random, non-contiguous page lists drawn from a pool of num_pages.

    With shared_prefix_pages = n, the first two sequences read the same first n
    pages (a shared prompt prefix); their new tokens must lie past those pages.
    """
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(kv / page_size) for kv in kv_lens]
    free = torch.randperm(num_pages, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in need]
    if shared_prefix_pages:
        n = shared_prefix_pages
        assert all(kv - q >= n * page_size for q, kv in zip(q_lens[:2], kv_lens[:2]))
        tables[1][:n] = tables[0][:n]
    return AttentionMetadata.build(q_lens, kv_lens, tables, page_size, device=device)


def make_tensors(meta, num_pages, hq, hkv, dim, dtype, device, seed=0):
    """q, k, v of the new tokens and a random [layers=2, 2, P, S, Hkv, D] engine buffer."""
    g = torch.Generator().manual_seed(seed + 1)
    t = meta.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    kv = rnd(2, 2, num_pages, meta.page_size, hkv, dim)
    return rnd(t, hq, dim), rnd(t, hkv, dim), rnd(t, hkv, dim), kv


def run_backend(backend, meta, q, k, v, kv, layer=1, scale=None):
    """One layer's store + attend on a copy of the engine buffer: (out, buffer)."""
    kv = kv.clone()
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    plan = backend.plan(meta)
    out = backend.forward(q, k, v, kv[layer, 0], kv[layer, 1], plan, scale)
    return out, kv


def check_against_reference(backend, meta, q, k, v, kv, device):
    """Cache writes must match exactly; outputs within the dtype's tolerance of the
    fp32 reference on the same inputs."""
    out, kv_out = run_backend(backend, meta, q, k, v, kv)
    ref_out, ref_kv = run_backend(TorchAttention(), meta, q.float(), k.float(), v.float(), kv.float())
    assert torch.equal(kv_out.float(), ref_kv), "K/V cache writes differ"
    assert out.dtype == q.dtype and out.shape == q.shape
    t = tol(q.dtype, device)
    torch.testing.assert_close(out.float(), ref_out, atol=t, rtol=t)


# --------------------------------------------------------------------------- the reference itself


def dense_attention(meta, q, k_cache, v_cache, scale):
    """Per-sequence, per-token loop: gather each sequence's K/V by position, softmax
    over positions <= the token's own. Slow and obvious."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    row = 0
    for i, (q_len, kv_len) in enumerate(zip(meta.q_lens, meta.kv_lens)):
        pages = meta.page_table[i].long()
        pos = torch.arange(kv_len)
        ks = k_cache[pages[pos // meta.page_size], pos % meta.page_size]  # [L, Hkv, D]
        vs = v_cache[pages[pos // meta.page_size], pos % meta.page_size]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        for j in range(q_len):
            n = kv_len - q_len + j + 1  # causal: positions 0 .. own position
            w = torch.softmax(torch.einsum("hd,lhd->hl", q[row], ks[:n]).double() * scale, -1)
            out[row] = torch.einsum("hl,lhd->hd", w, vs[:n].double()).to(q.dtype)
            row += 1
    return out


@pytest.mark.parametrize("page_size,group", [(1, 1), (4, 2), (16, 4), (3, 8)])
def test_torch_reference_matches_dense(page_size, group):
    q_lens, kv_lens = [1, 6, 1, 9, 3], [13, 6, 1, 20, 40]
    meta = make_meta(q_lens, kv_lens, page_size, num_pages=80, seed=page_size)
    q, k, v, kv = make_tensors(meta, 80, 2 * group, 2, 16, torch.float64, "cpu")
    out, kv_out = run_backend(TorchAttention(), meta, q, k, v, kv, scale=0.3)
    slots = meta.slot_mapping
    assert torch.equal(kv_out[1, 0].view(-1, 2, 16)[slots], k)
    assert torch.equal(kv_out[0], kv[0]), "another layer was written"
    ref = dense_attention(meta, q, kv_out[1, 0], kv_out[1, 1], 0.3)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_torch_reference_empty_batch():
    meta = AttentionMetadata.build([], [], [], 16)
    q = torch.zeros(0, 4, 16)
    out, _ = run_backend(TorchAttention(), meta, q, torch.zeros(0, 2, 16), torch.zeros(0, 2, 16),
                         torch.randn(2, 2, 4, 16, 2, 16))
    assert out.shape == (0, 4, 16)


# --------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(device, dtype):
    meta = make_meta([3, 1, 5], [3, 9, 21], page_size=4, num_pages=20, device=device)
    _, k, v, kv = make_tensors(meta, 20, 4, 2, 24, dtype, device)
    qkv = torch.cat([k, v, k], dim=1)  # k, v as strided views of a fused projection
    k, v = qkv[:, :2], qkv[:, 2:4]
    out = kv.clone()
    tk.store_kv(k, v, out[1, 0], out[1, 1], meta.slot_mapping)
    ref = kv.clone()
    ref[1, 0].view(-1, 2, 24)[meta.slot_mapping] = k
    ref[1, 1].view(-1, 2, 24)[meta.slot_mapping] = v
    assert torch.equal(out, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_skips_negative_slots(device):
    kv = torch.zeros(2, 3, 4, 1, 16, device=device)  # [k/v, P, S, Hkv, D]
    k = torch.ones(2, 1, 16, device=device)
    tk.store_kv(k, k, kv[0], kv[1], torch.tensor([5, -1], device=device))
    assert kv.sum().item() == 2 * 16 and kv[:, 1, 1].eq(1).all()


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,group", [(1, 1), (16, 2), (1, 4), (16, 8)])
def test_decode(device, page_size, group):
    kv_lens = [1, 17, 40, 5]
    meta = make_meta([1] * 4, kv_lens, page_size, num_pages=110, seed=group, device=device)
    check_against_reference(TritonAttention(block_n=16), meta,
                            *make_tensors(meta, 110, 2 * group, 2, 32, torch.float32, device), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_split_kv(device, num_splits):
    """Long and short contexts in one batch: short ones get empty splits."""
    meta = make_meta([1, 1, 1], [150, 3, 64], page_size=8, num_pages=40, seed=num_splits,
                     device=device)
    check_against_reference(TritonAttention(num_splits=num_splits, block_n=16), meta,
                            *make_tensors(meta, 40, 8, 2, 16, torch.float32, device), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,group", [(1, 1), (16, 4), (16, 8), (5, 2)])
def test_extend_with_prefix(device, page_size, group):
    """Prefill from scratch, chunked prefill over a cached prefix, odd lengths."""
    q_lens, kv_lens = [7, 33, 2], [7, 50, 19]
    meta = make_meta(q_lens, kv_lens, page_size, num_pages=90, seed=group, device=device)
    check_against_reference(TritonAttention(block_m=16, block_n=16), meta,
                            *make_tensors(meta, 90, 2 * group, 2, 16, torch.float32, device), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_shared_prefix(device, dtype):
    """Decodes and extends in one batch; the first two share their first page."""
    q_lens, kv_lens = [1, 4, 1, 9, 1], [21, 23, 2, 9, 35]
    meta = make_meta(q_lens, kv_lens, 8, num_pages=24, shared_prefix_pages=1, device=device)
    assert meta.page_table[0, 0] == meta.page_table[1, 0]
    check_against_reference(TritonAttention(num_splits=2, block_m=16, block_n=16), meta,
                            *make_tensors(meta, 24, 4, 1, 32, dtype, device), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(8))
def test_random_batches(device, seed):
    """Random mixes of decodes, fresh prefills and chunks over a prefix, with random
    page size, GQA ratio, head dim and decode split count."""
    g = torch.Generator().manual_seed(100 + seed)

    def pick(xs):
        return xs[torch.randint(len(xs), (1,), generator=g).item()]

    q_lens, kv_lens = [], []
    for _ in range(pick([1, 2, 3, 5])):
        kind, kv = pick(["decode", "prefill", "chunk"]), pick([1, 2, 9, 16, 17, 31, 48])
        q = {"decode": 1, "prefill": kv, "chunk": max(1, kv // 3)}[kind]
        q_lens.append(q)
        kv_lens.append(kv)
    hkv = pick([1, 2, 3])
    page_size, group, dim = pick([1, 3, 16]), pick([1, 2, 4, 8]), pick([16, 24, 32])
    pool = sum(math.ceil(kv / page_size) for kv in kv_lens) + 3
    meta = make_meta(q_lens, kv_lens, page_size, pool, seed=seed, device=device)
    backend = TritonAttention(num_splits=pick([1, 2, 4]), block_m=16, block_n=16)
    check_against_reference(backend, meta,
                            *make_tensors(meta, pool, hkv * group, hkv, dim, torch.float32, device,
                                          seed=seed), device)


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_not_power_of_two(device):
    meta = make_meta([1, 6], [12, 6], 4, num_pages=8, device=device)
    check_against_reference(TritonAttention(num_splits=2, block_m=16, block_n=16), meta,
                            *make_tensors(meta, 8, 6, 2, 40, torch.float32, device), device)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_q(device):
    """q as a view of a fused qkv projection: only its last stride is 1."""
    meta = make_meta([1, 3], [7, 3], 4, num_pages=6, device=device)
    q, k, v, kv = make_tensors(meta, 6, 4, 2, 16, torch.float32, device)
    q = torch.cat([q, k, v], dim=1)[:, :4]
    assert not q.is_contiguous()
    check_against_reference(TritonAttention(block_m=16, block_n=16), meta, q, k, v, kv, device)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    meta = AttentionMetadata.build([], [], [], 16, device=device)
    kv = torch.randn(2, 2, 4, 16, 2, 16, device=device)
    empty = torch.zeros(0, 2, 16, device=device)
    out, kv_out = run_backend(TritonAttention(), meta, torch.zeros(0, 4, 16, device=device),
                              empty, empty, kv)
    assert out.shape == (0, 4, 16) and torch.equal(kv_out, kv)


def test_shape_errors_name_expected_and_got():
    k_cache = torch.zeros(4, 2, 2, 16)
    with pytest.raises(ValueError, match=r"expected \(3, 2, 16\), got \(3, 2, 8\)"):
        tk.store_kv(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), k_cache, k_cache.clone(),
                     torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="v_cache"):
        tk.store_kv(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), k_cache, torch.zeros(4, 2, 2, 8),
                    torch.zeros(3, dtype=torch.long))
    rows = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="q: expected"):
        tk.paged_decode(torch.zeros(1, 3, 16), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
                        rows, rows, rows, 1, 1.0, torch.zeros(1, 3, 16))


def test_decode_num_splits():
    # Few long sequences on a 132-SM GPU: split; many sequences or short contexts: don't.
    assert tk.decode_num_splits(1, 8, 32768, 32, target_programs=264) == 33
    assert tk.decode_num_splits(256, 8, 32768, 32, target_programs=264) == 1
    assert tk.decode_num_splits(1, 8, 300, 32, target_programs=264) == 2
    assert tk.decode_num_splits(4, 8, 0, 32, target_programs=264) == 1


# --------------------------------------------------------------------------- flashinfer


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not HAS_FLASHINFER, reason="needs CUDA and flashinfer")
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [1, 100, 37]), ([1, 5, 1, 17], [33, 40, 2, 17])])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer(q_lens, kv_lens, group, dtype):
    from kernels.flashinfer_backend import FlashinferAttention

    meta = make_meta(q_lens, kv_lens, 16, num_pages=40, device="cuda")
    check_against_reference(FlashinferAttention("cuda"), meta,
                            *make_tensors(meta, 40, 2 * group, 2, 128, dtype, "cuda"), "cuda")


def test_flashinfer_refuses_cpu():
    from kernels.flashinfer_backend import FlashinferAttention

    with pytest.raises(RuntimeError, match="CUDA"):
        FlashinferAttention("cpu")


def serving_tokens(path: str, backend: str, num_prompts: int, max_tokens: int) -> list[list[int]]:
    """Greedy ids the whole engine streams for the first test prompts, on one attention backend."""
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine, token_ids
    from tests.test_model_parity import prompts

    engine = small_engine(path, attention_backend=backend)
    assert engine.runner.attention_backend == backend
    try:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens)
        return [token_ids(o) for o in collect(engine, prompts(num_prompts), params, timeout_s=600)]
    finally:
        engine.stop()


def test_serving_greedy_identical_torch_and_triton(checkpoint):
    """The whole engine on a tiny checkpoint: the triton backend (interpreter on
    CPU) streams exactly the torch backend's greedy tokens."""
    path = checkpoint("qwen3")
    assert serving_tokens(path, "triton", 3, 12) == serving_tokens(path, "torch", 3, 12)


# --------------------------------------------------------------------------- the CPU decode kernel


def cpu_backend():
    from kernels.cpu_backend import CpuAttention

    return CpuAttention()


@pytest.mark.parametrize("page_size,group,dim", [(1, 1, 16), (16, 3, 64), (3, 4, 128), (5, 2, 40), (4, 9, 32),
                                                 (2, 7, 64)])
def test_cpu_decode(page_size, group, dim):
    """Decodes of mixed lengths (1 token, page-sized, long, not multiples of 16) against the
    reference, fp32. Dims 32, 64 and 128 take the AVX-512 path (its groups of 4, 7 and 9
    query heads need 2 passes over V), the others the general one."""
    kv_lens = [1, page_size, 2 * page_size + 1, 300, 17]
    pool = sum(math.ceil(kv / page_size) for kv in kv_lens) + 5
    meta = make_meta([1] * 5, kv_lens, page_size, pool, seed=dim)
    check_against_reference(cpu_backend(), meta, *make_tensors(meta, pool, 2 * group, 2, dim, torch.float32, "cpu"),
                            "cpu")


@pytest.mark.parametrize("seed", range(6))
def test_cpu_random_batches(seed):
    """Decodes mixed with prefills and chunks over a prefix, all rows through the kernel."""
    g = torch.Generator().manual_seed(200 + seed)
    q_lens, kv_lens = [], []
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        kv = int(torch.randint(1, 70, (1,), generator=g))
        q = [1, kv, max(1, kv // 3)][int(torch.randint(3, (1,), generator=g))]
        q_lens.append(q)
        kv_lens.append(kv)
    page_size, hkv = [1, 4, 16][seed % 3], 1 + seed % 3
    pool = sum(math.ceil(kv / page_size) for kv in kv_lens) + 3
    meta = make_meta(q_lens, kv_lens, page_size, pool, seed=seed)
    check_against_reference(cpu_backend(), meta, *make_tensors(meta, pool, 2 * hkv, hkv, 64, torch.float32, "cpu",
                                                               seed=seed), "cpu")


@pytest.mark.parametrize("dim,hkv", [(64, 3), (32, 2), (40, 2)])
def test_cpu_task_shapes_agree(dim, hkv):
    """A decode row takes all its KV heads in one task when there are at least two rows
    per thread, one head a task otherwise, and one query head a task when rows x KV heads
    are fewer than the threads. On the same batch (decodes beside a prefill chunk, whose
    rows never take every head) 1 thread gets the first shape, 3 the second and 64 the
    third: all must match the reference and each other bit for bit."""
    meta = make_meta([1, 1, 5, 1, 1], [40, 17, 30, 3, 64], 16, num_pages=20, seed=dim)
    tensors = make_tensors(meta, 20, 3 * hkv, hkv, dim, torch.float32, "cpu", seed=dim)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 3, 64):
            torch.set_num_threads(threads)
            check_against_reference(cpu_backend(), meta, *tensors, "cpu")
            outs.append(run_backend(cpu_backend(), meta, *tensors)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dim,hkv,threads", [(64, 3, 2), (64, 3, 64), (32, 2, 1), (128, 1, 2), (40, 2, 2)])
def test_cpu_bf16_cache_is_the_fp32_kernel_on_rounded_kv(dim, hkv, threads):
    """kv_cache_dtype bfloat16: each new K/V value is stored rounded as torch rounds it, and the
    outputs equal, bit for bit, the fp32 kernel's over a cache holding the same rounded values
    (the rows widen exactly as they load; the arithmetic is the same). Decodes beside a prefill
    chunk, every task shape (threads), the vector paths (32, 64, 128) and the general one (40)."""
    meta = make_meta([1, 1, 5, 1, 1], [40, 17, 30, 3, 64], 16, num_pages=20, seed=dim)
    q, k, v, kv = make_tensors(meta, 20, 3 * hkv, hkv, dim, torch.float32, "cpu", seed=dim)
    kv16 = kv.bfloat16()
    rounded = lambda t: t.bfloat16().float()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out16, buf16 = run_backend(cpu_backend(), meta, q, k, v, kv16)
        out32, buf32 = run_backend(cpu_backend(), meta, q, rounded(k), rounded(v), kv16.float())
    finally:
        torch.set_num_threads(before)
    assert buf16.dtype == torch.bfloat16 and torch.equal(buf16.float(), buf32)
    assert torch.equal(out16, out32)
    assert not torch.equal(buf16.float(), run_backend(cpu_backend(), meta, q, k, v, kv)[1])  # it did round


def test_cpu_bf16_kv_store_rounds_as_torch():
    """Ties to even, the largest values to infinity, subnormals kept: torch's bits, but for a NaN,
    which stays a NaN (torch's own bits for one differ between its vector and scalar paths)."""
    from kernels.layer_ops import CpuOps
    k = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895314e38, float("inf"), float("-inf"),
                      float("nan"), 1e-40, -0.0, 2 ** -7 + 2 ** -16])
    k = torch.cat([k, torch.randn(54, generator=torch.Generator().manual_seed(0))]).view(1, 2, 32)
    caches = torch.zeros(2, 1, 1, 2, 32, dtype=torch.bfloat16)
    CpuOps().store_kv(k, -k, caches[0], caches[1], torch.tensor([0]))
    for cache, values in ((caches[0], k[0]), (caches[1], -k[0])):
        nan = values.isnan()
        assert nan.any() and cache[0, 0][nan].isnan().all()
        assert torch.equal(cache[0, 0][~nan].view(torch.int16), values[~nan].bfloat16().view(torch.int16))


def test_cpu_empty_batch():
    """No rows: no task list to allocate, nothing written, no error."""
    meta = AttentionMetadata.build([], [], [], 16)
    kv = torch.randn(2, 2, 4, 16, 2, 16)
    empty = torch.zeros(0, 2, 16)
    out, kv_out = run_backend(cpu_backend(), meta, torch.zeros(0, 4, 16), empty, empty, kv)
    assert out.shape == (0, 4, 16) and torch.equal(kv_out, kv)


def test_cpu_strided_q_and_other_dtypes():
    """q as a view of a fused projection goes to the kernel; bf16 takes the torch path."""
    meta = make_meta([1, 1], [20, 3], 4, num_pages=8)
    q, k, v, kv = make_tensors(meta, 8, 4, 2, 64, torch.float32, "cpu")
    strided = torch.cat([q, k, v], dim=1)[:, :4]
    check_against_reference(cpu_backend(), meta, strided, k, v, kv, "cpu")
    check_against_reference(cpu_backend(), meta, *make_tensors(meta, 8, 4, 2, 64, torch.bfloat16, "cpu"), "cpu")


def test_cpu_kernel_cache_rebuilds_for_another_source(tmp_path):
    """The library is keyed by its source and the headers beside it: after an edit of either
    the kernel is compiled, not an old library loaded."""
    from kernels import cbuild

    src = tmp_path / "src"
    src.mkdir()
    for name in ("paged_attention.c", "vexp.h"):
        (src / name).write_text((cbuild.CSRC / name).read_text())
    source, header = src / "paged_attention.c", src / "vexp.h"
    first = cbuild.build(source, tmp_path)
    assert first.exists() and cbuild.build(source, tmp_path) == first
    source.write_text(source.read_text() + "\n/* edited */\n")
    second = cbuild.build(source, tmp_path)
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert second != first and cbuild.build(source, tmp_path) not in (first, second)


def test_cpu_kernel_build_error_is_reported(tmp_path):
    from kernels import cbuild

    broken = tmp_path / "broken.c"
    broken.write_text("int f( {")
    with pytest.raises(RuntimeError, match="broken.c with .* failed"):
        cbuild.build(broken, tmp_path)


def test_auto_picks_cpu_kernel_on_cpu_and_triton_on_cuda_without_flashinfer(monkeypatch):
    import importlib.util

    from kernels import resolve_backend_name

    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"  # never touches the device


def test_serving_greedy_identical_torch_and_cpu(checkpoint):
    """The whole engine on a tiny checkpoint: the C decode kernel streams exactly the
    torch backend's greedy tokens (long enough for decodes over several pages)."""
    path = checkpoint("llama")
    assert serving_tokens(path, "cpu", 4, 40) == serving_tokens(path, "torch", 4, 40)


# --------------------------------------------------------------------------- all layers in one C call


def cpu_runner(path: str, backend: str = "cpu", num_pages: int = 64, **knobs):
    from backends.config import EngineConfig
    from backends.runner import ModelRunner

    return ModelRunner(EngineConfig(model_path=path, page_size=4, num_pages=num_pages, attention_backend=backend,
                                    threads=2, **knobs))


def test_decoder_call_is_bit_identical_to_per_op_loop(checkpoint):
    """decoder.c runs the per-op path's kernels in its order: same logits and same K/V, bit for
    bit, on a batch of two decodes, a fresh prefill and a chunk over a cached prefix."""
    from backends.request import Request, SamplingParams
    from backends.runner import Batch

    runner = cpu_runner(checkpoint("llama"))
    assert runner.model.decoder is not None
    g = torch.Generator().manual_seed(7)
    reqs = []
    for i, length in enumerate([9, 21, 13, 30]):
        req = Request(f"r{i}", torch.randint(3, 500, (length,), generator=g).tolist(), SamplingParams(), None, None)
        req.pages = runner.pool.allocate(math.ceil(length / 4))
        reqs.append(req)
    runner.run(Batch([(reqs[0], 9), (reqs[1], 21), (reqs[3], 12)]))  # prefixes: two whole prompts, a chunk
    reqs[0].num_computed, reqs[1].num_computed, reqs[3].num_computed = 8, 20, 12
    batch = Batch([(reqs[0], 1), (reqs[1], 1), (reqs[2], 13), (reqs[3], 18)])
    before = runner.kv.clone()
    fused = runner.run(batch)
    fused_kv = runner.kv.clone()
    runner.kv.copy_(before)
    runner.model.decoder = None
    assert torch.equal(fused, runner.run(batch))
    assert torch.equal(fused_kv, runner.kv)


def decode_steps(runner, rows: int, steps: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`steps` decode steps of `rows` sequences after their prompts, each sequence in the same
    pages every time (taken at the first call), from the KV pool as it was: each step's logits,
    and the KV after the last."""
    from backends.request import Request, SamplingParams
    from backends.runner import Batch

    pages = runner.__dict__.setdefault("test_pages", {})
    before = runner.kv.clone()
    reqs = []
    for i in range(rows):
        req = Request(f"r{i}", list(range(5 + 7 * i, 16 + 9 * i)), SamplingParams(), None, None)
        req.pages = pages.setdefault(i, runner.pool.allocate(math.ceil((len(req.prompt_ids) + steps) / 4)))
        runner.run(Batch([(req, len(req.prompt_ids))]))
        req.num_computed = len(req.prompt_ids)
        req.output_ids.append(99)
        reqs.append(req)
    logits = []
    for step in range(steps):
        logits.append(runner.run(Batch([(req, 1) for req in reqs])))
        for req in reqs:
            req.num_computed += 1
            req.output_ids.append(100 + 31 * step + len(req.prompt_ids))
    kv = runner.kv.clone()
    runner.kv.copy_(before)
    return logits, kv


@pytest.mark.parametrize("knobs", [{}, {"dtype": "bfloat16"}, {"dtype": "bfloat16", "wide": 1}, {"weights": "int8"},
                                   {"weights": "int8", "kv_cache_dtype": "float32"}],
                         ids=["fp32", "bf16", "bf16-wide", "int8", "int8-fp32kv"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16])
def test_team_step_is_bit_identical_to_the_per_op_forms(checkpoint, knobs, rows):
    """A step of up to 16 decodes runs as one team (decoder.c's team form; from 8 rows bf16 panels
    on AMX tiles where the CPU has them, int8 at 16; bf16-wide: bf16 GEMMs widened to fp32 FMAs from
    the first row, as a CPU whose vdpbf16ps is slow runs them from 9): the same logits and K/V, bit
    for bit, as the same call op by op and as the per-op loop of the model."""
    from kernels.decoder import team_max_rows
    from kernels.linear import panel_bf16_wide_min_rows

    knobs = dict(knobs)
    wide = panel_bf16_wide_min_rows(knobs.pop("wide", None))
    try:
        runner = cpu_runner(checkpoint("mistral"), num_pages=160, **knobs)
        if knobs and runner.model.decoder is None:
            pytest.skip("no bf16 / int8 panel GEMM on this CPU")
        shipped = team_max_rows(rows)
        try:
            team = decode_steps(runner, rows)
        finally:
            team_max_rows(shipped)
        shipped = team_max_rows(0)
        try:
            per_op = decode_steps(runner, rows)
        finally:
            team_max_rows(shipped)
        runner.model.decoder = None
        loop = decode_steps(runner, rows)
    finally:
        panel_bf16_wide_min_rows(wide)
    for other in (per_op, loop):
        assert all(torch.equal(a, b) for a, b in zip(team[0], other[0]))
        assert torch.equal(team[1], other[1])


@pytest.mark.parametrize("knobs", [{}, {"weights": "int8"}], ids=["fp32", "int8"])
def test_team_step_takes_over_from_a_stalled_thread(checkpoint, knobs):
    """Thread 1 of the team sleeps 20 ms holding a gate_up panel, as a thread the OS preempts
    does: thread 0 takes that panel over, thread 1's result is dropped when it wakes (the
    counters say both happened), and the step's logits and K/V are still the per-op form's,
    bit for bit."""
    from kernels.decoder import team_counts, team_max_rows, team_test_stall

    runner = cpu_runner(checkpoint("llama"), **knobs)
    if knobs and runner.model.decoder is None:
        pytest.skip("no int8 panel GEMM on this CPU")
    before = team_counts()
    team_test_stall(20_000)
    try:
        stalled = decode_steps(runner, 1)
    finally:
        team_test_stall(0)
    after = team_counts()
    assert after[0] > before[0] and after[1] > before[1]
    shipped = team_max_rows(0)
    try:
        per_op = decode_steps(runner, 1)
    finally:
        team_max_rows(shipped)
    assert all(torch.equal(a, b) for a, b in zip(stalled[0], per_op[0]))
    assert torch.equal(stalled[1], per_op[1])


def test_decoder_in_layer_groups_is_bit_identical_and_hooks_see_their_layers(checkpoint):
    """With a layer hook (the prefill side of a hand-off), the decoder runs one call per layer
    group: the same hidden states and K/V as the per-op loop, bit for bit, and when the hook
    runs after layer i, layers up to i hold this step's K/V and the later ones do not yet."""
    from backends.model import LayerHook
    from backends.request import Request, SamplingParams
    from backends.runner import Batch

    runner = cpu_runner(checkpoint("llama"))
    n = runner.model.cfg.num_layers
    assert runner.model.decoder is not None and n >= 3
    req = Request("r", list(range(40, 63)), SamplingParams(), None, None)
    req.pages = runner.pool.allocate(6)
    batch = Batch([(req, 23)])
    before = runner.kv.clone()
    seen = []

    def after(i: int) -> None:
        written = [not torch.equal(runner.kv[layer], before[layer]) for layer in range(n)]
        seen.append((i, written))
    stops = (0, n // 2)
    grouped = runner.run(batch, LayerHook(stops, after))
    assert [i for i, _ in seen] == list(stops)
    assert all(written == [layer <= i for layer in range(n)] for i, written in seen)
    grouped_kv = runner.kv.clone()
    runner.kv.copy_(before)
    runner.model.decoder = None
    seen.clear()
    assert torch.equal(grouped, runner.run(batch, LayerHook(stops, after)))
    assert torch.equal(grouped_kv, runner.kv) and [i for i, _ in seen] == list(stops)


def test_decoder_refuses_ids_positions_and_rows_outside_its_tables_and_writes_nothing(checkpoint):
    """The embedding and rope-table lookups are the kernel's: an id past the vocabulary, a
    position past the tables or an output row past the batch raise before any layer runs (no
    K/V written), and the next forward is the per-op loop's, bit for bit."""
    from backends.request import Request, SamplingParams
    from backends.runner import Batch

    runner = cpu_runner(checkpoint("llama"))
    model, vocab = runner.model, runner.model.embed.shape[0]
    req = Request("r", list(range(3, 11)), SamplingParams(), None, None)
    req.pages = runner.pool.allocate(3)
    inputs = runner.prepare(Batch([(req, 8)]))
    t, before = inputs.tensors, runner.kv.clone()
    bad = [(t["ids"].clone().fill_(vocab), t["positions"], t["rows"], "vocabulary"),
           (t["ids"], t["positions"] + model.cos_table.shape[0], t["rows"], "rope tables"),
           (t["ids"], t["positions"], torch.tensor([8]), "outside the batch")]
    for ids, positions, rows, message in bad:
        with pytest.raises(IndexError, match=message):
            model.forward(ids, positions, runner.kv, runner.attn, inputs.plan, rows)
        assert torch.equal(runner.kv, before)
    fused = runner.run(Batch([(req, 8)]))
    runner.kv.copy_(before)
    model.decoder = None
    assert torch.equal(fused, runner.run(Batch([(req, 8)])))


@pytest.mark.parametrize("arch,backend,fused", [("llama", "cpu", True), ("mistral", "cpu", True),
                                                ("qwen2", "cpu", False), ("qwen3", "cpu", False),
                                                ("llama", "torch", False)])
def test_decoder_call_only_where_every_op_is_a_c_kernel(checkpoint, arch, backend, fused):
    """A qkv bias (qwen2), q/k norms (qwen3) or the torch attention keep the per-op loop."""
    assert (cpu_runner(checkpoint(arch), backend).model.decoder is not None) == fused


def test_page_table_array_pads_truncates_and_adds_padding_rows():
    from kernels.base import page_table_array

    table = page_table_array([[4, 5], [], [7, 8, 9, 10]], width=3, pad=2).view(5, 3)
    assert table.dtype == torch.int32
    assert table.tolist() == [[4, 5, 0], [0, 0, 0], [7, 8, 9], [0, 0, 0], [0, 0, 0]]
