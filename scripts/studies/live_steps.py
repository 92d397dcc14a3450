#!/usr/bin/env python3
"""Per-step anatomy of a live vLLM run's arms, from the step logs `scripts/live_vllm.sh
--keep-logs DIR` keeps (DIR/runs/WORKLOAD/dpN/ARM_rR/worker_dp*.jsonl and, for plugin arms,
engine_dp*.jsonl). Answers where an arm's goodput went: tokens per step or time per step, which
rank set the step, and whether the attention model holds on the arm's batches.

Per arm (replicates pooled) and DP rank, over decode-only steps (every request's query <= 8):
steps, wall ms per step (time between consecutive decode steps' ends), forward ms, attention ms,
query tokens per step, drafts verified per request-step, mean spread of lengths within a step,
tokens emitted per step (accepted + bonus). For plugin arms, the plan's predicted attention of
each rank against the measured, and the predicted barrier (max over ranks) against the measured.
Last, a least-squares attention model fitted to the static arms' steps alone (features: sum of
query x context, sum of query, sum of context, requests, 1; the lengths there are uniform) and
its mean signed error on every arm's steps: a positive error on ragged batches (plugin arms)
means such batches cost more than their token counts say.

  scripts/studies/live_steps.py DIR/runs/WORKLOAD/dpN [--json OUT]
"""
import argparse
import json
import os
import statistics as st


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def decode_steps(rows):
    out = [r for r in rows if r.get("kind") == "model" and r.get("q") and max(r["q"]) <= 8]
    return out


