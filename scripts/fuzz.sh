#!/usr/bin/env bash
# Fuzzes every libFuzzer target for SECONDS each (default 20); fails on any finding.
# It builds the libFuzzer targets (the `fuzz` preset: clang, -fsanitize=fuzzer,address,undefined)
# and runs every target for SECONDS on a copy of its seed corpus (tests/fuzz/corpus/<target>/),
# (with tests/fuzz/dict/<target>.dict where there is one), in a temporary directory, so the
# repository is never modified. Fails if any target finds a
# crash, hang (> 10 s per input), leak, out-of-memory or sanitizer report; the failing target's
# log and reproducer stay in the printed directory.
#   scripts/fuzz.sh [SECONDS]   seconds per target (default 20)
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
seconds="${1:-20}"
[[ "$seconds" =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [SECONDS]" >&2; exit 2; }
root="$PWD"
scripts/install_deps.sh
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz

work="$(mktemp -d "${TMPDIR:-/tmp}/dpb_fuzz.XXXXXX")"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=()
for dir in tests/fuzz/corpus/*/; do
  target="$(basename "$dir")"
  mkdir -p "$work/$target/corpus" "$work/$target/artifacts"
  cp "$dir"* "$work/$target/corpus/"
  dict=()
  [ -f "tests/fuzz/dict/$target.dict" ] && dict=(-dict="$root/tests/fuzz/dict/$target.dict")
  # The target's working and temporary directory is its own folder: nothing it writes or reads
  # by a relative name touches the repository, and its scratch files (which libFuzzer's exit
  # may leave behind) go with the folder.
  if (cd "$work/$target" && TMPDIR="$work/$target" \
      "$root/build/fuzz/tests/fuzz/$target" -max_total_time="$seconds" -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$work/$target/artifacts/" \
        ${dict[@]+"${dict[@]}"} corpus >log 2>&1); then
    echo "fuzz: $target ok: $(grep -E '^#[0-9]+.*DONE' "$work/$target/log" | tail -1)"
  else
    echo "fuzz: $target FAILED; log and reproducer in $work/$target" >&2
    grep -E 'ERROR|SUMMARY|runtime error' "$work/$target/log" | head -5 >&2 || true
    failed+=("$target")
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: ${#failed[@]} target(s) failed: ${failed[*]}" >&2
  exit 1
fi
rm -rf "$work"
