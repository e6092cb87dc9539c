"""Engines in processes of their own behind one Triton model instance: DP attention
(`dp_size` > 1; issue 26), or one engine (`engine_process` own: the stub's Python then
spends its interpreter lock on streaming alone, not on the engine's step too).

The model instance's stub process holds no engine. It starts `dp_size` rank processes
(`python -m backends.dp_group`), each an `Engine` with its own scheduler, requests and KV
pool, joined in one gloo group (backends.dp: attention per rank, the MLP split across
them, every rank in every step; a lone rank joins no group). The stub checks and tokenizes
each request, sends it to a rank (`choose_rank`: where its prompt's prefix is likely
cached, unless that rank has clearly more to compute than another), and relays the rank's
outputs to the request's sink; an abort goes to the rank that holds the request.

Each rank talks to the stub over two pipes (pickled messages, multiprocessing.connection):
no port, and a rank's death is an end of file at once. A rank that dies takes the group
with it (the others cannot run a layer without it): every request still running on any
rank ends with an error that names the rank, the other ranks are stopped, and new requests
are refused with the same message; `tandem_dp_ranks_alive` drops. Triton 2.51's Python
backend cannot mark a loaded model not ready, so the error and the gauge are the signal.
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection, wait
from typing import Callable

from backends.config import EngineConfig
from backends.engine import check_request, load_tokenizer, tokenize
from backends.model_config import ModelConfig
from backends.ports import free_port
from backends.request import InvalidRequest, Request, RequestOutput, SamplingParams

log = logging.getLogger("tandem.dp")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_TIMEOUT_S = 600        # a rank loads its weights before it says ready
STATS_EVERY_S = 0.25         # a rank's stats (the model's gauges) are this old at most
STOP_TIMEOUT_S = 10
GROUP_BROKE = 3              # a rank's exit code when another rank's end broke its collective


def _python() -> str:
    """The interpreter for the ranks: the stub's own, when it is a Python executable."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    return shutil.which("python3") or "python3"


def page_chain(prompt_ids: list[int], salt: bytes | None, page_size: int) -> list[int]:
    """One hash per full page of the prompt, each over the one before it (the stub's own
    record; ranks match by tokens, not by these)."""
    chain, parent = [], hash(("salt", salt))
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        parent = hash((parent, tuple(prompt_ids[start:start + page_size])))
        chain.append(parent)
    return chain


class RankPrefixes:
    """The pages of prompts a rank was sent, most recent last, at most as many as its pool
    holds: a guess at its prefix cache (it evicts on its own), only to choose a rank."""

    def __init__(self):
        self.pages: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.capacity = 0

    def matched(self, chain: list[int]) -> int:
        """Leading pages of the chain this rank probably holds."""
        count = 0
        for page in chain:
            if page not in self.pages:
                break
            count += 1
        return count

    def add(self, chain: list[int]) -> None:
        for page in chain:
            self.pages[page] = None
            self.pages.move_to_end(page)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


def choose_rank(ranks: list["RankProcess"], chain: list[int], page_size: int) -> tuple["RankProcess", int]:
    """The rank whose tokens to compute, this prompt's own included, are fewest: a rank that
    holds its prefix saves those tokens, so a conversation stays on its rank unless that rank
    is busier than another by more than the prefix is worth. (rank, tokens it holds)"""
    held = [rank.prefixes.matched(chain) * page_size for rank in ranks]
    best = min(range(len(ranks)), key=lambda i: ranks[i].load - held[i])   # the first of equals
    return ranks[best], held[best]


