"""dpbalance's Prometheus series, per DP rank, in vLLM's own `/metrics`.

Each engine-core process (one per DP rank) updates its rank's series once per engine step.
`vllm serve` serves them: with more than one API server (its default under
`--data-parallel-size N > 1`, `--api-server-count N`) vLLM runs prometheus_client in multiprocess
mode (vllm/v1/metrics/prometheus.py `setup_multiprocess_prometheus`, vLLM 0.32.0): it sets
PROMETHEUS_MULTIPROC_DIR before it starts the engine cores, every process writes its values into
that directory, and the API servers' `/metrics` merges them (`MultiProcessCollector`). With one
API server, set PROMETHEUS_MULTIPROC_DIR yourself (an empty directory; vLLM then uses it the same
way). Without a `vllm serve` front end (vLLM's Python API), DPBALANCE_VLLM_METRICS_PORT=P serves
rank r's series on port P + r (prometheus_client's own HTTP server in the engine core).

Series (label `dp_rank`; `reason` on fallbacks; no request ids):
  dpbalance_enabled                        gauge: 1 while this rank balances
  dpbalance_steps_total                    counter: engine steps this rank joined the exchange
  dpbalance_plans_changed_total            counter: steps in which the plan changed some
                                           request's verify length from the fallback length
  dpbalance_fallbacks_total{reason}        counter: steps run at the fallback length, by reason
  dpbalance_attention_seconds              histogram: measured attention time per step
  dpbalance_barrier_wait_seconds           histogram: per step, the slowest rank's attention
                                           minus this rank's (its wait at the MoE barrier)
  dpbalance_bubble_ratio                   gauge: over the last DPBALANCE_VLLM_BUBBLE_WINDOW
                                           steps, sum(slowest - this rank) / sum(slowest)
                                           attention; the mean over dp_rank is the instance's
                                           bubble, 1 - sum(mean) / sum(max) (docs/design.md)
  dpbalance_predicted_attention_error_ratio histogram: |predicted - measured| / measured
                                           attention, per balanced decode step
  dpbalance_verify_tokens_planned_total    counter: draft tokens sent to verification
  dpbalance_verify_tokens_accepted_total   counter: draft tokens accepted
  dpbalance_output_tokens_total            counter: tokens emitted by verified requests
                                           (accepted drafts plus one per request and step)
  dpbalance_exchange_seconds               histogram: time in the per-step exchange (the
                                           engine core's DP all-reduce carrying the plugin's
                                           record), waiting for the other ranks included
The barrier wait and the bubble are taken over steps in which no rank ran prompt tokens (an
`extend` step's prefill attention is planned by nobody), from each rank's attention time, which
every rank sends with its next step's exchange (engine_plan.py).

A metrics failure never stops the engine or balancing: a directory that cannot be written, a
port in use or a failing update is one error line, and the series of this rank are dropped.
"""
from __future__ import annotations

import collections
import logging
import os
from typing import Optional

log = logging.getLogger("vllm.dpbalance")

PREFIX = "dpbalance_"
# (name, type, help): every series this module exports; docs/grafana_dpbalance.json queries only
# these (tests/integration/vllm_serve_test.py checks it).
SERIES = (
    ("dpbalance_enabled", "gauge", "1 while dpbalance balances this DP rank's verify lengths, 0 "
     "when it runs the fallback length (refused settings, or the plugin disabled itself)"),
    ("dpbalance_steps", "counter", "Engine steps this DP rank joined dpbalance's exchange"),
    ("dpbalance_plans_changed", "counter", "Steps in which dpbalance's plan changed some "
     "request's verify length from the fallback length"),
    ("dpbalance_fallbacks", "counter", "Steps run at the fallback verify length, by reason"),
    ("dpbalance_attention_seconds", "histogram", "Measured attention time per engine step"),
    ("dpbalance_barrier_wait_seconds", "histogram", "Per step without prefill: the slowest DP "
     "rank's attention time minus this rank's (its wait at the MoE barrier)"),
    ("dpbalance_bubble_ratio", "gauge", "Over the last DPBALANCE_VLLM_BUBBLE_WINDOW steps "
     "without prefill: sum(slowest rank - this rank) / sum(slowest rank) attention time; the "
     "mean over dp_rank is the instance's bubble"),
    ("dpbalance_predicted_attention_error_ratio", "histogram", "|predicted - measured| / "
     "measured attention time, per balanced decode step"),
    ("dpbalance_verify_tokens_planned", "counter", "Draft tokens sent to verification"),
    ("dpbalance_verify_tokens_accepted", "counter", "Draft tokens accepted"),
    ("dpbalance_output_tokens", "counter", "Tokens emitted by verified requests (accepted drafts "
     "plus one per request and step)"),
    ("dpbalance_exchange_seconds", "histogram", "Time in the per-step exchange over the engine "
     "core's DP group, waiting for the other ranks included"),
)
# prometheus_client adds _total to a counter's name when it exposes it.
EXPOSED_NAMES = tuple(n + "_total" if t == "counter" else n for n, t, _ in SERIES)
# The fallback reasons (label `reason`), created at zero so every rank shows all of them.
REASONS = {
    "dpbFallback": "exchange_failed",      # one step: the exchange failed or timed out
    "dpbDisabled": "plugin_disabled",      # the plugin disabled itself (its log says why)
    "dpbInvalidArgument": "invalid_input",  # a request or step the plugin refused
    "dpbInternalError": "internal_error",
    "config": "config_refused",            # refused at start-up (config.py)
    "no_dp_group": "no_dp_group",          # no DP group on the engine core's stack
}
# Bucket bounds, seconds. Attention: 20 us (a GPU decode at small batch) to 2.5 s (a CPU prefill
# chunk); waits and exchanges from 5 us.
ATTENTION_BUCKETS = (20e-6, 50e-6, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                     0.1, 0.25, 0.5, 1.0, 2.5)
WAIT_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                5e-2, 0.1, 0.25, 1.0)
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