def solve(a, b):
    """Least squares by the normal equations (small, well-scaled systems)."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))]
         for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c and m[c][c] != 0:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


def features(step):
    q, c = step["q"], step["ctx"]
    scale = 1e-6
    return [sum(a * b for a, b in zip(q, c)) * scale, sum(q) * 1e-2, sum(c) * scale, len(q), 1.0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="DIR/runs/WORKLOAD/dpN of a kept live run")
    ap.add_argument("--json", dest="out_path", help="write the figures here too")
    a = ap.parse_args()
    root, out_path = a.root, a.out_path
    arms = {}
    for name in sorted(os.listdir(root)):
        arm = name.rsplit("_r", 1)[0]
        for rank in range(64):
            p = os.path.join(root, name, f"worker_dp{rank}.jsonl")
            if not os.path.exists(p):
                break
            steps = decode_steps(load(p))
            for s, prev in zip(steps[1:], steps):
                s["wall_us"] = (s["t"] - prev["t"]) * 1e6
                # right after the previous decode step (no prefill step between them)
                s["next_to_prev"] = "i" in s and s["i"] == prev.get("i", -2) + 1
            a = arms.setdefault(arm, {}).setdefault(rank, {"steps": [], "plans": []})
            a["steps"] += steps[1:]
            e = os.path.join(root, name, f"engine_dp{rank}.jsonl")
            if os.path.exists(e):
                rows = load(e)
                plans = {r["x"]: r for r in rows if "x" in r and r.get("extra", 0) == 0
                         and r.get("n") and r.get("pred_us")}
                a["plans"].append(plans)
                a.setdefault("exchange_us", []).extend(
                    r["xchg_us"] for r in rows if "x" in r and r.get("xchg_us"))
                # Plans made, exchanged or not (a quiet step, DPB_QUIET_AFTER, has no xchg_us).
                a["plan_steps"] = a.get("plan_steps", 0) + sum(1 for r in rows if "x" in r)
    report = {"arms": {}}
    print(f"{'arm':10s} rank steps wall_ms fwd_ms att_ms q/step drafts/req spread tokens/step")
    for arm, ranks in arms.items():
        report["arms"][arm] = {}
        for rank, a in ranks.items():
            s = a["steps"]
            if not s:
                continue
            walls = sorted(x["wall_us"] for x in s)
            row = {
                "steps": len(s),
                "wall_ms_median": walls[len(walls) // 2] / 1e3,
                "forward_ms": st.mean(x["fwd_us"] for x in s) / 1e3,
                "attention_ms": st.mean(x["att_us"] for x in s) / 1e3,
                "query_tokens_per_step": st.mean(sum(x["q"]) for x in s),
                "drafts_per_request": st.mean(d for x in s for d in x["d"]),
                "length_spread": st.mean(max(x["d"]) - min(x["d"]) for x in s),
                "tokens_per_step": st.mean(sum(max(0, v) + 1 for v in x["a"]) for x in s),
            }
            report["arms"][arm][rank] = row
            print(f"{arm:10s} {rank:4d} {row['steps']:5d} {row['wall_ms_median']:7.1f} "
                  f"{row['forward_ms']:6.1f} {row['attention_ms']:6.1f} "
                  f"{row['query_tokens_per_step']:6.1f} {row['drafts_per_request']:10.2f} "
                  f"{row['length_spread']:6.2f} {row['tokens_per_step']:11.1f}")
    # Where a step's wall time goes outside the forward (the engine core's scheduling, the
    # sampler, drafting, and for plugin arms the plan's exchange): mean wall minus forward over
    # decode steps that directly follow another, and the plugin's collective (engine_dp*.jsonl
    # xchg_us, every exchange of the arm: the engine core's all-reduce, waits for the peer
    # included).
    print("outside the forward (ms per decode step; wall - forward), per rank; plugin arms: "
          "the exchange (ms per exchange) and the share of steps that ran one")
    for arm, ranks in arms.items():
        outs, xchg, share = [], [], []
        for rank, a in sorted(ranks.items()):
            pairs = [x for x in a["steps"] if x.get("next_to_prev")]
            if not pairs:
                continue
            out = st.mean(x["wall_us"] - x["fwd_us"] for x in pairs) / 1e3
            outs.append(out)
            row = report["arms"][arm][rank]
            row["outside_forward_ms"] = out
            row["wall_ms_mean"] = st.mean(x["wall_us"] for x in pairs) / 1e3
            if a.get("exchange_us"):
                row["exchange_ms"] = st.mean(a["exchange_us"]) / 1e3
                row["exchanged_share"] = len(a["exchange_us"]) / max(1, a["plan_steps"])
                xchg.append(row["exchange_ms"])
                share.append(row["exchanged_share"])
        if outs:
            print(f"  {arm:10s} outside {', '.join(f'{v:.2f}' for v in outs)}"
                  + (f"; exchange {', '.join(f'{v:.2f}' for v in xchg)} on "
                     f"{', '.join(f'{100 * v:.1f}%' for v in share)} of steps" if xchg else ""))
    # The plan's view: predicted against measured attention, per rank and at the barrier.
    for arm, ranks in arms.items():
        if not all(a["plans"] for a in ranks.values()):
            continue
        pred, meas, pmax, mmax = {}, {}, [], []
        for rep in range(min(len(a["plans"]) for a in ranks.values())):
            per = [ranks[r]["plans"][rep] for r in sorted(ranks)]
            for x in set.intersection(*(set(p) for p in per)):
                ps = [p[x]["pred_us"] for p in per]
                ms = [p[x]["att_us"] for p in per]
                for r, (pv, mv) in enumerate(zip(ps, ms)):
                    pred.setdefault(r, []).append(pv)
                    meas.setdefault(r, []).append(mv)
                pmax.append(max(ps))
                mmax.append(max(ms))
        if not pmax:
            continue
        view = {"steps": len(pmax),
                "predicted_ms": [st.mean(pred[r]) / 1e3 for r in sorted(pred)],
                "measured_ms": [st.mean(meas[r]) / 1e3 for r in sorted(meas)],
                "predicted_barrier_ms": st.mean(pmax) / 1e3,
                "measured_barrier_ms": st.mean(mmax) / 1e3}
        report.setdefault("plans", {})[arm] = view
        print(f"plan {arm}: {view['steps']} steps; attention per rank predicted "
              f"{', '.join(f'{v:.1f}' for v in view['predicted_ms'])} ms, measured "
              f"{', '.join(f'{v:.1f}' for v in view['measured_ms'])} ms; barrier predicted "
              f"{view['predicted_barrier_ms']:.1f}, measured {view['measured_barrier_ms']:.1f} ms")
    # Ragged batches against a model of uniform ones.
    train = [(features(x), x["att_us"]) for arm, ranks in arms.items() if arm.startswith(("static", "nospec"))
             for a in ranks.values() for x in a["steps"]]
    if len(train) > 10:
        w = solve([f for f, _ in train], [y for _, y in train])
        report["uniform_fit_error"] = {}
        for arm, ranks in arms.items():
            errs = [(sum(a * b for a, b in zip(features(x), w)) - x["att_us"]) / x["att_us"]
                    for a in ranks.values() for x in a["steps"] if x["att_us"] > 0]
            report["uniform_fit_error"][arm] = st.mean(errs)
            print(f"uniform-length attention fit on {arm}: mean error {100 * st.mean(errs):+.1f}% "
                  f"(negative: the arm's steps cost more than the fit says)")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
