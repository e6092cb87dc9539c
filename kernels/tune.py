"""Sweep the Triton attention kernels' tiles and launch shapes on a GPU: `python -m kernels.tune`.

Prints one row per configuration: decode in TB/s of K+V read, extend (512 new tokens,
causal) in TFLOP/s, at the points below, timed as kernels.bench times them (back-to-back
calls between CUDA events, KV copies cycled past L2). A '!' marks an output that differs
from SDPA's. The defaults in kernels/triton_backend.py come from this sweep (docs/kernels.md);
run it again on another GPU before changing them. --quick: the defaults against the former
ones, five repeats each, so one run separates them from the noise.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernels import bench
from kernels import triton_backend as tb
from kernels import triton_kernels as tk

SHAPE = dict(hq=32, hkv=8, dim=128, page_size=16)
DECODE_POINTS = [(1, 4096), (16, 4096), (64, 4096), (16, 16384), (64, 1024), (1, 16384)]
EXTEND_POINTS = [(1, 4096), (4, 4096), (1, 16384), (4, 1024)]
EXTEND_Q = 512


def make_case(batch: int, q_len: int, ctx: int) -> bench.Case:
    device = torch.device("cuda")
    return bench.Case(batch, q_len, ctx, SHAPE, torch.bfloat16, device,
                      copies=bench.copies_past_l2(batch, ctx, SHAPE, torch.bfloat16, device))


def rate(case: bench.Case, launch, figure, repeats: int) -> str:
    """figure(seconds) of one configuration at one point, '!' if its output is off."""
    out = torch.empty_like(case.q)
    call = lambda i: launch(case, *case.paged[i], out)
    try:
        t = bench.seconds_per_call(call, len(case.paged), torch.device("cuda"), repeats=repeats, target_s=0.01)
        call(0)
        off = (out.float() - case.sdpa(0, SHAPE["dim"] ** -0.5).float()).abs().max().item() > bench.TOLERANCE[torch.bfloat16]
        return f"{figure(t):6.2f}{'!' if off else ' '}"
    except Exception as e:  # a tile too large for shared memory fails its own row only
        return f"{type(e).__name__[:7]:>7s}"


def sweep_decode(configs, repeats: int) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = {p: make_case(p[0], 1, p[1]) for p in DECODE_POINTS}
    print("decode TB/s   block_n warps stages programs/SM | " + " | ".join(f"B{b}x{c}" for b, c in cases))
    for bn, warps, stages, per_sm in configs:
        def launch(c, k, v, out):
            m = c.meta
            splits = tk.decode_num_splits(c.batch, SHAPE["hkv"], c.ctx, bn, per_sm * sms)
            tk.paged_decode(c.q, k, v, m.page_table, m.seq_lens, m.decode_rows, m.decode_seqs, c.ctx,
                            SHAPE["dim"] ** -0.5, out, num_splits=splits, block_n=bn,
                            num_warps=warps, num_stages=stages)
        cols = [rate(c, launch, lambda t, c=c: c.kv_bytes() / t / 1e12, repeats) for c in cases.values()]
        print(f"decode {bn:3d} {warps} {stages} {per_sm:2d} | " + " | ".join(cols), flush=True)


def sweep_extend(configs, repeats: int) -> None:
    cases = {p: make_case(p[0], EXTEND_Q, p[1]) for p in EXTEND_POINTS}
    print("extend TFLOP/s   block_m block_n warps stages | " + " | ".join(f"B{b}x{c}" for b, c in cases))
    for bm, bn, warps, stages in configs:
        def launch(c, k, v, out):
            m = c.meta
            tk.paged_extend(c.q, k, v, m.page_table, m.seq_lens, m.cu_q, m.extend_seqs, c.q_len,
                            SHAPE["dim"] ** -0.5, out, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        figure = lambda t, c: c.flops(SHAPE["hq"], SHAPE["dim"]) / t / 1e12
        cols = [rate(c, launch, lambda t, c=c: figure(t, c), repeats) for c in cases.values()]
        print(f"extend {bm:3d} {bn:3d} {warps} {stages} | " + " | ".join(cols), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the defaults against the former ones only")
    args = ap.parse_args(argv)
    if args.quick:
        chosen = (tb.DECODE_BLOCK_N, tb.DECODE_WARPS, tb.DECODE_STAGES, tb.DECODE_PROGRAMS_PER_SM)
        sweep_decode([chosen, (32, 4, 3, 2)] * 2, repeats=5)
        chosen = (tb.EXTEND_BLOCK_M, tb.EXTEND_BLOCK_N, tb.EXTEND_WARPS, tb.EXTEND_STAGES)
        sweep_extend([chosen, (32, 32, 4, 3)] * 2, repeats=5)
        return
    sweep_decode(itertools.product([32, 64, 128], [4, 8], [1, 2, 3, 4], [2, 4, 8, 16]), repeats=3)
    sweep_extend(itertools.product([64, 128], [32, 64, 128], [4, 8], [1, 2, 3]), repeats=3)


if __name__ == "__main__":
    main()
