#!/usr/bin/env bash
# dpbalance inside a real SGLang instance on GPUs (for the day a GPU machine is lent; it has never
# run: none was lent to the session that wrote it). One call: SGLang 0.5.23 with DP attention
# (dp = tp = --dp, one GPU per rank), DSpark in compact ragged verify, the same request stream
# twice: the plugin off (DPB_PLUGIN=none: SGLang's own lengths) and on. Per run it records
#   bubble:  SGLang's own sglang:dp_attention_sync_wait_seconds (each rank's wait in the MLP sync
#            for the slowest rank; SGLANG_ENABLE_METRICS_DP_ATTENTION=1), mean per step;
#   goodput: output tokens/s and TPOT (mean, p99) from sglang.benchmark.serving;
# and writes them with the on/off ratios to --json.
#
#   scripts/gpu_sglang.sh --python PY --model DIR --draft DIR [--dp N] [--prompts N]
#                         [--input-len N] [--output-len N] [--json FILE] [--lib SO]
#
# Nothing is downloaded (the GPU machine reaches no network): PY is a Python with SGLang 0.5.23
# and its GPU dependencies installed (`pip install sglang==0.5.23`, not the CPU pins of
# integration/sglang/requirements-cpu.txt), DIR the target model and a DSpark draft with its
# confidence head, both on local disk. --lib is the plugin (default .gpu/lib/libdpbalance.so from
# scripts/prepare_gpu_carry.sh, else build/release/plugin/libdpbalance.so). The package goes into
# a venv layered on PY (as tests/integration/sglang_env.sh does), so PY is left as it is.
# Exit status: 0 done, 1 a run failed, 2 a bad flag or a missing input.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="" MODEL="" DRAFT="" DP=2 PROMPTS=256 IN_LEN=1024 OUT_LEN=256 JSON="$ROOT/out/gpu_sglang.json" LIB=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="${2:?}"; shift 2 ;;
    --model) MODEL="${2:?}"; shift 2 ;;
    --draft) DRAFT="${2:?}"; shift 2 ;;
    --dp) DP="${2:?}"; shift 2 ;;
    --prompts) PROMPTS="${2:?}"; shift 2 ;;
    --input-len) IN_LEN="${2:?}"; shift 2 ;;
    --output-len) OUT_LEN="${2:?}"; shift 2 ;;
    --json) JSON="${2:?}"; shift 2 ;;
    --lib) LIB="${2:?}"; shift 2 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "gpu_sglang.sh: unknown flag '$1' (see --help)" >&2; exit 2 ;;
  esac