class RankProcess:
    """One rank's process, its two pipes and the stub's view of its load."""

    def __init__(self, rank: int, size: int, port: int, cfg: EngineConfig, disagg, group_cores: list[int]):
        self.rank = rank
        self.name = f"DP rank {rank} of {size}" if size > 1 else "the engine process"
        to_rank_r, to_rank_w = os.pipe()
        from_rank_r, from_rank_w = os.pipe()
        cmd = [_python(), "-m", "backends.dp_group", str(rank), str(size), str(port), str(to_rank_r),
               str(from_rank_w)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(cmd, pass_fds=(to_rank_r, from_rank_w), env=env)
        os.close(to_rank_r)
        os.close(from_rank_w)
        self.send_conn = Connection(to_rank_w, readable=False)
        self.recv_conn = Connection(from_rank_r, writable=False)
        self.send_lock = threading.Lock()
        self.send((cfg, disagg, group_cores))
        self.stats: dict = {}
        self.load = 0                # tokens still to compute of the requests it holds
        self.prefixes = RankPrefixes()
        self.caches = cfg.caches_prefixes
        self.alive = True
        self.identity: dict = {}     # what its engine answers a `describe` (from its ready message)

    def send(self, message) -> None:
        with self.send_lock:
            self.send_conn.send(message)

    def wait_ready(self, timeout_s: float) -> str:
        if not self.recv_conn.poll(timeout_s):
            raise RuntimeError(f"{self.name} did not start within {timeout_s:.0f} s")
        try:
            kind, stats, description, self.identity = self.recv_conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name} exited while loading (code {self.proc.wait()}); "
                               "its error is in the server log") from None
        self.stats = stats
        self.prefixes.capacity = stats["kv_pages_total"] if self.caches else 0
        return description

    def send_quietly(self, message) -> None:
        try:
            self.send(message)
        except OSError:
            pass  # the rank is gone; the relay thread ends its requests

    def join(self) -> None:
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class DpGroup:
    """The engine side of a DP model instance: what `EngineModel` calls on an `Engine`."""

    def __init__(self, cfg: EngineConfig, disagg=None):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model_path)
        self.model_cfg = ModelConfig.load(cfg.model_path)
        self.max_context = cfg.context_limit(self.model_cfg.max_position)
        port = free_port() if cfg.dp_size > 1 else 0   # a lone engine joins no group
        self.ranks = [RankProcess(r, cfg.dp_size, port, cfg.for_rank(r), disagg, cfg.cores)
                      for r in range(cfg.dp_size)]
        self.requests: dict[str, tuple[Request, RankProcess, int]] = {}   # id -> (request, rank, its load)
        self.lock = threading.Lock()
        self.failure: str | None = None   # why the group stopped serving
        try:
            self.descriptions = [rank.wait_ready(READY_TIMEOUT_S) for rank in self.ranks]
        except Exception:
            self.stop()
            raise
        self._relay = threading.Thread(target=self._relay_loop, name="tandem-dp-relay", daemon=True)

    # ---- what EngineModel calls ----------------------------------------------------
    def tokenize(self, prompt: str, chat: bool = False) -> list[int]:
        return tokenize(self.tokenizer, prompt, chat)

    def make_request(self, prompt_ids: list[int], params: SamplingParams,
                     sink: Callable[[RequestOutput], None], request_id: str | None = None,
                     room: int | None = None, cache_salt: bytes | None = None,
                     prefill_agent: str | None = None) -> Request:
        if self.failure is not None:
            raise InvalidRequest(self.failure)
        check_request(self.model_cfg, self.max_context, prompt_ids, params)
        return Request(request_id or uuid.uuid4().hex, prompt_ids, params, sink, None, room, cache_salt, prefill_agent)

    def submit(self, req: Request) -> None:
        chain = page_chain(req.prompt_ids, req.cache_salt, self.cfg.page_size)
        with self.lock:
            if self.failure is not None:
                req.sink(self._error(req.id, self.failure))
                return
            rank, cached = choose_rank([r for r in self.ranks if r.alive], chain, self.cfg.page_size)
            load = len(req.prompt_ids) - cached + req.params.max_tokens
            rank.load += load
            rank.prefixes.add(chain)
            self.requests[req.id] = (req, rank, load)
        rank.send_quietly(("add", req.id, req.prompt_ids, req.params, req.room, req.cache_salt,
                           req.prefill_agent))  # dead: _rank_died

    def generate(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[RequestOutput], None],
                 request_id: str | None = None, room: int | None = None, cache_salt: bytes | None = None,
                 prefill_agent: str | None = None) -> str:
        req = self.make_request(prompt_ids, params, sink, request_id, room, cache_salt, prefill_agent)
        self.submit(req)
        return req.id

    def identity(self) -> dict:
        """A lone engine's own; a DP group's ranks each have an agent of their own: none to pair with
        (prefill runs dp_size 1)."""
        if len(self.ranks) == 1:
            return self.ranks[0].identity
        return {"role": self.cfg.role}

    def abort(self, request_id: str) -> None:
        with self.lock:
            entry = self.requests.get(request_id)
        # an abort that overtook its request (a decode control room) waits on every rank
        for rank in [entry[1]] if entry is not None else [r for r in self.ranks if r.alive]:
            rank.send_quietly(("abort", request_id))

    def stats(self) -> dict:
        total: dict = {}
        for rank in self.ranks:
            for key, value in rank.stats.items():
                total[key] = total.get(key, 0) + value
        total["dp_ranks_alive"] = sum(r.alive for r in self.ranks)
        return total

    def describe(self) -> str:
        if len(self.ranks) == 1:
            return f"in its own process (pid {self.ranks[0].proc.pid}): {self.descriptions[0]}"
        return f"DP attention, {len(self.ranks)} ranks: " + "; ".join(
            f"rank {r}: {d}" for r, d in enumerate(self.descriptions))

    def start(self) -> "DpGroup":
        self._relay.start()
        return self

    def stop(self) -> None:
        self.failure = self.failure or "the model is unloading"
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        for rank in self.ranks:  # all at once: a rank that stops first breaks the others' collectives
            rank.send_quietly(("stop",))
        for rank in self.ranks:
            rank.join()

    # ---- the relay thread ------------------------------------------------------------
    def _relay_loop(self) -> None:
        conns = {rank.recv_conn: rank for rank in self.ranks}
        while conns:
            ready = wait(list(conns))
            for conn in ready:
                if not self._take(conns[conn]):
                    del conns[conn]

    def _take(self, rank: RankProcess) -> bool:
        """Everything the rank has sent so far; False once it is gone."""
        try:
            while rank.recv_conn.poll():
                kind, payload = rank.recv_conn.recv()
                if kind == "outs":
                    for out in payload:
                        self._deliver(out)
                else:
                    rank.stats = payload
            return True
        except (EOFError, OSError):
            self._rank_died(rank)
            return False

    def _deliver(self, out: RequestOutput) -> None:
        with self.lock:
            entry = self.requests.get(out.request_id)
            if entry is not None and out.finished:
                del self.requests[out.request_id]
                entry[1].load -= entry[2]
        if entry is not None:
            entry[0].sink(out)

    def _rank_died(self, rank: RankProcess) -> None:
        rank.alive = False
        if self.failure is not None:
            return  # stopping: the group already failed, or the model is unloading
        try:
            code = rank.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its pipe closed but it hangs on: it cannot serve
            rank.proc.kill()
            code = rank.proc.wait()
        rank, code = first_cause(self.ranks, rank, code)
        self.failure = (f"{rank.name} exited (code {code}); this model stopped "
                        "serving with it: reload the model")
        log.error("%s", self.failure)
        with self.lock:
            lost, self.requests = list(self.requests.values()), {}
        for req, _, _ in lost:
            req.sink(self._error(req.id, self.failure))
        self._stop_ranks()  # the dead one is reaped already

    @staticmethod
    def _error(request_id: str, message: str) -> RequestOutput:
        return RequestOutput(request_id, finished=True, finish_reason="error", error=message)


