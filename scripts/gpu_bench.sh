#!/usr/bin/env bash
# make gpu-bench: the engine on a GPU against the hardware and transformers' continuous
# batching (client/bench_gpu.py). On a bare GPU box it runs on the image's own Python (torch,
# triton, transformers >= 5: nothing to carry but the working tree, and .gpu-serve for the
# tritonserver part, which runs when it is there); on a machine without CUDA, on .venv's, a
# tiny shape on the CPU as a smoke test. Report: $OUT/gpu_bench.json
# (default artifacts/gpu-bench). Extra arguments go to client.bench_gpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/artifacts/gpu-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
"$PY" -c "import torch, transformers" 2>/dev/null || PY=$PWD/.venv/bin/python
export PYTHONPATH=$PWD
SERVE=()
if [ -f .gpu-serve/tritonserver.tar.xz ] && "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    # the model through tritonserver too (scripts/gpu_serve_prepare.sh made the tree)
    TSDIR=$(mktemp -d)
    tar xJf .gpu-serve/tritonserver.tar.xz -C "$TSDIR"
    SERVE=(--serve "$TSDIR/pytriton/tritonserver")
    for wheel in .gpu-serve/numpy-*.whl; do   # the stub's numpy (scripts/gpu_serve_prepare.sh)
        [ -f "$wheel" ] && "$PY" -m zipfile -e "$wheel" "$TSDIR/stub-site" && SERVE+=(--stub-path "$TSDIR/stub-site")
    done
fi
timeout 560 "$PY" -m client.bench_gpu --out "$OUT" "${SERVE[@]}" "$@" 2>&1 | tee "$OUT/gpu_bench.txt"
exit "${PIPESTATUS[0]}"
