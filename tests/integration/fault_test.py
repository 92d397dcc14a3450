#!/usr/bin/env python3
"""Faults with real processes: DP ranks as OS processes (fault_rank.py) that load libdpbalance.so
through the Python adapter and exchange their records over TCP (a hub on 127.0.0.1 that pairs
collectives by order, as gloo and NCCL do). For each fault - a rank killed with SIGKILL mid-run,
a rank stopped with SIGSTOP for twice DPB_TIMEOUT_MS and continued, a rank that sends garbage
records, a rank with another config, a rank whose init fails - it checks that the survivors never
wait longer than DPB_TIMEOUT_MS (plus a margin) in any call, that no process crashes, that the
ranks' draft depths differ on at most one step (the step a late rank completes an exchange its
peers gave up on), and that every step the plugin did not balance reached the engine as a
non-success result (each fallback counted). Prints a table of the measured stalls.

Usage: fault_test.py LIBDPBALANCE
"""
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ADAPTER = os.path.join(HERE, "..", "..", "integration", "adapters", "python")
RANKS, STEPS, FAULT_STEP = 4, 120, 40
TIMEOUT_MS = 300
MARGIN_MS = 300  # Python, the hub and a loaded 2-core machine on top of the plugin's bound
_HEADER = struct.Struct("<QI")


class Hub:
    """The network: pairs round r of every rank and sends each the concatenation (rank order)."""

    def __init__(self, num_ranks):
        self.num_ranks = num_ranks
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(num_ranks)
        self.port = self.server.getsockname()[1]
        self.conns = {}
        self.rounds = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            rank = struct.unpack("<I", self._recv(conn, 4))[0]
            with self.lock:
                self.conns[rank] = conn
            threading.Thread(target=self._serve, args=(rank, conn), daemon=True).start()

    @staticmethod
    def _recv(conn, n):
        buf = bytearray()
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise ConnectionError
            buf += chunk
        return bytes(buf)

    def _serve(self, rank, conn):
        try:
            while True:
                rnd, n = _HEADER.unpack(self._recv(conn, _HEADER.size))
                payload = self._recv(conn, n)
                with self.lock:
                    got = self.rounds.setdefault(rnd, {})
                    got[rank] = payload
                    if len(got) < self.num_ranks:
                        continue
                    del self.rounds[rnd]
                    out = _HEADER.pack(rnd, n * self.num_ranks) + b"".join(
                        got[r] for r in range(self.num_ranks))
                    for c in self.conns.values():
                        try:
                            c.sendall(out)
                        except OSError:
                            pass  # a dead rank
        except (ConnectionError, OSError):
            return

    def close(self):
        self.server.close()


def run(library, name, faulty_mode="none", signal_plan=None, configs=None):
    hub = Hub(RANKS)
    env = dict(os.environ, DPB_TIMEOUT_MS=str(TIMEOUT_MS), DPB_LOG_EVERY="0",
               DPB_LOG_LEVEL="off")
    procs, lines = [], [[] for _ in range(RANKS)]
    reached = [threading.Event() for _ in range(RANKS)]
    for r in range(RANKS):
        config = (configs or {}).get(r, "default_k=3")
        mode = faulty_mode if r == RANKS - 1 else "none"
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "fault_rank.py"), library,
                              ADAPTER, str(hub.port), str(r), str(RANKS), str(STEPS), config,
                              mode, str(FAULT_STEP)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        procs.append(p)

        def reader(r=r, p=p):
            for line in p.stdout:
                rec = json.loads(line)
                lines[r].append(rec)
                if rec.get("step") == FAULT_STEP:
                    reached[r].set()
        threading.Thread(target=reader, daemon=True).start()
    faulty = procs[-1]
    if signal_plan == "kill":
        reached[-1].wait(60)
        faulty.send_signal(signal.SIGKILL)
    elif signal_plan == "stop":
        reached[-1].wait(60)
        faulty.send_signal(signal.SIGSTOP)
        time.sleep(2 * TIMEOUT_MS / 1000)
        faulty.send_signal(signal.SIGCONT)
    codes = [p.wait(timeout=120) for p in procs]
    time.sleep(0.1)  # the readers finish
    hub.close()
    # A rank configured with another default runs another depth without the plugin too: the
    # depth check then covers the ranks that share rank 0's configuration.
    same_config = [r for r in range(RANKS) if (configs or {}).get(r, "default_k=3") == "default_k=3"]
    return analyse(name, codes, lines, killed=signal_plan == "kill",
                   must_balance=faulty_mode == "none" and signal_plan is None and not configs,
                   depth_ranks=same_config if faulty_mode == "none" else range(RANKS))


