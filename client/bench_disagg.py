"""python -m client.bench_disagg: the KV hand-off measured without Triton in the way.

For each prompt length and pipeline mode (layer-pipelined writes vs one write
after the forward), a prefill and a decode engine in this process (real NIXL
transports) serve the same prompts; printed side by side from one run:
time to the first token at prefill (what the router streams first), time until
decode holds the KV and emits that token (TTFT of the decode stream), KV bytes
moved per request, the bandwidth the writes achieved, and raw NIXL bandwidth
measured by `backends.disagg.transport` in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

from backends.config import DEFAULT_MODEL_DIR
from backends.disagg.local import Pair
from backends.disagg.transport import bench as raw_bench
from backends.request import SamplingParams


def measure(pair: Pair, length: int, repeats: int) -> dict:
    params = SamplingParams(max_tokens=1)
    rows = []
    for r in range(repeats):
        ids = [1000 + (7 * i + 13 * r) % 30000 for i in range(length)]
        before = pair.prefill.stats()
        start = time.perf_counter()
        _, d, p = pair.submit(ids, params)
        first_prefill = p.get(timeout=600)
        t_prefill = time.perf_counter() - start
        first_decode = d.get(timeout=600)
        t_decode = time.perf_counter() - start
        assert first_decode.error is None and first_prefill.error is None, (first_decode.error, first_prefill.error)
        while not (p.get(timeout=60).finished if not first_prefill.finished else True):
            pass
        after = pair.prefill.stats()
        rows.append((t_prefill, t_decode, after["kv_bytes_sent"] - before["kv_bytes_sent"],
                     after["kv_write_seconds"] - before["kv_write_seconds"]))
    med = lambda i: statistics.median(row[i] for row in rows)
    return {"first_token_prefill_s": med(0), "ttft_decode_s": med(1), "bytes": med(2),
            "write_gbps": med(2) / med(3) / 1e9 if med(3) else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m client.bench_disagg", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=0, help="fixed layers per group (0 = adaptive)")
    args = ap.parse_args(argv)
    engine = dict(page_size=16, num_pages=(max(args.lengths) // 16 + 8) * 2, max_context=max(args.lengths) + 16,
                  chunk_size=512, max_batch_tokens=512, max_running_requests=4, threads=0)
    results = {}
    for mode in ("auto", "off"):
        pair = Pair(args.model, engine_overrides=engine, pipeline=mode, pipeline_group_size=args.group_size,
                    transfer_timeout_s=600)
        try:
            measure(pair, 64, 1)  # warm-up
            for length in args.lengths:
                results[(mode, length)] = measure(pair, length, args.repeats)
                print(f"  measured pipeline={mode} {length} tokens: {results[(mode, length)]}", flush=True)
        finally:
            pair.close()
    raw = raw_bench(mb=64)
    print(f"\nmedian of {args.repeats}; model {args.model}")
    print(f"{'prompt':>7} {'pipeline':>8} {'1st tok @prefill':>17} {'TTFT @decode':>13} {'KV MB/req':>10} "
          f"{'write GB/s':>10}")
    for (mode, length), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{length:>7} {mode:>8} {r['first_token_prefill_s']:>16.3f}s {r['ttft_decode_s']:>12.3f}s "
              f"{r['bytes'] / 1e6:>10.2f} {r['write_gbps']:>10.2f}")
    for length in args.lengths:
        on, off = results[("auto", length)], results[("off", length)]
        print(f"TTFT at decode, pipelined / not, {length} tokens: {on['ttft_decode_s'] / off['ttft_decode_s']:.2f}x")
    print("raw NIXL WRITE (same run):", {k: round(v.get("gbps", 0), 2) for k, v in raw.items() if isinstance(v, dict)})


if __name__ == "__main__":
    main()
