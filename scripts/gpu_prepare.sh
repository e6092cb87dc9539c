#!/usr/bin/env bash
# Fills .gpu-check/ (git-ignored, ~52 MB: carry it to the GPU box beside the working tree):
#   wheels/       scripts/gpu_wheels.txt for Python 3.12, manylinux x86_64 (the GPU image's)
#   checkpoints/  the tiny random checkpoint of every architecture; they all use the default
#                 model's tokenizer, kept once, in checkpoints/llama
# Run by `make setup` here; scripts/gpu_check.sh uses what it finds there.
set -euo pipefail
cd "$(dirname "$0")/.."
PREP=.gpu-check
mkdir -p "$PREP/wheels" "$PREP/checkpoints"
.venv/bin/python -m pip download -q -d "$PREP/wheels" --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux1_x86_64 -r scripts/gpu_wheels.txt
.venv/bin/python - <<'PY'
import os
from tests.checkpoints import configs, make_checkpoint
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
for arch in configs():
    out = os.path.join(".gpu-check", "checkpoints", arch)
    if not os.path.exists(os.path.join(out, "config.json")):
        os.makedirs(out, exist_ok=True)
        make_checkpoint(arch, out)
    for name in TOKENIZER if arch != "llama" else ():
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
PY
du -sh "$PREP"
