"""make gpu-bench's CPU smoke run (the tiny shape; figures mean nothing here) and its arithmetic:
the run writes every part of the report, the output tokens it counts are the ones asked
for, the `llm` model it serves through the real tritonserver streams them too, and the
roofline's weight bytes equal the parameters transformers builds for the shape."""
import json
import os
import subprocess
import sys

import pytest
import torch

from client import bench_gpu
from client.triton_server import ROOT


def test_weight_bytes_per_step_equal_the_parameters_read():
    """Every parameter but the embedding table (a step reads B of its rows) is read once a step."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = bench_gpu.hf_config("tiny", 64)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    weights, kv = bench_gpu.bytes_per_step(config, torch.bfloat16, contexts=10)
    assert weights == 2 * params
    assert kv == 10 * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2


@pytest.mark.server
def test_cpu_smoke_run_writes_the_report_and_serves(tmp_path):
    server = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "lib",
                          f"python{sys.version_info.major}.{sys.version_info.minor}", "site-packages", "pytriton",
                          "tritonserver")
    proc = subprocess.run([sys.executable, "-m", "client.bench_gpu", "--out", str(tmp_path), "--no-peer",
                           "--levels", "1:16,16:24", "--output-tokens", "6", "--variants", "torch-ops", "overlap=on",
                           "--serve", server], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert [(r["streams"], r["prompt_tokens"]) for r in report["engine"]] == [(1, 16), (16, 24)]
    for row in report["engine"] + report["variants"]["torch-ops"] + report["variants"]["overlap=on"]:
        assert row["tokens"] == row["streams"] * 6 and row["tok_s"] > 0 and row["roofline_ms"] > 0
    assert len(report["engine"][0]["ids"]) == 6 and report["variants"]["overlap=on"][0]["ids_equal_main"] is True
    assert "error" not in report["served"], report["served"]
    assert report["served"]["16x24"]["tokens"] == 16 * 6
    assert report["engine"][1]["served_over_engine"] > 0
    assert report["hardware"]["copy_bytes_s"] > 0 and "| 16 x 24 |" in proc.stdout



def test_a_package_failing_under_the_stubs_numpy_is_hidden_from_the_stub(tmp_path, monkeypatch):
    """The stub's environment: a package of the outer Python that raises on import (as one built
    for numpy 2 does under the stub's numpy 1.26) is named from the probe's traceback and hidden
    (a .pth the stub's Python runs); the next probe imports the model, the package absent."""
    from client import bench_gpu_serve

    outer, site = tmp_path / "outer", tmp_path / "site"
    (outer / "brokenpkg").mkdir(parents=True)
    site.mkdir()
    (outer / "brokenpkg" / "__init__.py").write_text("import numpy\nraise ImportError('built for numpy 2')\n")
    (site / "outer.pth").write_text(f"{outer}\n{ROOT}\n")
    python = tmp_path / "python"  # a Python whose imports look for brokenpkg as transformers does
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import site, sys, importlib.util; "
                      f"site.addsitedir('{site}'); importlib.util.find_spec('brokenpkg') and __import__('brokenpkg'); "
                      f"exec(sys.argv[2])\" \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setattr(bench_gpu_serve, "outer_site_packages", lambda: [str(outer)])
    assert bench_gpu_serve.check_stub_imports(str(python), str(site)) == ["brokenpkg"]
    (site / "hidden.pth").unlink()  # a failure inside torch: never hidden, the traceback raised
    monkeypatch.setattr(bench_gpu_serve, "failing_package", lambda stderr, dirs: "torch")
    with pytest.raises(RuntimeError, match="cannot import the model"):
        bench_gpu_serve.check_stub_imports(str(python), str(site), tries=2)
