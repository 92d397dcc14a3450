#!/usr/bin/env bash
# docs/generated/h200_gqa_noise.txt: the gqa rows' noise floor and our model's out-of-fold error
# against the shared rows and against the mean of the fresh H200 passes (docs/cost-model.md, "The
# noise floor, measured"). Needs build/release (cmake --preset release && cmake --build --preset
# release). Usage: scripts/studies/gqa_noise_report.sh [OUT] (default docs/generated/h200_gqa_noise.txt)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-docs/generated/h200_gqa_noise.txt}"
CAL=build/release/integration/dpbalance-calibrate
ROWS=integration/calibrate/data/attention_fa2_gqa.train.jsonl
REM=docs/generated/h200_gqa_remeasure.jsonl
S2=docs/generated/h200_gqa_remeasure_session2.jsonl
[ -x "$CAL" ] || { echo "gqa_noise_report.sh: $CAL is not built (cmake --build --preset release)" >&2; exit 1; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
{
  echo "# $CAL --train $ROWS --kernel fa2-gqa-h200 --cv 5 --dump DUMP"
  "$CAL" --train "$ROWS" --kernel fa2-gqa-h200 --cv 5 --dump "$T/dump" | grep '^5-fold CV, ours'
  echo "# python3 scripts/studies/h200_noise.py $ROWS $REM DUMP --session2 $S2 --denoised DENOISED"
  python3 scripts/studies/h200_noise.py "$ROWS" "$REM" "$T/dump" --session2 "$S2" --denoised "$T/dn.jsonl" \
    | sed "s|$T/dn.jsonl|DENOISED|"
  echo
  echo "# $CAL --train DENOISED --kernel fa2-gqa-h200 --cv 5 --dump DUMP2   (fitted and judged on the denoised labels)"
  "$CAL" --train "$T/dn.jsonl" --kernel fa2-gqa-h200 --cv 5 --dump "$T/dump2" | grep '^5-fold CV, ours'
  echo "# python3 scripts/studies/h200_noise.py $ROWS $REM DUMP2 --session2 $S2   (its section 3: the CV on DENOISED, judged against the shared rows and the fresh mean)"
  python3 scripts/studies/h200_noise.py "$ROWS" "$REM" "$T/dump2" --session2 "$S2" \
    | sed -n '/^3\. /,$p' | sed 's/(5-fold CV on the shared rows)/(5-fold CV on DENOISED)/'
} > "$OUT"
echo "gqa_noise_report.sh: wrote $OUT"
