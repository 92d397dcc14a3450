#!/usr/bin/env python3
"""dpbalance_sglang's version range and hooked-signature checks (patch/__init__.py), against the
installed SGLang's own functions: every refusal is one line naming what differs, and with it no
hook is registered, so SGLang runs as shipped. Each case below is a refusal a user can meet (or an
acceptance that an exact-string check used to refuse: a patch or .post release).

Run with the Python of the sglang ctest venv (sglang_env.sh). A missing SGLang is a failure.
"""
import logging
import sys

from script_checks import Checks


def main():
    try:
        import sglang  # noqa: F401
        from dpbalance_sglang import patch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError as e:
        sys.exit(f"FAIL: {e} in {sys.executable}; not skipping")
    checks = Checks()

    installed = sglang.__version__
    checks.check(f"SGLang {installed} as installed: accepted", patch.check_upstream() == "")
    for version in ("0.5.23", "0.5.24", "0.5.23.post1", "0.5.30"):
        checks.check(f"SGLang {version}: accepted", patch.check_upstream(version) == "")
    refusals = {
        "0.5.22": "written for SGLang >= 0.5.23, < 0.6, found SGLang 0.5.22",
        "0.6.0": "written for SGLang >= 0.5.23, < 0.6, found SGLang 0.6.0",
        "0.6.0rc1": "written for SGLang >= 0.5.23, < 0.6, found SGLang 0.6.0rc1",
        "1.0.0": "written for SGLang >= 0.5.23, < 0.6, found SGLang 1.0.0",
        "main": "SGLang reports version 'main', not a release number",
    }
    for version, want in refusals.items():
        got = patch.check_upstream(version)
        checks.check(f"SGLang {version}: refused with {got!r}", got.startswith(want))
    # A hooked function whose parameters changed (as a later release could): named, refused.
    original = Scheduler.process_batch_result

    def changed(self, batch, result, extra):  # noqa: ARG001 - the changed shape is the point
        return None

    Scheduler.process_batch_result = changed
    try:
        got = patch.check_upstream()
    finally:
        Scheduler.process_batch_result = original
    want = ("hook target sglang.srt.managers.scheduler.Scheduler.process_batch_result takes "
            "('self', 'batch', 'result', 'extra')")
    checks.check(f"a changed signature: refused with {got!r}", got.startswith(want))
    # A hooked function that is gone: named, refused.
    from sglang.srt.speculative import adaptive_spec_params as asp

    saved = asp.adaptive_unsupported_reason
    del asp.adaptive_unsupported_reason
    try:
        got = patch.check_upstream()
    finally:
        asp.adaptive_unsupported_reason = saved
    checks.check(f"a missing target: refused with {got!r}", got.startswith("hook target sglang.srt.speculative.adaptive_spec_params."
                         "adaptive_unsupported_reason cannot be resolved"))
    # register_all on a refused version: one error line, nothing registered.
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("sglang.srt.plugins.dpbalance").addHandler(handler)
    sglang.__version__ = "0.5.22"
    try:
        ok = patch.register_all()
    finally:
        sglang.__version__ = installed
    dpb_hooks = [t for t in HookRegistry._hooks if t.startswith("sglang.") and any(
        getattr(h, "__module__", "").startswith("dpbalance_sglang") for _, h, _ in
        HookRegistry._hooks[t])]
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    checks.check(f"register_all on 0.5.22: {len(dpb_hooks)} hooks registered", not ok and not dpb_hooks)
    checks.check(f"register_all on 0.5.22: one error line: {errors}", len(errors) == 1 and "SGLang runs as shipped" in errors[0] and "0.5.22" in errors[0])
    # And on the installed release every hook registers (the test process applies none).
    checks.check("register_all on the installed release", patch.register_all())
    checks.finish()


if __name__ == "__main__":
    sys.exit(main())
