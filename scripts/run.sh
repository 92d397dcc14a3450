#!/usr/bin/env bash
# The main job: installs what is missing, builds Release and runs the default replay comparison
# on the bundled Mooncake trace. Extra arguments go to dpbalance-replay (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake --preset release >/dev/null
cmake --build --preset release
exec build/release/integration/dpbalance-replay "$@"
