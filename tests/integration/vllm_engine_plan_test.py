#!/usr/bin/env python3
"""dpbalance_vllm.engine_plan without vLLM: two DP ranks as threads, the real plugin library.

The module's engine-facing contract: every rank joins exactly one exchange per engine step
(from schedule() with requests, or from the idle rank's dummy batch), a step whose schedule()
already joined does not join again from the dummy batch, the verify lengths come back within
each request's cap, the ranks' exchange indices agree, and refused flags leave vLLM's defaults
with the exchange still running. vLLM's string ids go to the plugin (ABI v2) as they are.

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


def make_plan(rank, n, group, k_spec=7):
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_size=n, data_parallel_rank=rank))
    plan = engine_plan.EnginePlan(cfg, k_spec)
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
        os.environ.pop("DPBALANCE_VLLM_STEP_LOG", None)

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
        self.assertEqual(res[0], [[3, 1]] * 3)           # DPB_DEFAULT_K=3, capped
        self.assertIn("dpbInvalidArgument", plans[0].disabled_reason)
        self.assertEqual(plans[0].fallbacks.get("dpbDisabled"), 3)
        # The refused init still joins the handshake once (its refusal names the flag, so no
        # peer waits out the timeout), then one exchange per step.
        self.assertEqual(group.calls, [4, 4])

    def test_unset_plugin_does_nothing(self):
        os.environ["DPB_PLUGIN"] = "none"
        group = ThreadGroup(1)
        plan = make_plan(0, 1, group)
        self.assertFalse(plan.enabled)
        self.assertIsNone(plan.exchange([("a", 1, 3)]))
        self.assertEqual(group.calls, [0])


if __name__ == "__main__":
    if not LIB:
        sys.exit("usage: vllm_engine_plan_test.py LIBDPBALANCE_SO")
    unittest.main(verbosity=2)
