"""Where SGLang's scheduler step meets dpbalance's plugin ABI (v2, through the Python adapter).

Read at SGLang 0.5.23 (PyPI wheel; sgl-project/sglang, see docs/engines.md for the commits):
`prepare_mlp_sync_batch_raw` (sglang/srt/managers/scheduler_components/dp_attn.py) runs on
every scheduler process every step that needs the MLP sync, idle ranks included, and calls
`MLPSyncBatchInfo.all_gather`, which gathers one int64 row per process of the TP group into a
(num_dp_ranks, attn_tp_size * attn_cp_size, W) tensor (W = 11 fields at 0.5.23), overwrites the
rows of inactive slots with `_get_fallback_tensor` (an IDLE row), and keeps
`tp0_info_cpu = global_info_tensor.cpu()[:, 0, :]`.

Our record rides there, as 64 extra int64 columns (512 bytes) after SGLang's W, not as a second
gather. Why: the row can grow: `all_gather` derives its width from `_get_local_tensor().numel()`
and every reader indexes SGLang's fields by position 0..W-1, so columns after W are invisible to
SGLang; one collective per step instead of two; the record fails exactly when SGLang's sync does;
SGLang's own fallback-row overwrite (an inactive slot) and its all-reduce variant (elastic EP:
an all-zero row becomes the fallback row) apply to our columns unchanged, so such a slot's record
arrives as zeros and every rank runs its defaults for the step; and int64 carries the bytes
exactly (the all-reduce sums one non-zero row per slot). The record columns are read back from
the gathered tensor (`tp0_info_cpu` is a view of it, `_base`), checked for its shape.

Per process (scheduler) one `RankState`:
  - the first sync initialises the plugin; its handshake rides that sync's row (the plugin's
    init calls our all-gather, which runs SGLang's gather with the handshake record). A rank
    whose init fails, or that has no plugin (DPB_PLUGIN=none), still runs every sync with a
    zero record: the others see it, refuse or fall back, and nobody waits;
  - every later sync calls `plan` with this rank's batch; `plan` runs SGLang's gather inside
    (our callback). The result is attached to the batch (`batch.dpb_plan`) for the DSpark hooks
    and the report;
  - `report` after the batch's results are processed (patch/scheduler.py).

Nothing here raises into SGLang except SGLang's own collective failure, which is re-raised as
it would have been.
"""
from __future__ import annotations

import contextvars
import logging
import os
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

try:  # the installed package holds the adapter next to this file
    from . import dpbalance_plugin as adapter  # type: ignore
except ImportError:  # pragma: no cover - a source tree without the link
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "adapters", "python"))
    import dpbalance_plugin as adapter  # type: ignore  # noqa: E402

log = logging.getLogger("sglang.srt.plugins.dpbalance")

RECORD_BYTES = adapter.RECORD_BYTES       # one process's summary record (the v2 handshake too)
RECORD_COLUMNS = RECORD_BYTES // 8        # int64 columns appended to SGLang's row


class BatchPlan(NamedTuple):
    """What one sync planned for the batch that runs after it."""
    plan: Any                  # adapter.PlanResult
    rids: tuple                # request ids, batch order, as planned
    kind: str                  # decode, idle, extend, no_verify
    t_plan: float              # time.monotonic() at the plan

    @property
    def exchanged(self) -> bool:
        """Every DP rank's total is known: the exchange went through and every rank agreed the
        padded tier from the same bytes. Then every rank runs this plan's lengths (balanced, or
        the defaults on a rank that fell back) and the agreed tier; else SGLang's own."""
        return all(t >= 0 for t in self.plan.rank_tokens)


class StepInput(NamedTuple):
    batch: Any                 # ScheduleBatch or None, as passed to prepare_mlp_sync_batch_raw
    model_runner: Any


_STEP: contextvars.ContextVar[Optional[StepInput]] = contextvars.ContextVar(
    "dpbalance_sglang_step", default=None)


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


def _env_set(name: str) -> bool:
    """Whether DPB_<name> is given (the plugin parses it and names a bad value)."""
    return bool(os.environ.get(name))


