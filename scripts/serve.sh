#!/usr/bin/env bash
# make serve: tritonserver on model_repository (ports 8000/8001/8002) and the OpenAI-compatible
# service in front of it (port 9000), a streamed demo answer through each once they are ready,
# then keeps serving until Ctrl-C (--demo-only: stop).
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate
# Its own process group: tritonserver 2.51 sometimes never sends a Python model its finalize
# (triton-inference-server/server#8755), exits after its 30 s exit timeout and leaves that
# model's stub running; killing the group at the end reaps it.
# Its output goes to LOG, read at the end to tell that failure apart (scripts/server_exit.sh),
# and is shown from there as it comes.
LOG=$(mktemp -t tandem-serve.XXXXXX)
setsid tritonserver --model-repository model_repository "${@:2}" > "$LOG" 2>&1 &
SERVER=$!
tail -n +1 -f --pid=$SERVER "$LOG" &
OPENAI=""
stop_server() {
    local rc=0
    [ -n "$OPENAI" ] && { kill $OPENAI 2>/dev/null; wait $OPENAI 2>/dev/null || true; }
    kill $SERVER 2>/dev/null && { wait $SERVER 2>/dev/null || rc=$?; }
    kill -9 -- -$SERVER 2>/dev/null || true
    local status=0
    scripts/server_exit.sh "$LOG" $rc || status=$?
    rm -f "$LOG"
    return $status
}
trap stop_server EXIT INT TERM
for _ in $(seq 1 300); do
    curl -sf localhost:8000/v2/health/ready >/dev/null 2>&1 && break
    kill -0 $SERVER 2>/dev/null || { echo "tritonserver exited" >&2; exit 1; }
    sleep 1
done
python -m client.openai_server --url localhost:8001 --port 9000 --log-level warning &
OPENAI=$!
echo; echo "== python -m client \"What is the capital of France?\""
python -m client "What is the capital of France?"
for _ in $(seq 1 60); do
    curl -sf localhost:9000/health >/dev/null 2>&1 && break
    kill -0 $OPENAI 2>/dev/null || { echo "the OpenAI service exited" >&2; exit 1; }
    sleep 1
done
echo; echo "== the OpenAI API: POST localhost:9000/v1/chat/completions"
curl -s localhost:9000/v1/chat/completions -H 'Content-Type: application/json' \
     -d '{"model": "llm", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}'
echo
[ "${1:-}" = "--demo-only" ] && exit 0
echo; echo "== serving: Triton on localhost:8001 (gRPC), 8000 (HTTP), 8002 (metrics);"
echo "   the OpenAI API on http://localhost:9000/v1 (models: llm, router); Ctrl-C stops"
wait $SERVER
