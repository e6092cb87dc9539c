"""python -m client.bench_transport: raw NIXL WRITE bandwidth between two processes.

Each process holds a KVTransport over a KV-shaped buffer; this one WRITEs into the other
in three patterns (one region, layer groups with coalesced page runs, one descriptor per
page) and prints GB/s, so an engine's achieved hand-off bandwidth can be put next to the
raw figure of the same machine (`client.bench_disagg` does, in the same run).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable, Sequence

import numpy as np
import torch

from backends.disagg.transport import KVTransport, PeerInfo, TransferError, XferHandle, page_descs


_BENCH_PAGE = dict(page_size=16, num_kv_heads=4, head_dim=64)  # 16 KiB fp32 pages


def bench_buffers(mb: int, num_layers: int):
    page_bytes = _BENCH_PAGE["page_size"] * _BENCH_PAGE["num_kv_heads"] * _BENCH_PAGE["head_dim"] * 4
    num_pages = max(8, (mb << 20) // (num_layers * 2 * page_bytes))
    kv = torch.zeros(num_layers, 2, num_pages, _BENCH_PAGE["page_size"], _BENCH_PAGE["num_kv_heads"],
                     _BENCH_PAGE["head_dim"], dtype=torch.float32)
    return kv, torch.zeros(4, 8, dtype=torch.int64)


def _bench_receiver(port_q, mb: int, num_layers: int) -> None:
    kv, meta = bench_buffers(mb, num_layers)
    with KVTransport("tandem-bench-recv", kv, meta) as t:
        port_q.put(t.port)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if any(m == b"stop" for _, m in t.messages()):
                return
            time.sleep(0.001)


def _scattered_pages(num_pages: int, want: int, rng: np.random.Generator) -> list[int]:
    """Pages as a fragmented allocator hands them out: shuffled runs of 1-8 pages."""
    cuts = np.cumsum(rng.integers(1, 9, size=num_pages))
    runs = np.split(np.arange(num_pages), cuts[cuts < num_pages])
    rng.shuffle(runs)
    return np.concatenate(runs)[:want].tolist()


def timed(t: KVTransport, post: Callable[[], list[XferHandle]], repeats: int) -> tuple[float, int, int]:
    """Median seconds from the first post to the last DONE, bytes and descriptors per round."""
    times = []
    for i in range(repeats + 1):  # round 0 warms up the UCX endpoint
        t0 = time.perf_counter()
        hs = post()
        while any(t.poll(h) == "PROC" for h in hs):
            if time.perf_counter() - t0 > 60:
                raise TransferError("bench transfer did not finish within 60 s")
        dt = time.perf_counter() - t0
        if any(h.state == "ERR" for h in hs):
            raise TransferError("bench transfer failed")
        for h in hs:
            t.release(h)
        if i:
            times.append(dt)
    return float(np.median(times)), sum(h.nbytes for h in hs), sum(h.ndescs for h in hs)


def bench(mb: int = 64, num_layers: int = 8, group: int = 2, repeats: int = 10) -> dict[str, dict]:
    """Raw WRITE bandwidth between two processes; returns {pattern: {gbps, bytes, descs, ms}}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_bench_receiver, args=(port_q, mb, num_layers), daemon=True)
    proc.start()
    kv, meta = bench_buffers(mb, num_layers)
    kv.uniform_()
    results: dict[str, dict] = {}
    try:
        with KVTransport("tandem-bench-send", kv, meta) as t:
            peer = "tandem-bench-recv"
            info = t.connect(peer, "127.0.0.1", port_q.get(timeout=60), timeout_s=30)
            results = _bench_patterns(t, peer, info, num_layers, group, repeats)
            t.send_message(peer, b"stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return results


def _bench_patterns(t: KVTransport, peer: str, info: PeerInfo, num_layers: int, group: int,
                    repeats: int) -> dict[str, dict]:
    num_pages, pb = t.info.kv.count, t.layout.page_bytes
    rng = np.random.default_rng(0)
    local = _scattered_pages(num_pages, num_pages // 2, rng)
    remote = _scattered_pages(num_pages, num_pages // 2, rng)
    groups = [range(g, min(g + group, num_layers)) for g in range(0, num_layers, group)]
    whole = np.array([[t.info.kv.addr, t.kv.nbytes, t.info.kv.dev]], dtype=np.uint64)
    whole_remote = np.array([[info.kv.addr, t.kv.nbytes, info.kv.dev]], dtype=np.uint64)

    def one_region():
        return [t._post(peer, whole, t.info.kv.mem, whole_remote, info.kv.mem, None)]

    def coalesced():
        return [t.write_kv(peer, local, remote, g) for g in groups]

    def per_page():
        ones = np.ones(len(local), dtype=np.int64)
        return [t._post(peer, t.kv_descs(g, local, coalesce=False), t.info.kv.mem,
                        page_descs(info.kv, info.kv.count, pb, list(g), np.asarray(remote), ones),
                        info.kv.mem, None) for g in groups]

    dst = torch.empty_like(t.kv)
    out = {"local memcpy (torch copy_, reference)": _memcpy_rate(t.kv, dst, repeats)}
    for name, post in (("one region", one_region), ("layer groups, coalesced runs", coalesced),
                       ("layer groups, one desc per page", per_page)):
        secs, nbytes, ndescs = timed(t, post, repeats)
        out[name] = {"gbps": nbytes / secs / 1e9, "bytes": nbytes, "descs": ndescs, "ms": secs * 1e3}
    return out


def _memcpy_rate(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> dict:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    secs = float(np.median(times[1:]))
    return {"gbps": src.nbytes / secs / 1e9, "bytes": src.nbytes, "descs": 0, "ms": secs * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client.bench_transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="KV pool size per side, MiB")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--group", type=int, default=2, help="layers per write in the layer-group patterns")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    res = bench(args.mb, args.layers, args.group, args.repeats)
    print(f"NIXL UCX WRITE between two processes, host memory, {args.mb} MiB pool per side, "
          f"{args.layers} layers, 16 KiB pages, groups of {args.group} layers, median of {args.repeats}")
    for name, r in res.items():
        print(f"  {name:38s} {r['bytes'] / 2**20:8.1f} MiB {r['descs']:7d} descs "
              f"{r['ms']:8.2f} ms {r['gbps']:7.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