def _spec_width(model_runner) -> tuple[str, int]:
    """(algorithm, drafts per request that verify can take) from SGLang's spec configuration:
    DSpark verifies its block (speculative_num_draft_tokens, the anchor included), EAGLE/MTP
    their speculative_num_steps drafts at a fixed width."""
    alg = getattr(model_runner, "spec_algorithm", None)
    if alg is None or alg.is_none():
        return "none", 0
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if alg.is_eagle():
        return "eagle", int(spec.speculative_num_steps or 0)
    name = "dspark" if alg.is_dspark() else alg.name.lower()
    return name, max(0, int(spec.speculative_num_draft_tokens or 1) - 1)


def _ragged_tiers(model_runner) -> Optional[list]:
    """DSpark compact: the decode runner's captured token grid (the tiers SGLang pads to)."""
    runner = getattr(model_runner, "decode_cuda_graph_runner", None)
    if runner is None or not getattr(runner, "ragged_verify_mode", False):
        return None
    return [int(t) for t in runner.capture_num_tokens]


def step_of(batch, k_draft: int) -> tuple[str, list, int]:
    """(kind, requests, extra_tokens) for this rank's batch, as SGLang formed it before the sync.

    None, idle or prebuilt: idle. Decode: one request per running request (`rid`, its host-side
    length `seqlen`, k_cap = min(drafts, tokens it may still emit - 1)), or no_verify without
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
            left = k_draft + 1 if cap is None else int(cap) - len(req.output_ids)
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


class RankState:
    """One scheduler process's dpbalance state."""

    def __init__(self):
        self.dpb = None
        self.initialised = False
        self.init_error: Optional[str] = None
        self.gather = _SyncGather()
        self.pending = None            # the int64 record columns of the gather in flight
        self.last_plan: Optional[BatchPlan] = None       # until the batch takes it
        self.last_sync_plan: Optional[BatchPlan] = None  # the last sync's, kept
        self.alg, self.k_draft = "none", 0
        self.syncs = 0                 # syncs joined (the first carries the handshake)
        self.plans = 0
        self.results: dict = {}        # plan result name -> count
        self.exchange_errors = 0
        self.max_plan_ms = 0.0         # longest plan call, SGLang's gather inside it included
        self.last_gather_ms = 0.0      # SGLang's gather in the last sync
        self.reports = 0

    # --- the plugin -------------------------------------------------------------------------

    def _config(self, model_runner) -> tuple[str, Optional[list]]:
        """Flags SGLang's configuration decides, where DPB_* leaves them unset (the config
        string wins over DPB_*, so only unset ones are passed): the draft width as k_max and
        default_k (SGLang verifies every draft by default: DSpark's verify-all fallback, EAGLE's
        fixed width), no draft cost (the draft length is SGLang's, not ours)."""
        self.alg, self.k_draft = _spec_width(model_runner)
        parts = []
        k = min(self.k_draft, 8)  # DPB_K_MAX's range (docs/flags.md)
        if not _env_set("DPB_K_MAX"):
            parts.append(f"k_max={k}")
        if not _env_set("DPB_DEFAULT_K"):
            parts.append(f"default_k={k}")
        if not _env_set("DPB_DRAFT_US"):
            parts.append("draft_us=0")
        tiers = _ragged_tiers(model_runner) if self.alg == "dspark" else None
        return ";".join(parts), tiers

    def _init(self, info, group, model_runner) -> None:
        """The first sync: load and init the plugin (its handshake rides this sync)."""
        self.initialised = True
        import torch.distributed as dist

        library = os.environ.get("DPB_PLUGIN", "")
        slots = int(info.tp_size) * int(info.cp_size)
        index = dist.get_rank(group)
        config, tiers = self._config(model_runner)
        try:
            self.dpb = adapter.DpBalance.load(
                int(info.num_dp_ranks), index // slots, config, allgather=self.gather,
                library=library, abi=2, attn_tp_size=slots, attn_tp_rank=index % slots,
                token_tiers=tiers, granularity="request")
        except (adapter.DpBalanceError, OSError, ValueError, TypeError) as e:
            self.dpb = None
            self.init_error = str(e)
            log.error("dpbalance_sglang: DPB_PLUGIN=%r could not start on TP process %d (%s); "
                      "this rank joins SGLang's sync with an empty record and every rank runs "
                      "SGLang's own verify lengths", library, index, e)
            return
        if self.dpb is None:
            log.warning("dpbalance_sglang: DPB_PLUGIN=none on TP process %d: SGLang's own "
                        "verify lengths on every rank", index)
        else:
            log.info("dpbalance_sglang: plugin %s on DP rank %d (attn-TP slot %d of %d), %s, "
                     "draft width %d, tiers %s", self.dpb.path, self.dpb.dp_rank,
                     index % slots, slots, self.alg, self.k_draft, tiers)

    # --- one sync -------------------------------------------------------------------------

    def sync(self, orig: Callable, info, device, group, use_all_reduce: bool) -> None:
        """MLPSyncBatchInfo.all_gather with our record in it (the AROUND hook's body)."""
        import torch

        step = _STEP.get()
        batch = step.batch if step is not None else None
        model_runner = step.model_runner if step is not None else None
        g = self.gather
        g.ran, g.engine_error = False, None
        self.syncs += 1
        self.last_gather_ms = 0.0

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
                self.last_gather_ms = (time.monotonic() - t0) * 1e3
            tp0 = info.tp0_info_cpu
            full = getattr(tp0, "_base", None)
            engine_width = int(tp0.shape[-1]) - RECORD_COLUMNS if tp0 is not None else 0
            try:
                return records_from_gathered(full, int(info.num_dp_ranks),
                                             int(info.tp_size) * int(info.cp_size), engine_width)
            except ValueError as e:  # SGLang's own fields stay as gathered; the plugin falls back
                self.exchange_errors += 1
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
        self.last_plan = self.last_sync_plan = plan

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
        kind, reqs, extra = step_of(batch, self.k_draft)
        t0 = time.monotonic()
        try:
            res = self.dpb.plan(reqs, kind=kind, extra_tokens=extra)
        except (TypeError, ValueError) as e:  # this rank's batch cannot be marshalled
            log.error("dpbalance_sglang: DP rank %d: %s; SGLang's own lengths this step",
                      self.dpb.dp_rank, e)
            return None
        self.max_plan_ms = max(self.max_plan_ms, (time.monotonic() - t0) * 1e3)
        self.plans += 1
        name = adapter.RESULT_NAMES.get(res.result, str(res.result))
        self.results[name] = self.results.get(name, 0) + 1
        return BatchPlan(res, tuple(r.request_id for r in reqs), kind, t0)

    def take_plan(self) -> Optional[BatchPlan]:
        p, self.last_plan = self.last_plan, None
        return p

    # --- after the batch ran ------------------------------------------------------------------

    def report(self, batch, result) -> None:
        """Reports a batch's accepted drafts for the plan it ran (plan_id pairs them under the
        overlap scheduler, where the report of step t follows the plan of step t+1). SGLang
        measures no attention-only time per step: the wall time from the plan to this report
        stands for both times."""
        bp: Optional[BatchPlan] = getattr(batch, "dpb_plan", None)
        if self.dpb is None or bp is None:
            return
        batch.dpb_plan = None
        self.report_plan(bp, batch, result)

    def report_plan(self, bp: BatchPlan, batch=None, result=None) -> None:
        """Reports `bp`; with no batch (SGLang ran nothing after the sync: every rank was idle)
        a step without accepted drafts."""
        if self.dpb is None:
            return
        lens = list(bp.plan.verify_len)
        accepted = []
        if batch is not None and bp.kind == "decode" and len(batch.reqs) == len(bp.rids):
            per_req = accepted_per_request(result, len(bp.rids))
            if per_req is not None:
                for req, rid, k, a in zip(batch.reqs, bp.rids, lens, per_req):
                    accepted.append(adapter.Accepted(rid, k, max(0, min(int(a), k)),
                                                     bool(req.finished())))
        us = (time.monotonic() - bp.t_plan) * 1e6
        self.dpb.report(us, us, accepted, plan_id=bp.plan.plan_id)
        self.reports += 1

    def summary(self) -> dict:
        out = {"syncs": self.syncs, "plans": self.plans, "results": dict(self.results),
               "exchange_errors": self.exchange_errors, "max_plan_ms": self.max_plan_ms,
               "reports": self.reports, "init_error": self.init_error,
               "plugin": self.dpb is not None}
        if self.dpb is not None:
            out["stats"] = self.dpb.stats()
        return out


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
