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
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

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
    check(pa.exchanged and pb.exchanged, "one rank's plans are exchanged")
    token = st.begin_run(a)
    check(st.usable() is None, "the stale batch's plan is not the running one")
    st.end_run(token)
    check(st.n.stale_dropped == 1, f"stale plans counted: {st.n.stale_dropped}")
    token = st.begin_run(b)
    check(st.usable() is pb, "the latest batch's plan is the running one")
    st.end_run(token)
    # SGLang's own copy, with the package's AFTER hook, keeps the plan; its report settles it.
    copied = ScheduleBatch.copy(b)
    copy_hook.after_copy(copied, b)
    check(copied is not b and copied.dpb_plan is pb, "ScheduleBatch.copy keeps the plan")
    result = SimpleNamespace(num_correct_drafts_per_req_cpu=[1, 2], accept_lens=None)
    st.report(copied, result)
    check(st.n.reports == 1 and pb.plan.plan_id not in st.outstanding,
          "the copy's report settles the latest plan")
    # Out of order: plan C (in flight), plan D (every rank idle: reported at once), then C.
    c, d = batch(2), batch(0)
    pc, pd = plan(c), plan(d)
    st.report_plan(pd)
    st.report(c, SimpleNamespace(num_correct_drafts_per_req_cpu=[0, 3], accept_lens=None))
    stats = st.dpb.stats()
    check(st.n.reports == 3 and not st.outstanding, f"both reported: {st.n.reports}, "
                                                   f"outstanding {list(st.outstanding)}")
    # Plan A (never run) was evicted when C and D waited; the plugin agrees.
    check(st.n.missing_reports == 1 and stats["missing_reports"] == 1,
          f"missing: package {st.n.missing_reports}, plugin {stats['missing_reports']}")
    # A report for a plan that is no longer outstanding changes nothing.
    st.report(a, result)
    check(st.n.reports == 3, "a stale batch's report is ignored")
    # Our bookkeeping failing at run_batch (here the attention timer) never stops SGLang's
    # forward, and the plan still applies: every peer applies it too.
    from dpbalance_sglang.patch import scheduler as sched_hooks

    engine_step._STATE = st
    e = batch(2)
    pe = plan(e)

    def failing_begin(_seq):
        raise RuntimeError("planted")

    st.timer.begin = failing_begin
    seen = []
    ran = sched_hooks.around_run_batch(lambda _self, bb: seen.append(st.usable()) or "ran",
                                       None, e)
    check(ran == "ran" and seen == [pe], "a failing timer: the forward runs with its plan")
    # What the report claims is what ran: a speculative batch whose lengths no hook applied
    # reports no accepted counts; one whose depth was applied reports that depth.
    st.spec = SimpleNamespace(alg="eagle", k_draft=4, full_width=True, describe=lambda: "t")
    before = st.dpb.last_step()
    st.report(e, SimpleNamespace(num_correct_drafts_per_req_cpu=[3, 3], accept_lens=None))
    check(st.dpb.last_step()["plan_id"] == pe.plan.plan_id, "the batch was reported")
    f_, g_ = batch(2), None
    pf = plan(f_)
    token = st.begin_run(f_)
    st.note_run("depth", 2)
    st.end_run(token)
    check(st._lens_run(pf) == [2, 2], f"the depth that ran is what is reported: "
                                      f"{st.ran}")
    check(before is not None, "the plugin answers last_step")
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
