#!/usr/bin/env python3
"""Runs SGLang 0.5.23's own scheduler event loop in 2 scheduler OS processes (DP attention:
dp_size 2, tp_size 2, attention TP 1) over gloo, with requests flowing, and prints each
process's record (sglang_loop_rank.py says what of SGLang runs and what stands in;
sglang_loop_NOTES.md has the findings and timings).

Usage: sglang_loop_probe.py LOOP SPEC [ITERATIONS] [options]
  LOOP: overlap (SGLang's default, Scheduler.event_loop_overlap) | normal (event_loop_normal)
  SPEC: none | eagle | eagle_adaptive | dspark | dspark_sps
  ITERATIONS: loop iterations per process (default 40)
  --json OUT        write the case and both records
  --keep            keep the output folder (per-process logs, streamed iterations)
  --symmetric       the same requests on both DP ranks (adaptive EAGLE then agrees)
  --accept P        the draft's per-token hit probability (default 0.7)
  --accept-by-dp P0,P1
  --plugin SO       DPB_PLUGIN for both processes (default: unset, SGLang as shipped)
  --load-plugins before_scheduler|after_scheduler|no

Run with the Python of a venv that holds the pinned SGLang and the installed dpbalance_sglang
package (its `sglang.srt.platforms` entry point gives SGLang the gloo CPU platform):
  tests/integration/sglang_env.sh /tmp/dpb_loop_probe_venv
  /tmp/dpb_loop_probe_venv/bin/python tests/integration/sglang_loop_probe.py overlap eagle
Exit status 0 when both processes ran every iteration without an error and every request's
output equals the deterministic target's greedy chain (speculative decoding is lossless).
"""
import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_requests(dp=2, symmetric=False):
    """A few requests per DP rank, uneven on purpose: rank 1 gets more and longer ones; some
    arrive later (at a given iteration), so prefill and decode mix over the run. symmetric:
    every DP rank gets the same requests (same prompts, same arrival), so that each rank's
    acceptance, and what SGLang decides from it, is the same."""
    reqs = []
    plan = {0: [(40, 12, 0), (24, 18, 0), (60, 10, 6), (32, 16, 14)],
            1: [(48, 20, 0), (30, 14, 0), (36, 24, 0), (80, 12, 4), (20, 16, 9), (44, 10, 18)]}
    for dp_rank in range(dp):
        for i, (plen, mnt, at) in enumerate(plan[1 if symmetric else dp_rank % 2]):
            r = {"rid": f"dp{dp_rank}-r{i}", "dp": dp_rank, "prompt_len": plen,
                 "max_new_tokens": mnt, "at": at}
            if symmetric:
                r["prompt_key"] = f"r{i}"
            reqs.append(r)
    return reqs


def make_case(loop, spec, iterations=40, **kw):
    case = {"name": f"loop_{loop}_{spec}", "loop": loop, "spec": spec, "iterations": iterations,
            "requests": default_requests(), "seed": 0, "accept": 0.7, "env": {},
            "load_plugins": "before_scheduler"}
    if spec == "eagle_adaptive":
        # SGLang's adaptive policy with a short warm-up so that it decides within a short run
        # (the shipped default waits 10 verifies, then re-decides every 5, per batch-size
        # slot); candidate depths around the start (3).
        case["eagle"] = {"steps": 3, "adaptive_config": {
            "1": {"candidate_steps": [1, 2, 3, 4]},
            "warmup_batches": 2, "update_interval": 2, "ema_alpha": 0.5}}
    if spec in ("dspark", "dspark_sps"):
        case["env"]["SGLANG_RAGGED_VERIFY_MODE"] = "compact"
    case.update(kw)
    return case


def run_procs(case, world=2, timeout_s=300, outdir=None):
    import torch.multiprocessing as mp

    import sglang_loop_rank

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    outdir = outdir or tempfile.mkdtemp(prefix="dpb-sglang-loop-")
    port = free_port()
    procs = [ctx.Process(target=sglang_loop_rank.process_main,
                         args=(p, world, port, case, outdir, q)) for p in range(world)]
    t0 = time.monotonic()
    got, crashed = collect(procs, q, world, timeout_s=timeout_s)
    wall = time.monotonic() - t0
    logs = {}
    for p in range(world):
        path = os.path.join(outdir, f"{case['name']}.{p}.log")
        logs[p] = open(path, errors="replace").read() if os.path.exists(path) else ""
    return got, crashed, logs, [p.exitcode for p in procs], wall, outdir


