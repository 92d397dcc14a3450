#!/usr/bin/env bash
# Installs this build to a temporary prefix, then configures, builds and runs a downstream
# project that uses find_package(dpbalance) and links dpbalance::dpbalance.
set -euo pipefail
build_dir="$1"; src_dir="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$src_dir" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log" \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/build/consumer"
echo "package consumer: 1 passed, 0 failed"
