#!/usr/bin/env python3
"""How well two acceptance estimators predict real vLLM acceptance, step by step, from a kept
live run's worker logs (`scripts/live_vllm.sh --keep-logs DIR`: DIR/runs/W/dpN/ARM_rR/
worker_dp*.jsonl, which hold each step's request ids, drafts verified `d` and accepted `a`).

Before each step, each estimator gives every request a curve of conditional acceptance rates;
the step's outcome (a of d accepted) is scored by its log-likelihood under that curve, then
observed. Reported: the mean log-likelihood per request-step (higher is better).
- beta: the plugin's AcceptanceEstimator (runtime/src/acceptance.cc): per position, a Beta
  posterior around the instance's pooled rate, worth `prior_strength` observations.
- shift(tau): one logit shift per request over the pooled rates (the shape the replay draws
  acceptance from), its MAP under a N(0, tau^2) prior from all the request's positions at once.

  scripts/acceptance_models.py 'DIR/runs/mixed/dp2/static_k*_r1/worker_dp*.jsonl' [...]
"""
import glob
import json
import math
import sys

K = 8
MTP = [0.762, 0.616, 0.513, 0.424, 0.364, 0.309, 0.272, 0.237]  # MtpK8ConditionalProfile
INIT = [MTP[0]] + [MTP[j] / MTP[j - 1] for j in range(1, K)]
PRIOR_STRENGTH = 4.0  # DPB_PRIOR_STRENGTH's default
TAUS = (0.5, 1.0, 2.0, 4.0)


def sig(x):
    return 1 / (1 + math.exp(-x))


def logit(p):
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def observe(c, d, a):
    for j in range(min(d, a + 1)):
        c[0][j] += 1
        c[1][j] += j < a


def pooled(p):
    return [(p[1][j] + PRIOR_STRENGTH * INIT[j]) / (p[0][j] + PRIOR_STRENGTH) for j in range(K)]


def beta_rates(c, pool):
    return pool if c is None else [(c[1][j] + PRIOR_STRENGTH * pool[j]) / (c[0][j] + PRIOR_STRENGTH)
                                   for j in range(K)]


def shift_rates(c, pool, tau):
    if c is None:
        return pool
    base = [logit(p) for p in pool]
    s = 0.0
    for _ in range(30):  # Newton on the log posterior of the shift
        g, h = -s / tau ** 2, -1 / tau ** 2
        for j in range(K):
            if c[0][j]:
                p = sig(base[j] + s)
                g += c[1][j] - c[0][j] * p
                h -= c[0][j] * p * (1 - p)
        step = g / h
        s = max(-15.0, min(15.0, s - step))
        if abs(step) < 1e-7:
            break
    return [sig(b + s) for b in base]


def loglik(rates, d, a):
    v = sum(math.log(max(rates[j], 1e-9)) for j in range(a))
    return v + (math.log(max(1 - rates[a], 1e-9)) if a < d else 0.0)


def score(files):
    total = {"beta": 0.0, **{f"shift({t:g})": 0.0 for t in TAUS}}
    n = 0
    for path in files:  # one rank of one instance: its own estimator, as the plugin keeps
        pool_counts = [[0.0] * K, [0.0] * K]
        per = {}
        for line in open(path):
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r.get("kind") != "model" or "rid" not in r or "d" not in r:
                continue
            steps = [(rid, min(d, K), min(a, d, K)) for rid, d, a in zip(r["rid"], r["d"], r["a"]) if d > 0]
            pool = pooled(pool_counts)
            for rid, d, a in steps:
                c = per.get(rid)
                total["beta"] += loglik(beta_rates(c, pool), d, a)
                for t in TAUS:
                    total[f"shift({t:g})"] += loglik(shift_rates(c, pool, t), d, a)
                n += 1
            for rid, d, a in steps:
                observe(pool_counts, d, a)
                observe(per.setdefault(rid, [[0.0] * K, [0.0] * K]), d, a)
    return n, {k: v / max(n, 1) for k, v in total.items()}


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    for pattern in sys.argv[1:]:
        files = sorted(glob.glob(pattern))
        n, s = score(files)
        print(f"{pattern}: {len(files)} logs, {n} request-steps; mean log-likelihood: "
              + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
