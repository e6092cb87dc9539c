"""The model runner: turns a scheduled batch into tensors and runs the forward.

It never decides who runs; it owns the weights, the KV buffer and the
attention backend.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from backends.config import EngineConfig, dtype_name
from backends.cores import CoreTurns
from backends.cuda_graphs import DecodeGraphs, GraphHead, bucket_sizes, graphs_enabled
from backends.kv_cache import KVManager, allocate_kv_buffer
from backends.model import LayerHook, LlamaModel, load_model
from backends.page_table import DevicePageTable
from backends.request import Request, SamplingParams
from kernels import AttentionMetadata, create_backend, resolve_backend_name
from kernels.decoder import pick_decoder
from kernels.host_pack import IntPack, scatter
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
        self.dp_counts: list[int] | None = None  # every DP rank's token count this step (backends.dp)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


@dataclass
class StepInputs:
    """A batch as the forward takes it, built on the scheduler thread. `futures` are
    (index in ids, (step, row)) of tokens that an earlier step is still sampling. `tensors`
    holds ids, positions and rows on the device (kernels.host_pack: one copy on CUDA). A
    step that a CUDA graph runs has no plan and no tensors but its graph's bucket and its
    inputs in the graph's layout on the host, copied in when it runs."""

    ids: list[int]
    positions: list[int]
    rows: list[int]
    plan: object
    futures: list[tuple[int, tuple[int, int]]]
    tensors: dict[str, torch.Tensor]
    graph: int | None = None
    host: torch.Tensor | None = None
    # futures fed from an earlier step's tokens where they were computed: (its tokens, indices
    # in ids, rows of its tokens) per step; the scheduler moves them here from `futures`
    fed: list[tuple[torch.Tensor, list[int], list[int]]] = field(default_factory=list)
    # a graph step's writes to the device page table (flat indices, pages): DevicePageTable.assign
    table_writes: tuple[list[int], list[int]] = ([], [])
    head: GraphHead | None = None  # a graph step's logits and greedy tokens, once it has run


