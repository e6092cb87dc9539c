"""python -m client.bench_disagg: the KV hand-off measured without Triton in the way.

Loopback (default): for each prompt length and pipeline mode (layer-pipelined
writes vs one write after the forward), a prefill and a decode engine in this
process (real NIXL transports) serve the same prompts; printed side by side from
one run: time to the first token at prefill (what the router streams first),
time until decode holds the KV and emits that token (TTFT of the decode stream),
KV bytes moved per request, the bandwidth the writes achieved, and raw NIXL
bandwidth measured by `client.bench_transport` in the same run.

--shaped-link (root): the same comparison between two "hosts". The prefill
engine and the decode engine run as two plain Python processes (the engine
library in-process, no tritonserver), each in its own network namespace made by
scripts/shaped_link.sh, joined by a veth pair that `tc tbf` limits; UCX is held
to TCP on the veth (UCX_TLS=tcp, UCX_NET_DEVICES) so the KV really crosses the
link (without it UCX takes shared memory between the namespaces: GB/s, and no
byte on the veth). The rate is chosen so that the calibration prompt's KV takes
as long to send as its prefill takes to compute (--rate auto), pipeline auto
and off are interleaved on the same prompts, and raw NIXL WRITE bandwidth is
measured on the same link before and after; the namespaces are removed at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from backends.config import DEFAULT_MODEL_DIR
from backends.disagg.local import Pair
from client.bench_transport import bench as raw_bench
from backends.request import SamplingParams


def measure(pair: Pair, length: int, repeats: int) -> dict:
    params = SamplingParams(max_tokens=1)
    rows = []
    for r in range(repeats):
        ids = [1000 + (7 * i + 13 * r) % 30000 for i in range(length)]
        before = pair.prefill.stats()
        start = time.perf_counter()
        _, d, p = pair.submit(ids, params)
        first_prefill = p.get(timeout=600)
        t_prefill = time.perf_counter() - start
        first_decode = d.get(timeout=600)
        t_decode = time.perf_counter() - start
        assert first_decode.error is None and first_prefill.error is None, (first_decode.error, first_prefill.error)
        while not (p.get(timeout=60).finished if not first_prefill.finished else True):
            pass
        after = pair.prefill.stats()
        rows.append((t_prefill, t_decode, after["kv_bytes_sent"] - before["kv_bytes_sent"],
                     after["kv_write_seconds"] - before["kv_write_seconds"]))
    med = lambda i: statistics.median(row[i] for row in rows)
    return {"first_token_prefill_s": med(0), "ttft_decode_s": med(1), "bytes": med(2),
            "write_gbps": med(2) / med(3) / 1e9 if med(3) else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m client.bench_disagg", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL_DIR)
    ap.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default 1024 4096; shaped: 1024 4096 8191, "
                    "the longest prompt the default model's 8192-token context takes with its one output token)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=0, help="fixed layers per group (0 = adaptive)")
    shaped = ap.add_argument_group("two hosts over a shaped link (root)")
    shaped.add_argument("--shaped-link", action="store_true", help="prefill and decode in two namespaces, tc-limited veth")
    shaped.add_argument("--rate", default="auto",
                        help="tc rate of the link (e.g. 120mbit), or auto: KV of --calibrate-length sent in its prefill time")
    shaped.add_argument("--calibrate-length", type=int, default=4096, help="prompt whose compute and KV set the auto rate")
    shaped.add_argument("--chunk", type=int, default=0,
                        help="prefill chunk size (0 = the whole prompt in one step: with chunks, `off` already "
                             "overlaps each chunk's write with the next chunk's compute)")
    shaped.add_argument("--threads", type=int, default=0, help="torch threads of the prefill engine (0 = all cores)")
    shaped.add_argument("--raw-mb", type=int, default=32, help="raw NIXL bench: MiB per side")
    ap.add_argument("--serve", choices=("prefill", "decode"), help=argparse.SUPPRESS)  # a host of --shaped-link
    ap.add_argument("--serve-config", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve, json.loads(args.serve_config))
    elif args.shaped_link:
        shaped_main(args)
    else:
        loopback_main(args)


def loopback_main(args: argparse.Namespace) -> None:
    args.lengths = args.lengths or [1024, 4096]
    engine = dict(page_size=16, num_pages=(max(args.lengths) // 16 + 8) * 2, max_context=max(args.lengths) + 16,
                  chunk_size=512, max_batch_tokens=512, max_running_requests=4, threads=0,
                  prefix_caching="off")  # both modes run the same prompts: a cache hit would skip the forward
    results = {}
    for mode in ("auto", "off"):
        # prompts wait for their destination in both modes, so only the write schedule differs
        pair = Pair(args.model, engine_overrides=engine, pipeline=mode, pipeline_group_size=args.group_size,
                    transfer_timeout_s=600, prefill_before_destination="off")
        try:
            measure(pair, 64, 1)  # warm-up
            for length in args.lengths:
                results[(mode, length)] = measure(pair, length, args.repeats)
                print(f"  measured pipeline={mode} {length} tokens: {results[(mode, length)]}", flush=True)
        finally:
            pair.close()
    raw = raw_bench(mb=64)
    print(f"\nmedian of {args.repeats}; model {args.model}")
    print(f"{'prompt':>7} {'pipeline':>8} {'1st tok @prefill':>17} {'TTFT @decode':>13} {'KV MB/req':>10} "
          f"{'write GB/s':>10}")
    for (mode, length), r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{length:>7} {mode:>8} {r['first_token_prefill_s']:>16.3f}s {r['ttft_decode_s']:>12.3f}s "
              f"{r['bytes'] / 1e6:>10.2f} {r['write_gbps']:>10.2f}")
    for length in args.lengths:
        on, off = results[("auto", length)], results[("off", length)]
        print(f"TTFT at decode, pipelined / not, {length} tokens: {on['ttft_decode_s'] / off['ttft_decode_s']:.2f}x")
    print("raw NIXL WRITE (same run):", {k: round(v.get("gbps", 0), 2) for k, v in raw.items() if isinstance(v, dict)})


# ---------------------------------------------------------------- two hosts over a shaped link
ROOT = Path(__file__).resolve().parent.parent
LINK_SCRIPT = ROOT / "scripts" / "shaped_link.sh"
# The link's names, in one place: handed to scripts/shaped_link.sh as its environment.
LINK = {"NS_PREFILL": "tdm-prefill", "NS_DECODE": "tdm-decode", "DEV_PREFILL": "tdm-p", "DEV_DECODE": "tdm-d",
        "ADDR_PREFILL": "10.213.7.1", "ADDR_DECODE": "10.213.7.2"}
NIXL_PORT = 17655             # the prefill engine's NIXL listen port (inside its namespace)
CALIBRATION_RATE = "10gbit"   # the link while the compute is timed: the transfer then costs ~nothing
# tbf counts whole frames: TCP over a 1500-byte MTU carries 1448 payload bytes per 1514-byte frame
WIRE_OVERHEAD = 1514 / 1448
RAW_LAYERS, RAW_GROUP = 8, 2  # the raw bench's buffers, as `python -m client.bench_transport`
REPLY = "@@ "                 # prefix of a host's replies on its stdout; every other line is a log line
HOST_TIMEOUT_S = 900


def link_unavailable() -> str | None:
    """Why a shaped link cannot be made on this machine, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2)"
    probe = f"tdm-probe-{os.getpid()}"  # root in a container may still lack CAP_SYS_ADMIN: try it
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def link(*args: str) -> str:
    """scripts/shaped_link.sh ARGS, with this module's names and addresses."""
    done = subprocess.run(["bash", str(LINK_SCRIPT), *args], env={**os.environ, **LINK},
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"shaped_link.sh {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def in_ns(side: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", LINK[f"NS_{side.upper()}"], *cmd]


