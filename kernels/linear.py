"""The matmul every projection of the model goes through, picked once per device and dtype.

`prepare` turns a checkpoint weight [out, in] into what the op reads; `__call__`
computes x @ weight.T (+ bias). On a CPU with AVX-512 or AVX2 in fp32 that is the panel GEMM of
csrc/panel_gemm.c (its header has the why and the numbers; csrc/panel_gemm_avx2.h its AVX2
form); elsewhere on a CPU it is oneDNN's inner product, and F.linear on a GPU. All of them are
full fp32: error against fp64 ~1e-6 relative. bf16 weights on a CPU with AVX-512 BF16 (or AVX2:
an AVX-512 CPU without its BF16 takes 16-lane forms with VNNI, the AVX2 ones without), and int8
weights (weights int8), are the same panel GEMM's bf16 and int8 forms under fp32 rows; from 8
rows the bf16 form runs on AMX tiles where the CPU has them (docs/cpu.md: what was measured
against oneDNN's bf16 inner product, prepacked or not, and torch's int8 weight-only matmul, row
count by row count).
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
# bf16 and int8: + the rows' scratch
SIGNATURES = {"panel_gemm_f32": ARGTYPES, "panel_gemm_bf16": (*ARGTYPES, _ptr), "panel_gemm_i8": (*ARGTYPES, _ptr),
              "panel_gemm_amx_ready": ()}


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


def pack_bf16(weight: torch.Tensor) -> PackedWeight:
    """[out, in] -> bf16 column panels [ceil(out / PANEL), ceil(in / 2), PANEL, 2]: k in pairs
    (vdpbf16ps's operand), zero-padded past `out` and an odd `in`; round to nearest even."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, -(-k // 2) * 2, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    return PackedWeight(padded.view(-1, PANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous(), n)


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
                raise RuntimeError("panel_gemm was built without AVX-512 or AVX2")
        y = y.view(*x.shape[:-1], weight.out_features)
        return y if bias is None else y.add_(bias)

    def runs_here(self) -> bool:
        """The library returns -1 where it was compiled without AVX-512 or AVX2."""
        x, w, y = torch.ones(1, 1), pack(torch.ones(1, 1)), torch.empty(1, 1)  # alive across the call
        return self._kernel(x.data_ptr(), 1, w.panels.data_ptr(), 1, 1, 1, y.data_ptr()) == 0


def panel_amx_min_rows(rows: int | None = None, int8: bool = False) -> int:
    """The row count from which the bf16 (or int8) panel GEMM runs on AMX tiles (csrc/panel_gemm.c;
    0: never): returned, then set to `rows` where given (client.bench_linear times each side of it)."""
    from kernels import cbuild

    name = "panel_amx_min_rows_i8" if int8 else "panel_amx_min_rows"
    value = ctypes.c_int.in_dll(cbuild.load("panel_gemm", SIGNATURES), name)
    shipped = value.value
    if rows is not None:
        value.value = rows
    return shipped


def panel_bf16_wide_min_rows(rows: int | None = None) -> int:
    """The row count from which a bf16 panel GEMM on a CPU with AVX-512 BF16 takes fp32 rows and its
    weights widened to fp32 FMAs instead of vdpbf16ps (csrc/panel_gemm.c; 0: never): measured once a
    process, returned, then set to `rows` where given, in every library holding the GEMM."""
    from kernels import cbuild

    return cbuild.shared_setting("panel_bf16_wide_min_rows", rows)


def scratch_words(rows: int, k: int) -> int:
    """int32 words of the bf16 and int8 GEMMs' scratch for `rows` rows of k: the rows in bf16 pairs,
    whole groups of 16 (AMX tiles read 16 rows), and int16 rows' scales (a row and group of 32 k)."""
    return -(-rows // 16) * 16 * -(-k // 2) + rows * -(-k // 32)


class Bf16PanelLinear:
    """bf16 weights, fp32 rows in and out: csrc/panel_gemm.c's panel_gemm_bf16. The model around
    it keeps its activations (and KV) in fp32: `activation_dtype`."""
    name = "panel-bf16"
    kind = 1  # csrc/decoder.c's weights kind
    activation_dtype = torch.float32
    function = "panel_gemm_bf16"

    def __init__(self):
        from kernels import cbuild

        self._library = cbuild.load("panel_gemm", SIGNATURES)
        self._kernel = getattr(self._library, self.function)

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        return pack_bf16(weight)

    def __call__(self, x, weight: PackedWeight, bias=None):
        x = x.float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.reshape(-1, x.shape[-1])
        m, k = rows.shape
        y = torch.empty((m, weight.out_features), dtype=torch.float32)
        if m:
            scratch = torch.empty(scratch_words(m, k), dtype=torch.int32)
            rc = self._kernel(rows.data_ptr(), rows.stride(0), weight.panels.data_ptr(), m, weight.out_features, k,
                              y.data_ptr(), scratch.data_ptr())
            if rc != 0:
                raise RuntimeError("panel_gemm was built without AVX-512 BF16 or AVX2 and FMA")
        y = y.view(*x.shape[:-1], weight.out_features)
        return y if bias is None else y.add_(bias)

    def amx_ready(self) -> bool:
        """Whether the tiles run here: the CPU has AMX and Linux grants this process its state."""
        return bool(self._library.panel_gemm_amx_ready())

    def runs_here(self) -> bool:
        x, y, s = torch.ones(1, 2), torch.empty(1, 1), torch.empty(scratch_words(1, 2), dtype=torch.int32)
        w = self.prepare(torch.ones(1, 2))
        return self._kernel(x.data_ptr(), 2, w.panels.data_ptr(), 1, 1, 2, y.data_ptr(), s.data_ptr()) == 0


INT8_GROUP = 32  # k per int8 scale (csrc/panel_gemm.c's GROUP2 pairs), as llama.cpp's Q8_0


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with a scale per row and group of INT8_GROUP k: (q [out, in padded to a
    whole group] as floats, scales [out, groups] fp16, as Q8_0's). s is the group's largest |w| /
    127 rounded up to fp16 (at least its smallest subnormal), and q = round(w / s), so no |q|
    passes 127 and the scale the kernel reads is the one q was made with."""
    n, k = weight.shape
    groups = -(-k // INT8_GROUP)
    w = torch.zeros(n, groups * INT8_GROUP, dtype=torch.float32)
    w[:, :k] = weight
    w = w.view(n, groups, INT8_GROUP)
    exact = w.abs().amax(dim=2) / 127
    scale = exact.to(torch.float16)
    bits = scale.view(torch.int16)  # positive fp16 in bit order: + 1 is the next one up
    scale = torch.where(scale.float() < exact, bits + 1, bits).clamp_(min=1).view(torch.float16)
    if not (torch.isfinite(exact).all() and torch.isfinite(scale).all()):
        raise ValueError("weights int8: a group of 32 weights has |w| too large for an fp16 scale (or not finite)")
    q = (w / scale.float()[:, :, None]).round_().clamp_(-127, 127)
    return q.view(n, -1), scale


def pack_int8(weight: torch.Tensor) -> PackedWeight:
    """int8_groups' q in pack_bf16's layout, then its fp16 scales [panels, groups, PANEL] (zero
    past `out`), in one byte buffer (panel_gemm_i8). One scale a group of 32 weights adds half
    a bit a weight, as Q8_0's: fp32 scales were 5.6 % more of a decode step's bytes."""
    return pack_int8_groups(*int8_groups(weight), weight.shape[1])


def pack_int8_groups(q: torch.Tensor, scale: torch.Tensor, k: int) -> PackedWeight:
    """pack_int8 from int8_groups' output for a weight of k columns."""
    n = q.shape[0]
    panels = pack_bf16(q[:, :-(-k // 2) * 2]).panels.to(torch.int8)  # integers of 7 bits: exact through bf16
    scales = torch.zeros(panels.shape[0] * PANEL, scale.shape[1], dtype=torch.float16)
    scales[:n] = scale
    scales = scales.view(panels.shape[0], PANEL, -1).transpose(1, 2).contiguous()
    return PackedWeight(torch.cat([panels.view(torch.uint8).flatten(), scales.view(torch.uint8).flatten()]), n)


class Int8PanelLinear(Bf16PanelLinear):
    """Symmetric int8 weights, a scale per 32 k of a column (weight-only), fp32 rows: panel_gemm_i8."""
    name = "panel-int8"
    kind = 2
    function = "panel_gemm_i8"

    def prepare(self, weight: torch.Tensor) -> PackedWeight:
        return pack_int8(weight)


def pick_linear(device: torch.device, dtype: torch.dtype, weights: str = "auto"):
    """dtype: the weights' (weights "int8": int8 instead). A linear with an `activation_dtype` wants
    the model's activations in that dtype instead (bf16 or int8 weights under fp32 rows)."""
    if weights == "int8":
        from kernels import cbuild

        panel = Int8PanelLinear() if device.type == "cpu" and cbuild.available("panel_gemm", SIGNATURES) else None
        if panel is None or not panel.runs_here():
            raise ValueError("weights int8 needs a CPU with AVX2 and FMA, or AVX-512 BF16 (the int8 panel GEMM)")
        return panel
    if device.type != "cpu":
        return TorchLinear()
    if dtype == torch.bfloat16:
        from kernels import cbuild

        if cbuild.available("panel_gemm", SIGNATURES):
            panel = Bf16PanelLinear()
            if panel.runs_here():
                return panel
    if dtype == torch.float32:
        from kernels import cbuild

        if cbuild.available("panel_gemm", SIGNATURES):
            panel = PanelLinear()
            if panel.runs_here():
                return panel
    # oneDNN has no fp16 inner product on CPUs without AVX-512-FP16, nor a bf16 one without AVX-512
    # (there its primitive fails at the first call; F.linear's own bf16 GEMM runs anywhere).
    onednn_bf16 = dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if (dtype == torch.float32 or onednn_bf16) and torch.backends.mkldnn.is_available():
        return OnednnLinear()
    return TorchLinear()
