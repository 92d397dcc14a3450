#!/usr/bin/env python3
"""dpbalance_sglang's version range and hooked-signature checks (patch/__init__.py), against the
installed SGLang's own functions: every refusal is one line naming what differs, and with it no
hook is registered, so SGLang runs as shipped. Each case below is a refusal a user can meet (or an
acceptance that an exact-string check used to refuse: a patch or .post release).

Run with the Python of the sglang ctest venv (sglang_env.sh). A missing SGLang is a failure.
"""
import logging
import sys


def main():
    try:
        import sglang  # noqa: F401
        from dpbalance_sglang import patch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError as e:
        sys.exit(f"FAIL: {e} in {sys.executable}; not skipping")
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    installed = sglang.__version__
    check(patch.check_upstream() == "", f"SGLang {installed} as installed: accepted")
    for version in ("0.5.23", "0.5.24", "0.5.23.post1", "0.5.30"):
        check(patch.check_upstream(version) == "", f"SGLang {version}: accepted")
    refusals = {
        "0.5.22": "written for SGLang >= 0.5.23, < 0.6, found SGLang 0.5.22",
        "0.6.0": "written for SGLang >= 0.5.23, < 0.6, found SGLang 0.6.0",
        "0.6.0rc1": "written for SGLang >= 0.5.23, < 0.6, found SGLang 0.6.0rc1",
        "1.0.0": "written for SGLang >= 0.5.23, < 0.6, found SGLang 1.0.0",
        "main": "SGLang reports version 'main', not a release number",
    }
    for version, want in refusals.items():
        got = patch.check_upstream(version)
        check(got.startswith(want), f"SGLang {version}: refused with {got!r}")
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
    check(got.startswith(want), f"a changed signature: refused with {got!r}")
    # A hooked function that is gone: named, refused.
    from sglang.srt.speculative import adaptive_spec_params as asp

    saved = asp.adaptive_unsupported_reason
    del asp.adaptive_unsupported_reason
    try:
        got = patch.check_upstream()
    finally:
        asp.adaptive_unsupported_reason = saved
    check(got.startswith("hook target sglang.srt.speculative.adaptive_spec_params."
                         "adaptive_unsupported_reason cannot be resolved"),
          f"a missing target: refused with {got!r}")
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
    check(not ok and not dpb_hooks, f"register_all on 0.5.22: {len(dpb_hooks)} hooks registered")
    check(len(errors) == 1 and "SGLang runs as shipped" in errors[0] and "0.5.22" in errors[0],
          f"register_all on 0.5.22: one error line: {errors}")
    # And on the installed release every hook registers (the test process applies none).
    check(patch.register_all(), "register_all on the installed release")
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
