"""Where SGLang's scheduler step meets dpbalance's plugin ABI (v2, through the Python adapter).

Read at SGLang 0.5.23 (PyPI wheel; docs/engines.md "SGLang" names the files and commits).

One scheduler iteration (`Scheduler.event_loop_overlap`, SGLang's default, or
`event_loop_normal`), as the hooks in patch/ see it:

  get_next_batch_to_run        (patch/scheduler.py: marks the iteration, `iteration()`)
    MLP sync 1 (the probe)     speculative decoding + DP attention only: a sync over the new
                               prefill batch. Its batch is a prefill or nothing, never a verify
                               step, so no plan is made and SGLang's row goes as shipped.
    MLP sync 2                 `prepare_mlp_sync_batch_raw` (patch/dp_attn.py): this rank's
                               batch is summarised and `plan` runs with SGLang's gather as the
                               exchange; the record rides that gather as 64 extra int64
                               columns. The plan goes on the batch SGLang returns
                               (`batch.dpb_plan`, None when there is none, so no older plan
                               stays on SGLang's persistent running batch).
  run_batch                    (patch/scheduler.py) the batch's plan is the current one while
                               its forward runs: the DSpark and EAGLE hooks apply it only if it
                               is this rank's latest plan (a stale plan is dropped, counted,
                               never applied); the target's attention is timed there.
  batch.copy()                 (patch/schedule_batch.py: the overlap loop and PD decode queue
                               a copy for result processing; the copy keeps the plan)
  process_batch_result         (patch/scheduler.py) reports the batch's accepted drafts and
                               measured times for the plan it carries (plan_id), whatever
                               object carries it.

Why extra columns and not a second gather: the row can grow (`MLPSyncBatchInfo.all_gather`
derives its width from `_get_local_tensor().numel()`, every reader indexes SGLang's fields by
position); one collective per step instead of two; the record fails exactly when SGLang's sync
does; SGLang's inactive-slot overwrite and its all-reduce variant reach our columns unchanged
(such a slot's record is zeros: every rank runs its defaults that step); int64 carries the
bytes exactly. The record columns are read back from the gathered tensor (`tp0_info_cpu._base`),
checked for shape.

Nothing here raises into SGLang except SGLang's own collective failure, re-raised as it was.
"""
from __future__ import annotations

import collections
import contextvars
import logging
import os
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

try:  # the installed package holds the adapter next to this file
    from . import dpbalance_plugin as adapter  # type: ignore
except ImportError:  # pragma: no cover - a source tree without the installed adapter
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "adapters", "python"))
    import dpbalance_plugin as adapter  # type: ignore  # noqa: E402

from . import attention_timer, spec_config

log = logging.getLogger("sglang.srt.plugins.dpbalance")

RECORD_BYTES = adapter.RECORD_BYTES       # one process's summary record (the v2 handshake too)
RECORD_COLUMNS = RECORD_BYTES // 8        # int64 columns appended to SGLang's row
# Plans kept waiting for their report: the overlap loop reports step t after planning t + 1, so
# two are normal; an older one was never reported (counted as missing).
MAX_OUTSTANDING = 2


class BatchPlan(NamedTuple):
    """What one planning sync decided for the batch that runs after it."""
    plan: Any                  # adapter.PlanResult
    rids: tuple                # request ids, batch order, as planned
    kind: str                  # decode, idle, extend, no_verify
    seq: int                   # this rank's planning-sync number (RankState.seq at the plan)
    t_plan: float              # time.monotonic() at the plan

    @property
    def exchanged(self) -> bool:
        """Every DP rank's total is known: the exchange went through and every rank agreed the
        padded tier and the draft depth from the same bytes. Then every rank runs this plan's
        lengths (balanced, or the defaults on a rank that fell back), tier and depth; else
        SGLang's own."""
        return all(t >= 0 for t in self.plan.rank_tokens)


class Waiting:
    """A plan waiting for its report, with what its batch's forward left for that report."""

    __slots__ = ("bp", "run_start", "ran", "timing")

    def __init__(self, bp: BatchPlan):
        self.bp = bp
        self.run_start: Optional[float] = None  # time.monotonic() at its run_batch
        self.ran = None                         # what the hooks made it run (note_run)
        self.timing = None                      # its attention layers' timing (AttentionTimer)


