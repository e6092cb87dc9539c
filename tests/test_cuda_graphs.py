"""The GPU path's host side, checked on the CPU: a step's integer arrays in one copy
(kernels.host_pack), the CUDA-graph buckets and their padding layout, the graph path with
its forward run eagerly instead of replayed (backends.cuda_graphs), the warm-up at load
and the cuda_graphs parameter. The capture and replay themselves run in `make gpu-check`."""
import pytest
import torch

from backends.config import EngineConfig
from backends.cuda_graphs import Captured, DecodeGraphs, bucket_sizes, graphs_enabled, pick_bucket
from backends.request import Request, SamplingParams
from backends.runner import Batch, ModelRunner, pack_inputs
from kernels.base import DEVICE_ARRAYS
from kernels.host_pack import ALIGN, IntPack
from tests.engine_utils import assert_pool_whole, collect, small_engine, token_ids
from tests.test_model_parity import prompts


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


# ---- one copy a step -------------------------------------------------------------------
def test_a_pack_is_one_buffer_of_aligned_views_sent_in_one_copy():
    pack = IntPack("cpu", packed=True)
    pack.add("a", [1, 2, 3], torch.int64)
    pack.add("b", [4, 5, 6, 7, 8, 9], torch.int32, (2, 3))
    pack.add("empty", [], torch.int32)
    pack.add("c", [-1], torch.int64)
    t = pack.send()
    assert pack.copies == 1 and len(storages(t.values())) == 1
    assert t["a"].tolist() == [1, 2, 3] and t["a"].dtype == torch.int64
    assert t["b"].tolist() == [[4, 5, 6], [7, 8, 9]] and t["b"].dtype == torch.int32
    assert t["empty"].shape == (0,) and t["c"].tolist() == [-1]
    base = t["a"].untyped_storage().data_ptr()
    assert all((v.data_ptr() - base) % ALIGN == 0 for v in t.values())  # Triton specializes on alignment
    with pytest.raises(ValueError, match="b2: expected 6 values"):
        pack.add("b2", [1, 2], torch.int32, (2, 3))


def test_unpacked_arrays_are_plain_tensors():
    pack = IntPack("cpu")
    assert not pack.packed  # the CPU's default: nothing to copy, no pinning
    pack.add("a", [1, 2], torch.int64)
    pack.add("b", [3], torch.int32)
    t = pack.send()
    assert pack.copies == 0 and len(storages(t.values())) == 2 and t["b"].tolist() == [3]


@pytest.fixture(scope="module")
def runner(checkpoint):
    return ModelRunner(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=64,
                                    attention_backend="triton", threads=2, max_running_requests=8))


def request(runner, prompt_len: int, computed: int) -> Request:
    req = Request(f"r{prompt_len}", [(7 * i) % 50 + 3 for i in range(prompt_len)], SamplingParams(), None, None)
    req.pages = runner.pool.allocate(runner.pool.pages_for(prompt_len))
    req.num_computed = computed
    return req


def mixed_batch(runner) -> Batch:
    """Two decodes, a fresh prompt and a chunk in the middle of a prompt (it samples nothing)."""
    items = [(request(runner, 9, 8), 1), (request(runner, 6, 5), 1), (request(runner, 7, 0), 7),
             (request(runner, 12, 4), 4)]
    return Batch(items)


def free(runner, batch: Batch) -> None:
    for req, _ in batch.items:
        runner.pool.release(req.pages)


def test_a_cuda_step_is_one_copy_and_runs_as_the_plain_tensors_do(runner, monkeypatch):
    """Packed (as on CUDA; here on the CPU), every tensor of a step (model inputs, metadata,
    the Triton plan's) is a view of one buffer, made by one copy, and the forward gives the
    plain tensors' result bit for bit."""
    batch, copies = mixed_batch(runner), []
    copy = IntPack.copy
    monkeypatch.setattr(IntPack, "copy", lambda self, *a: (copies.append(1), copy(self, *a))[1])
    try:
        runner.packed = False
        plain = runner.forward(runner.prepare(batch))
        runner.packed = True
        step = runner.prepare(batch)
        plan = step.plan
        tensors = list(step.tensors.values()) + [getattr(plan.meta, n) for n in DEVICE_ARRAYS] + \
            [plan.page_table, plan.kv_lens, plan.cu_q, plan.dec_rows, plan.dec_seqs, plan.ext_seqs]
        assert len(storages(tensors)) == 1 and len(copies) == 1
        assert torch.equal(runner.forward(step), plain) and len(copies) == 1
    finally:
        runner.packed = False
        free(runner, batch)


