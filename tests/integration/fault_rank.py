#!/usr/bin/env python3
"""One DP rank as an OS process, for fault_test.py: loads libdpbalance.so through the Python
adapter and exchanges its records with the other ranks over TCP (a hub on 127.0.0.1), honouring
the plugin's per-call timeout. Runs `steps` decode steps (plan -> a short sleep for the forward ->
report) and prints one JSON line per step on stdout, then a summary line.

Fault modes (this process's own misbehaviour): none, garbage (from step `fault_step` on, it
sends random bytes instead of its record), badinit (its config is invalid, so its init fails and
it runs without the plugin, never joining an exchange). Kills and stops come from the driver.

Usage: fault_rank.py LIBRARY ADAPTER_DIR PORT RANK NUM_RANKS STEPS CONFIG MODE FAULT_STEP
"""
import json
import os
import random
import socket
import struct
import sys
import time

_HEADER = struct.Struct("<QI")  # round, payload bytes


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("hub closed the connection")
        buf += chunk
    return bytes(buf)


class TcpAllGather:
    """All-gather through the hub: collectives pair by order (round r of every rank), like gloo
    or NCCL; each call waits at most `timeout_ms`, and late replies of earlier rounds are
    dropped."""

    def __init__(self, port, rank, num_ranks):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<I", rank))
        self.num_ranks = num_ranks
        self.round = 0
        self.garbage = False

    def __call__(self, send, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000.0
        if self.garbage:
            send = os.urandom(len(send))
        my_round = self.round
        self.round += 1
        self.sock.sendall(_HEADER.pack(my_round, len(send)) + send)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"all-gather round {my_round}: no reply in {timeout_ms} ms")
            self.sock.settimeout(left)
            try:
                got_round, n = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
                payload = _recv_exact(self.sock, n)
            except socket.timeout:
                raise TimeoutError(f"all-gather round {my_round}: no reply in {timeout_ms} ms")
            if got_round == my_round:
                return payload


def main():
    (library, adapter_dir, port, rank, num_ranks, steps, config, mode,
     fault_step) = sys.argv[1:10]
    port, rank, num_ranks, steps, fault_step = map(int, (port, rank, num_ranks, steps, fault_step))
    sys.path.insert(0, adapter_dir)
    from dpbalance_plugin import Accepted, DpBalance, DpBalanceError, Request, SUCCESS, RESULT_NAMES

    rng = random.Random(rank)
    gather = TcpAllGather(port, rank, num_ranks)
    gather(b"\0", 60000)  # the engine's own start barrier (process group init), before the plugin
    # The engine's own default verify length (what it runs without the plugin).
    pairs = (kv.split("=", 1) for kv in config.replace(";", ",").split(",") if "=" in kv)
    default_k = int(dict((k.strip(), v.strip()) for k, v in pairs).get("default_k", 3))
    t0 = time.monotonic()
    dpb, init_error = None, ""
    try:
        dpb = DpBalance(num_ranks, rank, config, allgather=gather, library=library)
    except DpBalanceError as e:
        init_error = str(e)
    init_ms = (time.monotonic() - t0) * 1000
    print(json.dumps({"init_ms": init_ms, "init_error": init_error}), flush=True)

    # A rank's requests: contexts differ by rank, so the balanced plan differs from the default.
    reqs = [Request(request_id=rank * 1000 + i, ctx_tokens=2000 + 3000 * rank + 500 * i, k_cap=7)
            for i in range(8)]
    results = {}
    max_plan_ms = 0.0
    for step in range(steps):
        if mode == "garbage" and step == fault_step:
            gather.garbage = True
        t = time.monotonic()
        if dpb is not None:
            lens, depth = dpb.plan(reqs)
            result = RESULT_NAMES.get(dpb.last_result, str(dpb.last_result))
        else:
            lens, depth, result = [default_k] * len(reqs), default_k, "no plugin"
        plan_ms = (time.monotonic() - t) * 1000
        max_plan_ms = max(max_plan_ms, plan_ms)
        results[result] = results.get(result, 0) + 1
        attention_us = sum(r.ctx_tokens * (1 + l) for r, l in zip(reqs, lens)) / 2000.0
        time.sleep(0.002)  # the forward
        if dpb is not None:
            accepted = [Accepted(r.request_id, l, rng.randint(0, l), False)
                        for r, l in zip(reqs, lens)]
            dpb.report(attention_us, attention_us + 2000.0, accepted)
        print(json.dumps({"step": step, "depth": depth, "result": result, "plan_ms": plan_ms}),
              flush=True)
    stats = dpb.stats() if dpb is not None else {}
    print(json.dumps({"done": True, "max_plan_ms": max_plan_ms, "results": results,
                      "fallbacks": stats.get("fallbacks", -1), "enabled": stats.get("enabled", 0),
                      "balanced_steps": stats.get("balanced_steps", 0)}), flush=True)
    if dpb is not None:
        dpb.close()


if __name__ == "__main__":
    main()
