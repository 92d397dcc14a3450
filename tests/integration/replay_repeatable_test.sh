#!/usr/bin/env bash
# The replay gives the same result in every process for one seed, with the shift acceptance
# model too: its learnt width sums over a hash map whose order changes from process to process
# (absl's per-process hash seed), and a last-bit difference there moved DSpark's top-k and the
# whole run (found in review: 51,650 / 51,959 / 51,702 tok/s for one seed). Six processes, each
# row's goodput must be identical. Usage: replay_repeatable_test.sh REPLAY_BINARY
set -euo pipefail
replay=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for i in 1 2 3 4 5 6; do
  "$replay" --compare=false --routing D --padded=true --draft block --verify dspark_fill \
    --acceptance shift --max_requests 4000 --stale_steps 1 --json "$dir/run$i.json" > /dev/null
done
python3 - "$dir" <<'PY'
import json, sys
runs = [json.load(open(f"{sys.argv[1]}/run{i}.json"))["runs"][0]["goodput_tok_per_s"] for i in range(1, 7)]
print("goodput per process:", runs)
sys.exit(0 if len(set(runs)) == 1 else 1)
PY
