"""DP attention inside one rank (issue 26): attention stays with each rank's own requests,
the MLP is tensor-parallel across the ranks. The rank processes behind one Triton model,
dispatch, cancellation and a dead rank are `backends.dp_group`'s.

Every step the ranks first agree on how many tokens each brings (an all-gather). In each
layer every rank gathers all ranks' MLP inputs, computes its shard of the intermediate
dimension for all of them, and the partial outputs are summed across the ranks (an
all-reduce; gloo has no reduce-scatter), of which each rank keeps its own rows. A rank with
no tokens still enters every collective with an empty batch (an idle batch); when no rank
has tokens the step runs no forward at all. gloo on the CPU, NCCL on CUDA (same calls).

`DpStep` is the loop's half: once a turn, before a step is launched, the ranks agree on
their token counts; a rank with nothing to run then launches an idle batch if any other rank
has tokens, and no rank runs a forward when none has.
"""
from __future__ import annotations

import collections
import datetime

import torch
import torch.distributed as dist

from backends.runner import Batch


def all_token_counts(num_tokens: int, size: int, group=None) -> list[int]:
    """Every rank's token count (all ranks call it, in the same order)."""
    mine = torch.tensor([num_tokens], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    return [int(c) for c in every]


class DpMlp:
    """The MLP of a LlamaModel as this rank's shard; set as `model.mlp`."""

    def __init__(self, model, weights: dict[str, torch.Tensor], rank: int, size: int, group=None):
        self.model, self.rank, self.size, self.group = model, rank, size, group
        bounds = torch.tensor_split(torch.arange(model.cfg.intermediate_size), size)[rank]
        lo, hi = int(bounds[0]), int(bounds[-1]) + 1
        prep = lambda t: model.linear.prepare(t.to(device=model.device, dtype=model.dtype).contiguous())
        self.gate_up, self.down = [], []
        for i in range(model.cfg.num_layers):
            p = f"model.layers.{i}.mlp."
            gate, up = weights[p + "gate_proj.weight"][lo:hi], weights[p + "up_proj.weight"][lo:hi]
            self.gate_up.append(prep(torch.cat([gate, up])))
            self.down.append(prep(weights[p + "down_proj.weight"][:, lo:hi]))
        self.counts = [0] * size

    def begin_step(self, num_tokens: int) -> list[int]:
        """Every rank's token count for this step, on the MLP's own group (the model-level
        tests; the loop agrees through DpStep)."""
        self.counts = all_token_counts(num_tokens, self.size, self.group)
        return self.counts

    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        longest = max(self.counts)
        padded = x.new_zeros(longest, x.shape[1])
        padded[:x.shape[0]] = x
        gathered = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(gathered, padded, group=self.group)
        everyone = torch.cat([g[:c] for g, c in zip(gathered, self.counts)])
        ops, linear = self.model.ops, self.model.linear
        partial = linear(ops.silu_mul(linear(everyone, self.gate_up[layer])), self.down[layer])
        dist.all_reduce(partial, group=self.group)
        start = sum(self.counts[:self.rank])
        return partial[start:start + self.counts[self.rank]]


class DpStep:
    """The scheduler's side of DP attention (`Scheduler.dp`): what this rank launches.

    The agreement runs on the loop thread over a process group of its own (`group`), the
    layers' collectives on the forward thread over the MLP's: with overlap on, the two
    threads' collectives interleave differently on each rank, and one group shared by both
    would pair one rank's step agreement with another's layer gather."""

    def __init__(self, mlp: DpMlp, group=None, on_broken=None):
        self.mlp, self.group = mlp, group
        self.on_broken = on_broken  # called when a rank is gone (the rank process exits there)
        # per turn, the latest ones: forward, idle or none (what the rule table names)
        self.modes: collections.deque[str] = collections.deque(maxlen=10_000)
        self.totals: collections.Counter[str] = collections.Counter()

    def stats(self) -> dict:
        return {"dp_forward_steps": self.totals["forward"], "dp_idle_steps": self.totals["idle"],
                "dp_none_turns": self.totals["none"]}

    def _record(self, mode: str) -> None:
        self.modes.append(mode)
        self.totals[mode] += 1

    def agree(self, batch):
        """This rank's batch, an idle batch (`Batch([])`) when only other ranks have tokens,
        or None when no rank has any (then no rank runs a forward). The batch carries every
        rank's token count to its forward (`begin_forward`)."""
        try:
            counts = all_token_counts(batch.num_tokens if batch is not None else 0, self.mlp.size, self.group)
        except RuntimeError as exc:  # gloo: a peer's connection closed or timed out
            if self.on_broken is not None:
                self.on_broken(exc)
            raise
        if not any(counts):
            self._record("none")
            return None
        self._record("forward" if batch is not None else "idle")
        batch = batch if batch is not None else Batch([])
        batch.dp_counts = counts
        return batch

    def begin_forward(self, batch) -> None:
        """On the thread that runs the forward, right before it."""
        self.mlp.counts = batch.dp_counts


def join_group(rank: int, size: int, port: int, device: str, timeout_s: float = 60):
    """This process as rank `rank` of a group on this host (the layers' collectives: gloo on
    the CPU, NCCL on CUDA); returns the loop's own group (`DpStep`), gloo either way: the
    token counts live on the host. A rank that dies turns the others' next collective into
    an error."""
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo")


def make_rank(engine, rank: int, size: int, loop_group, group_cores: list[int], on_broken=None) -> None:
    """Turn a loaded engine into one rank: the MLP shard replaces the whole MLP's weights.

    Where engines take turns at the cores (backends.cores), the group takes one turn for all
    its cores, through rank 0: ranks that each waited for their own cores could deadlock with
    another engine (it holds rank 0's core and waits for rank 1's, while rank 1 waits in a
    collective for rank 0). The other ranks' forwards move in step with rank 0's anyway."""
    from backends.cores import CoreTurns
    from backends.model import load_weights
    if engine.runner.turns is not None:
        engine.runner.turns = CoreTurns(group_cores, first=engine.cfg.role == "prefill") if rank == 0 else None
    model = engine.runner.model
    model.mlp = DpMlp(model, load_weights(engine.cfg.model_path), rank, size)
    model.decoder = None  # the fused all-layers decoder has no collectives
    for layer in model.layers:
        layer.gate_up = layer.down = None
    engine.scheduler.dp = DpStep(model.mlp, loop_group, on_broken)
