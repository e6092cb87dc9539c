"""perf_analyzer and genai-perf, the load tools Triton users run, against the
real server: they run, and count the output tokens the server produced."""
import json
import os
import subprocess

import pytest

from client.triton_server import ROOT

pytestmark = pytest.mark.server
BIN = os.path.join(ROOT, ".venv", "bin")
TOKENS = 8
# perf_analyzer 2.51 records an output that a response lacks from memory it never wrote; a float
# that reads as NaN stops its JSON writer and the export is left empty or cut at a 64 KiB flush.
# These flags put every float output (the logprob ones) in every response.
FLOAT_OUTPUT_FLAGS = ("return_log_probs", "return_cumulative_logprob")


def server_counts(export_path: str) -> list[int]:
    """Per request, the output tokens the server reported (num_output_tokens of its last response)
    and checked against the output_ids it streamed."""
    with open(export_path) as f:
        requests = json.load(f)["experiments"][0]["requests"]
    counts = []
    for r in requests:
        outs = r["response_outputs"]
        ids = [i for o in outs for i in (o["output_ids"] if isinstance(o["output_ids"], list) else [o["output_ids"]])]
        assert int(outs[-1]["num_output_tokens"]) == len(ids)
        counts.append(len(ids))
    return counts


def test_perf_analyzer_streaming(llm_server, tmp_path):
    data = {"data": [{"text_input": ["Write about the sea."], "max_tokens": [TOKENS], "min_tokens": [TOKENS],
                      "stream": [True], **{flag: [True] for flag in FLOAT_OUTPUT_FLAGS}}]}
    (tmp_path / "in.json").write_text(json.dumps(data))
    export = tmp_path / "pa.json"
    out = subprocess.run([os.path.join(BIN, "perf_analyzer"), "-m", "llm", "-i", "grpc", "-u", llm_server.grpc_url,
                          "--streaming", "--input-data", str(tmp_path / "in.json"), "--concurrency-range", "2",
                          "--measurement-mode", "count_windows", "--measurement-request-count", "4",
                          "-s", "1000", "--max-trials", "3", "--profile-export-file", str(export)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert export.stat().st_size > 0, "perf_analyzer wrote an empty export:\n" + out.stdout + out.stderr
    counts = server_counts(str(export))
    assert counts and all(c == TOKENS for c in counts)
    with open(export) as f:
        requests = json.load(f)["experiments"][0]["requests"]
    assert all(len(r["response_timestamps"]) == TOKENS for r in requests)  # one response per token


@pytest.mark.parametrize("backend", ["tensorrtllm", "vllm"])
def test_genai_perf(llm_server, default_model, tmp_path, backend):
    out = subprocess.run([os.path.join(BIN, "genai-perf"), "profile", "-m", "llm", "--backend", backend,
                          "--streaming", "-u", llm_server.grpc_url, "--tokenizer", default_model,
                          "--synthetic-input-tokens-mean", "16", "--output-tokens-mean", str(TOKENS),
                          "--output-tokens-mean-deterministic", "--concurrency", "2", "--request-count", "4",
                          "--warmup-request-count", "0", "--artifact-dir", str(tmp_path),
                          *[arg for flag in FLOAT_OUTPUT_FLAGS for arg in ("--extra-inputs", f"{flag}:true")]],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"]})  # it runs perf_analyzer
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [run_dir] = [d for d in tmp_path.iterdir() if d.is_dir() and d.name.startswith("llm-")]
    counts = server_counts(str(run_dir / "profile_export.json"))
    summary = json.loads((run_dir / "profile_export_genai_perf.json").read_text())
    osl = summary["output_sequence_length"]
    assert len(counts) == 4 and all(c == TOKENS for c in counts)
    assert (osl["min"], osl["avg"], osl["max"]) == (TOKENS, TOKENS, TOKENS)
