"""DP attention (backends/dp.py, backends/dp_group.py) with two gloo ranks on this CPU.

The model half: each rank runs attention for its own sequences and its shard of the MLP for
everyone's tokens, equal to the whole model, also beside an idle batch. The loop half: the
rule table's rows, with the modes each rank recorded. `dp_size` behind one model: ranks in
processes of their own, equal to one engine for every architecture with overlap off and on,
cancel, a killed rank, the decode role's prebuilt requests, and all of it through tritonserver."""
import os
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from client.triton_server import free_port
from tests.test_model_parity import prompts

CASES = {  # per rank, per step: the prompt each rank runs (None: an idle batch)
    "both busy": [(0, 2)],
    "one idle": [(1, None), (None, 3)],
}


def spawn_ranks(main, *args) -> None:
    """Two ranks in spawned processes, each running main(rank, *args) inside one gloo group."""
    mp.start_processes(_in_group, args=(main, free_port(), args), nprocs=2, join=True, start_method="spawn")


def _in_group(rank: int, main, port: int, args: tuple) -> None:
    import torch.distributed as dist
    from backends.dp import join_group
    join_group(rank, 2, port, "cpu", timeout_s=30)  # a rank out of step fails, not hangs
    try:
        main(rank, *args)
    finally:
        dist.destroy_process_group()


def run_prompt(runner, ids):
    """The final hidden state of a whole prompt as one prefill step, on fresh pages."""
    from backends.request import Request, SamplingParams
    from backends.runner import Batch
    if ids is None:
        return runner.run(Batch([]))
    req = Request("r", ids, SamplingParams(), None, None)
    req.pages = runner.pool.allocate(runner.pool.pages_for(len(ids)))
    try:
        return runner.run(Batch([(req, len(ids))]))
    finally:
        runner.pool.release(req.pages)


def make_runner(path):
    from backends.config import EngineConfig
    from backends.runner import ModelRunner
    runner = ModelRunner(EngineConfig(model_path=path, page_size=4, num_pages=64, threads=1,
                                      attention_backend="torch"))
    runner.model.decoder = None
    return runner


def rank_main(rank: int, path: str, steps: list, out_dir: str) -> None:
    from backends.dp import DpMlp
    from backends.model import load_weights
    runner = make_runner(path)
    runner.model.mlp = DpMlp(runner.model, load_weights(path), rank, 2)
    results = []
    for step in steps:
        ids = None if step[rank] is None else prompts(4)[step[rank]]
        counts = runner.model.mlp.begin_step(0 if ids is None else len(ids))
        results.append((counts, run_prompt(runner, ids)))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_the_whole_model(checkpoint, tmp_path, case):
    path, steps = checkpoint("llama"), CASES[case]
    spawn_ranks(rank_main, path, steps, str(tmp_path))
    whole = make_runner(path)
    for rank in range(2):
        for (counts, hidden), step in zip(torch.load(tmp_path / f"rank{rank}.pt"), steps):
            ids = None if step[rank] is None else prompts(4)[step[rank]]
            assert counts == [0 if s is None else len(prompts(4)[s]) for s in step]
            if ids is None:
                assert hidden.shape[0] == 0  # an idle batch: through the collectives, no rows
            else:
                torch.testing.assert_close(hidden, run_prompt(whole, ids), atol=1e-4, rtol=0)


# ---- the loop's half: every rank takes every turn ------------------------------------------
LOOP_CASES = {  # per rank: max_tokens of its one request (None: no request)
    "a rank with nothing runs idle batches": (6, None),
    "requests finishing at different steps": (3, 7),
}


def loop_rank_main(rank: int, path: str, plan: tuple, out_dir: str) -> None:
    from backends.config import EngineConfig
    from backends.dp import make_rank
    from backends.engine import Engine
    from backends.request import SamplingParams
    eng = Engine(EngineConfig(model_path=path, page_size=4, num_pages=64, threads=1, attention_backend="torch"))
    make_rank(eng, rank, 2, loop_group=None, group_cores=[])   # one gloo group for both: overlap is off
    outs = []
    if plan[rank] is not None:
        eng.generate(prompts(2)[rank], SamplingParams(max_tokens=plan[rank], min_tokens=plan[rank]), outs.append)
    for _ in range(max(p or 0 for p in plan) + 2):  # not started: both ranks turn the loop in step
        eng.scheduler.step(wait_s=0)
    ids = [t for o in outs for t in o.token_ids]
    torch.save({"ids": ids, "modes": list(eng.scheduler.dp.modes), "free": eng.stats()["kv_pages_free"] + eng.stats()["kv_pages_cached"]},
               os.path.join(out_dir, f"loop{rank}.pt"))


