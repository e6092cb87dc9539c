"""python -m client.bench_decode_prefix: decode prefix reuse on against off, multi-turn chat through `router`.

One tritonserver runs `prefill`, `decode` and `router` (started afresh for each setting of
decode's prefix_caching). --conversations chats go on at once; each turn resends the
conversation so far as a plain-text transcript (User:/Assistant:) with a new question,
and turn k of every chat is sent together, so the counters read between turns belong to
that turn. Per setting and turn this prints: KV bytes prefill sent per request
(tandem_kv_bytes_sent, metadata included), KV bytes decode already held per request
(tandem_kv_bytes_reused) and TTFT p50 (first streamed text, ms). Prefill's own prefix
cache is on in both runs: only what crosses between the engines differs.

    python -m client.bench_decode_prefix --conversations 4 --turns 4 --out artifacts/bench-decode-prefix.json
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import time

from backends.grpc_stream import stream_events
from client.stream import build_inputs
from client.triton_server import TritonServer, free_port

ENGINE = {"max_context": "4096", "num_pages": "1024"}
WORDS = ("box", "river", "lamp", "garden", "cloud", "paper", "stone", "window", "train", "music", "bread", "mirror")


def opening(seed: int, words: int) -> str:
    """A long first message, different for every chat (no prefix shared between chats)."""
    rng = random.Random(seed)
    facts = " ".join(f"Item {i} is a {rng.choice(WORDS)} near the {rng.choice(WORDS)}." for i in range(words // 8))
    return f"User: Remember these facts. {facts} Which item is near a lamp?\nAssistant:"


def ask(url: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    """The answer's text and its TTFT (s)."""
    start, first, pieces = time.perf_counter(), None, []
    for error, outputs in stream_events(url, "router", build_inputs(prompt, max_tokens=max_tokens)):
        if error:
            raise RuntimeError(error)
        text = outputs["text_output"][0].decode() if "text_output" in outputs else ""
        if text and first is None:
            first = time.perf_counter() - start
        pieces.append(text)
    return "".join(pieces), first if first is not None else time.perf_counter() - start


def counters(server: TritonServer) -> tuple[float, float]:
    m = server.metrics()
    return m.get('tandem_kv_bytes_sent{model="prefill"}', 0.0), m.get('tandem_kv_bytes_reused{model="decode"}', 0.0)


def settled(server: TritonServer) -> tuple[float, float]:
    """The counters once no request holds KV and they have stopped moving (published every 0.1 s)."""
    for model in ("prefill", "decode"):
        server.wait_kv_full(model, 30)
    last = counters(server)
    for _ in range(100):
        time.sleep(0.3)
        now = counters(server)
        if now == last:
            break
        last = now
    return last


def run_setting(caching: str, args) -> list[dict]:
    root = tempfile.mkdtemp(prefix=f"bench-decode-prefix-{caching}-")
    knobs = {**ENGINE, "nixl_port": str(free_port())}
    server = TritonServer(os.path.join(root, "repo"), models=["prefill", "decode", "router"], parameters={
        "prefill": knobs, "decode": {**ENGINE, "prefill_address": f"127.0.0.1:{knobs['nixl_port']}",
                                     "prefix_caching": caching}})
    rows = []
    with server, concurrent.futures.ThreadPoolExecutor(args.conversations) as pool:
        chats = [opening(seed, args.words) for seed in range(args.conversations)]
        for turn in range(1, args.turns + 1):
            before = settled(server)
            results = list(pool.map(lambda p: ask(server.grpc_url, p, args.max_tokens), chats))
            after = settled(server)
            n = len(chats)
            rows.append({"prefix_caching": caching, "turn": turn, "requests": n,
                         "prompt_chars_mean": statistics.mean(len(p) for p in chats),
                         "kv_bytes_sent_per_request": (after[0] - before[0]) / n,
                         "kv_bytes_reused_per_request": (after[1] - before[1]) / n,
                         "ttft_p50_ms": 1000 * statistics.median(t for _, t in results)})
            print(json.dumps(rows[-1]), file=sys.stderr)
            chats = [p + answer + f"\nUser: Tell me more about item {turn + 3}.\nAssistant:"
                     for p, (answer, _) in zip(chats, results)]
    return rows


def table(rows: list[dict]) -> str:
    out = ["| decode prefix_caching | turn | KV bytes sent / request | KV bytes reused / request | TTFT p50 (ms) |",
           "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['prefix_caching']} | {r['turn']} | {r['kv_bytes_sent_per_request']:,.0f} | "
                   f"{r['kv_bytes_reused_per_request']:,.0f} | {r['ttft_p50_ms']:.0f} |")
    by = {(r["prefix_caching"], r["turn"]): r for r in rows}
    later = {t for _, t in by if t > 1 and ("off", t) in by and ("on", t) in by}
    if later:
        off = sum(by["off", t]["kv_bytes_sent_per_request"] for t in later)
        on = sum(by["on", t]["kv_bytes_sent_per_request"] for t in later)
        out.append(f"\nturns after the first: {100 * (1 - on / off):.0f} % fewer KV bytes sent with reuse on")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--words", type=int, default=400, help="about how many words the first message has")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="", help="write the rows here as JSON too")
    args = parser.parse_args()
    rows = run_setting("off", args) + run_setting("on", args)
    print(table(rows))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
