"""The router's endpoint choice and health, without servers (backends.disagg.endpoints, and the
router's health thread and local `describe` over a stand-in for the stub's BLS)."""
import collections
import time

import numpy as np
import pytest

from backends.disagg.endpoints import (PIECE_CHARS, Endpoint, Endpoints, PrefixMemory, RoutingConfig,
                                       parse_endpoints, prefix_chain)


def endpoints(policy: str = "cache_aware", n: int = 2, answers=None, **cfg) -> Endpoints:
    """n prefill endpoints and one decode endpoint, each in the rotation (one good check)."""
    answers = answers if answers is not None else {}

    def describe(ep: Endpoint) -> dict:   # an exception in `answers` is the check failing
        answer = answers.get(ep.address, _good(ep))
        if isinstance(answer, Exception):
            raise answer
        return answer
    eps = Endpoints([Endpoint("prefill", f"p{i}:1", None) for i in range(n)], [Endpoint("decode", "d:1", None)],
                    RoutingConfig(prefill_policy=policy, **cfg), describe)
    for ep in eps.all:
        assert eps.check(ep)
    return eps


def _good(ep: Endpoint) -> dict:
    return {"role": ep.kind, "agent": f"agent-{ep.address}", "nixl_port": 2} if ep.kind == "prefill" else {"role": "decode"}


def test_parse_endpoints_refuses_what_is_not_an_address():
    assert parse_endpoints(" local , h:8001", "x") == ["local", "h:8001"]
    for bad, message in (("", "entry 1 of '' is empty"), ("h:1,", "entry 2"), ("h", "neither"),
                         ("h:99999", "neither"), ("h:1,h:1", "twice")):
        with pytest.raises(ValueError, match=message):
            parse_endpoints(bad, "prefill_endpoints")


def test_prefix_chain_is_salted_and_prefix_closed():
    text = "x" * (3 * PIECE_CHARS + 5)
    chain = prefix_chain(text)
    assert len(chain) == 3 and prefix_chain(text[:2 * PIECE_CHARS]) == chain[:2]
    assert prefix_chain(text, b"other")[0] != chain[0]
    memory = PrefixMemory(capacity=4)
    memory.remember(chain)
    assert memory.matched(chain) == 3 and memory.matched(prefix_chain("y" + text[1:])) == 0
    memory.remember(prefix_chain("z" * 2 * PIECE_CHARS))   # 5 pieces > 4: the oldest goes
    assert memory.matched(chain) == 0 and len(memory) == 4


def test_cache_aware_sends_a_shared_prefix_where_it_went_and_new_ones_to_the_least_loaded():
    eps = endpoints()
    a = prefix_chain("A" * 10 * PIECE_CHARS)
    first = eps.choose("prefill", a)
    eps.sent(first, a, 1)
    for _ in range(5):
        assert eps.choose("prefill", a + prefix_chain("tail" * PIECE_CHARS)[:1]) is first
    other = eps.choose("prefill", prefix_chain("B" * 10 * PIECE_CHARS))
    assert other is not first   # no match anywhere: the less loaded one (first holds a request)


def test_cache_aware_gives_way_to_load_out_of_balance():
    eps = endpoints(balance_abs_threshold=2, balance_rel_threshold=1.5)
    a = prefix_chain("A" * 10 * PIECE_CHARS)
    first = eps.prefill[0]
    eps.sent(first, a, 1)
    assert eps.choose("prefill", a) is first
    eps.sent(first, [], 3)   # load 4 against 0
    assert eps.choose("prefill", a) is eps.prefill[1]
    eps.done(first, 3)
    assert eps.choose("prefill", a) is first


def test_round_robin_spreads_and_least_load_takes_the_idle_one():
    eps = endpoints("round_robin", n=3)
    assert [eps.choose("prefill", []).address for _ in range(6)] == ["p0:1", "p1:1", "p2:1"] * 2
    eps = endpoints("least_load", n=2)
    eps.sent(eps.prefill[0], [], 1)
    assert {eps.choose("prefill", []).address for _ in range(4)} == {"p1:1"}


def test_an_endpoint_leaves_after_unhealthy_after_failures_and_returns_after_healthy_after():
    answers = {}
    eps = endpoints(n=2, answers=answers, unhealthy_after=3, healthy_after=2)
    dead = eps.prefill[0]
    answers[dead.address] = RuntimeError("connection refused")
    for expected in (True, True, False):
        assert not eps.check(dead)
        assert dead.healthy is expected
    assert {eps.choose("prefill", []).address for _ in range(4)} == {"p1:1"}
    del answers[dead.address]
    assert eps.check(dead) and not dead.healthy   # one good check is not enough
    assert eps.check(dead) and dead.healthy
    answers["p1:1"] = RuntimeError("down")
    for _ in range(3):
        eps.check(eps.prefill[1])
    answers[dead.address] = RuntimeError("down")
    for _ in range(3):
        eps.check(dead)
    assert eps.choose("prefill", []) is None


def test_a_wrong_role_or_a_prefill_without_agent_fails_its_check():
    eps = endpoints(n=1)
    eps.describe = lambda ep: {"role": "decode"}
    assert not eps.check(eps.prefill[0])
    eps.describe = lambda ep: {"role": "prefill"}
    assert not eps.check(eps.prefill[0])


