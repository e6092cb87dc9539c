"""python -m client.chaos: mixed, concurrent, misbehaving clients against a Tandem model.

N requests at once: good ones, ones whose client cancels (right after sending, before
the first token, or after a random number of tokens), ones whose client drops its
connection after a random number of tokens (closes the gRPC channel without cancelling,
as a client that dies does), and malformed ones (empty prompt, max_tokens sent as FP32,
bad sampling_parameters JSON, over-long prompt, negative max_tokens). Then checks:
  - every good request completed with exactly the text (and token ids) of the same
    prompt run alone first, greedy, against the same server;
  - text a cancelled or dropped request received is a prefix of that reference;
  - every malformed request got an error that names the problem, and no tokens;
  - no request holds a KV page of any engine on the server, nothing runs or waits
    (tandem_kv_pages_free + tandem_kv_pages_cached == tandem_kv_pages_total for every model label);
  - the server is still ready (HTTP /v2/health/ready) and answers a request right.
Exit code 0 when all hold, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from client.stream import StreamResult, absorb, build_inputs

PROMPTS = [
    "The history of the lighthouse begins",
    "Write a short poem about rain on a tin roof.",
    "def fibonacci(n):",
    "Three facts about the Moon:",
    "Once upon a time, in a village by the sea,",
    "The recipe for bread needs flour, water,",
]
# What a clear error mentions, per malformed kind (any of the words, case-insensitive).
BAD_KINDS = {
    "empty_prompt": ("empty",),
    "max_tokens_fp32": ("max_tokens",),
    "bad_json": ("sampling_parameters",),
    "long_prompt": ("context", "too long"),
    "negative_max_tokens": ("max_tokens",),
}


@dataclass
class Job:
    index: int
    kind: str                       # good | cancel_early | cancel_mid | drop | bad:<BAD_KINDS key>
    prompt_index: int
    cancel_after: int | None = None  # responses to read before cancelling (cancel_mid, drop)
    cancel_delay: float | None = None  # seconds after sending to cancel (cancel_early)


@dataclass
class Outcome:
    result: StreamResult = field(default_factory=StreamResult)
    responses: int = 0
    finished: bool = False
    cancelled: bool = False
    seconds: float = 0.0


def make_input(name: str, array: np.ndarray):
    import tritonclient.grpc as grpcclient
    dtype = "BYTES" if array.dtype == np.object_ else {np.dtype(np.int32): "INT32",
                                                       np.dtype(np.float32): "FP32"}[array.dtype]
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def job_inputs(job: Job, max_tokens: int, long_words: int):
    """The request tensors of a job; malformed kinds break one thing each."""
    prompt = PROMPTS[job.prompt_index]
    bad = job.kind.split(":", 1)[1] if job.kind.startswith("bad:") else ""
    if bad == "empty_prompt":
        return build_inputs("", max_tokens=max_tokens)
    if bad == "long_prompt":
        return build_inputs(prompt + " hello" * long_words, max_tokens=max_tokens)
    if bad == "negative_max_tokens":
        return build_inputs(prompt, max_tokens=-max_tokens)
    if bad == "max_tokens_fp32":
        return build_inputs(prompt) + [make_input("max_tokens", np.array([max_tokens], dtype=np.float32))]
    if bad == "bad_json":
        return build_inputs(prompt) + [make_input("sampling_parameters",
                                                  np.array([b'{"max_tokens": 8,'], dtype=np.object_))]
    return build_inputs(prompt, max_tokens=max_tokens, temperature=0.0)


def run_stream(url: str, model: str, inputs, cancel_after: int | None = None,
               cancel_delay: float | None = None, timeout_s: float = 120, drop: bool = False) -> Outcome:
    """One streamed request; the client cancels after `cancel_delay` s or `cancel_after` responses
    (with `drop`, it closes its connection instead of cancelling)."""
    import tritonclient.grpc as grpcclient

    events: queue.Queue = queue.Queue()
    out, start = Outcome(), time.time()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        if cancel_delay is not None:
            time.sleep(cancel_delay)
            out.cancelled = True
            _drain(events, out, block=False)
        else:
            _drain(events, out, block=True, cancel_after=cancel_after, timeout_s=timeout_s)
    finally:
        if drop and not out.finished:
            # Closing the channel tears the stream down without a cancel message, as when the
            # client process dies (tritonclient has no public call for it).
            client._channel.close()
        # cancel_requests=True is the client's cancellation Triton passes to the model.
        client.stop_stream(cancel_requests=True)
        client.close()
    out.seconds = time.time() - start
    return out


def _drain(events: queue.Queue, out: Outcome, block: bool, cancel_after: int | None = None,
           timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not out.finished and out.result.error is None:
        if cancel_after is not None and out.responses >= cancel_after:
            out.cancelled = True
            return
        try:
            result, error = events.get(timeout=max(0.0, deadline - time.time())) if block else events.get_nowait()
        except queue.Empty:
            if block:
                out.result.error = f"no response within {timeout_s:.0f} s"
            return
        if error is not None:
            out.result.error = str(error)
            return
        response = result.get_response()
        outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
        if outputs:
            absorb(out.result, outputs)
            out.responses += 1
        final = response.parameters.get("triton_final_response")
        out.finished = final is not None and final.bool_param


def plan(n: int, cancel_share: float, bad_share: float, max_tokens: int, seed: int,
         bad_kinds: list[str] = list(BAD_KINDS), drop_share: float = 0.0) -> list[Job]:
    """N jobs, shuffled: round(n*bad_share) malformed (kinds in turn), round(n*cancel_share)
    cancelled (half right after sending, half mid-stream), round(n*drop_share) dropped
    mid-stream, the rest good."""
    rng = random.Random(seed)
    n_bad, n_cancel, n_drop = round(n * bad_share), round(n * cancel_share), round(n * drop_share)
    kinds = [f"bad:{k}" for k in bad_kinds * n][:n_bad]
    kinds += ["cancel_early" if i % 2 == 0 else "cancel_mid" for i in range(n_cancel)]
    kinds += ["drop"] * n_drop
    kinds += ["good"] * (n - len(kinds))
    rng.shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        job = Job(i, kind, rng.randrange(len(PROMPTS)))
        if kind == "cancel_early":
            job.cancel_delay = rng.choice([0.0, rng.uniform(0, 0.05)])
        elif kind in ("cancel_mid", "drop"):
            job.cancel_after = rng.randint(1, max(1, max_tokens - 1))
        jobs.append(job)
    return jobs


# ---- checks ---------------------------------------------------------------------------
def check_job(job: Job, out: Outcome, ref: StreamResult) -> str | None:
    """None if the job behaved as it should, else why not."""
    r = out.result
    if job.kind == "good":
        if r.error:
            return f"failed: {r.error}"
        if not out.finished:
            return "no final response"
        if r.text != ref.text or r.token_ids != ref.token_ids:
            return f"text differs from the reference:\n      got {r.text!r}\n      ref {ref.text!r}"
        return None
    if job.kind.startswith("cancel") or job.kind == "drop":
        if r.error and "cancel" not in r.error.lower():  # a dropped stream ends CANCELLED too
            return f"error: {r.error}"
        if not ref.text.startswith(r.text):
            return f"partial text is not a prefix of the reference: {r.text!r}"
        return None
    words = BAD_KINDS[job.kind.split(":", 1)[1]]
    if not r.error:
        return f"accepted (got {r.num_output_tokens} tokens, {r.text[:40]!r})"
    if r.token_ids:
        return f"error after {len(r.token_ids)} tokens: {r.error}"
    if not any(w in r.error.lower() for w in words):
        return f"unclear error (want one of {words}): {r.error}"
    return None


def engine_gauges(metrics_url: str) -> dict[str, dict[str, float]]:
    """{model: {kv_pages_free, kv_pages_cached, kv_pages_total, running, waiting}} from Tandem's gauges."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for m in re.finditer(r'^tandem_(\w+)\{[^}]*model="([^"]+)"[^}]*\}\s+(\S+)$', text, re.M):
        out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return out


