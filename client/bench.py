"""python -m client.bench: one load tool for Tandem and its peers.

Drives genai-perf 0.0.16 (the load generator Triton users run) through a sweep of
concurrency levels (or request rates) with the same workload for every target:
the same synthetic prompts (same seed), the same forced output length, greedy,
streaming. Targets:

  --target llm=grpc://localhost:8001            a Tandem model over Triton gRPC
  --target router=grpc://localhost:8001         (the model name is the target's name,
  --target dis=grpc://host:8001/router           or the URL's path)
  --target llamacpp=http://localhost:8013/smol  an OpenAI-compatible /v1/completions
                                                 server; the path is its model name
  --target pen=grpc://localhost:8001/llm?repetition_penalty=1.2
                                                the query: extra request inputs of the target
                                                (genai-perf --extra-inputs), e.g. penalties

Prints one table, writes bench.json and PNG plots into --out, and for Tandem
targets checks that the output tokens genai-perf counted (by re-tokenizing the
streamed text) equal the tokens the server reports (num_output_tokens, output_ids).
Exit code: 0 ok, 1 a run failed, 3 token counts differ.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from client import bench_report, cpu_times
from client.stream import stream_generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENIZER = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
BIN = os.path.dirname(sys.executable)


@dataclass(frozen=True)
class Target:
    name: str
    kind: str    # "triton" (Tandem over gRPC) | "openai" (/v1/completions)
    url: str     # host:port for gRPC, http://host:port for OpenAI
    model: str
    extra: tuple[tuple[str, str], ...] = ()   # genai-perf --extra-inputs of every request


@dataclass(frozen=True)
class Workload:
    input_tokens: int
    output_tokens: int
    tokenizer: str
    seed: int
    warmup: int
    requests: int           # per level; 0 = max(4, 2 x level)
    triton_backend: str     # genai-perf --backend for Tandem targets
    timeout_s: float
    prefix_prompts: int = 0   # genai-perf's shared-prefix workload: this many prefixes, one before each prompt
    prefix_length: int = 0    # tokens of each prefix


def parse_target(spec: str) -> Target:
    """NAME=grpc://HOST:PORT[/MODEL][?KEY=VALUE&...] | NAME=http://HOST:PORT[/MODEL][?...] | NAME
    (= grpc://localhost:8001)."""
    name, _, url = spec.partition("=")
    parts = urllib.parse.urlsplit(url or "grpc://localhost:8001")
    if not name or parts.scheme not in ("grpc", "http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"bad target {spec!r}: want NAME=grpc://HOST:PORT[/MODEL] "
                                         "or NAME=http://HOST:PORT[/MODEL]")
    model = parts.path.strip("/") or name
    extra = tuple(urllib.parse.parse_qsl(parts.query, strict_parsing=bool(parts.query)))
    if parts.scheme == "grpc":
        return Target(name, "triton", parts.netloc, model, extra)
    return Target(name, "openai", f"{parts.scheme}://{parts.netloc}", model, extra)


def request_count(w: Workload, level: float) -> int:
    return w.requests or max(4, math.ceil(2 * level))


def genai_perf_cmd(t: Target, mode: str, level: float, w: Workload, seed: int, run_dir: str) -> list[str]:
    n = request_count(w, level)
    cmd = [os.path.join(BIN, "genai-perf"), "profile", "-m", t.model, "--streaming",
           "--tokenizer", w.tokenizer, "--synthetic-input-tokens-mean", str(w.input_tokens),
           "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(w.output_tokens),
           "--output-tokens-stddev", "0", "--random-seed", str(seed),
           # One prompt per request: no server sees a prompt twice (llama.cpp caches prompts).
           "--num-dataset-entries", str(n), "--request-count", str(n),
           # perf_analyzer 2.51 never stops when it warms up a streaming model (it keeps
           # sending requests): warm-up is client.bench's own, see warm_up().
           "--warmup-request-count", "0", "--artifact-dir", run_dir,
           f"--{mode.replace('_', '-')}", _fmt(level)]
    if w.prefix_prompts:
        cmd += ["--num-prefix-prompts", str(w.prefix_prompts), "--prefix-prompt-length", str(w.prefix_length)]
    if t.kind == "triton":
        # --output-tokens-mean-deterministic sends min_length (TensorRT-LLM) / min_tokens (vLLM).
        cmd += ["--backend", w.triton_backend, "-u", t.url, "--output-tokens-mean-deterministic",
                "--extra-inputs", "temperature:0.0"]
    else:
        # genai-perf forces a length only for Triton; OpenAI peers take these request fields.
        # One connection per request: llama-server answers HTTP 400 to a request perf_analyzer
        # 2.51 sends on a reused streaming connection (each body passes alone or with this).
        cmd += ["--endpoint-type", "completions", "-u", t.url, "--extra-inputs", "temperature:0.0",
                "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{w.output_tokens}",
                "--header", "Connection:close"]
    for key, value in t.extra:
        cmd += ["--extra-inputs", f"{key}:{value}"]
    return cmd


def warm_up(t: Target, w: Workload) -> str | None:
    """`w.warmup` requests at once, with the run's output length, before a target's first
    level; returns an error if the target does not answer."""
    prompt = "Warm up: say something about the weather. " * 8
    one = (lambda _: _triton_once(t, prompt, w.output_tokens)) if t.kind == "triton" else (
        lambda _: _openai_once(t, prompt, w.output_tokens))
    try:
        with ThreadPoolExecutor(max_workers=max(1, w.warmup)) as pool:
            errors = [e for e in pool.map(one, range(w.warmup)) if e]
    except Exception as exc:  # connection refused, timeout
        return f"{t.name} at {t.url} does not answer: {exc}"
    return f"{t.name} warm-up failed: {errors[0]}" if errors else None


def _triton_once(t: Target, prompt: str, max_tokens: int) -> str | None:
    return stream_generate(t.url, t.model, prompt, max_tokens=max_tokens, temperature=0.0).error


def _openai_once(t: Target, prompt: str, max_tokens: int) -> str | None:
    body = json.dumps({"model": t.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"{t.url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return None if resp.status == 200 else f"HTTP {resp.status}"


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


EXPORT_RERUNS = 2  # more runs of a level whose export perf_analyzer cut short (run_level)


def run_level(t: Target, mode: str, level: float, w: Workload, seed: int, run_dir: str,
              progress: "Progress") -> dict:
    """One genai-perf run; returns its row for the table (with `error` set if it failed). Run
    again, up to EXPORT_RERUNS times, when genai-perf found perf_analyzer's export cut short:
    perf_analyzer 2.51 records an output a response lacks (a logprob output nobody asked for) from
    memory it never wrote, a float of it that reads as NaN stops its JSON writer, and it exits 0
    with profile_export.json empty or ending at a 64 KiB flush (1 run in ~20 here; twice in a row
    for 2 of some 40 levels on one day). Asking for the logprobs would avoid it at the cost of
    computing them; a rerun is a new measurement, and the row says so. It gets new prompts (the
    next seeds; levels are 1000 apart): the first run left its prompts in the server's prefix
    cache, and the same prompts again measured the cache (Tandem int8 at one stream, TTFT p50 22 ms
    against 109-115 ms without a rerun, docs/cpu.md session 44)."""
    row = _run_level_once(t, mode, level, w, seed, run_dir, progress)
    for rerun in range(1, EXPORT_RERUNS + 1):
        if not (row["error"] and _export_cut_short(run_dir)):
            break
        shutil.rmtree(run_dir)
        row = {**_run_level_once(t, mode, level, w, seed + rerun, run_dir, progress), "rerun": "export cut short"}
    return row


def _export_cut_short(run_dir: str) -> bool:
    try:
        with open(os.path.join(run_dir, "genai-perf.log"), errors="replace") as f:
            return "JSONDecodeError" in f.read()
    except OSError:
        return False


def _run_level_once(t: Target, mode: str, level: float, w: Workload, seed: int, run_dir: str,
                    progress: "Progress") -> dict:
    os.makedirs(run_dir, exist_ok=True)
    log_path = os.path.join(run_dir, "genai-perf.log")
    # genai-perf runs the perf_analyzer it finds on PATH: the venv's wrapper.
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    row = {**base_row(t, mode, level, w), "run_dir": run_dir, "error": None}
    start, cpu = time.time(), cpu_times.read()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(genai_perf_cmd(t, mode, level, w, seed, run_dir), cwd=run_dir,
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            if time.time() - start > w.timeout_s:
                proc.kill()
                proc.wait()
                break
            progress.tick(_phase(log_path), time.time() - start)
            time.sleep(1)
    row["seconds"] = round(time.time() - start, 1)
    row["steal"] = cpu_times.read().share_stolen_since(cpu)
    if proc.returncode != 0:
        row["error"] = f"genai-perf exited {proc.returncode}; log: {log_path}\n" + _tail(log_path)
        return row
    try:
        row.update(bench_report.summary(run_dir))
    except (OSError, KeyError, ValueError) as exc:
        row["error"] = f"no usable genai-perf export in {run_dir}: {exc}"
    return row


def base_row(t: Target, mode: str, level: float, w: Workload) -> dict:
    # Each row carries its workload, so that merged results stay self-describing.
    return {"target": t.name, "kind": t.kind, "url": t.url, "model": t.model, "extra": dict(t.extra), "mode": mode,
            "level": level, "requests": request_count(w, level),
            "workload": {"input_tokens": w.input_tokens, "output_tokens": w.output_tokens, "seed": w.seed,
                         "prefix_prompts": w.prefix_prompts, "prefix_length": w.prefix_length}}


def _phase(log_path: str) -> str:
    """What genai-perf is doing, from its log: preparing prompts, measuring, or exporting."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "starting"
    if "Generating" in text or "Request Count" in text or "Statistic" in text:
        return "exporting"
    return "measuring" if "Running Perf Analyzer" in text else "preparing prompts"


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


class Progress:
    """One status line per run; redrawn in place on a terminal, plain lines otherwise."""

    def __init__(self, total: int):
        self.total, self.index, self.label = total, 0, ""
        self.tty = sys.stderr.isatty()
        self.last_phase = ""

    def begin(self, label: str) -> None:
        self.index += 1
        self.label, self.last_phase = f"[{self.index}/{self.total}] {label}", ""

    def tick(self, phase: str, elapsed: float) -> None:
        if self.tty:
            sys.stderr.write(f"\r\033[K{self.label}: {phase} {elapsed:.0f}s")
            sys.stderr.flush()
        elif phase != self.last_phase:
            print(f"{self.label}: {phase} ({elapsed:.0f}s)", file=sys.stderr, flush=True)
        self.last_phase = phase

    def end(self, row: dict) -> None:
        prefix = "\r\033[K" if self.tty else ""
        if row["error"]:
            msg = "FAILED: " + row["error"].splitlines()[0]
        else:
            msg = (f"{row['output_tok_s']:.1f} tok/s, {row['requests_s']:.2f} req/s, "
                   f"TTFT p50 {row['ttft_ms']['p50']:.0f} ms, ITL p50 {row['itl_ms']['p50']:.1f} ms")
        again = f", run again: {row['rerun']}" if row.get("rerun") else ""
        print(f"{prefix}{self.label}: {msg} ({row['seconds']:.0f}s{again})", file=sys.stderr, flush=True)


def sweep(targets: list[Target], mode: str, levels: list[float], w: Workload, out_dir: str,
          check_tokens: bool) -> list[dict]:
    progress = Progress(len(targets) * len(levels))
    counter = bench_report.TokenCounter(w.tokenizer) if check_tokens else None
    rows = []
    for t in targets:
        if w.warmup:
            print(f"warming up {t.name} ({w.warmup} requests at once)", file=sys.stderr, flush=True)
        error = warm_up(t, w) if w.warmup else None
        for i, level in enumerate(levels):
            progress.begin(f"{t.name} {mode}={_fmt(level)} ({request_count(w, level)} requests)")
            run_dir = os.path.join(out_dir, "runs", t.name, f"{mode}{_fmt(level)}")
            # Per level a different seed (fresh prompts), per target the same (same workload).
            if error:  # the target is down: no point in waiting for genai-perf
                row = {**base_row(t, mode, level, w), "error": error, "seconds": 0}
            else:
                row = run_level(t, mode, level, w, w.seed + 1000 * i, run_dir, progress)
            if counter and t.kind == "triton" and not row["error"]:
                row["tokens"] = tokens = counter.check(run_dir)
                # Throughput by the server's own token count (genai-perf's re-count can be lower).
                if tokens["client_total"]:
                    row["output_tok_s_server"] = row["output_tok_s"] * tokens["server_total"] / tokens["client_total"]
            progress.end(row)
            rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", action="append", type=parse_target, default=[],
                    help="NAME=grpc://HOST:PORT[/MODEL] or NAME=http://HOST:PORT[/MODEL] (repeatable)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=float, nargs="+", help="concurrency levels (default 1 8 16)")
    load.add_argument("--request-rate", type=float, nargs="+", help="request rates per second, instead")
    ap.add_argument("--input-tokens", type=int, default=128, help="prompt tokens, stddev 0 (default %(default)s)")
    ap.add_argument("--output-tokens", type=int, default=128, help="forced output tokens (default %(default)s)")
    ap.add_argument("--num-prefix-prompts", type=int, default=0,
                    help="genai-perf's shared-prefix workload: prefixes to pick from, one put before each prompt "
                         "(default 0: none)")
    ap.add_argument("--prefix-prompt-length", type=int, default=0, help="tokens of each prefix")
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(4, 2 x level))")
    ap.add_argument("--warmup", type=int, default=2,
                    help="warm-up requests at once before a target's first level (default %(default)s)")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="local tokenizer dir (default: default model)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default %(default)s)")
    ap.add_argument("--triton-backend", choices=["tensorrtllm", "vllm"], default="tensorrtllm",
                    help="tensor interface genai-perf uses for Tandem targets (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run (default %(default)s)")
    ap.add_argument("--out", default=None, help="output dir (default artifacts/bench-<time>)")
    ap.add_argument("--merge", action="append", default=[], metavar="BENCH_JSON",
                    help="add the results of an earlier bench.json to the table and plots (repeatable)")
    ap.add_argument("--rounds", nargs="+", metavar="BENCH_JSON",
                    help="only print the median and range over these reports of each Tandem target's (llm, llm-bf16, ...) ratios to the others")
    ap.add_argument("--no-token-check", dest="check_tokens", action="store_false",
                    help="skip the client-vs-server output token comparison")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds:
        print(bench_report.rounds_table(args.rounds))
        return 0
    if not args.target and not args.merge:
        build_parser().error("give at least one --target (or --merge)")
    mode = "request_rate" if args.request_rate else "concurrency"
    levels = args.request_rate or args.concurrency or [1, 8, 16]
    w = Workload(args.input_tokens, args.output_tokens, os.path.abspath(args.tokenizer), args.seed,
                 args.warmup, args.requests, args.triton_backend, args.timeout, args.num_prefix_prompts,
                 args.prefix_prompt_length)
    out_dir = os.path.abspath(args.out or os.path.join(ROOT, "artifacts", time.strftime("bench-%Y%m%d-%H%M%S")))
    os.makedirs(out_dir, exist_ok=True)
    rows = sweep(args.target, mode, levels, w, out_dir, args.check_tokens) if args.target else []
    rows = bench_report.merge(rows, args.merge)
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "workload": asdict(w) if args.target else None,
              "merged": [os.path.abspath(p) for p in args.merge],
              "targets": [asdict(t) for t in args.target], "results": rows}
    return bench_report.write(report, out_dir)


if __name__ == "__main__":
    sys.exit(main())
