#!/usr/bin/env bash
# Regenerates every figure docs/results.md and docs/cost-model.md cite (about two hours, 2 cores).
# It runs the replay comparisons on both bundled traces and the H200 truth over three
# seeds at lag 1 and lag 0, the lag study, the step bound, the calibration figures, the reference
# engine and the planner benchmark. The plots need Debian's python3-matplotlib.
#   scripts/make_results.sh           everything
#   scripts/make_results.sh replay    the replay figures only (no calibration, engine or bench)
# The studies it runs are in scripts/studies/ (scripts/studies/README.md).
set -euo pipefail
case "${1:-}" in
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
  ""|all|replay) ;;
  *) echo "make_results.sh: unknown part '$1' (all or replay; see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
PART="${1:-all}"
scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
B=build/release
mkdir -p docs/generated
# Section 0's parity figures (the knowledge-parity rule): every row with production knowledge, three seeds, lag 1
# on the three truths and V2 with 10% log-normal noise; the H200 truth is half B's fit, our
# planner starts from half A's (scripts/studies/h200_split_fits.sh). Then the same seed-1 runs planned with the truth (what
# knowledge is worth) and the sensitivity to the FFN constants and the draft cost.
scripts/studies/h200_split_fits.sh $B
HALF=(--truth docs/generated/model_packed_half_b.json --truth_layers 61
      --planner_model online:docs/generated/model_packed_half_a.json)
for c in "mooncake" "azure --trace integration/replay/data/azure_conv_2023.csv" "h200truth ${HALF[*]}" \
         "mooncake_noise --noise 0.1"; do
  set -- $c
  n=$1
  shift
  python3 scripts/replay_seeds.py $B/integration/dpbalance-replay 3 /tmp/dpb-parity-$n \
    --json-out docs/generated/parity_$n.json --stale_steps 1 "$@" | tee docs/generated/parity_$n.txt
  [ $n = h200truth ] && cp /tmp/dpb-parity-$n/seed_1.json docs/generated/parity_${n}_seed1.json
  $B/integration/dpbalance-replay --stale_steps 1 "$@" --planner_model truth \
    > docs/generated/parity_${n}_truth.txt
done
python3 scripts/parity_table.py "Mooncake, V2=docs/generated/parity_mooncake.json" \
  "Azure, V2=docs/generated/parity_azure.json" \
  "Mooncake, H200 packed half B x 61=docs/generated/parity_h200truth.json" \
  "Mooncake, V2 with 10% noise=docs/generated/parity_mooncake_noise.json" | tee docs/generated/parity_table.md
for s in "ffn05 --ffn_fixed_ms 10 --ffn_per_token_ms 0.001" "ffn2 --ffn_fixed_ms 40 --ffn_per_token_ms 0.004" \
         "draft05 --draft_ms 0.75" "draft2 --draft_ms 3"; do
  set -- $s
  n=$1
  shift
  $B/integration/dpbalance-replay --stale_steps 1 "$@" \
    > docs/generated/parity_sens_$n.txt
done
# The draft-confidence signal: acceptance varying step to step (logit sd 0.7), and
# DSpark reading the draft's confidence at noise 5 (useless) .. 0 (perfect), or none (-1).
# Seed 1's full tables are kept; seeds 1-3 make the summary.
for c in -1 5 1 0.3 0; do
  $B/integration/dpbalance-replay --stale_steps 1 --step_acceptance_sigma 0.7 --confidence_sigma $c \
    --json /tmp/dpb-confidence-s1-$c.json > docs/generated/parity_confidence_$c.txt
  for s in 2 3; do
    $B/integration/dpbalance-replay --stale_steps 1 --step_acceptance_sigma 0.7 --confidence_sigma $c \
      --seed $s --json /tmp/dpb-confidence-s$s-$c.json > /dev/null
  done
done
python3 scripts/parity_table.py --confidence /tmp/dpb-confidence-s{1,2,3}-{-1,5,1,0.3,0}.json \
  | tee docs/generated/parity_confidence.md
# Everything below predates the knowledge-parity rule and plans with the truth's own model (--planner_model truth,
# the default then; oracle knowledge of the cost model): R adds it, a later --planner_model wins.
R="$(mktemp -d)/dpbalance-replay"
printf '#!/bin/sh\nexec %s --planner_model=truth "$@"\n' "$PWD/$B/integration/dpbalance-replay" > "$R"
chmod +x "$R"
H200=(--truth docs/generated/model_packed.json --truth_layers 61)
# The default comparison (lag 1), seed 1, as the tables show it; then seeds 1-3 at lag 1 and lag 0
# (scripts/replay_seeds.py: every row's mean and range, the ratios each against its baseline).
$R --json docs/generated/replay_mooncake.json | tee docs/generated/replay_mooncake.txt
$R --trace integration/replay/data/azure_conv_2023.csv \
  --json docs/generated/replay_azure.json | tee docs/generated/replay_azure.txt