def prefill_qdisc() -> str:
    """`tc -s qdisc` of the prefill end of the veth: the KV leaves through it."""
    return subprocess.run(in_ns("prefill", "tc", "-s", "qdisc", "show", "dev", LINK["DEV_PREFILL"]),
                          capture_output=True, text=True, check=True).stdout


def link_bytes() -> int:
    """Bytes tbf has let out of the prefill end so far."""
    return int(re.search(r"Sent (\d+) bytes", prefill_qdisc()).group(1))


def link_rate_bps() -> float:
    """The tbf rate the kernel holds, in bytes of frames per second."""
    num, unit = re.search(r"\brate (\d+(?:\.\d+)?)([KMGT]?)bit", prefill_qdisc()).groups()
    return float(num) * 1000 ** " KMGT".index(unit or " ") / 8


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: how long some write was on the link."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def prompt_ids(length: int, seed: int) -> list[int]:
    return [1000 + (7 * i + 13 * seed) % 30000 for i in range(length)]


# ---- the two hosts: child processes in their namespaces, spoken to in JSON lines
class Host:
    """One engine in its own namespace, as a child process; UCX held to TCP on its veth end."""

    def __init__(self, side: str, conf: dict):
        self.side = side
        ucx = ["UCX_TLS=tcp", f"UCX_NET_DEVICES={LINK['DEV_' + side.upper()]}"]
        cmd = in_ns(side, "env", *ucx, sys.executable, "-m", "client.bench_disagg", "--serve", side,
                    "--serve-config", json.dumps(conf))
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self.replies.put(json.loads(line[len(REPLY):]))
            else:
                sys.stderr.write(f"[{self.side}] {line}")
        self.replies.put(None)  # the process is gone

    def send(self, op: str, **fields) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = HOST_TIMEOUT_S) -> dict:
        try:
            out = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"the {self.side} host did not answer within {timeout_s:g}s") from None
        if out is None:
            raise RuntimeError(f"the {self.side} host exited (code {self.proc.wait()})")
        if out.get("error"):
            raise RuntimeError(f"{self.side} host: {out['error']}")
        return out

    def call(self, op: str, **fields) -> dict:
        self.send(op, **fields)
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def serve(side: str, conf: dict) -> None:
    """--serve SIDE: one engine in this process; commands on stdin, replies on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the libraries print (NIXL's C++ too) goes to stderr, not among the replies
    sys.stdout = sys.stderr
    host = PrefillHost(conf) if side == "prefill" else DecodeHost(conf)
    replies.write(REPLY + json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            break
        try:
            out = getattr(host, op)(**cmd)
        except Exception as e:  # reported to the orchestrator, which stops the run
            out = {"error": f"{type(e).__name__}: {e}"}
        replies.write(REPLY + json.dumps(out) + "\n")
    host.engine.stop()


def _first_and_last(engine, ids: list[int], room: int) -> tuple[float, float, float]:
    """Run one request (one output token); (submitted, first output, finished) monotonic times."""
    outs: queue.Queue = queue.Queue()
    start = time.monotonic()
    engine.generate(ids, SamplingParams(max_tokens=1), outs.put, request_id=f"room-{room}", room=room)
    out = outs.get(timeout=HOST_TIMEOUT_S)
    first = time.monotonic()
    while not out.finished:
        out = outs.get(timeout=HOST_TIMEOUT_S)
    if out.error:
        raise RuntimeError(out.error)
    return start, first, time.monotonic()


class PrefillHost:
    def __init__(self, conf: dict):
        from backends.config import EngineConfig
        from backends.disagg.config import DisaggConfig
        from backends.engine import Engine

        self.cfg = DisaggConfig(**conf["disagg"])
        self.engine = Engine(EngineConfig(**conf["engine"], role="prefill"), disagg=self.cfg).start()
        self.role = self.engine.scheduler.role
        self.handles: list = []
        self.done: dict[int, float] = {}
        self._time_writes(self.role.worker.transport)

    def _time_writes(self, transport) -> None:
        """Note each KV write's post and the first poll that finds it done (the worker polls
        every 2 ms while a shipment is open): their union is the time the link was busy."""
        write_kv, poll = transport.write_kv, transport.poll

        def timed_write(*args, **kwargs):
            handle = write_kv(*args, **kwargs)
            self.handles.append(handle)
            return handle

        def timed_poll(handle):
            state = poll(handle)
            if state != "PROC":
                self.done.setdefault(id(handle), time.monotonic())
            return state
        transport.write_kv, transport.poll = timed_write, timed_poll

    def run(self, ids: list[int], room: int, pipeline: str) -> dict:
        # requests run one at a time, so the mode can change between them: layer_hook reads cfg per step
        self.role.cfg = dataclasses.replace(self.cfg, pipeline=pipeline)
        trace = self.role.worker.trace = []
        self.handles, self.done = [], {}
        before = self.engine.stats()["kv_bytes_sent"]
        start, first, _ = _first_and_last(self.engine, ids, room)
        layers = [t for what, _, t in trace if what == "layer"]
        kv_done = next(t for what, _, t in trace if what == "kv_done")
        spans = [(h.posted_at, self.done.get(id(h), kv_done)) for h in self.handles]
        return {"start_at": start, "first_token_at": first, "forward_end_at": max(layers),
                "first_post_at": min(a for a, _ in spans), "kv_done_at": kv_done, "busy_s": busy_seconds(spans),
                "writes": len(spans), "bytes": self.engine.stats()["kv_bytes_sent"] - before}

    def raw_send(self, host: str, port: int, mb: int, repeats: int) -> dict:
        """Raw NIXL WRITE bandwidth into the decode host's raw receiver, timed as the transport's
        own bench times it: one region, and layer groups (the hand-off's pattern)."""
        import numpy as np
        from backends.disagg.transport import KVTransport
        from client.bench_transport import bench_buffers, timed

        kv, meta = bench_buffers(mb, RAW_LAYERS)
        kv.uniform_()
        peer, out = "tandem-raw-recv", {}
        with KVTransport("tandem-raw-send", kv, meta) as t:
            info = t.connect(peer, host, port, timeout_s=30)
            whole = np.array([[t.info.kv.addr, kv.nbytes, t.info.kv.dev]], dtype=np.uint64)
            remote = np.array([[info.kv.addr, kv.nbytes, info.kv.dev]], dtype=np.uint64)
            pages = list(range(t.info.kv.count))
            groups = [range(g, g + RAW_GROUP) for g in range(0, RAW_LAYERS, RAW_GROUP)]
            patterns = {"one region": lambda: [t._post(peer, whole, "DRAM", remote, "DRAM", None)],
                        "layer groups": lambda: [t.write_kv(peer, pages, pages, g) for g in groups]}
            for name, post in patterns.items():
                secs, nbytes, _ = timed(t, post, repeats)
                out[name] = nbytes / secs
            t.send_message(peer, b"stop")
        return out


class DecodeHost:
    def __init__(self, conf: dict):
        from backends.config import EngineConfig
        from backends.disagg.config import DisaggConfig
        from backends.engine import Engine

        self.engine = Engine(EngineConfig(**conf["engine"], role="decode"),
                             disagg=DisaggConfig(**conf["disagg"])).start()

    def run(self, ids: list[int], room: int) -> dict:
        start, first, _ = _first_and_last(self.engine, ids, room)
        return {"start_at": start, "first_at": first}

    def raw_recv(self, mb: int) -> dict:
        from backends.disagg.transport import KVTransport
        from client.bench_transport import bench_buffers

        t = KVTransport("tandem-raw-recv", *bench_buffers(mb, RAW_LAYERS))
        threading.Thread(target=self._serve_raw, args=(t,), daemon=True).start()
        return {"port": t.port}

    @staticmethod
    def _serve_raw(t) -> None:
        with t:  # this thread alone drives it from here on; messages() also progresses the receive
            deadline = time.monotonic() + HOST_TIMEOUT_S
            while time.monotonic() < deadline and not any(m == b"stop" for _, m in t.messages()):
                time.sleep(0.001)


# ---- the orchestrator (root namespace)
def start_hosts(model: str, max_len: int, chunk: int, threads: int, group_size: int) -> dict[str, Host]:
    chunk = chunk or max_len
    engine = dict(model_path=model, page_size=16, max_context=max_len + 16, chunk_size=chunk,
                  max_batch_tokens=chunk, max_running_requests=2,
                  prefix_caching="off")  # both modes run the same prompts: a cache hit would skip the forward
    pages = max_len // 16 + 32  # the prompt, decode's reserve (128 tokens) and some slack
    hosts = {
        "prefill": Host("prefill", {"engine": {**engine, "num_pages": pages, "threads": threads},
                                    "disagg": {"nixl_port": NIXL_PORT, "transfer_timeout_s": 600,
                                               "pipeline_group_size": group_size,
                                               # as in loopback_main: only the write schedule differs
                                               "prefill_before_destination": "off"}}),
        "decode": Host("decode", {"engine": {**engine, "num_pages": pages, "threads": 1},
                                  "disagg": {"prefill_address": f"{LINK['ADDR_PREFILL']}:{NIXL_PORT}",
                                             "transfer_timeout_s": 600, "handshake_timeout_s": 60}}),
    }
    for h in hosts.values():
        h.reply()  # loaded
    return hosts


def run_pair(hosts: dict[str, Host], length: int, seed: int, mode: str) -> dict:
    """One request through both hosts; its timings, bytes, and the bytes tbf let through."""
    import random

    ids, room = prompt_ids(length, seed), random.getrandbits(62) + 1
    sent = link_bytes()
    hosts["prefill"].send("run", ids=ids, room=room, pipeline=mode)
    hosts["decode"].send("run", ids=ids, room=room)
    p, d = hosts["prefill"].reply(), hosts["decode"].reply()
    start = min(p["start_at"], d["start_at"])  # one clock: CLOCK_MONOTONIC is not per namespace
    return {"length": length, "mode": mode, "seed": seed,
            "ttft_s": d["first_at"] - start,                       # decode holds the KV, emits the token
            "prefill_first_s": p["first_token_at"] - start,        # the forward's end, seen at prefill
            "exposed_s": p["kv_done_at"] - p["forward_end_at"],    # transfer not hidden behind compute
            "posted_before_last_layer": p["first_post_at"] < p["forward_end_at"],
            "bytes": p["bytes"], "writes": p["writes"], "busy_s": p["busy_s"],
            "handoff_Bps": p["bytes"] / p["busy_s"] if p["busy_s"] else 0.0,
            "wire_bytes": link_bytes() - sent}


def measure_raw(hosts: dict[str, Host], mb: int, repeats: int = 3) -> dict:
    port = hosts["decode"].call("raw_recv", mb=mb)["port"]
    sent = link_bytes()
    out = hosts["prefill"].call("raw_send", host=LINK["ADDR_DECODE"], port=port, mb=mb, repeats=repeats)
    return {**out, "wire_bytes": link_bytes() - sent}


def run_shaped(model: str = DEFAULT_MODEL_DIR, lengths=(1024, 4096, 8191), repeats: int = 3, rate: str = "auto",
               calibrate_length: int = 4096, chunk: int = 0, threads: int = 0, group_size: int = 0,
               raw_mb: int = 32, log=print) -> dict:
    """The whole shaped-link run; the link exists only while it runs."""
    link("down")  # whatever an interrupted run left
    link("up", CALIBRATION_RATE)
    hosts: dict[str, Host] = {}
    try:
        hosts = start_hosts(model, max([*lengths, calibrate_length]), chunk, threads, group_size)
        run_pair(hosts, 64, 0, "off")  # handshake and warm-up
        # the faster of two: other work on a shared machine only ever slows a forward down
        tries = [run_pair(hosts, calibrate_length, 0, "off") for _ in range(2)]
        calib = min(tries, key=lambda r: r["prefill_first_s"])
        if rate == "auto":  # the KV takes as long to send as the prefill takes to compute
            rate = f"{round(calib['bytes'] * WIRE_OVERHEAD * 8 / calib['prefill_first_s'] / 1000)}kbit"
        times = " / ".join(f"{r['prefill_first_s']:.2f}" for r in tries)
        log(f"calibration on an unshaped link: {calibrate_length}-token prefill {times} s, "
            f"KV {calib['bytes'] / 1e6:.1f} MB -> tc rate {rate}", flush=True)
        link("up", rate)
        limit = link_rate_bps()
        raw = [measure_raw(hosts, raw_mb)]
        log(f"raw NIXL on the link: {fmt_raw(raw[0])}", flush=True)
        runs = []
        for r in range(repeats):
            for length in lengths:
                for mode in (("off", "auto") if r % 2 == 0 else ("auto", "off")):  # neither always goes first
                    runs.append(run_pair(hosts, length, r + 1, mode))
                    log(f"  repeat {r + 1} {length:>5} tokens pipeline={mode:<4} TTFT {runs[-1]['ttft_s']:.2f} s "
                        f"prefill {runs[-1]['prefill_first_s']:.2f} s exposed {runs[-1]['exposed_s']:.2f} s "
                        f"hand-off {runs[-1]['handoff_Bps'] / 1e6:.1f} MB/s", flush=True)
        raw.append(measure_raw(hosts, raw_mb))
        log(f"raw NIXL on the link: {fmt_raw(raw[1])}", flush=True)
        return {"rate": rate, "limit_Bps": limit, "calibration": tries, "raw": raw, "runs": runs,
                "lengths": list(lengths), "repeats": repeats, "chunk": chunk, "threads": threads}
    finally:
        for h in hosts.values():
            h.close()
        link("down")


def fmt_raw(raw: dict) -> str:
    return ", ".join(f"{k} {v / 1e6:.1f} MB/s" for k, v in raw.items() if k != "wire_bytes")


def summarize(res: dict) -> dict:
    """Medians per (length, mode), the raw figure, and the ratios the issue asks for."""
    raw = statistics.median(r["one region"] for r in res["raw"])
    rows = {}
    for length in res["lengths"]:
        for mode in ("off", "auto"):
            runs = [r for r in res["runs"] if r["length"] == length and r["mode"] == mode]
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("ttft_s", "prefill_first_s", "exposed_s", "bytes", "wire_bytes", "handoff_Bps")}
            med["overlapped"] = sum(r["posted_before_last_layer"] for r in runs)
            med["n"] = len(runs)
            rows[(length, mode)] = med
    ratios = {length: rows[(length, "auto")]["ttft_s"] / rows[(length, "off")]["ttft_s"] for length in res["lengths"]}
    return {"raw_Bps": raw, "rows": rows, "ttft_ratio": ratios}


