"""A prefill engine and a decode engine in one process, joined by real NIXL
transports and driven the way the router drives them (same room on both).
For tests and for benchmarks of the hand-off without Triton in the way."""
from __future__ import annotations

import queue
import random

from backends.config import EngineConfig
from backends.disagg.config import DisaggConfig
from backends.dp_group import DpGroup
from backends.engine import Engine
from backends.ports import free_port
from backends.request import RequestOutput, SamplingParams


class Pair:
    def __init__(self, path: str, prefill_overrides: dict | None = None, decode_overrides: dict | None = None,
                 engine_overrides: dict | None = None, prefill_engine: dict | None = None, decode_dp: int = 1,
                 **disagg):
        port = free_port()
        base = dict(model_path=path, page_size=4, num_pages=256, chunk_size=16, max_batch_tokens=40,
                    max_running_requests=8, threads=1)
        base.update(engine_overrides or {})
        self.prefill_cfg = DisaggConfig(nixl_port=port, **{**disagg, **(prefill_overrides or {})})
        self.decode_cfg = DisaggConfig(prefill_address=f"127.0.0.1:{port}", **{**disagg, **(decode_overrides or {})})
        self.prefill = Engine(EngineConfig(**{**base, **(prefill_engine or {}), "role": "prefill"}),
                              disagg=self.prefill_cfg).start()
        decode = EngineConfig(**{**base, "role": "decode", "dp_size": decode_dp})
        if decode_dp > 1:  # DP attention: the decode ranks in processes of their own
            self.decode = DpGroup(decode, self.decode_cfg).start()
        else:
            self.decode = Engine(decode, disagg=self.decode_cfg).start()

    def submit(self, ids: list[int], params: SamplingParams, room: int | None = None, to_prefill: bool = True):
        room = room or random.getrandbits(62) + 1
        d, p = queue.Queue(), queue.Queue()
        self.decode.generate(ids, params, d.put, request_id=f"room-{room}", room=room)
        if to_prefill:
            self.prefill.generate(ids, params, p.put, request_id=f"room-{room}", room=room)
        return room, d, p

    def run(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float = 120):
        """All prompts at once; per prompt (decode outputs, prefill outputs)."""
        handles = [self.submit(ids, params) for ids in prompts]
        return [(drain(d, timeout_s), drain(p, timeout_s)) for _, d, p in handles]

    def kv_whole(self) -> bool:
        """No request holds a page on either engine (each is free or cached), and both KV
        managers' integrity checks pass."""
        if not all(e.stats()["kv_pages_free"] + e.stats()["kv_pages_cached"] == e.stats()["kv_pages_total"]
                   for e in (self.prefill, self.decode)):
            return False
        for e in (self.prefill, self.decode):
            if hasattr(e, "runner"):   # a DP group's pages live in its rank processes (their gauges count)
                e.runner.pool.check_integrity()
        return True

    def wait_kv_whole(self, timeout_s: float = 10) -> bool:
        import time
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.kv_whole():
                return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.decode.stop()
        self.prefill.stop()


def drain(q: queue.Queue, timeout_s: float) -> list[RequestOutput]:
    outs = []
    while not (outs and outs[-1].finished):
        outs.append(q.get(timeout=timeout_s))
    return outs