@pytest.mark.parametrize("case", sorted(LOOP_CASES))
def test_the_loop_keeps_the_ranks_in_step(checkpoint, tmp_path, case):
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine, token_ids
    path, plan = checkpoint("llama"), LOOP_CASES[case]
    spawn_ranks(loop_rank_main, path, plan, str(tmp_path))
    busiest = max(p or 0 for p in plan)
    whole = small_engine(path)
    try:
        for rank, max_tokens in enumerate(plan):
            got = torch.load(tmp_path / f"loop{rank}.pt")
            mine = max_tokens or 0
            assert got["modes"] == ["forward"] * mine + ["idle"] * (busiest - mine) + ["none"] * 2, rank
            assert got["free"] == 64
            if max_tokens:
                params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens)
                assert got["ids"] == token_ids(collect(whole, [prompts(2)[rank]], params)[0])
    finally:
        whole.stop()


# ---- dp_size behind one model: rank processes, dispatch, cancel, rank death --------------


def dp_group(path, **overrides):
    from backends.config import EngineConfig
    from backends.dp_group import DpGroup
    cfg = dict(model_path=path, page_size=4, num_pages=64, chunk_size=16, max_running_requests=8, dp_size=2)
    cfg.update(overrides)
    return DpGroup(EngineConfig(**cfg)).start()


def wait_until(done, timeout_s: float = 20) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if done():
            return True
        time.sleep(0.05)
    return False


def fresh_stats(group) -> list[dict]:
    """Every rank's stats, sent after this call (ranks send theirs every STATS_EVERY_S)."""
    from backends.dp_group import STATS_EVERY_S
    time.sleep(2.5 * STATS_EVERY_S)
    return [dict(rank.stats) for rank in group.ranks]


def pools_whole(group) -> bool:
    return wait_until(lambda: all(s["kv_pages_free"] + s["kv_pages_cached"] == s["kv_pages_total"] for s in fresh_stats(group)), 10)


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_dp2_equals_one_engine(checkpoint, arch, overlap):
    """Greedy ids of 8 prompts at once through two ranks equal one whole engine's, and both
    ranks took requests (dispatch by load)."""
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine, token_ids
    path, batch = checkpoint(arch), prompts(8)
    params = SamplingParams(max_tokens=12, min_tokens=12)
    whole = small_engine(path)
    try:
        want = [token_ids(o) for o in collect(whole, batch, params)]
    finally:
        whole.stop()
    group = dp_group(path, overlap=overlap)
    try:
        got = collect(group, batch, params)
        assert [token_ids(o) for o in got] == want
        stats = fresh_stats(group)
        assert all(s["dp_forward_steps"] > 0 for s in stats), stats
        assert pools_whole(group)
    finally:
        group.stop()


def test_cancel_while_the_other_rank_is_idle(checkpoint):
    """One request on rank 0 while rank 1 runs idle batches for it; the cancel ends it, both
    pools are whole, and the group serves on."""
    import queue
    from backends.request import SamplingParams
    path = checkpoint("llama")
    group = dp_group(path)
    try:
        outs = queue.Queue()
        rid = group.generate(prompts(1)[0], SamplingParams(max_tokens=400, min_tokens=400), outs.put)
        assert group.requests[rid][1].rank == 0
        first = outs.get(timeout=30)
        idle_before = fresh_stats(group)[1]["dp_idle_steps"]
        assert idle_before > 0   # rank 1 is in the collectives with nothing of its own
        group.abort(rid)
        last = first
        while not last.finished:
            last = outs.get(timeout=30)
        assert last.finish_reason == "abort" and last.num_output_tokens < 400
        assert pools_whole(group)
        from tests.engine_utils import collect
        again = collect(group, prompts(2), SamplingParams(max_tokens=4))
        assert all(o[-1].finish_reason == "length" for o in again)
    finally:
        group.stop()


def test_a_killed_rank_ends_every_request_with_an_error(checkpoint):
    """SIGKILL rank 1 while both ranks run a request: both requests end with an error that
    names the rank, the group reports no rank alive, and new requests are refused."""
    import queue
    import signal
    from backends.request import InvalidRequest, SamplingParams
    group = dp_group(checkpoint("llama"))
    try:
        queues = [queue.Queue(), queue.Queue()]
        ids = [group.generate(p, SamplingParams(max_tokens=400, min_tokens=400), q.put)
               for p, q in zip(prompts(2), queues)]
        assert sorted(group.requests[i][1].rank for i in ids) == [0, 1]
        for q in queues:
            assert not q.get(timeout=30).finished
        assert [s["running"] for s in fresh_stats(group)] == [1, 1]   # the state the kill targets
        group.ranks[1].proc.send_signal(signal.SIGKILL)
        for q in queues:
            last = q.get(timeout=30)
            while not last.finished:
                last = q.get(timeout=30)
            assert last.finish_reason == "error" and "DP rank 1 of 2 exited (code -9)" in last.error
        assert wait_until(lambda: group.stats()["dp_ranks_alive"] == 0)
        assert group.ranks[0].proc.poll() is not None   # stopped, not hanging in a collective
        with pytest.raises(InvalidRequest, match="DP rank 1 of 2 exited"):
            group.generate(prompts(1)[0], SamplingParams(max_tokens=4), lambda out: None)
    finally:
        group.stop()


# ---- the decode role with DP: prebuilt requests --------------------------------------------
def test_prebuilt_only_runs_no_forward_on_any_rank(checkpoint):
    """Rows of the rule table with requests whose KV came from prefill (decode role, dp 2):
    - every rank has only prebuilt work: no rank runs a forward, and the first tokens stream;
    - one rank decodes while the other has only prebuilt work: the prebuilt rank runs idle
      batches (no forward of its own) and still streams its first token."""
    from backends.disagg.local import Pair, drain
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine, token_ids
    path = checkpoint("llama")
    whole = small_engine(path)
    want = [token_ids(o) for o in collect(whole, prompts(3), SamplingParams(max_tokens=30, min_tokens=30))]
    whole.stop()
    pair = Pair(path, decode_dp=2, transfer_timeout_s=10)
    try:
        before = fresh_stats(pair.decode)
        firsts = pair.run(prompts(2), SamplingParams(max_tokens=1))
        assert [token_ids(d) for d, _ in firsts] == [w[:1] for w in want[:2]]
        after = fresh_stats(pair.decode)
        assert [a["dp_forward_steps"] - b["dp_forward_steps"] for a, b in zip(after, before)] == [0, 0]
        assert [a["dp_idle_steps"] - b["dp_idle_steps"] for a, b in zip(after, before)] == [0, 0]
        assert all(a["dp_none_turns"] > b["dp_none_turns"] for a, b in zip(after, before))

        _, long_out, _ = pair.submit(prompts(1)[0], SamplingParams(max_tokens=400, min_tokens=400))
        first = long_out.get(timeout=30)
        before = [dict(rank.stats) for rank in pair.decode.ranks]  # counters only grow: older is fine
        _, short_out, _ = pair.submit(prompts(3)[2], SamplingParams(max_tokens=1))
        short = drain(short_out, 30)
        # Still decoding beside it: not finished, and its rank ran forwards while the short one
        # lived. (Its next token may land in its queue just after the short one's, in the same
        # step: reading the queue here raced, and failed once the KV hand-off got faster.)
        assert not any(o.finished for o in list(long_out.queue))
        after = fresh_stats(pair.decode)
        long_ids = token_ids([first] + drain(long_out, 60))
        assert long_ids[:30] == want[0] and token_ids(short) == want[2][:1]
        rank_long = 0 if after[0]["dp_forward_steps"] > before[0]["dp_forward_steps"] else 1
        rank_short = 1 - rank_long
        assert after[rank_long]["dp_forward_steps"] > before[rank_long]["dp_forward_steps"]
        assert after[rank_short]["dp_forward_steps"] == before[rank_short]["dp_forward_steps"]
        assert after[rank_short]["dp_idle_steps"] > before[rank_short]["dp_idle_steps"]
        assert pair.wait_kv_whole() and pools_whole(pair.decode)
    finally:
        pair.close()


def test_decode_dp2_equals_colocated(checkpoint):
    from backends.disagg.local import Pair
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine, token_ids
    path, batch = checkpoint("qwen3"), prompts(6)
    params = SamplingParams(max_tokens=16, min_tokens=16)
    whole = small_engine(path)
    want = [token_ids(o) for o in collect(whole, batch, params)]
    whole.stop()
    pair = Pair(path, decode_dp=2, transfer_timeout_s=10)
    try:
        assert [token_ids(d) for d, _ in pair.run(batch, params)] == want
        assert pair.wait_kv_whole()
    finally:
        pair.close()


# ---- through tritonserver ------------------------------------------------------------------
@pytest.mark.server
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_llm_and_router_with_dp2_equal_transformers(default_model, tmp_path_factory, overlap):
    """`llm` with dp_size 2 and `router` -> `decode` with dp_size 2 (each rank one of the two
    cores) stream transformers' greedy ids for prompts sent at once; every pool is whole after."""
    from client.triton_server import TritonServer
    from tests.test_router import assert_llm_and_router_equal_transformers, disagg_parameters
    parameters = disagg_parameters(free_port())
    for model in ("llm", "decode"):
        parameters[model] = {**parameters[model], "dp_size": "2", "overlap": overlap}
    server = TritonServer(str(tmp_path_factory.mktemp("repo_dp")), models=["llm", "prefill", "decode", "router"],
                          parameters=parameters)
    with server:
        assert_llm_and_router_equal_transformers(server)
        assert "DP attention, 2 ranks" in open(server.log_path).read()


def rank_pids(server) -> list[int]:
    """The DP rank processes under the server (`python -m backends.dp_group`), rank order."""
    found = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"backends.dp_group" in args:
            found[int(args[args.index(b"backends.dp_group") + 1])] = int(pid)
    return [found[r] for r in sorted(found)]


@pytest.mark.server
def test_a_rank_killed_under_tritonserver(default_model, tmp_path):
    """`llm` with dp_size 2, a stream on each rank, rank 1 SIGKILLed: both streams end with
    an error naming the rank, nothing hangs, the gauge shows no rank alive, a new request is
    refused with the same message, and the server itself keeps serving."""
    import concurrent.futures
    import signal
    from client.stream import stream_generate
    from client.triton_server import TritonServer
    server = TritonServer(str(tmp_path), models=["llm"], parameters={"llm": {"dp_size": "2"}})
    with server:
        url = server.grpc_url
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(stream_generate, url, "llm", f"Tell a long story number {i}.", max_tokens=1500,
                                min_tokens=np.array([1500], dtype=np.int32)) for i in range(2)]
            assert wait_until(lambda: server.metrics()['tandem_running{model="llm"}'] == 2, 60)
            time.sleep(1)  # both decoding, tokens streamed
            assert server.metrics()['tandem_running{model="llm"}'] == 2
            os.kill(rank_pids(server)[1], signal.SIGKILL)
            results = [run.result(timeout=60) for run in runs]
        for result in results:
            assert result.error and "DP rank 1 of 2 exited (code -9)" in result.error, result.error
            assert 0 < len(result.token_ids) < 1500
        assert wait_until(lambda: server.metrics()['tandem_dp_ranks_alive{model="llm"}'] == 0)
        assert rank_pids(server) == []
        refused = stream_generate(url, "llm", "Hello", max_tokens=4)
        assert refused.error and "DP rank 1 of 2 exited" in refused.error


# ---- one engine in a process of its own (engine_process own) ------------------------------
@pytest.mark.server
def test_every_role_with_its_engine_in_its_own_process_equals_transformers(default_model, tmp_path):
    """`llm`, and `router` -> `prefill` + `decode`, each engine in a process of its own beside
    its stub: transformers' greedy ids streamed, prefill's NIXL agent named by its describe
    (the router pairs with it), every pool whole after."""
    from client.triton_server import TritonServer
    from tests.test_router import assert_llm_and_router_equal_transformers, disagg_parameters
    parameters = disagg_parameters(free_port())
    for model in ("llm", "prefill", "decode"):
        parameters[model] = {**parameters[model], "engine_process": "own"}
    server = TritonServer(str(tmp_path), models=["llm", "prefill", "decode", "router"], parameters=parameters)
    with server:
        assert_llm_and_router_equal_transformers(server)
        assert open(server.log_path).read().count("engine ready: in its own process") == 3


@pytest.mark.server
def test_a_killed_engine_process_under_tritonserver(default_model, tmp_path):
    """`llm` with engine_process own, its engine SIGKILLed mid-stream: the stream ends with an
    error naming the engine process, the gauge drops to 0, a new request is refused with it."""
    import signal
    import threading
    from client.stream import stream_generate
    from client.triton_server import TritonServer
    server = TritonServer(str(tmp_path), models=["llm"], parameters={"llm": {"engine_process": "own"}})
    with server:
        url, result = server.grpc_url, {}
        run = threading.Thread(target=lambda: result.update(r=stream_generate(
            url, "llm", "Tell a long story.", max_tokens=1500, min_tokens=np.array([1500], dtype=np.int32))))
        run.start()
        assert wait_until(lambda: server.metrics()['tandem_running{model="llm"}'] == 1, 60)
        # streaming: its first token reached the stub (the latency histogram counts it)
        assert server.wait_metric('tandem_itl_seconds_count{model="llm"}', lambda n: n >= 1, 60)
        assert server.metrics()['tandem_dp_ranks_alive{model="llm"}'] == 1
        os.kill(rank_pids(server)[0], signal.SIGKILL)
        run.join(60)
        assert result["r"].error and "the engine process exited (code -9)" in result["r"].error, result["r"].error
        assert 0 < len(result["r"].token_ids) < 1500
        assert wait_until(lambda: server.metrics()['tandem_dp_ranks_alive{model="llm"}'] == 0)
        refused = stream_generate(url, "llm", "Hello", max_tokens=4)
        assert refused.error and "the engine process exited" in refused.error


def test_a_ranks_outputs_go_to_the_stub_in_order_batched_while_a_send_is_under_way():
    """The engine thread only appends: what it puts while a message is being sent goes in the
    next message, all of it, in order."""
    import threading
    from backends.dp_group import OutputBatches
    from backends.request import RequestOutput
    sent, first_in, release = [], threading.Event(), threading.Event()

    def send(message):
        first_in.set()
        release.wait(5)
        sent.append(message)

    batches = OutputBatches(send)
    batches.put(RequestOutput("a", "1"))
    assert first_in.wait(5)
    for text in "234":
        batches.put(RequestOutput("a", text))
    release.set()
    assert wait_until(lambda: sum(len(m[1]) for m in sent) == 4, 5)
    assert [(kind, [o.text for o in outs]) for kind, outs in sent] == [("outs", ["1"]), ("outs", ["2", "3", "4"])]


def test_a_rank_that_exits_because_the_group_broke_names_the_rank_that_broke_it():
    """Rank 1 SIGKILLed, rank 0 out with GROUP_BROKE: whichever pipe's end is read first, the
    failure names rank 1; a broken rank alone, or one whose peer still runs, names itself."""
    from types import SimpleNamespace

    from backends.dp_group import GROUP_BROKE, first_cause
    rank = lambda name, code: SimpleNamespace(name=name, proc=SimpleNamespace(poll=lambda: code))
    zero, one = rank("DP rank 0 of 2", GROUP_BROKE), rank("DP rank 1 of 2", -9)
    assert first_cause([zero, one], zero, GROUP_BROKE) == (one, -9)
    assert first_cause([zero, one], one, -9) == (one, -9)
    running = rank("DP rank 1 of 2", None)
    assert first_cause([zero, running], zero, GROUP_BROKE) == (zero, GROUP_BROKE)
