#!/usr/bin/env bash
# Penalties' cost, side by side in one run: one tritonserver serves `llm`; `python -m
# client.bench` (genai-perf, the standard workload: 128 prompt tokens, 128 forced output
# tokens, greedy, streaming) drives it as two targets that differ only in the requests:
# `llm` plain, `penalised` with repetition, presence and frequency penalties (TensorRT-LLM
# input tensors) on every request. ROUNDS rounds, each target through every level in turn;
# the medians of llm / penalised output tok/s go to $OUT/rounds.txt. Never run in CI.
#
#   OUT=artifacts/bench-penalties ROUNDS=3 bash scripts/bench_penalties.sh
#
# Environment: OUT, ROUNDS (3), LEVELS ("16"), REQUESTS (48 per level), PORT_BASE (18400).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/artifacts/bench-penalties}
ROUNDS=${ROUNDS:-3}
LEVELS=${LEVELS:-"16"}
REQUESTS=${REQUESTS:-48}
PORT_BASE=${PORT_BASE:-18400}
REPO=$OUT/repo
rm -rf "$REPO" && mkdir -p "$REPO"

source scripts/bench_lib.sh

cp -r model_repository/llm "$REPO/llm"
rm -rf "$REPO"/*/1/__pycache__
start_server "$REPO" "$OUT/server.log" "$PORT_BASE" llm
URL=grpc://localhost:$((PORT_BASE + 1))/llm
run_rounds --target "llm=$URL" \
    --target "penalised=$URL?repetition_penalty=1.1&presence_penalty=0.5&frequency_penalty=0.5"