def collect(procs, q, want, timeout_s=300, grace_s=20, join_s=30):
    """proc_results.collect's protocol ((proc, name, record) or (proc, "__crash__", tb) on the
    queue), but a process that dies without a word (a C++ abort in gloo on a collective
    mismatch) ends the wait grace_s later instead of at timeout_s."""
    import queue as queue_mod

    for p in procs:
        p.start()
    got, crashed = {}, []
    deadline = time.monotonic() + timeout_s
    dead_since = None
    while len(got) < want and time.monotonic() < deadline:
        try:
            proc, name, rec = q.get(timeout=1.0)
        except queue_mod.Empty:
            told = got.keys() | {c[0] for c in crashed}
            silent = [i for i, p in enumerate(procs) if p.exitcode is not None and i not in told]
            if crashed and not silent:
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > grace_s:
                    break  # a crash was reported; the others may wait in a collective
            if silent:
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since > grace_s:
                    for i in silent:
                        crashed.append((i, f"process {i} exited with code "
                                           f"{procs[i].exitcode} without a record"))
                    break
            continue
        if name == "__crash__":
            crashed.append((proc, rec))
            continue
        got[proc] = rec
    for p in procs:
        p.join(join_s if not crashed else 2)
        if p.exitcode is None:
            p.kill()
            p.join(5)
    return got, crashed


def compare_ranks(got):
    """Per iteration, the draft depth each DP rank's worker ran on decode; where they differ,
    the ranks' draft forwards (each with a DP gather over the TP group) no longer pair."""
    by_iter = {}
    for p, rec in got.items():
        for it in rec["iterations"]:
            sp = it.get("spec") or [None]
            by_iter.setdefault(it["iter"], {})[rec["dp_rank"]] = \
                None if sp[0] is None else (sp[0]["mode"], sp[0]["steps"])
    # Every mode counts but prefill: an idle rank runs the same number of draft forwards
    # (each with its DP gathers) as the depth it holds (EAGLEWorkerV2._draft_forward_idle).
    diverged = [(i, {r: f"{m}:{st}" for r, (m, st) in d.items()})
                for i, d in sorted(by_iter.items())
                if None not in d.values() and len(d) > 1
                and len({st for m, st in d.values() if m != "EXTEND"}) > 1]
    if not any(v is not None for d in by_iter.values() for v in d.values()):
        return "no speculative worker steps"
    if not diverged:
        return "draft depth: the same on every DP rank at every iteration"
    return ("draft depth differs between DP ranks at iterations "
            + ", ".join(f"{i} {d}" for i, d in diverged[:10]))


