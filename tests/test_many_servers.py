"""Several tritonservers behind one `router`: two prefill servers and one decode, then one
prefill and two decode servers (as many hosts would run them; here free ports and distinct
NIXL ports on one machine). Choice by policy, failover when a server is SIGKILLed, and
rejoining when it comes back."""
import concurrent.futures
import os
import shutil
import signal
import time

import pytest

from client.stream import stream_generate
from client.triton_server import TritonServer, free_port, set_parameters
from tests.test_router import ENGINE, PROMPTS, wait_endpoint_health

pytestmark = pytest.mark.server
KNOBS = {"pipeline_min_tokens": "128", "transfer_timeout_s": "10", "handshake_timeout_s": "5"}
SHARED = "You are a helpful assistant for a hardware store. " * 12   # a long system-prompt-like prefix


def add_copy(server: TritonServer, model: str, name: str, parameters: dict[str, str]) -> None:
    """A second instance of `model` in the server's repository, under `name`, with other parameters."""
    dst = os.path.join(server.repo_dir, name)
    shutil.copytree(os.path.join(server.repo_dir, model), dst)
    path = os.path.join(dst, "config.pbtxt")
    with open(path) as f:
        text = set_parameters(f.read().replace(f'name: "{model}"', f'name: "{name}"'), parameters)
    with open(path, "w") as f:
        f.write(text)


def requests_to(server: TritonServer, endpoint: str, model: str = "router") -> float:
    return server.metric("tandem_router_requests", endpoint=endpoint, model=model) or 0.0


def run_all(url: str, model: str, prompts: list[str], max_tokens: int = 24):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: stream_generate(url, model, p, max_tokens=max_tokens, chat=True), prompts))


def wait_for(condition, timeout_s: float = 15) -> bool:
    """Counters reach the metrics port on the router's next poll: wait for what they should say."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def ended(result) -> bool:
    """Finished with its tokens, or ended with an error (never cut short in silence)."""
    return bool(result.error) or (result.finish_reason in ("length", "stop") and result.token_ids)


def kill_while_streaming(a: TritonServer, model: str, prompts: list[str], max_tokens: int,
                         victim: TritonServer, holder: TritonServer) -> None:
    """Streams the prompts through `model` on A and SIGKILLs `victim` once `holder`'s decode
    holds their KV: every stream ends (tokens or an error) within a minute, none hangs."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        pending = [pool.submit(stream_generate, a.grpc_url, model, p, max_tokens=max_tokens, chat=True)
                   for p in prompts]
        assert holder.wait_kv_used("decode", timeout_s=30)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        results = [f.result(timeout=60) for f in pending]
    assert all(ended(r) for r in results), [(r.finish_reason, r.error) for r in results]


@pytest.fixture(scope="module")
def two_prefill(default_model, tmp_path_factory):
    """P1 and P2 run prefill; A runs decode, `router` (cache_aware) and `router_rr` (round_robin) over both."""
    prefills = [TritonServer(str(tmp_path_factory.mktemp(f"prefill{i}")), models=["prefill"],
                             parameters={"prefill": {**ENGINE, **KNOBS, "nixl_port": str(free_port())}})
                for i in (1, 2)]
    for server in prefills:
        server.start()
    try:
        endpoints = ",".join(p.grpc_url for p in prefills)
        a = TritonServer(str(tmp_path_factory.mktemp("a")), models=["decode", "router"],
                         parameters={"decode": {**ENGINE, **KNOBS}, "router": {"prefill_endpoints": endpoints}})
        add_copy(a, "router", "router_rr", {"prefill_policy": "round_robin"})
        with a:
            for p in prefills:
                assert wait_endpoint_health(a, p.grpc_url, 1.0)
            yield a, prefills
    finally:
        for server in prefills:
            server.stop()


def test_two_prefill_servers_equal_transformers_and_both_serve(two_prefill):
    from tests.test_server import greedy_ids
    a, prefills = two_prefill
    before = [requests_to(a, p.grpc_url, "router_rr") for p in prefills]
    for prompt, result in zip(PROMPTS, run_all(a.grpc_url, "router_rr", PROMPTS)):
        assert result.error is None and result.token_ids == greedy_ids(prompt, 24), prompt[:40]
    served = lambda: [requests_to(a, p.grpc_url, "router_rr") - b for p, b in zip(prefills, before)]
    assert wait_for(lambda: sum(served()) == len(PROMPTS)) and min(served()) >= 2, served()
    assert a.wait_kv_full("decode") and all(p.wait_kv_full("prefill") for p in prefills)


