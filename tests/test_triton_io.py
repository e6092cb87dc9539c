"""Request tensors -> engine request: every accepted form and every bad input; the adapter's gauges."""
import time

import numpy as np
import pytest

from backends.request import InvalidRequest
from backends.triton_io import output_arrays, parse_request


def getter(**tensors):
    arrays = {k: (np.array([v.encode()], dtype=np.object_) if isinstance(v, str) else np.array([v]))
              for k, v in tensors.items()}
    return arrays.get


def test_trtllm_style_inputs():
    r = parse_request(getter(text_input="hi", max_tokens=np.int32(7), stream=True, temperature=np.float32(0.5),
                             top_k=np.int32(5), top_p=np.float32(0.9), seed=np.uint64(3), min_length=np.int32(2),
                             exclude_input_in_output=True, end_id=np.int32(9)), 16)
    p = r.params
    assert (r.prompt, r.stream, r.exclude_input) == ("hi", True, True)
    assert (p.max_tokens, p.min_tokens, p.top_k, p.seed, p.end_id) == (7, 2, 5, 3, 9)
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9)


def test_vllm_sampling_parameters_with_numbers_as_strings():
    r = parse_request(getter(text_input="hi", sampling_parameters='{"max_tokens":"16","min_tokens":"16",'
                             '"temperature":"0","stop":["\\n"],"ignore_eos":"true"}'), 4)
    assert (r.params.max_tokens, r.params.min_tokens, r.params.stop, r.params.ignore_eos) == (16, 16, ("\n",), True)


def test_defaults():
    r = parse_request(getter(text_input="hi"), 33)
    assert (r.params.max_tokens, r.stream, r.exclude_input, r.chat, r.params.greedy) == (33, False, False, False, True)


def test_stop_words_tensor():
    get = lambda name: {"text_input": np.array([b"x"], dtype=np.object_),
                        "stop_words": np.array([b"a", b"", b"bc"], dtype=np.object_)}.get(name)
    assert parse_request(get, 4).params.stop == ("a", "bc")


