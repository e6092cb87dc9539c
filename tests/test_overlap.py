"""Overlap scheduling: step N's results are processed while step N+1 computes, and that
changes nothing a client sees (greedy ids, finish reasons, counts) nor what the pool
holds. The scheduler scenarios of test_scheduler and the hand-off of test_disagg also run
with overlap on; these are the cases only overlap has."""
import threading

import pytest
import torch

from backends.request import SamplingParams
from tests.engine_utils import assert_pool_whole, collect, idle_pages, small_engine, token_ids
from tests.test_model_parity import prompts


@pytest.fixture(scope="module")
def engines(checkpoint):
    off, on = small_engine(checkpoint("llama"), overlap="off"), small_engine(checkpoint("llama"), overlap="on")
    yield off, on
    off.stop()
    on.stop()


def test_step_n_is_processed_after_step_n_plus_1_is_launched(engines):
    _, on = engines
    events, scheduler = [], on.scheduler
    launch, process = scheduler._launch, scheduler.process
    scheduler._launch = lambda batch: (step := launch(batch), events.append(("launch", step.number)))[0]
    scheduler.process = lambda step, *a: (events.append(("process", step.number)), process(step, *a))[1]
    try:
        collect(on, prompts(3), SamplingParams(max_tokens=12, min_tokens=12))
    finally:
        del scheduler._launch, scheduler.process
    processed = [n for kind, n in events if kind == "process"]
    launched = {n for kind, n in events if kind == "launch"}
    assert len(processed) >= 12
    for n in processed:
        if n + 1 in launched:
            assert events.index(("launch", n + 1)) < events.index(("process", n)), n


def test_every_end_relative_to_the_step_in_flight(engines):
    """eos, a stop string and max_tokens at each of the first positions: the same tokens,
    text, reasons and counts as overlap off (the token the next step computed is dropped)."""
    off, on = engines
    p = prompts(2)[1]
    greedy = token_ids(collect(off, [p], SamplingParams(max_tokens=16))[0])
    text = "".join(o.text for o in collect(off, [p], SamplingParams(max_tokens=16))[0])
    cases = [SamplingParams(max_tokens=k) for k in range(1, 7)]
    cases += [SamplingParams(max_tokens=16, end_id=greedy[k]) for k in range(0, 6)]
    cases += [SamplingParams(max_tokens=16, stop=(text[k:k + 2],)) for k in range(1, 12, 2) if text[k:k + 2].strip()]
    for params in cases:
        want, got = collect(off, [p], params)[0], collect(on, [p], params)[0]
        assert token_ids(got) == token_ids(want), params
        assert "".join(o.text for o in got) == "".join(o.text for o in want), params
        assert (got[-1].finish_reason, got[-1].num_output_tokens) == (want[-1].finish_reason,
                                                                      want[-1].num_output_tokens), params
    assert_pool_whole(on)


def test_a_cancel_while_a_step_is_in_flight(checkpoint, monkeypatch):
    """The loop turned by hand: step 1 (a decode) is held on the forward thread when the
    abort is taken. The stream ends with abort at once, the pages stay out of the pool
    until that forward ends, its token is dropped, and the pool is whole after."""
    from backends.config import EngineConfig
    from backends.engine import Engine
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=64, threads=1, overlap="on"))
    try:  # not started: this test turns the loop
        outs: list = []
        rid = eng.generate(prompts(2)[1], SamplingParams(max_tokens=400, min_tokens=400), outs.append)
        assert eng.scheduler.step() and eng.scheduler.in_flight.number == 0  # the prefill, launched
        forward, gate = eng.runner.forward, threading.Event()
        monkeypatch.setattr(eng.runner, "forward", lambda *a: (gate.wait(30), forward(*a))[1])
        assert eng.scheduler.step() and eng.scheduler.in_flight.number == 1  # step 0 done, step 1 held
        assert len(outs) == 1 and not eng.scheduler.in_flight.result.done()
        eng.abort(rid)
        eng.scheduler._take_inbox()
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert idle_pages(eng.stats()) < eng.stats()["kv_pages_total"], "pages freed under a running forward"
        gate.set()
        assert eng.scheduler.step()  # completes step 1: its token is dropped, the pages come back
        assert len(outs) == 2 and eng.scheduler.in_flight is None
        eng.runner.pool.check_integrity()
        assert idle_pages(eng.stats()) == eng.stats()["kv_pages_total"]
    finally:
        gate.set()
        eng.stop()


