#!/usr/bin/env bash
# The GPU check: the NCCL backend test, the plugin over NCCL and the NCCL overhead bench.
# Run on the device machine from the repo root with .gpu/ carried
# (see scripts/prepare_gpu_carry.sh). Builds nothing: the binaries were built here (x86-64,
# the GPU machine's glibc is newer). NCCL comes from the PyTorch environment's wheel there.
set -uo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac
NCCL_LIB=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
export LD_LIBRARY_PATH=$PWD/.gpu/lib:$NCCL_LIB:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpu.txt"
ls "$NCCL_LIB" | tee -a "$OUT/gpu.txt"
# 1. NCCL backend end to end with one rank (the test skips only without a device).
.gpu/bin/allgather_test --gtest_filter='Nccl*' 2>&1 | tee "$OUT/allgather_test.txt"
# 2. The plugin through dlopen and the C ABI over NCCL: the engine's borrowed communicator and
#    stream, then one the plugin makes from a unique id.
TEST_DPBALANCE_PLUGIN=$PWD/.gpu/lib/libdpbalance.so .gpu/bin/plugin_nccl_test 2>&1 | tee "$OUT/plugin_nccl_test.txt"
# 3. Our per-step overhead vs a bare ncclAllGather of the same 512 bytes.
.gpu/bin/dpbalance-nccl-bench --iters 3000 2>&1 | tee "$OUT/nccl_bench.txt"
