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
the plugin has disabled itself on some rank (a zero record: every rank then falls back).
"""
from __future__ import annotations

import json
import logging
import os
import struct
import sys
import time
from typing import Optional, Sequence

log = logging.getLogger("dpbalance.vllm")

try:  # the installed package bundles the adapter next to this file
    from . import dpbalance_plugin as adapter  # type: ignore
except ImportError:  # the source tree: integration/adapters/python
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(_here, "..", "..", "adapters", "python"))
    import dpbalance_plugin as adapter  # type: ignore  # noqa: E402

# What each rank adds to the exchange besides the plugin's record: its exchange index (the ranks
# must agree, else the exchange is out of step), its number of planned requests and its tokens.
_PAYLOAD = struct.Struct("<qii")


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

    def __init__(self, vllm_config, k_spec: int):
        pc = vllm_config.parallel_config
        self.dp_size = int(pc.data_parallel_size)
        self.dp_rank = int(pc.data_parallel_rank)
        self.k_spec = int(k_spec)          # vLLM's num_speculative_tokens (the draft limit)
        self.lib = library_path()
        self.enabled = self.lib is not None
        self.dpb = None
        self.pb = None
        self._group = None
        self.exchanges = 0                 # exchanges joined (= engine steps while running)
        self.exchanged_this_step = False
        self.fallbacks = {}                # plugin result name -> steps
        self.desyncs = 0                   # steps whose exchange indices differed across ranks
        self.stale_steps = 0               # see begin_step
        self.disabled_reason = ""
        self.ab_epoch = int(os.environ.get("DPB_AB_EPOCH", "0") or 0)
        self.default_k = int(os.environ.get("DPB_DEFAULT_K", "3") or 3)
        self._last = None                  # (requests, lens, result, extra) of this step
        self.last_plan = None
        self._t_step = None
        log_dir = os.environ.get("DPBALANCE_VLLM_STEP_LOG", "")
        self._log = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self._log = open(os.path.join(log_dir, f"engine_dp{self.dp_rank}.jsonl"), "a",
                             buffering=1)
        if self.enabled:
            log.warning("dpbalance: enabled on DP rank %d/%d with %s (k_spec=%d)", self.dp_rank,
                        self.dp_size, self.lib, self.k_spec)

    # --- the exchange ---------------------------------------------------------------------
    _find_group = staticmethod(_find_dp_group)  # a test replaces it and _collective

    def _collective(self, send: bytes) -> bytes:
        """All-gather of equal-size byte strings over the engine core's DP group: a
        (dp_size, n) uint8 all-reduce in which each rank fills its own row."""
        import torch
        import torch.distributed as dist
        if self.dp_size == 1:
            return bytes(send)
        n = len(send)
        t = torch.zeros(self.dp_size, n, dtype=torch.uint8)
        t[self.dp_rank] = torch.frombuffer(bytearray(send), dtype=torch.uint8)
        dist.all_reduce(t, group=self._group)
        return t.numpy().tobytes()

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
                log.error("dpbalance: %s; running without balancing", self.disabled_reason)
                return False
        self.pb = adapter.Piggyback(self._collective, self.dp_size)
        config = []
        if "DPB_K_MAX" not in os.environ:
            config.append(f"k_max={min(8, self.k_spec)}")
        if "DPB_DEFAULT_K" not in os.environ:
            config.append(f"default_k={min(self.default_k, min(8, self.k_spec))}")
        self.default_k = min(self.default_k, self.k_spec)
        # init's handshake runs through the same collective, on every rank's first step.
        try:
            self.dpb = adapter.DpBalance.load(self.dp_size, self.dp_rank, ";".join(config),
                                              allgather=self.pb, library=self.lib, abi=2)
        except adapter.DpBalanceError as e:
            # Refused flags (the plugin logs which): the same environment reaches every rank,
            # so every rank refuses them here, before init's handshake, and all go on with
            # vLLM's own draft lengths while still joining the exchange each step (zero
            # records). Never a reason to stop vLLM.
            self.dpb = None
            self.disabled_reason = str(e)
            log.error("%s; vLLM's own draft lengths from now on", e)
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
        reqs = [adapter.Request(str(r[0]), int(r[1]), 0, max(0, min(int(r[2]), 8)))
                for r in requests]
        payload = _PAYLOAD.pack(self.exchanges, len(reqs), sum(1 + q.k_cap for q in reqs))
        extra = max(0, int(extra_tokens))
        kind = "extend" if extra > 0 else ("decode" if reqs else "idle")
        res = self.pb.step(self.dpb, reqs, payload, kind=kind, extra_tokens=extra)
        self.last_plan = res.plan  # the ABI v2 PlanResult (every rank's tokens and flags), or None
        self.exchanged_this_step = True
        idx = {_PAYLOAD.unpack(p)[0] for p in res.payloads}
        if len(idx) != 1:
            self.desyncs += 1
            log.error("dpbalance: DP rank %d exchange %d met indices %s", self.dp_rank,
                      self.exchanges, sorted(idx))
        self.exchanges += 1
        result = adapter.RESULT_NAMES.get(self.dpb.last_result, str(self.dpb.last_result)) \
            if self.dpb is not None else "dpbDisabled"
        if result != "dpbSuccess":
            self.fallbacks[result] = self.fallbacks.get(result, 0) + 1
        lens = list(res.verify_len) if res.verify_len is not None else \
            [min(self.default_k, q.k_cap) for q in reqs]
        self._last = (requests, lens, result, extra)
        return lens

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
                   accepted: Sequence[tuple], scheduled_tokens: int) -> None:
        """After the forward: report measured attention time and the accepted drafts
        [(req_id, verify_len, accepted, finished), ...]; log the step."""
        if not self.enabled or not self.exchanged_this_step:
            return
        self.exchanged_this_step = False
        planned = self._last
        self._last = None
        if step_us is None and self._t_step is not None:
            step_us = (time.perf_counter() - self._t_step) * 1e6
        att = float(attention_us) if attention_us is not None else 0.0
        if self.dpb is not None:
            acc = [adapter.Accepted(str(a[0]), int(a[1]), int(a[2]), bool(a[3]))
                   for a in accepted]
            self.dpb.report(att, float(step_us or 0.0), acc)
        if self._log is not None and planned is not None:
            requests, lens, result, extra = planned
            defaults = [min(self.default_k, int(r[2])) for r in requests]
            arm_on = self.ab_epoch <= 0 or ((self.exchanges - 1) // self.ab_epoch) % 2 == 0
            self._log.write(json.dumps({
                "x": self.exchanges - 1, "n": len(requests), "result": result, "arm_on": arm_on,
                "extra": extra,
                "lens": lens, "defaults": defaults, "ctx": [int(r[1]) for r in requests],
                "changed": any(a != b for a, b in zip(lens, defaults)),
                "accepted": sum(int(a[2]) for a in accepted),
                "drafted": sum(int(a[1]) for a in accepted), "tokens": scheduled_tokens,
                "att_us": att, "desyncs": self.desyncs}) + "\n")

    def stats(self) -> dict:
        s = self.dpb.stats() if self.dpb is not None else {}
        s.update({"exchanges": self.exchanges, "fallback_results": dict(self.fallbacks),
                  "desyncs": self.desyncs, "stale_steps": self.stale_steps,
                  "disabled_reason": self.disabled_reason})
        return s

    def close(self) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"final": self.stats()}) + "\n")
            self._log.flush()
        if self.dpb is not None:
            self.dpb.close()
            self.dpb = None


_PLAN: Optional[EnginePlan] = None


def get(vllm_config=None, k_spec: int = 0) -> Optional[EnginePlan]:
    """This process's EnginePlan (created by the scheduler, found by the executor)."""
    global _PLAN
    if _PLAN is None and vllm_config is not None:
        _PLAN = EnginePlan(vllm_config, k_spec)
    return _PLAN