done
bad() { echo "gpu_sglang.sh: $1" >&2; exit 2; }
[ -n "$PY" ] && [ -x "$PY" ] || bad "--python '$PY' is not an executable Python with SGLang 0.5.23"
[ -d "$MODEL" ] || bad "--model '$MODEL' is not a directory"
[ -d "$DRAFT" ] || bad "--draft '$DRAFT' is not a directory"
[[ "$DP" =~ ^[1-9][0-9]*$ ]] || bad "--dp '$DP' is not a positive integer"
for v in PROMPTS IN_LEN OUT_LEN; do [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || bad "--${v,,} '${!v}' is not a positive integer"; done
if [ -z "$LIB" ]; then
  for c in "$ROOT/.gpu/lib/libdpbalance.so" "$ROOT/build/release/plugin/libdpbalance.so"; do
    [ -f "$c" ] && { LIB="$c"; break; }
  done
fi
[ -f "$LIB" ] || bad "no plugin library (--lib, or run scripts/prepare_gpu_carry.sh)"
"$PY" -c 'import sglang, sys; sys.exit(sglang.__version__ != "0.5.23")' \
  || bad "'$PY' has no SGLang 0.5.23 (dpbalance_sglang's hooks were read at 0.5.23)"
command -v nvidia-smi >/dev/null && [ "$(nvidia-smi -L | wc -l)" -ge "$DP" ] \
  || bad "fewer than --dp $DP GPUs"
mkdir -p "$(dirname "$JSON")"
[ -d "$ROOT/.gpu/lib" ] && export LD_LIBRARY_PATH="$ROOT/.gpu/lib:${LD_LIBRARY_PATH:-}"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/dpb-gpu-sglang.XXXXXX")"
SERVER_PID=""
cleanup() { [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$WORK/venv"; }
trap cleanup EXIT
# dpbalance_sglang in a venv layered on PY (its entry points are how load_plugins finds it).
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -m venv --without-pip "$WORK/venv"
OWN="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$SITE" > "$OWN/dpb_sglang_base.pth"
cp -rL "$ROOT/integration/sglang" "$WORK/pkg"
"$WORK/venv/bin/python" -m pip install --no-deps --no-build-isolation --no-input --quiet "$WORK/pkg"
RUN_PY="$WORK/venv/bin/python"

run() {  # run MODE(off|on) PORT
  local mode="$1" port="$2" log="$WORK/server_$1.log"
  local plugin=none; [ "$mode" = on ] && plugin="$LIB"
  env DPB_PLUGIN="$plugin" SGLANG_PLUGINS=dpbalance SGLANG_RAGGED_VERIFY_MODE=compact \
      SGLANG_ENABLE_METRICS_DP_ATTENTION=1 DPB_LOG_EVERY=1000 DPB_TIMEOUT_MS=1000 \
      "$RUN_PY" -m sglang.launch_server --model-path "$MODEL" --tp-size "$DP" --dp-size "$DP" \
      --enable-dp-attention --speculative-algorithm DSPARK --speculative-draft-model-path "$DRAFT" \
      --enable-metrics --port "$port" >"$log" 2>&1 &
  SERVER_PID=$!
  local t=0
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    sleep 5; t=$((t + 5))
    if ! kill -0 "$SERVER_PID" 2>/dev/null || [ $t -gt 900 ]; then
      echo "gpu_sglang.sh: the $mode server did not come up; tail of $log:" >&2; tail -n 30 "$log" >&2; exit 1
    fi
  done
  if [ "$mode" = on ] && ! grep -q "dpbalance_sglang: plugin" "$log"; then
    echo "gpu_sglang.sh: the plugin did not start in the on run; tail of $log:" >&2; tail -n 30 "$log" >&2; exit 1
  fi
  "$RUN_PY" -m sglang.benchmark.serving --backend sglang --port "$port" --dataset-name random \
      --random-input-len "$IN_LEN" --random-output-len "$OUT_LEN" --random-range-ratio 0.5 \
      --num-prompts "$PROMPTS" --seed 32 --output-file "$WORK/bench_$mode.jsonl" \
      >"$WORK/bench_$mode.txt" 2>&1 || { tail -n 30 "$WORK/bench_$mode.txt" >&2; exit 1; }
  curl -sf "http://127.0.0.1:$port/metrics" >"$WORK/metrics_$mode.txt"
  kill "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=""
}
run off 30111
run on 30112

"$RUN_PY" - "$WORK" "$JSON" "$DP" <<'EOF'
import json, re, sys
work, out, dp = sys.argv[1], sys.argv[2], int(sys.argv[3])
def bench(mode):
    rows = [json.loads(l) for l in open(f"{work}/bench_{mode}.jsonl") if l.strip()]
    r = rows[-1]
    return {"output_tok_per_s": r["output_throughput"], "tpot_mean_ms": r["mean_tpot_ms"],
            "tpot_p99_ms": r.get("p99_tpot_ms"), "completed": r.get("completed")}
def sync_wait(mode):
    text = open(f"{work}/metrics_{mode}.txt").read()
    tot = sum(float(m) for m in re.findall(r'^sglang:dp_attention_sync_wait_seconds_sum\{[^}]*\} (\S+)', text, re.M))
    cnt = sum(float(m) for m in re.findall(r'^sglang:dp_attention_sync_wait_seconds_count\{[^}]*\} (\S+)', text, re.M))
    return {"sync_wait_ms_per_step": 1e3 * tot / cnt if cnt else None, "sync_steps": cnt}
res = {m: {**bench(m), **sync_wait(m)} for m in ("off", "on")}
ratio = lambda k: (res["on"][k] / res["off"][k]) if res["off"].get(k) and res["on"].get(k) is not None else None
res["on_over_off"] = {k: ratio(k) for k in ("output_tok_per_s", "tpot_mean_ms", "tpot_p99_ms", "sync_wait_ms_per_step")}
res["dp"] = dp
json.dump(res, open(out, "w"), indent=1)
print(json.dumps(res, indent=1))
EOF
