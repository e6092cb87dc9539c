"""CUDA graphs for decode steps (the `cuda_graphs` parameter).

A decode step of a small batch launches a dozen kernels a layer, each of them short, and
the GPU waits for the host to launch the next; a graph replays them all in one launch.
One graph is captured at load per bucket of batch sizes (bucket_sizes). Its inputs are
views of one static device buffer laid out as the runner packs any step (token ids,
positions, logit rows, then the attention metadata: backends.runner.pack_inputs), the
sequences' rows of a page table kept on the device (backends.page_table; the graph gathers
them, as wide as the longest context), and the Triton decode kernel's split count fixed by
that context (splits past a shorter context are empty and cost a program each).

A decode step of B <= bucket requests fills the bucket's layout on the host with
bucket - B padding decodes after its own (one cached position, the table's row of zeros,
so they read page 0; slot -1, so they write no KV; their output rows are dropped), copies
it in with one copy, writes the page-table entries that changed and replays. The graph runs
the lm_head and its argmax too: a step's logits and greedy tokens come out of the replay
(`GraphHead`), with no launch after it. Prefill and mixed steps, batches above the largest
bucket and steps with DP collectives run eagerly. Only the Triton attention backend runs in a
graph: the others plan on the host per batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.host_pack import IntPack

# a graph's forward: its inputs' views -> (hidden [bucket, H], logits [bucket, V], their argmax [bucket])
FORWARD = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
CAPTURE = Callable[[int], tuple[IntPack, FORWARD]]


def graphs_enabled(setting: str, device_type: str, backend: str, role: str) -> bool:
    """Whether the engine captures decode graphs; `on` where it cannot is refused."""
    if setting == "off":
        return False
    why = "the device is not CUDA" if device_type != "cuda" else \
        f"attention_backend is {backend!r}, and only 'triton' runs in a graph" if backend != "triton" else ""
    if why and setting == "on":
        raise ValueError(f"cuda_graphs on: {why}; use auto or off")
    return not why and role != "prefill"  # prefill steps are never decodes


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch, and max_batch: a padding row costs about a
    row's work, so a step pays for at most 7 rows it does not use (a few at small sizes)."""
    sizes = {s for s in (1, 2, 4) if s < max_batch} | set(range(8, max_batch, 8)) | {max_batch}
    return sorted(sizes)


def pick_bucket(sizes: list[int], batch: int) -> int | None:
    """The smallest bucket that holds `batch` decodes; None (eager) for 0 or more than the largest."""
    return next((s for s in sizes if s >= batch), None) if batch > 0 else None


@dataclass
class Captured:
    graph: "torch.cuda.CUDAGraph"
    static: torch.Tensor           # the inputs' device buffer [nbytes] uint8
    ids: torch.Tensor              # its token-id view (a step's late tokens are written there)
    out: tuple[torch.Tensor, ...]  # the forward's outputs (FORWARD), rewritten by every replay
    layout: list[tuple[str, int, int]]


@dataclass
class GraphHead:
    """A graph step's lm_head outputs. `logits` [rows, V] in the model's dtype are the graph's
    memory, rewritten by its next replay: they are read (or barred in place) within the step.
    `tokens` [rows], their argmax, are the step's own (a later step may feed on them)."""
    logits: torch.Tensor
    tokens: torch.Tensor


class DecodeGraphs:
    def __init__(self, sizes: list[int]):
        self.sizes = sizes
        self.captured: dict[int, Captured] = {}

    def bucket(self, batch: int) -> int | None:
        return pick_bucket(self.sizes, batch)

    def capture(self, inputs: CAPTURE) -> None:
        """inputs(bucket) -> (the bucket's pack of padding decodes, the forward over its views).
        Largest first, all in one memory pool: the smaller graphs reuse the largest's memory."""
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            pack, forward = inputs(size)
            static = torch.zeros(pack.nbytes, dtype=torch.uint8, device=pack.device)
            views = pack.views(pack.copy(pack.host(), static))
            side = torch.cuda.Stream(pack.device)
            side.wait_stream(torch.cuda.current_stream(pack.device))
            with torch.cuda.stream(side):  # once outside the graph: kernels compiled, lazy state made
                forward(views)
            torch.cuda.current_stream(pack.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(views)
            self.captured[size] = Captured(graph, static, views["ids"], out, pack.layout())

    def host(self, bucket: int, pack: IntPack) -> torch.Tensor:
        """A step's filled host buffer, checked to be in the layout its graph was captured with."""
        if pack.layout() != self.captured[bucket].layout:
            raise RuntimeError(f"a decode step of bucket {bucket} is not laid out as its CUDA graph")
        return pack.host()

    def replay(self, bucket: int, host: torch.Tensor, rows: int,
               before: Callable[[torch.Tensor], None]) -> tuple[torch.Tensor, GraphHead]:
        """One copy of the step's inputs into the graph's buffer, before(ids) (the tokens known
        only now), the replay; the first `rows` rows of the hidden states and the head's. The
        hidden rows, like the logits, are the graph's memory: read within the step."""
        c = self.captured[bucket]
        c.static.copy_(host, non_blocking=True)
        before(c.ids)
        c.graph.replay()
        hidden, logits, tokens = c.out
        return hidden[:rows], GraphHead(logits[:rows], tokens[:rows].clone())