for lag in 1 0; do
  for c in "mooncake" "azure --trace integration/replay/data/azure_conv_2023.csv" "h200truth ${H200[*]}"; do
    set -- $c
    n=$1
    shift
    python3 scripts/replay_seeds.py $R 3 /tmp/dpb-seeds-$n-$lag \
      --json-out docs/generated/seeds_${n}_lag$lag.json --stale_steps $lag "$@" \
      | tee docs/generated/seeds_${n}_lag$lag.txt
  done
done
# Mooncake V2 over seeds 1-10, without and with the deferral value: is the 1.05x target's gap
# larger than the seeds' spread (results.md section 8)?
for d in "" "--value_deferral=true"; do
  n=$([ -z "$d" ] && echo seeds_mooncake_lag1_s10 || echo seeds_mooncake_lag1_defer_s10)
  python3 scripts/replay_seeds.py $R 10 /tmp/dpb-$n --stale_steps 1 $d \
    | tee docs/generated/$n.txt
done
# The shift acceptance model (DPB_ACCEPTANCE=shift) on the three truths, seeds 1-3, lag 1: does a
# better acceptance estimate lift our planner or the baseline (results.md 8, the ceiling)?
for c in "mooncake" "azure --trace integration/replay/data/azure_conv_2023.csv" "h200truth ${H200[*]}"; do
  set -- $c
  n=$1
  shift
  python3 scripts/replay_seeds.py $R 3 /tmp/dpb-seeds-$n-shift \
    --stale_steps 1 --acceptance shift "$@" | tee docs/generated/seeds_${n}_lag1_shift.txt
done
# Every row with the oracle's knowledge of acceptance (--acceptance truth: ours and DSpark's rows
# read each request's true curve): the lead the planners make on equal knowledge (results.md 8,
# the ceiling). Mooncake over seeds 1-10 as above, the other truths over seeds 1-3.
for c in "mooncake_lag1_truthacc_s10 10" \
         "azure_lag1_truthacc 3 --trace integration/replay/data/azure_conv_2023.csv" \
         "h200truth_lag1_truthacc 3 ${H200[*]}"; do
  set -- $c
  n=$1 seeds=$2
  shift 2
  python3 scripts/replay_seeds.py $R $seeds /tmp/dpb-seeds-$n \
    --stale_steps 1 --acceptance truth "$@" | tee docs/generated/seeds_$n.txt
done
# What one step of lag costs the planner rows, split by what they predict (lag.h).
python3 scripts/studies/lag_study.py $R 3 | tee docs/generated/lag_study.txt
# The step bound on the V2 truth (Mooncake and Azure, DSpark's engine: tiers, block draft): each
# row's expected tokens per second against the bound on its own steps, seeds 1-3.
: > docs/generated/step_bound.txt
for t in integration/replay/data/mooncake_conversation.jsonl integration/replay/data/azure_conv_2023.csv; do
  for v in "off --k 2" "dspark" "dspark_fill" "goodput --k 2 --tpot_slo_ms=off" \
           "oracle --k 2 --tpot_slo_ms=off" "oracle --k 2 --tpot_slo_ms=off --step_slack=-1"; do
    for seed in 1 2 3; do
      echo "== $(basename $t) --verify $v --seed $seed" | tee -a docs/generated/step_bound.txt
      $R --trace $t --compare=false --routing D --padded=true --draft block \
        --step_bound=true --seed $seed --verify $v --json /tmp/dpb-bound.json > /dev/null
      python3 -c "import json; r = json.load(open('/tmp/dpb-bound.json'))['runs'][0]; print('goodput %.1f expected %.1f bound/expected %.4f tpot99 %.2f' % (r['goodput_tok_per_s'], r['expected_tok_per_s'], r['step_bound_over_expected'], r['tpot_p99_ms']))" \
        | tee -a docs/generated/step_bound.txt
    done
  done
done
$R --eval_cost v1 --compare=false --routing D --k 1 \
  --json docs/generated/replay_mooncake_eval_v1.json > /dev/null
