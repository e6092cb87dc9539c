"""python -m client.bench against the real server (and a stand-in OpenAI peer): it runs
genai-perf, writes the table, bench.json and plots, and the output tokens it counts
equal those the server reports."""
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from client.bench import Workload, genai_perf_cmd, parse_target
from client.triton_server import ROOT

pytestmark = pytest.mark.server
TOKENS = 6
PLOTS = ("throughput.png", "ttft.png", "itl.png", "latency.png")


def run_bench(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "-m", "client.bench", "--concurrency", "1", "--requests", "2",
                           "--warmup", "1", "--input-tokens", "16", "--output-tokens", str(TOKENS),
                           "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in PLOTS + ("table.txt",):
        assert (out / name).stat().st_size > 0, name
    return proc, json.loads((out / "bench.json").read_text())


def test_bench_llm_counts_equal_server(llm_server, tmp_path):
    proc, report = run_bench(tmp_path, "--target", f"llm=grpc://{llm_server.grpc_url}")
    [row] = report["results"]
    assert row["error"] is None and row["request_count"] == 2 and row["output_tok_s"] > 0
    assert "llm" in proc.stdout and "equal (12)" in proc.stdout  # the table, token column
    tokens = row["tokens"]
    # genai-perf's count (re-tokenized text) == our recount == the server's num_output_tokens/output_ids.
    assert tokens["equal"] and not tokens["mismatches"], tokens
    assert tokens["client_total"] == tokens["server_total"] == tokens["genai_perf_total"] == 2 * TOKENS
    assert row["osl"] == {"min": TOKENS, "avg": TOKENS, "max": TOKENS}
    assert 0 <= row["steal"] < 1 and proc.stdout.splitlines()[0].endswith("steal %")
    # Independently of the tool: what the server itself sent, per request.
    [export] = [os.path.join(d, f) for d, _, fs in os.walk(row["run_dir"]) for f in fs if f == "profile_export.json"]
    with open(export) as f:
        requests = json.load(f)["experiments"][0]["requests"]
    assert [r["response_outputs"][-1]["num_output_tokens"] for r in requests] == [TOKENS, TOKENS]


def test_engine_in_process_beside_llm(llm_server, default_model, tmp_path):
    """bench_engine --out writes client.bench rows; merged with the same workload through
    tritonserver, the report has the llm / engine ratios (Triton's overhead)."""
    engine_dir = tmp_path / "engine"
    proc = subprocess.run([sys.executable, "-m", "client.bench_engine", "--model", default_model, "--streams", "1",
                           "--requests", "2", "--reps", "1", "--prompt-tokens", "16", "--output-tokens", str(TOKENS),
                           "--out", str(engine_dir)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [engine] = json.loads((engine_dir / "bench.json").read_text())["results"]
    assert engine["target"] == "engine" and engine["request_count"] == 2 and engine["osl"]["avg"] == TOKENS
    assert engine["ttft_ms"]["p50"] <= engine["latency_ms"]["p50"] and engine["itl_ms"]["p50"] > 0
    assert 0 <= engine["steal"] < 1
    proc, report = run_bench(tmp_path, "--target", f"llm=grpc://{llm_server.grpc_url}",
                             "--merge", str(engine_dir / "bench.json"))
    llm = next(r for r in report["results"] if r["target"] == "llm")
    ratio = report["ratios"]["llm"]["engine"]["c=1"]
    assert ratio["output_tok_s"] == pytest.approx(llm["output_tok_s"] / engine["output_tok_s"])
    assert ratio["ttft_p50"] == pytest.approx(llm["ttft_ms"]["p50"] / engine["ttft_ms"]["p50"])
    assert "llm / target" in proc.stdout and "engine" in proc.stdout.split("llm / target")[1]


class FakePeer(BaseHTTPRequestHandler):
    """An OpenAI /v1/completions server that streams max_tokens words; records the bodies
    and each request's Connection header."""
    bodies: list[dict] = []
    connections: list[str | None] = []
    protocol_version = "HTTP/1.1"  # answers curl's "Expect: 100-continue" at once (1.0 makes it wait 1 s)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakePeer.bodies.append(body)
        FakePeer.connections.append(self.headers.get("Connection"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(int(body["max_tokens"])):
            chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": " hello", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.02)  # a token every 20 ms, like a server
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True  # the body ends with the connection

    def log_message(self, *args):
        pass


def test_bench_openai_peer(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePeer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc, report = run_bench(tmp_path, "--target", f"peer=http://127.0.0.1:{server.server_port}/smol")
    finally:
        server.shutdown()
    [row] = report["results"]
    assert row["error"] is None and row["kind"] == "openai" and row["osl"]["avg"] == TOKENS
    assert len(FakePeer.bodies) == 3 and "stream" not in FakePeer.bodies[0]  # client.bench's warm-up first
    body = FakePeer.bodies[-1]
    # The same workload as for Tandem: forced length, greedy, streaming.
    assert body["model"] == "smol" and body["stream"] is True and body["max_tokens"] == TOKENS
    assert body["ignore_eos"] is True and body["min_tokens"] == TOKENS and body["temperature"] == 0
    # One connection per request (llama-server rejects perf_analyzer's reused ones with HTTP 400).
    assert [(c or "").lower() for c in FakePeer.connections[1:]] == ["close", "close"], FakePeer.connections


def test_parse_target():
    t = parse_target("llm=grpc://localhost:8001")
    assert (t.kind, t.url, t.model) == ("triton", "localhost:8001", "llm")
    assert parse_target("dis=grpc://h:1/router").model == "router"
    p = parse_target("vllm=http://127.0.0.1:8011/smol")
    assert (p.kind, p.url, p.model) == ("openai", "http://127.0.0.1:8011", "smol")
    with pytest.raises(Exception):
        parse_target("x=ftp://h:1")
    pen = parse_target("pen=grpc://h:1/llm?repetition_penalty=1.2&presence_penalty=0.5")
    assert (pen.model, pen.extra) == ("llm", (("repetition_penalty", "1.2"), ("presence_penalty", "0.5")))
    cmd = genai_perf_cmd(pen, "concurrency", 16, Workload(128, 128, "tok", 0, 0, 0, "tensorrtllm", 60), 0, "d")
    assert " ".join(cmd).endswith("--extra-inputs repetition_penalty:1.2 --extra-inputs presence_penalty:0.5")
    with pytest.raises(Exception):
        parse_target("bad=grpc://h:1/llm?novalue")


def test_rounds_median_of_ratios(tmp_path, capsys):
    from client.bench import main
    row = lambda target, tok_s: {"target": target, "mode": "concurrency", "level": 8.0, "error": None,
                                 "output_tok_s": tok_s, "ttft_ms": {"p50": 100.0}}
    paths = []
    for i, (llm, vllm) in enumerate([(240, 200), (260, 200), (300, 200)]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"results": [row("llm", llm), row("vllm", vllm)]}))
    assert main(["--rounds", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "over 3 rounds" in out and "vllm" in out and "c=8 1.30x (1.20-1.50)" in out


def test_rounds_of_each_tandem_dtype_against_the_peers(tmp_path, capsys):
    """llm-bf16 and llm-int8 (the same server in other dtypes) are each compared with every peer,
    not with each other."""
    from client.bench import main
    row = lambda target, tok_s: {"target": target, "mode": "concurrency", "level": 1.0, "error": None,
                                 "output_tok_s": tok_s, "ttft_ms": {"p50": 100.0}}
    paths = []
    for i, (bf16, int8) in enumerate([(60, 80), (66, 88)]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"results": [row("llm-bf16", bf16), row("llamacpp-bf16", 50),
                                                     row("llm-int8", int8), row("llamacpp-q8", 80)]}))
    assert main(["--rounds", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    bf16, int8 = out.split("llm-int8 / target")
    assert "llm-bf16 / target" in bf16 and "llamacpp-bf16  c=1 1.26x (1.20-1.32)" in bf16 and "llm-int8" not in bf16
    assert "llamacpp-q8    c=1 1.05x (1.00-1.10)" in int8 and "llm-bf16" not in int8


def test_cpu_times_steal_share(tmp_path):
    """The steal share is stolen ticks over all ticks between two reads of /proc/stat; guest
    time (already in user) is not counted twice."""
    from client import cpu_times
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 20 1000 7 3 2 40 30 0\ncpu0 50 2 10 500 3 1 1 20 15 0\n")
    before = cpu_times.read(str(stat))
    assert before == cpu_times.CpuTimes(busy=130, steal=40, total=1177)
    stat.write_text("cpu  150 5 30 1030 7 3 2 50 60 0\n")
    assert cpu_times.read(str(stat)).share_stolen_since(before) == pytest.approx(10 / 100)


def test_table_shows_steal_and_notes_a_stolen_level(tmp_path, capsys):
    from client import bench_report
    pcts = {"avg": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    row = lambda level, steal: {"target": "llm", "kind": "triton", "mode": "concurrency", "level": level,
                                "requests": 2, "request_count": 2, "error": None, "output_tok_s": 10.0,
                                "requests_s": 1.0, "ttft_ms": pcts, "itl_ms": pcts, "latency_ms": pcts,
                                "osl": {"min": 6, "avg": 6, "max": 6}, "steal": steal}
    rows = [row(1.0, 0.002), row(8.0, 0.034), {**row(16.0, 0.0), "steal": None}]
    bench_report.write({"results": rows}, str(tmp_path))
    out, err = capsys.readouterr()
    assert [line.split()[-1] for line in out.splitlines()[2:5]] == ["0.2", "3.4", "-"]
    assert "llm concurrency=8: the hypervisor took 3.4 %" in err and "concurrency=1:" not in err


def test_a_level_whose_export_was_cut_short_runs_again(tmp_path, monkeypatch):
    """perf_analyzer has written profile_export.json cut at a 64 KiB boundary and exited 0:
    genai-perf then fails to parse it. That level runs again, up to EXPORT_RERUNS times, and
    says so, each run with new prompts (a seed of its own: the same prompts again would hit the
    prefix cache the first run filled); any other failure does not."""
    from client import bench
    calls, cut_runs, seeds = [], {"cut": 1, "twice": 2, "always": 99, "other": 0}, {}

    def once(t, mode, level, w, seed, run_dir, progress):
        name = os.path.basename(run_dir)
        calls.append(name)
        seeds.setdefault(name, []).append(seed)
        os.makedirs(run_dir, exist_ok=True)
        if calls.count(name) <= cut_runs[name] or name == "other":
            with open(os.path.join(run_dir, "genai-perf.log"), "w") as f:
                f.write("orjson.JSONDecodeError: unexpected end of data\n" if name != "other" else "refused\n")
            return {"error": "genai-perf exited 1"}
        return {"error": None, "output_tok_s": 1.0}

    monkeypatch.setattr(bench, "_run_level_once", once)
    assert bench.EXPORT_RERUNS == 2
    for name, runs in (("cut", 2), ("twice", 3)):
        row = bench.run_level(None, "concurrency", 1, None, 0, str(tmp_path / name), None)
        assert row == {"error": None, "output_tok_s": 1.0, "rerun": "export cut short"}
        assert calls.count(name) == runs
    row = bench.run_level(None, "concurrency", 1, None, 0, str(tmp_path / "always"), None)
    assert row["error"] and calls.count("always") == 3
    assert seeds["twice"] == [0, 1, 2] and seeds["always"] == [0, 1, 2]
    row = bench.run_level(None, "concurrency", 1, None, 0, str(tmp_path / "other"), None)
    assert row["error"] and "rerun" not in row and calls.count("other") == 1


def test_engine_bench_wave_ends_on_a_failed_request():
    """A request that fails (an error output) ends the wave with its error, instead of waiting
    for requests that will never finish (every bf16 request failed on an AVX2 CPU once)."""
    import threading

    from backends.request import RequestOutput, SamplingParams
    from client.bench_engine import wave

    class FailingEngine:
        def generate(self, ids, params, sink):
            threading.Thread(target=sink, args=(RequestOutput("r", error="no primitive", finished=True),)).start()

    raised = []
    runner = threading.Thread(target=lambda: raised.append(pytest.raises(RuntimeError, wave, FailingEngine(),
                                                                        [[1], [2], [3]], 2, SamplingParams())),
                              daemon=True)
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "the wave waited for requests that had failed"
    assert "no primitive" in str(raised[0].value)
