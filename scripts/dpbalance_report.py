#!/usr/bin/env python3
"""dpbalance-report: one self-contained HTML page (inline SVG plots) from dpbalance's records.

  dpbalance-report --step-log DIR [--metrics FILE ...] [--replay FILE] --out PAGE.html

Inputs (any of them; each adds its sections):
  --step-log DIR   the vLLM package's step log (DPBALANCE_VLLM_STEP_LOG; docs/live_vllm.md):
                   engine_dp{r}.jsonl (a row per engine step, `stats` and `final` rows) and, when
                   present, worker_dp{r}.jsonl (a row per forward). Plots: per-rank step time over
                   steps, the bubble over time, predicted against measured attention, verify
                   lengths per rank.
  --metrics FILE   the plugin's JSON-lines metrics (DPB_METRICS_FILE; one line per rank and log
                   period, running figures): the bubble, goodput and model error over steps.
  --replay FILE    a replay's JSON (dpbalance-replay --json): the bubble, goodput, TPOT p99 and
                   mean verify length of each run, and the table of runs. The replay writes
                   per-run figures, not steps, so it has no per-step plots.
Run it through scripts/dpbalance-report, which makes the venv with the pinned matplotlib
(scripts/requirements-report.txt). Exit status: 0 written; 2 a bad flag or an output that cannot
be written; 3 an input that is missing or malformed (the message names the file and the line;
--skip-bad-lines reads past malformed lines instead, e.g. a line cut by a killed process).
"""
from __future__ import annotations

import argparse
import glob
import html
import io
import json
import math
import os
import re
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]


class InputError(Exception):
    """A missing or malformed input, with the file and line."""


def read_jsonl(path: str, skip_bad: bool, warnings: list) -> list:
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    rows = []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"a JSON {type(row).__name__}, not an object")
            except ValueError as e:
                msg = f"{path}:{n}: not a JSON object ({e}): {line.strip()[:80]!r}"
                if not skip_bad:
                    raise InputError(msg + " (--skip-bad-lines reads past it)") from None
                warnings.append(msg)
                continue
            rows.append(row)
    return rows


def svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def number(row: dict, key: str, path: str, default=None):
    v = row.get(key, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise InputError(f"{path}: field {key!r} = {v!r} is not a finite number")
    return v


def rolling_bubble(steps: list, window: int) -> list:
    """1 - sum(mean) / sum(max) of the ranks' attention over each trailing window of steps."""
    out, s_mean, s_max, q = [], 0.0, 0.0, []
    for atts in steps:
        row = (sum(atts) / len(atts), max(atts))
        q.append(row)
        s_mean += row[0]
        s_max += row[1]
        if len(q) > window:
            old = q.pop(0)
            s_mean -= old[0]
            s_max -= old[1]
        out.append(1 - s_mean / s_max if s_max > 0 else 0.0)
    return out


# --- the step log ----------------------------------------------------------------------------

def step_log_sections(d: str, skip_bad: bool, warnings: list, window: int) -> list:
    engine_files = sorted(glob.glob(os.path.join(d, "engine_dp*.jsonl")),
                          key=lambda p: int(re.findall(r"(\d+)\.jsonl$", p)[0]))
    if not engine_files:
        raise InputError(f"{d}: no engine_dp*.jsonl (is it a DPBALANCE_VLLM_STEP_LOG directory?)")
    ranks = {}
    for p in engine_files:
        r = int(re.findall(r"(\d+)\.jsonl$", p)[0])
        rows = read_jsonl(p, skip_bad, warnings)
        steps = {}
        for row in rows:
            if "x" in row:
                steps[int(number(row, "x", p))] = row
        wpath = os.path.join(d, f"worker_dp{r}.jsonl")
        fwd = [row for row in read_jsonl(wpath, skip_bad, warnings) if "i" in row] \
            if os.path.exists(wpath) else []
        ranks[r] = {"steps": steps, "final": next((x["final"] for x in reversed(rows)
                                                   if "final" in x), None),
                    "stats": [x for x in rows if "stats" in x], "fwd": fwd, "path": p}
    rs = sorted(ranks)
    common = sorted(set.intersection(*(set(ranks[r]["steps"]) for r in rs)))
    sections = []

    # Summary table.
    head = ("rank", "steps", "balanced (dpbSuccess)", "at the fallback", "plans changed",
            "final record")
    body = []
    for r in rs:
        st = ranks[r]["steps"].values()
        fin = ranks[r]["final"]
        body.append((r, len(st), sum(1 for x in st if x.get("result") == "dpbSuccess"),
                     sum(1 for x in st if x.get("result") != "dpbSuccess"),
                     sum(1 for x in st if x.get("changed")),
                     "yes" if fin else "no (the rank was killed, or is still running)"))
    sections.append(("Step log: " + html.escape(d), table(head, body) + finals_table(ranks)))

    # 1. Per-rank step time over steps.
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for k, r in enumerate(rs):
        fwd = ranks[r]["fwd"]
        if fwd:
            xs = [number(f, "i", "worker row") for f in fwd]
            ys = [number(f, "fwd_us", "worker row", 0) / 1e3 for f in fwd]
            label = f"rank {r} (forward, worker_dp{r})"
        else:  # no worker log: the time between the rank's engine steps
            st = sorted(ranks[r]["steps"].items())
            xs = [x for x, _ in st[1:]]
            ys = [(b.get("t", 0) - a.get("t", 0)) * 1e3 for (_, a), (_, b) in zip(st, st[1:])]
            label = f"rank {r} (between engine steps)"
        ax.plot(xs, ys, lw=0.7, color=COLORS[k % len(COLORS)], label=label)
    ax.set_xlabel("step (forward index)")
    ax.set_ylabel("step time, ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Per-rank step time over steps")
    sections.append(("Per-rank step time", svg(fig)))

    # 2. The bubble over time: steps without prefill on any rank.
    dec = [x for x in common if all(not ranks[r]["steps"][x].get("extra") for r in rs)]
    atts = [[number(ranks[r]["steps"][x], "att_us", ranks[r]["path"], 0) for r in rs] for x in dec]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    if dec:
        ax.plot(dec, rolling_bubble(atts, window), lw=1.2, color="#333333",
                label=f"instance, trailing {window} steps")
        for k, r in enumerate(rs):
            share = []
            s_idle = s_max = 0.0
            q = []
            for a in atts:
                row = (max(a) - a[k], max(a))
                q.append(row)
                s_idle, s_max = s_idle + row[0], s_max + row[1]
                if len(q) > window:
                    o = q.pop(0)
                    s_idle, s_max = s_idle - o[0], s_max - o[1]
                share.append(s_idle / s_max if s_max > 0 else 0.0)
            ax.plot(dec, share, lw=0.7, color=COLORS[k % len(COLORS)],
                    label=f"rank {r}: its wait / slowest")
    ax.set_xlabel("engine step (exchange index)")
    ax.set_ylabel("bubble")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title(f"The bubble over time ({len(dec)} steps without prefill of {len(common)})")
    sections.append(("The bubble over time", svg(fig)))

    # 3. Predicted against measured attention.
    fig, axs = plt.subplots(1, 2, figsize=(11, 4))
    hi = 0.0
    for k, r in enumerate(rs):
        pts = [(number(x, "att_us", "", 0) / 1e3, number(x, "pred_us", "", 0) / 1e3)
               for x in ranks[r]["steps"].values() if x.get("pred_us") and not x.get("extra")]
        if pts:
            axs[0].scatter([p[0] for p in pts], [p[1] for p in pts], s=6, alpha=0.6,
                           color=COLORS[k % len(COLORS)], label=f"rank {r} ({len(pts)} steps)")
            hi = max(hi, max(max(p) for p in pts))
            st = sorted((x, v) for x, v in ranks[r]["steps"].items()
                        if v.get("pred_us") and not v.get("extra") and v.get("att_us"))
            axs[1].plot([x for x, _ in st],
                        [abs(v["pred_us"] - v["att_us"]) / v["att_us"] for _, v in st], lw=0.6,
                        color=COLORS[k % len(COLORS)], label=f"rank {r}")
    if hi > 0:
        axs[0].plot([0, hi], [0, hi], color="#999999", lw=0.8, ls="--", label="predicted = measured")
    axs[0].set_xlabel("measured attention, ms")
    axs[0].set_ylabel("predicted attention, ms")
    axs[0].legend(fontsize=8)
    axs[0].set_title("Predicted against measured (balanced decode steps)")
    axs[1].set_xlabel("engine step")
    axs[1].set_ylabel("|predicted - measured| / measured")
    axs[1].set_yscale("log")
    axs[1].set_title("The model's error over steps (online refit)")
    if axs[1].lines:
        axs[1].legend(fontsize=8)
    sections.append(("Predicted against measured attention", svg(fig)))

    # 4. Verify lengths per rank.
    fig, axs = plt.subplots(1, 2, figsize=(11, 3.6))
    for k, r in enumerate(rs):
        st = sorted((x, v) for x, v in ranks[r]["steps"].items() if v.get("lens"))
        axs[0].plot([x for x, _ in st], [sum(v["lens"]) / len(v["lens"]) for _, v in st], lw=0.7,
                    color=COLORS[k % len(COLORS)], label=f"rank {r}")
        lens = [n for _, v in st for n in v["lens"]]
        if lens:
            axs[1].hist(lens, bins=range(0, max(lens) + 2), alpha=0.5, align="left",
                        color=COLORS[k % len(COLORS)], label=f"rank {r} ({len(lens)} request-steps)")
    axs[0].set_xlabel("engine step")
    axs[0].set_ylabel("mean planned verify length")
    axs[0].set_title("Verify lengths per rank over steps")
    axs[1].set_xlabel("verify length (drafts)")
    axs[1].set_ylabel("request-steps")
    axs[1].set_title("Verify lengths per rank")
    for a in axs:
        if a.lines or a.patches:
            a.legend(fontsize=8)
    sections.append(("Verify lengths per rank", svg(fig)))
    return sections


def finals_table(ranks: dict) -> str:
    rows = []
    for r in sorted(ranks):
        f = ranks[r]["final"] or (ranks[r]["stats"][-1]["stats"] if ranks[r]["stats"] else None)
        if f:
            rows.append((r, "final" if ranks[r]["final"] else "last stats",
                         f.get("steps"), f.get("balanced_steps"), f.get("fallbacks"),
                         _fmt(f.get("bubble_fraction")), _fmt(f.get("predicted_error")),
                         _fmt(f.get("goodput_tok_per_s")), f.get("desyncs")))
    if not rows:
        return ""
    return "<p>The plugin's figures per rank:</p>" + table(
        ("rank", "record", "steps", "balanced", "fallbacks", "bubble (plugin)", "model error",
         "goodput tok/s", "desyncs"), rows)


# --- the plugin's metrics file -----------------------------------------------------------------

def metrics_sections(paths: list, skip_bad: bool, warnings: list) -> list:
    rows = []
    for p in paths:
        for row in read_jsonl(p, skip_bad, warnings):
            for k in ("rank", "step"):
                if not isinstance(row.get(k), int):
                    raise InputError(f"{p}: a row without an integer {k!r}: {json.dumps(row)[:80]}"
                                     f" (is it a DPB_METRICS_FILE?)")
            rows.append(row)
    if not rows:
        raise InputError(f"{', '.join(paths)}: no rows")
    fig, axs = plt.subplots(1, 3, figsize=(13, 3.6))
    for k, r in enumerate(sorted({x["rank"] for x in rows})):
        rr = sorted((x for x in rows if x["rank"] == r), key=lambda x: x["step"])
        xs = [x["step"] for x in rr]
        for a, key in zip(axs, ("bubble_fraction", "goodput_tok_per_s", "predicted_error")):
            a.plot(xs, [number(x, key, "metrics row", 0) for x in rr], lw=1,
                   color=COLORS[k % len(COLORS)], label=f"rank {r}")
    for a, t in zip(axs, ("bubble (running mean)", "goodput, tok/s (running)",
                          "model error (running mean)")):
        a.set_xlabel("step")
        a.set_title(t)
        a.legend(fontsize=8)
    return [("The plugin's metrics: " + html.escape(", ".join(paths)), svg(fig))]


# --- a replay's JSON ---------------------------------------------------------------------------

def replay_sections(path: str) -> list:
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        doc = json.load(open(path))
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e})") from None
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, list) or not runs:
        raise InputError(f"{path}: no 'runs' list (is it dpbalance-replay --json output?)")
    for i, r in enumerate(runs):
        if not isinstance(r, dict) or "name" not in r:
            raise InputError(f"{path}: runs[{i}] has no 'name'")
    names = [r["name"] for r in runs]
    fig, axs = plt.subplots(1, 4, figsize=(15, 0.32 * len(runs) + 1.5), sharey=True)
    for a, key, title in zip(axs, ("bubble_fraction", "goodput_tok_per_s", "tpot_p99_ms",
                                   "mean_verify_len"),
                             ("bubble", "goodput, tok/s", "TPOT p99, ms", "mean verify length")):
        vals = [number(r, key, f"{path}: run {r['name']}", 0) for r in runs]
        cols = ["#d95f02" if r.get("verify_mode") not in (None, "off") else "#7570b3"
                for r in runs]
        a.barh(range(len(runs)), vals, color=cols)
        a.set_title(title, fontsize=10)
        a.tick_params(labelsize=7)
    axs[0].set_yticks(range(len(runs)), names)
    axs[0].invert_yaxis()
    head = ("run", "routing", "verify", "k", "bubble", "goodput tok/s", "TPOT p50 / p99 ms",
            "mean verify len", "model error")
    body = [(r["name"], r.get("routing"), r.get("verify_mode"), r.get("k"),
             _fmt(r.get("bubble_fraction")), _fmt(r.get("goodput_tok_per_s"), 1),
             f"{_fmt(r.get('tpot_p50_ms'), 2)} / {_fmt(r.get('tpot_p99_ms'), 2)}",
             _fmt(r.get("mean_verify_len"), 2), _fmt(r.get("planner_model_error")))
            for r in runs]
    what = (f"trace {html.escape(str(doc.get('trace')))}, {doc.get('requests')} requests, "
            f"DP{doc.get('dp')}, truth {html.escape(str(doc.get('truth')))}")
    return [("Replay: " + html.escape(path),
             f"<p>{what}. Orange: planned verify lengths; purple: static.</p>" + svg(fig)
             + table(head, body))]


