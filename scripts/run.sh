#!/usr/bin/env bash
# Runs the default replay comparison on the bundled Mooncake trace (the README's first command).
# Installs the missing Debian packages (scripts/install_deps.sh), builds Release, then runs
# build/release/integration/dpbalance-replay, passing it any extra arguments (its flags:
# build/release/integration/dpbalance-replay --help once built). Prints the comparison: one row
# per routing and verify-length strategy, then each ratio against the baseline it names.
#   scripts/run.sh [dpbalance-replay flags...]
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
exec build/release/integration/dpbalance-replay "$@"
