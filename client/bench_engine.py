"""In-process engine benchmark: the Engine with no Triton in front of it.

    python -m client.bench_engine --streams 1 8 16 --prompt-tokens 128 --output-tokens 128 [--with-hf]

Closed loop per level: C streams, each starts its next request as soon as the
previous one ends (4 requests at 1 stream, 2*C otherwise, as the peers'
bench_stream.py; --requests N sets N per level, as client.bench's). Every
request is a distinct window of Python stdlib source tokens, greedy, exactly
--output-tokens tokens (ignore_eos, min_tokens).
Per repetition: output tok/s = output tokens / wall (first submit -> last
token), TTFT (submit -> first token), ITL per request ((last - first token) /
(tokens - 1), as genai-perf computes it). The median over repetitions is
printed per level, with the CPU share other processes took during the runs
(this machine is shared) and the share a VM's hypervisor took (steal). With
--out DIR, the repetition closest to that median is also written as
client.bench rows (target `engine`: bench.json, table.txt, plots), so
`client.bench --merge` puts the engine beside the same engine behind
tritonserver and prints the ratios.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import threading
import time

import numpy as np

from backends.config import EngineConfig
from backends.engine import Engine
from backends.request import RequestOutput, SamplingParams
from client import cpu_times

STDLIB = "/usr/lib/python3.11"


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct token windows of stdlib source (past each file's header)."""
    files = sorted(f for f in glob.glob(f"{STDLIB}/**/*.py", recursive=True) if "/test" not in f)
    out = []
    for path in files:
        try:
            ids = tokenizer(open(path, encoding="utf-8").read(), add_special_tokens=False).input_ids
        except (OSError, UnicodeDecodeError):
            continue
        out += [ids[s:s + length] for s in range(512, len(ids) - length, 4 * length)][:3]
        if len(out) >= n:
            return out[:n]
    raise RuntimeError(f"only {len(out)} prompts of {length} tokens in {STDLIB}")


class Stream:
    """One request's timestamps, filled by the engine thread."""

    def __init__(self, on_done):
        self.t0 = time.perf_counter()
        self.stamps: list[float] = []
        self.tokens = 0
        self.ids: list[int] = []
        self.error: str | None = None
        self.on_done = on_done

    def __call__(self, out: RequestOutput) -> None:
        if out.token_ids:
            self.stamps.append(time.perf_counter())
            self.tokens += len(out.token_ids)
            self.ids.extend(out.token_ids)
        self.error = self.error or out.error
        if out.finished or out.error:
            self.on_done(self)


def own_ticks() -> int:
    st = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    return int(st[11]) + int(st[12])


def wave(engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    """Run len(prompts) requests, `concurrency` at a time; returns this repetition's figures."""
    todo, done, lock, finished = list(prompts), [], threading.Lock(), threading.Event()

    def start_next():
        with lock:
            ids = todo.pop(0) if todo else None
        if ids is not None:
            engine.generate(ids, params, Stream(on_done))

    def on_done(stream):  # runs on the engine thread: the next request goes in at once
        done.append(stream)
        if len(done) == len(prompts) or stream.error:  # a failed request ends the wave
            finished.set()
        if not stream.error:
            start_next()

    c0, o0, t0 = cpu_times.read(), own_ticks(), time.perf_counter()
    for _ in range(concurrency):
        start_next()
    finished.wait()
    failed = next((s.error for s in done if s.error), None)
    if failed:
        raise RuntimeError(f"a request failed: {failed}")
    wall = max(s.stamps[-1] for s in done) - t0
    c1 = cpu_times.read()
    foreign = max(0, (c1.busy - c0.busy) - (own_ticks() - o0)) / os.sysconf("SC_CLK_TCK")
    tokens = sum(s.tokens for s in done)
    ms = lambda values: 1e3 * np.asarray(values, dtype=float)
    return dict(tok_s=tokens / wall, req_s=len(done) / wall, tokens=tokens, requests=len(done),
                ttft=ms([s.stamps[0] - s.t0 for s in done]),
                itl=ms([(s.stamps[-1] - s.stamps[0]) / (s.tokens - 1) for s in done if s.tokens > 1]),
                latency=ms([s.stamps[-1] - s.t0 for s in done]), osl=[s.tokens for s in done],
                ids=[s.ids for s in done],  # in the order the requests finished
                foreign=foreign / (os.cpu_count() * wall), steal=c1.share_stolen_since(c0))


def bench_row(c: int, r: dict, prompt_tokens: int, output_tokens: int) -> dict:
    """A repetition as a row of client.bench's bench.json (same keys, target `engine`)."""
    pcts = lambda a: {"avg": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in (50, 90, 99)}}
    return {"target": "engine", "kind": "engine", "url": "in-process", "model": "llm", "mode": "concurrency",
            "level": float(c), "requests": r["requests"], "request_count": r["requests"],
            "workload": {"input_tokens": prompt_tokens, "output_tokens": output_tokens, "seed": 0},
            "error": None, "output_tok_s": r["tok_s"], "requests_s": r["req_s"],
            "ttft_ms": pcts(r["ttft"]), "itl_ms": pcts(r["itl"]), "latency_ms": pcts(r["latency"]),
            "osl": {"min": min(r["osl"]), "avg": float(np.mean(r["osl"])), "max": max(r["osl"])},
            "isl_avg": float(prompt_tokens), "steal": r["steal"]}