def test_pages_go_back_only_after_the_forward_that_reads_them(engines, monkeypatch):
    """Requests that end by eos while the next step already computes for them: none of
    their pages returns to the pool while a step that holds them is still running."""
    off, on = engines
    scheduler, pool = on.scheduler, on.runner.pool
    held: dict[int, set[int]] = {}
    launch, idle, early = scheduler._launch, pool._idle, []

    def record_launch(batch):
        pages = {page for req, _ in batch.items for page in req.pages}
        step = launch(batch)
        held[step.number] = pages
        return step

    def record_idle(page):  # its last reference went: free or cached, another request may take it
        running = [n for n in held if n > scheduler.forward_done]
        if any(page in held[n] for n in running):
            early.append(page)
        idle(page)
    monkeypatch.setattr(scheduler, "_launch", record_launch)
    monkeypatch.setattr(pool, "_idle", record_idle)
    batch = prompts(6)
    ends = [SamplingParams(max_tokens=24, end_id=token_ids(collect(off, [p], SamplingParams(max_tokens=8))[0])[3])
            for p in batch]
    results = collect(on, batch, ends)
    assert all(r[-1].finish_reason == "stop" for r in results)
    assert not early, f"pages {early} went back while a forward still read them"
    assert_pool_whole(on)


def test_bad_overlap_value_is_refused(checkpoint):
    from backends.config import EngineConfig
    with pytest.raises(ValueError, match="overlap"):
        EngineConfig(model_path=checkpoint("llama"), overlap="yes")


def test_overlap_auto_is_on_on_cuda_only(checkpoint, monkeypatch):
    from backends.config import EngineConfig
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a config for a GPU, never loaded
    path = checkpoint("llama")
    assert EngineConfig(model_path=path, device="cuda").overlaps
    assert not EngineConfig(model_path=path, device="cpu").overlaps
    assert not EngineConfig(model_path=path, device="cuda", overlap="off").overlaps
    assert EngineConfig(model_path=path, device="cpu", overlap="on").overlaps


@pytest.mark.server
def test_llm_and_router_with_overlap_equal_transformers(default_model, tmp_path_factory):
    """Through tritonserver, every engine with overlap on: `llm` and `router` (prefill and
    decode both overlapping) stream transformers' greedy text, prompts at once."""
    from client.triton_server import TritonServer, free_port
    from tests.test_router import assert_llm_and_router_equal_transformers, disagg_parameters
    parameters = {model: {**knobs, "overlap": "on"} for model, knobs in disagg_parameters(free_port()).items()}
    server = TritonServer(str(tmp_path_factory.mktemp("repo_overlap")), models=["llm", "prefill", "decode", "router"],
                          parameters=parameters)
    with server:
        assert_llm_and_router_equal_transformers(server)