class Iteration:
    """One `get_next_batch_to_run` call: how many MLP syncs it has run, and whether its first
    is SGLang's prefill probe (see the module docstring)."""

    __slots__ = ("probe_first", "syncs")

    def __init__(self, probe_first: bool):
        self.probe_first = probe_first
        self.syncs = 0


class StepInput(NamedTuple):
    batch: Any                 # ScheduleBatch or None, as passed to prepare_mlp_sync_batch_raw
    model_runner: Any


_STEP: contextvars.ContextVar[Optional[StepInput]] = contextvars.ContextVar(
    "dpbalance_sglang_step", default=None)
_ITERATION: contextvars.ContextVar[Optional[Iteration]] = contextvars.ContextVar(
    "dpbalance_sglang_iteration", default=None)
_RUNNING: contextvars.ContextVar[Optional[BatchPlan]] = contextvars.ContextVar(
    "dpbalance_sglang_running", default=None)


def records_from_gathered(gathered, dp_size: int, slots: int, engine_width: int) -> bytes:
    """The record columns of SGLang's gathered MLP-sync tensor, group order (dp_rank, slot).

    `gathered`: the (dp_size, slots, engine_width + 64) int64 CPU tensor. Raises ValueError naming
    the shape when it is not that (a row of another width: a peer without these hooks, or an
    SGLang whose gather changed)."""
    want = (dp_size, slots, engine_width + RECORD_COLUMNS)
    got = tuple(gathered.shape) if gathered is not None else None
    if got != want:
        raise ValueError(f"dpbalance_sglang: SGLang's gathered MLP-sync rows have shape {got}, "
                         f"expected {want} ({engine_width} SGLang columns + {RECORD_COLUMNS} "
                         f"record columns per process)")
    return gathered[:, :, engine_width:].contiguous().numpy().tobytes()


def step_of(batch, k_draft: int, full_width: bool) -> tuple[str, list, int]:
    """(kind, requests, extra_tokens) for this rank's batch, as SGLang formed it before the sync.

    None, idle or prebuilt: idle. Decode: one request per running request (`rid`, its host-side
    length `seqlen`, k_cap = min(drafts, tokens it may still emit - 1); `full_width`: every
    request at the width, as EAGLE verifies it whatever is left), or no_verify without
    speculation. Extend or mixed: extend with its `extend_num_tokens` of prefill."""
    if batch is None:
        return "idle", [], 0
    mode = batch.forward_mode
    if mode.is_idle() or mode.is_prebuilt():
        return "idle", [], 0
    if mode.is_decode():
        reqs = []
        for req in batch.reqs:
            cap = req.sampling_params.max_new_tokens
            left = k_draft + 1 if cap is None or full_width else int(cap) - len(req.output_ids)
            reqs.append(adapter.Request(req.rid, int(req.seqlen), k_min=0,
                                        k_cap=max(0, min(k_draft, left - 1))))
        return ("decode" if k_draft > 0 else "no_verify"), reqs, 0
    return "extend", [], int(batch.extend_num_tokens or 0)


class _SyncGather:
    """The plugin's all-gather: runs SGLang's gather of this step with the record in it."""

    def __init__(self):
        self.run: Optional[Callable[[bytes], bytes]] = None
        self.ran = False
        self.engine_error: Optional[BaseException] = None

    def __call__(self, send: bytes, _timeout_ms: int) -> bytes:
        if self.run is None:
            raise RuntimeError("dpbalance_sglang: the plugin exchanged outside SGLang's sync")
        return self.run(send)


class Counters:
    """What the package counts on one process (summary(); the tests read them)."""

    def __init__(self):
        self.syncs = 0             # MLP syncs with our columns (the first carries the handshake)
        self.probe_syncs = 0       # SGLang's prefill probes, left as shipped
        self.plans = 0
        self.reports = 0
        self.idle_reports = 0      # plans whose sync found every rank idle (reported at once)
        self.stale_dropped = 0     # a batch's plan that was not this rank's latest: not applied
        self.missing_reports = 0   # plans evicted unreported (more than MAX_OUTSTANDING behind)
        self.unplanned_results = 0  # results of batches that carried no plan (prefill probes)
        self.applied = {}          # what the hooks applied: name -> count
        self.exchange_errors = 0
        self.max_plan_ms = 0.0     # longest plan call, SGLang's gather inside it included
        self.max_wait_ms = 0.0     # longest time from a plan to its report
        self.attention_reports = 0  # reports whose attention was timed (> 0)
        self.attention_us = 0.0    # their attention, summed
        self.last_gather_ms = 0.0  # SGLang's gather in the last sync


