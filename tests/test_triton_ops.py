"""The GPU's layer ops (kernels.triton_ops) against the torch reference (kernels.layer_ops.TorchOps).

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (set before triton is
imported); with CUDA the same tests run on the GPU (marked gpu). They do the reference's
arithmetic in its order and rounding, so on a GPU the results agree to the last bit except
where a reduction's order or an exp differs (RMSNorm, SiLU): there within one unit in the
last place. The interpreter rounds fp32 to bf16 its own way (not to nearest), so in bf16 on
the CPU every comparison allows two units in the last place.
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from kernels import triton_kernels as tk  # noqa: E402
from kernels.layer_ops import TorchOps, apply_rope  # noqa: E402
from kernels.triton_ops import TritonOps  # noqa: E402

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not tk.INTERPRETED, reason="triton kernels were imported compiled: set TRITON_INTERPRET=1 first")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]
DTYPES = [torch.float32, torch.bfloat16]


def agree(a: torch.Tensor, b: torch.Tensor, exact: bool = False) -> bool:
    """Equal (exact) or within one unit in the last place of their dtype; two under the
    interpreter in bf16 (see the module's docstring)."""
    ulps = 2 if a.dtype == torch.bfloat16 and a.device.type == "cpu" else 0 if exact else 1
    eps = ulps * torch.finfo(a.dtype).eps
    return torch.allclose(a.float(), b.float(), rtol=eps, atol=eps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_h", [True, False])
def test_add_rms_norm(device, dtype, with_h):
    g = torch.Generator().manual_seed(0)
    residual = (torch.randn(5, 96, generator=g) * 3).to(device, dtype)
    h = torch.randn(5, 96, generator=g).to(device, dtype) if with_h else None
    weight = torch.randn(96, generator=g).to(device, dtype)
    ref_residual = residual.clone()
    ref = TorchOps().add_rms_norm(ref_residual, h, weight, 1e-5)
    out = TritonOps().add_rms_norm(residual, h, weight, 1e-5)
    assert agree(residual, ref_residual, exact=True)  # the sum is rounded to the dtype as add_ rounds it
    assert agree(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(device, dtype):
    gate_up = (torch.randn(3, 2 * 200, generator=torch.Generator().manual_seed(1)) * 4).to(device, dtype)
    ref = TorchOps().silu_mul(gate_up.clone())
    out = TritonOps().silu_mul(gate_up)
    assert out.shape == (3, 200) and agree(out, ref)


def rope_tables(positions: int, dim: int, dtype, device):
    """cos, signed_sin [positions, dim] as the model builds them (sin's first half negated)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.arange(positions).float()[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), dim=-1)
    sin = emb.sin()
    sin[:, :dim // 2].neg_()
    return emb.cos().to(device, dtype), sin.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 24])
def test_rope_store(device, dtype, dim):
    """q and k rotated in place as apply_rope does; k (rotated) and v land in their slots; a
    negative slot writes nothing; the rows of qkv are strided views (a fused projection)."""
    hq, hkv, t, pages, page_size = 4, 2, 4, 6, 4
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(t, (hq + 2 * hkv) * dim + 8, generator=g).to(device, dtype)
    qkv = wide[:, 8:]  # rows strided, each row contiguous
    positions = torch.tensor([0, 7, 3, 30], device=device)
    slots = torch.tensor([5, 9, -1, 22], device=device)
    cos, sin = rope_tables(32, dim, dtype, device)
    kv = torch.zeros(2, pages, page_size, hkv, dim, dtype=dtype, device=device)
    heads = qkv.reshape(t, -1, dim)
    expected = apply_rope(heads[:, :hq + hkv].clone(), cos[positions][:, None], sin[positions][:, None])
    v = heads[:, hq + hkv:].clone()
    TritonOps().rope_store(qkv, hq, hkv, positions, cos, sin, kv[0], kv[1], slots)
    assert agree(qkv.reshape(t, -1, dim)[:, :hq + hkv], expected, exact=True)
    assert torch.equal(qkv.reshape(t, -1, dim)[:, hq + hkv:], v)  # v is not rotated
    flat_k, flat_v = kv[0].view(-1, hkv, dim), kv[1].view(-1, hkv, dim)
    written = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    assert torch.equal(flat_k[slots[written]], qkv.reshape(t, -1, dim)[written, hq:hq + hkv])
    assert torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots[written].cpu()] = False
    assert flat_k[untouched.to(device)].eq(0).all() and flat_v[untouched.to(device)].eq(0).all()


def test_serving_greedy_identical_with_fused_ops(checkpoint):
    """The whole engine on a tiny Llama with the Triton backend (interpreter on the CPU): the
    fused ops (add + norm, SiLU-mul, rope + KV store from the position tables) stream exactly
    the greedy tokens of the torch ops."""
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine, token_ids
    from tests.test_model_parity import prompts

    def tokens(fused: bool) -> list[list[int]]:
        engine = small_engine(checkpoint("llama"), attention_backend="triton")
        model, calls = engine.runner.model, []
        if fused:
            model.ops, model.fused_kv = CountingOps(calls), True
        assert model.cos_table is not None
        try:
            params = SamplingParams(max_tokens=10, min_tokens=10)
            out = [token_ids(o) for o in collect(engine, prompts(3), params, timeout_s=600)]
        finally:
            engine.stop()
        assert set(calls) == ({"add_rms_norm", "silu_mul", "rope_store"} if fused else set())
        return out

    assert tokens(True) == tokens(False)


class CountingOps(TritonOps):
    """TritonOps that note each op they run."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def add_rms_norm(self, *args):
        self.calls.append("add_rms_norm")
        return super().add_rms_norm(*args)

    def silu_mul(self, *args):
        self.calls.append("silu_mul")
        return super().silu_mul(*args)

    def rope_store(self, *args):
        self.calls.append("rope_store")
        return super().rope_store(*args)
