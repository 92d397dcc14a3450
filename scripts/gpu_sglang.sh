#!/usr/bin/env bash
# dpbalance against SGLang as shipped, inside a real SGLang instance on GPUs.
# Never run yet: no session that wrote it was lent a GPU with SGLang's GPU build (docs/engines.md
# "SGLang").
# One call, one setup, the same request stream for every arm, DP attention (dp = tp = --dp):
#   --setup mtp     EAGLE/MTP, topk 1 (DeepSeek-V3's MTP is EAGLE with its NextN layer). Arms:
#                   SGLang as shipped at each --static-steps (SGLang refuses adaptive steps under
#                   attention DP, so a fixed depth is what a user has), then dpbalance:
#                   --speculative-adaptive with one batch-size slot of those depths, the depth
#                   agreed by every rank each step (DPB_PLUGIN=dpbalance).
#   --setup dspark  DSpark, SGLANG_RAGGED_VERIFY_MODE=compact, with an SPS table (SGLang's best
#                   option: without one DSpark verifies every draft). Arms: SGLang as shipped with
#                   the table, then dpbalance. --sps-table FILE, or `profile`: the table is made
#                   first with SGLang's own profiler (sglang.benchmark.dspark_sps_profiler all)
#                   against the shipped server.
# Per arm: bubble = SGLang's sglang:dp_attention_sync_wait_seconds per step (each rank's wait in
# the MLP sync for the slowest; SGLANG_ENABLE_METRICS_DP_ATTENTION=1); goodput = output tok/s and
# TPOT mean/p99 from sglang.benchmark.serving. Printed and written to --json with dpbalance over
# the best shipped arm.
#
#   scripts/gpu_sglang.sh --python PY --model DIR --setup mtp|dspark [--draft DIR]
#       [--static-steps "1 3"] [--sps-table FILE|profile] [--dp N] [--prompts N]
#       [--input-len N] [--output-len N] [--json FILE]
#
# Nothing is downloaded (the GPU machine reaches no network): PY is a Python with SGLang >=
# 0.5.23, < 0.6 and its GPU dependencies (`pip install sglang==0.5.23`, not the CPU pins of
# integration/sglang/requirements-cpu.txt) and scikit-build-core; DIR the model (and --draft: the
# EAGLE/DSpark draft; DeepSeek-V3's MTP needs none) on local disk. The package is built and
# installed into a venv layered on PY (as tests/integration/sglang_env.sh does).
# Exit status: 0 done, 1 a run failed, 2 a bad flag or a missing input.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="" MODEL="" DRAFT="" SETUP="" STEPS="1 3" SPS="" DP=2 PROMPTS=256 IN_LEN=1024 OUT_LEN=256
JSON="$ROOT/build/out/gpu_sglang.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="${2:?}"; shift 2 ;;
    --model) MODEL="${2:?}"; shift 2 ;;
    --draft) DRAFT="${2:?}"; shift 2 ;;
    --setup) SETUP="${2:?}"; shift 2 ;;
    --static-steps) STEPS="${2:?}"; shift 2 ;;
    --sps-table) SPS="${2:?}"; shift 2 ;;
    --dp) DP="${2:?}"; shift 2 ;;
    --prompts) PROMPTS="${2:?}"; shift 2 ;;
    --input-len) IN_LEN="${2:?}"; shift 2 ;;
    --output-len) OUT_LEN="${2:?}"; shift 2 ;;
    --json) JSON="${2:?}"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_sglang.sh: unknown flag '$1' (see --help)" >&2; exit 2 ;;
  esac
