"""python -m client.bench_openai: what the OpenAI-compatible service costs, side by side.

The same model, the same workload, alternately over Triton gRPC directly (genai-perf
--backend tensorrtllm, the chat template applied by the model) and through the service
(genai-perf --endpoint-type chat, the template applied by the service): prompts of the same
length (fresh ones each run, so that the prefix cache favours no run), forced output length,
greedy, streaming, after a warm-up run of each path. Prints, per round, output tok/s and TTFT
p50 of each path and their ratio, then the medians; writes bench_openai.json into --out.
With --service-pid, also the CPU time the service itself used per output token, a measure
of its cost that other load on the machine does not blur as much as throughput.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from client import bench_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
BIN = os.path.dirname(sys.executable)


def genai_perf_cmd(path: str, args, seed: int, run_dir: str) -> list[str]:
    n = args.requests or max(4, 2 * args.concurrency)
    cmd = [os.path.join(BIN, "genai-perf"), "profile", "-m", args.model, "--streaming",
           "--tokenizer", args.tokenizer, "--synthetic-input-tokens-mean", str(args.input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_tokens),
           "--output-tokens-stddev", "0", "--random-seed", str(seed), "--num-dataset-entries", str(n),
           "--request-count", str(n), "--warmup-request-count", "0", "--concurrency", str(args.concurrency),
           "--artifact-dir", run_dir, "--extra-inputs", "temperature:0.0"]
    if path == "grpc":
        return cmd + ["--backend", "tensorrtllm", "-u", args.grpc, "--output-tokens-mean-deterministic",
                      "--extra-inputs", "apply_chat_template:true"]
    # genai-perf sends max_tokens; min_tokens (vLLM's field) forces the length as min_length does.
    return cmd + ["--endpoint-type", "chat", "-u", args.openai, "--extra-inputs", f"min_tokens:{args.output_tokens}"]


def cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def _children_cpu() -> float:
    """CPU seconds of the finished child processes: genai-perf and its perf_analyzer, the load
    generator, which shares the machine's cores with the server it measures."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(path: str, args, seed: int, out_dir: str, round_: int) -> dict:
    run_dir = os.path.join(out_dir, f"round{round_}", path)
    os.makedirs(run_dir, exist_ok=True)
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}   # its perf_analyzer
    start, cpu, client = time.time(), cpu_seconds(args.service_pid), _children_cpu()
    with open(os.path.join(run_dir, "genai-perf.log"), "w") as log:
        proc = subprocess.run(genai_perf_cmd(path, args, seed, run_dir), cwd=run_dir, stdout=log,
                              stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"genai-perf ({path}) exited {proc.returncode}; log: {run_dir}/genai-perf.log")
    row = {"path": path, "round": round_, "seconds": round(time.time() - start, 1),
           "service_cpu_s": cpu_seconds(args.service_pid) - cpu, "client_cpu_s": _children_cpu() - client,
           **bench_report.summary(run_dir)}
    if row["osl"]["min"] < args.output_tokens * 0.9:
        raise RuntimeError(f"{path}: output lengths {row['osl']} are not the forced {args.output_tokens}")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.bench_openai", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc", default="localhost:8001", help="tritonserver gRPC (default %(default)s)")
    ap.add_argument("--openai", default="localhost:9000", help="the service, host:port (default %(default)s)")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both paths, alternating (default 3)")
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0, help="per run (default max(4, 2 x concurrency))")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="output dir (default artifacts/bench-openai-<time>)")
    ap.add_argument("--service-pid", type=int, default=None, help="the service's process, to read its CPU time")
    args = ap.parse_args(argv)
    out_dir = os.path.abspath(args.out or os.path.join(ROOT, "artifacts", time.strftime("bench-openai-%Y%m%d-%H%M%S")))
    rows = []
    # A short run of each path first: the engine's first forwards (kernels built on first use)
    # and each path's connections, outside the measurement.
    for path in ("grpc", "openai"):
        run(path, argparse.Namespace(**{**vars(args), "requests": args.concurrency}), seed=10_000,
            out_dir=out_dir, round_=-1)
    print(f"{'round':>5} {'path':>6} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} {'service CPU':>12} {'client CPU':>10}", flush=True)
    for r in range(args.rounds):
        # Which path goes first alternates, so a drift of the machine favours neither.
        for path in (("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")):
            # Fresh prompts for every run: no run finds another's prompts in the prefix cache.
            row = run(path, args, seed=2 * r + (path == "openai"), out_dir=out_dir, round_=r)
            rows.append(row)
            tokens = row["request_count"] * row["osl"]["avg"]
            row["service_us_per_token"] = row["service_cpu_s"] / tokens * 1e6
            print(f"{r:>5} {path:>6} {row['output_tok_s']:>8.1f} {row['ttft_ms']['p50']:>7.0f}ms "
                  f"{row['itl_ms']['p50']:>6.1f}ms {row['service_cpu_s']:>6.2f}s "
                  f"({row['service_us_per_token']:.0f} us/token) {row['client_cpu_s']:>8.1f}s", flush=True)
    ratios = [next(x for x in rows if x["round"] == r and x["path"] == "openai")["output_tok_s"] /
              next(x for x in rows if x["round"] == r and x["path"] == "grpc")["output_tok_s"] for r in range(args.rounds)]
    med = {p: statistics.median(x["output_tok_s"] for x in rows if x["path"] == p) for p in ("grpc", "openai")}
    print(f"openai / grpc output tok/s per round: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f} (medians: grpc {med['grpc']:.1f}, openai {med['openai']:.1f})")
    with open(os.path.join(out_dir, "bench_openai.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "ratios": ratios}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
