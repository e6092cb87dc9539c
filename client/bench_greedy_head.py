"""python -m client.bench_greedy_head [model_dir]: the default model's lm_head at 1 / 8 / 16 /
32 rows of random hidden states, full fp32 logits + argmax against the screened greedy head
(kernels.greedy_head) on vdpbf16ps and on the AMX tiles (where it has them); medians of 30,
each call after 512 MB of other reads, as a decode step's layers leave the caches."""
from __future__ import annotations

import statistics
import sys
import time

import torch

from backends.model import load_weights
from backends.prepare_model import DEFAULT_DIR
from kernels.greedy_head import GreedyHead, pick_greedy_head
from kernels.linear import PanelLinear


def main() -> None:
    torch.set_num_threads(2)
    weights = load_weights(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR)
    weight = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
    linear = PanelLinear()
    head = pick_greedy_head(linear, weight, linear.prepare(weight))
    if head is None:
        sys.exit("no greedy head on this CPU (needs AVX-512 BF16)")
    heads = {"vdpbf16ps": GreedyHead(weight, head.packed, amx=False)}
    if head.amx:
        heads["amx"] = head
    other = torch.ones(128 << 20)  # 512 MB
    g = torch.Generator().manual_seed(0)
    for rows in (1, 8, 16, 32):
        x = torch.randn(rows, weight.shape[1], generator=g)
        fns = {"full": lambda: linear(x, head.packed).argmax(-1).tolist()}
        fns |= {name: (lambda h=h: h(x)) for name, h in heads.items()}
        samples = {name: [] for name in fns}
        for _ in range(30):
            for name, fn in fns.items():
                other.sum()
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        print(f"{rows:2d} rows: " + ", ".join(f"{name} {t:.2f} ms ({ms['full'] / t:.2f}x)" for name, t in ms.items()))


if __name__ == "__main__":
    main()
