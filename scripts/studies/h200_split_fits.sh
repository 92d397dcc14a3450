#!/usr/bin/env bash
# The knowledge-parity rule on the H200 truth: the bundled packed-attention rows split in two
# (odd lines: half A, even lines: half B), each fitted alone by dpbalance-calibrate with the
# kernel grid (as docs/generated/model_packed.json is fitted on all of them). The replay's truth is
# B's fit (the hardware); our planner starts from A's fit (what a user calibrates on their own
# rows) and refits online: it never reads the truth.
#   scripts/studies/h200_split_fits.sh [BUILD_DIR]   writes docs/generated/model_packed_half_{a,b}.json
set -euo pipefail
cd "$(dirname "$0")/../.."
B="${1:-build/release}"
rows=integration/calibrate/data/attention_fa2_packed.train.jsonl
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
awk 'NR % 2 == 1' "$rows" > "$tmp/a.jsonl"
awk 'NR % 2 == 0' "$rows" > "$tmp/b.jsonl"
for h in a b; do
  other=$([ $h = a ] && echo b || echo a)
  "$B/integration/dpbalance-calibrate" --train "$tmp/$h.jsonl" --test "$tmp/$other.jsonl" \
    --kernel fa2-packed-h200 --cv 0 --out "docs/generated/model_packed_half_$h.json" \
    | tee "docs/generated/model_packed_half_$h.txt"
done
