#!/usr/bin/env bash
# The main job: set everything up, start vLLM with KVLens on the real model (SmolLM2-135M-Instruct,
# converted by scripts/setup.sh into .run/smollm2-135m), ask it questions about short documents
# (scripts/rag_workload.py: answers printed in words beside the tokens KVLens supplied), stop the
# server.
#
#   bash scripts/demo.sh [--tiny] [workload options, e.g. --rounds 4 --reset request --expect-kvlens]
#
# --tiny: the tiny random-weight test model and the token-level workload (scripts/workload.py)
# instead; its answers are gibberish, and it starts and answers faster.
# Environment: PORT (default 8000); KVLENS_DEMO_NO_CONNECTOR=1 starts vLLM without
# --kv-transfer-config (baseline); KVLENS_DEMO_STARTUP_TIMEOUT (default 300 s);
# KVLENS_DEMO_KEEP=1 keeps the server running after the workload (Ctrl-C stops it), to watch
# it in the dashboard (streamlit run dashboard/app.py).
# The server log is .run/serve.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

PY="$KVLENS_VENV/bin/python"
PORT="${PORT:-8000}"
BASE="http://127.0.0.1:$PORT"
LOG="$KVLENS_RUN_DIR/serve.log"
STARTUP_TIMEOUT="${KVLENS_DEMO_STARTUP_TIMEOUT:-300}"
KV_CONFIG='{"kv_connector":"KVLensConnector","kv_connector_module_path":"connector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"lmcache.chunk_size":256,"lmcache.max_local_cpu_size":1}}'

MODEL="$KVLENS_REAL_MODEL"
WORKLOAD=scripts/rag_workload.py
WORKLOAD_ARGS=()
for arg in "$@"; do
    if [ "$arg" = --tiny ]; then
        MODEL="$KVLENS_TINY_MODEL"
        WORKLOAD=scripts/workload.py
    else
        WORKLOAD_ARGS+=("$arg")
    fi
done
if [ ! -f "$MODEL/config.json" ]; then
    echo "[demo] ERROR: no model in $MODEL (scripts/setup.sh makes it; see its output above)" >&2
    exit 1
fi

# The checkpoints are bf16; an x86 CPU without AVX-512 has torch emulate bf16 (a prefill ~50x
# slower than in fp32, measured on such a machine), so there the demo serves in fp32, as the
# benchmarks do (bench/lib/report.py's native_dtype).
DTYPE="$("$PY" -c 'from bench.lib.report import native_dtype; print(native_dtype())')"
SERVE_ARGS=(serve "$MODEL" --host 127.0.0.1 --port "$PORT" --enforce-eager --dtype "$DTYPE"
    --max-model-len 4096 --enable-prompt-tokens-details)
if [ "${KVLENS_DEMO_NO_CONNECTOR:-0}" = 1 ]; then
    echo "[demo] KVLENS_DEMO_NO_CONNECTOR=1: vLLM without KVLens"
else
    SERVE_ARGS+=(--kv-transfer-config "$KV_CONFIG")
fi

# Health probe with the venv's Python (no curl needed); exit 0 when /health answers 200.
health() {
    "$PY" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1] + "/health", timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)' "$BASE"
}

if health; then
    echo "[demo] ERROR: something already serves $BASE; stop it or set PORT" >&2
    exit 1
fi

SERVER_PID=""
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    # vLLM's API server (the group leader) shuts its engine and worker processes down on
    # SIGTERM; whatever is left of the process group after 30 s is killed.
    if kill -0 -- "-$SERVER_PID" 2>/dev/null; then
        echo "[demo] stopping vLLM (process group $SERVER_PID)"
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do
            kill -0 -- "-$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 -- "-$SERVER_PID" 2>/dev/null; then
            echo "[demo] vLLM did not stop in 30 s; killing its process group"
            kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        fi
    fi
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$KVLENS_RUN_DIR"
echo "[demo] starting vLLM with $(basename "$MODEL") on $BASE (log: $LOG)"
START=$(date +%s.%N)
# setsid: own process group, so the whole server (API server, engine core, worker) can be
# stopped together.
VLLM_SERVER_DEV_MODE=1 setsid "$PY" -m connector.launcher "${SERVE_ARGS[@]}" >"$LOG" 2>&1 &
SERVER_PID=$!

deadline=$(($(date +%s) + STARTUP_TIMEOUT))
until health; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "[demo] ERROR: vLLM exited during start-up; last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "[demo] ERROR: vLLM not healthy after ${STARTUP_TIMEOUT}s; last lines of $LOG:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    sleep 1
done
echo "[demo] vLLM ready in $(awk -v s="$START" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}') s"

rc=0
"$PY" "$WORKLOAD" --url "$BASE" ${WORKLOAD_ARGS[@]+"${WORKLOAD_ARGS[@]}"} || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "[demo] workload failed (exit $rc); server log: $LOG" >&2
fi

# From the repository root: its .streamlit/config.toml binds the dashboard to 127.0.0.1.
DASHBOARD=(cd "$ROOT" "&&" "$PY" -m streamlit run dashboard/app.py -- --metrics "127.0.0.1:$PORT")
if [ "${KVLENS_DEMO_KEEP:-0}" = 1 ]; then
    echo "[demo] vLLM keeps running on $BASE (Ctrl-C stops it). Watch it in the dashboard:"
    echo "         ${DASHBOARD[*]}"
    echo "       then open http://localhost:8501 (send more traffic: $PY $WORKLOAD --url $BASE)"
    wait "$SERVER_PID" || true
else
    echo "[demo] To watch this server in the dashboard, run the demo keeping vLLM up:"
    echo "         KVLENS_DEMO_KEEP=1 PORT=$PORT bash scripts/demo.sh"
    echo "       and in another terminal: ${DASHBOARD[*]}   (then open http://localhost:8501)"
fi
exit "$rc"