def first_cause(ranks: list[RankProcess], rank: RankProcess, code: int) -> tuple[RankProcess, int]:
    """The rank whose exit broke the group: a rank that exits because its collective broke
    (GROUP_BROKE) names another that has exited for another reason, if one has (its pipe's end
    may be read after the broken rank's)."""
    if code == GROUP_BROKE:
        for other in ranks:
            other_code = other.proc.poll()
            if other is not rank and other_code not in (None, GROUP_BROKE):
                return other, other_code
    return rank, code


# ---- the rank process ----------------------------------------------------------------
def rank_main(rank: int, size: int, port: int, recv_fd: int, send_fd: int) -> None:
    from backends.dp import join_group, make_rank
    from backends.engine import Engine
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s dp{rank} %(name)s %(levelname)s %(message)s")
    # A rank lives as long as its stub (it exits when the stub says stop or its pipe closes),
    # and like the stub it ignores the signals a terminal or a script sends the server's
    # process group: otherwise Ctrl-C or a group SIGTERM at shutdown would kill the ranks
    # first, and the stub would report a dead rank while the model is unloading.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbox, outbox = Connection(recv_fd, writable=False), Connection(send_fd, readable=False)
    cfg, disagg, group_cores = inbox.recv()
    loop_group = join_group(rank, size, port, cfg.torch_device.type) if size > 1 else None
    engine = Engine(cfg, disagg=disagg)
    if loop_group is not None:
        make_rank(engine, rank, size, loop_group, group_cores,
                  on_broken=lambda exc: _exit(f"the DP group broke: {exc}", GROUP_BROKE))
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            outbox.send(message)

    engine.start()
    send(("ready", engine.stats(), engine.describe(), engine.identity()))
    threading.Thread(target=_send_stats, args=(engine, send), daemon=True).start()
    to_stub = OutputBatches(send).put
    try:
        while True:
            message = inbox.recv()
            if message[0] == "add":
                _, request_id, prompt_ids, params, room, salt, agent = message
                try:
                    engine.generate(prompt_ids, params, to_stub, request_id=request_id, room=room, cache_salt=salt,
                                    prefill_agent=agent)
                except InvalidRequest as exc:  # checked by the stub already; a model mismatch lands here
                    to_stub(DpGroup._error(request_id, str(exc)))
            elif message[0] == "abort":
                engine.abort(message[1])
            else:
                break
    except EOFError:
        _exit("the stub is gone", 0)
    _exit("stopped", 0)


