"""The matmul every projection of the model goes through, picked once per device and dtype.

`prepare` turns a checkpoint weight [out, in] into what the op reads; `__call__`
computes x @ weight.T (+ bias). On an AVX-512 CPU in fp32 that is the panel GEMM of
csrc/panel_gemm.c (its header has the why and the numbers); elsewhere on a CPU it is
oneDNN's inner product (AVX-512 by ISA on AMD, where MKL takes its AVX2 path), and
F.linear on a GPU. All of them are full fp32: error against fp64 ~1e-6 relative.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
PANEL = 48  # columns per packed panel; csrc/panel_gemm.c's PANEL
# x, ldx, packed weight, M, N, K, y
ARGTYPES = (_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr)
SIGNATURES = {"panel_gemm_f32": ARGTYPES}


class TorchLinear:
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def __call__(self, x, weight, bias=None):
        return F.linear(x, weight, bias)


class OnednnLinear(TorchLinear):
    name = "onednn"

    def __call__(self, x, weight, bias=None):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@dataclass
class PackedWeight:
    panels: torch.Tensor  # [ceil(out / PANEL), in, PANEL], zero-padded past `out_features`
    out_features: int


def pack(weight: torch.Tensor) -> PackedWeight:
    """[out, in] -> column panels of PANEL outputs, each [in, PANEL] contiguous."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = weight
    return PackedWeight(padded.view(-1, PANEL, k).transpose(1, 2).contiguous(), n)


class PanelLinear:
    name = "panel"

    def __init__(self):
        from kernels import cbuild

        self._kernel = cbuild.load("panel_gemm", SIGNATURES).panel_gemm_f32

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        return pack(weight.float())

    def __call__(self, x, weight: PackedWeight, bias=None):
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.reshape(-1, x.shape[-1])
        y = torch.empty((rows.shape[0], weight.out_features), dtype=torch.float32)
        if rows.shape[0]:
            rc = self._kernel(rows.data_ptr(), rows.stride(0), weight.panels.data_ptr(), rows.shape[0],
                              weight.out_features, rows.shape[1], y.data_ptr())
            if rc != 0:
                raise RuntimeError("panel_gemm was built without AVX-512")
        y = y.view(*x.shape[:-1], weight.out_features)
        return y if bias is None else y.add_(bias)

    def runs_here(self) -> bool:
        """The library returns -1 where it was compiled without AVX-512."""
        x, w, y = torch.ones(1, 1), pack(torch.ones(1, 1)), torch.empty(1, 1)  # alive across the call
        return self._kernel(x.data_ptr(), 1, w.panels.data_ptr(), 1, 1, 1, y.data_ptr()) == 0


def pick_linear(device: torch.device, dtype: torch.dtype):
    if device.type != "cpu":
        return TorchLinear()
    if dtype == torch.float32:
        from kernels import cbuild

        if cbuild.available("panel_gemm", SIGNATURES):
            panel = PanelLinear()
            if panel.runs_here():
                return panel
    if dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available():
        return OnednnLinear()  # oneDNN has no fp16 inner product on CPUs without AVX-512-FP16
    return TorchLinear()
