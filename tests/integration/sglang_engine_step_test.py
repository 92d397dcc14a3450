#!/usr/bin/env python3
"""dpbalance_sglang's plan bookkeeping on paths SGLang's loops rarely take (engine_step.py), with
the real plugin behind it (one DP rank, in-process exchange) and SGLang's own ScheduleBatch:

  - a batch that carries an older plan than this rank's latest (a batch SGLang kept across an
    iteration without a new planning sync) is dropped at run_batch, counted, and nothing of it is
    applied: the DSpark and EAGLE hooks see no plan;
  - ScheduleBatch.copy (SGLang's own, hooked as the package hooks it) keeps the plan, and the
    report of the copy settles it;
  - reports out of plan order (an all-idle sync's plan reported at once while the batch before it
    is in flight) settle each plan by its id, in the package and in the plugin (missing_reports 0);
  - a plan never reported is counted missing once MAX_OUTSTANDING newer plans wait, in the
    package and in the plugin alike.

Usage: sglang_engine_step_test.py PLUGIN_SO   (the sglang ctest venv's Python; nothing skips)
"""
import os
import sys

from script_checks import Checks
from types import SimpleNamespace


def main():
    plugin = os.path.abspath(sys.argv[1])
    try:
        from dpbalance_sglang import engine_step
        from dpbalance_sglang.patch import schedule_batch as copy_hook
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
    except ImportError as e:
        sys.exit(f"FAIL: {e} in {sys.executable}; not skipping")
    checks = Checks()

    adapter = engine_step.adapter
    st = engine_step.RankState()
    st.dpb = adapter.DpBalance.load(1, 0, "backend=inproc;group=es;log_every=0;k_max=4;"
                                    "default_k=4", library=plugin, abi=2)
    st.initialised = True
    st.spec = SimpleNamespace(alg="none", k_draft=4, full_width=False, describe=lambda: "test")

    def batch(n):
        b = ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE)
        b.reqs = [SimpleNamespace(rid=f"r{i}", seqlen=100 + i, output_ids=[],
                                  sampling_params=SimpleNamespace(max_new_tokens=64),
                                  finished=lambda: False) for i in range(n)]
        return b

    def plan(b):
        bp = st._init_or_plan(SimpleNamespace(), None, b, None)
        b.dpb_plan = bp
        return bp

    # A stale plan: batch A planned, then batch B planned; A runs: dropped, nothing applied.
    a, b = batch(3), batch(2)
    pa, pb = plan(a), plan(b)
    checks.check("one rank's plans are exchanged", pa.exchanged and pb.exchanged)
    token = st.begin_run(a)
    checks.check("the stale batch's plan is not the running one", st.usable() is None)
    st.end_run(token)
    checks.check(f"stale plans counted: {st.n.stale_dropped}", st.n.stale_dropped == 1)
    token = st.begin_run(b)
    checks.check("the latest batch's plan is the running one", st.usable() is pb)
    st.end_run(token)
    # SGLang's own copy, with the package's AFTER hook, keeps the plan; its report settles it.
    copied = ScheduleBatch.copy(b)
    copy_hook.after_copy(copied, b)
    checks.check("ScheduleBatch.copy keeps the plan", copied is not b and copied.dpb_plan is pb)
    result = SimpleNamespace(num_correct_drafts_per_req_cpu=[1, 2], accept_lens=None)
    st.report(copied, result)
    checks.check("the copy's report settles the latest plan", st.n.reports == 1 and pb.seq not in st.waiting)
    # Out of order: plan C (in flight), plan D (every rank idle: reported at once), then C.
    c, d = batch(2), batch(0)
    plan(c)
    pd = plan(d)
    st.report_plan(pd)
    st.report(c, SimpleNamespace(num_correct_drafts_per_req_cpu=[0, 3], accept_lens=None))
    stats = st.dpb.stats()
    checks.check(f"both reported: {st.n.reports}, "
                                                f"waiting {list(st.waiting)}", st.n.reports == 3 and not st.waiting)
    # Plan A (never run) was evicted when C and D waited; the plugin agrees.
    checks.check(f"missing: package {st.n.missing_reports}, plugin {stats['missing_reports']}", st.n.missing_reports == 1 and stats["missing_reports"] == 1)
    # A report for a plan that is no longer outstanding changes nothing.
    st.report(a, result)
    checks.check("a stale batch's report is ignored", st.n.reports == 3)
    # Our bookkeeping failing at run_batch (here the attention timer) never stops SGLang's
    # forward, and the plan still applies: every peer applies it too.
    from dpbalance_sglang.patch import scheduler as sched_hooks

    engine_step._STATE = st
    e = batch(2)
    pe = plan(e)

    def failing_begin(_active):
        raise RuntimeError("planted")

    st.timer.begin = failing_begin
    seen = []
    ran = sched_hooks.around_run_batch(lambda _self, bb: seen.append(st.usable()) or "ran",
                                       None, e)
    checks.check("a failing timer: the forward runs with its plan", ran == "ran" and seen == [pe])
    # What the report claims is what ran: a speculative batch whose lengths no hook applied
    # reports no accepted counts; one whose depth was applied reports that depth.
    st.spec = SimpleNamespace(alg="eagle", k_draft=4, full_width=True, describe=lambda: "t")
    before = st.dpb.last_step()
    st.report(e, SimpleNamespace(num_correct_drafts_per_req_cpu=[3, 3], accept_lens=None))
    checks.check("the batch was reported", st.dpb.last_step()["plan_id"] == pe.plan.plan_id)
    f_ = batch(2)
    pf = plan(f_)
    token = st.begin_run(f_)
    st.note_run("depth", 2)
    st.end_run(token)
    checks.check("the depth that ran is what is reported", st._lens_run(st.waiting[pf.seq]) == [2, 2])
    # DPBALANCE_SGLANG_DSPARK_TOPK: SGLang's own lengths (the anchor counted) are reported as
    # drafts; the flag is 0, 1 or unset, anything else read as 0.
    import torch

    g = batch(2)
    pg = plan(g)
    token = st.begin_run(g)
    st.note_run("sglang_lens", torch.tensor([1, 4], dtype=torch.int32))
    st.end_run(token)
    checks.check("SGLang's top-k lengths are reported as drafts",
                 st._lens_run(st.waiting[pg.seq]) == [0, 3])
    saved = os.environ.get("DPBALANCE_SGLANG_DSPARK_TOPK")
    try:
        for raw, want in (("", False), ("0", False), ("1", True), ("yes", False), ("2", False)):
            os.environ["DPBALANCE_SGLANG_DSPARK_TOPK"] = raw
            checks.check(f"DPBALANCE_SGLANG_DSPARK_TOPK={raw!r} reads {want}",
                         engine_step.read_dspark_topk() is want)
    finally:
        if saved is None:
            os.environ.pop("DPBALANCE_SGLANG_DSPARK_TOPK", None)
        else:
            os.environ["DPBALANCE_SGLANG_DSPARK_TOPK"] = saved
    checks.check("the plugin answers last_step", before is not None)
    checks.finish()


if __name__ == "__main__":
    sys.exit(main())
