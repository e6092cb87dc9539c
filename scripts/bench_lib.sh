# Sourced by the one-server benchmark scripts (bench_overlap.sh, bench_dllm.sh, bench_dp.sh).

# set_param FILE KEY VALUE: the string_value of a config.pbtxt parameter.
set_param() {
    python3 - "$@" <<'PY'
import re, sys
path, key, value = sys.argv[1:]
text = open(path).read()
text, n = re.subn(r'(key: "%s"\s*value: \{ string_value: ")[^"]*(")' % re.escape(key),
                  lambda m: m.group(1) + value + m.group(2), text)
assert n == 1, f"{path}: no parameter {key}"
open(path, "w").write(text)
PY
}

# start_server REPO LOG PORT_BASE MODEL...: tritonserver with those models (http PORT_BASE,
# grpc +1, metrics +2), stopped when the calling script exits; returns once it is ready.
start_server() {
    local repo=$1 log=$2 port=$3 loads="" m
    shift 3
    for m in "$@"; do loads="$loads --load-model $m"; done
    echo "== tritonserver (log $log)"
    setsid .venv/bin/tritonserver --model-repository "$repo" --model-control-mode explicit $loads \
        --http-port "$port" --grpc-port $((port + 1)) --metrics-port $((port + 2)) >"$log" 2>&1 &
    SERVER=$!
    trap 'kill -- -$SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
        curl -sf -m 2 "http://127.0.0.1:$port/v2/health/ready" -o /dev/null && return 0
        kill -0 $SERVER 2>/dev/null || { tail -30 "$log"; exit 1; }
        sleep 1
    done
    echo "tritonserver not ready after 600 s" >&2
    exit 1
}

# run_rounds TARGET_ARGS...: `client.bench` with those --target arguments through LEVELS,
# ROUNDS times (REQUESTS a level), each round into $OUT/round-N, then the medians of the
# rounds' ratios into $OUT/rounds.txt; names the CPU first.
run_rounds() {
    local runs="" r
    lscpu | grep -m1 "Model name" | tee "$OUT/cpu.txt"
    for r in $(seq "$ROUNDS"); do
        echo "== round $r"
        .venv/bin/python -m client.bench "$@" --concurrency $LEVELS --requests "$REQUESTS" \
            --out "$OUT/round-$r"
        runs="$runs $OUT/round-$r/bench.json"
    done
    if [ "$ROUNDS" -gt 1 ]; then .venv/bin/python -m client.bench --rounds $runs | tee "$OUT/rounds.txt"; fi
}