if [ "$PART" = all ]; then
for v in gqa packed; do
  # With the measured kernel's simulated grid (kernel_grid.h), and without it for comparison.
  $B/integration/dpbalance-calibrate --train integration/calibrate/data/attention_fa2_$v.train.jsonl \
    --kernel fa2-$v-h200 --cv 5 --json docs/generated/calibrate_$v.json \
    --out docs/generated/model_$v.json | tee docs/generated/calibrate_$v.txt
  $B/integration/dpbalance-calibrate --train integration/calibrate/data/attention_fa2_$v.train.jsonl \
    --cv 5 --json docs/generated/calibrate_${v}_nogrid.json --out docs/generated/model_${v}_nogrid.json \
    | tee docs/generated/calibrate_${v}_nogrid.txt
  $B/integration/dpbalance-calibrate --train integration/calibrate/data/attention_fa2_$v.train.jsonl \
    --kernel fa2-$v-h200 --cv 5 --target step | tee docs/generated/calibrate_${v}_step.txt
done
# Where gqa's tail lies, its noise floor, a held-out sample's spread (docs/cost-model.md).
for p in 1 2; do
  $B/integration/dpbalance-calibrate --train integration/calibrate/data/attention_fa2_gqa.train.jsonl \
    --kernel fa2-gqa-h200 --cv 5 --loss_power $p --dump /tmp/dpb_gqa_dump_$p.txt > /dev/null
  n=$([ $p = 1 ] && echo gqa_tail || echo gqa_tail_loss2)
  python3 scripts/studies/gqa_tail.py integration/calibrate/data/attention_fa2_gqa.train.jsonl \
    /tmp/dpb_gqa_dump_$p.txt | tee docs/generated/$n.txt
done
# The gqa rows' noise floor, from the committed H200 re-timings (docs/generated/h200_gqa_remeasure*.jsonl).
scripts/studies/gqa_noise_report.sh docs/generated/h200_gqa_noise.txt
$B/integration/dpbalance-calibrate --gemm integration/calibrate/data/projection_gemm_sweep.jsonl \
  | tee docs/generated/calibrate_gemm.txt
fi
# Truth from the real H200 kernel: the packed-attention fit, 61 attention layers per step.
$R --truth docs/generated/model_packed.json --truth_layers 61 \
  --json docs/generated/replay_h200truth.json | tee docs/generated/replay_h200truth.txt
# The gqa (head-major) fit as the truth (results.md 3d; about 16 minutes).
$R --truth docs/generated/model_gqa.json --truth_layers 61 \
  --json docs/generated/replay_h200truth_gqa.json | tee docs/generated/replay_h200truth_gqa.txt
$R --truth docs/generated/model_packed.json --truth_layers 61 \
  --planner_model online --json docs/generated/replay_h200truth_online.json \
  | tee docs/generated/replay_h200truth_online.txt
$R --truth docs/generated/model_packed.json --truth_layers 61 \
  --planner_model v2 --json docs/generated/replay_h200truth_v2planner.json \
  | tee docs/generated/replay_h200truth_v2planner.txt
# Online planners that know the kernel: from the offline packed fit, and from V2 with the
# packed grid's makespans seeded (what an engine without a calibration run can set).
for start in docs/generated/model_packed.json v2+fa2-packed-h200; do
  n=$(echo $start | sed 's|docs/generated/model_packed.json|packedfit|; s|v2+fa2-packed-h200|v2grid|')
  $R --truth docs/generated/model_packed.json --truth_layers 61 \
    --compare=false --verify goodput --k 5 --tpot_slo_ms=off --planner_model online:$start \
    --json docs/generated/replay_h200truth_online_$n.json | tee docs/generated/replay_h200truth_online_$n.txt
done
# The same with the previous truth, the packed fit without the kernel grid (sums and maxima).
$R --truth docs/generated/model_packed_nogrid.json --truth_layers 61 \
  --json docs/generated/replay_h200truth_nogrid.json | tee docs/generated/replay_h200truth_nogrid.txt
if [ "$PART" = all ]; then
$B/tests/runtime/calibration_test --gtest_filter='Online*' | tee docs/generated/online_calibration.txt
$B/integration/dpbalance-reference-engine --json docs/generated/reference_engine.json \
  2>/dev/null | tee docs/generated/reference_engine.txt
# The same with every request routed centrally through the library's router ABI.
for routing in D E; do
  $B/integration/dpbalance-reference-engine --routing $routing \
    --json docs/generated/reference_engine_routing_$routing.json \
    2>/dev/null | tee docs/generated/reference_engine_routing_$routing.txt
