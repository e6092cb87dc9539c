"""Micro-benchmark of the attention backends: `python -m kernels.bench`.

Times one layer's attention over paged KV, for a sweep of batch sizes and context
lengths, against torch SDPA over the same KV laid out contiguously ([B, Hkv, ctx, D],
`enable_gqa`): the best a paged kernel can hope for. Decode points report the K+V
bytes read per second (TB/s), extend points (512 new tokens, causal) TFLOP/s. Every
paged output is checked against SDPA's; the exit code is 1 if any check failed or a
backend raised.

Timing: calls run back to back between two CUDA events (one sync per measurement, not
per call), captured in one CUDA graph (as the engine's decode steps are), the median of 5
measurements; each call reads another copy of the KV when one copy would fit in L2, so
the figures are HBM bandwidth, not cache. The plan is built once per batch, outside the
timing, as the engine amortizes it over layers.

    --device cuda (default when available): bf16, 32 q heads, 8 KV heads, head dim
        128, page size 16; batch 1/16/64 x 1K/4K/16K (--quick) or more points.
    --device cpu: a small fp32 sweep (< 1 minute); the Triton kernels run too when
        TRITON_INTERPRET=1 (slowly), flashinfer never.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from kernels.base import AttentionMetadata
from kernels.torch_ref import TorchAttention

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
L2_DEFEAT_BYTES = 256 << 20  # several times an H100/H200 L2 (50-60 MB)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--quick", action="store_true", help="the issue's points only")
    p.add_argument("--max-tokens", type=int, default=4 << 20,
                   help="skip points whose batch * context exceeds this (memory)")
    return p.parse_args(argv)


def sweep(device: torch.device, quick: bool) -> dict:
    """Model shape and the (batch, context) points to run, decode and extend."""
    if device.type == "cuda":
        shape = dict(hq=32, hkv=8, dim=128, page_size=16)
        ctxs = [1024, 4096, 16384] if quick else [1024, 4096, 8192, 16384, 32768]
        batches = [1, 16, 64] if quick else [1, 4, 16, 64, 128, 256]
        ext = dict(q_len=512, batches=[1, 4] if quick else [1, 4, 16])
    else:
        shape = dict(hq=8, hkv=2, dim=64, page_size=16)
        ctxs = [256] if quick else [256, 1024]
        batches = [1, 4] if quick else [1, 4, 16]
        ext = dict(q_len=64, batches=[1, 4])
    return dict(shape=shape, ctxs=ctxs, batches=batches, ext=ext)


def paged_backends(device: torch.device) -> dict:
    """name -> paged backend instance, or the reason it is skipped."""
    found = {"torch-paged": TorchAttention()}
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


class Case:
    """`batch` sequences of `ctx` cached tokens (the last q_len of them new), their pages
    scattered over the pool; `copies` copies of one layer's KV, paged and contiguous."""

    def __init__(self, batch, q_len, ctx, shape, dtype, device, copies=1, seed=0):
        size, hkv, dim = shape["page_size"], shape["hkv"], shape["dim"]
        per_seq = math.ceil(ctx / size)
        g = torch.Generator().manual_seed(seed)
        pages = torch.randperm(batch * per_seq, generator=g).view(batch, per_seq)
        self.meta = AttentionMetadata.build([q_len] * batch, [ctx] * batch, pages.tolist(), size, device=device)
        self.q = torch.randn(batch * q_len, shape["hq"], dim, dtype=dtype, device=device)
        self.batch, self.q_len, self.ctx = batch, q_len, ctx
        self.paged, self.contiguous = [], []
        slots = (pages.to(device)[:, :, None] * size + torch.arange(size, device=device)).flatten(1)[:, :ctx]
        # [B, Hkv, ctx, D]: the same values, each sequence's positions in order
        lay = lambda c: c.flatten(0, 1)[slots].transpose(1, 2).contiguous()
        for _ in range(copies):
            k, v = (torch.randn(batch * per_seq, size, hkv, dim, dtype=dtype, device=device) for _ in range(2))
            self.paged.append((k, v))
            self.contiguous.append((lay(k), lay(v)))

    def kv_bytes(self) -> int:
        k = self.paged[0][0]
        return 2 * self.batch * self.ctx * k.shape[2] * k.shape[3] * k.element_size()

    def flops(self, hq: int, dim: int) -> float:
        """QK^T and PV over every causal (query, key) pair."""
        keys = sum(self.ctx - self.q_len + i + 1 for i in range(self.q_len))
        return 4.0 * self.batch * keys * hq * dim

    def sdpa(self, i: int, scale: float) -> torch.Tensor:
        """torch SDPA over copy i's contiguous KV: [T, Hq, D] like the paged backends."""
        k, v = self.contiguous[i]
        q = self.q.view(self.batch, self.q_len, *self.q.shape[1:]).transpose(1, 2)
        mask = None
        if self.q_len > 1:  # causal, aligned to the last position (the new tokens are the last ones)
            mask = torch.ones(self.q_len, self.ctx, dtype=torch.bool, device=q.device).tril(self.ctx - self.q_len)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(self.q.shape)


