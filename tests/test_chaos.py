"""python -m client.chaos against the real server: cancelling and malformed clients mixed
with good ones; good answers stay exact, bad ones get clear errors, KV comes back full."""
import json
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = pytest.mark.server


def test_chaos_llm(llm_server, tmp_path):
    out = tmp_path / "chaos.json"
    # 12 requests: 5 malformed (one of each kind), 4 cancelled, 3 good.
    proc = subprocess.run([sys.executable, "-m", "client.chaos", "--url", llm_server.grpc_url,
                           "--http-url", f"http://localhost:{llm_server.http_port}",
                           "--metrics-url", f"http://localhost:{llm_server.metrics_port}/metrics",
                           "--model", "llm", "-n", "12", "--bad-share", "0.42", "--cancel-share", "0.34",
                           "--max-tokens", "8", "--seed", "1", "--timeout", "120", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "PASS" in proc.stdout
    report = json.loads(out.read_text())
    kinds = {j["kind"] for j in report["jobs"]}
    assert {"good", "cancel_early", "cancel_mid"} <= kinds and sum(k.startswith("bad:") for k in kinds) == 5
    assert report["failures"] == []
    # The chaos ends with one more good request; its pages are free before its last response
    # leaves, but the gauges are published every 0.1 s.
    assert llm_server.wait_kv_full("llm"), llm_server.kv_pages("llm")
