#!/usr/bin/env bash
# make gpu-check: one command that tells everything about the CUDA path on a bare GPU box
# (the image's own Python, torch and triton; no .venv, no registry). Carry the git-ignored
# .gpu-check/ (wheels and tiny checkpoints, ~48 MB, made by scripts/gpu_prepare.sh during
# `make setup`) beside the working tree. Writes the report and logs to $OUT
# (artifacts/gpu-check). Without CUDA each CUDA step prints a SKIP line, so it runs in CI.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/artifacts/gpu-check}
PREP=$ROOT/.gpu-check
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    PY=$ROOT/.venv/bin/python   # a development machine: the project's environment
fi
export PYTHONPATH=$ROOT
if ! "$PY" -c "import pytest, transformers, safetensors, numpy" 2>/dev/null; then
    echo "installing the carried wheels into $PREP/site"
    # The image's own numpy stays: its scipy (which transformers imports through sklearn when
    # it is there) needs numpy 2, and a carried 1.26 ahead of it on the path broke that import
    # under pytest on the H200 image. numpy < 2 matters only inside the Triton stub.
    REQS=$OUT/gpu_wheels.txt
    if "$PY" -c "import numpy" 2>/dev/null; then grep -v '^numpy==' scripts/gpu_wheels.txt > "$REQS"
    else cp scripts/gpu_wheels.txt "$REQS"; fi
    "$PY" -m pip install -q --no-index --find-links "$PREP/wheels" --target "$PREP/site" \
        -r "$REQS" || { echo "FAIL wheels: run scripts/gpu_prepare.sh and carry .gpu-check"; exit 1; }
    export PYTHONPATH=$ROOT:$PREP/site
fi
timeout 480 "$PY" -m client.gpu_check --out "$OUT" 2>&1 | tee "$OUT/gpu_check.txt"
exit "${PIPESTATUS[0]}"
