"""vLLM's V1 scheduler with per-request draft lengths planned by dpbalance.

`--scheduler-cls dpbalance_vllm.scheduler.DpbScheduler`. With DPB_PLUGIN unset (or `none`) it
is vLLM's `Scheduler` unchanged. With it set, before vLLM schedules a step it plans the rank's
running decode requests with every other DP rank (engine_plan.EnginePlan.exchange) and cuts each
request's draft tokens (`request.spec_token_ids`, proposed after the previous step) to the
planned verify length, so vLLM schedules and verifies only those (`scheduled_spec_decode_tokens`).
A step that will also run prompt tokens (the rest of a running request's prompt, or waiting
requests') is planned as an `extend` step with that many extra tokens. After the forward it
reports the accepted drafts and the measured attention time. A step the plugin does not balance
runs the fallback length: vLLM's num_speculative_tokens, or DPB_DEFAULT_K when set (config.py).

Hooked in vLLM 0.32.0 (vllm/v1/core/sched/scheduler.py): `Scheduler.schedule` (its running-request
loop schedules `num_tokens_with_spec - num_computed_tokens`, which includes the drafts) and
`Scheduler.update_from_output` (accepted = generated tokens - 1 per request with drafts).
vLLM on CPU always runs the synchronous scheduler (vllm/platforms/cpu.py turns async scheduling
off); under async scheduling a GPU deployment uses `DpbAsyncScheduler` (same logic on
`AsyncScheduler`, whose drafts are placeholders of the same count). There `schedule()` for step
t+1 runs before `update_from_output()` of step t, so each plan is kept with the
`SchedulerOutput` it was made for and reported by its token (EnginePlan.after_step), and a
request's context is passed as seen: `num_computed_tokens` less the tokens scheduled but not yet
output (`num_output_placeholders`; vLLM advances `num_computed_tokens` at schedule time and rolls
rejected drafts back in `update_from_output`, vllm/v1/core/sched/async_scheduler.py at
014b2350). With the synchronous scheduler the placeholders are 0 and each plan is reported
before the next is made.
"""
from __future__ import annotations

import logging

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from . import engine_plan, routing

log = logging.getLogger("vllm.dpbalance")


