#!/usr/bin/env bash
# Installs the Debian packages dpbalance builds with, only those that are missing.
set -euo pipefail
case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;; esac
pkgs=(cmake ninja-build g++ pkg-config libabsl-dev libspdlog-dev libgtest-dev libgmock-dev
      libbenchmark-dev nlohmann-json3-dev libeigen3-dev python3
      python3-torch  # the python_adapter test's torch.distributed (gloo) cases
      # scripts/fuzz.sh: clang 14 and its runtimes (libclang-rt-14-dev holds libFuzzer, ASan, UBSan)
      clang libclang-rt-14-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
