"""python -m client.gpu_check: everything a GPU box can tell about the CUDA path, in one run.

Run by scripts/gpu_check.sh (`make gpu-check`), which puts the carried wheels on the path.
Each step prints one line, PASS, SKIP (with why) or FAIL, then a summary; the exit code is 1
when any step failed. On a machine without CUDA every CUDA step is a SKIP line, so CI runs
the script itself.

    kernel tests     the `gpu`-marked tests of tests/test_kernels.py, Triton compiled
    engines          each tiny checkpoint, engine on CUDA in bf16 against the engine on the
                     CPU in fp32: greedy ids equal wherever fp32's top-2 logit margin is
                     above bf16 error, first-step logits within tolerance
    seeded sampling  temperature 1 with a seed on CUDA: repeatable, differs by seed
    hand-off         prefill -> decode over NIXL with the KV in VRAM (where NIXL imports)
    cuda graphs      decode steps replayed from CUDA graphs: greedy ids equal the eager engine's
    kernel bench     python -m kernels.bench --quick on CUDA (KV bytes read per second)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import queue
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LENGTHS = (5, 17, 33, 64)
NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * k) % 500 + 3 for i in range(n)] for k, n in enumerate(PROMPT_LENGTHS)]


def missing(args) -> str:
    """Why this machine cannot run the step on args.device ('' when it can)."""
    return "no CUDA device" if args.device == "cuda" and not torch.cuda.is_available() else ""


def dtype_of(args) -> str:
    return "bfloat16" if args.device == "cuda" else "float32"


def step_kernel_tests(args) -> tuple[str, str]:
    if args.device != "cuda" or missing(args):
        return "SKIP", missing(args) or "CUDA only"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_kernels.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    with open(os.path.join(args.out, "kernel_tests.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return ("PASS" if proc.returncode == 0 else "FAIL"), last


def engine(path: str, tokenizer, device: str, dtype: str, **knobs):
    from backends.config import EngineConfig
    from backends.engine import Engine
    cfg = EngineConfig(model_path=path, device=device, dtype=dtype, page_size=16, num_pages=64,
                       max_running_requests=8, **knobs)
    return Engine(cfg, tokenizer=tokenizer)


def greedy(eng, batch: list[list[int]], params, timeout_s: float = 120) -> list[list[int]]:
    """Every prompt's output ids, the prompts submitted at once (they batch)."""
    queues = [queue.Queue() for _ in batch]
    eng.start()
    try:
        for ids, q in zip(batch, queues):
            eng.generate(ids, params, q.put)
        return [output_ids(q, timeout_s) for q in queues]
    finally:
        eng.stop()


def output_ids(q: queue.Queue, timeout_s: float) -> list[int]:
    ids = []
    while True:
        out = q.get(timeout=timeout_s)
        if out.error:
            raise RuntimeError(out.error)
        ids += out.token_ids
        if out.finished:
            return ids


def first_logits(eng, ids: list[int]) -> torch.Tensor:
    """The logits after the prompt, from the engine's own runner (not started)."""
    from backends.request import Request, SamplingParams
    from backends.runner import Batch
    req = Request("probe", ids, SamplingParams(), None, None)
    req.pages = eng.runner.pool.allocate(eng.runner.pool.pages_for(len(ids)))
    with torch.inference_mode():
        hidden = eng.runner.run(Batch([(req, len(ids))]))
        logits = eng.runner.model.logits(hidden)[0].float().cpu()
    eng.runner.pool.release(req.pages)
    return logits


