#!/usr/bin/env bash
# scripts/dpbalance-report on real inputs: a replay's JSON (dpbalance-replay --json), the
# plugin's JSON-lines metrics (DPB_METRICS_FILE, from the plugin through the Python adapter),
# and bad input: a malformed JSON line (exit 3, the file and the line named; --skip-bad-lines
# reads past it), a missing input (3), an unwritable output (2). The live run's step-log page
# is made by the vllm_prometheus test.
#
#   dpbalance_report_test.sh REPLAY LIBDPBALANCE_SO WORKDIR
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
REPLAY=$1 PLUGIN=$2 W=$3
export DPBALANCE_REPORT_ROOT="$ROOT"
REPORT="$ROOT/scripts/dpbalance-report"
mkdir -p "$W" && rm -f "$W"/*.html "$W"/*.json "$W"/*.jsonl
pass=0 fail=0
ok() { echo "PASS $1"; pass=$((pass + 1)); }
no() { echo "FAIL $1"; fail=$((fail + 1)); }
page_ok() {  # FILE: one page, inline SVG, no external resource
  [ -s "$1" ] && grep -q "<svg" "$1" && ! grep -qE '<(img|script|link)[^>]+(src|href)="https?:' "$1"
}

"$REPLAY" --max_requests 300 --dp 8 --json "$W/replay.json" >/dev/null 2>&1 || no "the replay ran"
if "$REPORT" --replay "$W/replay.json" --out "$W/replay.html" && page_ok "$W/replay.html" \
   && grep -q "D z1.2" "$W/replay.html"; then ok "a replay's JSON: one self-contained page with its runs"
else no "a replay's JSON"; fi

# The plugin's metrics file: two ranks as threads through the Python adapter, in-process backend.
DPB_METRICS_FILE="$W/metrics.jsonl" DPB_LOG_LEVEL=warn python3 - "$PLUGIN" <<'PY' || no "the plugin ran"
import random, sys, threading
import os; sys.path.insert(0, os.path.join(os.environ["DPBALANCE_REPORT_ROOT"], "integration", "adapters", "python"))
import dpbalance_plugin as dpb
def rank(r):
    b = dpb.DpBalance(2, r, "backend=inproc;group=report;log_every=5;timeout_ms=20000", library=sys.argv[1])
    rng = random.Random(r)
    reqs = [dpb.Request(100 * r + i, (2000 if r == 0 else 30000) + 50 * i, k_cap=7) for i in range(8)]
    for step in range(60):
        lens, _ = b.plan(reqs)
        b.report(300.0 + 200 * r + rng.random() * 50, 3000.0, [dpb.Accepted(q.request_id, n, n * 3 // 4) for q, n in zip(reqs, lens)])
    b.close()
ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
PY
if [ "$(wc -l < "$W/metrics.jsonl")" -ge 8 ] && "$REPORT" --metrics "$W/metrics.jsonl" --out "$W/metrics.html" \
   && page_ok "$W/metrics.html"; then ok "the plugin's JSON-lines metrics: one page"
else no "the plugin's JSON-lines metrics"; fi

head -n 3 "$W/metrics.jsonl" > "$W/bad.jsonl"; echo '{"rank": 0, "step": 9, "bubble_fr' >> "$W/bad.jsonl"
tail -n 2 "$W/metrics.jsonl" >> "$W/bad.jsonl"
msg=$("$REPORT" --metrics "$W/bad.jsonl" --out "$W/bad.html" 2>&1 >/dev/null); rc=$?
if [ $rc -eq 3 ] && echo "$msg" | grep -qF "bad.jsonl:4: not a JSON object" && [ ! -e "$W/bad.html" ]; then
  ok "a malformed line: exit 3 naming the file and line ($msg)"
else no "a malformed line: exit $rc, '$msg'"; fi
if "$REPORT" --metrics "$W/bad.jsonl" --out "$W/bad.html" --skip-bad-lines >/dev/null 2>&1 \
   && grep -q "bad.jsonl:4" "$W/bad.html"; then ok "--skip-bad-lines reads past it and lists it"
else no "--skip-bad-lines"; fi
msg=$("$REPORT" --step-log "$W/nonexistent" --out "$W/x.html" 2>&1 >/dev/null); rc=$?
[ $rc -eq 3 ] && echo "$msg" | grep -qF "nonexistent" && ok "a missing step log: exit 3 ($msg)" || no "a missing step log: $rc '$msg'"
msg=$("$REPORT" --replay "$W/replay.json" --out /nonexistent/dir/x.html 2>&1 >/dev/null); rc=$?
[ $rc -eq 2 ] && echo "$msg" | grep -qF "/nonexistent/dir" && ok "an unwritable --out: exit 2" || no "an unwritable --out: $rc '$msg'"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
