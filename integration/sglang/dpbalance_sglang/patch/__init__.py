"""Every hook dpbalance_sglang puts on SGLang, registered through SGLang's own HookRegistry
(sglang/srt/plugins/hook_registry.py: `HookRegistry.register(target, hook, hook_type)`, applied by
`load_plugins()`), one module per patched file (README.md beside this file lists each target, the
version it was read at and why no extension point does it).

Before registering, `register_all` checks the SGLang version (dpbalance_sglang.PINNED_SGLANG) and
each target's parameters as read at that version. On any mismatch it logs one error line naming
it and registers nothing: SGLang runs as shipped.
"""
from __future__ import annotations

import inspect
import logging
import pkgutil

from . import dp_attn, dspark, scheduler

log = logging.getLogger("sglang.srt.plugins.dpbalance")

MODULES = (dp_attn, dspark, scheduler)


def check_upstream() -> str:
    """'' when the installed SGLang is the pinned release with every target as read; else why
    not (one line)."""
    from .. import PINNED_SGLANG

    try:
        import sglang

        version = getattr(sglang, "__version__", None)
    except ImportError as e:
        return f"SGLang cannot be imported ({e})"
    if version != PINNED_SGLANG:
        return f"written against SGLang {PINNED_SGLANG}, found SGLang {version}"
    for mod in MODULES:
        for target, params in mod.SIGNATURES.items():
            try:
                fn = pkgutil.resolve_name(target)
            except (ImportError, AttributeError, ValueError) as e:
                return f"hook target {target} cannot be resolved ({e})"
            got = tuple(inspect.signature(fn).parameters)
            if got != params:
                return f"hook target {target} takes {got}, read as {params}"
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
