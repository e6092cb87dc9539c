"""Micro-benchmark of the attention backends: `python -m kernels.bench`.

For a sweep of batch sizes and context lengths, times one layer's attend() (the
plan is built once per batch, outside the timing, as the engine amortizes it over
layers) for every available backend, and prints its ratio to the torch
reference (speedup: torch time / backend time), the KV bytes it read per second
and its largest deviation from the torch output.

    --device cuda (default when available): bf16, 32 q heads, 8 KV heads, head
        dim 128, page size 16, contexts 1K-32K, batch 1-256 (the issue's sweep;
        combinations above --max-tokens cached tokens are skipped for memory).
    --device cpu: a small sweep with the torch backend only (< 1 minute); triton
        runs too if TRITON_INTERPRET=1 is set (slowly), flashinfer never.
    --quick: fewer points.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import time

import torch

from kernels.base import AttentionMetadata
from kernels.torch_ref import TorchAttention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and contexts")
    p.add_argument("--max-tokens", type=int, default=4 << 20,
                   help="skip points whose batch * context exceeds this (memory)")
    return p.parse_args(argv)


def sweep(device: torch.device, quick: bool) -> dict:
    """Model shape and the (batch, context) points to run, decode and extend."""
    if device.type == "cuda":
        shape = dict(hq=32, hkv=8, dim=128, page_size=16)
        ctxs = [1024, 8192] if quick else [1024, 4096, 8192, 16384, 32768]
        batches = [1, 16, 64] if quick else [1, 4, 16, 64, 128, 256]
        ext = dict(q_len=512, batches=[1, 4] if quick else [1, 4, 16])
    else:
        shape = dict(hq=8, hkv=2, dim=64, page_size=16)
        ctxs = [256] if quick else [256, 1024]
        batches = [1, 4] if quick else [1, 4, 16]
        ext = dict(q_len=64, batches=[1, 4])
    return dict(shape=shape, ctxs=ctxs, batches=batches, ext=ext)


def backends(device: torch.device) -> dict:
    """name -> backend instance, or the reason it is skipped."""
    found = {"torch": TorchAttention()}
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from kernels.triton_backend import TritonAttention
        found["triton"] = TritonAttention()
    else:
        found["triton"] = "skipped: needs CUDA (or TRITON_INTERPRET=1, slow)"
    if device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None:
        from kernels.flashinfer_backend import FlashinferAttention
        found["flashinfer"] = FlashinferAttention(device)
    else:
        found["flashinfer"] = "skipped: needs CUDA and flashinfer"
    return found


def make_case(batch, q_len, ctx, shape, dtype, device, seed=0):
    """A batch of `batch` sequences with `ctx` cached tokens (the last q_len new),
    pages scattered at random over the pool, and one layer's q and K/V cache."""
    size = shape["page_size"]
    per_seq = math.ceil(ctx / size)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq).tolist()
    meta = AttentionMetadata.build([q_len] * batch, [ctx] * batch, pool, size, device=device)
    cache = (batch * per_seq, size, shape["hkv"], shape["dim"])
    k_cache = torch.randn(cache, dtype=dtype, device=device)
    v_cache = torch.randn(cache, dtype=dtype, device=device)
    q = torch.randn(batch * q_len, shape["hq"], shape["dim"], dtype=dtype, device=device)
    return meta, q, k_cache, v_cache


def time_fn(fn, device: torch.device, min_time=0.2, max_iters=50) -> float:
    """Median seconds per call after warm-up."""
    fn()
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_point(kind, batch, q_len, ctx, shape, dtype, device, found) -> str:
    meta, q, k_cache, v_cache = make_case(batch, q_len, ctx, shape, dtype, device)
    scale = shape["dim"] ** -0.5
    kv_bytes = 2 * batch * ctx * shape["hkv"] * shape["dim"] * k_cache.element_size()
    cols, ref_out, ref_time = [], None, None
    for name, be in found.items():
        if isinstance(be, str):
            continue
        try:
            plan = be.plan(meta)
            out = be.attend(q, k_cache, v_cache, plan, scale)
            t = time_fn(lambda: be.attend(q, k_cache, v_cache, plan, scale), device)
        except Exception as e:  # one failing backend (e.g. out of memory) must not end the sweep
            cols.append(f"{name}: {type(e).__name__}: {str(e)[:60]}")
            continue
        if ref_out is None:
            ref_out, ref_time = out.float(), t
        diff = (out.float() - ref_out).abs().max().item()
        cols.append(f"{name} {t * 1e3:8.3f} ms x{ref_time / t:5.2f} {kv_bytes / t / 1e9:7.1f} GB/s "
                    f"maxdiff {diff:.1e}")
    return f"{kind:6s} B={batch:4d} ctx={ctx:6d} q_len={q_len:4d} | " + " | ".join(cols)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = sweep(device, args.quick)
    found = backends(device)
    shape = cfg["shape"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, {dtype}, {shape}; times per layer attend(), x = speedup over torch, "
          f"GB/s = K+V bytes read / time")
    for bname, be in found.items():
        if isinstance(be, str):
            print(f"  {bname}: {be}")
    points = [("decode", b, 1, c) for c in cfg["ctxs"] for b in cfg["batches"]]
    points += [("extend", b, cfg["ext"]["q_len"], c) for c in cfg["ctxs"] for b in cfg["ext"]["batches"]]
    for kind, batch, q_len, ctx in points:
        if batch * ctx > args.max_tokens:
            print(f"{kind:6s} B={batch:4d} ctx={ctx:6d} skipped: over --max-tokens {args.max_tokens}")
            continue
        print(run_point(kind, batch, q_len, ctx, shape, dtype, device, found), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the point's tensors are gone: give the next one room


if __name__ == "__main__":
    main()
