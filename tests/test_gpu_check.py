"""`make gpu-check`, here where there is no GPU: the script runs with a SKIP line per CUDA
step, and its steps run on the CPU (`--device cpu`), where they must pass, and fail when the
engine under test differs from the fp32 reference."""
import os
import subprocess

import pytest
import torch

from client import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoints(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_checkpoints")
    for arch in ("llama", "qwen3"):
        os.symlink(checkpoint(arch), root / arch)
    return str(root)


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the CUDA steps run instead of skipping")
def test_the_script_skips_every_cuda_step_with_a_line(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line[:4] in ("PASS", "SKIP", "FAIL")]
    assert [line.split(" (")[0] for line in lines] == [f"SKIP {name}" for name, _ in gpu_check.STEPS]
    assert "no CUDA device" in lines[0] and (tmp_path / "gpu_check.txt").exists()


def test_its_steps_pass_on_the_cpu(checkpoints, tmp_path, capsys):
    tokenizer = os.path.join(checkpoints, "llama")
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--checkpoints", checkpoints,
                           "--tokenizer", tokenizer])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("engines", "seeded sampling", "hand-off"):
        assert f"PASS {name}" in out


def test_the_engine_step_fails_when_the_engine_differs(checkpoints, monkeypatch):
    """The engine under test loads another checkpoint's weights: greedy ids and logits differ."""
    from transformers import AutoTokenizer
    real, other, calls = gpu_check.engine, os.path.join(checkpoints, "qwen3"), {"n": 0}

    def engine(path, tok, device, dtype):
        calls["n"] += 1  # the first engine is the fp32 reference, the second the one checked
        return real(path if calls["n"] == 1 else other, tok, device, dtype)
    monkeypatch.setattr(gpu_check, "engine", engine)
    llama = os.path.join(checkpoints, "llama")
    problems = gpu_check.compare_one(llama, AutoTokenizer.from_pretrained(llama), "cpu", "float32")
    assert "token" in problems and "logits differ" in problems


def test_the_kernel_bench_exits_1_when_a_paged_output_is_off(monkeypatch, capsys):
    """kernels.bench checks every paged backend against SDPA over contiguous KV; a backend
    off by 0.1 fails its rows and the exit code, honest ones pass."""
    from kernels import bench
    from kernels.torch_ref import TorchAttention

    class Off(TorchAttention):
        def attend(self, *args):
            return super().attend(*args) + 0.1
    assert bench.main(["--device", "cpu", "--quick"]) == 0
    monkeypatch.setattr(bench, "paged_backends", lambda device: {"torch-paged": TorchAttention(), "off": Off()})
    assert bench.main(["--device", "cpu", "--quick"]) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("decode", "extend"))]
    assert rows and all("FAIL" in line.split("| off")[1] for line in rows[-4:])
