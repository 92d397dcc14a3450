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
- eb-shift: the same, with tau^2 learnt online by empirical Bayes (the rank's own requests:
  tau^2 = mean of m_i^2 + v_i, each request's posterior mode and Laplace variance, with a prior
  worth EB_PRIOR_REQUESTS requests at EB_TAU2_INIT); no width is chosen by hand. The plugin's
  DPB_ACCEPTANCE=shift (AcceptanceEstimator's kShift), refitted once a step as here.
- eb-hybrid: the per-position Beta of `beta`, centred on the request's eb-shift rates instead of
  the pooled ones (tau -> 0 gives `beta` back).

  scripts/studies/acceptance_models.py 'DIR/runs/mixed/dp2/static_k*_r1/worker_dp*.jsonl' [...]
  scripts/studies/acceptance_models.py --synthetic SIGMA [SEED]
    a made-up log drawn the way the replay draws acceptance (each request's rates the MTP
    profile shifted by N(0, SIGMA) in logit space; 16 requests at a time, 3 drafts a step,
    5-80 tokens each, 1,500 steps), written to a temporary directory and scored the same way.
"""
import glob
import json
import math
import os
import random
import sys
import tempfile

K = 8
MTP = [0.762, 0.616, 0.513, 0.424, 0.364, 0.309, 0.272, 0.237]  # MtpK8ConditionalProfile
INIT = [MTP[0]] + [MTP[j] / MTP[j - 1] for j in range(1, K)]
PRIOR_STRENGTH = 4.0  # DPB_PRIOR_STRENGTH's default
TAUS = (0.5, 1.0, 2.0, 4.0)
# AcceptanceEstimator's kShift constants (runtime/include/dpbalance/acceptance.h): the learnt
# tau^2 starts at EB_TAU2_INIT worth EB_PRIOR_REQUESTS requests; retired requests' weight decays
# by 1/EB_MEMORY_REQUESTS per retired request.
EB_TAU2_INIT = 1.0
EB_PRIOR_REQUESTS = 4.0
EB_MEMORY_REQUESTS = 256.0


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
    return shift_post(c, pool, tau)[0]


def shift_post(c, pool, tau):
    """(rates, posterior mode, Laplace variance) of the request's shift under N(0, tau^2)."""
    if c is None:
        return pool, 0.0, tau ** 2
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
    h = -1 / tau ** 2 - sum(c[0][j] * sig(base[j] + s) * (1 - sig(base[j] + s)) for j in range(K))
    return [sig(b + s) for b in base], s, -1 / h


class EbShift:
    """tau^2 by online EM over the rank's requests (the retired ones at their last posterior)."""

    def __init__(self):
        self.tau2 = EB_TAU2_INIT
        self.done_sum, self.done_n = 0.0, 0.0

    def refit(self, per, pool):
        tot, n = EB_PRIOR_REQUESTS * EB_TAU2_INIT + self.done_sum, EB_PRIOR_REQUESTS + self.done_n
        for c in per.values():
            _, m, v = shift_post(c, pool, math.sqrt(self.tau2))
            tot, n = tot + m * m + v, n + 1
        self.tau2 = min(max(tot / n, 1e-4), 100.0)

    def retire(self, c, pool):
        _, m, v = shift_post(c, pool, math.sqrt(self.tau2))
        keep = 1 - 1 / EB_MEMORY_REQUESTS
        self.done_sum, self.done_n = self.done_sum * keep + m * m + v, self.done_n * keep + 1

    def rates(self, c, pool):
        return shift_post(c, pool, math.sqrt(self.tau2))[0]

    def hybrid(self, c, pool):
        return beta_rates(c, self.rates(c, pool))


def loglik(rates, d, a):
    v = sum(math.log(max(rates[j], 1e-9)) for j in range(a))
    return v + (math.log(max(1 - rates[a], 1e-9)) if a < d else 0.0)


def score(files):
    total = {"beta": 0.0, **{f"shift({t:g})": 0.0 for t in TAUS}, "eb-shift": 0.0, "eb-hybrid": 0.0}
    taus = []
    n = 0
    for path in files:  # one rank of one instance: its own estimator, as the plugin keeps
        pool_counts = [[0.0] * K, [0.0] * K]
        per = {}
        eb = EbShift()
        active = set()
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
                total["eb-shift"] += loglik(eb.rates(c, pool), d, a)
                total["eb-hybrid"] += loglik(eb.hybrid(c, pool), d, a)
                n += 1
            live = {rid for rid, _, _ in steps}
            for rid in active - live:  # left the batch (finished, or preempted): retired
                eb.retire(per[rid], pool)
            active = live
            for rid, d, a in steps:
                observe(pool_counts, d, a)
                observe(per.setdefault(rid, [[0.0] * K, [0.0] * K]), d, a)
            eb.refit({rid: per[rid] for rid in active}, pooled(pool_counts))
        taus.append(math.sqrt(eb.tau2))
    print("  learnt tau per log: " + " ".join(f"{t:.2f}" for t in taus))
    return n, {k: v / max(n, 1) for k, v in total.items()}


def synthetic_log(sigma, seed, path):
    rng = random.Random(seed)
    live, next_id = [], 0
    with open(path, "w") as f:
        for _ in range(1500):
            while len(live) < 16:
                s = rng.gauss(0, sigma)
                live.append([next_id, [sig(logit(p) + s) for p in INIT], rng.randint(5, 80)])
                next_id += 1
            rid, d, a = [], [], []
            for r in live:
                acc = 0
                while acc < 3 and rng.random() < r[1][acc]:
                    acc += 1
                rid.append(r[0]), d.append(3), a.append(acc)
                r[2] -= acc + 1
            f.write(json.dumps({"kind": "model", "rid": rid, "d": d, "a": a}) + "\n")
            live = [r for r in live if r[2] > 0]


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if sys.argv[1] == "--synthetic":
        sigma = float(sys.argv[2])
        seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "worker_dp0.jsonl")
            synthetic_log(sigma, seed, path)
            n, s = score([path])
        print(f"synthetic sigma {sigma:g} seed {seed}: {n} request-steps; mean log-likelihood: "
              + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))
        return
    for pattern in sys.argv[1:]:
        files = sorted(glob.glob(pattern))
        n, s = score(files)
        print(f"{pattern}: {len(files)} logs, {n} request-steps; mean log-likelihood: "
              + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