done
# An idle rank (docs/results.md section 4): the last of 8 ranks idle in every other block of 10
# steps, its row in the engine's sync the idle row or zeros; the online refit off (it learns
# from wall-clock times).
for row in idle zeros; do
  DPB_ONLINE=0 $B/integration/dpbalance-reference-engine --idle_ranks 1 --idle_row $row \
    --json docs/generated/reference_engine_idle_$row.json 2>/dev/null \
    | tee docs/generated/reference_engine_idle_$row.txt
done
$B/bench/dpbalance_planner_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  | tee docs/generated/planner_bench.txt
fi
PY=python3
command -v /usr/bin/python3 >/dev/null && PY=/usr/bin/python3
$PY scripts/plot_results.py docs/generated/replay_mooncake.json docs/results_mooncake.png \
  "Mooncake conversation trace, DP64, closed loop 2048, truth V2"
$PY scripts/plot_results.py docs/generated/replay_azure.json docs/results_azure.png \
  "Azure conversation trace 2023, DP64, closed loop 2048, truth V2"
$PY scripts/plot_results.py docs/generated/replay_h200truth.json docs/results_h200truth.png \
  "Mooncake trace, DP64, truth = H200 packed-attention fit x 61 layers"
# Routing rows A, D z1.2 / z1.3 and E at k = 1 over twenty acceptance seeds (docs/results.md
# section 1): how far apart they are against the seed-to-seed spread, with paired differences.
# These two studies ran at lag 0, the replay's default before lag 1 (--stale_steps 0 gives
# the same outputs byte for byte, as checked on the default comparison's unpadded rows);
# results.md says so beside them.
$PY scripts/studies/routing_seeds.py $R 20 --stale_steps 0 | tee docs/generated/routing_seeds.txt
$PY scripts/studies/routing_seeds.py $R 20 --stale_steps 0 \
  --trace integration/replay/data/azure_conv_2023.csv | tee docs/generated/routing_seeds_azure.txt
# The planner's TPOT guard (step slack) against the goodput target, over five seeds.
$PY scripts/studies/guard_frontier.py $R 5 --stale_steps 0 | tee docs/generated/guard_frontier.txt
$PY scripts/studies/guard_frontier.py $R 5 --stale_steps 0 \
  --trace integration/replay/data/azure_conv_2023.csv | tee docs/generated/guard_frontier_azure.txt
# What the Python adapter adds to a step (docs/results.md section 5).
[ "$PART" = all ] && $PY bench/python_adapter_bench.py $B/plugin/libdpbalance.so | tee docs/generated/python_adapter_bench.txt
[ "$PART" = all ] && $PY bench/engine_plan_bench.py $B/plugin/libdpbalance.so 2>/dev/null \
  | grep -v '^dpbalance' | tee docs/generated/engine_plan_bench.txt
# A dense draft that each rank runs to its own depth (docs/results.md section 1).
$R --draft per_rank --json docs/generated/replay_mooncake_per_rank_draft.json \
  | tee docs/generated/replay_mooncake_per_rank_draft.txt
# One verify length per rank (--granularity rank; docs/results.md section 3c): goodput and
# oracle on the three truths, at each truth's best static k, with the default (auto) TPOT SLO.
: > docs/generated/granularity_rank.txt
for c in "mooncake 1" "azure 1 --trace integration/replay/data/azure_conv_2023.csv" \
         "h200truth 5 --truth docs/generated/model_packed.json --truth_layers 61"; do
  set -- $c
  n=$1 k=$2
  shift 2
  for v in goodput oracle; do
    echo "== $n --verify $v --k $k --granularity rank" | tee -a docs/generated/granularity_rank.txt
    $R "$@" --compare=false --verify $v --k $k --granularity rank \
      --json docs/generated/granularity_rank_${n}_$v.json | tee -a docs/generated/granularity_rank.txt
  done
done
# The per-request TPOT floor trade-off (docs/results.md section 2).
for t in integration/replay/data/mooncake_conversation.jsonl integration/replay/data/azure_conv_2023.csv; do
  n=$(basename $t | cut -d_ -f1)
  $R --trace $t --compare=false --routing D --k 1 \
    --json docs/generated/floor_${n}_static.json > /dev/null
  $R --trace $t --compare=false --routing D --k 1 --verify goodput \
    --floor_at_default=true --json docs/generated/floor_${n}_goodput.json > /dev/null
done
