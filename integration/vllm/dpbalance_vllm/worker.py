"""vLLM's worker with per-step timing of attention and MoE blocks (what dpbalance reports).

`--worker-cls dpbalance_vllm.worker.DpbWorker`: vLLM's worker for the current platform
(`CPUWorker` on CPU, `Worker` on CUDA) plus forward pre/post hooks on every decoder layer's
attention block (`*.self_attn`) and MoE block (`*.mlp` of a sparse-MoE class). Per forward it
sums the time spent in each, measured on the host clock (CPU), or with CUDA events read after
the step's sampled tokens are on the host (GPU). It runs the hooks only when DPB_PLUGIN is set
or DPBALANCE_VLLM_STEP_LOG names a directory, else it is vLLM's worker unchanged.

The attention time goes back to the engine core with the step's output (the attribute
`dpb_timing` of vLLM's `ModelRunnerOutput`, pickled with it) for the plugin's `report`, and from
an idle rank's dummy batch as that call's return value. With DPBALANCE_VLLM_STEP_LOG set, each worker
also appends one JSON line per forward to `worker_dp{rank}.jsonl`: the forward's index (every
forward of a DP instance meets every other rank's forward of the same index at its MoE
collectives), its kind (`model` or `dummy`), tokens, drafts verified and accepted, and the
attention, MoE and forward times in microseconds, and (CPU data parallel) the time inside the MoE
dispatch all-gathers, `coll_us`; per scheduled request, its context and query tokens (`ctx`, `q`)
and, for a forward with sampled tokens, its id and drafts verified and accepted (`rid`, `d`, `a`;
`a` is -1 for a request that sampled nothing, a prefill chunk).
"""
from __future__ import annotations

import json
import os
import time

import torch

from vllm.platforms import current_platform

from . import audit, dp_ride

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _Base
else:
    from vllm.v1.worker.gpu_worker import Worker as _Base


def _measuring() -> bool:
    plugin = os.environ.get("DPB_PLUGIN", "")
    return bool(os.environ.get("DPBALANCE_VLLM_STEP_LOG")) or (bool(plugin) and plugin != "none")