def analyse(name, codes, lines, killed, must_balance, depth_ranks):
    failures = []
    survivors = range(RANKS - 1)
    max_init = max(lines[r][0]["init_ms"] for r in survivors)
    max_plan = max((l["plan_ms"] for r in survivors for l in lines[r] if "plan_ms" in l),
                   default=0)
    for r in range(RANKS):
        want = -signal.SIGKILL if killed and r == RANKS - 1 else 0
        if codes[r] != want:
            failures.append(f"rank {r} exited {codes[r]}, expected {want}")
    if max(max_init, max_plan) > TIMEOUT_MS + MARGIN_MS:
        failures.append(f"a survivor waited {max(max_init, max_plan):.0f} ms "
                        f"(DPB_TIMEOUT_MS {TIMEOUT_MS} + {MARGIN_MS} margin)")
    # Draft depths per step over every rank that ran the step.
    depths = {}
    for r in depth_ranks:
        for l in lines[r]:
            if "step" in l:
                depths.setdefault(l["step"], set()).add(l["depth"])
    split_steps = sorted(s for s, d in depths.items() if len(d) > 1)
    if len(split_steps) > 1:
        failures.append(f"draft depths differ on steps {split_steps[:10]}")
    # Every unbalanced step reached the engine as a non-success result.
    fallbacks = 0
    for r in range(RANKS):
        done = [l for l in lines[r] if l.get("done")]
        if not done:
            continue
        d = done[0]
        non_success = sum(n for res, n in d["results"].items() if res != "dpbSuccess")
        fallbacks += non_success
        if must_balance and d["balanced_steps"] != STEPS:
            failures.append(f"rank {r}: {d['balanced_steps']} of {STEPS} steps balanced without a fault")
        if "no plugin" not in d["results"] and non_success != STEPS - d["balanced_steps"]:
            failures.append(f"rank {r}: {non_success} non-success results but "
                            f"{STEPS - d['balanced_steps']} unbalanced steps")
    outcome = "; ".join(failures) if failures else "ok"
    print(f"| {name} | {max_init:.0f} | {max_plan:.0f} | {len(split_steps)} | {fallbacks} | "
          f"{codes} | {outcome} |", flush=True)
    return not failures


def main():
    library = os.path.abspath(sys.argv[1])
    print(f"DPB_TIMEOUT_MS {TIMEOUT_MS}, {RANKS} ranks, {STEPS} steps, fault at step {FAULT_STEP}")
    print("| fault | max init ms (survivors) | max plan ms (survivors) | steps with split depth "
          "| non-success results (all ranks) | exit codes | outcome |")
    print("|---|---|---|---|---|---|---|")
    ok = [
        run(library, "none"),
        run(library, "SIGKILL rank 3 mid-run", signal_plan="kill"),
        run(library, f"SIGSTOP rank 3 for {2 * TIMEOUT_MS} ms", signal_plan="stop"),
        run(library, "rank 3 sends garbage records", faulty_mode="garbage"),
        run(library, "rank 3 runs another config (default_k 2)",
            configs={RANKS - 1: "default_k=2"}),
        run(library, "rank 3's init fails (k_max=banana)", faulty_mode="badinit",
            configs={RANKS - 1: "k_max=banana"}),
    ]
    passed = sum(ok)
    print(f"{passed} passed, {len(ok) - passed} failed")
    sys.exit(0 if passed == len(ok) else 1)


if __name__ == "__main__":
    main()
