"""Helpers to drive an in-process Engine from tests."""
from __future__ import annotations

import queue
import threading

from backends.config import EngineConfig
from backends.engine import Engine
from backends.request import RequestOutput, SamplingParams


def small_engine(path: str, **overrides) -> Engine:
    """An engine with small pages and budgets, so prompts go through chunked prefill."""
    cfg = dict(model_path=path, page_size=4, num_pages=256, chunk_size=16, max_batch_tokens=40,
               max_running_requests=8, threads=2)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg)).start()


def collect(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            timeout_s: float = 120) -> list[list[RequestOutput]]:
    """Submit all prompts at once (so they batch) and gather every output of each."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    queues = [queue.Queue() for _ in prompts]
    for ids, p, q in zip(prompts, params, queues):
        engine.generate(ids, p, q.put)
    results = []
    for q in queues:
        outs = []
        while not (outs and outs[-1].finished):
            outs.append(q.get(timeout=timeout_s))
        results.append(outs)
    return results


def token_ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outputs)


def idle_pages(stats: dict) -> int:
    """Pages no request holds: free, or cached for a later prompt."""
    return stats["kv_pages_free"] + stats["kv_pages_cached"]


def assert_pool_whole(engine: Engine, timeout_s: float = 5) -> None:
    """No request is left and no page is held: every page is free or cached, and the KV
    manager's integrity check passes (counts equal holders). With overlap a request's last
    output goes out before the step computing past it ends, so its pages come back up to a
    step later."""
    for _ in range(int(timeout_s / 0.05)):
        if idle_pages(engine.stats()) == engine.stats()["kv_pages_total"]:
            break
        threading.Event().wait(0.05)
    assert idle_pages(engine.stats()) == engine.stats()["kv_pages_total"]
    engine.runner.pool.check_integrity()  # no holders: nothing may be held
