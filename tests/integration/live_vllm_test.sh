#!/usr/bin/env bash
# The live vLLM test: `scripts/live_vllm.sh --quick` (one replicate of the mixed workload in a
# real vLLM 0.32.0 DP=2 instance on the CPUs: static k = 1, 3, 5, 7, the DSpark-like arm and
# dpbalance, each a fresh instance; then the replay's prediction; its first
# run installs vLLM into a cached venv), then checks of what it wrote. Functional checks only:
# every arm served every request with no hang and no desynchronised exchange over at least
# MIN_STEPS decode steps, the static arms ran vLLM as shipped at their length, the plugin was
# loaded through vLLM's entry point on every DP rank of the plugin arms and planned every step,
# every fallback is accounted for, the A/B's default epochs ran static_best's length (when the
# JSON has an A/B arm: the full run's, not --quick's), the mixed stream's per-request acceptance spreads, the summary and the prediction are there.
# Goodput, bubble, TPOT and attention share are reported, not asserted: they are wall-clock
# measurements on a shared 2-core machine (docs/live_vllm.md says what they were).
#
#   tests/integration/live_vllm_test.sh [OUT_JSON]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
JSON="${1:-$ROOT/build/out/live_vllm.json}"
MIN_STEPS="${LIVE_VLLM_MIN_STEPS:-150}"
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

t0=$(date +%s)
set +e
"$ROOT/scripts/live_vllm.sh" --quick --json "$JSON" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -eq 3 ]; then
  echo "live_vllm_test: the vLLM install failed (see above): 0 passed, 1 failed" >&2
  exit 1
fi
[ "$rc" -eq 0 ] || { echo "live_vllm_test: scripts/live_vllm.sh exited $rc"; echo "0 passed, 1 failed"; exit 1; }
echo "live_vllm_test: scripts/live_vllm.sh --quick took $(( $(date +%s) - t0 )) s"

VENV_PY="${DPBALANCE_VLLM_VENV:-$HOME/.cache/dpb-vllm/venv}/bin/python"
"$VENV_PY" - "$JSON" "$LOG" "$MIN_STEPS" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))
log = open(sys.argv[2]).read()
min_steps = int(sys.argv[3])
runs = {r["name"]: r for r in res["runs"]}
checks = []
def check(name, ok, detail):
    checks.append((name, bool(ok), detail))
check("vllm and torch versions recorded", res.get("vllm_version") and res.get("torch_version"),
      f'{res.get("vllm_version")} / {res.get("torch_version")}')
want = ["static_k1", "static_k3", "static_k5", "static_k7", "dspark", "dpbalance"]
if "ab" in runs:
    want.append("ab")
check("every arm ran", all(n in runs for n in want), ", ".join(sorted(runs)))
for name in want:
    r = runs.get(name)
    if r is None:
        continue
    check(f"{name}: dp=2, every request served", r["dp"] == 2 and r["requests_done"] == r["requests"],
          f'{r["requests_done"]} of {r["requests"]} requests')
    check(f"{name}: no hang, no desynchronised exchange", r["hangs"] == 0, f'hangs {r["hangs"]}')
    check(f"{name}: at least {min_steps} decode steps", r["steps"] >= min_steps,
          f'{r["steps"]} decode steps, {r["forwards"]} forwards, '
          f'{r["idle_rank_steps"]} idle-rank steps')
    check(f"{name}: attention and MoE hooks on every rank",
          all(h and h["attention"] > 0 and h["moe"] > 0 for h in r["hooks"]), str(r["hooks"]))
    check(f"{name}: the barrier wait timed at the MoE all-gather on every decode step",
          r["barrier_wait_timed_steps"] == r["steps"] and r["barrier_wait_ms"] is not None,
          f'{r["barrier_wait_timed_steps"]} of {r["steps"]} steps, {r["barrier_wait_ms"]} ms')
    check(f"{name}: attention share measured", r["attention_share"] is not None,
          f'{r["attention_share"]}')