_FAMILIES = None  # this process's metric objects (prometheus_client allows one per name)


def _families(registry):
    global _FAMILIES
    if _FAMILIES is None:
        from prometheus_client import Counter, Gauge, Histogram
        h = dict(SERIES_HELP)
        lab = ["dp_rank"]
        _FAMILIES = {
            "enabled": Gauge("dpbalance_enabled", h["dpbalance_enabled"], lab, registry=registry,
                             multiprocess_mode="livemostrecent"),
            "steps": Counter("dpbalance_steps", h["dpbalance_steps"], lab, registry=registry),
            "changed": Counter("dpbalance_plans_changed", h["dpbalance_plans_changed"], lab,
                               registry=registry),
            "fallbacks": Counter("dpbalance_fallbacks", h["dpbalance_fallbacks"],
                                 lab + ["reason"], registry=registry),
            "attention": Histogram("dpbalance_attention_seconds",
                                   h["dpbalance_attention_seconds"], lab,
                                   buckets=ATTENTION_BUCKETS, registry=registry),
            "wait": Histogram("dpbalance_barrier_wait_seconds",
                              h["dpbalance_barrier_wait_seconds"], lab, buckets=WAIT_BUCKETS,
                              registry=registry),
            "bubble": Gauge("dpbalance_bubble_ratio", h["dpbalance_bubble_ratio"], lab,
                            registry=registry, multiprocess_mode="livemostrecent"),
            "error": Histogram("dpbalance_predicted_attention_error_ratio",
                               h["dpbalance_predicted_attention_error_ratio"], lab,
                               buckets=ERROR_BUCKETS, registry=registry),
            "planned": Counter("dpbalance_verify_tokens_planned",
                               h["dpbalance_verify_tokens_planned"], lab, registry=registry),
            "accepted": Counter("dpbalance_verify_tokens_accepted",
                                h["dpbalance_verify_tokens_accepted"], lab, registry=registry),
            "output": Counter("dpbalance_output_tokens", h["dpbalance_output_tokens"], lab,
                              registry=registry),
            "exchange": Histogram("dpbalance_exchange_seconds", h["dpbalance_exchange_seconds"],
                                  lab, buckets=WAIT_BUCKETS, registry=registry),
        }
    return _FAMILIES


SERIES_HELP = tuple((n, h) for n, _, h in SERIES)


class BubbleWindow:
    """This rank's share of the barrier over the last `steps` steps: sum(max - own) / sum(max)
    of the ranks' attention times (the mean over ranks is 1 - sum(mean) / sum(max))."""

    def __init__(self, steps: int):
        self._rows = collections.deque(maxlen=max(1, int(steps)))
        self._idle = 0.0
        self._max = 0.0

    def add(self, slowest_us: float, own_us: float) -> float:
        if len(self._rows) == self._rows.maxlen:
            i, m = self._rows[0]
            self._idle -= i
            self._max -= m
        row = (max(0.0, slowest_us - own_us), max(0.0, slowest_us))
        self._rows.append(row)
        self._idle += row[0]
        self._max += row[1]
        return self.ratio()

    @property
    def steps(self) -> int:
        return self._rows.maxlen

    def ratio(self) -> float:
        return self._idle / self._max if self._max > 1e-9 else 0.0


