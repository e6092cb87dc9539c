"""python -m client.bench_routing: cache_aware against round_robin over two prefill servers.

Three tritonservers on this machine: P1 and P2 run `prefill`, A runs `decode` and two
routers over both, `router` (prefill_policy cache_aware) and `router_rr` (round_robin).
Each policy gets the same genai-perf shared-prefix workload (--num-prefix-prompts
prefixes, one before each prompt) with P1 and P2 started afresh (empty caches), and
this prints, per policy: the prefix-hit rate of the two prefill servers together
(tandem_prefix_cache_hits / tandem_prefix_cache_queries, tokens, vLLM's counters), the
requests each prefill server got and their max/min, output tok/s and TTFT p50. On one
machine the servers share its cores: this measures where requests go, not scaling.

    python -m client.bench_routing --rounds 3 --out artifacts/bench-routing
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

from client.bench import DEFAULT_TOKENIZER, Progress, Target, Workload, run_level
from client.triton_server import TritonServer, free_port, metric_value, set_parameters

ENGINE = {"max_context": "2048", "num_pages": "512"}
POLICIES = {"cache_aware": "router", "round_robin": "router_rr"}


def prefill_servers(root: str, nixl_ports: list[int], grpc_ports: list[int] | None = None) -> list[TritonServer]:
    servers = []
    for i, port in enumerate(nixl_ports):
        server = TritonServer(os.path.join(root, f"p{i + 1}"), models=["prefill"],
                              parameters={"prefill": {**ENGINE, "nixl_port": str(port)}})
        if grpc_ports:   # the same address as before, for the router's endpoint list
            server.grpc_port = grpc_ports[i]
        servers.append(server)
    return servers


def router_server(root: str, prefills: list[TritonServer]) -> TritonServer:
    endpoints = ",".join(p.grpc_url for p in prefills)
    a = TritonServer(os.path.join(root, "a"), models=["decode", "router"],
                     parameters={"decode": ENGINE, "router": {"prefill_endpoints": endpoints}})
    dst = os.path.join(a.repo_dir, "router_rr")
    shutil.copytree(os.path.join(a.repo_dir, "router"), dst)
    path = os.path.join(dst, "config.pbtxt")
    with open(path) as f:
        text = f.read().replace('name: "router"', 'name: "router_rr"')
    with open(path, "w") as f:
        f.write(set_parameters(text, {"prefill_policy": "round_robin"}))
    return a


def counter(metrics: dict, name: str, **labels) -> float:
    return metric_value(metrics, name, **labels) or 0.0


def wait_healthy(a: TritonServer, prefills: list[TritonServer], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = a.metrics()
        if all(counter(m, "tandem_router_endpoint_healthy", endpoint=p.grpc_url, model=model) == 1
               for p in prefills for model in POLICIES.values()):
            return
        time.sleep(0.2)
    raise RuntimeError("the prefill servers did not join the routers' rotation")


def one_policy(policy: str, a: TritonServer, prefills: list[TritonServer], w: Workload, level: int,
               out: str) -> dict:
    model = POLICIES[policy]
    before = [p.metrics() for p in prefills]
    sent = [counter(a.metrics(), "tandem_router_requests", endpoint=p.grpc_url, model=model) for p in prefills]
    target = Target(policy, "triton", a.grpc_url, model)
    progress = Progress(1)
    progress.begin(f"{policy} concurrency={level}")
    row = run_level(target, "concurrency", level, w, w.seed, os.path.join(out, policy), progress)
    if row.get("error"):
        raise RuntimeError(row["error"])
    after = [p.metrics() for p in prefills]
    hits = sum(counter(m1, "tandem_prefix_cache_hits") - counter(m0, "tandem_prefix_cache_hits")
               for m0, m1 in zip(before, after))
    queries = sum(counter(m1, "tandem_prefix_cache_queries") - counter(m0, "tandem_prefix_cache_queries")
                  for m0, m1 in zip(before, after))
    time.sleep(0.5)   # the router publishes its counters on its next poll
    served = [counter(a.metrics(), "tandem_router_requests", endpoint=p.grpc_url, model=model) - s
              for p, s in zip(prefills, sent)]
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0, "requests": served,
            "balance": max(served) / max(min(served), 1), "tok_s": row["output_tok_s"],
            "ttft_p50_ms": row["ttft_ms"]["p50"]}


def run_round(args, w: Workload, out: str) -> list[dict]:
    nixl = [free_port(), free_port()]
    rows = []
    grpc_ports = None
    for policy in POLICIES:
        prefills = prefill_servers(out, nixl, grpc_ports)
        grpc_ports = [p.grpc_port for p in prefills]
        for p in prefills:
            p.start()
        try:
            if not rows:
                a = router_server(out, prefills)
                a.start()
            wait_healthy(a, prefills)
            rows.append(one_policy(policy, a, prefills, w, args.concurrency, out))
        finally:
            for p in prefills:
                p.stop()
    a.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--num-prefix-prompts", type=int, default=24)
    ap.add_argument("--prefix-prompt-length", type=int, default=512)
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--out", default=os.path.join("artifacts", time.strftime("bench-routing-%Y%m%d-%H%M%S")))
    args = ap.parse_args(argv)
    w = Workload(args.input_tokens, args.output_tokens, DEFAULT_TOKENIZER, 0, 2, args.requests, "tensorrtllm",
                 1800, args.num_prefix_prompts, args.prefix_prompt_length)
    results = []
    for r in range(args.rounds):
        out = os.path.abspath(os.path.join(args.out, f"round-{r + 1}"))
        os.makedirs(out, exist_ok=True)
        for row in run_round(args, w, out):
            results.append({**row, "round": r + 1})
            print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(args.out, "routing.json"), "w") as f:
        json.dump(results, f, indent=1)
    for policy in POLICIES:
        rows = [x for x in results if x["policy"] == policy]
        print(f"{policy:12s} hit rate median {statistics.median(x['hit_rate'] for x in rows):.3f}  "
              f"balance max/min {[round(x['balance'], 2) for x in rows]}  requests {[x['requests'] for x in rows]}")
    ca = statistics.median(x["hit_rate"] for x in results if x["policy"] == "cache_aware")
    rr = statistics.median(x["hit_rate"] for x in results if x["policy"] == "round_robin")
    print(f"cache_aware / round_robin hit rate: {ca / rr if rr else float('inf'):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
