"""A model's forward in one C call (csrc/decoder.c) where every op has a C kernel: the embedding
rows, all decoder layers and the final norm.

The model's per-op loop (backends.model) stays the reference and the path of GPUs,
other dtypes and models with a qkv bias or q/k norms. With a layer hook (the prefill side of a
hand-off) a forward is one C call per layer group, the group's KV writes posted between them. On a CPU
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


class DecoderStep(ctypes.Structure):
    _fields_ = [("first", _i64), ("last", _i64), ("ids", _ptr), ("embed", _ptr), ("vocab", _i64),
                ("positions", _ptr), ("cos_table", _ptr), ("sin_table", _ptr), ("max_position", _i64),
                ("final_norm", _ptr), ("out_rows", _ptr), ("n_out", _i64), ("out", _ptr)]


# shape, step, residual, weights, kv, kv_layer_stride, v_offset, slots, pages, seqs, lens,
# cos, sin, x, qkv, attn, h, gate_up, act, xb
ARGTYPES = (ctypes.POINTER(DecoderShape), ctypes.POINTER(DecoderStep), _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr,
            _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr)
SIGNATURES = {"decoder_forward_f32": ARGTYPES}
ERRORS = {-1: (RuntimeError, "decoder_forward_f32 was built without AVX-512 or AVX2 and FMA"),
          -2: (MemoryError, "paged attention: no memory for the scores buffer"),
          -3: (IndexError, "a token id is outside the vocabulary"),
          -4: (IndexError, "a position is outside the rope tables"),
          -5: (IndexError, "an output row is outside the batch")}


class Workspace:
    """The call's buffers for up to `rows` rows, kept from one forward to the next (a step
    allocated nine a call); residual and h carry a forward's state between its calls."""

    def __init__(self, cfg, rows: int, weights_kind: int):
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        widths = dict(residual=cfg.hidden_size, h=cfg.hidden_size, cos=cfg.head_dim, sin=cfg.head_dim,
                      x=cfg.hidden_size, qkv=q_size + 2 * kv_size, attn=q_size, gate_up=2 * cfg.intermediate_size,
                      act=cfg.intermediate_size)
        self.rows, self.floats = rows, torch.empty(rows * sum(widths.values()), dtype=torch.float32)
        self.xb = torch.empty(scratch_words(rows, max(cfg.hidden_size, q_size, cfg.intermediate_size))
                              if weights_kind else 1, dtype=torch.int32)
        p, offset = {}, 0
        for name, width in widths.items():  # each a [rows, width] block of `floats`
            p[name] = self.floats[offset:].data_ptr()
            offset += rows * width
        self.residual = p["residual"]
        # decoder_forward_f32's cos .. xb arguments, in its order
        self.tail = (p["cos"], p["sin"], p["x"], p["qkv"], p["attn"], p["h"], p["gate_up"], p["act"],
                     self.xb.data_ptr())