def print_table(res: dict, out=sys.stdout) -> None:
    s = summarize(res)
    limit, raw = res["limit_Bps"], s["raw_Bps"]
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"\nshaped link: veth {LINK['DEV_PREFILL']} -> {LINK['DEV_DECODE']}, tbf rate {res['rate']} "
      f"({limit / 1e6:.1f} MB/s of frames, {limit / WIRE_OVERHEAD / 1e6:.1f} MB/s of TCP payload), UCX_TLS=tcp; "
      f"prefill chunk {res['chunk'] or 'whole prompt'}, prefill torch threads {res['threads'] or 'all cores'}; "
      f"median of {res['repeats']}, off/auto interleaved")
    p(f"raw NIXL WRITE on the link (one region, median of before/after): {raw / 1e6:.1f} MB/s "
      f"= {raw * WIRE_OVERHEAD / limit:.0%} of the tc rate counting frame overhead "
      f"({'; '.join(fmt_raw(r) for r in res['raw'])})")
    p(f"{'prompt':>6} {'pipeline':>8} {'TTFT':>8} {'prefill':>8} {'exposed':>8} {'KV MB':>7} {'wire MB':>8} "
      f"{'hand-off':>9} {'hand-off':>9} {'overlap':>7}")
    p(f"{'':>6} {'':>8} {'median':>8} {'1st tok':>8} {'xfer':>8} {'':>7} {'(tc)':>8} {'MB/s':>9} {'/ raw':>9} "
      f"{'runs':>7}")
    for (length, mode), m in s["rows"].items():
        p(f"{length:>6} {mode:>8} {m['ttft_s']:>7.2f}s {m['prefill_first_s']:>7.2f}s {m['exposed_s']:>7.2f}s "
          f"{m['bytes'] / 1e6:>7.1f} {m['wire_bytes'] / 1e6:>8.1f} {m['handoff_Bps'] / 1e6:>9.1f} "
          f"{m['handoff_Bps'] / raw:>9.2f} {m['overlapped']:>3}/{m['n']:<3}")
    for length, ratio in s["ttft_ratio"].items():
        p(f"TTFT pipeline auto / off at {length} tokens: {ratio:.2f}x")


def shaped_main(args: argparse.Namespace) -> None:
    why = link_unavailable()
    if why:
        sys.exit(f"--shaped-link: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` takes the link down
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; model {args.model}", flush=True)
    res = run_shaped(args.model, args.lengths or [1024, 4096, 8191], args.repeats, args.rate,
                     args.calibrate_length, args.chunk, args.threads, args.group_size, args.raw_mb)
    print_table(res)
    print("\nraw runs (JSON):")
    print(json.dumps({k: v for k, v in res.items()}, default=str))

if __name__ == "__main__":
    main()
