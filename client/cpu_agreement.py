"""Greedy agreement of the CPU weight kinds on one model: `python -m client.cpu_agreement`.

Runs the fp32, bf16-weight and int8-weight engines (in-process, CPU) over a fixed prompt set,
greedy, and prints for each pair the share of identical output tokens (position by position)
and the mean length of the common prefix, the point where the two continuations part.
"""
from __future__ import annotations

import argparse
import json

from backends.config import DEFAULT_MODEL_DIR, EngineConfig
from backends.engine import Engine
from backends.request import SamplingParams
from client.gpu_check import greedy

PROMPTS = [
    "The capital of France is", "Write a Python function that reverses a string.", "Explain photosynthesis.",
    "What is the difference between a list and a tuple in Python?", "Once upon a time, in a small village,",
    "List three uses of a paperclip.", "How do airplanes stay in the air?", "Translate 'good morning' to Spanish.",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Romeo and Juliet.",
    "What are prime numbers?", "Describe the water cycle.", "Write a haiku about autumn.",
    "How does a computer store numbers?", "What causes earthquakes?",
]
KINDS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"), "int8": dict(dtype="float32", weights="int8")}


def outputs(model: str, tokens: int, knobs: dict) -> list[list[int]]:
    eng = Engine(EngineConfig(model_path=model, device="cpu", num_pages=512, max_running_requests=16, **knobs))
    tok = eng.tokenizer
    batch = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in PROMPTS]
    return greedy(eng, batch, SamplingParams(max_tokens=tokens, min_tokens=tokens))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    prefix = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b)]
    return {"identical_share": same / total, "mean_common_prefix": sum(prefix) / len(prefix),
            "whole_outputs_equal": sum(p == len(r) for p, r in zip(prefix, a)), "prompts": len(a)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    runs = {kind: outputs(args.model, args.tokens, knobs) for kind, knobs in KINDS.items()}
    report = {f"{x} vs {y}": agreement(runs[x], runs[y]) for x, y in [("bf16", "fp32"), ("int8", "fp32"),
                                                                      ("int8", "bf16")]}
    for pair, r in report.items():
        print(f"{pair}: {100 * r['identical_share']:.1f} % identical tokens, common prefix "
              f"{r['mean_common_prefix']:.1f} of {args.tokens} on average, {r['whole_outputs_equal']} of "
              f"{r['prompts']} outputs whole")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
