"""The C layer ops (kernels.layer_ops.CpuOps) against the torch reference ops, and which
ops a device and dtype get. Rows run from empty to past the size where the C loops go
parallel (64K floats)."""
from __future__ import annotations

import pytest
import torch

from kernels.layer_ops import CpuOps, TorchOps, pick_ops

ROWS = [0, 1, 5, 300]


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 576, 1000])
@pytest.mark.parametrize("with_h", [False, True])
def test_add_rms_norm(rows, dim, with_h):
    residual, weight = randn(rows, dim, seed=1, scale=3), randn(dim, seed=2)
    h = randn(rows, dim, seed=3) if with_h else None
    ref_residual, got_residual = residual.clone(), residual.clone()
    ref = TorchOps().add_rms_norm(ref_residual, h, weight, 1e-5)
    got = CpuOps().add_rms_norm(got_residual, h, weight, 1e-5)
    assert torch.equal(got_residual, ref_residual)  # the residual add is one rounding either way
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,dim", [(12, 64), (3, 128), (5, 16)])
def test_rope_in_place_is_bit_identical(rows, heads, dim):
    """On a strided view of fused qkv rows, as the model calls it; the values past the
    rotated heads (v) are untouched."""
    qkv = randn(rows, heads * dim + 40, seed=4, scale=2)
    angles = randn(rows, 1, dim // 2, seed=5, scale=10)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sin[..., :dim // 2].neg_()
    ref = TorchOps().rope(qkv[:, :heads * dim].view(rows, heads, dim), cos, sin)
    x = qkv.clone()
    got = CpuOps().rope(x[:, :heads * dim].view(rows, heads, dim), cos, sin)
    assert got.data_ptr() == x.data_ptr() and torch.equal(got, ref)
    assert torch.equal(x[:, heads * dim:], qkv[:, heads * dim:])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 100])
def test_silu_mul(rows, inter):
    gate_up = randn(rows, 2 * inter, seed=6, scale=4)
    gate_up[:, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])  # the exp's clamped ends
    ref = TorchOps().silu_mul(gate_up.clone())
    got = CpuOps().silu_mul(gate_up)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_store_kv_matches_index_copy(rows):
    pages, page_size, hkv, dim = 40, 16, 3, 64
    qkv = randn(rows, (3 + 2) * hkv * dim, seed=7)  # k and v as views into fused rows
    k = qkv[:, 3 * hkv * dim:4 * hkv * dim].view(rows, hkv, dim)
    v = qkv[:, 4 * hkv * dim:].view(rows, hkv, dim)
    slots = torch.randperm(pages * page_size, generator=torch.Generator().manual_seed(8))[:rows]
    caches = [randn(pages, page_size, hkv, dim, seed=9) for _ in range(4)]
    CpuOps().store_kv(k, v, caches[0], caches[1], slots)
    caches[2].view(-1, hkv, dim).index_copy_(0, slots, k)
    caches[3].view(-1, hkv, dim).index_copy_(0, slots, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_non_contiguous_inputs_take_the_torch_path():
    residual, h, weight = randn(6, 64, seed=10)[:, :32], randn(6, 32, seed=11), randn(32, seed=12)
    ref_residual = residual.clone()
    got = CpuOps().add_rms_norm(residual, h, weight, 1e-6)
    torch.testing.assert_close(got, TorchOps().add_rms_norm(ref_residual, h, weight, 1e-6))
    gate_up = randn(4, 400, seed=13)[:, :200]
    ref = TorchOps().silu_mul(gate_up.clone())  # (the torch op overwrites the gate half)
    torch.testing.assert_close(CpuOps().silu_mul(gate_up), ref)


def test_pick_ops():
    assert pick_ops(torch.device("cpu"), torch.float32).name == "cpu"
    assert pick_ops(torch.device("cpu"), torch.bfloat16).name == "torch"
    assert pick_ops(torch.device("cuda"), torch.float32).name == "triton"  # kernels.triton_ops


def test_the_exp_loops_vectorize(tmp_path):
    """SiLU and the softmax go through vexp.h's clamp; built with cbuild's flags both loops
    must come out as vector code (with GCC's default -ftrapping-math they were scalar)."""
    import subprocess

    from kernels import cbuild

    cc = cbuild.compiler()
    if "GCC" not in subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.upper():
        pytest.skip(f"{cc} is not GCC: -fopt-info-vec is GCC's")
    for source, line in (("layer_ops.c", "y[i] = g[i] / (1.f + vexp(-g[i]))"), ("paged_attention.c", "vexp(s[t] - max)")):
        text = (cbuild.CSRC / source).read_text().splitlines()
        number = next(i for i, ln in enumerate(text, 1) if line in ln)
        done = subprocess.run([cc, *cbuild.FLAGS, "-fopt-info-vec-optimized", str(cbuild.CSRC / source),
                               "-o", str(tmp_path / "lib.so"), "-lm"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert f"{source}:{number}:" in done.stderr, f"{source}:{number} not vectorized:\n{done.stderr}"
