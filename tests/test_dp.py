"""DP attention's model half (backends/dp.py) in two gloo ranks on this CPU: each rank runs
attention for its own sequences and its shard of the MLP for everyone's tokens; what each
rank computes must equal the whole model run on its sequences alone, also when the other
rank brings an idle batch (no tokens) through the collectives."""
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


def rank_main(rank: int, path: str, port: int, steps: list, out_dir: str) -> None:
    import torch.distributed as dist

    from backends.dp import DpMlp
    from backends.model import load_weights
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        runner = make_runner(path)
        runner.model.mlp = DpMlp(runner.model, load_weights(path), rank, 2)
        results = []
        for step in steps:
            ids = None if step[rank] is None else prompts(4)[step[rank]]
            counts = runner.model.mlp.begin_step(0 if ids is None else len(ids))
            results.append((counts, run_prompt(runner, ids)))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_the_whole_model(checkpoint, tmp_path, case):
    path, steps = checkpoint("llama"), CASES[case]
    mp.start_processes(rank_main, args=(path, free_port(), steps, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    whole = make_runner(path)
    for rank in range(2):
        for (counts, hidden), step in zip(torch.load(tmp_path / f"rank{rank}.pt"), steps):
            ids = None if step[rank] is None else prompts(4)[step[rank]]
            assert counts == [0 if s is None else len(prompts(4)[s]) for s in step]
            if ids is None:
                assert hidden.shape[0] == 0  # an idle batch: through the collectives, no rows
            else:
                torch.testing.assert_close(hidden, run_prompt(whole, ids), atol=1e-4, rtol=0)