def wait_idle(metrics_url: str, timeout_s: float) -> tuple[bool, dict]:
    """True once no request holds a KV page of any engine (each page free, or cached for a
    later prompt) and nothing runs or waits."""
    deadline = time.time() + timeout_s
    while True:
        gauges = engine_gauges(metrics_url)
        unheld = lambda g: g.get("kv_pages_free", 0) + g.get("kv_pages_cached", 0) == g.get("kv_pages_total", 0)
        idle = bool(gauges) and all(unheld(g) and not g.get("running") and not g.get("waiting")
                                    for g in gauges.values())
        if idle or time.time() > deadline:
            return idle, gauges
        time.sleep(0.2)


def healthy(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(http_url.rstrip("/") + "/v2/health/ready", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


# ---- main -----------------------------------------------------------------------------
def references(args) -> list[StreamResult]:
    """Each prompt alone, greedy: what every good request must reproduce exactly."""
    refs = []
    for i, prompt in enumerate(PROMPTS):
        out = run_stream(args.url, args.model, build_inputs(prompt, max_tokens=args.max_tokens, temperature=0.0))
        if out.result.error or not out.finished:
            raise RuntimeError(f"reference request {i} failed: {out.result.error or 'no final response'}")
        refs.append(out.result)
    return refs


def run_jobs(args, jobs: list[Job]) -> list[Outcome]:
    def one(job: Job) -> Outcome:
        inputs = job_inputs(job, args.max_tokens, args.long_prompt_words)
        try:
            return run_stream(args.url, args.model, inputs, job.cancel_after, job.cancel_delay, args.timeout,
                              drop=job.kind == "drop")
        except Exception as exc:  # a transport failure is a finding, not a crash of the tool
            return Outcome(result=StreamResult(error=f"client: {exc}"))
    with ThreadPoolExecutor(max_workers=args.concurrency or len(jobs)) as pool:
        return list(pool.map(one, jobs))


def report(args, jobs, outcomes, refs, idle, gauges, ready, after) -> list[str]:
    """Prints the summary; returns the failures."""
    failures = []
    counts: dict[str, list[int]] = {}
    for job, out in zip(jobs, outcomes):
        why = check_job(job, out, refs[job.prompt_index])
        ok_fail = counts.setdefault(job.kind, [0, 0])
        ok_fail[why is not None] += 1
        if why:
            failures.append(f"#{job.index} {job.kind} (prompt {job.prompt_index}): {why}")
    print(f"chaos: {len(jobs)} requests against {args.model} at {args.url} "
          f"(concurrency {args.concurrency or len(jobs)}, max_tokens {args.max_tokens}, seed {args.seed})")
    for kind in sorted(counts):
        ok, bad = counts[kind]
        print(f"  {kind:26s} {ok}/{ok + bad} ok")
    early = [o for j, o in zip(jobs, outcomes) if j.kind.startswith("cancel") or j.kind == "drop"]
    print(f"  cancelled or dropped: {sum(o.responses == 0 for o in early)} before the first token, "
          f"{sum(o.responses > 0 and not o.finished for o in early)} mid-stream, "
          f"{sum(o.finished for o in early)} finished before the cancel reached them")
    for model, g in sorted(gauges.items()):
        print(f"  KV {model}: {g.get('kv_pages_free', 0):.0f}/{g.get('kv_pages_total', 0):.0f} pages free, "
              f"{g.get('kv_pages_cached', 0):.0f} cached, "
              f"running {g.get('running', 0):.0f}, waiting {g.get('waiting', 0):.0f}")
    if not idle:
        failures.append(f"engines not back to idle with full KV within {args.settle_timeout:.0f} s: {gauges}")
    if not ready:
        failures.append("server not ready (/v2/health/ready)")
    if after:
        failures.append(f"request after the chaos: {after}")
    print(f"  health: {'ready' if ready else 'NOT READY'}; request after the chaos "
          f"{'matches the reference' if not after else 'FAILED'}")
    for f in failures:
        print(f"FAIL {f}")
    print("PASS" if not failures else f"FAILED ({len(failures)})")
    return failures


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m client.chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default %(default)s)")
    ap.add_argument("--http-url", default="http://localhost:8000", help="Triton HTTP, for health (default %(default)s)")
    ap.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="default %(default)s")
    ap.add_argument("--model", default="llm", help="llm or router (default %(default)s)")
    ap.add_argument("-n", "--requests", type=int, default=40, help="requests (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=0, help="clients at once (default: all)")
    ap.add_argument("--cancel-share", type=float, default=0.25, help="default %(default)s")
    ap.add_argument("--bad-share", type=float, default=0.25, help="default %(default)s")
    ap.add_argument("--drop-share", type=float, default=0.0,
                    help="clients that close their connection mid-stream (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=32, help="default %(default)s")
    ap.add_argument("--long-prompt-words", type=int, default=40000,
                    help="words in the over-long prompt, beyond any context (default %(default)s)")
    ap.add_argument("--bad-kinds", default=",".join(BAD_KINDS),
                    help="malformed kinds to send, in turn (default: all: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="default %(default)s")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request (default %(default)s)")
    ap.add_argument("--settle-timeout", type=float, default=15, help="seconds for KV to free (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the outcomes here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not healthy(args.http_url):
        print(f"server not ready at {args.http_url}", file=sys.stderr)
        return 1
    bad_kinds = [k for k in args.bad_kinds.split(",") if k]
    unknown = set(bad_kinds) - set(BAD_KINDS)
    if unknown:
        build_parser().error(f"unknown --bad-kinds {sorted(unknown)}; known: {list(BAD_KINDS)}")
    jobs = plan(args.requests, args.cancel_share, args.bad_share, args.max_tokens, args.seed, bad_kinds,
                args.drop_share)
    print(f"references: {len(PROMPTS)} prompts alone ...", file=sys.stderr, flush=True)
    refs = references(args)
    print(f"chaos: {len(jobs)} requests at once ...", file=sys.stderr, flush=True)
    start = time.time()
    outcomes = run_jobs(args, jobs)
    print(f"done in {time.time() - start:.1f} s; checking ...", file=sys.stderr, flush=True)
    idle, gauges = wait_idle(args.metrics_url, args.settle_timeout)
    ready = healthy(args.http_url)
    after = check_job(Job(-1, "good", 0), run_stream(args.url, args.model, job_inputs(
        Job(-1, "good", 0), args.max_tokens, 0), timeout_s=args.timeout), refs[0]) if ready else None
    failures = report(args, jobs, outcomes, refs, idle, gauges, ready, after)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jobs": [asdict(j) for j in jobs], "outcomes": [asdict(o) for o in outcomes],
                       "gauges": gauges, "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
