"""One decode engine fed by two prefill engines (real NIXL transports, in this
process): each request names the prefill agent that writes its KV, decode keeps
a peer per agent, and a peer that fails or is unreachable fails only its own
rooms. Every pool is whole afterwards."""
import queue
import random
import time

import pytest

from backends.config import EngineConfig
from backends.disagg.config import DisaggConfig
from backends.disagg.local import drain
from backends.disagg.prefill import prefill_agent_name
from backends.engine import Engine
from backends.request import SamplingParams
from tests.engine_utils import collect, token_ids
from client.triton_server import free_port
from tests.test_disagg import wait_for
from tests.test_model_parity import prompts

PARAMS = SamplingParams(max_tokens=20, min_tokens=20)
BASE = dict(page_size=4, num_pages=256, chunk_size=16, max_batch_tokens=40, max_running_requests=8, threads=1)


def agent(port: int) -> str:
    return f"{prefill_agent_name(port)}@127.0.0.1:{port}"


def start_prefill(path: str, port: int) -> Engine:
    cfg = DisaggConfig(nixl_port=port, transfer_timeout_s=30)
    return Engine(EngineConfig(model_path=path, **BASE, role="prefill"), disagg=cfg).start()


HANDSHAKE_S = 10  # long beside a request's service on a loaded 2-core machine


class Trio:
    """Two prefill engines and one decode engine whose default prefill_address has no one
    listening: a request reaches a prefill engine only through its prefill_agent."""

    def __init__(self, path: str):
        self.path, self.ports = path, [free_port(), free_port()]
        self.prefills = [start_prefill(path, port) for port in self.ports]
        cfg = DisaggConfig(prefill_address=f"127.0.0.1:{free_port()}", transfer_timeout_s=30,
                           handshake_timeout_s=HANDSHAKE_S)
        self.decode = Engine(EngineConfig(model_path=path, **BASE, role="decode"), disagg=cfg).start()

    def submit(self, ids: list[int], params: SamplingParams, which: int, to_prefill: bool = True):
        room, d, p = random.getrandbits(62) + 1, queue.Queue(), queue.Queue()
        self.decode.generate(ids, params, d.put, request_id=f"room-{room}", room=room,
                             prefill_agent=agent(self.ports[which]))
        if to_prefill:
            self.prefills[which].generate(ids, params, p.put, request_id=f"room-{room}", room=room)
        return room, d, p

    def restart(self, which: int) -> None:
        """Stop the engine, then start a new one on the same port (so under the same agent name)."""
        self.prefills[which].stop()
        self.prefills[which] = start_prefill(self.path, self.ports[which])

    def kv_whole(self, engines=None) -> bool:
        for e in engines or [self.decode, *self.prefills]:
            stats = e.stats()
            if stats["kv_pages_free"] + stats["kv_pages_cached"] != stats["kv_pages_total"]:
                return False
            e.runner.pool.check_integrity()
        return True

    def close(self) -> None:
        for e in [self.decode, *self.prefills]:
            e.stop()


@pytest.fixture
def trio(checkpoint):
    t = Trio(checkpoint("llama"))
    yield t
    t.close()


def test_requests_paired_with_either_prefill_engine_equal_colocated(trio, colocated):
    batch = prompts(6)
    expected = [token_ids(o) for o in collect(colocated, batch, PARAMS)]
    handles = [trio.submit(ids, PARAMS, i % 2) for i, ids in enumerate(batch)]
    for (_, d, p), want in zip(handles, expected):
        dec = drain(d, 60)
        assert dec[-1].error is None and token_ids(dec) == want and drain(p, 60)[-1].error is None
    assert all(e.stats()["kv_bytes_sent"] > 0 for e in trio.prefills), "both prefill engines wrote KV"
    assert sorted(trio.decode.scheduler.role.peers) == sorted(prefill_agent_name(p) for p in trio.ports)
    assert wait_for(trio.kv_whole)


def test_a_stopped_prefill_engine_fails_only_its_rooms(trio, colocated):
    """Rooms of engine 0 wait for KV it will never write (it never got their requests) when
    it stops: they fail at once, not at the transfer timeout; engine 1's requests, in flight
    then and sent after, are served exactly. A restarted engine 0 is dialed again."""
    long = SamplingParams(max_tokens=200, min_tokens=200)
    stranded = [trio.submit(ids, PARAMS, 0, to_prefill=False) for ids in prompts(2)]
    serving = trio.submit(prompts(3)[2], long, 1)
    assert wait_for(lambda: trio.decode.stats()["transferring"] == 2 and trio.decode.stats()["running"] == 1)
    trio.prefills[0].stop()
    start = time.monotonic()
    for _, d, _ in stranded:
        assert "lost the prefill engine" in drain(d, 10)[-1].error
    assert time.monotonic() - start < 5
    later = trio.submit(prompts(4)[3], PARAMS, 1)
    expected = [token_ids(o) for o in collect(colocated, [prompts(3)[2], prompts(4)[3]], [long, PARAMS])]
    for (_, d, p), want in zip([serving, later], expected):
        dec = drain(d, 60)
        assert dec[-1].error is None and token_ids(dec) == want and drain(p, 60)[-1].error is None
    assert wait_for(lambda: trio.kv_whole([trio.decode, trio.prefills[1]]))

    trio.restart(0)
    _, d, p = trio.submit(prompts(1)[0], PARAMS, 0)
    assert drain(d, 30)[-1].error is None and drain(p, 30)[-1].error is None
    assert wait_for(trio.kv_whole)


def test_an_unreachable_prefill_agent_does_not_hold_up_the_others(trio):
    """The handshake with a dead address takes the whole handshake timeout; requests paired
    with a live engine are served meanwhile (decode's transfer thread does not wait for it)."""
    dead = free_port()
    room = random.getrandbits(62) + 1
    lost = queue.Queue()
    trio.decode.generate(prompts(1)[0], PARAMS, lost.put, request_id=f"room-{room}", room=room,
                         prefill_agent=agent(dead))
    peers = trio.decode.scheduler.role.peers
    name = prefill_agent_name(dead)
    assert wait_for(lambda: name in peers and peers[name].state == "connecting")  # its dial has started
    _, d, p = trio.submit(prompts(2)[1], PARAMS, 1)
    assert drain(d, 30)[-1].error is None and drain(p, 30)[-1].error is None
    assert lost.empty(), "a live engine's request waited for a dead one's handshake"
    assert "unreachable" in drain(lost, 30)[-1].error
    assert wait_for(trio.kv_whole)
