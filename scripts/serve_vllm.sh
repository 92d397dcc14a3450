#!/usr/bin/env bash
# Serves vLLM's OpenAI-compatible API with dpbalance on, on this machine's CPUs (DP = 2).
# It runs the quickstart of README.md and docs/live_vllm.md, as written there (tests/integration/vllm_serve_test.py checks
# that the three copies of the block are the same text, and runs this script).
#
#   scripts/serve_vllm.sh [--no-install]
#
# First (unless --no-install) `scripts/live_vllm.sh --install-only`: the pinned vLLM (CPU) venv in
# ~/.cache/dpb-vllm (made once, ~10 min) and this checkout's plugin package in it. Then the block:
# it writes the random-weight test model and serves it with DP=2 on port 8000 until Ctrl-C.
# DPBALANCE_PORT, DPBALANCE_MODEL and DPBALANCE_STEP_DIR override the port, the model folder and
# the step-log folder; any DPB_* flag in the environment reaches the plugin (docs/flags.md).
# Exit status: vLLM's; 3 when the install failed.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --no-install) ;;
  "") scripts/live_vllm.sh --install-only ;;
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
  *) echo "serve_vllm.sh: unknown flag '$1' (see --help)" >&2; exit 2 ;;
esac
set +u  # the venv's activate script reads unset variables

# --- quickstart: vLLM on CPUs (begin) ---
. "${DPBALANCE_VLLM_VENV:-$HOME/.cache/dpb-vllm/venv}/bin/activate"
port=${DPBALANCE_PORT:-8000} model=${DPBALANCE_MODEL:-/tmp/dpb-model}
python integration/vllm/live_bench.py write-model "$model"  # a config.json: random weights, no tokenizer
export DPB_PLUGIN=dpbalance                        # dpbalance on (unset or none: vLLM as shipped)
export DPBALANCE_VLLM_CPU_DP=1                     # vLLM's CPU platform plus the DP-MoE collectives it lacks
export VLLM_CPU_KVCACHE_SPACE=1                    # 1 GiB of KV cache per rank (vLLM's default: half the RAM)
export VLLM_CPU_OMP_THREADS_BIND='0|1'             # one core per DP rank
export DPBALANCE_VLLM_STEP_LOG=${DPBALANCE_STEP_DIR:-/tmp/dpb-steps}  # per-step and final records
dpbalance-vllm serve "$model" --port "$port" --data-parallel-size 2 \
  --enforce-eager --load-format dummy --skip-tokenizer-init --dtype bfloat16 \
  --max-model-len 4096 --max-num-seqs 16 \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 1, "prompt_lookup_max": 3}' \
  --scheduler-cls dpbalance_vllm.scheduler.DpbScheduler \
  --worker-cls dpbalance_vllm.worker.DpbWorker \
  --distributed-executor-backend dpbalance_vllm.executor.DpbExecutor
# --- quickstart: vLLM on CPUs (end) ---
