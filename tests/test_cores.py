"""Placement on a CPU: the cores an engine runs on, and turns at cores engines share."""
import os
import threading
import time

import pytest

from backends import cores
from backends.config import EngineConfig
from backends.cores import CoreTurns, parse_cores


def test_core_lists():
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cores("") == allowed
    assert parse_cores(f"{allowed[0]}") == [allowed[0]]
    assert parse_cores(f"{allowed[0]}-{allowed[-1]}") == allowed


@pytest.mark.parametrize("params, message", [
    ({"cpu_cores": "zero"}, "cpu_cores must be a list of cores such as '0-3,8', got 'zero'"),
    ({"cpu_cores": "0-4096"}, "cpu_cores '0-4096' names cores this process may not use"),
    ({"core_turns": "sometimes"}, "core_turns must be auto, on or off, got 'sometimes'"),
    ({"threads": "-1"}, "threads"),
])
def test_bad_placement_is_refused_naming_it(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_params(params)


def test_turns_by_default_only_where_engines_share_a_host():
    assert EngineConfig(role="prefill", device="cpu").takes_turns
    assert EngineConfig(role="decode", device="cpu").takes_turns
    assert not EngineConfig(role="colocated", device="cpu").takes_turns
    assert EngineConfig(role="colocated", device="cpu", core_turns="on").takes_turns
    assert not EngineConfig(role="decode", device="cpu", core_turns="off").takes_turns
    assert EngineConfig(role="decode", device="cpu").num_threads == len(os.sched_getaffinity(0))


@pytest.fixture
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "LOCK_DIR", str(tmp_path))


def test_one_forward_at_a_time_on_shared_cores_none_across_disjoint_ones(lock_dir):
    a, b, other = CoreTurns([0, 1], first=False), CoreTurns([1, 2], first=False), CoreTurns([3], first=False)
    entered = threading.Event()

    def enter_b():
        with b:
            entered.set()
    with a:
        with other:   # disjoint cores: no wait
            pass
        waiter = threading.Thread(target=enter_b)
        waiter.start()
        assert not entered.wait(0.3), "a forward on a shared core ran during another's turn"
    assert entered.wait(5)
    waiter.join()


def test_a_queued_prefill_forward_goes_before_the_next_decode_forwards(lock_dir):
    """Decode runs forward after forward (the engine loop takes the turn again at once); a
    prefill forward that queues gets the cores after at most the decode forward in flight."""
    decode, prefill = CoreTurns([0], first=False), CoreTurns([0], first=True)
    steps, stop, queued_at = [], threading.Event(), []

    def decode_loop():
        while not stop.is_set():
            with decode:
                steps.append(time.monotonic())
                time.sleep(0.002)
    loop = threading.Thread(target=decode_loop)
    loop.start()
    time.sleep(0.05)
    queued_at.append(time.monotonic())
    with prefill:
        entered = time.monotonic()
    stop.set()
    loop.join(5)
    assert len([t for t in steps if queued_at[0] < t < entered]) <= 1
