#!/usr/bin/env bash
# Creates the pinned SGLang environment for dpbalance_sglang's contract tests when it is missing
# (scripts/test.sh calls it; docs/engines.md "SGLang"): a virtual environment outside the work
# tree, $DPBALANCE_SGLANG_VENV (default ~/.cache/dpb-sglang/venv), holding the exact versions of
# integration/sglang/requirements-cpu.txt (PyPI only: sglang 0.5.23 without its GPU-only
# dependencies, torch 2.14.1 as sglang pins it, and the pure-Python packages its DP sync, DSpark
# planner and plugin modules import). Made once, remade when the pins change; a half-made one is
# removed first. Concurrent callers wait on a lock. About 6 GB (torch's CUDA libraries).
#
#   scripts/install_sglang.sh [--print-python]
#
# Exit status: 0 ready (--print-python prints its interpreter), 3 the install failed (the
# reason on stderr, the log in the cache folder).
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${DPBALANCE_SGLANG_CACHE:-$HOME/.cache/dpb-sglang}"
VENV="${DPBALANCE_SGLANG_VENV:-$CACHE/venv}"
REQ="$ROOT/integration/sglang/requirements-cpu.txt"
PY="$VENV/bin/python"
case "$VENV" in "$ROOT"/*) echo "install_sglang.sh: DPBALANCE_SGLANG_VENV must be outside the work tree" >&2; exit 3 ;; esac

failed() {
  echo "install_sglang.sh: INSTALL FAILED: $1" >&2
  echo "install_sglang.sh: (log: $CACHE/install.log; the venv is $VENV)" >&2
  exit 3
}

STAMP="$VENV/.dpb-pins-$(sha256sum "$REQ" | cut -c1-16)"
mkdir -p "$CACHE"
exec 9>"$CACHE/.install.lock"
flock 9
if [ ! -e "$STAMP" ]; then
  t0=$(date +%s)
  echo "install_sglang.sh: installing SGLang 0.5.23 and its pinned CPU requirements into $VENV (first run: a few minutes, ~6 GB)" >&2
  BASE_PY="${DPBALANCE_SGLANG_BASE_PYTHON:-}"
  if [ -z "$BASE_PY" ]; then
    # sglang 0.5.23's wheel is built for CPython 3.11 (cp311).
    for c in python3.11 python3; do
      if command -v "$c" >/dev/null && "$c" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
        BASE_PY="$(command -v "$c")"; break
      fi
    done
  fi
  [ -n "$BASE_PY" ] || failed "no CPython 3.11 with venv and ensurepip found (sglang 0.5.23's wheel is cp311); set DPBALANCE_SGLANG_BASE_PYTHON"
  rm -rf "$VENV"
  "$BASE_PY" -m venv "$VENV" >"$CACHE/install.log" 2>&1 || failed "python -m venv $VENV ($BASE_PY)"
  "$PY" -m pip install --no-deps --no-input -r "$REQ" >>"$CACHE/install.log" 2>&1 \
    || failed "pip install --no-deps -r $REQ (tail of the log: $(tail -n 3 "$CACHE/install.log" | tr '\n' ' '))"
  "$PY" -c 'import torch, sglang, sglang.srt.managers.scheduler_components.dp_attn, sglang.srt.speculative.dspark_components.dspark_planner, sglang.srt.plugins; assert sglang.__version__ == "0.5.23", sglang.__version__' >>"$CACHE/install.log" 2>&1 \
    || failed "import torch, sglang and its DP-sync modules in $VENV ($(tail -n 1 "$CACHE/install.log"))"
  touch "$STAMP"
  echo "install_sglang.sh: done in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))" >&2
fi
if [ "${1:-}" = "--print-python" ]; then
  echo "$PY"
fi
