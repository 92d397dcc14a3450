#!/usr/bin/env bash
# Builds Release and fills .gpu/ (git-ignored) with what scripts/gpu_check.sh needs on a GPU machine.
# .gpu/ holds the Release build's GPU-relevant binaries and the shared libraries they need that the GPU machine lacks (Abseil, spdlog, fmt, GoogleTest).
# Then, with the device tool: run `bash scripts/gpu_check.sh`, carry [".gpu"], timeout ~300 s.
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp build/release/tests/collectives/allgather_test build/release/bench/dpbalance-nccl-bench \
   build/release/tests/plugin/plugin_abi_test build/release/tests/plugin/plugin_nccl_test .gpu/bin/
cp build/release/plugin/libdpbalance.so .gpu/lib/
for b in .gpu/bin/* .gpu/lib/libdpbalance.so; do
  ldd "$b" | awk '/=> \// {print $3}' | grep -E 'libabsl|libspdlog|libfmt|libgtest|libgmock' || true
done | sort -u | xargs -r -I{} cp -L {} .gpu/lib/
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu
