"""DP attention's model half (backends/dp.py) in two gloo ranks on this CPU: each rank runs
attention for its own sequences and its shard of the MLP for everyone's tokens; what each
rank computes must equal the whole model run on its sequences alone, also when the other
rank brings an idle batch (no tokens) through the collectives."""
import datetime
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.test_model_parity import prompts

CASES = {  # per rank, per step: the prompt each rank runs (None: an idle batch)
    "both busy": [(0, 2)],
    "one idle": [(1, None), (None, 3)],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(main, *args) -> None:
    """Two ranks in spawned processes, each running main(rank, *args) inside one gloo group."""
    mp.start_processes(_in_group, args=(main, free_port(), args), nprocs=2, join=True, start_method="spawn")


def _in_group(rank: int, main, port: int, args: tuple) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))  # a rank out of step fails, not hangs
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
        runner.pool.free(req.pages)


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
    from backends.dp import DpMlp, DpStep
    from backends.engine import Engine
    from backends.model import load_weights
    from backends.request import SamplingParams
    eng = Engine(EngineConfig(model_path=path, page_size=4, num_pages=64, threads=1, attention_backend="torch"))
    eng.runner.model.decoder = None
    eng.runner.model.mlp = DpMlp(eng.runner.model, load_weights(path), rank, 2)
    eng.scheduler.dp = DpStep(eng.runner.model.mlp)
    outs = []
    if plan[rank] is not None:
        eng.generate(prompts(2)[rank], SamplingParams(max_tokens=plan[rank], min_tokens=plan[rank]), outs.append)
    for _ in range(max(p or 0 for p in plan) + 2):  # not started: both ranks turn the loop in step
        eng.scheduler.step(wait_s=0)
    ids = [t for o in outs for t in o.token_ids]
    torch.save({"ids": ids, "modes": list(eng.scheduler.dp.modes), "free": eng.stats()["kv_pages_free"]},
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