class CpuDecoder:
    """Built once per model from its prepared weights; call it once per forward (one at a time:
    the calls of a forward share one workspace)."""

    def __init__(self, model):
        cfg = model.cfg
        self._kernel = cbuild.load("decoder", SIGNATURES).decoder_forward_f32
        self.cfg, self.scale = cfg, model.scale
        self.weights_kind = getattr(model.linear, "kind", 0)  # decoder.c's: 0 fp32, 1 bf16, 2 int8 panels
        # The weights' addresses, six a layer in the order decoder.c reads them; the model keeps them alive.
        self.weights = torch.tensor([t.data_ptr() for w in model.layers for t in (
            w.input_norm, w.qkv.panels, w.o_proj.panels, w.post_norm, w.gate_up.panels, w.down.panels)],
            dtype=torch.int64)
        self._shape = DecoderShape(0, cfg.hidden_size, 0, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.intermediate_size, 0, 0, self.weights_kind, 0, cfg.rms_norm_eps, self.scale)
        self._step = DecoderStep(0, cfg.num_layers, 0, model.embed.data_ptr(), model.embed.shape[0], 0, 0, 0, 0,
                                 model.norm.data_ptr(), 0, 0, 0)
        self._work: Workspace | None = None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                 kv: torch.Tensor, plan, out_rows: torch.Tensor, hook=None) -> torch.Tensor:
        """The forward of ids at positions [T] int64 with the K/V of `plan`'s rows (a
        kernels.cpu_backend.RowPlan), one call per run of layers between the stops of `hook`
        (a backends.model.LayerHook); returns the final norm of out_rows [n, hidden], the lm_head's
        input. cos_table, sin_table [positions, D]: the model's rope tables."""
        # the kernel reads int64 arrays in place (no copy, nor a torch call, where they already are)
        ids, positions, out_rows = (t if t.dtype == torch.int64 and t.is_contiguous()
                                    else t.to(torch.int64).contiguous() for t in (ids, positions, out_rows))
        rows, n = ids.shape[0], self.cfg.num_layers
        out = torch.empty((out_rows.shape[0], self.cfg.hidden_size), dtype=torch.float32)
        if rows == 0:
            return out
        if self._work is None or self._work.rows < rows:
            self._work = None  # its memory back before the larger one's
            self._work = Workspace(self.cfg, rows, self.weights_kind)
        shape, step = self._shape, self._step
        shape.rows, shape.page_size, shape.max_pages = rows, kv.shape[3], plan.pages.shape[1]
        shape.kv_bf16 = int(kv.dtype == torch.bfloat16)
        step.ids, step.positions, step.out_rows, step.n_out, step.out = \
            ids.data_ptr(), positions.data_ptr(), out_rows.data_ptr(), out_rows.shape[0], out.data_ptr()
        step.cos_table, step.sin_table, step.max_position = cos_table.data_ptr(), sin_table.data_ptr(), cos_table.shape[0]
        start = 0
        for end in sorted(set(hook.after if hook is not None else ()) | {n - 1}):
            self._layers(kv, plan, start, end + 1 - start)
            if hook is not None and end in hook.after:
                hook.run(end)
            start = end + 1
        return out

    def _layers(self, kv: torch.Tensor, plan, first: int, count: int) -> None:
        self._shape.layers, self._step.first = count, first
        weights = self.weights.data_ptr() + first * 6 * self.weights.element_size()
        kv_start = kv.data_ptr() + first * kv.stride(0) * kv.element_size()
        rc = self._kernel(ctypes.byref(self._shape), ctypes.byref(self._step), self._work.residual, weights,
                          kv_start, kv.stride(0), kv.stride(1), plan.meta.slot_mapping.data_ptr(),
                          plan.pages.data_ptr(), plan.seqs.data_ptr(), plan.lens.data_ptr(), *self._work.tail)
        if rc != 0:
            error, message = ERRORS.get(rc, (RuntimeError, f"decoder_forward_f32 returned {rc}"))
            raise error(message)


def team_max_rows(rows: int | None = None) -> int:
    """The row count up to which a call runs as one team (csrc/decoder.c's team form; 0: never):
    returned, then set to `rows` where given (the tests and A/B timings compare both forms)."""
    value = ctypes.c_int.in_dll(cbuild.load("decoder", SIGNATURES), "decoder_team_max_rows")
    shipped = value.value
    if rows is not None:
        value.value = rows
    return shipped


def team_test_stall(us: int) -> None:
    """Tests: the team's thread 1 sleeps `us` holding a gate_up panel, once a call (0: never)."""
    ctypes.c_int.in_dll(cbuild.load("decoder", SIGNATURES), "decoder_team_test_stall_us").value = us


def team_counts() -> tuple[int, int]:
    """Since the library was loaded: the items a team thread took over from another, and the
    results a thread dropped because another had taken its item over."""
    fn = cbuild.load("decoder", SIGNATURES).decoder_team_count
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int]
    return fn(0), fn(1)


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