class OutputBatches:
    """A rank's outputs to the stub, sent by a thread of their own as one message for all that
    came since the last: the engine thread only appends. One pickled message an output cost
    the engine thread 9-11 us (20,000 RequestOutputs through a pipe, dev CPU), one a batch of
    64 about 3 us an output, and the stub unpickles once a batch."""

    def __init__(self, send: Callable[[tuple], None]):
        self.send = send
        self.pending: list[RequestOutput] = []
        self.ready = threading.Condition()
        threading.Thread(target=self._run, name="tandem-rank-out", daemon=True).start()

    def put(self, out: RequestOutput) -> None:
        with self.ready:
            self.pending.append(out)
            self.ready.notify()

    def _run(self) -> None:
        while True:
            with self.ready:
                self.ready.wait_for(lambda: self.pending)
                batch, self.pending = self.pending, []
            try:
                self.send(("outs", batch))
            except OSError:
                return  # the stub is gone; the main loop exits on its end of file


def _exit(why: str, code: int) -> None:
    """No orderly stop: the other ranks may be gone already, and a collective would wait for them."""
    log.log(logging.WARNING if code else logging.INFO, "%s; this rank exits", why)
    logging.shutdown()
    os._exit(code)


def _send_stats(engine, send) -> None:
    while True:
        time.sleep(STATS_EVERY_S)
        try:
            send(("stats", engine.stats()))
        except OSError:
            return


if __name__ == "__main__":
    rank_main(*map(int, sys.argv[1:6]))
