#!/usr/bin/env bash
# The sglang ctests' environment (the fixture test sglang_package_install): a fresh venv beside
# the pinned SGLang, with `pip install integration/sglang` in it.
#
#   sglang_env.sh VENV
#
# The pinned SGLang venv comes from scripts/install_sglang.sh (made when missing, cached in
# ~/.cache/dpb-sglang). VENV is made anew, without packages of its own: a .pth file puts the
# pinned venv's site-packages after its own, so SGLang, torch and pip come from there and only
# dpbalance_sglang is installed into VENV (from a copy of integration/sglang, so that the build
# leaves nothing in the source tree; the copy resolves the adapter's link). Then checks that the
# entry points are registered and that `import sglang, dpbalance_sglang` works.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:?usage: sglang_env.sh VENV}"
BASE_PY="$("$ROOT/scripts/install_sglang.sh" --print-python)"
SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "$VENV"
"$BASE_PY" -m venv --without-pip "$VENV"
OWN="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$SITE" > "$OWN/dpb_pinned_sglang.pth"
SRC="$VENV/src/sglang"
mkdir -p "$SRC"
cp -rL "$ROOT/integration/sglang/." "$SRC/"
"$VENV/bin/python" -m pip install --no-deps --no-build-isolation --no-input --quiet "$SRC"
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import sglang, dpbalance_sglang  # noqa: F401  (the issue's check: both import on this machine)
eps = {g: {e.name: e.value for e in m.entry_points(group=g)}
       for g in ("sglang.srt.plugins", "sglang.srt.platforms")}
assert eps["sglang.srt.plugins"].get("dpbalance") == "dpbalance_sglang:register", eps
assert eps["sglang.srt.platforms"].get("dpbalance") == \
    "dpbalance_sglang:activate_cpu_platform", eps
dist = m.distribution("dpbalance-sglang")
assert dist.locate_file("dpbalance_sglang/dpbalance_plugin.py").exists(), "adapter missing"
print(f"sglang {sglang.__version__}, dpbalance-sglang {dist.version}: entry points {eps}")
print("1 passed, 0 failed")
EOF