# --- the page ----------------------------------------------------------------------------------

def _fmt(v, digits: int = 4) -> str:
    return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def table(head, rows) -> str:
    h = "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                for row in rows)
    return f"<table><tr>{h}</tr>{b}</table>"


def page(sections: list, inputs: str, warnings: list) -> str:
    warn = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    body = "".join(f"<h2>{t}</h2>\n{c}\n" for t, c in sections)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dpbalance report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:1em auto;color:#222}}
table{{border-collapse:collapse;font-size:13px;margin:0.5em 0}}td,th{{border:1px solid #ccc;
padding:2px 6px;text-align:right}}th{{background:#f3f3f3}}h2{{margin-top:1.6em}}</style></head>
<body><h1>dpbalance report</h1>
<p>From {html.escape(inputs)}, made {time.strftime('%Y-%m-%d %H:%M:%S')} by
scripts/dpbalance-report. Definitions: docs/live_vllm.md (step log, bubble), docs/design.md.</p>
{('<p>Lines read past:</p><ul>' + warn + '</ul>') if warn else ''}
{body}</body></html>
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-log", default="", help="DPBALANCE_VLLM_STEP_LOG directory")
    p.add_argument("--metrics", action="append", default=[], help="DPB_METRICS_FILE (repeatable)")
    p.add_argument("--replay", default="", help="dpbalance-replay --json output")
    p.add_argument("--out", required=True, help="the HTML page to write")
    p.add_argument("--window", type=int, default=50, help="steps in the bubble's trailing window")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="read past malformed JSON lines (listed on the page) instead of failing")
    a = p.parse_args(argv)
    if not (a.step_log or a.metrics or a.replay):
        p.error("give --step-log, --metrics or --replay")
    if a.window < 1:
        p.error(f"--window {a.window} must be >= 1")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        print(f"dpbalance-report: --out '{a.out}': directory '{out_dir}' is not writable",
              file=sys.stderr)
        return 2
    warnings, sections = [], []
    try:
        if a.step_log:
            sections += step_log_sections(a.step_log, a.skip_bad_lines, warnings, a.window)
        if a.metrics:
            sections += metrics_sections(a.metrics, a.skip_bad_lines, warnings)
        if a.replay:
            sections += replay_sections(a.replay)
    except InputError as e:
        print(f"dpbalance-report: {e}", file=sys.stderr)
        return 3
    inputs = ", ".join(x for x in [a.step_log and f"step log {a.step_log}"]
                       + [f"metrics {m}" for m in a.metrics]
                       + [a.replay and f"replay {a.replay}"] if x)
    with open(a.out, "w") as f:
        f.write(page(sections, inputs, warnings))
    for w in warnings:
        print(f"dpbalance-report: read past {w}", file=sys.stderr)
    print(f"dpbalance-report: wrote {a.out} ({os.path.getsize(a.out)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
