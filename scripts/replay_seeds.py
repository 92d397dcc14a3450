#!/usr/bin/env python3
"""The default replay comparison over seeds 1..N: each row's mean and spread, ratios vs baselines.

Every row's mean and spread, and the ratios a user reads, each against the baseline it names.

Runs `dpbalance-replay --seed S --json DIR/seed_S.json [extra flags]` for seeds 1..N (N >= 2) and
prints, per row, the mean goodput, its range over the seeds, TPOT p99 and bubble; then, per seed
and as mean ± standard deviation:
  - the DSpark section: our planner on the tiers ("D z1.2 + goodput (tiers)") over the engines'
    best there, the best of every DSpark row (each of SGLang's tables, tier fill off and on) and
    "D z1.2 static_best tiers" by mean goodput over the seeds (the same row for every seed); over
    the best fixed verify length on the same tiers
    ("D z1.2 static_best tiers"); TPOT p99 over the engines' best; and dspark_fill over
    static_best;
  - the instance's own draft: "D z1.2 + goodput" over "D z1.2" (its best static k).
`--json-out FILE` writes the same as JSON. Rows missing from a run (a comparison with other
rows) are left out.

Usage: scripts/replay_seeds.py REPLAY_BINARY SEEDS OUT_DIR [--json-out FILE] [replay flags...]
"""
import json
import os
import statistics
import subprocess
import sys

OURS_TIERS = "D z1.2 + goodput (tiers)"
DSPARK = "D z1.2 dspark"
DSPARK_FILL = "D z1.2 dspark_fill"
STATIC_TIERS = "D z1.2 static_best tiers"
OURS = "D z1.2 + goodput"
STATIC = "D z1.2"


def run(binary, seed, out_dir, extra):
    path = os.path.join(out_dir, f"seed_{seed}.json")
    subprocess.run([binary, "--seed", str(seed), "--json", path, *extra], check=True,
                   stdout=subprocess.DEVNULL)
    with open(path) as f:
        return {r["name"]: r for r in json.load(f)["runs"]}


def spread(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def main():
    args = sys.argv[1:]
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    json_out = None
    if "--json-out" in args:
        i = args.index("--json-out")
        json_out = args[i + 1]
        del args[i:i + 2]
    if len(args) < 3:
        sys.exit(__doc__)
    binary, seeds, out_dir, extra = args[0], int(args[1]), args[2], args[3:]
    if seeds < 2:
        sys.exit(f"replay_seeds: SEEDS = {seeds} must be >= 2 (a spread needs two)")
    os.makedirs(out_dir, exist_ok=True)
    runs = [run(binary, s, out_dir, extra) for s in range(1, seeds + 1)]
    names = [n for n in runs[0] if all(n in r for r in runs)]

    print(f"flags: {' '.join(extra) or '(defaults)'}; seeds 1..{seeds}")
    print(f"{'row':28} {'goodput mean':>13} {'min':>9} {'max':>9} {'tpot99':>8} {'bubble':>7} {'k':>2}")
    table = {}
    for n in names:
        g = [r[n]["goodput_tok_per_s"] for r in runs]
        t = [r[n]["tpot_p99_ms"] for r in runs]
        b = [r[n]["bubble_fraction"] for r in runs]
        ks = sorted({r[n]["k"] for r in runs})
        table[n] = {"goodput_mean": statistics.mean(g), "goodput_sd": spread(g), "goodput": g,
                    "tpot_p99_mean": statistics.mean(t), "bubble_mean": statistics.mean(b), "k": ks}
        print(f"{n:28} {statistics.mean(g):13.1f} {min(g):9.1f} {max(g):9.1f} "
              f"{statistics.mean(t):8.2f} {statistics.mean(b):7.4f} {','.join(map(str, ks)):>2}")

    ratios = {}

    def ratio(label, num, den, key="goodput_tok_per_s"):
        if num not in names or den not in names:
            return
        xs = [r[num][key] / r[den][key] for r in runs]
        ratios[label] = {"per_seed": xs, "mean": statistics.mean(xs), "sd": spread(xs),
                         "numerator": num, "denominator": den, "key": key}

    # The engines' best: every DSpark row (each of SGLang's tables, tier fill off and on) and its
    # static mode at the best fixed length on the same tiers, by mean goodput over the seeds.
    engine_rows = [n for n in names if runs[0][n].get("verify_mode") in ("dspark", "dspark_fill",
                                                                         "static_best")]
    for n in (OURS, OURS_TIERS):
        if n in names and not all(r[n].get("headline", True) for r in runs):
            print(f"WARNING: {n} planned with {runs[0][n].get('planner_model')}: oracle knowledge, "
                  "not a headline")
    if DSPARK in names and DSPARK_FILL in names:
        engine = max(engine_rows, key=lambda n: table[n]["goodput_mean"])
        ratio(f"goodput: ours (tiers) / engines' best ({engine})", OURS_TIERS, engine)
        ratio(f"TPOT p99: ours (tiers) / engines' best ({engine})", OURS_TIERS, engine, "tpot_p99_ms")
        ratio("goodput: ours (tiers) / static_best (tiers)", OURS_TIERS, STATIC_TIERS)
        ratio("goodput: dspark_fill / static_best (tiers)", DSPARK_FILL, STATIC_TIERS)
        ratio("goodput: dspark / static_best (tiers)", DSPARK, STATIC_TIERS)
    ratio("goodput: D z1.2 + goodput / D z1.2 (best static k)", OURS, STATIC)
    ratio("TPOT p99: D z1.2 + goodput / D z1.2", OURS, STATIC, "tpot_p99_ms")
    print()
    for label, r in ratios.items():
        seeds_text = ", ".join(f"{x:.4f}" for x in r["per_seed"])
        print(f"{label:58} {r['mean']:.4f} ± {r['sd']:.4f}  ({seeds_text})")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"flags": extra, "seeds": seeds, "rows": table, "ratios": ratios}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