@pytest.mark.parametrize("packed", [False, True])
def test_a_token_known_only_when_the_step_starts_reaches_its_ids(runner, packed):
    """Overlap: a decode's input token is still being sampled when its step is prepared."""
    req = request(runner, 9, 9)
    req.futures = [(3, 0)]  # its 10th token: row 0 of step 3
    try:
        runner.packed = packed
        step = runner.prepare(Batch([(req, 1)]))
        assert step.futures == [(0, (3, 0))]
        step.ids[0] = 42  # what the scheduler's forward thread does before the forward
        runner.forward(step)
        assert step.tensors["ids"].tolist() == [42]
    finally:
        runner.packed = False
        runner.pool.release(req.pages)


# ---- CUDA graphs: buckets, padding, the path itself ---------------------------------------
@pytest.mark.parametrize("max_batch, sizes", [
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]), (12, [1, 2, 4, 8, 12]), (5, [1, 2, 4, 5]), (1, [1])])
def test_bucket_sizes(max_batch, sizes):
    assert bucket_sizes(max_batch) == sizes


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    sizes = [1, 2, 4, 8]
    assert [pick_bucket(sizes, n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert pick_bucket(sizes, 9) is None and pick_bucket(sizes, 0) is None  # eager


def test_only_steps_of_sampling_decodes_that_fit_a_bucket_replay(runner):
    runner.graphs = DecodeGraphs([1, 2, 4])
    try:
        assert runner._graph_bucket([1, 1, 1], [0, 1, 2]) == 4
        assert runner._graph_bucket([1] * 5, list(range(5))) is None     # above the largest bucket
        assert runner._graph_bucket([1, 7], [0, 7]) is None              # a prefill in the step
        assert runner._graph_bucket([1, 1], [0]) is None                 # a chunk of one token: no sample
        assert runner._graph_bucket([], []) is None                      # an idle batch (DP)
    finally:
        runner.graphs = None


def test_a_padded_decode_step_is_laid_out_as_its_graph(runner):
    """Three decodes in the bucket of 4: the capture's layout, one padding decode after them
    that reads one position of page 0 (the device table's zero row) and writes no KV (slot -1)."""
    runner.capture_graphs(EagerGraphs([4]))
    try:
        captured, _ = runner._graph_inputs(4)
        pad = runner.page_rows.padding
        pack = IntPack("cpu", packed=True)
        pack_inputs(pack, [11, 12, 13], [8, 5, 2], [0, 1, 2, 3], [1, 1, 1], [9, 6, 3], [[1, 2, 3], [4, 5], [6]],
                    4, pad=1, table_rows=[0, 1, 2, pad])
        assert pack.layout() == captured.layout()
        t = pack.send()
        assert "page_table" not in t and t["table_rows"].tolist() == [0, 1, 2, pad]
        assert not runner.page_rows.table[pad].any()
    finally:
        runner.graphs = runner.page_rows = None
    assert t["ids"].tolist() == [11, 12, 13, 0] and t["positions"].tolist() == [8, 5, 2, 0]
    assert t["slot_mapping"].tolist() == [3 * 4 + 0, 5 * 4 + 1, 6 * 4 + 2, -1]
    assert t["seq_lens"].tolist() == [9, 6, 3, 1] and t["cu_q"].tolist() == [0, 1, 2, 3, 4]
    assert t["decode_seqs"].tolist() == t["decode_rows"].tolist() == [0, 1, 2, 3]
    assert t["extend_seqs"].numel() == 0


class Replay:
    """A captured graph's stand-in: replay() runs the forward eagerly on the same views."""

    def __init__(self, forward, views):
        self.forward, self.views = forward, views
        self.out = forward(views)
        self.count = 0

    def replay(self):
        self.count += 1
        with torch.inference_mode():  # the forward's outputs are inference tensors
            for out, new in zip(self.out, self.forward(self.views)):
                out.copy_(new)


class EagerGraphs(DecodeGraphs):
    """The graph path on a CPU: static buffer, layout check, one copy, late tokens, padding and
    output rows as on CUDA; only the capture is left out."""

    def capture(self, inputs):
        for size in self.sizes:
            pack, forward = inputs(size)
            static = torch.zeros(pack.nbytes, dtype=torch.uint8)
            views = pack.views(pack.copy(pack.host(), static))
            graph = Replay(forward, views)
            self.captured[size] = Captured(graph, static, views["ids"], graph.out, pack.layout())

    def replays(self) -> int:
        return sum(c.graph.count for c in self.captured.values())


def test_padding_decodes_write_no_kv(runner):
    runner.capture_graphs(EagerGraphs([4]))
    taken = runner.pool.allocate(runner.pool.num_free)
    held = [p for p in taken if p == 0]  # page 0, where padding decodes point, is no request's here
    runner.pool.release([p for p in taken if p != 0])
    (first, _), (second, _) = items = [(request(runner, 9, 8), 1), (request(runner, 6, 5), 1)]
    try:
        runner.kv.fill_(123.0)  # the capture's padding forward ran too: rewrite what it may have written
        step = runner.prepare(Batch(items))
        assert step.graph == 4 and runner.forward(step).shape[0] == 2 and runner.graphs.replays() == 1
        changed = (runner.kv != 123.0).flatten(4).any(-1).nonzero()[:, 2:].tolist()  # (page, offset) written
        assert sorted({tuple(x) for x in changed}) == sorted([(first.pages[2], 0), (second.pages[1], 1)])
    finally:
        runner.graphs = runner.page_rows = None
        free(runner, Batch(items))
        runner.pool.release(held)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_the_graph_path_streams_the_eager_engines_tokens(checkpoint, overlap):
    """Whole engine, Triton kernels in the interpreter: decode steps through the graph path
    (padded to their bucket) give the eager engine's greedy tokens."""
    path = checkpoint("qwen3")
    params = SamplingParams(max_tokens=10, min_tokens=10)
    batch = prompts(3)

    def run(graphs: bool):
        engine = small_engine(path, attention_backend="triton", overlap=overlap)
        if graphs:
            engine.runner.capture_graphs(EagerGraphs(bucket_sizes(engine.cfg.max_running_requests)))
        try:
            out = [token_ids(o) for o in collect(engine, batch, params, timeout_s=600)]
            assert_pool_whole(engine)
            return out, engine.runner.graphs.replays() if graphs else 0
        finally:
            engine.stop()
    (graphed, replays), (eager, _) = run(True), run(False)
    assert replays > 0 and graphed == eager


def test_graph_steps_through_preemptions_and_reused_rows_stream_the_eager_engines_tokens(checkpoint):
    """More requests than the device page table has rows and too few pages for them all:
    rows are taken back from finished requests, preempted requests come back with new page
    lists, and the tokens are still the eager engine's; every page is given back."""
    path = checkpoint("llama")
    params = SamplingParams(max_tokens=12, min_tokens=12)
    batch = prompts(6, seed=3)

    def run(graphs: bool):
        engine = small_engine(path, attention_backend="triton", overlap="on", max_running_requests=4, num_pages=24)
        if graphs:
            engine.runner.capture_graphs(EagerGraphs(bucket_sizes(engine.cfg.max_running_requests)))
        try:
            out = [token_ids(o) for o in collect(engine, batch, params, timeout_s=600)]
            assert_pool_whole(engine)
            return out, engine.runner.graphs.replays() if graphs else 0, engine.scheduler.num_preemptions
        finally:
            engine.stop()
    (graphed, replays, preempted), (eager, _, _) = run(True), run(False)
    assert replays > 0 and preempted > 0 and graphed == eager


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_graph_step_samples_its_graphs_logits_and_runs_no_head_after_it(checkpoint, overlap):
    """The lm_head and its argmax run inside the graph: after a replay the model's head is never
    called, for plain greedy, min_tokens-barred, penalised, seeded and logprob rows alike, and
    every row's tokens and logprobs are the eager engine's."""
    path = checkpoint("llama")
    batch = prompts(5, seed=5)
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, min_tokens=8),
              SamplingParams(max_tokens=8, repetition_penalty=1.3),
              SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(max_tokens=8, logprobs=2)]

    def run(graphs: bool, params):
        engine = small_engine(path, attention_backend="triton", overlap=overlap)
        runner, after_replay = engine.runner, []
        if graphs:
            runner.capture_graphs(EagerGraphs(bucket_sizes(engine.cfg.max_running_requests)))
        forward, step_kind = runner.forward, ["forward"]  # while a forward runs, then "graph" / "eager"

        def recording(step, *a):
            step_kind[0] = "forward"
            hidden = forward(step, *a)
            step_kind[0] = "graph" if step.graph is not None else "eager"
            return hidden
        runner.forward = recording
        for name in ("head_logits", "greedy", "logits_at"):  # the head after a forward (logits calls head_logits)
            call = getattr(runner.model, name)
            setattr(runner.model, name, lambda *a, call=call: (after_replay.append(step_kind[0]), call(*a))[1])
        try:
            out = collect(engine, batch[:len(params)], params, timeout_s=600)
            assert_pool_whole(engine)
            return out, engine.runner.graphs.replays() if graphs else 0, after_replay
        finally:
            engine.stop()
    for rows in (params, params[:2]):  # mixed rows, then plain greedy ones (overlap on: fed on the device)
        (graphed, replays, calls), (eager, _, _) = run(True, rows), run(False, rows)
        assert replays > 0 and "eager" in calls and "graph" not in calls
        assert [token_ids(o) for o in graphed] == [token_ids(o) for o in eager]
        lp = lambda outs: [(t, round(v[0], 4), v[1]) for o in outs for e in o.logprobs or () for t, v in e.items()]
        assert lp(graphed[-1]) == lp(eager[-1])