done
bad() { echo "gpu_sglang.sh: $1" >&2; exit 2; }
[ -n "$PY" ] && [ -x "$PY" ] || bad "--python '$PY' is not an executable Python with SGLang"
[ -d "$MODEL" ] || bad "--model '$MODEL' is not a directory"
[ -z "$DRAFT" ] || [ -d "$DRAFT" ] || bad "--draft '$DRAFT' is not a directory"
case "$SETUP" in
  mtp) for s in $STEPS; do [[ "$s" =~ ^[1-8]$ ]] || bad "--static-steps '$STEPS': each must be 1..8"; done ;;
  dspark) [ -n "$DRAFT" ] || bad "--setup dspark needs --draft (a DSpark draft with its confidence head)"
          [ "$SPS" = profile ] || [ -f "$SPS" ] || bad "--sps-table '$SPS' is neither a file nor 'profile'" ;;
  *) bad "--setup '$SETUP' must be mtp or dspark" ;;
esac
[[ "$DP" =~ ^[1-9][0-9]*$ ]] || bad "--dp '$DP' is not a positive integer"
for v in PROMPTS IN_LEN OUT_LEN; do [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || bad "--${v,,} '${!v}' is not a positive integer"; done
"$PY" -c 'import sglang, sys; v = tuple(int(x) for x in sglang.__version__.split(".")[:3]); sys.exit(not ((0, 5, 23) <= v < (0, 6)))' \
  || bad "'$PY' has no SGLang >= 0.5.23, < 0.6 (dpbalance_sglang's supported range)"
command -v nvidia-smi >/dev/null && [ "$(nvidia-smi -L | wc -l)" -ge "$DP" ] || bad "fewer than --dp $DP GPUs"
mkdir -p "$(dirname "$JSON")"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/dpb-gpu-sglang.XXXXXX")"
SERVER_PID=""
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK/venv"; }
trap cleanup EXIT
# dpbalance_sglang (with its bundled libdpbalance.so) in a venv layered on PY.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -m venv --without-pip "$WORK/venv"
OWN="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$SITE" > "$OWN/dpb_sglang_base.pth"
"$WORK/venv/bin/python" -m pip install --no-deps --no-build-isolation --no-input --quiet \
    --config-settings=build-dir="$WORK/build" "$ROOT/integration/sglang"
RUN_PY="$WORK/venv/bin/python"

spec_args() {  # spec_args ARM: SGLang's speculative flags for one arm
  local arm="$1" draft=(); [ -n "$DRAFT" ] && draft=(--speculative-draft-model-path "$DRAFT")
  case "$arm" in
    steps*) local s="${arm#steps}"
            echo --speculative-algorithm EAGLE --speculative-eagle-topk 1 --speculative-num-steps "$s" \
                 --speculative-num-draft-tokens $((s + 1)) "${draft[@]}" ;;
    mtp_dpb) # one batch-size slot, so every depth has step graphs for every batch size; SGLang
             # resolves the draft tokens per depth (steps + 1) itself
             printf '{"1": {"candidate_steps": [%s]}}' "$(echo "$STEPS" | tr ' ' ',')" > "$WORK/adaptive.json"
             echo --speculative-algorithm EAGLE --speculative-eagle-topk 1 --speculative-num-steps "${STEPS%% *}" \
                  --speculative-adaptive --speculative-adaptive-config "$WORK/adaptive.json" "${draft[@]}" ;;
    dspark*) local table=(); [ -f "$WORK/sps.json" ] && table=(--speculative-dspark-sps-table-path "$WORK/sps.json")
             echo --speculative-algorithm DSPARK "${draft[@]}" "${table[@]}" ;;
  esac
}

