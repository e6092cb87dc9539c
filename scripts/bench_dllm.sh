#!/usr/bin/env bash
# Block-diffusion serving through tritonserver, three ways side by side in one run: prefill
# and denoising work in separate steps (the default), in shared steps (dllm_mixed_batches
# on), and one request at a time (max_running_requests 1, what a per-request loop gives).
# No block-diffusion weights can be downloaded here, so the model is the default one with
# dllm_block_size and mask_token_id added to its config.json: its text is meaningless, its
# cost per token real. `python -m client.bench` (genai-perf), each target through LEVELS in
# turn. Never run in CI.
#
#   OUT=artifacts/bench-dllm bash scripts/bench_dllm.sh
#
# Environment: OUT, LEVELS ("1 8 16"), REQUESTS (16), OUTPUT_TOKENS (64), BLOCK (8),
# THRESHOLD (0.9), PORT_BASE (18400).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/artifacts/bench-dllm}
LEVELS=${LEVELS:-"1 8 16"}
REQUESTS=${REQUESTS:-16}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
BLOCK=${BLOCK:-8}
THRESHOLD=${THRESHOLD:-0.9}
PORT_BASE=${PORT_BASE:-18400}
REPO=$OUT/repo
MODEL=$OUT/smollm2-dllm
rm -rf "$REPO" && mkdir -p "$REPO" "$MODEL"
cp models/SmolLM2-135M-Instruct/* "$MODEL/"
python3 - "$MODEL/config.json" "$BLOCK" <<'PY'
import json, sys
path, block = sys.argv[1], int(sys.argv[2])
config = json.load(open(path))
config.update(dllm_block_size=block, mask_token_id=config["vocab_size"] - 1)
json.dump(config, open(path, "w"), indent=1)
PY
source scripts/bench_lib.sh

targets=""
for m in dllm dllm_mixed dllm_serial; do
    cp -r model_repository/llm "$REPO/$m"
    rm -rf "$REPO/$m/1/__pycache__"
    sed -i "s/^name: \"llm\"/name: \"$m\"/" "$REPO/$m/config.pbtxt"
    set_param "$REPO/$m/config.pbtxt" model_path "$MODEL"
    set_param "$REPO/$m/config.pbtxt" dllm_threshold "$THRESHOLD"
    set_param "$REPO/$m/config.pbtxt" max_context 1024
    targets="$targets --target $m=grpc://localhost:$((PORT_BASE + 1))"
done
set_param "$REPO/dllm_mixed/config.pbtxt" dllm_mixed_batches on
set_param "$REPO/dllm_serial/config.pbtxt" max_running_requests 1

start_server "$REPO" "$OUT/server.log" "$PORT_BASE" dllm dllm_mixed dllm_serial
lscpu | grep -m1 "Model name" | tee "$OUT/cpu.txt"
.venv/bin/python -m client.bench $targets --concurrency $LEVELS --requests "$REQUESTS" \
    --output-tokens "$OUTPUT_TOKENS" --out "$OUT/run"