class RankMetrics:
    """One DP rank's series. Create with `RankMetrics.create` (None when they cannot be
    exported, with one line saying why); every update swallows its own failure (one line,
    then the series stop)."""

    def __init__(self, dp_rank: int, families: dict, registry, served: str):
        self.dp_rank = dp_rank
        self.served = served          # where the series go, for the start-up line
        self._registry = registry
        r = str(dp_rank)
        f = families
        self._enabled = f["enabled"].labels(r)
        self._steps = f["steps"].labels(r)
        self._changed = f["changed"].labels(r)
        self._fallbacks = {reason: f["fallbacks"].labels(r, reason)
                           for reason in REASONS.values()}
        self._attention = f["attention"].labels(r)
        self._wait = f["wait"].labels(r)
        self._bubble = f["bubble"].labels(r)
        self._error = f["error"].labels(r)
        self._planned = f["planned"].labels(r)
        self._accepted = f["accepted"].labels(r)
        self._output = f["output"].labels(r)
        self._exchange = f["exchange"].labels(r)
        self._broken = False

    @classmethod
    def create(cls, dp_rank: int, port: int = 0) -> Optional["RankMetrics"]:
        """The rank's series, exported through vLLM's multiprocess directory and/or a port of
        its own (port + dp_rank); None, with one log line, when neither is possible."""
        mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
        if not mp_dir and not port:
            log.info("dpbalance: DP rank %d: Prometheus series not exported: "
                     "PROMETHEUS_MULTIPROC_DIR is unset in the engine core (vllm serve sets it "
                     "with more than one API server; with one, set it yourself) and "
                     "DPBALANCE_VLLM_METRICS_PORT is unset", dp_rank)
            return None
        try:
            from prometheus_client import CollectorRegistry, values
        except ImportError as e:
            log.error("dpbalance: DP rank %d: Prometheus series not exported: %s", dp_rank, e)
            return None
        where = []
        try:
            if mp_dir:
                try:  # a file made and removed: what prometheus_client will do, as this user
                    import tempfile
                    with tempfile.NamedTemporaryFile(dir=mp_dir, prefix=".dpbalance-probe-"):
                        pass
                except OSError as e:
                    raise PermissionError(f"PROMETHEUS_MULTIPROC_DIR '{mp_dir}' is not a "
                                          f"writable directory ({e.strerror})") from None
                # prometheus_client picks multiprocess values when it is first imported; a
                # process that imported it before PROMETHEUS_MULTIPROC_DIR was set (a fork of
                # one) would keep its values in memory, where /metrics never sees them.
                if not getattr(values.ValueClass, "_multiprocess", False):
                    values.ValueClass = values.MultiProcessValue()
                where.append(f"vLLM's /metrics (multiprocess directory {mp_dir})")
            registry = CollectorRegistry(auto_describe=True)
            m = cls(dp_rank, _families(registry), registry, "")
            m._steps.inc(0)  # opens this process's files now, so a failure shows at start-up
        except Exception as e:  # noqa: BLE001 - whatever it is, the engine goes on
            log.error("dpbalance: DP rank %d: Prometheus series not exported: %s: %s; "
                      "balancing is not affected", dp_rank, type(e).__name__, e)
            return None
        if port:
            try:
                from prometheus_client import start_http_server
                start_http_server(port + dp_rank, registry=registry)
                where.append(f"port {port + dp_rank} (DPBALANCE_VLLM_METRICS_PORT={port} + DP "
                             f"rank {dp_rank})")
            except Exception as e:  # noqa: BLE001 - a port in use, no permission, ...
                log.error("dpbalance: DP rank %d: cannot serve Prometheus series on port %d "
                          "(DPBALANCE_VLLM_METRICS_PORT=%d + DP rank %d): %s; balancing is not "
                          "affected", dp_rank, port + dp_rank, port, dp_rank, e)
                if not mp_dir:
                    return None
        m.served = " and ".join(where)
        return m

    def _guard(self, fn, *args) -> None:
        if self._broken:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a full disk, a removed directory, ...
            self._broken = True
            log.error("dpbalance: DP rank %d: Prometheus update failed (%s: %s); this rank's "
                      "series stop here, balancing is not affected", self.dp_rank,
                      type(e).__name__, e)

    def set_enabled(self, on: bool) -> None:
        self._guard(self._enabled.set, 1.0 if on else 0.0)

    def step(self, *, fallback: Optional[str], changed: bool, planned: int, accepted: int,
             output_tokens: int, attention_s: Optional[float], exchange_s: Optional[float],
             error_ratio: Optional[float]) -> None:
        """One engine step of this rank. `fallback`: a key of REASONS, or None."""
        def update():
            self._steps.inc()
            if fallback is not None:
                self._fallbacks[REASONS.get(fallback, "internal_error")].inc()
            if changed:
                self._changed.inc()
            if planned:
                self._planned.inc(planned)
            if accepted:
                self._accepted.inc(accepted)
            if output_tokens:
                self._output.inc(output_tokens)
            if attention_s is not None:
                self._attention.observe(attention_s)
            if exchange_s is not None:
                self._exchange.observe(exchange_s)
            if error_ratio is not None:
                self._error.observe(error_ratio)
        self._guard(update)

    def barrier(self, wait_s: float, bubble_ratio: float) -> None:
        def update():
            self._wait.observe(wait_s)
            self._bubble.set(bubble_ratio)
        self._guard(update)

    def close(self) -> None:
        """This process leaves: its live gauges (enabled, bubble) leave /metrics with it."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not self._broken:
            try:
                from prometheus_client import multiprocess
                multiprocess.mark_process_dead(os.getpid())
            except Exception as e:  # noqa: BLE001
                log.warning("dpbalance: DP rank %d: cannot retire this process's Prometheus "
                            "gauges: %s", self.dp_rank, e)
        self._broken = True