class RankState:
    """One scheduler process's dpbalance state."""

    def __init__(self):
        self.dpb = None
        self.initialised = False
        self.init_error: Optional[str] = None
        self.gather = _SyncGather()
        self.pending = None            # the int64 record columns of the gather in flight
        self.n = Counters()
        self.results: dict = {}        # plan result name -> count
        self.seq = 0                   # planning syncs so far
        self.latest: Optional[BatchPlan] = None          # the last planning sync's plan
        self.last_sync_plan: Optional[BatchPlan] = None  # the same, kept (tests, logs)
        # Plans waiting for their report, oldest first: plan seq -> Waiting.
        self.waiting: collections.OrderedDict = collections.OrderedDict()
        self.spec = spec_config.SpecConfig.none()
        self.timer = attention_timer.AttentionTimer()
        self.dspark_topk = False       # DPBALANCE_SGLANG_DSPARK_TOPK (read_dspark_topk)

    # --- the plugin -------------------------------------------------------------------------

    def _init(self, info, group, model_runner) -> None:
        """The first sync: load and init the plugin (its handshake rides this sync)."""
        self.initialised = True
        import torch.distributed as dist

        from . import library

        slots = int(info.tp_size) * int(info.cp_size)
        index = dist.get_rank(group)
        value = os.environ.get("DPB_PLUGIN", "")
        from sglang.srt.runtime_context import get_parallel

        if int(getattr(get_parallel(), "pp_size", 1) or 1) > 1:
            # event_loop_pp processes a microbatch's results pp_size - 1 iterations later, more
            # than the plans kept outstanding (MAX_OUTSTANDING, the plugin's two): every plan
            # would be evicted before its report. This rank joins with an empty record.
            self.init_error = f"pipeline parallelism (pp_size {get_parallel().pp_size})"
            log.error("dpbalance_sglang: %s is not supported; SGLang's own verify lengths on "
                      "every rank", self.init_error)
            return
        self.spec = spec_config.SpecConfig.from_sglang(model_runner)
        self.dspark_topk = read_dspark_topk() and self.spec.alg == "dspark"
        config = self.spec.plugin_config()
        try:
            path = library.resolve(value)
            self.dpb = adapter.DpBalance.load(
                int(info.num_dp_ranks), index // slots, config, allgather=self.gather,
                library=path, abi=2, attn_tp_size=slots, attn_tp_rank=index % slots,
                token_tiers=self.spec.tiers, granularity="request")
        except (adapter.DpBalanceError, OSError, ValueError, TypeError) as e:
            self.dpb = None
            self.init_error = str(e)
            log.error("dpbalance_sglang: DPB_PLUGIN=%r could not start on TP process %d (%s); "
                      "this rank joins SGLang's sync with an empty record and every rank runs "
                      "SGLang's own verify lengths", value, index, e)
            return
        if self.dpb is None:
            log.warning("dpbalance_sglang: DPB_PLUGIN=none on TP process %d: SGLang's own "
                        "verify lengths on every rank", index)
            return
        self.timer.bind(model_runner)
        log.info("dpbalance_sglang: plugin %s on DP rank %d (attn-TP slot %d of %d), %s; "
                 "config %r; attention timed on %d layers", self.dpb.path, self.dpb.dp_rank,
                 index % slots, slots, self.spec.describe(), config, self.timer.num_layers)

    # --- one sync -------------------------------------------------------------------------

    def planning_sync(self) -> bool:
        """Whether the sync now starting plans (counts it in the iteration). Every rank runs the
        same iterations, so every rank answers alike."""
        it = _ITERATION.get()
        if it is None:  # a sync outside get_next_batch_to_run (PD disaggregation's loops)
            return True
        first = it.syncs == 0
        it.syncs += 1
        return not (it.probe_first and first)

    def sync(self, orig: Callable, info, device, group, use_all_reduce: bool) -> None:
        """MLPSyncBatchInfo.all_gather with our record in it (the AROUND hook's body). The probe
        sync of an iteration runs as shipped (no columns, no plan)."""
        planning = self.planning_sync()  # counted on every sync, the handshake's too
        if self.initialised and not planning:
            self.n.probe_syncs += 1
            orig(info, device, group, use_all_reduce)
            return
        import torch

        step = _STEP.get()
        batch = step.batch if step is not None else None
        model_runner = step.model_runner if step is not None else None
        g = self.gather
        g.ran, g.engine_error = False, None
        self.n.syncs += 1
        self.n.last_gather_ms = 0.0

        def exchange(record: bytes) -> bytes:
            g.ran = True
            if len(record) != RECORD_BYTES:
                raise ValueError(f"dpbalance_sglang: a record of {len(record)} bytes, SGLang's "
                                 f"row carries {RECORD_BYTES}")
            self.pending = torch.frombuffer(bytearray(record), dtype=torch.int64)
            t0 = time.monotonic()
            try:
                orig(info, device, group, use_all_reduce)
            except BaseException as e:  # SGLang's own sync failed: re-raised after plan
                g.engine_error = e
                raise
            finally:
                self.pending = None
                self.n.last_gather_ms = (time.monotonic() - t0) * 1e3
            tp0 = info.tp0_info_cpu
            full = getattr(tp0, "_base", None)
            engine_width = int(tp0.shape[-1]) - RECORD_COLUMNS if tp0 is not None else 0
            try:
                return records_from_gathered(full, int(info.num_dp_ranks),
                                             int(info.tp_size) * int(info.cp_size), engine_width)
            except ValueError as e:  # SGLang's own fields stay as gathered; the plugin falls back
                self.n.exchange_errors += 1
                log.error("%s; SGLang's own verify lengths this step", e)
                raise

        g.run = exchange
        plan = None
        try:
            try:
                plan = self._init_or_plan(info, group, batch, model_runner)
            except Exception as e:  # noqa: BLE001 - ours must never stop SGLang
                if g.engine_error is not None:
                    raise g.engine_error from None
                self._stop(f"{type(e).__name__}: {e}")
                plan = None
            if g.engine_error is not None:
                raise g.engine_error
            if not g.ran:  # no plugin, a failed init, a disabled plugin: SGLang's sync runs anyway
                exchange(bytes(RECORD_BYTES))
        finally:
            g.run = None
        self.latest = self.last_sync_plan = plan

    def _stop(self, why: str) -> None:
        """An error of ours (or SGLang state we did not expect): log it once with its trace,
        stop planning on this rank; it keeps joining SGLang's sync with a zero record, so every
        rank runs SGLang's own lengths from here on."""
        log.exception("dpbalance_sglang: %s; this rank stops planning and SGLang runs its own "
                      "verify lengths", why)
        self.init_error = self.init_error or why
        if self.dpb is not None:
            try:
                self.dpb.close()
            except Exception:  # noqa: BLE001
                pass
        self.dpb = None

    def _init_or_plan(self, info, group, batch, model_runner) -> Optional[BatchPlan]:
        """The first sync: init (the handshake rides it). Later ones: plan this rank's batch."""
        if not self.initialised:
            self._init(info, group, model_runner)
            return None
        if self.dpb is None:
            return None
        kind, reqs, extra = step_of(batch, self.spec.k_draft, self.spec.full_width)
        t0 = time.monotonic()
        try:
            res = self.dpb.plan(reqs, kind=kind, extra_tokens=extra)
        except (TypeError, ValueError) as e:
            # This rank's batch cannot be marshalled: it sends a zero record, so no rank has an
            # agreement this step.
            log.error("dpbalance_sglang: DP rank %d: %s; SGLang's own lengths this step",
                      self.dpb.dp_rank, e)
            return None
        # The exchange went through on this rank: every peer now holds the same agreement, so
        # nothing below may lose this plan (an error in the bookkeeping is logged and the plan
        # still runs; a rank running other values than its peers would split a collective).
        self.seq += 1
        bp = BatchPlan(res, tuple(r.request_id for r in reqs), kind, self.seq, t0)
        try:
            self.n.max_plan_ms = max(self.n.max_plan_ms, (time.monotonic() - t0) * 1e3)
            self.n.plans += 1
            name = adapter.RESULT_NAMES.get(res.result, str(res.result))
            self.results[name] = self.results.get(name, 0) + 1
            self._keep(bp)
        except Exception:  # noqa: BLE001
            log.exception("dpbalance_sglang: plan bookkeeping failed; the plan still runs")
        return bp

    def _keep(self, bp: BatchPlan) -> None:
        """Waits for bp's report; a plan more than MAX_OUTSTANDING behind is counted missing."""
        self.waiting[bp.seq] = Waiting(bp)
        while len(self.waiting) > MAX_OUTSTANDING:
            self.waiting.popitem(last=False)
            self.n.missing_reports += 1

    def take_latest(self) -> Optional[BatchPlan]:
        """The plan of the sync that just ran (once)."""
        p, self.latest = self.latest, None
        return p

    # --- the forward --------------------------------------------------------------------------

    def usable(self) -> Optional[BatchPlan]:
        """The running batch's plan when the hooks may apply it: this rank's latest (begin_run
        checked) and exchanged (every rank derived the same tier and depth from it)."""
        bp = _RUNNING.get()
        return bp if bp is not None and self.dpb is not None and bp.exchanged else None

    def applied(self, what: str) -> None:
        self.n.applied[what] = self.n.applied.get(what, 0) + 1

    def begin_run(self, batch) -> contextvars.Token:
        """run_batch starts: the batch's plan is the running one if it is this rank's latest.
        A batch that carries an older plan (a batch SGLang kept across iterations without a new
        planning sync) runs SGLang's own values: dropped, counted, never applied."""
        carried = getattr(batch, "dpb_plan", None)
        bp = carried if carried is not None and carried.seq == self.seq else None
        token = _RUNNING.set(bp)  # first: what every rank applies must not hang on what follows
        try:
            if carried is not None and bp is None:
                self.n.stale_dropped += 1
                log.warning("dpbalance_sglang: a batch carries plan %d of planning sync %d, the "
                            "latest is %d: dropped, SGLang's own values", carried.plan.plan_id,
                            carried.seq, self.seq)
            w = self.waiting.get(bp.seq) if bp is not None else None
            if w is not None:
                w.run_start = time.monotonic()
            self.timer.begin(w is not None)
        except Exception:  # noqa: BLE001 - timing and counts only; the plan still applies
            log.exception("dpbalance_sglang: run_batch bookkeeping failed; the plan still runs")
        return token

    def end_run(self, token: contextvars.Token) -> None:
        try:
            timing = self.timer.end()
            w = self._running_waiting()
            if w is not None:
                w.timing = timing
        finally:
            _RUNNING.reset(token)

    def _running_waiting(self) -> Optional[Waiting]:
        bp = _RUNNING.get()
        return self.waiting.get(bp.seq) if bp is not None else None

    def note_run(self, what: str, value) -> None:
        """What the hooks made the running batch's forward run (what its report then claims):
        ("depth", d) for EAGLE, ("lens", [drafts per request]) for DSpark."""
        w = self._running_waiting()
        if w is not None:
            w.ran = (what, value)

    # --- after the batch ran ------------------------------------------------------------------

    def report(self, batch, result) -> None:
        """Reports a batch's accepted drafts for the plan it carries (plan_id pairs them under
        the overlap scheduler, where the report of step t follows the plan of step t+1).
        attention_us: the target's attention layers as timed during its forward (0 when they
        were not seen: a CUDA-graph replay; the online refit then skips the step); step_us: the
        time from this batch's run_batch to the next one's (or to now)."""
        bp: Optional[BatchPlan] = getattr(batch, "dpb_plan", None)
        if self.dpb is None:
            return
        if bp is None:
            self.n.unplanned_results += 1
            return
        batch.dpb_plan = None
        self.report_plan(bp, batch, result)

    def report_plan(self, bp: BatchPlan, batch=None, result=None) -> None:
        """Reports `bp`; with no batch (SGLang ran nothing after the sync: every rank was idle)
        a step without accepted drafts."""
        w = self.waiting.pop(bp.seq, None) if self.dpb is not None else None
        if w is None:
            return
        lens = self._lens_run(w)
        accepted = []
        if lens is not None and batch is not None and bp.kind == "decode" and \
                len(batch.reqs) == len(bp.rids):
            per_req = accepted_per_request(result, len(bp.rids))
            if per_req is not None:
                for req, rid, k, a in zip(batch.reqs, bp.rids, lens, per_req):
                    accepted.append(adapter.Accepted(rid, k, max(0, min(int(a), k)),
                                                     bool(req.finished())))
        now = time.monotonic()
        later = [x.run_start for x in self.waiting.values()
                 if x.bp.seq > bp.seq and x.run_start is not None]
        step_us = ((later[0] if later else now) - w.run_start) * 1e6 \
            if w.run_start is not None else 0.0
        attention_us = self.timer.elapsed_us(w.timing)
        if attention_us > 0:
            self.n.attention_reports += 1
            self.n.attention_us += attention_us
        self.dpb.report(attention_us, step_us, accepted, plan_id=bp.plan.plan_id)
        self.n.reports += 1
        if batch is None:
            self.n.idle_reports += 1
        self.n.max_wait_ms = max(self.n.max_wait_ms, (now - bp.t_plan) * 1e3)

    def _lens_run(self, w: Waiting) -> Optional[list]:
        """The drafts each request of w's batch verified, as far as we know: what the hooks
        applied (note_run); for a speculative decode batch they did not touch, None (SGLang's own
        lengths ran: its accepted counts would be read against lengths it did not verify)."""
        bp, ran = w.bp, w.ran
        if ran is not None and ran[0] == "depth":
            return [int(ran[1])] * len(bp.rids)
        if ran is not None and ran[0] == "sglang_lens":  # SGLang's own, the anchor counted
            return [max(0, int(x) - 1) for x in ran[1].tolist()]
        if ran is not None:
            return list(ran[1])
        if bp.kind == "decode" and self.spec.alg != "none":
            return None
        return list(bp.plan.verify_len)

    def summary(self) -> dict:
        n = self.n
        out = {"syncs": n.syncs, "probe_syncs": n.probe_syncs, "plans": n.plans,
               "reports": n.reports, "idle_reports": n.idle_reports,
               "stale_dropped": n.stale_dropped, "missing_reports": n.missing_reports,
               "unplanned_results": n.unplanned_results, "applied": dict(n.applied),
               "results": dict(self.results), "exchange_errors": n.exchange_errors,
               "max_plan_ms": n.max_plan_ms, "max_wait_ms": n.max_wait_ms,
               "attention_reports": n.attention_reports, "attention_us": n.attention_us,
               "outstanding": len(self.waiting), "init_error": self.init_error,
               "plugin": self.dpb is not None, "spec": self.spec.describe(),
               "dspark_topk": self.dspark_topk,
               "timed_layers": self.timer.num_layers}
        if self.dpb is not None:
            out["stats"] = self.dpb.stats()
            out["step_terms"] = self.dpb.step_terms()  # what the plans priced the step with
        return out