for k in (1, 3, 5, 7):
    r = runs.get(f"static_k{k}")
    if r is None:
        continue
    check(f"static_k{k}: vLLM as shipped (no plugin), at most {k} drafts per request and step",
          r["plan_steps"] == 0 and r["env"].get("DPB_PLUGIN") == "none"
          and (r["drafts_per_request_step"] or 0) <= k + 1e-9,
          f'{r["plan_steps"]} exchanges, {r["drafts_per_request_step"]} drafts per request-step')
for name in ("dspark", "dpbalance", "ab"):
    r = runs.get(name)
    if r is None:
        continue
    check(f"{name}: the plugin planned every step on both ranks",
          r["plan_steps"] >= r["steps"], f'{r["plan_steps"]} plan calls (quiet ones included)')
    fb = r["fallback_results"]
    check(f"{name}: every fallback counted and named", sum(fb.values()) == r["fallbacks"],
          f'{r["fallbacks"]} {fb}')
    check(f"{name}: verify lengths changed from the default on some steps",
          (r["plans_changed"] or 0) > 0, f'{r["plans_changed"]}')
    fin = [f or {} for f in r["plugin_stats"]]
    check(f"{name}: the records rode vLLM's DP sync on both ranks (no collective of the "
          "package's own after init's handshake)",
          all(f.get("exchange") == "ride" and f.get("own_collectives") == 1
              and f.get("carried", 0) >= f.get("steps", 0) - 1 for f in fin) and len(fin) == 2,
          json.dumps([{q: f.get(q) for q in ("exchange", "own_collectives", "carried", "steps")}
                      for f in fin]))
mode = {n: runs[n]["env"].get("DPB_MODE") for n in ("dspark", "dpbalance", "ab") if n in runs}
check("the plugin arms ran their modes", mode.get("dspark") == "dspark_fill"
      and mode.get("dpbalance") == "goodput" and mode.get("ab", "goodput") == "goodput", str(mode))
summ = {s["workload"]: s for s in res["summary"]}
s = summ.get("mixed", {})
check("summary: static_best and the ratios", s.get("static_best_k") in (1, 3, 5, 7)
      and s.get("goodput_ratio") and s.get("goodput_ratio_vs_dspark")
      and s.get("bubble_reduction") is not None and s.get("tpot_p99_ratio"),
      json.dumps({k: s.get(k) for k in ("static_best_k", "goodput_ratio", "goodput_ratio_vs_dspark",
                                        "bubble_reduction", "tpot_p99_ratio")}))
check("dpbalance anchored at static_best's k", runs.get("dpbalance", {}).get("default_k") == s.get("static_best_k"),
      f'DPB_DEFAULT_K={runs.get("dpbalance", {}).get("default_k")}, static_best k={s.get("static_best_k")}')
check("the replay's prediction is there", s.get("predicted_goodput_ratio"),
      f'{s.get("predicted_goodput_ratio")}')
if "ab" in runs:
    ab = runs["ab"]["ab"]["paired"]
    check("ab: the step logs and the arms line up (no default-epoch step verified past static_best's k)",
          ab["pairs"] > 0 and ab["off_steps_above_default"] == 0,
          f'{ab["pairs"]} pairs, {ab["off_steps_above_default"]} default-epoch steps past it')
acc = res["acceptance"]["dp2"].get("mixed", {})
q = acc.get("conditional_rate_quantiles", {})
check("mixed: per-request acceptance spreads (10th percentile below 0.3, 90th above 0.8)",
      q.get("10") is not None and q["10"] < 0.3 and q["90"] > 0.8, json.dumps(q))
check("plugin loaded through vLLM's entry point",
      "dpbalance_vllm: plugin entry point loaded" in log, "log line present")
bad = 0
for name, ok, detail in checks:
    print(f'{"PASS" if ok else "FAIL"} {name}: {detail}')
    bad += not ok
for r in res["runs"]:
    print(f'FIGURE {r["name"]}: goodput {r["goodput_tok_per_s"]:.1f} tok/s, bubble '
          f'{r["bubble_fraction"]}, TPOT p99 {r["tpot_p99_ms"]} ms, attention share '
          f'{r["attention_share"]}')
print("FIGURE summary:", json.dumps({k: v for k, v in s.items() if k not in ("arms", "prediction")}))
print(f"{len(checks) - bad} passed, {bad} failed")
sys.exit(1 if bad else 0)
EOF