start() {  # start ARM PORT PLUGIN: an SGLang server, waits for /health
  local arm="$1" port="$2" plugin="$3" log="$WORK/server_$1.log"
  # shellcheck disable=SC2046
  env DPB_PLUGIN="$plugin" SGLANG_PLUGINS=dpbalance SGLANG_RAGGED_VERIFY_MODE=compact \
      SGLANG_ENABLE_METRICS_DP_ATTENTION=1 DPB_LOG_EVERY=1000 \
      "$RUN_PY" -m sglang.launch_server --model-path "$MODEL" --tp-size "$DP" --dp-size "$DP" \
      --enable-dp-attention --enable-metrics --port "$port" $(spec_args "$arm") >"$log" 2>&1 &
  SERVER_PID=$!
  local t=0
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    sleep 5; t=$((t + 5))
    if ! kill -0 "$SERVER_PID" 2>/dev/null || [ $t -gt 1200 ]; then
      echo "gpu_sglang.sh: the $arm server did not come up; tail of $log:" >&2; tail -n 30 "$log" >&2; exit 1
    fi
  done
  if [ "$plugin" != none ] && ! grep -q "dpbalance_sglang: plugin" "$log"; then
    echo "gpu_sglang.sh: the plugin did not start in arm $arm; tail of $log:" >&2; tail -n 30 "$log" >&2; exit 1
  fi
}

stop() { kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""; }

run() {  # run ARM PORT PLUGIN: one arm's stream and its metrics
  local arm="$1" port="$2"
  start "$@"
  "$RUN_PY" -m sglang.benchmark.serving --backend sglang --port "$port" --dataset-name random \
      --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --random-range-ratio 0.5 \
      --num-prompts "$PROMPTS" --seed 32 --output-file "$WORK/bench_$arm.jsonl" \
      >"$WORK/bench_$arm.txt" 2>&1 || { tail -n 30 "$WORK/bench_$arm.txt" >&2; exit 1; }
  curl -sf "http://127.0.0.1:$port/metrics" >"$WORK/metrics_$arm.txt"
  stop
  echo "$arm" >> "$WORK/arms"
}

if [ "$SETUP" = mtp ]; then
  port=30111
  for s in $STEPS; do run "steps$s" "$port" none; port=$((port + 1)); done
  run mtp_dpb "$port" dpbalance
else
  if [ "$SPS" = profile ]; then  # SGLang's own SPS profiler against the shipped server
    start dspark_profile 30110 none
    "$RUN_PY" -m sglang.benchmark.dspark_sps_profiler all --base-url http://127.0.0.1:30110 \
        --out "$WORK/sps.json" >"$WORK/sps_profile.txt" 2>&1 || { tail -n 30 "$WORK/sps_profile.txt" >&2; exit 1; }
    stop
  else
    cp "$SPS" "$WORK/sps.json"
  fi
  run dspark_sps 30111 none
  run dspark_dpb 30112 dpbalance
fi

"$RUN_PY" - "$WORK" "$JSON" "$DP" "$SETUP" <<'EOF'
import json, re, sys
work, out, dp, setup = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
arms = [a.strip() for a in open(f"{work}/arms") if a.strip()]
def bench(arm):
    r = [json.loads(l) for l in open(f"{work}/bench_{arm}.jsonl") if l.strip()][-1]
    return {"output_tok_per_s": r["output_throughput"], "tpot_mean_ms": r["mean_tpot_ms"],
            "tpot_p99_ms": r.get("p99_tpot_ms"), "completed": r.get("completed")}
def sync_wait(arm):
    text = open(f"{work}/metrics_{arm}.txt").read()
    get = lambda n: sum(float(m) for m in re.findall(rf'^sglang:dp_attention_sync_wait_seconds_{n}\{{[^}}]*\}} (\S+)', text, re.M))
    cnt = get("count")
    return {"sync_wait_ms_per_step": 1e3 * get("sum") / cnt if cnt else None, "sync_steps": cnt}
res = {a: {**bench(a), **sync_wait(a)} for a in arms}
ours = arms[-1]
shipped = max(arms[:-1], key=lambda a: res[a]["output_tok_per_s"])
ratio = lambda k: (res[ours][k] / res[shipped][k]) if res[shipped].get(k) and res[ours].get(k) is not None else None
summary = {"setup": setup, "dp": dp, "arms": res, "baseline": shipped,
           "dpbalance_over_baseline": {k: ratio(k) for k in ("output_tok_per_s", "tpot_mean_ms", "tpot_p99_ms", "sync_wait_ms_per_step")}}
json.dump(summary, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
