"""Every hook dpbalance_sglang puts on SGLang, registered through SGLang's own HookRegistry
(sglang/srt/plugins/hook_registry.py: `HookRegistry.register(target, hook, hook_type)`, applied by
`load_plugins()`), one module per patched file (README.md beside this file lists each target, the
version it was read at and why no extension point does it).

Before registering, `register_all` checks the SGLang version against the supported range
(`SUPPORTED`: from the release the hooks were read at up to, not including, the next minor
release; `.post` and patch releases inside it are taken) and each target's parameters as read.
On any mismatch it logs one error line naming it and registers nothing: SGLang runs as shipped.
"""
from __future__ import annotations

import inspect
import logging
import pkgutil
from typing import Optional

from . import attention, dp_attn, dspark, eagle, schedule_batch, scheduler

log = logging.getLogger("sglang.srt.plugins.dpbalance")

MODULES = (dp_attn, scheduler, schedule_batch, dspark, eagle, attention)
# SGLang releases the hooks run on: [first, last) as release numbers. Read at 0.5.23 (README.md);
# a release inside the range must still match every hooked signature.
SUPPORTED = ((0, 5, 23), (0, 6))


def _release(version: str) -> Optional[tuple]:
    """The release numbers of a PEP 440 version ('0.5.23.post1' -> (0, 5, 23)); None when it is
    not one."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except (InvalidVersion, TypeError):
        return None


def check_upstream(version: Optional[str] = None) -> str:
    """'' when the installed SGLang (or `version`) is in the supported range with every target as
    read; else why not (one line)."""
    if version is None:
        try:
            import sglang

            version = getattr(sglang, "__version__", None)
        except ImportError as e:
            return f"SGLang cannot be imported ({e})"
    lo, hi = SUPPORTED
    rel = _release(version)
    span = f">= {'.'.join(map(str, lo))}, < {'.'.join(map(str, hi))}"
    if rel is None:
        return f"SGLang reports version {version!r}, not a release number (supported: {span})"
    if not lo <= rel < hi:
        return f"written for SGLang {span}, found SGLang {version}"
    for mod in MODULES:
        for target, params in mod.SIGNATURES.items():
            try:
                fn = pkgutil.resolve_name(target)
            except (ImportError, AttributeError, ValueError) as e:
                return f"hook target {target} cannot be resolved in SGLang {version} ({e})"
            fn = inspect.unwrap(fn)
            got = tuple(inspect.signature(fn).parameters)
            if got != params:
                return f"hook target {target} takes {got} in SGLang {version}, read as {params}"
    return ""


def register_all() -> bool:
    """Registers every hook (True), or none (False, one error line)."""
    why = check_upstream()
    if why:
        log.error("dpbalance_sglang: %s; dpbalance stays off and SGLang runs as shipped", why)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for mod in MODULES:
        for target, hook, kind in mod.HOOKS:
            HookRegistry.register(target, hook, HookType[kind])
    log.info("dpbalance_sglang: %d hooks registered on SGLang %s",
             sum(len(m.HOOKS) for m in MODULES), __import__("sglang").__version__)
    return True