def test_a_new_endpoint_joins_on_its_first_good_check():
    eps = Endpoints([Endpoint("prefill", "p:1", None)], [], RoutingConfig(), _good)
    assert eps.choose("prefill", []) is None
    assert eps.check(eps.prefill[0]) and eps.choose("prefill", []) is eps.prefill[0]


def test_routing_config_refuses_bad_values_naming_them():
    with pytest.raises(ValueError, match="decode_policy must be least_load or round_robin, got 'cache_aware'"):
        RoutingConfig(decode_policy="cache_aware")
    with pytest.raises(ValueError, match="cache_threshold must be in"):
        RoutingConfig(cache_threshold=1.5)


def _asking(down: set[str]):
    """A describe that counts the checks by endpoint label and fails for the labels in `down`."""
    asked = collections.Counter()

    def describe(ep: Endpoint) -> dict:
        asked[ep.label] += 1
        if ep.label in down:
            raise RuntimeError("down")
        return _good(ep)
    return asked, describe


def test_the_health_thread_asks_remote_endpoints_only_and_the_request_path_brings_local_ones_back():
    from backends.disagg.router import HealthChecker
    down = set()
    asked, describe = _asking(down)

    def wait_remote_checks(count: int) -> None:
        target, deadline = asked["prefill p:1"] + count, time.monotonic() + 10
        while asked["prefill p:1"] < target:
            assert time.monotonic() < deadline, "the health thread stopped asking the remote endpoint"
            time.sleep(0.005)
    eps = Endpoints([Endpoint("prefill", "local", None), Endpoint("prefill", "p:1", None)],
                    [Endpoint("decode", "local", None)],
                    RoutingConfig(health_interval_s=0.01, unhealthy_after=1, healthy_after=2), describe)
    local = eps.prefill[0]
    health = HealthChecker(eps)
    try:
        wait_remote_checks(5)
        assert asked["prefill local"] == asked["decode local"] == 0
        health.check_out("prefill")   # never answered: asked once, and in
        assert local.healthy and asked["prefill local"] == 1
        down.add(local.label)
        assert not eps.check(local) and not local.healthy   # a failed request's check
        down.clear()
        wait_remote_checks(5)
        assert not local.healthy and asked["prefill local"] == 2   # nothing but the request path asks it
        health.check_out("prefill")   # healthy_after good checks in a row, at once
        assert local.healthy and asked["prefill local"] == 4 and asked["decode local"] == 0
    finally:
        health.stop()
    assert not health.thread.is_alive()


def test_a_local_endpoint_out_of_the_rotation_is_asked_again_once_an_interval_on_the_request_path():
    from backends.disagg.router import HealthChecker
    down = {"prefill local"}
    asked, describe = _asking(down)
    eps = Endpoints([Endpoint("prefill", "local", None), Endpoint("prefill", "p:1", None)], [],
                    RoutingConfig(health_interval_s=60, unhealthy_after=1, healthy_after=1), describe)
    local, remote = eps.prefill
    assert eps.check(remote) and not eps.check(local)
    local.identity = {"role": "prefill", "agent": "a", "nixl_port": 2}   # it had answered before
    down.clear()
    health = HealthChecker(eps)
    try:
        health.check_local("prefill")   # the remote one is in: no check_out, but this one is due
        assert local.healthy and asked["prefill local"] == 2
        down.add(local.label)
        assert not eps.check(local)      # a failed request's check
        health.check_local("prefill")   # within the interval of the last one it began: not asked
        assert not local.healthy and asked["prefill local"] == 3
    finally:
        health.stop()


class _Response:
    def __init__(self, error: str | None = None, text: bytes = b""):
        self.message, self.text = error, text

    def has_error(self) -> bool:
        return self.message is not None

    def error(self):
        return type("Error", (), {"message": lambda _: self.message})()

    def output_tensors(self) -> list:
        array = np.array([self.text], dtype=np.object_)
        return [type("Tensor", (), {"name": lambda _: "text_output", "as_numpy": lambda _: array})()]


class _Pb:
    """What LocalChild.describe uses of triton_python_backend_utils: exec answers `responses`."""

    def __init__(self, responses: list):
        self.iterator = iter(responses)
        pb = self

        class InferenceRequest:
            def __init__(self, **_):
                pass

            def exec(self, decoupled: bool):
                return pb.iterator
        self.InferenceRequest = InferenceRequest
        self.Tensor = lambda name, array: (name, array)


@pytest.mark.parametrize("responses, error", [([_Response(text=b'{"role": "decode"}')], None),
                                              ([_Response("Server not ready")], "Server not ready"),
                                              ([_Response("first"), _Response(text=b"{}")], "first")])
def test_a_local_describe_retires_its_responses_when_it_fails_too(responses, error):
    """The stub frees an iterator Python dropped without the GIL (backends.disagg.router.Retired)."""
    from backends.disagg.router import LocalChild, Retired
    retired = Retired()
    pb = _Pb(responses)
    child = LocalChild(pb, "decode", retired)
    if error:
        with pytest.raises(RuntimeError, match=error):
            child.describe()
    else:
        assert child.describe() == {"role": "decode"}
    assert retired.take() == [pb.iterator] and next(pb.iterator, None) is None   # read to its end
