#!/usr/bin/env bash
# The sglang ctests' environment (the fixture test sglang_package_install): a fresh venv beside
# the pinned SGLang, with `pip install integration/sglang` in it.
#
#   sglang_env.sh VENV
#
# The pinned SGLang venv comes from scripts/install_sglang.sh (made when missing, cached in
# ~/.cache/dpb-sglang). VENV is made anew, without packages of its own: a .pth file puts the
# pinned venv's site-packages after its own, so SGLang, torch, pip and the build backend
# (scikit-build-core) come from there and only dpbalance_sglang is installed into VENV, with
# --no-build-isolation: scikit-build-core builds libdpbalance.so with the project's CMake (the
# system's cmake and ninja) and bundles it with the Python adapter. The CMake build folder is
# VENV.build, beside VENV and kept when VENV is remade, so that a second run is incremental; the
# build leaves nothing in the source tree. Then checks that the entry points are registered, that
# `import sglang, dpbalance_sglang` works, and that DPB_PLUGIN=dpbalance resolves to the bundled
# library (dpbalance_sglang.library.resolve), which loads and exports the v2 symbol.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:?usage: sglang_env.sh VENV}"
BASE_PY="$("$ROOT/scripts/install_sglang.sh" --print-python)"
SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$VENV"
"$BASE_PY" -m venv --without-pip "$VENV"
OWN="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$SITE" > "$OWN/dpb_pinned_sglang.pth"
PKG="$ROOT/integration/sglang"
BUILD="$(cd "$VENV" && pwd).build"   # absolute: pip resolves a relative one in the source folder
# A build folder configured from another checkout is of no use (CMake refuses it): start anew.
if [ -f "$BUILD/CMakeCache.txt" ] && \
   ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$PKG" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD"
fi
"$VENV/bin/python" -m pip install --no-deps --no-build-isolation --no-input --quiet \
  --config-settings=build-dir="$BUILD" "$PKG"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import sglang, dpbalance_sglang  # noqa: F401  (the issue's check: both import on this machine)
eps = {g: {e.name: e.value for e in m.entry_points(group=g)}
       for g in ("sglang.srt.plugins", "sglang.srt.platforms")}
assert eps["sglang.srt.plugins"].get("dpbalance") == "dpbalance_sglang:register", eps
assert eps["sglang.srt.platforms"].get("dpbalance") == \
    "dpbalance_sglang:activate_cpu_platform", eps
dist = m.distribution("dpbalance-sglang")
files = [str(f) for f in dist.files]
for name in ("dpbalance_sglang/dpbalance_plugin.py", "dpbalance_sglang/libdpbalance.so",
             "dpbalance_sglang/patch/README.md"):
    assert files.count(name) == 1, f"{name}: {files.count(name)} times in the package"
    assert dist.locate_file(name).exists(), f"{name} missing"
import ctypes, os
from dpbalance_sglang import dpbalance_plugin as adapter, library
lib = library.resolve("dpbalance")
assert lib == library.bundled_library() and os.path.isabs(lib) and os.path.isfile(lib), lib
assert os.path.samefile(lib, dist.locate_file("dpbalance_sglang/libdpbalance.so")), lib
getattr(ctypes.CDLL(lib, mode=ctypes.RTLD_LOCAL), adapter.SYMBOL_V2)
assert library.resolve("/x/libdpbalance.so") == "/x/libdpbalance.so"
assert library.resolve("none") == "none"
print(f"sglang {sglang.__version__}, dpbalance-sglang {dist.version}: entry points {eps}; "
      f"DPB_PLUGIN=dpbalance -> {lib}")
print("1 passed, 0 failed")
EOF
