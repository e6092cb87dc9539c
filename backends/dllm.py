"""Block diffusion (LLaDA2.0 / SDAR / BD3-LM style) as a request kind of the one loop.

A request's sequence is its prompt, then blocks of B positions aligned to multiples of B;
the block being denoised starts as mask ids (the prompt's tail, when the prompt does not
end on a block boundary, is the head of its first block). Attention is block-causal. A
denoising step runs the block (and, after a block ended, that block's final tokens first,
so the KV it leaves is theirs) over the committed KV, then reveals every masked position
whose confidence (fp32 softmax probability of its argmax, the mask id excluded) reaches the
threshold, or else the single most confident one. When no mask is left the block's tokens
are the output; the next block starts.

Phases, for the scheduler: a request is in prefill while whole blocks of its prompt before
the last one are not in the cache (chunks end on block boundaries), in decode after that.
A step runs prefill work or decode work, never both (`Scheduler._schedule_dllm`).
"""
from __future__ import annotations

import math

import torch

from backends.request import Request


def start(req: Request, block_size: int, mask_id: int) -> None:
    """The first block: the prompt's tail, then mask ids to the next multiple of B (a whole
    block of masks when the prompt ends on a boundary)."""
    n = len(req.prompt_ids)
    req.block_start = n // block_size * block_size
    req.block = req.prompt_ids[req.block_start:] + [mask_id] * (block_size - (n - req.block_start))


def prefill_end(req: Request, block_size: int) -> int:
    """Positions the prefill phase puts in the cache: every block before the last one that
    precedes the block being denoised (that one goes with the block's first step)."""
    return max(0, req.block_start - block_size)


def reusable_prefix(req: Request, block_size: int, page_size: int) -> tuple[int, int]:
    """How much of a cached prefix a request may take: (tokens, pages per unit). Whole
    blocks of its prefill phase that are whole pages too: under block-causal attention a
    committed block's KV depends only on it and the blocks before it."""
    unit = math.lcm(block_size, page_size)
    return prefill_end(req, block_size) // unit * unit, unit // page_size


def in_prefill(req: Request, block_size: int) -> bool:
    return req.num_computed < prefill_end(req, block_size)


def reveal(logits: torch.Tensor, block: list[int], mask_id: int, threshold: float) -> list[int]:
    """One denoising step of a block: logits [B, V], row p predicting position p (no shift)."""
    masked = [p for p, token in enumerate(block) if token == mask_id]
    rows = logits[masked].float()
    rows[:, mask_id] = float("-inf")  # the mask id is never chosen
    confidence, choice = rows.softmax(dim=-1).max(dim=-1)
    chosen = [i for i, c in enumerate(confidence.tolist()) if c >= threshold]
    if not chosen:
        chosen = [int(confidence.argmax())]  # argmax takes the first of equals: the lowest position
    out = list(block)
    for i in chosen:
        out[masked[i]] = int(choice[i])
    return out


def block_done(block: list[int], mask_id: int) -> bool:
    return mask_id not in block
