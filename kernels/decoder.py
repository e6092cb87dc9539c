"""All decoder layers in one C call (csrc/decoder.c) where every op has a C kernel.

The model's per-op loop (backends.model) stays the reference and the path of GPUs,
other dtypes and models with a qkv bias or q/k norms. The prefill side of a hand-off
calls it once per layer group and posts the group's KV writes between calls. On a CPU
in fp32 with the panel GEMM (its fp32, bf16 or int8 weights: activations stay fp32, the KV
fp32 or bf16), the C layer ops and the paged attention kernel, this runs the same kernels in the
same order without the Python between them (see decoder.c for the why and the numbers).
"""
from __future__ import annotations

import ctypes

import torch

from kernels import cbuild
from kernels.linear import Bf16PanelLinear, Int8PanelLinear, PanelLinear, scratch_words

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class DecoderShape(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("rows", "hidden", "layers", "heads", "kv_heads", "dim", "inter",
                                          "page_size", "max_pages", "weights", "kv_bf16")] \
        + [("eps", _f32), ("scale", _f32)]


# shape, residual, weights, cos, signed_sin, kv, kv_layer_stride, v_offset, slots, pages, seqs, lens,
# x, qkv, attn, h, gate_up, act, xb
ARGTYPES = (ctypes.POINTER(DecoderShape), _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
            _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr)
SIGNATURES = {"decoder_layers_f32": ARGTYPES}


class CpuDecoder:
    """Built once per model from its prepared weights; call it once per forward."""

    def __init__(self, model):
        cfg = model.cfg
        self._kernel = cbuild.load("decoder", SIGNATURES).decoder_layers_f32
        self.cfg, self.scale = cfg, model.scale
        self.weights_kind = getattr(model.linear, "kind", 0)  # decoder.c's: 0 fp32, 1 bf16, 2 int8 panels
        # The weights' addresses, six a layer in the order decoder.c reads them; the model keeps them alive.
        self.weights = torch.tensor([t.data_ptr() for w in model.layers for t in (
            w.input_norm, w.qkv.panels, w.o_proj.panels, w.post_norm, w.gate_up.panels, w.down.panels)],
            dtype=torch.int64)

    def __call__(self, residual: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv: torch.Tensor,
                 plan, layers: range | None = None) -> torch.Tensor:
        """Runs `layers` (default all) on residual [T, hidden] (updated in place) with the K/V of
        `plan`'s rows (a kernels.cpu_backend.RowPlan); returns the last one's h [T, hidden], not yet
        added. A range that does not start at layer 0 takes a residual the caller has added the
        previous range's h to: the kernel's first layer adds nothing."""
        c, rows = self.cfg, residual.shape[0]
        layers = layers or range(c.num_layers)
        empty = lambda width: torch.empty((rows, width), dtype=torch.float32)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x, qkv, attn, h = empty(c.hidden_size), empty(q_size + 2 * kv_size), empty(q_size), empty(c.hidden_size)
        gate_up, act = empty(2 * c.intermediate_size), empty(c.intermediate_size)
        xb = torch.empty(scratch_words(rows, max(c.hidden_size, q_size, c.intermediate_size))
                         if self.weights_kind else 1, dtype=torch.int32)
        shape = DecoderShape(rows, c.hidden_size, len(layers), c.num_heads, c.num_kv_heads, c.head_dim,
                             c.intermediate_size, kv.shape[3], plan.pages.shape[1], self.weights_kind,
                             int(kv.dtype == torch.bfloat16), c.rms_norm_eps, self.scale)
        weights = self.weights.data_ptr() + layers.start * 6 * self.weights.element_size()
        kv_start = kv.data_ptr() + layers.start * kv.stride(0) * kv.element_size()
        rc = self._kernel(ctypes.byref(shape), residual.data_ptr(), weights, cos.data_ptr(),
                          signed_sin.data_ptr(), kv_start, kv.stride(0), kv.stride(1),
                          plan.meta.slot_mapping.data_ptr(), plan.pages.data_ptr(), plan.seqs.data_ptr(),
                          plan.lens.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), h.data_ptr(),
                          gate_up.data_ptr(), act.data_ptr(), xb.data_ptr())
        if rc == -2:
            raise MemoryError("paged attention: no memory for the scores buffer")
        if rc != 0:
            raise RuntimeError("decoder_layers_f32 was built without AVX-512 or AVX2 and FMA")
        return h


def pick_decoder(model, attn) -> CpuDecoder | None:
    """The one-call decoder where every op it runs is the C kernel the per-op loop would run."""
    from kernels.cpu_backend import CpuAttention
    from kernels.layer_ops import CpuOps
    cfg = model.cfg
    if not (isinstance(model.linear, (PanelLinear, Bf16PanelLinear, Int8PanelLinear)) and isinstance(model.ops, CpuOps)
            and isinstance(attn, CpuAttention)) or cfg.qkv_bias or cfg.qk_norm:
        return None
    if not cbuild.available("decoder", SIGNATURES):
        return None
    return CpuDecoder(model)