def test_a_failed_step_costs_the_next_step_nothing(checkpoint, monkeypatch):
    """Step 0 fails while step 1, launched behind it, decodes step 0's request (a future
    with no token) beside a new prompt: only step 0's request ends with the error."""
    from backends.config import EngineConfig
    from backends.engine import Engine
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=64, threads=1, overlap="on"))
    try:  # not started: this test turns the loop
        forward, calls = eng.runner.forward, {"n": 0}

        def first_fails(*args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return forward(*args)
        monkeypatch.setattr(eng.runner, "forward", first_fails)
        a, b = [], []
        eng.generate(prompts(2)[0], SamplingParams(max_tokens=4), a.append)
        assert eng.scheduler.step()  # step 0: a's prefill, launched (it will fail)
        eng.generate(prompts(2)[1], SamplingParams(max_tokens=4), b.append)
        assert eng.scheduler.step() and len(eng.scheduler.in_flight.batch.items) == 2  # a's decode, b's prefill
        for _ in range(20):
            eng.scheduler.step()
        assert a[-1].finish_reason == "error" and "injected failure" in a[-1].error
        assert b[-1].finished and b[-1].error is None and len(token_ids(b)) == 4
        assert_pool_whole(eng)
    finally:
        eng.stop()


def test_greedy_steps_feed_the_next_step_where_their_tokens_are(engines, monkeypatch):
    """A step of plain greedy rows leaves its tokens pending and the next step takes them from
    there (fed), none through the host; a step with a penalised or a logprob row samples on
    the host and the next step's tokens come from the host. Both equal overlap off."""
    off, on = engines
    resolved, resolve = [], on.runner._resolve

    def record(step, ids):
        resolved.append((len(step.futures), sum(len(index) for _, index, _ in step.fed)))
        resolve(step, ids)
    monkeypatch.setattr(on.runner, "_resolve", record)
    batch, greedy = prompts(3), SamplingParams(max_tokens=10, min_tokens=10)
    assert [token_ids(o) for o in collect(on, batch, greedy)] == [token_ids(o) for o in collect(off, batch, greedy)]
    assert sum(fed for _, fed in resolved) > 0 and sum(host for host, _ in resolved) == 0
    resolved.clear()
    mixed = [greedy, SamplingParams(max_tokens=10, min_tokens=10, repetition_penalty=1.3),
             SamplingParams(max_tokens=10, min_tokens=10, logprobs=2)]
    assert [token_ids(o) for o in collect(on, batch, mixed)] == [token_ids(o) for o in collect(off, batch, mixed)]
    assert sum(host for host, _ in resolved) > 0
    assert_pool_whole(on)


class HeldEvent:
    """A device's "step done" event that does not come until the test says so."""

    def __init__(self):
        self.gate, self.waited = threading.Event(), threading.Event()

    def synchronize(self):
        self.waited.set()
        assert self.gate.wait(30)


def test_a_pending_step_launches_the_next_and_holds_its_fence_until_it_ends(checkpoint, monkeypatch):
    """The loop turned by hand, each step's device work held (a fake event): step 1 is
    launched and its forward runs while step 0's tokens are still pending, and step 0 counts
    as done (its pages' fence) only once its end was waited for."""
    from backends.config import EngineConfig
    from backends.engine import Engine
    from kernels.greedy_head import PendingTokens
    eng = Engine(EngineConfig(model_path=checkpoint("llama"), page_size=4, num_pages=64, threads=1, overlap="on"))
    held, sched = HeldEvent(), eng.scheduler
    try:  # not started: this test turns the loop
        launch = sched._launch_greedy
        monkeypatch.setattr(sched, "_launch_greedy", lambda *a: PendingTokens(launch(*a).device, None, held))
        outs: list = []
        eng.generate(prompts(2)[1], SamplingParams(max_tokens=8, min_tokens=8), outs.append)
        assert sched.step() and sched.in_flight.number == 0
        sched.in_flight.result.result(30)
        assert sched.forward_done == -1 and not sched.after_step(0)()
        turn = threading.Thread(target=sched.step)
        turn.start()  # launches step 1, then waits for step 0's end
        assert held.waited.wait(30)
        assert sched.in_flight.number == 1 and sched.in_flight.result.result(30)  # step 1's forward ran
        assert sched.forward_done == -1 and not outs
        held.gate.set()
        turn.join(30)
        assert sched.forward_done >= 0 and sched.after_step(0) is None and len(outs) == 1
        while not (outs and outs[-1].finished):
            sched.step()
        assert len(token_ids(outs)) == 8
        assert_pool_whole(eng)
    finally:
        held.gate.set()
        eng.stop()