def test_shared_prefix_sticks_under_cache_aware_and_spreads_under_round_robin(two_prefill):
    a, prefills = two_prefill
    for model, sticks in (("router", True), ("router_rr", False)):
        before = [requests_to(a, p.grpc_url, model) for p in prefills]
        hits = [p.metrics().get('tandem_prefix_cache_hits{model="prefill"}', 0) for p in prefills]
        for i in range(6):  # one after another: load is equal each time
            result = stream_generate(a.grpc_url, model, f"{SHARED} Question {i}: where are the nails?",
                                     max_tokens=4, chat=True)
            assert result.error is None
        served = lambda: sorted(requests_to(a, p.grpc_url, model) - b for p, b in zip(prefills, before))
        assert wait_for(lambda: sum(served()) == 6) and served() == ([0, 6] if sticks else [3, 3]), (model, served())
        if sticks:  # the server that got them all computed the prefix once
            gained = [p.metrics().get('tandem_prefix_cache_hits{model="prefill"}', 0) - h for p, h in zip(prefills, hits)]
            assert max(gained) >= 5 * len(SHARED) // 8, gained   # >= 5 requests x most of the prefix's tokens
    assert a.wait_kv_full("decode") and all(p.wait_kv_full("prefill") for p in prefills)


def test_prefill_server_killed_idle_and_under_load(two_prefill):
    """P1 dies idle: requests sent at once (before failed checks take it out of the rotation)
    that go to P1 fail there before any token and are tried again on P2, without an error;
    once it is out, every request goes to P2. Restarted, it rejoins; killed again while
    requests stream, each of them ends (tokens or an error), none hangs, pools whole."""
    a, (p1, p2) = two_prefill
    prompts = [f"Tell me a story about the number {i}." for i in range(6)]
    os.killpg(p1.proc.pid, signal.SIGKILL)
    sent_p1 = requests_to(a, p1.grpc_url, "router_rr")
    retried = run_all(a.grpc_url, "router_rr", prompts[:4], max_tokens=8)
    assert [r.error for r in retried] == [None] * 4
    assert wait_for(lambda: requests_to(a, p1.grpc_url, "router_rr") > sent_p1), "nothing went to the dead server"
    assert wait_endpoint_health(a, p1.grpc_url, 0.0), "the killed prefill server must leave the rotation"
    to_p2 = requests_to(a, p2.grpc_url, "router_rr")
    after = run_all(a.grpc_url, "router_rr", prompts, max_tokens=8)
    assert [r.error for r in after] == [None] * len(prompts)
    assert wait_for(lambda: requests_to(a, p2.grpc_url, "router_rr") - to_p2 == len(prompts))
    p1.start()   # same ports
    assert wait_endpoint_health(a, p1.grpc_url, 1.0), "the restarted prefill server must rejoin"
    kill_while_streaming(a, "router_rr", prompts, 48, victim=p1, holder=a)
    assert wait_endpoint_health(a, p1.grpc_url, 0.0)
    assert a.wait_kv_full("decode", timeout_s=15) and p2.wait_kv_full("prefill")
    assert [r.error for r in run_all(a.grpc_url, "router", prompts[:2], max_tokens=8)] == [None] * 2


def test_two_decode_servers_one_killed_then_back(default_model, tmp_path_factory):
    """A runs router and prefill; D1 and D2 run decode. Both serve; D1 dies mid-stream: its
    streams end with an error (or finish), none hangs, later requests all go to D2; D1
    restarted rejoins."""
    from tests.test_server import greedy_ids
    decodes = [TritonServer(str(tmp_path_factory.mktemp(f"decode{i}")), models=["decode"],
                            parameters={"decode": {**ENGINE, **KNOBS}}) for i in (1, 2)]
    for server in decodes:
        server.start()
    try:
        a = TritonServer(str(tmp_path_factory.mktemp("a2")), models=["prefill", "router"], parameters={
            "prefill": {**ENGINE, **KNOBS, "nixl_port": str(free_port())},
            "router": {"decode_endpoints": ",".join(d.grpc_url for d in decodes)}})
        with a:
            d1, d2 = decodes
            for d in decodes:
                assert wait_endpoint_health(a, d.grpc_url, 1.0)
            for prompt, result in zip(PROMPTS, run_all(a.grpc_url, "router", PROMPTS)):
                assert result.error is None and result.token_ids == greedy_ids(prompt, 24), prompt[:40]
            assert wait_for(lambda: min(requests_to(a, d.grpc_url) for d in decodes) >= 1)
            prompts = [f"Write a long poem about the sea, verse {i}." for i in range(6)]
            kill_while_streaming(a, "router", prompts, 64, victim=d1, holder=d1)
            assert wait_endpoint_health(a, d1.grpc_url, 0.0), "the killed decode server must leave the rotation"
            to_d2 = requests_to(a, d2.grpc_url)
            after = run_all(a.grpc_url, "router", prompts, max_tokens=8)
            assert [r.error for r in after] == [None] * len(prompts)
            assert wait_for(lambda: requests_to(a, d2.grpc_url) - to_d2 == len(prompts))
            assert a.wait_kv_full("prefill", timeout_s=15) and d2.wait_kv_full("decode")
            d1.start()
            assert wait_endpoint_health(a, d1.grpc_url, 1.0), "the restarted decode server must rejoin"
            to_d1 = requests_to(a, d1.grpc_url)
            again = run_all(a.grpc_url, "router", prompts[:4], max_tokens=8)
            assert [r.error for r in again] == [None] * 4
            assert wait_for(lambda: requests_to(a, d1.grpc_url) > to_d1)
            assert a.wait_kv_full("prefill") and d1.wait_kv_full("decode")
    finally:
        for server in decodes:
            server.stop()