def copies_past_l2(batch: int, ctx: int, shape: dict, dtype: torch.dtype, device: torch.device) -> int:
    """How many copies of a point's KV (paged and contiguous) one measurement cycles through,
    so that no call finds its KV in L2 (one on the CPU)."""
    if device.type != "cuda":
        return 1
    per_copy = 4 * batch * ctx * shape["hkv"] * shape["dim"] * torch.finfo(dtype).bits // 8  # K, V; paged, contiguous
    return max(1, math.ceil(L2_DEFEAT_BYTES / per_copy))


def seconds_per_call(fn, copies: int, device: torch.device, repeats: int = 5, target_s: float = 0.02) -> float:
    """Median over `repeats` of (time of n back-to-back calls) / n, the copies in turn. On CUDA
    the n calls are captured in one CUDA graph and replayed, as the engine replays its decode
    steps, so that the figure is the kernels' and not Python's launch overhead; a call that
    cannot be captured is timed in an eager loop instead."""
    fn(0)
    fn(min(1, copies - 1))
    one = _measure(lambda: [fn(0)], device)
    n = max(copies, min(1000, math.ceil(target_s / max(one, 1e-7))))
    run = (_graphed(fn, n, copies) if device.type == "cuda" else None) or (lambda: [fn(i % copies) for i in range(n)])
    times = sorted(_measure(run, device) / n for _ in range(repeats))
    return times[len(times) // 2]


def _graphed(fn, n: int, copies: int):
    """graph.replay of n calls, or None when a call cannot be captured (a host sync)."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # first calls outside the capture, on its stream (torch's advice)
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for i in range(n):
                fn(i % copies)
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return graph.replay


def _measure(run, device: torch.device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def run_point(kind, batch, q_len, ctx, shape, dtype, device, found) -> tuple[str, bool]:
    """One table row, and whether every check passed."""
    copies = copies_past_l2(batch, ctx, shape, dtype, device)
    case = Case(batch, q_len, ctx, shape, dtype, device, copies=copies)
    scale = shape["dim"] ** -0.5
    rate = (lambda t: f"{case.kv_bytes() / t / 1e12:6.3f} TB/s") if kind == "decode" else \
           (lambda t: f"{case.flops(shape['hq'], shape['dim']) / t / 1e12:6.1f} TFLOP/s")
    ref = case.sdpa(0, scale).float()
    base = seconds_per_call(lambda i: case.sdpa(i, scale), copies, device)
    cols, ok = [f"sdpa-contig {base * 1e3:8.3f} ms {rate(base)}"], True
    tol = TOLERANCE[dtype] * max(1.0, ref.abs().max().item())
    for name, be in found.items():
        if isinstance(be, str):
            continue
        try:
            plan = be.plan(case.meta)
            call = lambda i: be.attend(case.q, *case.paged[i], plan, scale)
            diff = (call(0).float() - ref).abs().max().item()
            t = seconds_per_call(call, copies, device)
        except Exception as e:  # one failing backend (e.g. out of memory) must not end the sweep
            cols.append(f"{name}: FAIL {type(e).__name__}: {str(e)[:80]}")
            ok = False
            continue
        good = diff <= tol
        ok &= good
        cols.append(f"{name} {t * 1e3:8.3f} ms {rate(t)} {base / t:4.0%} diff {diff:.1e}"
                    + ("" if good else f" FAIL > {tol:.1e}"))
    return f"{kind:6s} B={batch:3d} ctx={ctx:6d} | " + " | ".join(cols), ok


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = sweep(device, args.quick)
    found = paged_backends(device)
    shape = cfg["shape"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, {dtype}, {shape}; one layer's attention per call; % = SDPA's time / the "
          f"backend's (contiguous KV is SDPA's best case); decode: K+V bytes read per second")
    for bname, be in found.items():
        if isinstance(be, str):
            print(f"  {bname}: {be}")
    points = [("decode", b, 1, c) for c in cfg["ctxs"] for b in cfg["batches"]]
    points += [("extend", b, cfg["ext"]["q_len"], c) for c in cfg["ctxs"] for b in cfg["ext"]["batches"]]
    failed = 0
    for kind, batch, q_len, ctx in points:
        if batch * ctx > args.max_tokens:
            print(f"{kind:6s} B={batch:3d} ctx={ctx:6d} skipped: over --max-tokens {args.max_tokens}")
            continue
        line, ok = run_point(kind, batch, q_len, ctx, shape, dtype, device, found)
        failed += not ok
        print(line, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the point's tensors are gone: give the next one room
    print(f"{failed} point(s) failed a check" if failed else "every paged output matches SDPA's")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