class _DpbMixin:
    _DPB_LAG = 1  # plans read the records of vLLM's sync this many steps back (dp_ride.py)

    def _dpb_init(self):
        spec = self.vllm_config.speculative_config
        k_spec = int(spec.num_speculative_tokens) if spec is not None else 0
        method = str(getattr(spec, "method", "") or "") if spec is not None else ""
        # Checks every setting now, before the engine core reports ready (config.py).
        self._dpb = engine_plan.get(self.vllm_config, k_spec, method, lag=self._DPB_LAG)
        # With DPB_ROUTING (or its log): this rank's load for the router after every schedule().
        self._dpb_route = None
        if routing.active():
            par = self.vllm_config.parallel_config
            self._dpb_route = routing.RankWriter(int(par.data_parallel_rank),
                                                 int(par.data_parallel_size))
        # (SchedulerOutput, {request id: planned length}, plan token) of the steps scheduled and
        # not yet processed, oldest first: one with the synchronous scheduler, two with async.
        self._dpb_steps = []

    def _dpb_requests(self):
        """This rank's running decode requests: (id, context, draft cap) in running order."""
        out, reqs = [], []
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens or r.is_finished():
                continue  # a prefill (chunk): no drafts to verify this step
            left = r.max_tokens - r.num_output_tokens if r.max_tokens is not None else 1 << 30
            cap = min(len(r.spec_token_ids), self._dpb.k_spec, max(0, left - 1))
            seen = r.num_computed_tokens - getattr(r, "num_output_placeholders", 0)
            out.append((r.request_id, int(seen), int(cap)))
            reqs.append(r)
        return out, reqs

    def _dpb_prefill_tokens(self, decode_tokens: int) -> int:
        """Prompt tokens this step will run beside the decodes, as schedule() will take them:
        the rest of each running request's prompt, then the waiting requests' (FCFS, up to the
        free sequence slots), within the step's token budget. An upper bound when KV space
        holds a waiting request back; the plugin then prices and learns nothing from the step
        it did not plan (ABI v2 `extend`)."""
        budget = max(0, int(self.max_num_scheduled_tokens) - decode_tokens)
        need, running = 0, 0
        for r in self.running:
            running += 1
            if r.num_computed_tokens < r.num_prompt_tokens:
                need += r.num_prompt_tokens - r.num_computed_tokens
        slots = max(0, int(self.max_num_running_reqs) - running)
        for r in self.waiting:
            if slots == 0 or need >= budget:
                break
            need += max(0, r.num_prompt_tokens - r.num_computed_tokens)
            slots -= 1
        return min(need, budget)

    def schedule(self, *args, **kwargs):
        plan = self._dpb
        planned, token = {}, None
        # Join only while this rank has work: a call that only flushes finished ids can come
        # after the DP wave ended, when the other ranks are not stepping. An idle rank joins
        # from the executor's dummy batch instead (engine_plan.EnginePlan.join_idle).
        if plan is not None and plan.enabled:
            plan.begin_step()
        if plan is not None and plan.enabled and self.has_unfinished_requests():
            rows, reqs = self._dpb_requests()
            extra = self._dpb_prefill_tokens(sum(1 + row[2] for row in rows))
            lens = plan.exchange(rows, extra_tokens=extra)
            if lens is not None:
                token = plan.last_token
                for r, row, n in zip(reqs, rows, lens):
                    n = max(0, min(int(n), row[2]))
                    if len(r.spec_token_ids) > n:
                        r.spec_token_ids = list(r.spec_token_ids[:n])
                    planned[r.request_id] = n
        so = super().schedule(*args, **kwargs)
        if self._dpb_route is not None:
            self._dpb_route.publish(self)
        if plan is not None and plan.enabled:
            if plan.ride and so.total_num_scheduled_tokens > 0:
                # This step's record rides vLLM's sync in the forward (a step with nothing
                # scheduled runs a dummy forward instead, which carries it: executor.py).
                so.dpb_carry = plan.take_carry()
            self._dpb_steps.append((so, planned, token))
            del self._dpb_steps[:-2]  # a step never processed (vLLM dropped it) goes
        return so

    def update_from_output(self, scheduler_output, model_runner_output):
        plan = self._dpb
        if plan is not None and plan.ride:
            plan.received(getattr(model_runner_output, "dpb_gathered", None))
        accepted, planned, token = [], {}, None
        for i, (so, p, t) in enumerate(self._dpb_steps):
            if so is scheduler_output:  # the plan made for this very step
                planned, token = p, t
                del self._dpb_steps[i]
                break
        if plan is not None and plan.enabled and scheduler_output.total_num_scheduled_tokens > 0:
            sampled = model_runner_output.sampled_token_ids or []
            index = model_runner_output.req_id_to_index or {}
            spec = scheduler_output.scheduled_spec_decode_tokens
            for rid in planned:
                i = index.get(rid)
                drafts = spec.get(rid) or []
                if i is None or i >= len(sampled):
                    continue
                acc = max(0, min(len(sampled[i]) - 1, len(drafts)))
                accepted.append([rid, len(drafts), acc, False])
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._dpb_route is not None:
            self._dpb_route.publish(self, tick=False)  # the step's finished requests gone
        if plan is not None and plan.enabled and scheduler_output.total_num_scheduled_tokens > 0:
            for a in accepted:
                r = self.requests.get(a[0])
                a[3] = r is None or r.is_finished()
            timing = getattr(model_runner_output, "dpb_timing", None) or {}
            plan.after_step(timing.get("att_us"), timing.get("fwd_us"), accepted,
                            scheduler_output.total_num_scheduled_tokens, token=token,
                            worker=timing.get("worker"))
        return outputs

    def add_request(self, request, *args, **kwargs):
        if self._dpb_route is not None and request.request_id not in self.requests:
            self._dpb_route.added(request.request_id)  # not a streaming session's next chunk
        return super().add_request(request, *args, **kwargs)

    def shutdown(self):
        if self._dpb is not None:
            self._dpb.close()
        if self._dpb_route is not None:
            self._dpb_route.close()
        super().shutdown()


class DpbScheduler(_DpbMixin, Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dpb_init()


class DpbAsyncScheduler(_DpbMixin, AsyncScheduler):
    _DPB_LAG = 2  # step s is scheduled before step s - 1's output (and records) are processed

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._dpb_init()