@pytest.mark.parametrize("tensors, message", [
    ({}, "missing input 'text_input'"),
    ({"text_input": "  "}, "prompt .* is empty"),
    ({"text_input": "x", "max_tokens": np.int32(0)}, "max_tokens must be >= 1"),
    ({"text_input": "x", "max_tokens": np.int32(-5)}, "max_tokens must be >= 1"),
    ({"text_input": "x", "sampling_parameters": "{bad json"}, "not valid JSON"),
    ({"text_input": "x", "sampling_parameters": "[1]"}, "must be a JSON object"),
    ({"text_input": "x", "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens must be a int"),
    ({"text_input": "x", "top_p": np.float32(0)}, "top_p must be in"),
    ({"text_input": "x", "temperature": np.float32(-1)}, "temperature must be >= 0"),
    ({"text_input": "x", "temperature": np.float32("nan")}, "temperature must be a finite number"),
    ({"text_input": "x", "temperature": np.float32("inf")}, "temperature must be a finite number"),
    ({"text_input": "x", "top_p": np.float32("nan")}, "top_p must be a finite number"),
    ({"text_input": "x", "sampling_parameters": '{"temperature": "NaN"}'}, "temperature must be a finite"),
    ({"text_input": "x", "sampling_parameters": '{"max_tokens": "inf"}'}, "max_tokens must be a int"),
    ({"text_input": "x", "sampling_parameters": '{"seed": -1}'}, "seed must be in"),
    ({"text_input": "x", "end_id": np.int32(-2)}, "end_id must be >= 0"),
])
def test_bad_input_is_a_clear_error(tensors, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(getter(**tensors), 16)


@pytest.mark.parametrize("name", ["text_input", "stop_words", "sampling_parameters"])
def test_bytes_that_are_not_utf8_are_named(name):
    arrays = {"text_input": np.array([b"hi"], dtype=np.object_), name: np.array([b"\xff\xfe ok"], dtype=np.object_)}
    with pytest.raises(InvalidRequest, match=f"^{name} is not valid UTF-8$"):
        parse_request(arrays.get, 16)


def test_output_arrays_only_what_was_asked():
    arrays = output_arrays("é", [1, 2], "stop", 3, 2, ("text_output", "output_ids"))
    assert set(arrays) == {"text_output", "output_ids"}
    assert arrays["text_output"][0].decode() == "é" and arrays["output_ids"].tolist() == [1, 2]


def test_engine_gauges_set_only_when_changed():
    """Each gauge set is a round trip to the server: EngineMetrics skips unchanged values."""
    from backends.triton_adapter import EngineMetrics

    sets = []

    class Family:
        GAUGE, COUNTER = "gauge", "counter"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):
            family = self
            return type("Gauge", (), {"set": lambda _, v: sets.append((family.name, v))})()

    pb = type("pb", (), {"MetricFamily": Family})
    metrics = EngineMetrics(pb, "llm", {"running": 0, "waiting": 0, "kv_pages_free": 8, "kv_pages_total": 8})
    metrics.update({"running": 0, "waiting": 0, "kv_pages_free": 8, "kv_pages_total": 8})
    assert len(sets) == 4
    metrics.update({"running": 1, "waiting": 0, "kv_pages_free": 8, "kv_pages_total": 8})
    metrics.update({"running": 1, "waiting": 0, "kv_pages_free": 8, "kv_pages_total": 8})
    assert sets[4:] == [("tandem_running", 1.0)]


def test_send_pool_overlaps_a_steps_sends_and_drain_waits_for_them():
    """Two sends that each wait for the other finish only if they run at once; drain returns
    after both, and a failed send is logged, not raised into every later step."""
    import threading
    import time

    from backends.triton_adapter import SendPool

    pool, both, done = SendPool(4), threading.Barrier(2, timeout=5), []

    def send(name):
        both.wait()
        time.sleep(0.05)
        done.append(name)

    pool.submit(send, "a")
    pool.submit(send, "b")
    pool.drain()
    assert sorted(done) == ["a", "b"] and pool.pending == []
    pool.submit(lambda: 1 / 0)
    pool.drain()
    pool.submit(done.append, "c")
    pool.drain()
    assert done[-1] == "c" and pool.pending == []
    pool.close()


def test_send_pool_stops_waiting_for_a_send_to_an_orphaned_stream():
    """A send whose BLS reader died never returns: once its stream is orphaned, drain
    returns and a new thread serves the later sends (the stuck one is left behind)."""
    import threading

    from backends.triton_adapter import SendPool

    class Stream:
        orphaned = False

    pool, never, done, stream = SendPool(1), threading.Event(), [], Stream()
    pool.submit(never.wait, stream=stream)
    threading.Timer(0.3, lambda: setattr(stream, "orphaned", True)).start()
    pool.drain()  # returns only because the stream was orphaned
    assert stream.orphaned and not never.is_set()
    pool.submit(done.append, "next")
    pool.drain()
    assert done == ["next"] and len(pool.threads) == 2
    never.set()
    pool.close()


def test_a_dead_or_zombie_or_reused_parent_is_not_alive():
    """The engine aborts a BLS request whose parent is gone; a dead stub is a zombie until
    the server reaps it, and a reused pid has another start time."""
    import signal
    import subprocess

    from backends.triton_stream import process_alive, process_identity

    child = subprocess.Popen(["sleep", "30"])
    identity = process_identity(child.pid)
    assert process_alive(identity) and process_alive(process_identity())
    child.send_signal(signal.SIGSEGV)
    for _ in range(100):  # not reaped: a zombie
        if not process_alive(identity):
            break
        time.sleep(0.02)
    assert not process_alive(identity)
    child.wait()
    assert not process_alive(identity)
    pid, start = process_identity().split(":")
    assert not process_alive(f"{pid}:{int(start) + 1}") and not process_alive("garbage")


def test_the_router_loads_neither_torch_nor_the_engine():
    """The router has no engine: its stub must not pay for torch and the model code."""
    import subprocess
    import sys
    code = "import sys, backends.disagg.router; print(sorted(m for m in ('torch', 'backends.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
