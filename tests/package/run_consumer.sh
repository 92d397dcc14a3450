#!/usr/bin/env bash
# Installs this build to a temporary prefix, checks that exactly the public headers were
# installed, then configures, builds and runs a downstream project that uses
# find_package(dpbalance) and links dpbalance::dpbalance (consumer/: spdlog and Eigen poisoned).
set -euo pipefail
build_dir="$1"; src_dir="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
headers=$(cd "$work/prefix/include" && find . -name '*.h' | sort | tr '\n' ' ')
want="./dpbalance/acceptance.h ./dpbalance/allgather.h ./dpbalance/balancer.h ./dpbalance/cost_model.h \
./dpbalance/dspark.h ./dpbalance/inprocess_allgather.h ./dpbalance/kernel_grid.h ./dpbalance/lag.h ./dpbalance/metrics.h ./dpbalance/nccl_allgather.h \
./dpbalance/planner.h ./dpbalance/plugin/dpbalance_inspect_v1.h ./dpbalance/plugin/dpbalance_inspect_v2.h ./dpbalance/plugin/dpbalance_plugin.h ./dpbalance/plugin/dpbalance_plugin_v1.h ./dpbalance/plugin/dpbalance_plugin_v2.h \
./dpbalance/plugin/dpbalance_router_v1.h ./dpbalance/quiet.h ./dpbalance/routing.h ./dpbalance/summary.h ./dpbalance/tpot_slo.h "
if [ "$headers" != "$want" ]; then
  echo "installed headers differ from the public API:"; echo " got:  $headers"; echo " want: $want"
  echo "package consumer: 0 passed, 1 failed"; exit 1
fi
cmake -S "$src_dir" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log" \
  || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" > "$work/build.log" || { cat "$work/build.log"; exit 1; }
"$work/build/consumer"
echo "package consumer: 1 passed, 0 failed"