class _Timer:
    """Sums the time between a module's pre-hook and its post-hook over one forward."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.total_s = 0.0
        self._t0 = 0.0
        self._events = []

    def pre(self, _module, _args):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append([ev, None])
        else:
            self._t0 = time.perf_counter()

    def post(self, _module, _args, _out):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[-1][1] = ev
        else:
            self.total_s += time.perf_counter() - self._t0

    def take_us(self) -> float:
        if self.cuda:
            if self._events:
                self._events[-1][1].synchronize()
            self.total_s = sum(a.elapsed_time(b) for a, b in self._events if b is not None) / 1e3
            self._events = []
        us = self.total_s * 1e6
        self.total_s = 0.0
        return us


def _round(us):
    return None if us is None else round(us, 1)


def _install_ride(vllm_config) -> bool:
    """Carries the plugin's record on vLLM's DP sync in this worker (dp_ride.py), when the
    plugin is on, DP > 1 and DPBALANCE_VLLM_EXCHANGE is `ride` (the default). Every worker of
    the instance decides alike (the same environment), so every sync has one shape."""
    from . import engine_plan
    try:
        ride = dp_ride.mode() == "ride"
    except ValueError:
        return False  # the engine core refuses the value (config.py) and says so
    if not ride or engine_plan.library_path() is None \
            or vllm_config.parallel_config.data_parallel_size <= 1:
        return False
    return dp_ride.install(engine_plan.CARRY_BYTES)


class DpbWorker(_Base):
    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        self._dpb_on = _measuring()
        self._dpb_fwd = 0
        self._dpb_log = None
        self._dpb_pending = None
        self._dpb_ride = False
        if not self._dpb_on:
            return out
        self._dpb_ride = _install_ride(self.vllm_config)
        if not self._dpb_ride and self.vllm_config.parallel_config.data_parallel_size > 1:
            dp_ride.install(0)  # vLLM's sync timed, nothing carried (sync_us in the step log)
        cuda = not current_platform.is_cpu()
        self._dpb_att, self._dpb_moe = _Timer(cuda), _Timer(cuda)
        # Time in the MoE dispatch's all-gathers (µs), where the package's CPU communicator runs
        # them (DPBALANCE_VLLM_CPU_DP=1); looked up once here, not per forward.
        self._dpb_gather = None
        if os.environ.get("DPBALANCE_VLLM_CPU_DP") == "1":
            from . import cpu_communicator
            self._dpb_gather = cpu_communicator.take_gather_wait_us
        n_att = n_moe = 0
        for name, mod in self.model_runner.get_model().named_modules():
            cls = type(mod).__name__.lower()
            if name.endswith("self_attn"):
                mod.register_forward_pre_hook(self._dpb_att.pre)
                mod.register_forward_hook(self._dpb_att.post)
                n_att += 1
            elif name.endswith(".mlp") and "moe" in cls:
                mod.register_forward_pre_hook(self._dpb_moe.pre)
                mod.register_forward_hook(self._dpb_moe.post)
                n_moe += 1
        rank = self.vllm_config.parallel_config.data_parallel_rank
        log_dir = os.environ.get("DPBALANCE_VLLM_STEP_LOG", "")
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self._dpb_log = open(os.path.join(log_dir, f"worker_dp{rank}.jsonl"), "a",
                                 buffering=1)
            self._dpb_log.write(json.dumps({"hooks": {"attention": n_att, "moe": n_moe},
                                            "pid": os.getpid()}) + "\n")
        return out

    def _dpb_start(self):
        self._dpb_att.take_us()
        self._dpb_moe.take_us()
        if self._dpb_gather is not None:
            self._dpb_gather()
        dp_ride.take_sync_us()
        return time.perf_counter()

    def _dpb_finish(self, kind: str, t0: float, tokens: int, drafted: int = 0,
                    accepted: int = 0, ctx=(), q=(), per_req=()) -> dict:
        timing = {"i": self._dpb_fwd, "kind": kind, "tokens": tokens,
                  "att_us": round(self._dpb_att.take_us(), 1),
                  "moe_us": round(self._dpb_moe.take_us(), 1),
                  "coll_us": None if self._dpb_gather is None else round(self._dpb_gather(), 1),
                  "sync_us": _round(dp_ride.take_sync_us()),
                  "fwd_us": round((time.perf_counter() - t0) * 1e6, 1),
                  "drafted": drafted, "accepted": accepted, "t": time.time()}
        worker = dp_ride.counts()  # vLLM's syncs and those that carried a record
        seen = audit.counts()
        if seen:
            worker["audit_own_collectives"] = seen["own"]
        if worker:
            timing["worker"] = worker
        self._dpb_fwd += 1
        if self._dpb_log is not None:
            row = dict(timing, ctx=list(ctx), q=list(q))
            if per_req:
                row.update(rid=[r[0] for r in per_req], d=[r[1] for r in per_req],
                           a=[r[2] for r in per_req])
            self._dpb_log.write(json.dumps(row) + "\n")
        return timing

    def execute_model(self, scheduler_output, *args, **kwargs):
        if getattr(self, "_dpb_ride", False):
            dp_ride.arm(getattr(scheduler_output, "dpb_carry", None))
        if not getattr(self, "_dpb_on", False) or scheduler_output.total_num_scheduled_tokens == 0:
            return super().execute_model(scheduler_output, *args, **kwargs)
        t0 = self._dpb_start()
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self._dpb_pending = (t0, scheduler_output)
        if out is not None:  # the output came with the forward: no sample_tokens call
            self._dpb_attach(out)
        return out

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        if getattr(self, "_dpb_pending", None) is not None and out is not None:
            self._dpb_attach(out)
        return out

    def _dpb_attach(self, out):
        t0, so = self._dpb_pending
        self._dpb_pending = None
        drafted = accepted = 0
        sampled = getattr(out, "sampled_token_ids", None) or []
        index = getattr(out, "req_id_to_index", None) or {}
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            i = index.get(rid)
            if i is not None and i < len(sampled) and len(sampled[i]) > 0:
                drafted += len(drafts)
                accepted += max(0, min(len(sampled[i]) - 1, len(drafts)))
        # Each scheduled request's context before the step and query tokens, for calibrating
        # the attention cost model (dpbalance-calibrate's timing rows).
        ctx = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        ctx.update(zip(cached.req_ids, cached.num_computed_tokens))
        rows = [(ctx.get(rid, 0), n) for rid, n in so.num_scheduled_tokens.items()]
        # Each request's drafts verified and accepted this step (vLLM's own counts), for the
        # per-request acceptance of the live bench (integration/vllm/live_bench.py).
        per_req = []
        for rid in so.num_scheduled_tokens:
            i = index.get(rid)
            d = len(so.scheduled_spec_decode_tokens.get(rid) or ())
            a = max(0, min(len(sampled[i]) - 1, d)) if i is not None and i < len(sampled) \
                and len(sampled[i]) > 0 else -1  # -1: no token sampled (a prefill chunk)
            per_req.append((rid, d, a))
        timing = self._dpb_finish("model", t0, so.total_num_scheduled_tokens, drafted, accepted,
                                  [c for c, _ in rows], [q for _, q in rows], per_req)
        try:
            out.dpb_timing = timing
            if self._dpb_ride:
                out.dpb_gathered = dp_ride.take()
        except AttributeError:  # an output type without a __dict__: the scheduler reports 0
            pass

    def execute_dummy_batch(self, *args, **kwargs):
        if not getattr(self, "_dpb_on", False):
            return super().execute_dummy_batch(*args, **kwargs)
        t0 = self._dpb_start()
        super().execute_dummy_batch(*args, **kwargs)
        return self._dpb_finish("dummy", t0, 0)

    def dpb_dummy_batch(self, carry=None):
        """The idle rank's dummy forward (executor.py), its sync carrying `carry` when the
        package rides vLLM's DP sync; the timing dict, with what that sync gathered."""
        if getattr(self, "_dpb_ride", False):
            dp_ride.arm(carry)
        timing = self.execute_dummy_batch()
        timing = timing if isinstance(timing, dict) else {}
        if getattr(self, "_dpb_ride", False):
            timing["gathered"] = dp_ride.take()
        return timing

    def shutdown(self):
        if getattr(self, "_dpb_log", None) is not None:
            self._dpb_log.flush()
        return super().shutdown()
