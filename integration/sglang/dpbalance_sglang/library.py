"""Which libdpbalance.so DPB_PLUGIN names: `dpbalance` is the copy bundled with this package.

`pip install integration/sglang` builds the plugin with the project's CMake and installs it next
to this file (CMakeLists.txt, pyproject.toml), as the vLLM package does (dpbalance_vllm/
engine_plan.py, library_path). Any other value of DPB_PLUGIN (a path, a name on the loader's path,
`none`, unset) goes to the adapter unchanged. Imports nothing but the standard library.
"""
from __future__ import annotations

import os
from typing import Optional

BUNDLED_NAME = "dpbalance"          # DPB_PLUGIN=dpbalance: the bundled copy
LIBRARY_FILE = "libdpbalance.so"    # what CMake installs into the package folder
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def bundled_library() -> Optional[str]:
    """The absolute path of the libdpbalance.so bundled with this package, or None when the
    package folder holds none (a source tree, or an install that did not build it)."""
    path = os.path.join(PACKAGE_DIR, LIBRARY_FILE)
    return path if os.path.isfile(path) else None


def resolve(value: Optional[str]) -> Optional[str]:
    """DPB_PLUGIN's value as the adapter should load it: `dpbalance` becomes the bundled library's
    absolute path; anything else (a path, another name, `none`, "" or None) is returned unchanged.

    Raises FileNotFoundError (an OSError) when `dpbalance` is asked for and the package folder
    holds no libdpbalance.so."""
    if value != BUNDLED_NAME:
        return value
    path = bundled_library()
    if path is None:
        raise FileNotFoundError(
            f"dpbalance_sglang: DPB_PLUGIN={value!r} names the libdpbalance.so bundled with this "
            f"package, but {PACKAGE_DIR} holds no {LIBRARY_FILE} (install the package with "
            f"`pip install integration/sglang` from a dpbalance checkout, which builds it, or set "
            f"DPB_PLUGIN to the library's path)")
    return path
