#!/usr/bin/env python3
"""dpbalance_vllm.engine_plan without vLLM: two DP ranks as threads, the real plugin library.

The module's engine-facing contract: every rank joins exactly one exchange per engine step
(from schedule() with requests, or from the idle rank's dummy batch), a step whose schedule()
already joined does not join again from the dummy batch, the verify lengths come back within
each request's cap, the ranks' exchange indices agree, and refused flags leave vLLM's defaults
with the exchange still running (also when only one rank refuses them), refused under
DPB_STRICT=1, the engine defaults the package gives the plugin (fallback = vLLM's
num_speculative_tokens, no draft cost for ngram), and the `stats` and `final` records of the step
log. vLLM's string ids go to the plugin (ABI v2) as they are.

  vllm_engine_plan_test.py LIBDPBALANCE_SO
"""
import os
import sys
import threading
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration", "vllm"))
LIB = sys.argv.pop(1) if len(sys.argv) > 1 else ""

from dpbalance_vllm import engine_plan  # noqa: E402


class ThreadGroup:
    """An all-gather of equal-size byte strings between threads (the ranks)."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=20)
        self.slots = [None] * n
        self.calls = [0] * n

    def collective(self, rank):
        def run(send: bytes) -> bytes:
            self.calls[rank] += 1
            self.slots[rank] = bytes(send)
            self.barrier.wait()
            out = b"".join(self.slots)
            self.barrier.wait()
            return out
        return run


def make_plan(rank, n, group, k_spec=7, method="ngram", check=None):
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_size=n, data_parallel_rank=rank))
    plan = engine_plan.EnginePlan(cfg, k_spec, method, check=check)
    plan._find_group = lambda: object()
    plan._collective = group.collective(rank)
    return plan


def run_ranks(fns):
    errors, results = [], [None] * len(fns)

    def wrap(i, f):
        try:
            results[i] = f()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=wrap, args=(i, f)) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]
    return results


class EnginePlanTest(unittest.TestCase):
    def setUp(self):
        self.env = dict(os.environ)
        os.environ["DPB_PLUGIN"] = LIB
        os.environ["DPB_LOG_LEVEL"] = "warn"
        # The plugin's own collective (the threads' all-gather); RideTest covers vLLM's sync.
        os.environ["DPBALANCE_VLLM_EXCHANGE"] = "own"
        for name in ("DPBALANCE_VLLM_STEP_LOG", "DPB_DEFAULT_K", "DPB_STRICT", "DPB_DRAFT_US",
                     "DPB_GUARD_MEASURED", "DPB_QUIET_AFTER", "DPB_MIN_PLAN_GAIN",
                     "PROMETHEUS_MULTIPROC_DIR",
                     "DPBALANCE_VLLM_METRICS_PORT"):
            os.environ.pop(name, None)

    def tearDown(self):
        os.environ.clear()
        os.environ.update(self.env)

    def test_vllm_string_ids_reach_the_plugin_as_they_are(self):
        # ABI v2 keys each request's acceptance history by vLLM's own id: ids that differ only
        # late in a long string, or in non-ASCII characters, are distinct requests.
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]
        long_id = "cmpl-" + "x" * 300
        reqs = [(long_id + "-0", 900, 7), (long_id + "-1", 900, 7), ("cmpl-ü-0", 300, 7)]

        def rank(r):
            def go():
                out = []
                for _ in range(12):
                    lens = plans[r].exchange(reqs if r == 0 else [])
                    if r == 0:
                        out.append(lens)
                        plans[r].after_step(1000.0, 5000.0, [(q[0], n, n, False) for q, n in
                                                             zip(reqs, lens)], sum(1 + n for n in lens))
                    else:
                        plans[r].after_step(200.0, 5000.0, [], 0)
                return out
            return go

        got = run_ranks([rank(0), rank(1)])[0]
        self.assertFalse(plans[0].fallbacks, plans[0].fallbacks)
        self.assertEqual([p.desyncs for p in plans], [0, 0])
        self.assertEqual(plans[0].dpb.last_result, 0)  # dpbSuccess: the ids were accepted
        self.assertTrue(all(len(lens) == 3 for lens in got))
        self.assertIsInstance(plans[0].dpb, engine_plan.adapter.DpBalanceV2)
        stats = plans[0].dpb.stats()
        self.assertEqual(stats["missing_reports"], 0, stats)
        self.assertGreater(stats["balanced_steps"], 0, stats)

    def test_async_scheduler_reports_each_plan_one_step_late_by_its_token(self):
        # vLLM's AsyncScheduler plans step t+1 (schedule) before it processes step t's output
        # (update_from_output). Each report must reach the plugin as the plan it was made for
        # (its plan id), not as the latest plan, and the step log must name that step.
        # Quiet mode off: every step exchanges (quiet steps: the test below).
        os.environ["DPB_QUIET_AFTER"] = "0"
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]
        reqs = [("a", 4000, 7), ("b", 300, 7), ("c", 900, 2)]

        def rank0():
            p, made, paired = plans[0], [], []
            for step in range(10):
                p.begin_step()                     # schedule() of step t
                lens = p.exchange(reqs)
                made.append((p.last_token, p.last_plan.plan_id, lens))
                if step > 0:                       # update_from_output() of step t - 1
                    token, plan_id, prev = made[-2]
                    p.after_step(1000.0, 5000.0, [(q[0], n, n, False) for q, n in zip(reqs, prev)],
                                 sum(1 + n for n in prev), token=token)
                    paired.append((plan_id, p.last_step["plan_id"]))
            token, plan_id, prev = made[-1]
            p.after_step(1000.0, 5000.0, [], 0, token=token)
            paired.append((plan_id, p.last_step["plan_id"]))
            return paired

        def rank1():
            for _ in range(10):
                plans[1].begin_step()
                plans[1].join_idle()               # the idle rank's dummy batch
                plans[1].after_step(200.0, 5000.0, [], 0)

        paired = run_ranks([rank0, rank1])[0]
        self.assertEqual(len(paired), 10)
        for made_id, reported_id in paired:
            self.assertEqual(made_id, reported_id)
        self.assertEqual([p.exchanges for p in plans], [10, 10])
        self.assertEqual([p.desyncs for p in plans], [0, 0])
        self.assertFalse(plans[0].fallbacks, plans[0].fallbacks)
        self.assertFalse(plans[0]._outstanding)   # every plan reported
        stats = plans[0].dpb.stats()
        self.assertEqual(stats["missing_reports"], 0, stats)

    def test_async_scheduler_mixin_pairs_each_output_with_its_own_plan(self):
        # scheduler.py's mixin on a stand-in for vLLM's AsyncScheduler (vLLM itself does not run
        # async on CPU): schedule() advances num_computed_tokens by every scheduled token and
        # counts them in num_output_placeholders; update_from_output() rolls the rejected
        # drafts back. Step t+1 is scheduled before step t's output. The plan must see each
        # request's context as last seen (committed tokens only), and each output must be
        # reported with the token of the plan made for its step, whose lengths it ran.
        class AsyncBase:
            def __init__(self, running):
                self.running, self.waiting = running, []
                self.requests = {r.request_id: r for r in running}
                self.max_num_scheduled_tokens, self.max_num_running_reqs = 8192, 16
                self.vllm_config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
                    num_speculative_tokens=4, method="ngram"))

            def has_unfinished_requests(self):
                return bool(self.running)

            def schedule(self):
                spec = {r.request_id: list(r.spec_token_ids) for r in self.running}
                so = types.SimpleNamespace(scheduled_spec_decode_tokens=spec,
                                           total_num_scheduled_tokens=sum(1 + len(d) for d in spec.values()))
                for r in self.running:
                    n = 1 + len(spec[r.request_id])
                    r.num_computed_tokens += n
                    r.num_output_placeholders += n
                    r.spec_token_ids = [-1] * 4
                return so

            def update_from_output(self, so, out):
                for i, r in enumerate(self.running):
                    drafts = len(so.scheduled_spec_decode_tokens[r.request_id])
                    acc = len(out.sampled_token_ids[i]) - 1
                    r.num_computed_tokens -= drafts - acc
                    r.num_output_placeholders -= 1 + drafts
                    r.num_output_tokens += 1 + acc
                return None

        def request(rid, prompt):
            return types.SimpleNamespace(request_id=rid, num_prompt_tokens=prompt,
                                         num_computed_tokens=prompt, num_output_placeholders=0,
                                         num_output_tokens=0, max_tokens=200, spec_token_ids=[7] * 4,
                                         is_finished=lambda: False)

        stubs = {n: types.ModuleType(n) for n in ("vllm", "vllm.v1", "vllm.v1.core",
                                                 "vllm.v1.core.sched", "vllm.v1.core.sched.scheduler",
                                                 "vllm.v1.core.sched.async_scheduler")}
        stubs["vllm.v1.core.sched.scheduler"].Scheduler = AsyncBase
        stubs["vllm.v1.core.sched.async_scheduler"].AsyncScheduler = AsyncBase
        saved = {n: sys.modules.get(n) for n in list(stubs) + ["dpbalance_vllm.scheduler"]}
        sys.modules.update(stubs)
        sys.modules.pop("dpbalance_vllm.scheduler", None)
        try:
            from dpbalance_vllm import scheduler
            plan = make_plan(0, 1, ThreadGroup(1), k_spec=4)
            planned, reported, seen_ctx = {}, [], []
            exchange, after_step = plan.exchange, plan.after_step

            def forced_exchange(rows, extra_tokens=0):  # lengths that differ step to step
                exchange(rows, extra_tokens=extra_tokens)
                seen_ctx.append([row[1] for row in rows])
                lens = [min(row[2], 1 + plan.last_token % 3) for row in rows]
                planned[plan.last_token] = lens
                return lens

            def recorded_after_step(att, step_us, accepted, tokens, token=None, worker=None):
                reported.append((token, [a[1] for a in accepted]))
                after_step(att, step_us, accepted, tokens, token=token)

            plan.exchange, plan.after_step = forced_exchange, recorded_after_step
            engine_plan._PLAN = plan

            class Sched(scheduler._DpbMixin, AsyncBase):
                def __init__(self, running):
                    AsyncBase.__init__(self, running)
                    self._dpb_init()

            reqs = [request("a", 1000), request("b", 300)]
            sched = Sched(reqs)
            committed = {"a": 1000, "b": 300}
            pending = []
            for step in range(8):
                expected = [committed["a"], committed["b"]]  # what the engine has seen
                pending.append(sched.schedule())
                self.assertEqual(seen_ctx[-1], expected, step)
                if len(pending) == 2:  # the older step's output, after the newer was scheduled
                    so = pending.pop(0)
                    sampled = [[1] * (1 + len(so.scheduled_spec_decode_tokens[r.request_id]) // 2)
                               for r in reqs]
                    out = types.SimpleNamespace(sampled_token_ids=sampled, req_id_to_index={"a": 0, "b": 1})
                    sched.update_from_output(so, out)
                    for r, s in zip(reqs, sampled):
                        committed[r.request_id] += len(s)
            self.assertEqual(len(reported), 7)
            for token, lens in reported:
                self.assertIsNotNone(token)
                self.assertEqual(lens, planned[token], (token, lens, planned))
            self.assertEqual([t for t, _ in reported], list(range(len(reported))))
            self.assertEqual(plan.desyncs, 0)
        finally:
            engine_plan._PLAN = None
            for n, m in saved.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m

    def test_prefill_beside_the_decodes_is_an_extend_step_on_every_rank(self):
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]
        reqs = [("req-a", 3000, 7), ("req-b", 200, 7)]

        def rank(r):
            def go():
                plans[r].exchange(reqs if r == 0 else [], extra_tokens=512 if r == 0 else 0)
                plans[r].after_step(1000.0, 5000.0, [], 0)
                return plans[r].last_plan
            return go

        got = run_ranks([rank(0), rank(1)])
        a = engine_plan.adapter
        for res in got:  # both ranks see rank 0 extend and rank 1 idle, from the one exchange
            self.assertIsNotNone(res)
            self.assertTrue(res.rank_flags[0] & a.RANK_EXTEND, res.rank_flags)
            self.assertTrue(res.rank_flags[1] & a.RANK_IDLE, res.rank_flags)
            self.assertGreaterEqual(res.rank_tokens[0], 512 + 2)

    def test_active_and_idle_rank_join_one_exchange_per_step(self):
        os.environ["DPB_QUIET_AFTER"] = "0"  # every step exchanges (quiet steps: below)
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]
        reqs = [("req-a", 3000, 7), ("req-b", 200, 7), ("req-c", 100, 2)]
        steps = 30
        got = []

        def active():
            for _ in range(steps):
                lens = plans[0].exchange(reqs)           # from schedule()
                got.append(lens)
                plans[0].after_step(1000.0, 5000.0, [(r[0], n, n, False) for r, n in
                                                     zip(reqs, lens)], sum(1 + n for n in lens))
            return True

        def idle():
            for _ in range(steps):
                plans[1].join_idle()                     # from the dummy batch
                plans[1].after_step(200.0, 5000.0, [], 0)
            return True

        run_ranks([active, idle])
        self.assertEqual(group.calls, [steps + 1, steps + 1])  # + init's handshake
        self.assertEqual([p.exchanges for p in plans], [steps, steps])
        self.assertEqual([p.desyncs for p in plans], [0, 0])
        for lens in got:
            self.assertEqual(len(lens), 3)
            for (_, _, cap), n in zip(reqs, lens):
                self.assertTrue(0 <= n <= cap, (lens, reqs))
        self.assertFalse(plans[0].fallbacks, plans[0].fallbacks)

    def test_schedule_with_nothing_scheduled_then_dummy_joins_once(self):
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]

        def rank0():
            # schedule() joined (requests waiting, none scheduled); the busy loop then runs the
            # dummy batch, which must not join a second exchange.
            plans[0].exchange([("w", 10, 0)])
            plans[0].join_idle()
            plans[0].after_step(100.0, 100.0, [], 0)
            plans[0].join_idle()                         # the next step, idle
            plans[0].after_step(100.0, 100.0, [], 0)

        def rank1():
            for _ in range(2):
                plans[1].join_idle()
                plans[1].after_step(100.0, 100.0, [], 0)

        run_ranks([rank0, rank1])
        self.assertEqual(group.calls[0], group.calls[1])
        self.assertEqual([p.exchanges for p in plans], [2, 2])

    def test_a_stale_flag_does_not_skip_the_next_scheduled_exchange(self):
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]

        def rank0():
            plans[0].begin_step()
            plans[0].exchange([("w", 10, 0)])   # nothing scheduled, and no dummy batch ran
            plans[0].begin_step()               # the next step's schedule()
            plans[0].exchange([("w", 10, 3)])
            plans[0].after_step(1.0, 1.0, [], 1)

        def rank1():
            for _ in range(2):
                plans[1].join_idle()
                plans[1].after_step(1.0, 1.0, [], 0)

        run_ranks([rank0, rank1])
        self.assertEqual([p.exchanges for p in plans], [2, 2])
        self.assertEqual(plans[0].stale_steps, 1)
        self.assertEqual([p.desyncs for p in plans], [0, 0])

    def test_refused_flags_keep_defaults_and_the_exchange(self):
        os.environ["DPB_MODE"] = "sideways"
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]
        reqs = [("x", 500, 7), ("y", 50, 1)]

        def rank(r):
            def f():
                out = []
                for _ in range(3):
                    out.append(plans[r].exchange(reqs) if r == 0 else plans[r].join_idle())
                    plans[r].after_step(10.0, 10.0, [], 0)
                return out
            return f

        res = run_ranks([rank(0), rank(1)])
        # The fallback is vLLM's own length, num_speculative_tokens = 7, capped by each request.
        self.assertEqual(res[0], [[7, 1]] * 3)
        self.assertIn("environment variable DPB_MODE: 'sideways'", plans[0].disabled_reason)
        self.assertEqual(plans[0].fallbacks.get("config"), 3)
        self.assertIsNone(plans[0].dpb)
        # The handshake's stand-in (peers' plugins may run one), then one exchange per step.
        self.assertEqual(group.calls, [4, 4])

    def test_refused_flags_under_strict_stop_the_engine_core(self):
        os.environ["DPB_MODE"] = "sideways"
        os.environ["DPB_STRICT"] = "1"
        with self.assertRaises(RuntimeError) as e:
            make_plan(0, 2, ThreadGroup(2))
        self.assertIn("DPB_MODE: 'sideways' is not", str(e.exception))
        self.assertIn("DPB_STRICT=1: refusing to start", str(e.exception))
        os.environ["DPB_STRICT"] = "yes"  # neither 0 nor 1: strict, and said so
        os.environ.pop("DPB_MODE")
        with self.assertRaises(RuntimeError) as e:
            make_plan(0, 2, ThreadGroup(2))
        self.assertIn("DPB_STRICT: 'yes' is not 0 or 1", str(e.exception))

    def test_package_settings_are_checked_at_start(self):
        cases = {"DPBALANCE_VLLM_STATS_EVERY_S": ("soon", "'soon' is not a number"),
                 "DPBALANCE_VLLM_METRICS_PORT": ("70000", "70000 is not in 0..65535"),
                 "DPBALANCE_VLLM_STEP_LOG": ("/proc/no/such", "'/proc/no/such' cannot be created"),
                 "DPB_COST_MODEL": ("/nonexistent/model.json", "/nonexistent/model.json")}
        for name, (value, says) in cases.items():
            os.environ[name] = value
            plan = make_plan(0, 1, ThreadGroup(1))
            self.assertIn(says, plan.disabled_reason, name)
            self.assertIn(name, plan.disabled_reason)
            self.assertTrue(plan.enabled)      # still joins the exchange
            self.assertEqual(plan.exchange([("a", 10, 5)]), [5])  # at vLLM's own length
            del os.environ[name]

    def test_a_rank_refused_alone_leaves_no_peer_waiting(self):
        # Rank 0's settings are refused (a file missing on its node, say), rank 1's are fine:
        # rank 0 joins rank 1's handshake with a zero record, so both step on, at the fallback.
        group = ThreadGroup(2)
        refuse = lambda config, dp: (False, "flag 'cost_model' ...: no such file", {})  # noqa: E731
        plans = [make_plan(0, 2, group, check=refuse), make_plan(1, 2, group)]
        reqs = [("x", 500, 7), ("y", 50, 2)]

        def rank(r):
            def f():
                out = []
                for _ in range(5):
                    out.append(plans[r].exchange(reqs))
                    plans[r].after_step(100.0, 1000.0, [], 2)
                return out
            return f

        res = run_ranks([rank(0), rank(1)])
        self.assertEqual(res, [[[7, 2]] * 5] * 2)
        self.assertEqual(group.calls, [6, 6])
        self.assertEqual(plans[0].fallbacks, {"config": 5})
        self.assertNotIn("dpbSuccess", plans[1].fallbacks)
        self.assertEqual(sum(plans[1].fallbacks.values()), 5)

    def test_quiet_steps_skip_the_collective_on_every_rank_alike(self):
        # The package's default quiet mode (quiet_after=8, spans up to 32): with a default
        # guard no plan beats, every decision keeps vLLM's lengths, so after steps 0-8 the
        # ranks skip the all-reduce on the same steps (spans 8, 16, 32: exchanges at 0-8, 17,
        # 34, 67 of 80 steps), the step log's index still counts every step, the exchange
        # indices agree at every exchange, and each plan still reaches its report. With
        # DPB_QUIET_AFTER=0 every step runs the collective.
        reqs = [("a", 3000, 7), ("b", 200, 7)]

        def run(quiet_after):  # rank 1 is idle: it joins from the dummy batch
            os.environ["DPB_MIN_PLAN_GAIN"] = "10"
            # The spans' arithmetic from the first steps (learnt step terms hold quiet mode back
            # until their fit settles: balancer_test's QuietModeWaitsForTheStepTermsToSettle).
            os.environ["DPB_LEARN_STEP_TERMS"] = "0"
            if quiet_after is not None:
                os.environ["DPB_QUIET_AFTER"] = str(quiet_after)
            group = ThreadGroup(2)
            plans = [make_plan(r, 2, group) for r in range(2)]

            def rank(r):
                def go():
                    tokens, out = [], []
                    for _ in range(80):
                        plans[r].begin_step()
                        if r == 0:
                            lens = plans[r].exchange(reqs)
                            acc = [(q[0], n, n, False) for q, n in zip(reqs, lens)]
                        else:
                            plans[r].join_idle()
                            lens, acc = [], []
                        tokens.append(plans[r].last_token)
                        out.append(lens)
                        plans[r].after_step(900.0, 2000.0, acc, 4)
                    stats = plans[r].stats()
                    return tokens, out, stats
                return go

            res = run_ranks([rank(0), rank(1)])
            for p in plans:
                p.close()
            return group, plans, res

        group, plans, res = run(None)
        self.assertEqual(group.calls, [1 + 12, 1 + 12])  # the handshake, then the exchanges
        for r, ((tokens, lens, stats), p) in enumerate(zip(res, plans)):
            self.assertEqual(tokens, list(range(80)))
            self.assertEqual(lens, [[7, 7] if r == 0 else []] * 80)
            self.assertEqual((p.steps, p.exchanges, p.pb.quiet_steps, p.desyncs), (80, 12, 68, 0))
            self.assertEqual((stats["steps"], stats["exchanges"], stats["quiet_steps"]), (80, 12, 68))
            self.assertFalse(p.fallbacks, p.fallbacks)
            self.assertEqual(stats["missing_reports"], 0)
        group, plans, res = run(0)
        self.assertEqual(group.calls, [81, 81])
        self.assertEqual([p.pb.quiet_steps for p in plans], [0, 0])

    def test_engine_defaults_for_the_plugin(self):
        plan = make_plan(0, 1, ThreadGroup(1), k_spec=5, method="ngram")
        self.assertEqual(plan.cfg.plugin_config, "k_max=5;default_k=5;draft_us=0;guard_measured=1;quiet_after=8")
        self.assertEqual(plan.cfg.settings["draft_us"], "0")
        self.assertEqual(plan.cfg.settings["guard_measured"], "1")
        self.assertIn("counting 0 us + its measured own time", plan.cfg.startup_line())
        self.assertEqual(plan.default_k, 5)
        plan = make_plan(0, 1, ThreadGroup(1), k_spec=3, method="eagle")  # a model drafts
        # vLLM's model drafters draft num_speculative_tokens every step: the depth is fixed.
        self.assertEqual(plan.cfg.plugin_config,
                         "k_max=3;default_k=3;depths=3;guard_measured=1;quiet_after=8")
        self.assertEqual(plan.cfg.settings["draft_us"], "1500")
        self.assertIn("quiet after 8 kept-default steps, spans up to 32", plan.cfg.startup_line())
        os.environ["DPB_DEFAULT_K"] = "2"  # a fallback shorter than what the model drafts
        plan = make_plan(0, 1, ThreadGroup(1), k_spec=3, method="eagle")
        self.assertIn("DPB_DEFAULT_K: 2 with the model drafter 'eagle'", plan.cfg.error)
        os.environ.update(DPB_DEFAULT_K="2", DPB_DRAFT_US="40", DPB_GUARD_MEASURED="0",
                          DPB_QUIET_AFTER="0")
        plan = make_plan(0, 1, ThreadGroup(1), k_spec=7, method="ngram")
        self.assertEqual(plan.cfg.plugin_config, "k_max=7")
        self.assertEqual(plan.cfg.settings["guard_measured"], "0")
        self.assertEqual(plan.cfg.settings["quiet_after"], "0")
        self.assertEqual((plan.default_k, plan.cfg.settings["draft_us"]), (2, "40"))
        self.assertIn("fallback verify length 2 (DPB_DEFAULT_K=2)", plan.cfg.startup_line())

    def test_final_and_periodic_stats_records(self):
        import json
        import tempfile
        d = tempfile.mkdtemp()
        os.environ.update(DPBALANCE_VLLM_STEP_LOG=d, DPBALANCE_VLLM_STATS_EVERY_S="0.1")
        group = ThreadGroup(2)
        plans = [make_plan(r, 2, group) for r in range(2)]
        reqs = [("a", 3000, 7), ("b", 200, 7)]

        def rank(r):
            def f():
                import time
                for step in range(6):
                    lens = plans[r].exchange(reqs if r == 0 else [])
                    time.sleep(0.05)
                    plans[r].after_step(900.0 if r == 0 else 300.0, 2000.0,
                                        [(q[0], n, n, False) for q, n in zip(reqs, lens)]
                                        if r == 0 else [], 5)
                plans[r].close()
                plans[r].close()  # idempotent: the scheduler's shutdown comes after the executor's
            return f

        run_ranks([rank(0), rank(1)])
        for r in range(2):
            rows = [json.loads(line) for line in open(os.path.join(d, f"engine_dp{r}.jsonl"))]
            self.assertEqual(sum("final" in row for row in rows), 1, r)
            self.assertIn("final", rows[-1])
            self.assertGreaterEqual(sum("stats" in row for row in rows), 1, r)
            final = rows[-1]["final"]
            self.assertEqual((final["dp_rank"], final["exchanges"], final["desyncs"]), (r, 6, 0))
            steps = [row for row in rows if "x" in row]
            self.assertEqual(len(steps), 6)
        # Rank 0 waited 0 at the barrier (slowest), rank 1 waited 600 of every 900 us.
        self.assertAlmostEqual(plans[0]._window.ratio(), 0.0)
        self.assertAlmostEqual(plans[1]._window.ratio(), 600 / 900)
        # The prediction of a balanced step is in rank 0's step rows.
        rows = [json.loads(line) for line in open(os.path.join(d, "engine_dp0.jsonl"))]
        self.assertTrue(any(row.get("pred_us") for row in rows if "x" in row), rows)

    def test_unset_plugin_does_nothing(self):
        os.environ["DPB_PLUGIN"] = "none"
        group = ThreadGroup(1)
        plan = make_plan(0, 1, group)
        self.assertFalse(plan.enabled)
        self.assertIsNone(plan.exchange([("a", 1, 3)]))
        self.assertEqual(group.calls, [0])


class RideTest(unittest.TestCase):
    """The exchange riding vLLM's own DP sync (dp_ride.py): the plan call hands its record to
    the step's forward, whose sync gathers every rank's (here the threads' all-gather, playing
    `coordinate_batch_across_dp` in the worker), and the next step plans from those. The package
    runs no collective of its own after init's handshake."""

    def setUp(self):
        self.env = dict(os.environ)
        os.environ["DPB_PLUGIN"] = LIB
        os.environ["DPB_LOG_LEVEL"] = "warn"
        for name in ("DPBALANCE_VLLM_STEP_LOG", "DPB_DEFAULT_K", "DPB_STRICT", "DPB_DRAFT_US",
                     "DPB_GUARD_MEASURED", "DPB_QUIET_AFTER", "DPB_MIN_PLAN_GAIN",
                     "PROMETHEUS_MULTIPROC_DIR", "DPBALANCE_VLLM_METRICS_PORT",
                     "DPBALANCE_VLLM_EXCHANGE", "DPBALANCE_VLLM_BYPASS_EPOCH", "DPB_AB_EPOCH"):
            os.environ.pop(name, None)

    def tearDown(self):
        os.environ.clear()
        os.environ.update(self.env)

    def run_ride(self, steps, lag=1, idle_rank1=False, unrun=None):
        own = ThreadGroup(2)   # the engine core's DP group: init's handshake only
        sync = ThreadGroup(2)  # vLLM's per-step sync in the worker
        plans = []
        for r in range(2):
            p = make_plan(r, 2, own)
            p.lag = lag
            plans.append(p)
        reqs = [[("a", 6000, 7), ("b", 5000, 7), ("c", 4000, 7)], [("d", 100, 7), ("e", 200, 7)]]
        got = [[], []]
        zero = bytes(engine_plan.CARRY_BYTES)

        def rank(r):
            def go():
                p = plans[r]
                backlog = []  # gathered records not yet processed (the async scheduler's lag)
                for x in range(steps):
                    if unrun is not None and unrun == (r, x):
                        # A schedule() that planned a step vLLM then never ran (nothing
                        # scheduled and no dummy batch): no forward, no sync, no report.
                        p.begin_step()
                        p.exchange(reqs[r])
                    p.begin_step()
                    if r == 1 and idle_rank1:
                        p.join_idle()
                        lens = []
                    else:
                        lens = p.exchange(reqs[r])
                    got[r].append(lens)
                    backlog.append(sync.collective(r)(p.take_carry() or zero))
                    while len(backlog) >= lag:  # update_from_output of the oldest step
                        p.received(backlog.pop(0))
                    att = 4000.0 if r == 0 else 500.0
                    p.after_step(att, 6000.0, [(q[0], n, n // 2, False) for q, n in
                                               zip(reqs[r], lens)], sum(1 + n for n in lens))
                return True
            return go

        run_ranks([rank(0), rank(1)])
        return plans, own, sync, got, reqs

    def test_plans_ride_the_sync_with_no_collective_of_their_own(self):
        steps = 40
        plans, own, sync, got, reqs = self.run_ride(steps)
        self.assertEqual(own.calls, [1, 1])  # init's handshake, and nothing after it
        self.assertEqual([p.own_collectives for p in plans], [1, 1])
        self.assertEqual(sync.calls, [steps, steps])
        self.assertTrue(all(p.ride for p in plans))
        # Step 0 has no records yet (every rank at its defaults); every later step plans from
        # the records of the step before, the same index on both ranks.
        self.assertEqual([p.carried for p in plans], [steps - 1, steps - 1])
        self.assertEqual([p.desyncs for p in plans], [0, 0])
        self.assertEqual(plans[0].stats()["quiet_steps"], 0)
        stats = [p.dpb.stats() for p in plans]
        for st in stats:
            self.assertGreater(st["balanced_steps"], steps // 2, st)
        # Balanced from one-step-old records: the long-context rank verifies less than its
        # default (7), the short one keeps more.
        self.assertLess(sum(map(sum, got[0][5:])), 7 * 3 * (steps - 5))
        for r in range(2):
            for lens in got[r][1:]:
                self.assertTrue(all(0 <= n <= 7 for n in lens), lens)
        self.assertEqual(plans[0].stats()["exchange"], "ride")

    def test_an_idle_rank_rides_its_dummy_forward(self):
        steps = 20
        plans, own, sync, got, _ = self.run_ride(steps, idle_rank1=True)
        self.assertEqual(own.calls, [1, 1])
        self.assertEqual([p.carried for p in plans], [steps - 1, steps - 1])
        self.assertEqual([p.desyncs for p in plans], [0, 0])
        self.assertGreater(plans[0].dpb.stats()["balanced_steps"], 0)

    def test_a_plan_vllm_never_ran_leaves_no_gap(self):
        """A rank whose schedule() planned a step that vLLM then did not run (seen at a
        `vllm serve` shutdown: 27 plans on one rank, 26 on the other, 26 syncs each) hands no
        record to any sync. The records are labelled by the sync they ride, not by the plans
        made, so both ranks go on reading the same records: nothing missing, no desync."""
        steps = 20
        for lag in (1, 2):
            plans, own, sync, got, _ = self.run_ride(steps, lag=lag, unrun=(1, 7))
            self.assertEqual(sync.calls, [steps, steps])
            self.assertEqual([p.steps for p in plans], [steps, steps + 1])
            self.assertEqual([p.stats()["unsent"] for p in plans], [0, 1])
            self.assertEqual([p.missing for p in plans], [0, 0], lag)
            self.assertEqual([p.desyncs for p in plans], [0, 0], lag)
            self.assertEqual([p.carried for p in plans], [steps - lag, steps + 1 - lag], lag)
            self.assertGreater(plans[0].dpb.stats()["balanced_steps"], steps // 2)

    def test_the_async_scheduler_plans_from_two_steps_back(self):
        steps = 20
        plans, own, sync, got, _ = self.run_ride(steps, lag=2)
        self.assertEqual(own.calls, [1, 1])
        self.assertEqual([p.carried for p in plans], [steps - 2, steps - 2])
        self.assertEqual([p.missing for p in plans], [0, 0])  # steps 0, 1: nothing to read yet
        self.assertEqual([p.desyncs for p in plans], [0, 0])

    def test_bypass_epochs_run_vllm_as_shipped_on_every_rank_alike(self):
        """DPBALANCE_VLLM_BYPASS_EPOCH=4: steps 4-7, 12-15, ... call no plugin on any rank and
        run the fallback lengths; the others plan as usual, from the records of the step
        before when it was planned too. The step log marks each step's arm."""
        import json
        import tempfile
        steps, epoch = 40, 4
        os.environ["DPBALANCE_VLLM_BYPASS_EPOCH"] = str(epoch)
        with tempfile.TemporaryDirectory() as d:
            os.environ["DPBALANCE_VLLM_STEP_LOG"] = d
            plans, own, sync, got, reqs = self.run_ride(steps)
            for p in plans:
                p.close()
            logs = [[json.loads(x) for x in open(os.path.join(d, f"engine_dp{r}.jsonl"))
                     if x.startswith('{"x"')] for r in range(2)]
        self.assertEqual([p.cfg.error for p in plans], ["", ""])
        self.assertEqual(own.calls, [1, 1])
        self.assertEqual(sync.calls, [steps, steps])  # vLLM's sync runs every step, as shipped
        self.assertEqual([p.bypassed for p in plans], [steps // 2, steps // 2])
        # Each balanced epoch after the first plans from its own records from its second step
        # on; its first step finds the bypassed step's none, which is not a missing record.
        self.assertEqual([p.carried for p in plans], [(epoch - 1) * steps // (2 * epoch)] * 2)
        self.assertEqual([p.missing for p in plans], [0, 0])
        self.assertEqual([p.desyncs for p in plans], [0, 0])
        stats = [p.stats() for p in plans]
        self.assertEqual([s["bypassed"] for s in stats], [steps // 2] * 2)
        for r in range(2):
            self.assertEqual(len(logs[r]), steps)
            for x, (lens, row) in enumerate(zip(got[r], logs[r])):
                off = (x // epoch) % 2 == 1
                self.assertEqual(row["x"], x)
                self.assertEqual(row["result"] == "bypass", off, row)
                self.assertEqual(row["arm_on"], not off, row)
                if off:
                    self.assertEqual(lens, [7] * len(reqs[r]), x)
                    self.assertIsNone(row["plan_us"])
        # Balanced in the planned epochs: the long-context rank verifies less than its default.
        on = [lens for x, lens in enumerate(got[0]) if (x // epoch) % 2 == 0 and x % epoch]
        self.assertLess(sum(map(sum, on)), 7 * 3 * len(on))

    def test_bad_bypass_epochs_are_named(self):
        os.environ["DPBALANCE_VLLM_BYPASS_EPOCH"] = "two"
        plan = make_plan(0, 2, ThreadGroup(2))
        self.assertIn("DPBALANCE_VLLM_BYPASS_EPOCH: 'two'", plan.cfg.error)
        os.environ["DPBALANCE_VLLM_BYPASS_EPOCH"] = "4"
        os.environ["DPB_AB_EPOCH"] = "2"
        plan = make_plan(0, 2, ThreadGroup(2))
        self.assertIn("DPBALANCE_VLLM_BYPASS_EPOCH: 4 with DPB_AB_EPOCH=2", plan.cfg.error)
        self.assertEqual(plan.bypass_epoch, 0)  # refused: the rank runs the fallback throughout

    def test_quiet_mode_is_refused_when_riding(self):
        os.environ["DPB_QUIET_AFTER"] = "8"
        plan = make_plan(0, 2, ThreadGroup(2))
        self.assertIn("DPB_QUIET_AFTER", plan.cfg.error)
        self.assertIn("DPBALANCE_VLLM_EXCHANGE", plan.cfg.error)

    def test_a_bad_exchange_value_is_named(self):
        os.environ["DPBALANCE_VLLM_EXCHANGE"] = "nccl"
        plan = make_plan(0, 2, ThreadGroup(2))
        self.assertIn("DPBALANCE_VLLM_EXCHANGE: 'nccl'", plan.cfg.error)


if __name__ == "__main__":
    if not LIB:
        sys.exit("usage: vllm_engine_plan_test.py LIBDPBALANCE_SO")
    unittest.main(verbosity=2)
