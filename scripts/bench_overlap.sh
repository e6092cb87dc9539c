#!/usr/bin/env bash
# Overlap scheduling off vs on, side by side in one run: one tritonserver serves `llm`,
# `router` (with `prefill`, `decode`) as configured, and copies of all four with
# `overlap` "on" (`llm_overlap`, `router_overlap` -> `prefill_overlap`, `decode_overlap`);
# `python -m client.bench` (genai-perf) sweeps LEVELS over every target, ROUNDS times,
# each target through every level in turn. Never run in CI (minutes of full load).
#
#   OUT=artifacts/bench-overlap ROUNDS=2 bash scripts/bench_overlap.sh
#
# Environment: OUT, ROUNDS (2), LEVELS ("1 8 16"), REQUESTS (32 per level),
# TARGETS ("llm router"), PORT_BASE (18300: http, +1 grpc, +2 metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/artifacts/bench-overlap}
ROUNDS=${ROUNDS:-2}
LEVELS=${LEVELS:-"1 8 16"}
REQUESTS=${REQUESTS:-32}
TARGETS=${TARGETS:-"llm router"}
PORT_BASE=${PORT_BASE:-18300}
REPO=$OUT/repo
rm -rf "$REPO" && mkdir -p "$REPO"

source scripts/bench_lib.sh

for m in llm router prefill decode; do
    cp -r "model_repository/$m" "$REPO/$m"
    cp -r "model_repository/$m" "$REPO/${m}_overlap"
    sed -i "s/^name: \"$m\"/name: \"${m}_overlap\"/" "$REPO/${m}_overlap/config.pbtxt"
done
rm -rf "$REPO"/*/1/__pycache__
for m in llm prefill decode; do set_param "$REPO/${m}_overlap/config.pbtxt" overlap on; done
set_param "$REPO/prefill_overlap/config.pbtxt" nixl_port 17556
set_param "$REPO/decode_overlap/config.pbtxt" prefill_address 127.0.0.1:17556
set_param "$REPO/router_overlap/config.pbtxt" prefill_model prefill_overlap
set_param "$REPO/router_overlap/config.pbtxt" decode_model decode_overlap

models=""
targets=""
for t in $TARGETS; do
    for m in $t ${t}_overlap; do
        models="$models $m"
        targets="$targets --target $m=grpc://localhost:$((PORT_BASE + 1))"
    done
    if [ "$t" = router ]; then models="$models prefill decode prefill_overlap decode_overlap"; fi
done
start_server "$REPO" "$OUT/server.log" "$PORT_BASE" $models
run_rounds $targets
