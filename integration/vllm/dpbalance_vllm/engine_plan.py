"""The one place where vLLM's engine core meets dpbalance's plugin ABI (v2, Python adapter).

Everything that depends on the ABI lives here: the exchange over vLLM's DP group and the
plan/report calls, with vLLM's own string request ids (dpbalance_plugin_v2.h takes them as they
are) and the step's kind (`decode`; `extend` when prompt tokens run beside the decodes, whose
attention the plugin then does not learn from; `idle` on a rank without work). The
scheduler (scheduler.py) and the executor (executor.py) call only `EnginePlan.exchange`,
`EnginePlan.join_idle` and `EnginePlan.after_step`.

One `EnginePlan` per engine-core process (one per DP rank), created by the scheduler. It does
nothing unless DPB_PLUGIN names the library (`dpbalance`, a file or a path). Every step of a
running DP wave each rank calls `exchange` exactly once: from `schedule()` on a rank with
requests, from the executor's dummy batch on an idle rank (vLLM's `EngineCore.step()` returns
before the scheduler there). The exchange is an all-reduce over the engine core's own DP group
(`DPEngineCoreProc.dp_group`, gloo, the group `_has_global_unfinished_reqs` syncs on), each rank
filling its row, carried through the adapter's `Piggyback` so that it runs every step even when
the plugin has disabled itself on some rank (a zero record: every rank then falls back). The
one exception is the plugin's quiet mode (DPB_QUIET_AFTER, which config.py sets to 8): while
every decision keeps vLLM's own draft lengths the plugin agrees, in the exchange, on spans of
steps that skip it, and since the collective is the plugin's alone the all-reduce is skipped on
those steps too, on every rank (`exchanges` counts the steps that ran it, `steps` all of them).

Start-up (config.py): the scheduler creates the EnginePlan while vLLM builds the engine core,
before the engine reports ready, and every setting is checked there. A refused setting is one
error line; with DPB_STRICT=1 the constructor raises (vLLM does not start), else the rank runs
vLLM's own draft lengths and still joins the exchange (zero records), so a rank whose settings
differ from its peers' never leaves them waiting.

Fallback: any step the plugin does not balance runs the engine's default verify length,
`default_k`: vLLM's num_speculative_tokens (its drafts as they are), or DPB_DEFAULT_K when set.

Reports one step late (vLLM's `AsyncScheduler`, which schedules step t+1 before step t's
output is processed): `exchange` returns the plan and `last_token` names it; `after_step(...,
token=)` reports that plan (the plugin pairs it by plan id and counts its verify lengths as
pending while later steps are planned, lag.h). Up to two plans may be outstanding; a report
without a token is the latest plan's (the synchronous scheduler, the dummy batch).

What a rank reports (beside the plugin's own log): the per-rank `final` record of the step log,
written before vLLM tears the engine core down (the executor's shutdown, the first step of
`EngineCore.shutdown`) and, every DPBALANCE_VLLM_STATS_EVERY_S seconds, a `stats` record with
the same fields, so a rank that is killed loses at most one interval; and its Prometheus series
(metrics.py).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import sys
import time
from typing import Optional, Sequence

log = logging.getLogger("vllm.dpbalance")

try:  # the installed package bundles the adapter next to this file
    from . import dpbalance_plugin as adapter  # type: ignore
except ImportError:  # the source tree: integration/adapters/python
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(_here, "..", "..", "adapters", "python"))
    import dpbalance_plugin as adapter  # type: ignore  # noqa: E402

from . import audit as _audit  # noqa: E402
from . import config as _config  # noqa: E402
from . import metrics as _metrics  # noqa: E402

# What each rank adds to the exchange besides the plugin's record: its exchange index (the ranks
# must agree, else the exchange is out of step), its number of planned requests and its tokens,
# and for the metrics its previous step's measured attention time (us; < 0: unknown) and whether
# that step ran prompt tokens (1) or not (0).
_PAYLOAD = struct.Struct("<qiidi")
# One rank's bytes on vLLM's DP sync (dp_ride.py): the payload, then the plugin's record.
CARRY_BYTES = _PAYLOAD.size + adapter.RECORD_BYTES
MISSING_WARN = 16  # riding: steps without records before a rank says so (once)


def library_path() -> Optional[str]:
    """The library to load for DPB_PLUGIN, or None when it is unset or `none`.

    `dpbalance` (the name) means the copy bundled with this package, when there is one."""
    name = os.environ.get("DPB_PLUGIN", "")
    if not name or name == "none":
        return None
    if name in ("dpbalance", "libdpbalance.so"):
        bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libdpbalance.so")
        if os.path.exists(bundled):
            return bundled
    return adapter.resolve_library(name)


def _find_dp_group():
    """vLLM's engine-core DP group (DPEngineCoreProc.dp_group) from the calling frames.

    The exchange first runs inside the engine core's busy loop (schedule() or the dummy batch
    are called from it), so the DPEngineCoreProc is on the stack. Read, never modified."""
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if obj is not None and hasattr(obj, "dp_group") and hasattr(obj, "dp_rank") \
                and hasattr(obj, "scheduler"):
            return obj.dp_group
        f = f.f_back
    return None


class EnginePlan:
    """One DP rank's dpbalance state inside vLLM's engine-core process."""

    def __init__(self, vllm_config, k_spec: int, method: str = "", check=None, lag: int = 1):
        pc = vllm_config.parallel_config
        self.dp_size = int(pc.data_parallel_size)
        self.dp_rank = int(pc.data_parallel_rank)
        self.k_spec = int(k_spec)          # vLLM's num_speculative_tokens (the draft limit)
        self.cfg = _config.EngineConfig.resolve(self.dp_size, self.dp_rank, self.k_spec,
                                                method, library_path(), check=check)
        self.lib = self.cfg.library
        self.enabled = self.cfg.enabled    # joins the exchange every step
        # The exchange rides vLLM's own DP sync (dp_ride.py): each plan reads the records the
        # sync of `lag` steps before gathered (1: vLLM's synchronous scheduler, 2: its async
        # one, which schedules step s before it processes step s - 1's output). Else the
        # plugin's own all-reduce on the engine core's DP group, every step.
        self.ride = self.cfg.exchange == "ride" and self.dp_size > 1
        self.lag = int(lag)
        self._carry = None                 # this step's bytes for vLLM's next sync
        # Records are labelled by the sync they ride: `sent` counts the syncs this rank has
        # handed a carry slot to (take_carry, once per vLLM sync, the same count on every rank
        # at the same step). A plan whose step vLLM never ran (schedule() planned, nothing was
        # scheduled, no dummy batch followed) hands nothing on and leaves no gap.
        self.sent = 0
        self._gathered = {}                # record label -> every rank's carry from vLLM's sync
        self._in_step = False
        self.own_collectives = 0           # collectives this package ran itself (ride: init's)
        self.carried = 0                   # plans whose records came from vLLM's sync
        self.missing = 0                   # plans whose step's records had not arrived
        self.worker_ride = {}              # the worker's syncs and carries (dp_ride.counts)
        self.default_k = self.cfg.default_k  # the fallback verify length
        self.dpb = None
        self.pb = None
        self._group = None
        self.steps = 0                     # plans made (= engine steps while running)
        self.exchanges = 0                 # of them, steps that ran the exchange (not quiet)
        self.exchanged_this_step = False
        self.fallbacks = {}                # plugin result name -> steps
        self.desyncs = 0                   # steps whose exchange indices differed across ranks
        self.stale_steps = 0               # see begin_step
        self.disabled_reason = self.cfg.error
        # DPB_AB_EPOCH is the plugin's flag (checked above); the step log marks the arms with it.
        self.ab_epoch = int(os.environ.get("DPB_AB_EPOCH") or 0) if self.cfg.usable else 0
        # DPBALANCE_VLLM_BYPASS_EPOCH=E (a measurement, config.py): steps E..2E-1, 3E..4E-1, ...
        # run as vLLM as shipped at the fallback length (`_bypass`), the others as usual.
        self.bypass_epoch = self.cfg.bypass_epoch if self.cfg.usable else 0
        self.bypassed = 0                  # steps run bypassed
        # Plans not yet reported, oldest first: token -> (requests, lens, result, extra, plan_id,
        # time of its exchange). At most two (the async scheduler's lag).
        self._outstanding = {}
        self.last_token = None             # the latest exchange's token (its index)
        self.last_plan = None
        self.last_step = None              # the plugin's dpbStepInfo of the latest report
        self._t_step = None
        self._exchange_s = None            # this step's time in the collective
        self._prev = (-1.0, 0)             # this rank's previous step: (attention us, prefill)
        self._plan_s = None                # the latest plan call (Piggyback.step), seconds
        self._window = _metrics.BubbleWindow(self.cfg.bubble_window)
        self._closed = False
        self._balancing = self.cfg.usable  # what dpbalance_enabled says
        self._log = None
        self.metrics = None
        if not self.enabled:
            return
        if self.cfg.error:
            log.error(self.cfg.refused_line())
            if self.cfg.strict:
                raise RuntimeError(self.cfg.refused_line())
        if self.cfg.step_log:
            self._log = open(os.path.join(self.cfg.step_log, f"engine_dp{self.dp_rank}.jsonl"),
                             "a", buffering=1)
        self._t_stats = time.monotonic()
        self._writing = False
        self._chain_signals()
        self.metrics = _metrics.RankMetrics.create(self.dp_rank, self.cfg.metrics_port)
        if self.metrics is not None:
            self.metrics.set_enabled(self.cfg.usable)
        if self.cfg.usable:
            log.warning("%s; Prometheus %s", self.cfg.startup_line(),
                        self.metrics.served if self.metrics is not None else "off")

    # --- the exchange ---------------------------------------------------------------------
    _find_group = staticmethod(_find_dp_group)  # a test replaces it and _collective

    def _collective(self, send: bytes) -> bytes:
        """All-gather of equal-size byte strings over the engine core's DP group: a
        (dp_size, n) uint8 all-reduce in which each rank fills its own row."""
        if self.dp_size == 1:
            return bytes(send)
        import torch
        import torch.distributed as dist
        n = len(send)
        t = torch.zeros(self.dp_size, n, dtype=torch.uint8)
        t[self.dp_rank] = torch.frombuffer(bytearray(send), dtype=torch.uint8)
        dist.all_reduce(t, group=self._group)
        return t.numpy().tobytes()

    def _exchange_bytes(self, send: bytes) -> bytes:
        if self.ride and self._in_step:
            return self._ride(send)
        t0 = time.perf_counter()
        self.own_collectives += 1
        try:
            return self._collective(send)
        finally:
            self._exchange_s = time.perf_counter() - t0

    # --- riding vLLM's DP sync (dp_ride.py) ---------------------------------------------
    def _ride(self, send: bytes) -> bytes:
        """The plan's exchange when riding: `send` waits for vLLM's next sync (`take_carry`);
        the records returned are those vLLM's sync gathered `lag` steps ago, the same bytes on
        every rank. None yet (the first steps, a step vLLM dropped): rows with no record, which
        every rank's plugin reads as "nobody planned" (default lengths)."""
        t0 = time.perf_counter()
        self._carry = bytes(send)
        want = self.sent - self.lag
        got = self._gathered.get(want)  # kept: a plan vLLM never runs is followed by one that
        for old in [k for k in self._gathered if k < want]:  # reads the same records
            del self._gathered[old]
        if got is None:
            if want >= 0 and not self._bypassing(want):  # a bypassed step carried nothing
                self.missing += 1
                if self.missing == MISSING_WARN and not self.carried:
                    log.error("dpbalance: DP rank %d: vLLM's DP sync carried no record in %d "
                              "steps (a model runner whose sync dp_ride.py does not extend?): "
                              "every step runs vLLM's own lengths; %s=own exchanges on the "
                              "plugin's own collective instead", self.dp_rank, self.missing,
                              "DPBALANCE_VLLM_EXCHANGE")
            empty = _PAYLOAD.pack(-1, 0, 0, -1.0, 0) + bytes(len(send) - _PAYLOAD.size)
            got = empty * self.dp_size
        else:
            self.carried += 1
        self._exchange_s = time.perf_counter() - t0  # the exchange's own cost: no collective
        return got

    def take_carry(self) -> Optional[bytes]:
        """This step's bytes for vLLM's sync (the worker arms them), once; called once per
        sync (None: this rank carries nothing, the sync runs anyway)."""
        c, self._carry = self._carry, None
        self.sent += 1
        return c

    def received(self, gathered: Optional[bytes]) -> None:
        """What vLLM's sync gathered (the worker's `dpb_gathered`): every rank's carry, rank
        order, each padded to int32. Kept by the label in the payloads (`_label`)."""
        if not self.ride or not gathered:
            return
        width = len(gathered) // self.dp_size
        if width < CARRY_BYTES or width * self.dp_size != len(gathered):
            log.error("dpbalance: DP rank %d: vLLM's sync returned %d bytes for %d ranks",
                      self.dp_rank, len(gathered), self.dp_size)
            return
        rows = [gathered[i * width:i * width + CARRY_BYTES] for i in range(self.dp_size)]
        index = max(_PAYLOAD.unpack_from(r)[0] for r in rows)
        if index < 0:
            return  # no rank carried a record (every plugin off)
        self._gathered[index] = b"".join(rows)
        while len(self._gathered) > 4:
            del self._gathered[min(self._gathered)]

    def _ensure_loaded(self) -> bool:
        if self.pb is not None:
            return True
        if self.dp_size > 1:
            self._group = self._find_group()
            if self._group is None:
                # Cannot happen inside DPEngineCoreProc; outside it (an offline engine with DP>1
                # and no engine-core DP group) there is nothing to exchange over. Every rank hits
                # this on its first step, so none waits for another.
                self.enabled = False
                self.disabled_reason = "no DP group found on the engine core's stack"
                log.error("dpbalance: DP rank %d: %s; balancing is OFF, fallback %s",
                          self.dp_rank, self.disabled_reason, self.cfg.fallback_text())
                if self.metrics is not None:
                    self.metrics.set_enabled(False)
                    self.metrics.step(fallback="no_dp_group", changed=False, planned=0,
                                      accepted=0, output_tokens=0, attention_s=None,
                                      exchange_s=None, error_ratio=None)
                return False
        # Riding vLLM's sync, a step's exchange is the mailbox (`_ride`); init's handshake, once,
        # runs on the engine core's DP group. Else the collective is the plugin's alone: on its
        # quiet steps (DPB_QUIET_AFTER) it is skipped on every rank.
        self.pb = adapter.Piggyback(self._exchange_bytes, self.dp_size,
                                    own_collective=not self.ride)
        if self.cfg.error:
            # Refused at start-up: no plugin here, but the peers' init runs a handshake through
            # this collective on their first step; join it with a zero record (which their
            # plugin refuses, so they fall back too) and then every step with zero records.
            self.pb(bytes(self.pb.record_bytes), 0)
            return True
        # init's handshake runs through the same collective, on every rank's first step.
        try:
            self.dpb = adapter.DpBalance.load(self.dp_size, self.dp_rank, self.cfg.plugin_config,
                                              allgather=self.pb, library=self.lib, abi=2)
        except adapter.DpBalanceError as e:
            # Checked at start-up, so only what the check cannot see (the handshake with the
            # peers) lands here. Never a reason to stop vLLM: every rank goes on at the
            # fallback length and still joins the exchange each step (zero records).
            self.dpb = None
            self.disabled_reason = str(e)
            log.error("dpbalance: DP rank %d: %s; balancing is OFF, fallback %s", self.dp_rank,
                      e, self.cfg.fallback_text())
            if self.metrics is not None:
                self.metrics.set_enabled(False)
        return True

    def exchange(self, requests: Sequence[tuple], extra_tokens: int = 0) -> Optional[list]:
        """Plans this rank's decode requests [(req_id: str, ctx_tokens, k_cap), ...] with every
        other rank; returns their verify lengths (None when the plugin is off). Joins the
        exchange exactly once per engine step, also with no requests. `extra_tokens`: prompt
        tokens the step runs beside them (an `extend` step: the plugin charges them to the
        instance's tokens and does not learn its cost model from the step's attention time)."""
        if not self.enabled:
            return None
        if self.exchanged_this_step:  # schedule() already joined this step
            return None
        self._t_step = time.perf_counter()
        if not self._ensure_loaded():
            return None
        if self._bypassing(self._label()):
            return self._bypass(requests, extra_tokens)
        reqs = [adapter.Request(str(r[0]), int(r[1]), 0,
                                max(0, min(int(r[2]), _config.PLUGIN_K_LIMIT)))
                for r in requests]
        extra = max(0, int(extra_tokens))
        payload = _PAYLOAD.pack(self._label() if self.ride else self.exchanges, len(reqs),
                                sum(1 + q.k_cap for q in reqs) + extra, self._prev[0], self._prev[1])
        kind = "extend" if extra > 0 else ("decode" if reqs else "idle")
        self._exchange_s = None
        t_plan = time.perf_counter()
        self._in_step = True
        try:
            res = self.pb.step(self.dpb, reqs, payload, kind=kind, extra_tokens=extra)
        finally:
            self._in_step = False
        self._plan_s = time.perf_counter() - t_plan  # the plugin's plan call, exchange included
        self.last_plan = res.plan  # the ABI v2 PlanResult (every rank's tokens and flags), or None
        self.exchanged_this_step = True
        if res.payloads is not None:  # None: a quiet step, no exchange on any rank
            rows = [_PAYLOAD.unpack(p) for p in res.payloads]
            idx = {row[0] for row in rows}
            if self.ride and idx == {-1}:
                pass  # the step's records had not arrived (counted as missing)
            elif len(idx) != 1:
                self.desyncs += 1
                log.error("dpbalance: DP rank %d exchange %d met indices %s", self.dp_rank,
                          self.exchanges, sorted(idx))
            else:
                self._previous_barrier(rows)
            self.exchanges += 1
        self.steps += 1
        if self.dpb is not None:
            result = adapter.RESULT_NAMES.get(self.dpb.last_result, str(self.dpb.last_result))
        else:
            result = "config" if self.cfg.error else "dpbDisabled"
        if result == "dpbSuccess" and res.verify_len is not None:
            lens = list(res.verify_len)   # balanced, or the defaults of an A/B off epoch
        else:
            self.fallbacks[result] = self.fallbacks.get(result, 0) + 1
            lens = self._defaults(requests)  # the engine's default
        plan_id = getattr(res.plan, "plan_id", None) if res.plan is not None else None
        self._remember(requests, lens, result, extra, plan_id)
        return lens

    def _defaults(self, requests: Sequence[tuple]) -> list:
        """The fallback verify length of each request [(id, context, cap), ...]."""
        return [min(self.default_k, int(r[2])) for r in requests]

    def _remember(self, requests, lens, result: str, extra: int, plan_id) -> None:
        """This step's plan (the latest, `last_token`) until after_step reports it."""
        self.last_token = self.steps - 1
        self._outstanding[self.last_token] = (requests, lens, result, extra, plan_id, self._t_step)
        while len(self._outstanding) > 2:  # a plan never reported (a step the engine dropped)
            del self._outstanding[next(iter(self._outstanding))]

    def _label(self) -> int:
        """The step's index common to every rank: riding, the sync its record will ride
        (`sent`); else the plans made (each ran the plugin's own collective)."""
        return self.sent if self.ride else self.steps

    def _bypassing(self, step: int) -> bool:
        """Step `step` (`_label`) falls in an off epoch of DPBALANCE_VLLM_BYPASS_EPOCH."""
        return self.bypass_epoch > 0 and (step // self.bypass_epoch) % 2 == 1

    def _bypass(self, requests: Sequence[tuple], extra_tokens: int) -> list:
        """A step of a bypass epoch: vLLM as shipped at the fallback length, the plugin not
        called (no plan, no exchange, no report; riding, this rank's rows of vLLM's sync carry
        zeros, as they do for a rank without a record). Every rank bypasses the same steps: the
        step index (`_label`) is the one the ride's records are matched by, equal on every rank. The
        step log marks it (`result` "bypass"), so the harness pairs each balanced epoch with
        the bypassed one after it (live_bench.py `bypass_summary`): the plugin's whole cost
        per step, measured inside one instance."""
        lens = self._defaults(requests)
        self._carry = None
        self._plan_s = self._exchange_s = None
        self.last_plan = None
        self.exchanged_this_step = True
        self.steps += 1
        self.bypassed += 1
        self._remember(requests, lens, "bypass", max(0, int(extra_tokens)), None)
        return lens

    def _previous_barrier(self, rows) -> None:
        """The previous step's wait at the barrier, from every rank's attention time in this
        exchange: into the bubble window and the metrics, for steps without prompt tokens."""
        atts = [row[3] for row in rows]
        if self._prev[0] < 0 or min(atts) < 0 or any(row[4] for row in rows):
            return
        slowest = max(atts)
        ratio = self._window.add(slowest, self._prev[0])
        if self.metrics is not None:
            self.metrics.barrier((slowest - self._prev[0]) / 1e6, ratio)

    def begin_step(self) -> None:
        """schedule() starts a new engine step: a flag left set by an earlier step (one whose
        schedule() joined, scheduled nothing, and saw no dummy batch) must not make this step
        skip its exchange. Counted as `stale_steps`."""
        if self.exchanged_this_step:
            self.stale_steps += 1
            self.exchanged_this_step = False

    def join_idle(self) -> None:
        """An idle rank's step (vLLM runs a dummy batch): join the exchange with no requests,
        unless this step's schedule() already did (it scheduled nothing)."""
        if self.enabled and not self.exchanged_this_step:
            self.exchange([])

    def after_step(self, attention_us: Optional[float], step_us: Optional[float],
                   accepted: Sequence[tuple], scheduled_tokens: int, token: Optional[int] = None,
                   worker: Optional[dict] = None) -> None:
        """After the forward: report measured attention time and the accepted drafts
        [(req_id, verify_len, accepted, finished), ...] of plan `token` (`last_token` when the
        plan was made; None: this engine step's plan, as the synchronous scheduler and the
        dummy batch report); log the step."""
        if not self.enabled:
            return
        if token is None:  # the latest plan, unless this engine step's report is in already
            if not self.exchanged_this_step:
                return
            token = self.last_token
        entry = self._outstanding.pop(token, None)
        if entry is None:  # reported already, or dropped
            return
        if token == self.last_token:  # the latest plan: this engine step is done
            self.exchanged_this_step = False
        requests, lens, result, extra, plan_id, t_step = entry
        if worker:
            self.worker_ride = worker
        if step_us is None and t_step is not None:
            step_us = (time.perf_counter() - t_step) * 1e6
        att = float(attention_us) if attention_us is not None else 0.0
        info = None
        bypassed = result == "bypass"
        if self.dpb is not None and not bypassed:
            acc = [adapter.Accepted(str(a[0]), int(a[1]), int(a[2]), bool(a[3]))
                   for a in accepted]
            self.dpb.report(att, float(step_us or 0.0), acc, plan_id=plan_id)
            info = self.dpb.last_step()
        self.last_step = info
        # The model's error on this step: balanced (a prediction) and no prefill beside it.
        pred = info["predicted_attention_us"] if info else -1.0
        err = abs(pred - att) / att if pred > 0 and att > 0 and not info["extend"] else None
        self._prev = (att if attention_us is not None else -1.0, 1 if extra > 0 else 0)
        defaults = self._defaults(requests)
        changed = any(a != b for a, b in zip(lens, defaults))
        n_acc = sum(int(a[2]) for a in accepted)
        n_verified = sum(int(a[1]) for a in accepted)
        if self.metrics is not None and not bypassed:
            self.metrics.step(fallback=None if result == "dpbSuccess" else result,
                              changed=changed, planned=n_verified, accepted=n_acc,
                              output_tokens=n_acc + len(accepted),
                              attention_s=att / 1e6 if attention_us is not None else None,
                              exchange_s=self._exchange_s, error_ratio=err)
            balancing = result == "dpbSuccess" or result == "dpbFallback"
            if balancing != self._balancing:  # the plugin disabled itself (or came back)
                self._balancing = balancing
                self.metrics.set_enabled(balancing)
        if self._log is not None:
            self._writing = True
            arm_on = not bypassed and (self.ab_epoch <= 0 or (token // self.ab_epoch) % 2 == 0)
            self._log.write(json.dumps({
                "x": token, "n": len(requests), "result": result, "arm_on": arm_on,
                "extra": extra,
                "lens": lens, "defaults": defaults, "ctx": [int(r[1]) for r in requests],
                "changed": changed, "accepted": n_acc, "drafted": n_verified,
                "tokens": scheduled_tokens, "att_us": att,
                "pred_us": round(pred, 1) if pred > 0 else None,
                "xchg_us": round(self._exchange_s * 1e6, 1) if self._exchange_s else None,
                "plan_us": round(self._plan_s * 1e6, 1) if self._plan_s else None,
                "t": round(time.time(), 4), "desyncs": self.desyncs}) + "\n")
            self._writing = False
        now = time.monotonic()
        if now - self._t_stats >= self.cfg.stats_every_s:
            self._t_stats = now
            self._write_stats("stats")

    def stats(self) -> dict:
        s = self.dpb.stats() if self.dpb is not None else {}
        s.update({"dp_rank": self.dp_rank, "steps": self.steps, "exchanges": self.exchanges,
                  "exchange": "ride" if self.ride else "own", "lag": self.lag if self.ride else 0,
                  "own_collectives": self.own_collectives, "carried": self.carried,
                  "bypass_epoch": self.bypass_epoch, "bypassed": self.bypassed,
                  "missing": self.missing, "worker_ride": dict(self.worker_ride),
                  # riding: plans whose step vLLM never ran, so no sync carried their record
                  "unsent": max(0, self.steps - self.sent) if self.ride else 0,
                  "quiet_steps": self.pb.quiet_steps if self.pb is not None else 0,
                  "fallback_results": dict(self.fallbacks), "desyncs": self.desyncs,
                  "stale_steps": self.stale_steps, "disabled_reason": self.disabled_reason,
                  "default_k": self.default_k,
                  "wait_share_window": round(self._window.ratio(), 6)})
        own = _audit.counts()
        if own:  # DPBALANCE_VLLM_AUDIT_COLLECTIVES=1: counted at torch.distributed
            s["audit_own_collectives"] = own["own"]
        terms = self.dpb.step_terms() if self.dpb is not None else None
        if terms is not None:  # what the plan prices the step's non-attention time with
            s["step_terms"] = terms
        return s

    def _chain_signals(self) -> None:
        """SIGTERM / SIGINT first write the `final` record (nothing else: the rank keeps
        joining the exchange until vLLM stops stepping), then run vLLM's own handler.

        vLLM's engine core installs its handlers before it builds the scheduler
        (vllm/v1/engine/core.py `run_engine_core`), and under `vllm serve` the process manager
        SIGTERMs the engine cores and kills them at once (--shutdown-timeout 0), which can
        come before the executor's shutdown writes the record. Python runs this handler in the
        main thread between two bytecodes, never inside a plugin call; a handler that finds a
        record being written leaves the record to the shutdown."""
        import signal
        import threading
        if threading.current_thread() is not threading.main_thread():
            return  # not an engine core's main thread (a test): signals stay as they are
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if not callable(previous):
                continue

            def handler(signum, frame, previous=previous):
                if not self._writing:
                    try:
                        self._write_final()  # the plugin and the exchange stay as they are
                    except Exception as e:  # noqa: BLE001 - vLLM's handler must still run
                        log.error("dpbalance: DP rank %d: final record on signal %d: %s",
                                  self.dp_rank, signum, e)
                previous(signum, frame)
            signal.signal(sig, handler)

    def _write_stats(self, kind: str) -> None:
        """A `stats` (periodic) or `final` record in the step log, and one summary line."""
        s = self.stats()
        if self._log is not None:
            self._writing = True
            try:
                self._log.write(json.dumps({kind: s, "t": round(time.time(), 4)}) + "\n")
                self._log.flush()
            finally:
                self._writing = False
        fb = sum(self.fallbacks.values())
        why = " (" + ", ".join(f"{k} {v}" for k, v in sorted(self.fallbacks.items())) + ")" \
            if fb else ""
        line = (f"dpbalance: DP rank {self.dp_rank} {kind}: {self.steps} steps "
                f"({self.exchanges} exchanged), "
                f"{s.get('balanced_steps', 0)} balanced, {fb} at the fallback length{why}; "
                f"instance bubble {s.get('bubble_fraction', 0):.3f}, this rank's wait share "
                f"{self._window.ratio():.3f} (last {self._window.steps} steps); model error "
                f"{s.get('predicted_error', 0):.3f}; desyncs {self.desyncs}")
        t = s.get("step_terms")
        if t:
            line += (f"; step terms ({'learnt online, %d rows' % t['rows'] if t['online'] else 'flags'}): "
                     f"ffn_fixed_us={t['ffn_fixed_us']:.0f} ffn_per_token_us={t['ffn_per_token_us']:.2f} "
                     f"draft_us={t['draft_us']:.0f} step_overhead_us={t['step_overhead_us']:.0f}")
        if kind == "final":
            log.warning(line)
        else:
            log.info(line)

    def _write_final(self) -> None:
        """The rank's `final` record and summary line, once."""
        if getattr(self, "_final_written", False) or not (self.enabled or self.cfg.error):
            return
        self._final_written = True
        try:
            self._write_stats("final")
        except (OSError, ValueError) as e:
            log.error("dpbalance: DP rank %d: cannot write the final record: %s", self.dp_rank, e)

    def close(self) -> None:
        """Writes the rank's `final` record and releases the plugin. Idempotent: the executor's
        shutdown (the first thing vLLM's EngineCore.shutdown does) calls it before vLLM tears
        the workers down, the scheduler's shutdown again."""
        if self._closed:
            return
        self._closed = True
        self._write_final()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.metrics is not None:
            self.metrics.close()
        if self.dpb is not None:
            self.dpb.close()
            self.dpb = None
        self.enabled = False


_PLAN: Optional[EnginePlan] = None


def get(vllm_config=None, k_spec: int = 0, method: str = "", lag: int = 1) -> Optional[EnginePlan]:
    """This process's EnginePlan (created by the scheduler, found by the executor)."""
    global _PLAN
    if _PLAN is None and vllm_config is not None:
        _PLAN = EnginePlan(vllm_config, k_spec, method, lag=lag)
    return _PLAN