def summarize(rec):
    lines = [f"process {rec['proc']} (DP rank {rec['dp_rank']}): {rec['loop']} loop, spec "
             f"{rec['spec']}; timing {rec['timing']}; totals {rec['totals']}"]
    for it in rec["iterations"]:
        evs = []
        for e in it["events"]:
            if e[0] == "sync":
                evs.append(f"sync{e[3]}")
            elif e[0] == "run_batch":
                evs.append(f"run({e[1]['mode']},{e[1]['bs']})")
            elif e[0] == "copy":
                evs.append("copy")
            elif e[0] == "process_batch_result":
                b = e[1]["batch"]
                extra = ""
                if "accept_lens" in e[1]:
                    extra = f" acc={e[1]['accept_lens']}"
                if "spec_steps" in e[1]:
                    extra += f" steps={e[1]['spec_steps']}"
                evs.append(f"process({b['mode']},{b['bs']}{extra})")
            elif e[0] == "dspark_tier_gather":
                if e[1]["enabled"]:
                    evs.append(f"tier_gather({e[1]['local']}->{e[1]['gathered']})")
            elif e[0] in ("activate_step_by_batch", "on_verify_complete_cpu"):
                d = e[1]
                if d["steps_before"] != d["steps_after"]:
                    evs.append(f"{e[0]}:{d['steps_before']}->{d['steps_after']}")
            else:
                evs.append(e[0])
        for lay in it.get("dspark_layout", []):
            evs.append(f"[dspark layout lens={lay.get('verify_lens')} "
                       f"tier={lay.get('graph_num_tokens')} dp_tier={lay['dp_tier_num_tokens']}"
                       f"{' verify-all' if lay['verify_all'] else ''}]")
        for sp in it.get("spec", []):
            evs.append(f"[worker {sp['mode']} bs={sp['bs']} steps={sp['steps']}"
                       + (f" lens={sp['verify_lens']}" if sp.get("verify_lens") else "") + "]")
        b = it.get("batch")
        lines.append(f"  it {it['iter']:3d} {it['seconds']:.3f}s syncs={it['syncs']} "
                     f"batch={'-' if b is None else b['mode'] + '/' + str(b['bs'])}: "
                     + " ".join(evs))
    lines.append(f"  finished {len(rec['finished'])}/{len(rec['requests'])}: {rec['finished']}")
    bad = [rid for rid, d in rec["outputs"].items() if not d.get("matches_target", True)]
    lines.append(f"  outputs equal to the target's greedy chain: "
                 f"{len(rec['outputs']) - len(bad)}/{len(rec['outputs'])}"
                 + (f" (differ: {bad})" if bad else ""))
    if rec.get("dpbalance"):
        d = rec["dpbalance"]
        lines.append("  dpbalance_sglang summary: " + json.dumps(
            {k: d.get(k) for k in ("plans", "reports", "unplanned_results", "missing_reports",
                                   "stale_dropped", "exchange_errors", "outstanding",
                                   "init_error", "applied")}, default=str))
    if rec.get("adaptive"):
        lines.append(f"  adaptive: {rec['adaptive']}")
    steps = [sp["steps"] for it in rec["iterations"] for sp in it.get("spec", [])
             if sp["mode"] == "DECODE"]
    acc = [a for it in rec["iterations"] for e in it["events"]
           if e[0] == "process_batch_result" for a in e[1].get("accept_lens", [])]
    if steps:
        lines.append(f"  decode draft depth run by the worker (DSpark: gamma): {steps}")
    if acc:
        lines.append(f"  accept lengths (with the bonus token): n={len(acc)} "
                     f"mean={sum(acc) / len(acc):.2f} histogram="
                     f"{ {k: acc.count(k) for k in sorted(set(acc))} }")
    if rec["error"]:
        lines.append("  ERROR:\n" + rec["error"])
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("loop", choices=["overlap", "normal"])
    ap.add_argument("spec", choices=["none", "eagle", "eagle_adaptive", "dspark", "dspark_sps"])
    ap.add_argument("iterations", nargs="?", type=int, default=40)
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--keep", action="store_true", help="keep the output folder (logs)")
    ap.add_argument("--plugin", help="DPB_PLUGIN for both processes (default: unset)")
    ap.add_argument("--accept", type=float, default=0.7,
                    help="probability that the draft guesses the target's token")
    ap.add_argument("--load-plugins", default="before_scheduler",
                    choices=["before_scheduler", "after_scheduler", "no"],
                    help="when SGLang's load_plugins() runs (default: where "
                         "run_scheduler_process runs it, before the Scheduler is built)")
    ap.add_argument("--symmetric", action="store_true",
                    help="the same requests on every DP rank")
    ap.add_argument("--accept-by-dp", help="per DP rank, e.g. 0.9,0.4 (overrides --accept)")
    ap.add_argument("--draft-moe", action="store_true",
                    help="DSpark: the draft counts as MoE (SGLang's DP tier agreement runs)")
    args = ap.parse_args(argv)
    os.environ.pop("DPB_PLUGIN", None)
    case = make_case(args.loop, args.spec, args.iterations, accept=args.accept,
                     load_plugins=args.load_plugins)
    if args.symmetric:
        case["requests"] = default_requests(symmetric=True)
    if args.accept_by_dp:
        case["accept_by_dp"] = {str(i): float(v)
                                for i, v in enumerate(args.accept_by_dp.split(","))}
    if args.plugin:
        case["env"]["DPB_PLUGIN"] = args.plugin
    if args.draft_moe:
        case["draft_moe"] = True
    got, crashed, logs, codes, wall, outdir = run_procs(case)
    ok = not crashed and len(got) == 2
    for p in sorted(got):
        print(summarize(got[p]))
        ok = ok and got[p]["error"] is None and all(
            d.get("matches_target", True) for d in got[p]["outputs"].values())
    partial = {}
    for p in range(2):
        if p not in got:  # a process that died without a record: its streamed iterations
            path = os.path.join(outdir, f"{case['name']}.{p}.iters.jsonl")
            if os.path.exists(path):
                by_iter = {}  # a step's partial line, then the finished iteration's
                for line in open(path):
                    if line.strip():
                        it = json.loads(line)
                        by_iter[it["iter"]] = it
                its = [by_iter[i] for i in sorted(by_iter)]
                partial[p] = {"proc": p, "dp_rank": p, "iterations": its}
                print(f"process {p} (no record; {len(its)} iterations streamed before it died):")
                for it in its[-3:]:
                    print(f"   it {it['iter']:3d}{' (unfinished)' if it.get('partial') else ''}:"
                          f" spec {it.get('spec')} events "
                          f"{[e[0] if isinstance(e, list) else e for e in it['events']]}")
    print(compare_ranks({**got, **partial}))

    for proc, tb in crashed:
        print(f"process {proc} crashed:\n{tb}")
    if not ok:
        for p, text in logs.items():
            print(f"---- log of process {p} (last 60 lines) ----")
            print("\n".join(text.splitlines()[-60:]))
    keep = args.keep or not ok
    print(f"wall {wall:.1f} s for both processes; exit codes {codes}; "
          + (f"logs in {outdir}" if keep else "output folder removed (--keep keeps it)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": case, "records": got, "crashed": crashed, "wall_s": wall}, f,
                      indent=1, default=str)
    if not keep:
        shutil.rmtree(outdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
