"""Issue #49: no headline row plans with the replay's truth.

Runs the default comparison (DP4, the first 400 Mooncake requests) and checks its JSON: every row
says whether it is a headline; the planner rows plan with what they would have in production
(auto: online:v2 on the V2 truth), never with "truth"; the oracle rows are never headlines; every
DSpark row names its table. Then with `--planner_model truth`: every planner row is marked not a
headline and the summary says ORACLE KNOWLEDGE. This fails if the default goes back to planning
with the truth, or a truth-planned row is left marked as a headline.

Usage: replay_parity_test.py REPLAY_BINARY
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_checks import Checks  # noqa: E402

SMALL = ["--dp", "4", "--max_requests", "400", "--threads", "2"]


def replay(binary, out_dir, name, *flags):
    path = os.path.join(out_dir, f"{name}.json")
    done = subprocess.run([binary, *SMALL, "--json", path, *flags], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: dpbalance-replay exited {done.returncode}: {done.stderr}")
    with open(path) as f:
        return json.load(f)["runs"], done.stdout


def main():
    binary = sys.argv[1]
    checks = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        runs, out = replay(binary, tmp, "default")
        planners = [r for r in runs if r["verify_mode"] in ("goodput", "local", "fill")]
        checks.check("every row says whether it is a headline", all("headline" in r for r in runs))
        checks.check("no headline row plans with the truth",
                     not [r["name"] for r in runs
                          if r["headline"] and r.get("planner_model", "").startswith("truth")])
        checks.check("the planner rows plan with online:v2 and are headlines",
                     planners and all(r.get("planner_model") == "online:v2" and r["headline"]
                                      for r in planners),
                     [(r["name"], r.get("planner_model")) for r in planners])
        oracles = [r for r in runs if r["verify_mode"] == "oracle"]
        checks.check("the oracle rows are not headlines",
                     oracles and not any(r["headline"] for r in oracles))
        dspark = [r for r in runs if r["verify_mode"] in ("dspark", "dspark_fill")]
        checks.check("every DSpark row names its table, SGLang's four and ours",
                     {r.get("dspark_table") for r in dspark} ==
                     {"profiled", "workload", "additive", "online", "context"})
        checks.check("the online rows count their rebuilds",
                     all("dspark_table_rebuilds" in r for r in dspark if r["dspark_table"] == "online"))
        checks.check("the header names the planner's model",
                     "planner model: online:v2 (auto" in out, out.splitlines()[:4])
        checks.check("the DSpark summary names the engines' best", "<- the engines' best" in out)

        runs, out = replay(binary, tmp, "truth", "--planner_model", "truth")
        planners = [r for r in runs if r["verify_mode"] in ("goodput", "local", "fill")]
        checks.check("--planner_model truth: no planner row is a headline",
                     planners and not any(r["headline"] for r in planners))
        checks.check("--planner_model truth: the summaries say so", "ORACLE KNOWLEDGE" in out)
    checks.finish()


if __name__ == "__main__":
    main()
