"""Prefix caching through tritonserver (issue 34): `num_cached_tokens` in the first and
the last response, the Prometheus counters and the cached-pages gauge, for `llm` and for
`router` (whose prefill engine caches), and `cache_salt` as an input."""
import time

import numpy as np
import pytest

from backends.grpc_stream import stream_events
from backends.triton_io import output_arrays, parse_request
from client.stream import build_inputs
from client.triton_server import TritonServer, free_port
from tests.test_router import disagg_parameters

PROMPT = ("You are a helpful assistant who answers in one short sentence. The user asks about the capital "
          "cities of Europe and their rivers. ") * 3 + "Which river flows through Paris?"


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    server = TritonServer(str(tmp_path_factory.mktemp("repo_prefix")), models=["llm", "prefill", "decode", "router"],
                          parameters=disagg_parameters(free_port()))
    with server:
        yield server


def generate(server, model: str, salt: bytes | None = None) -> tuple[list[int], list[dict]]:
    """Greedy ids and every response's outputs."""
    extra = {"min_tokens": np.array([8], dtype=np.int32)}
    if salt is not None:
        extra["cache_salt"] = np.array([salt], dtype=np.object_)
    responses, ids = [], []
    for error, outputs in stream_events(server.grpc_url, model,
                                        build_inputs(PROMPT, max_tokens=8, **extra)):
        assert error is None, error
        responses.append(outputs)
        ids += [int(t) for t in outputs.get("output_ids", [])]
    return ids, responses


def cached(responses: list[dict]) -> list[int]:
    """num_cached_tokens of the responses that carry it."""
    return [int(r["num_cached_tokens"][0]) for r in responses if "num_cached_tokens" in r]


def wait_until(condition, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def counters(server, engine: str) -> tuple[float, float]:
    m = server.metrics()
    label = f'{{model="{engine}"}}'
    return m[f"tandem_prefix_cache_queries{label}"], m[f"tandem_prefix_cache_hits{label}"]


def test_the_salt_input_and_the_cached_output():
    inputs = {"text_input": np.array([b"hi"], dtype=np.object_)}
    assert parse_request(inputs.get, 8).cache_salt is None
    for salt, want in [(b"tenant-a", b"tenant-a"), (b"", None)]:
        inputs["cache_salt"] = np.array([salt], dtype=np.object_)
        assert parse_request(inputs.get, 8).cache_salt == want
    arrays = output_arrays("x", [5], None, 40, 1, ("num_cached_tokens",), num_cached=32)
    assert arrays["num_cached_tokens"].tolist() == [32] and arrays["num_cached_tokens"].dtype == np.int32


def test_the_prefix_counters_move_on_by_what_they_grew():
    from backends.triton_adapter import EngineMetrics
    calls = []

    class Family:
        GAUGE, COUNTER = "gauge", "counter"

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind

        def Metric(self, labels):
            family = self
            return type("Metric", (), {"set": lambda _, v: calls.append(("set", family.name, v)),
                                       "increment": lambda _, v: calls.append(("add", family.name, v))})()

    pb = type("pb", (), {"MetricFamily": Family})
    stats = {"kv_pages_cached": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    metrics = EngineMetrics(pb, "llm", stats)
    assert {f.name: f.kind for f in metrics.families.values()} == {
        "tandem_kv_pages_cached": "gauge", "tandem_prefix_cache_queries": "counter", "tandem_prefix_cache_hits": "counter"}
    metrics.update(stats)
    calls.clear()
    metrics.update({"kv_pages_cached": 3, "prefix_cache_queries": 100, "prefix_cache_hits": 64})
    metrics.update({"kv_pages_cached": 3, "prefix_cache_queries": 150, "prefix_cache_hits": 64})
    assert calls == [("set", "tandem_kv_pages_cached", 3.0), ("add", "tandem_prefix_cache_queries", 100.0),
                     ("add", "tandem_prefix_cache_hits", 64.0), ("add", "tandem_prefix_cache_queries", 50.0)]


@pytest.mark.server
@pytest.mark.parametrize("model, engine", [("llm", "llm"), ("router", "prefill")])
def test_a_repeated_prompt_is_served_from_the_cache(server, model, engine):
    queries0, hits0 = counters(server, engine)
    first_ids, first = generate(server, model, salt=model.encode())
    again_ids, again = generate(server, model, salt=model.encode())
    assert first_ids == again_ids
    assert len(first) > 2 and cached(first) == [0, 0]   # the first and the last response carry it
    n = int(first[0]["num_input_tokens"][0])
    assert cached(again) == [(n - 1) // 16 * 16] * 2   # every full page but the one with the last token
    other_ids, other = generate(server, model, salt=b"someone else")
    assert cached(other) == [0, 0] and other_ids == first_ids
    # the counters are published every poll: wait for this model's to move
    want = (queries0 + 3 * n, hits0 + cached(again)[0])
    assert wait_until(lambda: counters(server, engine) == want), (counters(server, engine), want)
    assert server.wait_kv_full(engine)
    m = server.metrics()
    assert m[f'tandem_kv_pages_cached{{model="{engine}"}}'] > 0
