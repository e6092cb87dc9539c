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


def test_busy_sees_other_engines_and_never_touches_its_own_locks(lock_dir):
    decode, prefill, other = CoreTurns([0], first=False), CoreTurns([0], first=True), CoreTurns([0], first=False)
    assert not decode.busy()
    with prefill:
        assert decode.busy()
    assert not decode.busy()
    with decode:
        decode.busy()   # probes its own turn: must not release it
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: other.__enter__() and entered.set())
        waiter.start()
        assert not entered.wait(0.2), "probing released the engine's own turn"
    waiter.join(5)
    other.__exit__()
    import fcntl
    fd = os.open(os.path.join(cores.LOCK_DIR, "tandem-core0.queue"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)   # a prefill forward queued for the core
    assert decode.busy()
    os.close(fd)


def test_a_loop_waiting_for_the_cores_still_takes_new_requests(lock_dir, checkpoint):
    """While another engine's forward holds the cores, an engine that takes turns (and does
    not go first) waits before its forward, not inside it: a request that comes meanwhile is
    taken at once. (The cores are taken while the engine is idle: an engine caught between
    its look at the cores and its own turn would wait inside the turn, as before.)"""
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine
    engine = small_engine(checkpoint("llama"), core_turns="on")

    def taken(request_id: str) -> bool:
        deadline = time.monotonic() + 1
        while request_id not in engine.scheduler.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        return request_id in engine.scheduler.requests

    try:
        outs = []
        with CoreTurns(engine.cfg.cores, first=True):   # a prefill forward holds every core
            first = engine.generate([5, 6, 7], SamplingParams(max_tokens=4), outs.append)
            assert taken(first)   # the loop's turn takes it, then waits for the cores
            time.sleep(0.05)
            second = engine.generate([8, 9, 10], SamplingParams(max_tokens=4), outs.append)
            assert taken(second), "the loop waited inside the turn"
            assert not outs   # nothing ran while the cores were held
        assert collect(engine, [[11, 12]], SamplingParams(max_tokens=3))[0][-1].finish_reason == "length"
        deadline = time.monotonic() + 5  # the third request may finish in the same step as the two
        while sum(o.finished for o in outs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(o.finished for o in outs) == 2
    finally:
        engine.stop()


def test_sampling_runs_inside_the_core_turn(lock_dir, checkpoint, monkeypatch):
    """The lm_head is a fifth of the default model's weights: run beside another engine's
    forward, both OpenMP teams would fight for the cores."""
    from backends import scheduler
    from backends.request import SamplingParams
    from tests.engine_utils import collect, small_engine
    held, real_sample = [], scheduler.sample

    def sample(*args, **kwargs):
        held.append(CoreTurns(engine.cfg.cores, first=False).busy())
        return real_sample(*args, **kwargs)
    monkeypatch.setattr(scheduler, "sample", sample)
    engine = small_engine(checkpoint("llama"), core_turns="on")
    try:
        assert collect(engine, [[5, 6, 7]], SamplingParams(max_tokens=3))[0][-1].finish_reason == "length"
    finally:
        engine.stop()
    assert held == [True] * 3


def test_a_waiting_decode_gets_one_forward_between_two_prefill_forwards(lock_dir):
    """A burst of prompts does not hold a waiting decode engine back for the whole burst:
    prefill and decode alternate, as the colocated engine's mixed steps do."""
    decode, prefill = CoreTurns([0], first=False), CoreTurns([0], first=True)
    order = []

    def decode_loop():   # as Scheduler._wait_for_cores: poll, then the forward
        while decode.busy():
            time.sleep(0.02)
        with decode:
            order.append("decode")
    with prefill:
        decode.mark_waiting()
        loop = threading.Thread(target=decode_loop)
        loop.start()
        time.sleep(0.05)
        order.append("prefill 1")
    with prefill:   # the next prompt's forward, at once
        order.append("prefill 2")
    loop.join(5)
    assert order == ["prefill 1", "decode", "prefill 2"]


def test_a_wait_that_ends_without_a_forward_does_not_hold_prefill(lock_dir, checkpoint):
    """The engine marks its wait for the cores; a request aborted meanwhile leaves nothing to
    run, and the mark must go with it, or the next prefill forward would wait for ever."""
    from backends.request import SamplingParams
    from tests.engine_utils import small_engine
    engine = small_engine(checkpoint("llama"), core_turns="on")
    prefill = CoreTurns(engine.cfg.cores, first=True)
    try:
        with CoreTurns(engine.cfg.cores, first=True):   # another prefill forward holds the cores
            request = engine.generate([5, 6, 7], SamplingParams(max_tokens=4), lambda out: None)
            time.sleep(0.1)   # the loop is waiting for the cores, marked
            engine.abort(request)
            time.sleep(0.1)
        entered = threading.Event()
        waiter = threading.Thread(target=lambda: prefill.__enter__() and entered.set())
        waiter.start()
        assert entered.wait(2), "the mark outlived the wait"
        prefill.__exit__()
        waiter.join(5)
    finally:
        engine.stop()
