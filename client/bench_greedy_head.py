"""python -m client.bench_greedy_head [model_dir]: the default model's lm_head at 1 / 8 / 16 / 32 /
64 rows of random hidden states, full logits + argmax against the greedy head that runs on this
CPU: on one with AVX-512 BF16 the fp32 head's bf16 screen (kernels.greedy_head.GreedyHead) on
vdpbf16ps and on the AMX tiles (where it has them); elsewhere (AVX2) ScreenedHead for an fp32
head and for a bf16 one; PairsScreenedHead for a bf16 head on AVX-512 BF16 (its int8 screen up to
its MAX_ROWS, the full head past them); and ArgmaxHead (the full logits' argmax in one call) for an
int8 head. Medians of 30, each call after 512 MB of other reads, as a
decode step's layers leave the caches."""
from __future__ import annotations

import statistics
import sys
import time

import torch

from backends.model import load_weights
from backends.prepare_model import DEFAULT_DIR
from kernels.greedy_head import ArgmaxHead, GreedyHead, ScreenedHead, pick_greedy_head
from kernels.linear import Bf16PanelLinear, Int8PanelLinear, PanelLinear


def heads(weight: torch.Tensor) -> list[tuple[str, object, object, dict]]:
    """(label, full linear, its packed head, {name: greedy head}) for each head this CPU screens."""
    out = []
    for label, linear in (("fp32 head", PanelLinear()), ("bf16 head", Bf16PanelLinear()),
                          ("int8 head", Int8PanelLinear())):
        packed = linear.prepare(weight)
        head = pick_greedy_head(linear, weight, packed, tied=True)
        if isinstance(head, GreedyHead):
            named = {"vdpbf16ps": GreedyHead(weight, packed, amx=False)} | ({"amx": head} if head.amx else {})
        elif isinstance(head, ScreenedHead):
            named = {"screened": head}
        elif isinstance(head, ArgmaxHead):
            named = {"one call": head}
        else:
            continue
        out.append((label, linear, packed, named))
    return out


def main() -> None:
    torch.set_num_threads(2)
    weights = load_weights(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR)
    weight = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float().contiguous()
    found = heads(weight)
    if not found:
        sys.exit("no greedy head on this CPU (needs AVX-512 BF16, or AVX2 and FMA)")
    other = torch.ones(128 << 20)  # 512 MB
    g = torch.Generator().manual_seed(0)
    for label, linear, packed, named in found:
        for rows in (1, 8, 16, 32, 64):
            x = torch.randn(rows, weight.shape[1], generator=g)
            fns = {"full": lambda: linear(x, packed).argmax(-1).tolist()}
            fns |= {name: (lambda h=h: h(x)) for name, h in named.items()}
            samples = {name: [] for name in fns}
            for _ in range(30):
                for name, fn in fns.items():
                    other.sum()
                    t0 = time.perf_counter()
                    fn()
                    samples[name].append(time.perf_counter() - t0)
            ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
            print(f"{label}, {rows:2d} rows: " +
                  ", ".join(f"{name} {t:.2f} ms ({ms['full'] / t:.2f}x)" for name, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
