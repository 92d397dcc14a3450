#!/usr/bin/env python3
"""docs/grafana_dpbalance.json queries only the series dpbalance_vllm/metrics.py exports.

The dashboard parses as JSON; it has the panels an operator asks for (bubble per rank, barrier
wait, goodput, fallbacks by reason, prediction error); every metric name in every query is one
of metrics.SERIES (a counter with its `_total`, a histogram with `_bucket`, `_sum` or `_count`),
and appears in the exporter's code; no query names any other metric. Needs no vLLM.
"""
import json
import os
import re
import sys
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DASHBOARD = os.path.join(ROOT, "docs", "grafana_dpbalance.json")
EXPORTER = os.path.join(ROOT, "integration", "vllm", "dpbalance_vllm", "metrics.py")
sys.path.insert(0, os.path.join(ROOT, "integration", "vllm"))

from dpbalance_vllm import metrics  # noqa: E402  (stdlib only at import)

# PromQL words the dashboard may use besides metric names.
PROMQL = {"rate", "irate", "increase", "sum", "avg", "min", "max", "count", "by", "without",
          "histogram_quantile", "clamp_min", "clamp_max", "le", "dp_rank", "reason", "inf"}


def queries(dash):
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


def metric_names(expr: str) -> set:
    e = re.sub(r"\[[^\]]*\]", "", expr)          # range selectors
    e = re.sub(r"\{[^}]*\}", "", e)               # label matchers
    e = re.sub(r'"[^"]*"', "", e)                 # strings
    e = re.sub(r"\b\d+(\.\d+)?([eE][-+]?\d+)?\b", "", e)  # numbers
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e) if w not in PROMQL}


def series_of(name: str, kinds: dict):
    """The series a sample name belongs to, or None."""
    for suffix, kind in (("_total", "counter"), ("_bucket", "histogram"), ("_sum", "histogram"),
                         ("_count", "histogram")):
        base = name[: -len(suffix)]
        if name.endswith(suffix) and kinds.get(base) == kind:
            return base
    return name if kinds.get(name) == "gauge" else None


class DashboardTest(unittest.TestCase):
    def setUp(self):
        with open(DASHBOARD) as f:
            self.dash = json.load(f)
        self.kinds = {n: k for n, k, _ in metrics.SERIES}
        with open(EXPORTER) as f:
            self.code = f.read()

    def test_every_query_uses_only_exported_series(self):
        used = set()
        for title, expr in queries(self.dash):
            names = metric_names(expr)
            self.assertTrue(names, f"{title}: no metric in {expr!r}")
            for name in names:
                base = series_of(name, self.kinds)
                self.assertIsNotNone(base, f"panel {title!r} queries {name!r}, which "
                                     f"metrics.py does not export")
                self.assertIn(f'"{base}"', self.code, f"{base} is not in the exporter's code")
                used.add(base)
        # Every series the exporter names is on the dashboard.
        self.assertEqual(used, set(self.kinds), sorted(set(self.kinds) - used))

    def test_the_operators_panels_are_there(self):
        titles = " | ".join(p["title"].lower() for p in self.dash["panels"])
        for want in ("bubble per rank", "barrier wait", "goodput", "fallbacks by reason",
                     "prediction error"):
            self.assertIn(want, titles)

    def test_the_checker_would_catch_a_foreign_metric(self):
        self.assertIsNone(series_of("vllm:num_requests_running", self.kinds))
        self.assertIsNone(series_of("dpbalance_steps", self.kinds))  # exposed as _total
        self.assertEqual(metric_names('sum by (le) (rate(dpbalance_exchange_seconds_bucket'
                                      '{dp_rank="0"}[5m]))'), {"dpbalance_exchange_seconds_bucket"})


if __name__ == "__main__":
    unittest.main(verbosity=2)