def read_dspark_topk() -> bool:
    """DPBALANCE_SGLANG_DSPARK_TOPK: 1 hands each DSpark rank's planned drafts to DSpark's own
    top-k on the draft's fresh confidence (patch/dspark.py); 0 or unset, the plan's lengths.
    Any other value is logged, naming it, and read as 0."""
    raw = os.environ.get("DPBALANCE_SGLANG_DSPARK_TOPK", "")
    if raw in ("", "0", "1"):
        return raw == "1"
    log.error("dpbalance_sglang: environment variable DPBALANCE_SGLANG_DSPARK_TOPK: %r is not 0 "
              "or 1 (read as 0: DSpark verifies the plan's lengths)", raw)
    return False


def accepted_per_request(result, n: int) -> Optional[Sequence[int]]:
    """Accepted drafts per request from SGLang's GenerationBatchResult
    (sglang/srt/managers/utils.py): `num_correct_drafts_per_req_cpu` (drafts, no bonus), else
    `accept_lens` (with the bonus token). None when neither has n entries."""
    per = getattr(result, "num_correct_drafts_per_req_cpu", None)
    if per is not None and len(per) == n:
        return [int(x) for x in per]
    lens = getattr(result, "accept_lens", None)
    if lens is not None:
        vals = lens.tolist() if hasattr(lens, "tolist") else list(lens)
        if len(vals) == n:
            return [max(0, int(x) - 1) for x in vals]
    return None


_STATE: Optional[RankState] = None


def state() -> RankState:
    """This process's RankState (made on first use)."""
    global _STATE
    if _STATE is None:
        _STATE = RankState()
    return _STATE


def enter_step(batch, model_runner) -> contextvars.Token:
    return _STEP.set(StepInput(batch, model_runner))


def leave_step(token: contextvars.Token) -> None:
    _STEP.reset(token)


def enter_iteration(probe_first: bool) -> contextvars.Token:
    return _ITERATION.set(Iteration(probe_first))


def leave_iteration(token: contextvars.Token) -> None:
    _ITERATION.reset(token)
