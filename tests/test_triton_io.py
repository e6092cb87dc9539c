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


def wait_for(condition, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def blocked_outbox(backlog: int):
    """An outbox whose first send blocks until released; what it sent, in order."""
    import threading

    from backends.triton_adapter import Outbox, SendPool

    pool, release, sent, first_in = SendPool(4), threading.Event(), [], threading.Event()

    def send(out):
        first_in.set()
        release.wait(5)
        sent.append(out)

    return pool, Outbox(pool, send, backlog), release, first_in, sent


def test_an_outbox_merges_a_backlog_past_its_bound_and_keeps_the_order():
    """The engine never waits for a send: when more outputs than the backlog wait behind the
    stream's blocked send, they go out next as one response (tokens and text in order, the
    last one's counts and end); an error stays a response of its own, after them."""
    from backends.request import RequestOutput

    pool, outbox, release, first_in, sent = blocked_outbox(backlog=1)
    outbox.put(RequestOutput("r", "a", [1], num_output_tokens=1))
    assert first_in.wait(5)
    for k, (text, token) in enumerate([("b", 2), ("c", 3)], start=2):
        outbox.put(RequestOutput("r", text, [token], num_output_tokens=k, logprobs=[{token: (-0.5, 1, text)}]))
    outbox.put(RequestOutput("r", "", [], finished=True, finish_reason="error", error="boom", num_output_tokens=3))
    release.set()
    wait_for(lambda: len(sent) == 3 and not outbox.queued)
    assert [(o.text, o.token_ids, o.num_output_tokens, o.error) for o in sent] == [
        ("a", [1], 1, None), ("bc", [2, 3], 3, None), ("", [], 3, "boom")]
    assert [list(e) for e in sent[1].logprobs] == [[2], [3]]
    pool.close()


def test_an_outbox_sends_a_backlog_within_its_bound_one_response_per_output():
    """As many outputs as the backlog waiting behind a blocked send: each its own response."""
    from backends.request import RequestOutput

    pool, outbox, release, first_in, sent = blocked_outbox(backlog=3)
    outbox.put(RequestOutput("r", "a", [1], num_output_tokens=1))
    assert first_in.wait(5)
    for k, (text, token) in enumerate([("b", 2), ("c", 3), ("d", 4)], start=2):
        outbox.put(RequestOutput("r", text, [token], num_output_tokens=k, finished=k == 4))
    release.set()
    wait_for(lambda: len(sent) == 4 and not outbox.queued)
    assert [(o.text, o.token_ids, o.num_output_tokens, o.finished) for o in sent] == [
        ("a", [1], 1, False), ("b", [2], 2, False), ("c", [3], 3, False), ("d", [4], 4, True)]
    pool.close()


def test_streams_take_turns_on_the_send_threads():
    """One thread, two streams that keep producing: a stream sends once, then waits its turn."""
    import threading

    from backends.request import RequestOutput
    from backends.triton_adapter import Outbox, SendPool

    pool, order, gate = SendPool(1), [], threading.Semaphore(0)

    def sender(name):
        def send(out):
            gate.acquire(timeout=5)
            order.append((name, out.text))
        return send

    a, b = Outbox(pool, sender("a"), 0), Outbox(pool, sender("b"), 0)  # 0: merge whatever waits
    a.put(RequestOutput("a", "1"))
    wait_for(lambda: a.sending)
    b.put(RequestOutput("b", "1"))
    a.put(RequestOutput("a", "2"))
    b.put(RequestOutput("b", "2"))
    for _ in range(3):
        gate.release()
    wait_for(lambda: len(order) == 3)
    assert order == [("a", "1"), ("b", "12"), ("a", "2")]  # b's turn before a's second
    pool.close()


def test_a_send_stuck_on_an_orphaned_stream_gets_a_new_thread_beside_it():
    """A send whose BLS reader died never returns: unstick adds a thread, and the other streams
    are sent (the stuck one is left behind); an outbox not sending adds none."""
    import threading

    from backends.request import RequestOutput
    from backends.triton_adapter import Outbox, SendPool

    pool, never, done = SendPool(1), threading.Event(), []
    stuck = Outbox(pool, lambda out: never.wait(), 0)
    stuck.put(RequestOutput("s", "x"))
    wait_for(lambda: stuck.sending)
    pool.unstick(stuck)
    other = Outbox(pool, done.append, 0)
    other.put(RequestOutput("o", "y"))
    wait_for(lambda: len(done) == 1)
    pool.unstick(other)
    assert len(pool.threads) == 2 and not never.is_set()
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