# ---- warm-up and the parameter -------------------------------------------------------------
def test_the_warm_up_runs_a_prefill_and_a_decode_and_gives_its_pages_back(runner, monkeypatch):
    shapes, run = [], runner.run
    monkeypatch.setattr(runner, "run", lambda batch, *a: (shapes.append([n for _, n in batch.items]), run(batch, *a))[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    free_pages = runner.pool.num_free
    runner._warm_up()
    assert shapes == [[4], [1]] and runner.pool.num_free == free_pages


@pytest.mark.parametrize("setting, device, backend, role, expected", [
    ("auto", "cuda", "triton", "colocated", True), ("auto", "cuda", "triton", "decode", True),
    ("auto", "cuda", "triton", "prefill", False), ("auto", "cuda", "flashinfer", "colocated", False),
    ("auto", "cpu", "cpu", "colocated", False), ("off", "cuda", "triton", "colocated", False),
    ("on", "cuda", "triton", "colocated", True)])
def test_where_graphs_are_captured(setting, device, backend, role, expected):
    assert graphs_enabled(setting, device, backend, role) is expected


def test_cuda_graphs_on_where_they_cannot_run_is_refused_naming_it(checkpoint):
    with pytest.raises(ValueError, match="cuda_graphs on: attention_backend is 'torch'"):
        graphs_enabled("on", "cuda", "torch", "colocated")
    with pytest.raises(ValueError, match="cuda_graphs on: the device is not CUDA"):
        ModelRunner(EngineConfig(model_path=checkpoint("llama"), device="cpu", num_pages=8, cuda_graphs="on"))
    with pytest.raises(ValueError, match="cuda_graphs must be auto, on or off, got 'yes'"):
        EngineConfig.from_params({"cuda_graphs": "yes"})