def compare_one(path: str, tokenizer, device: str = "cuda", dtype: str = "bfloat16") -> str:
    """'' when the engine on `device` agrees with the CPU fp32 engine, else what differs.

    The allowed error is measured, not guessed: transformers' own forward in `dtype` on
    `device`, against its fp32 forward on the CPU, over the same tokens. Greedy ids must be
    equal while fp32's top-2 margin is above twice that error, and the engine's first-step
    logits within twice that error (plus 0.1 % of their scale)."""
    from transformers import AutoModelForCausalLM

    from backends.request import SamplingParams
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    batch = prompts()
    cpu_ids = greedy(engine(path, tokenizer, "cpu", "float32"), batch, params)
    gpu = engine(path, tokenizer, device, dtype)
    got_logits = first_logits(gpu, batch[-1])
    gpu_ids = greedy(gpu, batch, params)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    low = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    problems = []
    for prompt, want, got in zip(batch, cpu_ids, gpu_ids):
        ids = torch.tensor([prompt + want])
        with torch.no_grad():
            logits = ref(ids).logits[0, len(prompt) - 1:-1]
            err = (low(ids.to(device)).logits[0, len(prompt) - 1:-1].float().cpu() - logits).abs().max().item()
        top2 = logits.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        for pos, (w, g) in enumerate(zip(want, got)):
            if margin[pos] <= 2 * err:
                break  # undecided at this precision from here on
            if w != g:
                problems.append(f"prompt of {len(prompt)}: token {pos} is {g}, fp32 says {w} "
                                f"(margin {margin[pos]:.3f} > 2 x {dtype} error {err:.3f})")
                break
    ids = torch.tensor([batch[-1]])
    with torch.no_grad():
        want_logits = ref(ids).logits[0, -1]
        low_err = (low(ids.to(device)).logits[0, -1].float().cpu() - want_logits).abs().max().item()
    err, scale = (got_logits - want_logits).abs().max().item(), want_logits.abs().max().item()
    allowed = 2 * low_err + 1e-3 * scale
    print(f"  {os.path.basename(path)}: first-step logits off fp32 by {err:.3f} (engine, {dtype} on {device}) "
          f"and {low_err:.3f} (transformers, same); scale {scale:.2f}", flush=True)
    if err > allowed:
        problems.append(f"first-step logits differ by {err:.3f}, allowed {allowed:.3f} "
                        f"(transformers in {dtype}: {low_err:.3f})")
    return "; ".join(problems)


def step_engines(args) -> tuple[str, str]:
    if missing(args):
        return "SKIP", missing(args)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    archs = sorted(os.listdir(args.checkpoints)) if os.path.isdir(args.checkpoints) else []
    if not archs:
        return "FAIL", f"no checkpoints in {args.checkpoints} (run scripts/gpu_prepare.sh and carry .gpu-check)"
    bad = {arch: msg for arch in archs
           if (msg := compare_one(os.path.join(args.checkpoints, arch), tokenizer, args.device, dtype_of(args)))}
    if bad:
        return "FAIL", " | ".join(f"{arch}: {msg}" for arch, msg in bad.items())
    return "PASS", f"{', '.join(archs)}: {dtype_of(args)} on {args.device} agrees with fp32 on the CPU"


def step_seeded_sampling(args) -> tuple[str, str]:
    if missing(args):
        return "SKIP", missing(args)
    from transformers import AutoTokenizer

    from backends.request import SamplingParams
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    path = os.path.join(args.checkpoints, "llama")
    sampled = lambda seed: greedy(engine(path, tokenizer, args.device, dtype_of(args)), prompts()[:2],
                                  SamplingParams(max_tokens=12, min_tokens=12, temperature=1.0, seed=seed))
    first, again, other = sampled(7), sampled(7), sampled(8)
    if first != again:
        return "FAIL", "the same seed gave different tokens"
    if first == other:
        return "FAIL", "seeds 7 and 8 gave the same tokens"
    return "PASS", "seeded rows repeat and differ by seed"