def bench_engine(args, engine: Engine) -> list[dict]:
    per_level = {c: args.requests or (4 if c == 1 else 2 * c) for c in args.streams}
    need = sum(per_level.values()) * args.reps + 2 * max(args.streams)
    prompts = make_prompts(engine.tokenizer, need, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, min_tokens=args.output_tokens, ignore_eos=True)
    rows = []
    for c, n in per_level.items():
        wave(engine, [prompts.pop() for _ in range(c)], c, SamplingParams(max_tokens=16, ignore_eos=True))
        reps = []
        for _ in range(args.reps):
            r = wave(engine, [prompts.pop() for _ in range(n)], c, params)
            assert r["tokens"] == n * args.output_tokens, r
            reps.append(r)
        med = {k: statistics.median(float(np.median(r[k])) for r in reps) for k in ("tok_s", "ttft", "itl")}
        print(json.dumps(dict(streams=c, requests=n, tok_s=round(med["tok_s"], 1),
                              ttft_p50_ms=round(med["ttft"], 1), itl_p50_ms=round(med["itl"], 2),
                              runs_tok_s=[round(r["tok_s"], 1) for r in reps],
                              foreign_cpu=[round(r["foreign"], 2) for r in reps],
                              steal=[round(r["steal"], 3) for r in reps])), flush=True)
        typical = min(reps, key=lambda r: abs(r["tok_s"] - med["tok_s"]))
        rows.append(bench_row(c, typical, args.prompt_tokens, args.output_tokens))
    return rows


def bench_hf(args, tokenizer) -> None:
    """transformers generate at batch 1 and 8, same prompts and lengths, for comparison."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = make_prompts(tokenizer, 8 * (args.reps + 1), args.prompt_tokens)
    for b in (1, 8):
        runs = []
        for rep in range(args.reps):
            ids = torch.tensor(prompts[rep * b:(rep + 1) * b])
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=args.output_tokens, min_new_tokens=args.output_tokens,
                               pad_token_id=tokenizer.eos_token_id)
            runs.append(b * args.output_tokens / (time.perf_counter() - t0))
        print(json.dumps(dict(hf_batch=b, tok_s=round(statistics.median(runs), 1),
                              runs_tok_s=[round(r, 1) for r in runs])), flush=True)


def check_hf(args, engine: Engine) -> bool:
    """Greedy ids of --check prompts, run concurrently in the engine, against transformers one by one."""
    import queue

    import torch
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(engine.tokenizer, args.check, args.prompt_tokens)
    # EOS masked until min_tokens, as transformers' min_new_tokens does (ignore_eos would not mask it)
    params = SamplingParams(max_tokens=args.output_tokens, min_tokens=args.output_tokens)
    queues = [queue.Queue() for _ in prompts]
    for ids, q in zip(prompts, queues):
        engine.generate(ids, params, q.put)
    got = []
    for q in queues:
        outs = [q.get(timeout=600)]
        while not outs[-1].finished:
            outs.append(q.get(timeout=600))
        got.append([t for o in outs for t in o.token_ids])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    same = 0
    for i, (ids, mine) in enumerate(zip(prompts, got)):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=args.output_tokens,
                                 min_new_tokens=args.output_tokens, pad_token_id=engine.tokenizer.eos_token_id)
        ref = ref[0, len(ids):].tolist()
        first = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        same += mine == ref
        if mine != ref:
            print(json.dumps(dict(prompt=i, first_difference=first)), flush=True)
    print(json.dumps(dict(check=len(prompts), identical_to_transformers=same)), flush=True)
    return same == len(prompts)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m client.bench_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default 4 at 1 stream, 2*C above)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=EngineConfig().model_path)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                    help="engine knob, as in config.pbtxt (repeatable)")
    ap.add_argument("--with-hf", action="store_true", help="also time transformers generate (batch 1, 8)")
    ap.add_argument("--out", help="also write the results as client.bench rows (bench.json, table, plots) here")
    ap.add_argument("--check", type=int, default=0, metavar="N",
                    help="instead of timing, compare the greedy ids of N concurrent requests with transformers")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    knobs = dict(kv.split("=", 1) for kv in args.set)
    cfg = EngineConfig.from_params({**knobs, "model_path": args.model})
    t0 = time.perf_counter()
    engine = Engine(cfg).start()
    print(json.dumps(dict(load_s=round(time.perf_counter() - t0, 1), knobs=knobs)), flush=True)
    try:
        if args.check:
            ok = check_hf(args, engine)
            raise SystemExit(0 if ok else 1)
        rows = bench_engine(args, engine)
    finally:
        engine.stop()
    if args.out:
        from client import bench_report
        os.makedirs(args.out, exist_ok=True)
        bench_report.write({"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": rows}, args.out)
    if args.with_hf:
        bench_hf(args, engine.tokenizer)


if __name__ == "__main__":
    main()
