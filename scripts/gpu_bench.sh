#!/usr/bin/env bash
# make gpu-bench: the engine on a GPU against the hardware and transformers' continuous
# batching (client/bench_gpu.py). On a bare GPU box it runs on the image's own Python (torch,
# triton, transformers >= 5: nothing to carry but the working tree); on a machine without
# CUDA, on .venv's, a tiny shape on the CPU as a smoke test. Report: $OUT/gpu_bench.json
# (default artifacts/gpu-bench). Extra arguments go to client.bench_gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/artifacts/gpu-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
"$PY" -c "import torch, transformers" 2>/dev/null || PY=$PWD/.venv/bin/python
export PYTHONPATH=$PWD
timeout 420 "$PY" -m client.bench_gpu --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.txt"
exit "${PIPESTATUS[0]}"
