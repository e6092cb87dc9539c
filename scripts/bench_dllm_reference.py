"""The per-request reference loop's speed, for the table of scripts/bench_dllm.sh: the
plain definition of tests/test_dllm.py (transformers, dense block-causal attention over the
whole sequence every step, no KV cache, one request at a time) on the same model, prompts of
128 ids, up to 64 output tokens, threshold 0.9. Prints output tokens per second (output ids,
not re-tokenized text).

    .venv/bin/python scripts/bench_dllm_reference.py artifacts/bench-dllm/smollm2-dllm [requests]
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from backends.model_config import ModelConfig  # noqa: E402
from tests.test_dllm import reference  # noqa: E402


def main() -> None:
    path, requests = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    torch.set_num_threads(os.cpu_count() or 1)
    eos = set(ModelConfig.load(path).eos_token_ids)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (128,), generator=g).tolist() for _ in range(requests)]
    reference(path, prompts[0][:16], 0.9, 8, eos)  # loads the model, warms up
    start, tokens = time.perf_counter(), 0
    for p in prompts:
        tokens += len(reference(path, p, 0.9, 64, eos))
    seconds = time.perf_counter() - start
    print(f"reference loop, one request at a time: {requests} requests, {tokens} output tokens in "
          f"{seconds:.1f} s = {tokens / seconds:.1f} tok/s, {requests / seconds:.2f} req/s")


if __name__ == "__main__":
    main()