def step_handoff(args) -> tuple[str, str]:
    if missing(args):
        return "SKIP", missing(args)
    if importlib.util.find_spec("nixl") is None:
        return "SKIP", "NIXL does not import on this machine"
    from backends.disagg.local import Pair
    from backends.request import SamplingParams
    path = os.path.join(args.checkpoints, "llama")
    params = SamplingParams(max_tokens=8, min_tokens=8)
    pair = Pair(path, engine_overrides={"device": args.device, "dtype": dtype_of(args)})
    try:
        handed = [[t for out in dec for t in out.token_ids] for dec, _ in pair.run(prompts(), params)]
        whole = pair.wait_kv_whole()
    finally:
        pair.close()
    from transformers import AutoTokenizer
    local = greedy(engine(path, AutoTokenizer.from_pretrained(args.tokenizer), args.device, dtype_of(args)),
                   prompts(), params)
    if handed != local or not whole:
        return "FAIL", f"hand-off ids equal colocated: {handed == local}; pools whole: {whole}"
    return "PASS", f"prefill -> decode over NIXL ({args.device} memory) equals the colocated engine"


def step_cuda_graphs(args) -> tuple[str, str]:
    """Decode steps replayed from CUDA graphs against the same engine run eagerly, in fp32 so that
    a graph's fixed split count (and padded matmuls) cannot flip a token by rounding."""
    if args.device != "cuda" or missing(args):
        return "SKIP", missing(args) or "CUDA only"
    from transformers import AutoTokenizer

    from backends.request import SamplingParams
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    path = os.path.join(args.checkpoints, "llama")
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    run = lambda **knobs: engine(path, tokenizer, args.device, "float32", attention_backend="triton", **knobs)
    eager = greedy(run(cuda_graphs="off"), prompts(), params)
    problems, replays = [], 0
    for overlap in ("off", "on"):
        graphed = run(cuda_graphs="on", overlap=overlap)
        replay, counted = graphed.runner.graphs.replay, []
        graphed.runner.graphs.replay = lambda *a: (counted.append(1), replay(*a))[1]
        if greedy(graphed, prompts(), params) != eager:
            problems.append(f"overlap {overlap}: greedy ids differ from the eager engine's")
        if not counted:
            problems.append(f"overlap {overlap}: no decode step replayed a graph")
        replays += len(counted)
    if problems:
        return "FAIL", "; ".join(problems)
    return "PASS", f"{replays} decode steps replayed from graphs; greedy ids equal the eager engine's (overlap off, on)"


def step_kernel_bench(args) -> tuple[str, str]:
    if args.device != "cuda" or missing(args):
        return "SKIP", missing(args) or "CUDA only"
    proc = subprocess.run([sys.executable, "-m", "kernels.bench", "--quick"], cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(args.out, "kernel_bench.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    print(proc.stdout, flush=True)
    return ("PASS" if proc.returncode == 0 else "FAIL"), "table above, and in kernel_bench.txt"


STEPS = [("kernel tests", step_kernel_tests), ("engines", step_engines), ("seeded sampling", step_seeded_sampling),
         ("hand-off", step_handoff), ("cuda graphs", step_cuda_graphs), ("kernel bench", step_kernel_bench)]


def environment() -> str:
    parts = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    if importlib.util.find_spec("triton") is not None:
        import triton
        parts.append(f"triton {triton.__version__}")
    parts.append(f"CUDA: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "CUDA: none")
    parts.append("nixl: " + ("yes" if importlib.util.find_spec("nixl") else "no"))
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu runs the engine steps on the CPU in fp32 (a check of this script itself)")
    ap.add_argument("--out", default=os.path.join(ROOT, "artifacts", "gpu-check"))
    ap.add_argument("--checkpoints", default=os.path.join(ROOT, ".gpu-check", "checkpoints"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".gpu-check", "checkpoints", "llama"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    print(environment(), flush=True)
    results = []
    for name, step in STEPS:
        start = time.monotonic()
        try:
            status, detail = step(args)
        except Exception as exc:
            status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        results.append((name, status))
        print(f"{status:4s} {name} ({time.monotonic() - start:.0f} s): {detail}", flush=True)
    failed = [name for name, status in results if status == "FAIL"]
    print(f"gpu-check: {sum(s == 'PASS' for _, s in results)} passed, {len(failed)} failed, "
          f"{sum(s == 'SKIP' for _, s in results)} skipped" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
