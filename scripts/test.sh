#!/usr/bin/env bash
# Installs what is missing, builds and runs the whole test suite with ctest.
#   scripts/test.sh          Release build (the README's test command)
#   scripts/test.sh asan     Debug + AddressSanitizer + UndefinedBehaviorSanitizer
set -euo pipefail
cd "$(dirname "$0")/.."
preset="${1:-release}"
scripts/install_deps.sh
# The pinned SGLang venv for the sglang_* tests (~/.cache/dpb-sglang; made once, a few minutes).
if [ "$preset" = release ]; then scripts/install_sglang.sh; fi
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
ctest --preset "$preset" -j2