def pack_inputs(pack: IntPack, ids: list[int], positions: list[int], rows: list[int], q_lens: list[int],
                kv_lens: list[int], page_tables: list[list[int]], page_size: int, width: int = 0,
                pad: int = 0, table_rows: list[int] | None = None) -> None:
    """A step's arrays into one pack: the model's inputs, then the attention metadata's.
    pad: padding decodes after the real ones (a CUDA graph's bucket); table_rows: rows of the
    device page table instead of a table (see AttentionMetadata.add_to)."""
    pack.add("ids", ids + [0] * pad, torch.long)
    pack.add("positions", positions + [0] * pad, torch.long)
    pack.add("rows", rows, torch.long)
    AttentionMetadata.add_to(pack, q_lens, kv_lens, page_tables, page_size, width, pad, table_rows)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model: LlamaModel | None = None):
        """model: weights already on cfg's device (a benchmark's random model); None loads cfg.model_path."""
        self.cfg = cfg
        self.device, self.dtype = cfg.torch_device, cfg.torch_dtype
        # Load on one thread; the thread that runs the steps takes cfg.num_threads on its first
        # step. An OpenMP team is per calling thread: a team left behind by the loading thread
        # competed with the engine thread's on 2 cores (decode steps 20-40% slower, measured).
        self._step_thread: int | None = None
        if self.device.type == "cpu":
            os.sched_setaffinity(0, cfg.cores)   # the process: every thread it starts inherits it
            torch.set_num_threads(1)
        self.model = model or load_model(cfg.model_path, self.device, self.dtype, cfg.weights_kind)
        self.dtype = self.model.dtype  # activations: fp32 under bf16 weights on a CPU (kernels.linear)
        mc = self.model.cfg
        self.max_context = cfg.context_limit(mc.max_position)
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
            self.model.fused_kv = self.attention_backend == "triton" and not mc.qk_norm \
                and hasattr(self.model.ops, "rope_store")
        self.kv_dtype = cfg.kv_dtype(self._auto_kv_dtype(cfg))
        self._check_kv_dtype()
        self.pool = KVManager(self._num_pages(), cfg.page_size)
        self.kv = allocate_kv_buffer(mc.num_layers, self.pool.num_pages, cfg.page_size,
                                     mc.num_kv_heads, mc.head_dim, self.kv_dtype, self.device)
        self.model.build_rope_tables(self.max_context)
        # held by the scheduler around a step's forward and sampling
        self.turns = CoreTurns(cfg.cores, first=cfg.role == "prefill") if cfg.takes_turns else None
        self.packed = self.device.type == "cuda"  # a step's arrays in one pinned copy (tests set it on a CPU)
        use_graphs = graphs_enabled(cfg.cuda_graphs, self.device.type, self.attention_backend, cfg.role)
        self.graphs: DecodeGraphs | None = None
        self.page_rows: DevicePageTable | None = None
        if self.device.type == "cuda":
            self._warm_up()
        if use_graphs:
            self.capture_graphs(DecodeGraphs(bucket_sizes(cfg.max_running_requests)))

    def capture_graphs(self, graphs: DecodeGraphs) -> None:
        """Decode steps from now on replay `graphs`, which read their pages from a table on
        the device with a row for each sequence of the largest bucket."""
        self.page_rows = DevicePageTable(max(graphs.sizes), self.graph_width, self.device)
        self.graphs = graphs
        graphs.capture(self._graph_inputs)

    def _warm_up(self) -> None:
        """Triton compiles a kernel on its first launch (seconds): a prefill and a decode
        forward here, at load, so that the first request does not wait for it."""
        n = max(2, min(self.cfg.page_size, self.max_context))
        req = Request("warm-up", [0] * n, SamplingParams(), None, None)
        req.pages = self.pool.allocate(self.pool.pages_for(n)) or []
        if not req.pages:
            return
        try:
            self.run(Batch([(req, n)]))   # the extend kernel
            req.num_computed = n - 1
            self.run(Batch([(req, 1)]))   # the decode kernels
            torch.cuda.synchronize(self.device)
        finally:
            self.pool.release(req.pages)

    def _graph_inputs(self, bucket: int):
        """A graph's capture: its pack of `bucket` padding decodes, and the forward over the
        views of that pack's device buffer (split count fixed by the longest context), its
        page table gathered from the device's."""
        pack = IntPack(self.device, packed=True)
        pack_inputs(pack, [], [], list(range(bucket)), [], [], [], self.cfg.page_size, pad=bucket,
                    table_rows=[self.page_rows.padding] * bucket)

        def forward(views: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            views = {**views, "page_table": self.page_rows.gather(views["table_rows"])}
            meta = AttentionMetadata.from_pack([1] * bucket, [self.max_context] * bucket, self.cfg.page_size, views)
            hidden = self.model.forward(views["ids"], views["positions"], self.kv, self.attn, self.attn.plan(meta),
                                        views["rows"])
            logits = self.model.head_logits(hidden)
            return hidden, logits, logits.argmax(dim=-1)
        return pack, forward

    @property
    def graph_width(self) -> int:
        """A graph's page-table width: the pages of the longest context."""
        return -(-self.max_context // self.cfg.page_size)

    def _auto_kv_dtype(self, cfg: EngineConfig) -> torch.dtype:
        """kv_cache_dtype auto: bf16 on a CPU whose weights are bf16 or int8 under fp32 activations,
        where the C attention kernel reads it (in-process at 1 / 8 / 16 streams, int8 weights: 1.06 /
        1.06 / 1.08x the fp32 cache's tok/s, docs/cpu.md); else the activations' dtype (fp32 weights
        keep transformers' fp32 tokens)."""
        reduced = self.model.weight_dtype != torch.float32 or cfg.weights_kind == "int8"
        if self.device.type == "cpu" and self.dtype == torch.float32 and reduced and self.attention_backend == "cpu":
            return torch.bfloat16
        return self.dtype

    def _check_kv_dtype(self) -> None:
        """A KV cache in another dtype than the activations needs a kernel that reads it: on a CPU
        the C attention kernel (it widens bf16 rows as it loads them); the GPU kernels read the
        cache in the model's dtype."""
        if self.kv_dtype == self.dtype:
            return
        kv, activations = dtype_name(self.kv_dtype), dtype_name(self.dtype)
        if self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype {kv} on {self.device.type} needs the model's own dtype ({activations})")
        if self.attention_backend != "cpu" or self.kv_dtype != torch.bfloat16 or self.dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype {kv} under {activations} activations on a CPU needs the C attention "
                             f"kernel with fp32 activations and a bf16 cache (attention_backend auto or cpu); this "
                             f"model runs attention_backend {self.attention_backend!r}")

    def _num_pages(self) -> int:
        if self.cfg.num_pages:
            return self.cfg.num_pages
        mc = self.model.cfg
        page_bytes = 2 * mc.num_layers * self.cfg.page_size * mc.num_kv_heads * mc.head_dim \
            * self.kv_dtype.itemsize
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
        pages = [r.pages for r, _ in batch.items]
        bucket = self._graph_bucket(q_lens, rows)
        if bucket is not None:
            try:
                table_rows, *writes = self.page_rows.assign([r for r, _ in batch.items], bucket - len(q_lens))
                pack = IntPack(self.device, packed=True)
                pack_inputs(pack, ids, positions, list(range(bucket)), q_lens, kv_lens, pages, self.cfg.page_size,
                            pad=bucket - len(q_lens), table_rows=table_rows)
                host = self.graphs.host(bucket, pack)
            except Exception:
                self.page_rows.reset()  # its writes will never be made
                raise
            return StepInputs(ids, positions, rows, None, futures, {}, bucket, host, table_writes=tuple(writes))
        pack = IntPack(self.device, self.packed)
        pack_inputs(pack, ids, positions, rows, q_lens, kv_lens, pages, self.cfg.page_size)
        tensors = pack.send()
        meta = AttentionMetadata.from_pack(q_lens, kv_lens, self.cfg.page_size, tensors)
        return StepInputs(ids, positions, rows, self.attn.plan(meta), futures, tensors)

    def _graph_bucket(self, q_lens: list[int], rows: list[int]) -> int | None:
        """The CUDA graph that runs this step: decodes only, each sampling (its output row is
        its own), no DP collectives; None runs it eagerly."""
        if self.graphs is None or self.model.mlp is not None or len(rows) != len(q_lens) \
                or any(q != 1 for q in q_lens):
            return None
        return self.graphs.bucket(len(q_lens))

    def run(self, batch: Batch, hook: LayerHook | None = None) -> torch.Tensor:
        """Forward of every item's new tokens; the lm_head's input [len(batch.samples), hidden]
        (`model.logits` / `model.greedy` turn it into tokens: backends.sampler). A step that a
        graph ran has its head's outputs too, in `StepInputs.head` (`forward`); its hidden rows and
        logits are the graph's memory, rewritten by the next replay."""
        return self.forward(self.prepare(batch), hook)

    def forward(self, step: StepInputs, hook: LayerHook | None = None) -> torch.Tensor:
        if self._step_thread != threading.get_ident() and self.device.type == "cpu":
            self._step_thread = threading.get_ident()
            torch.set_num_threads(self.cfg.num_threads)
        if step.graph is not None:
            try:
                self.page_rows.write(*step.table_writes, self.packed)
            except Exception:
                self.page_rows.reset()
                raise
            hidden, step.head = self.graphs.replay(step.graph, step.host, len(step.rows),
                                                   lambda ids: self._resolve(step, ids))
            return hidden
        t = step.tensors
        self._resolve(step, t["ids"])
        return self.model.forward(t["ids"], t["positions"], self.kv, self.attn, step.plan, t["rows"], hook)

    def _resolve(self, step: StepInputs, ids: torch.Tensor) -> None:
        """Write the tokens that an earlier step was still sampling when this one was prepared
        (overlap) into its ids: those known on the host, known only now, so on CUDA a second,
        small copy; and those fed from the earlier step's tokens on the device."""
        if step.futures:
            index = [i for i, _ in step.futures]
            scatter(ids, index, [step.ids[i] for i in index], self.packed)
        for tokens, index, rows in step.fed:
            pack = IntPack(self.device, self.packed)
            pack.add("index", index, torch.long)
            pack.add("rows", rows, torch.long)
            t = pack.send()
            ids.index_copy_(0, t["index"], tokens.index_select(0, t["rows"]))
