"""The process harness both engine contract tests share (contract_test.py, sglang_contract_test.py):
start the ranks' processes, gather what each reports on a queue, then join them.

A process puts (proc, name, record) on the queue per case it finishes, or (proc, "__crash__",
traceback) when it dies; the first crash ends the wait (the other ranks may then never report).
"""
import time


def collect(procs, q, want, key, timeout_s=240, join_s=30):
    """Starts `procs` and reads `q` until `want` records arrived, `timeout_s` passed or a process
    crashed; then joins every process for up to `join_s` seconds, killing the ones still running.
    Returns (records keyed by key(proc, name), [(proc, traceback) of the crash, if any])."""
    for p in procs:
        p.start()
    got, crashed = {}, []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        try:
            proc, name, rec = q.get(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 (queue.Empty)
            break
        if name == "__crash__":
            crashed.append((proc, rec))
            break
        got[key(proc, name)] = rec
    for p in procs:
        p.join(join_s)
        if p.exitcode is None:
            p.kill()
    return got, crashed
