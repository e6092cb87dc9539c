"""The CPU matmul options at one model's shapes: `python -m client.bench_linear`.

A decode step multiplies a few rows by every weight of the model, so each option runs
the matmuls of a whole step (every layer's qkv, o_proj, gate_up and down with that
layer's own weights, then the lm_head): the weight stream a step really reads, not one
matrix that stays in cache. On a 2-core machine that other processes share, a call whose
thread lost its core waits for it at OpenMP's barrier (tens of ms), so each call's best of
--repeat steps is summed (the step without the other processes), and the median whole step
is printed beside it; the per-shape columns split the former by matmul (all layers summed).

Options: the project's fp32 panel GEMM (kernels.linear.PanelLinear), oneDNN's fp32 inner
product (OnednnLinear), torch's bf16 F.linear, oneDNN's bf16 inner product unpacked and
prepacked (torch.ops.mkldnn._reorder_linear_weight for the row count, then
_linear_pointwise), the same prepacked product under fp32 rows, the project's bf16-weight
panel GEMM (Bf16PanelLinear) off the tiles alone (vdpbf16ps; with AVX2 alone, fp32 FMAs) and on
AMX tiles alone, its int8 form (Int8PanelLinear) on int16 rows (vpdpwssd; AVX2: vpmaddwd) alone and
on the tiles alone (the engine switches to
the tiles from csrc/panel_gemm.c's panel_amx_min_rows rows, _i8 for int8), and torch's weight-only int8
matmul (aten._weight_int8pack_mm, per-channel scales). Options that do not run on this CPU (AMX,
oneDNN's bf16 without AVX-512) are left out. The bf16 library rows take bf16
activations ready (a model held in bf16), except "fp32 rows", which rounds fp32 rows to bf16
and makes its bf16 output fp32 again (what this fp32-activation model would run); the panel
GEMMs take and give fp32 rows, their conversion included.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from backends.config import DEFAULT_MODEL_DIR
from backends.model_config import ModelConfig


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """matmul -> (out, in) of the model's fused projections."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return {"qkv": (qkv, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def options(rows: int) -> dict:
    """name -> (prepare(weight fp32) -> what the call reads, the activation dtype, call(x, w))."""
    from kernels.linear import Bf16PanelLinear, Int8PanelLinear, OnednnLinear, PanelLinear, panel_amx_min_rows

    panel, panel_bf16, panel_int8, onednn = PanelLinear(), Bf16PanelLinear(), Int8PanelLinear(), OnednnLinear()
    pointwise = torch.ops.mkldnn._linear_pointwise

    def tiles(linear, from_rows: int):
        """The panel GEMM with its AMX tiles from `from_rows` rows (0: never)."""
        int8 = linear.kind == 2

        def call(x, w):
            shipped = panel_amx_min_rows(from_rows, int8)
            try:
                return linear(x, w)
            finally:
                panel_amx_min_rows(shipped, int8)
        return call

    def int8(w):
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.bfloat16()

    amx = panel_bf16.runs_here() and panel_bf16.amx_ready()
    found = {
        "panel fp32 (hand-written)": (panel.prepare, torch.float32, panel),
        "oneDNN fp32": (onednn.prepare, torch.float32, onednn),
        "F.linear bf16": (lambda w: w.bfloat16(), torch.bfloat16, F.linear),
        "oneDNN bf16": (lambda w: w.bfloat16(), torch.bfloat16, lambda x, w: pointwise(x, w, None, "none", [], "")),
        "oneDNN bf16 prepacked": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), rows),
                                  torch.bfloat16, lambda x, w: pointwise(x, w, None, "none", [], "")),
        "oneDNN bf16 prepacked, fp32 rows": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), rows),
                                             torch.float32,
                                             lambda x, w: pointwise(x.bfloat16(), w, None, "none", [], "").float()),
        "panel bf16 weights, off the tiles (hand-written)": (panel_bf16.prepare, torch.float32, tiles(panel_bf16, 0)),
        "panel bf16 weights, AMX tiles (hand-written)": (panel_bf16.prepare, torch.float32, tiles(panel_bf16, 1)),
        "panel int8 weights, int16 rows (hand-written)": (panel_int8.prepare, torch.float32,
                                                                      tiles(panel_int8, 0)),
        "panel int8 weights, AMX tiles (hand-written)": (panel_int8.prepare, torch.float32, tiles(panel_int8, 1)),
        "torch int8 weight-only": (int8, torch.bfloat16, lambda x, w: torch.ops.aten._weight_int8pack_mm(x, *w)),
    }
    runs = {"panel fp32": panel.runs_here(), "panel bf16": panel_bf16.runs_here(), "panel int8": panel_int8.runs_here(),
            "AMX": amx, "oneDNN bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported()}
    return {label: option for label, option in found.items()
            if all(ok for part, ok in runs.items() if part in label)}


def step_times(cfg: ModelConfig, rows: int, repeat: int, only: list[str] | None) -> dict:
    gen = torch.Generator().manual_seed(0)
    dims = shapes(cfg)
    fp32 = [{name: torch.randn(out, inp, generator=gen) * inp ** -0.5 for name, (out, inp) in dims.items()
             if name != "lm_head"} for _ in range(cfg.num_layers)]
    head = torch.randn(*dims["lm_head"], generator=gen) * dims["lm_head"][1] ** -0.5
    results = {}
    for label, (prepare, act_dtype, call) in options(rows).items():
        if only and not any(o in label for o in only):
            continue
        layers = [{name: prepare(w) for name, w in layer.items()} for layer in fp32]
        packed_head = prepare(head)
        xs = {name: torch.randn(rows, inp, generator=gen).to(act_dtype) for name, (_, inp) in dims.items()}
        calls = [(name, w) for layer in layers for name, w in layer.items()] + [("lm_head", packed_head)]
        times = torch.zeros(repeat, len(calls), dtype=torch.float64)
        steps = []
        for i in range(repeat + 2):
            start = time.perf_counter()
            for j, (name, w) in enumerate(calls):
                t = time.perf_counter()
                call(xs[name], w)
                if i >= 2:  # two warm-up steps
                    times[i - 2, j] = time.perf_counter() - t
            if i >= 2:
                steps.append(time.perf_counter() - start)
        best = times.min(dim=0).values  # each call's best: the step without the other processes' slices
        results[label] = {"step_ms": 1e3 * statistics.median(steps), "best_ms": 1e3 * best.sum().item(),
                          **{name: 1e3 * sum(b for (n, _), b in zip(calls, best.tolist()) if n == name)
                             for name in dims}}
        del layers, packed_head
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--only", default="", help="comma-separated substrings of the option names")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    cfg = ModelConfig.load(args.model)
    only = [o for o in args.only.split(",") if o]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shapes (out, in): {shapes(cfg)}")
    everything = {}
    for rows in map(int, args.rows.split(",")):
        res = step_times(cfg, rows, args.repeat, only)
        everything[rows] = res
        base = res.get("panel fp32 (hand-written)", {}).get("best_ms")
        print(f"\nM = {rows}: ms per step's matmuls, each call's best of {args.repeat} summed (the median "
              "whole step beside it)")
        print("| option | step (best calls) | " + " | ".join(shapes(cfg)) + " | vs panel fp32 | step (median) |")
        print("|---|---|" + "---|" * len(shapes(cfg)) + "---|---|")
        for label, r in res.items():
            ratio = f"{base / r['best_ms']:.2f}x" if base else ""
            print(f"| {label} | {r['best_ms']:.2f} | " + " | ".join(f"{r[n]:.2f}" for n in shapes(cfg))
                  + f" | {ratio} | {r['step_ms']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
