"""The model runner: turns a scheduled batch into tensors and runs the forward.

It never decides who runs; it owns the weights, the KV buffer and the
attention backend.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from backends.config import EngineConfig
from backends.cores import CoreTurns
from backends.kv_cache import PagePool, allocate_kv_buffer
from backends.model import load_model
from backends.request import Request
from kernels import AttentionMetadata, create_backend, resolve_backend_name
from kernels.decoder import pick_decoder
from kernels.torch_ref import TorchAttention


@dataclass
class Batch:
    """(request, new tokens this step) pairs; `samples` are the requests whose
    last pending token is in this step, so they sample a token from it. `starts` are the
    items' first positions, taken when the batch is made (the scheduler moves
    num_computed on as soon as the step is launched)."""

    items: list[tuple[Request, int]]

    def __post_init__(self):
        self.samples = [r for r, n in self.items if r.num_computed + n == r.num_tokens]
        self.starts = [r.num_computed for r, _ in self.items]

    @property
        self.dp_counts: list[int] | None = None  # every DP rank's token count this step (backends.dp)
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


@dataclass
class StepInputs:
    """A batch as the forward takes it, built on the scheduler thread. `futures` are
    (index in ids, (step, row)) of tokens that an earlier step is still sampling."""

    ids: list[int]
    positions: list[int]
    rows: list[int]
    plan: object
    futures: list[tuple[int, tuple[int, int]]]


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device, self.dtype = cfg.torch_device, cfg.torch_dtype
        # Load on one thread; the thread that runs the steps takes cfg.num_threads on its first
        # step. An OpenMP team is per calling thread: a team left behind by the loading thread
        # competed with the engine thread's on 2 cores (decode steps 20-40% slower, measured).
        self._step_thread: int | None = None
        if self.device.type == "cpu":
            os.sched_setaffinity(0, cfg.cores)   # the process: every thread it starts inherits it
            torch.set_num_threads(1)
        self.model = load_model(cfg.model_path, self.device, self.dtype)
        mc = self.model.cfg
        self.max_context = min(cfg.max_context or mc.max_position, mc.max_position)
        self.pool = PagePool(self._num_pages(), cfg.page_size)
        self.kv = allocate_kv_buffer(mc.num_layers, self.pool.num_pages, cfg.page_size,
                                     mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        if mc.is_dllm:  # block-causal attention: the torch backend's masks, no fused decoder
            if cfg.attention_backend not in ("auto", "torch"):
                raise ValueError(f"attention_backend {cfg.attention_backend!r} has no block-causal attention "
                                 "for this block-diffusion model: use auto or torch")
            self.attention_backend, self.attn = "torch", TorchAttention(mc.dllm_block_size)
            self.model.decoder = None
        else:
            self.attention_backend = resolve_backend_name(cfg.attention_backend, self.device)
            self.attn = create_backend(self.attention_backend, self.device)
            self.model.decoder = pick_decoder(self.model, self.attn)
        self.turns = CoreTurns(cfg.cores, first=cfg.role == "prefill") if cfg.takes_turns else None

    def _num_pages(self) -> int:
        if self.cfg.num_pages:
            return self.cfg.num_pages
        mc = self.model.cfg
        page_bytes = 2 * mc.num_layers * self.cfg.page_size * mc.num_kv_heads * mc.head_dim \
            * self.dtype.itemsize
        wanted = self.cfg.max_running_requests * -(-self.max_context // self.cfg.page_size)
        return max(1, min(wanted, int(self.cfg.kv_memory_gb * 2**30 // page_bytes)))

    def prepare(self, batch: Batch) -> StepInputs:
        """Everything of a step that does not need the tokens of the step before it."""
        ids, positions, q_lens, kv_lens, rows, futures = [], [], [], [], [], []
        for (req, n), start in zip(batch.items, batch.starts):  # Python lists: cheaper than tensors each
            for token in req.token_slice(start, start + n):
                if isinstance(token, tuple):
                    futures.append((len(ids), token))
                    token = 0
                ids.append(token)
            positions.extend(range(start, start + n))
            q_lens.append(n)
            kv_lens.append(start + n)
            if start + n == req.num_tokens:  # it samples: its last row, or a diffusion block's rows
                wanted = len(req.block) if req.block is not None else 1
                rows.extend(range(len(ids) - wanted, len(ids)))
        meta = AttentionMetadata.build(q_lens, kv_lens, [r.pages for r, _ in batch.items],
                                       self.cfg.page_size, self.device)
        return StepInputs(ids, positions, rows, self.attn.plan(meta), futures)

    def run(self, batch: Batch, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward of every item's new tokens; the lm_head's input [len(batch.samples), hidden]
        (`model.logits` / `model.greedy` turn it into tokens: backends.sampler)."""
        return self.forward(self.prepare(batch), after_layer)

    def forward(self, step: StepInputs, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        if self._step_thread != threading.get_ident() and self.device.type == "cpu":
            self._step_thread = threading.get_ident()
            torch.set_num_threads(self.cfg.num_threads)
        tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        with self.turns or contextlib.nullcontext():
            return self.model.forward(tensor(step.ids), tensor(step.positions), self.kv, self.attn, step.plan,
                                      tensor(step.rows), after_layer)
