#!/usr/bin/env bash
# DP attention: `llm` with dp_size 1 against a copy with dp_size 2 (`llm_dp2`: two rank
# processes, one core each on a 2-core machine), side by side in one tritonserver run;
# `python -m client.bench` (genai-perf) sweeps LEVELS over both, ROUNDS times, each target
# through every level in turn. Never run in CI (minutes of full load).
#
#   OUT=artifacts/bench-dp ROUNDS=2 bash scripts/bench_dp.sh
#
# Environment: OUT, ROUNDS (2), LEVELS ("1 8 16"), REQUESTS (32 per level),
# PORT_BASE (18500: http, +1 grpc, +2 metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/artifacts/bench-dp}
ROUNDS=${ROUNDS:-2}
LEVELS=${LEVELS:-"1 8 16"}
REQUESTS=${REQUESTS:-32}
PORT_BASE=${PORT_BASE:-18500}
REPO=$OUT/repo
rm -rf "$REPO" && mkdir -p "$REPO"

source scripts/bench_lib.sh

cp -r model_repository/llm "$REPO/llm"
cp -r model_repository/llm "$REPO/llm_dp2"
rm -rf "$REPO"/*/1/__pycache__
sed -i 's/^name: "llm"/name: "llm_dp2"/' "$REPO/llm_dp2/config.pbtxt"
set_param "$REPO/llm_dp2/config.pbtxt" dp_size 2

start_server "$REPO" "$OUT/server.log" "$PORT_BASE" llm llm_dp2
targets="--target llm=grpc://localhost:$((PORT_BASE + 1)) --target llm_dp2=grpc://localhost:$((PORT_BASE + 1))"
run_rounds $targets
