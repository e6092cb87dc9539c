"""The model's matmul ops (kernels.linear) against fp64, and which one a device gets."""
from __future__ import annotations

import pytest
import torch

from backends.config import cpu_flags, cpu_has_bf16
from kernels.linear import PANEL, OnednnLinear, PanelLinear, TorchLinear, pick_linear

FLAGS = cpu_flags()
HAS_PANEL = "avx512f" in FLAGS or {"avx2", "fma"} <= FLAGS
HAS_PANEL_BF16 = cpu_has_bf16()
needs_panel = pytest.mark.skipif(not HAS_PANEL, reason="panel GEMM needs AVX-512 or AVX2")


def check(op, x, weight, bias=None, tol=2e-6):
    ref = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    got = op(x, op.prepare(weight), bias)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert ref.numel() == 0 or ((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1)) < tol


@needs_panel
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 16, 17, 130])
@pytest.mark.parametrize("out_features", [1, PANEL - 1, PANEL, PANEL + 1, 200])
@pytest.mark.parametrize("in_features", [37, 150])  # one k block, and 64 + 64 + 22 (over 8 rows)
def test_panel_gemm_matches_fp64(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    check(PanelLinear(), x, w)


@needs_panel
def test_panel_gemm_rows_do_not_depend_on_the_batch():
    """Every output is one FMA chain over k in order, so a row's result is bit-identical
    alone and in a batch that k-blocks (a token's logits must not depend on its batch)."""
    g = torch.Generator().manual_seed(3)
    op, x = PanelLinear(), torch.randn(21, 200, generator=g)
    w = op.prepare(torch.randn(100, 200, generator=g))
    together = op(x, w)
    assert all(torch.equal(together[i], op(x[i:i + 1], w)[0]) for i in range(21))


@needs_panel
def test_panel_gemm_strided_batched_and_bias():
    """x as a view with a row stride (the SiLU-gated half of gate_up), a 3-D x, and a bias."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(100, 64, generator=g), torch.randn(100, generator=g)
    wide = torch.randn(9, 128, generator=g)
    check(PanelLinear(), wide[:, :64], w, b)
    op = PanelLinear()
    x3 = torch.randn(2, 5, 64, generator=g)
    torch.testing.assert_close(op(x3, op.prepare(w)), op(x3.reshape(10, 64), op.prepare(w)).view(2, 5, 100))
    check(PanelLinear(), wide[:, ::2], w)  # last stride 2: copied first


def test_onednn_and_torch_match_fp64():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(5, 70, generator=g), torch.randn(33, 70, generator=g), torch.randn(33, generator=g)
    check(OnednnLinear(), x, w, b)
    check(TorchLinear(), x, w, b)


def test_pick_linear():
    assert pick_linear(torch.device("cuda"), torch.float32).name == "torch"
    bf16_fallback = "onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch"
    assert pick_linear(torch.device("cpu"), torch.bfloat16).name == ("panel-bf16" if HAS_PANEL_BF16 else bf16_fallback)
    assert pick_linear(torch.device("cpu"), torch.float16).name == "torch"
    assert pick_linear(torch.device("cpu"), torch.float32).name == ("panel" if HAS_PANEL else "onednn")


def test_bf16_without_the_panel_gemm_runs(monkeypatch):
    """Where the panel GEMM does not build, bf16 goes to oneDNN only where oneDNN has a bf16 inner
    product (AVX-512): on an AVX2 CPU its primitive fails at the first call, which failed every
    request of a bf16 engine."""
    from kernels import cbuild

    monkeypatch.setattr(cbuild, "available", lambda *args: False)
    op = pick_linear(torch.device("cpu"), torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(20, 64, generator=g).bfloat16()
    torch.testing.assert_close(op(x, op.prepare(w)).float(), x.float() @ w.float().T, rtol=2e-2, atol=5e-2)
