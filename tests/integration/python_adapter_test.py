"""The Python adapter (integration/adapters/python) against the real plugin library.

Usage: python3 python_adapter_test.py PLUGIN_SO ABI_LAYOUT
(ctest passes the built libdpbalance.so and the abi_layout program, which prints the C
structs' layout as the compiler laid them out)

Ranks are threads of one process, or processes sharing memory; their all-gather is a Python
callable (the engine-callback backend), as a Python engine's CPU group would be. Two more
cases run two processes over a real torch.distributed gloo group through `torch_allgather`;
torch is required (scripts/install_deps.sh installs python3-torch): without it they fail.
"""
import ctypes
import os
import random
import struct
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration", "adapters", "python"))
import dpbalance_plugin as dpb  # noqa: E402

PLUGIN = None
ABI_LAYOUT = None
COMMON = "mode=goodput;k_max=7;default_k=3;log_every=0;timeout_ms=5000;log_level=error"


class ThreadGroup:
    """An all-gather among threads: what a CPU process group does across processes."""

    def __init__(self, n):
        self.n = n
        self.slots = [None] * n
        self.arrive = threading.Barrier(n)
        self.leave = threading.Barrier(n)
        self.fail_steps = set()  # calls (counted per rank) on which every rank's callback raises
        self.short_steps = set()  # calls on which every rank returns a truncated buffer
        self.calls = [0] * n

    def member(self, rank):
        def allgather(send, timeout_ms):
            call = self.calls[rank]
            self.calls[rank] += 1
            if call in self.fail_steps:
                raise ConnectionError(f"injected failure on call {call}")
            self.slots[rank] = send
            self.arrive.wait(timeout_ms / 1000)
            out = b"".join(self.slots)
            self.leave.wait(timeout_ms / 1000)
            return out[:-1] if call in self.short_steps else out
        return allgather


class LateGroup:
    """An all-gather like gloo's or NCCL's: a rank's record is delivered once it is deposited,
    even if that rank then stops waiting. `late[(rank, call)]` delays a rank's arrival;
    `patience[rank]` is how long it waits (default: the plugin's timeout)."""

    def __init__(self, n, late, patience):
        self.n, self.late, self.patience = n, late, patience
        self.slots = {}
        self.cv = threading.Condition()

    def member(self, rank):
        calls = [0]

        def allgather(send, timeout_ms):
            call = calls[0]
            calls[0] += 1
            time.sleep(self.late.get((rank, call), 0))
            with self.cv:
                got = self.slots.setdefault(call, {})
                got[rank] = send
                self.cv.notify_all()
                if not self.cv.wait_for(lambda: len(got) == self.n,
                                        self.patience.get(rank, timeout_ms / 1000)):
                    raise TimeoutError(f"rank {rank}: a peer is late on call {call}")
                return b"".join(got[r] for r in range(self.n))
        return allgather


def attention_us(requests, lens):
    # A rank's attention time grows with its query tokens and their context.
    q = [1 + k for k in lens]
    return 2000.0 + sum(300.0 * qi + 0.02 * qi * r.ctx_tokens for qi, r in zip(q, requests))


def run_steps(bal, rank, steps, batch_of, rng, plan=None):
    """One rank's decode loop: plan, check the lengths' bounds, report. Returns its record.
    `plan(requests, step) -> (lens, depth)` replaces `bal.plan` (the piggyback cases)."""
    rec = {"lens": [], "depths": [], "results": []}
    for step in range(steps):
        reqs = batch_of(rank, step, rng)
        lens, depth = plan(reqs, step) if plan else bal.plan(reqs)
        rec["lens"].append(lens)
        rec["depths"].append(depth)
        rec["results"].append(bal.last_result)
        for r, k in zip(reqs, lens):
            assert r.k_min <= k <= r.k_cap, (r, k)
        a = attention_us(reqs, lens)
        bal.report(a, a + 20000.0, [dpb.Accepted(r.request_id, k, rng.randint(0, k))
                                    for r, k in zip(reqs, lens)])
    rec["stats"] = bal.stats()
    bal.close()
    return rec


def mean_len(rec, skip):
    """Mean verify length of a rank after its first `skip` steps."""
    lens = rec["lens"][skip:]
    return sum(map(sum, lens)) / sum(map(len, lens))


def engine_payload(rank, step):
    """What an engine's own per-step DP sync carries (SGLang: tokens, forward mode, ...)."""
    return struct.pack("<qqi", rank, step, 1000 + 7 * rank + step)


def piggyback_plan(bal, pb, rank, rec):
    """A plan through `Piggyback.step` that checks every rank's engine payload came back."""
    rec["payloads_ok"] = []

    def plan(reqs, step):
        res = pb.step(bal, reqs, engine_payload(rank, step))
        rec["payloads_ok"].append(res.payloads == [engine_payload(r, step)
                                                   for r in range(pb.num_ranks)])
        return res.verify_len, res.draft_depth
    return plan


def run_ranks(num_ranks, steps, group, config=COMMON, batch_of=None, seed=7, piggyback=False,
              configs=None):
    """Runs `steps` decode steps on `num_ranks` threads; returns per-rank records. With
    `piggyback` the exchange rides on an engine sync (`Piggyback`); `configs` sets per-rank
    flags."""
    out = [None] * num_ranks

    def rank_main(rank):
        rng = random.Random(seed * 100 + rank)
        member, plan, rec = group.member(rank), None, {}
        cfg = configs[rank] if configs else config
        if piggyback:
            pb = dpb.Piggyback(lambda payload: member(payload, 5000), num_ranks)
            bal = dpb.DpBalance(num_ranks, rank, cfg, allgather=pb, library=PLUGIN)
            plan = piggyback_plan(bal, pb, rank, rec)
        else:
            bal = dpb.DpBalance(num_ranks, rank, cfg, allgather=member, library=PLUGIN)
        out[rank] = {**run_steps(bal, rank, steps, batch_of, rng, plan), **rec}

    run_threads(num_ranks, rank_main)
    return out


def run_threads(num_ranks, rank_main):
    """Runs rank_main(rank) on one thread per rank and joins them; re-raises the first
    exception a rank raised (a thread's own would only be printed)."""
    errors = []

    def guarded(rank):
        try:
            rank_main(rank)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def skewed_batch(rank, step, rng):
    # Rank 0 is light (short contexts), the last rank heavy: balancing should move verify work.
    n = 16
    ctx = 2000 if rank == 0 else 60000
    return [dpb.Request(rank * 1000 + i, ctx + rng.randint(0, 500), k_min=0, k_cap=7)
            for i in range(n)]


class AdapterTest(unittest.TestCase):
    def test_ctypes_structs_match_the_c_layout(self):
        import subprocess
        mirror = {"dpbInitArgs_v1_t": dpb._InitArgs, "dpbRequest_v1_t": dpb._Request,
                  "dpbAccepted_v1_t": dpb._Accepted, "dpbStats_v1_t": dpb._Stats,
                  "dpbalancePlugin_v1_t": dpb._Plugin, "dpbRouterArgs_v1_t": dpb._RouterArgs,
                  "dpbRankLoad_v1_t": dpb._RankLoad, "dpbalanceRouter_v1_t": dpb._Router,
                  "dpbStepInfo_v1_t": dpb._StepInfo, "dpbalanceInspect_v1_t": dpb._Inspect,
                  "dpbStepTerms_v1_t": dpb._StepTerms, "dpbalanceInspect_v2_t": dpb._InspectV2}
        seen = {name: [] for name in mirror}
        out = subprocess.run([ABI_LAYOUT], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            struct, field, offset, size = line.split()
            cls = mirror[struct]
            if field == "sizeof":
                self.assertEqual(ctypes.sizeof(cls), int(size), struct)
                continue
            seen[struct].append(field)
            f = getattr(cls, field)
            self.assertEqual((f.offset, f.size), (int(offset), int(size)), f"{struct}.{field}")
        for name, cls in mirror.items():  # no field of the mirror left unchecked, in order
            self.assertEqual(seen[name], [f[0] for f in cls._fields_], name)

    def test_balances_across_thread_ranks(self):
        recs = run_ranks(4, 60, ThreadGroup(4), batch_of=skewed_batch)
        for step in range(60):  # one draft depth, agreed by every rank, every step
            self.assertEqual(len({recs[r]["depths"][step] for r in range(4)}), 1, step)
        for r in range(4):
            s = recs[r]["stats"]
            self.assertEqual(s["steps"], 60)
            self.assertEqual(s["fallbacks"], 0)
            self.assertEqual(s["enabled"], 1)
            self.assertGreater(s["balanced_steps"], 30)
            self.assertTrue(all(x == dpb.SUCCESS for x in recs[r]["results"]))
        mean = [mean_len(recs[r], 10) for r in range(4)]
        # The light rank absorbs more verify work than the heavy ones.
        self.assertGreater(mean[0], max(mean[1:]) + 0.5, mean)

    def test_granularity_rank_gives_every_request_of_a_rank_one_level(self):
        def cap(step, i):  # caps vary, so a level shows as min(level, k_cap)
            return (1, 3, 7)[(step + i) % 3]

        def batch_of(rank, step, rng):
            return [r._replace(k_cap=cap(step, i)) for i, r in enumerate(skewed_batch(rank, step, rng))]
        recs = run_ranks(4, 40, ThreadGroup(4), config=COMMON + ";granularity=rank",
                         batch_of=batch_of)
        levels = set()
        for r in range(4):
            self.assertEqual(recs[r]["stats"]["fallbacks"], 0)
            for step, lens in enumerate(recs[r]["lens"]):
                caps = [cap(step, i) for i in range(len(lens))]
                level = max(lens)
                self.assertEqual(lens, [min(level, c) for c in caps], (r, step))
                if step >= 10:
                    levels.add((r, level))
        # The light rank runs a deeper level than the heavy ones.
        self.assertGreater(max(l for r, l in levels if r == 0),
                           max(l for r, l in levels if r != 0), levels)

    def check_disabled_from(self, group, at):
        """A failed exchange on plan `at`: default lengths from then on, never an exception,
        and the callback is not called again (the ranks may no longer be in lockstep)."""
        recs = run_ranks(3, 12, group, batch_of=lambda r, s, rng: [
            dpb.Request(i, 1000 * (r + 1), k_min=0, k_cap=2 if i == 0 else 7) for i in range(5)])
        for r in range(3):
            self.assertTrue(all(x == dpb.SUCCESS for x in recs[r]["results"][:at]), r)
            self.assertTrue(all(x == dpb.DISABLED for x in recs[r]["results"][at:]), r)
            for step in range(at, 12):
                self.assertEqual(recs[r]["lens"][step], [2, 3, 3, 3, 3], (r, step))
            self.assertEqual(recs[r]["stats"]["enabled"], 0)
            self.assertEqual(recs[r]["stats"]["steps"], 12)
            self.assertEqual(group.calls[r], at + 2)  # the handshake, `at` plans, the failed one

    def test_callback_that_raises_disables_the_rank_without_raising(self):
        g = ThreadGroup(3)
        g.fail_steps = {6}  # call 0 is init's handshake: this is plan 5
        self.check_disabled_from(g, 5)

    def test_callback_that_returns_a_short_buffer_disables_the_rank(self):
        g = ThreadGroup(3)
        g.short_steps = {4}
        self.check_disabled_from(g, 3)

    def test_a_timed_collective_that_completes_late_splits_the_depth_for_one_step(self):
        # Why `Piggyback` exists (docs/engines.md): rank 0 stops waiting after 50 ms on plan 2
        # (call 3) while rank 3 is 300 ms late; the others still complete with rank 0's
        # record. Rank 0 drafts the default depth and the others the agreed one on that step.
        # Then every rank disables (a failed callback is never called again), so the split
        # lasts one step, but an MTP draft with MoE layers needs one depth on every rank.
        g = LateGroup(4, late={(3, 3): 0.3}, patience={0: 0.05, 1: 1, 2: 1, 3: 1})
        recs = run_ranks(4, 6, g, batch_of=skewed_batch)
        at2 = [recs[r]["depths"][2] for r in range(4)]
        self.assertEqual(at2[0], 3)  # default_k
        self.assertEqual(len(set(at2[1:])), 1)
        self.assertNotEqual(at2[1], 3, "the agreed depth happened to be the default: no split shown")
        for step in [0, 1, 3, 4, 5]:
            self.assertEqual(len({recs[r]["depths"][step] for r in range(4)}), 1, step)
        for r in range(4):
            self.assertEqual(recs[r]["stats"]["enabled"], 0, r)

    def test_piggyback_on_the_engine_sync_balances_and_returns_its_payloads(self):
        recs = run_ranks(4, 40, ThreadGroup(4), batch_of=skewed_batch, piggyback=True)
        for step in range(40):
            self.assertEqual(len({recs[r]["depths"][step] for r in range(4)}), 1, step)
        for r in range(4):
            self.assertTrue(all(recs[r]["payloads_ok"]), r)
            self.assertTrue(all(x == dpb.SUCCESS for x in recs[r]["results"]), r)
            self.assertEqual(recs[r]["stats"]["fallbacks"], 0)
        mean = [mean_len(recs[r], 10) for r in range(4)]
        self.assertGreater(mean[0], max(mean[1:]) + 0.5, mean)

    def test_piggyback_a_rank_that_disables_itself_takes_every_rank_to_the_default_depth(self):
        # Rank 2 gives up after one failure (max_failures is local, not agreed) and sends a
        # bad request on step 5. From step 6 its record slot goes out as zeros: every other
        # rank sees the empty record and runs the default lengths that step (a pause, not a
        # disable: an engine's inactive-rank row is the same zeros), so all ranks draft the same
        # (default) depth on every step and the engine's payloads still arrive.
        def batch_of(rank, step, rng):
            reqs = skewed_batch(rank, step, rng)
            if rank == 2 and step == 5:
                reqs[0] = reqs[0]._replace(ctx_tokens=-1)
            return reqs
        configs = [COMMON] * 4
        configs[2] = COMMON + ";max_failures=1"
        recs = run_ranks(4, 12, ThreadGroup(4), batch_of=batch_of, piggyback=True, configs=configs)
        for step in range(12):
            self.assertEqual(len({recs[r]["depths"][step] for r in range(4)}), 1, step)
        for r in range(4):
            self.assertTrue(all(recs[r]["payloads_ok"]), r)
            self.assertEqual(recs[r]["stats"]["enabled"], 0 if r == 2 else 1, r)
            self.assertEqual(recs[r]["depths"][11], 3)  # default_k
            self.assertTrue(all(x == dpb.SUCCESS for x in recs[r]["results"][:5]), r)
            if r != 2:  # every paused step reaches the engine as a fallback, counted
                self.assertTrue(all(x == dpb.FALLBACK for x in recs[r]["results"][6:]), r)
                self.assertGreaterEqual(recs[r]["stats"]["fallbacks"], 6, r)
        self.assertEqual(recs[2]["results"][5], dpb.DISABLED)  # it joined that step, then stopped

    def test_piggyback_a_request_that_cannot_be_marshalled_raises_after_the_sync(self):
        # Rank 1 passes k_cap = 2.5 on step 3: its step raises (a programming error), but only
        # after the engine's sync ran with a zero record, so the others finish the step (their
        # barrier would break otherwise) at the default depth; from step 4 all plan again.
        g = ThreadGroup(3)
        got, errors = [[] for _ in range(3)], []

        def rank_main(rank):
            pb = dpb.Piggyback(lambda p: g.member(rank)(p, 5000), 3)
            bal = dpb.DpBalance(3, rank, COMMON, allgather=pb, library=PLUGIN)
            rng = random.Random(rank)
            for step in range(8):
                reqs = skewed_batch(rank, step, rng)
                if rank == 1 and step == 3:
                    reqs[2] = reqs[2]._replace(k_cap=2.5)
                try:
                    res = pb.step(bal, reqs, engine_payload(rank, step))
                    got[rank].append((step, res.draft_depth,
                                      res.payloads == [engine_payload(r, step) for r in range(3)]))
                except TypeError as e:
                    errors.append((rank, step, str(e)))
            bal.close()
        run_threads(3, rank_main)
        self.assertEqual([(r, s) for r, s, _ in errors], [(1, 3)])
        self.assertIn("k_cap = 2.5", errors[0][2])
        for r in range(3):
            self.assertTrue(all(ok for _, _, ok in got[r]), r)
        for step in range(8):
            depths = {d for r in range(3) for s, d, _ in got[r] if s == step}
            self.assertEqual(len(depths), 1, (step, depths))
        self.assertEqual({d for r in range(3) for s, d, _ in got[r] if s == 3}, {3})

    def test_piggyback_without_a_plugin_still_runs_the_engine_sync(self):
        g = ThreadGroup(2)
        got = [None, None]

        def rank_main(rank):
            pb = dpb.Piggyback(lambda p: g.member(rank)(p, 5000), 2)
            got[rank] = [pb.step(None, [dpb.Request(1, 100)], engine_payload(rank, s))
                         for s in range(3)]
        run_threads(2, rank_main)
        for rank in range(2):
            for s, res in enumerate(got[rank]):
                self.assertEqual(res, dpb.StepResult(None, None, [engine_payload(0, s),
                                                                  engine_payload(1, s)]))

    def test_piggyback_on_quiet_steps_runs_the_engines_sync_unless_the_collective_is_ours(self):
        # The plugin's quiet mode (quiet_after=2, spans up to 4; a default guard no plan beats):
        # after steps 0-2 it plans without an exchange on agreed spans (exchanges at 0-2, 5,
        # 10, 15 of 16 steps). On the engine's own sync (SGLang: the default) the collective
        # still runs every step and every payload arrives; on a collective of the plugin's
        # alone (own_collective=True, the vLLM package) those steps run no collective at all,
        # on every rank alike, and return no payloads.
        config = COMMON + ";quiet_after=2;quiet_max=4;min_plan_gain=10;learn_step_terms=0"
        for own in (False, True):
            g = ThreadGroup(2)
            got = [None, None]

            def rank_main(rank):
                pb = dpb.Piggyback(lambda p: g.member(rank)(p, 5000), 2, own_collective=own)
                bal = dpb.DpBalance(2, rank, config, allgather=pb, library=PLUGIN)
                got[rank] = [pb.step(bal, [dpb.Request(1, 900 + 100 * rank)],
                                     engine_payload(rank, s)) for s in range(16)]
                bal.close()
            run_threads(2, rank_main)
            exchanged = [0, 1, 2, 5, 10, 15]
            self.assertEqual(g.calls, [1 + (len(exchanged) if own else 16)] * 2, own)
            for rank in range(2):
                for s, res in enumerate(got[rank]):
                    self.assertEqual(res.verify_len, [3], (own, rank, s))
                    want = [engine_payload(0, s), engine_payload(1, s)]
                    self.assertEqual(res.payloads, None if own and s not in exchanged else want,
                                     (own, rank, s))

    def test_piggyback_reraises_the_engine_collectives_failure(self):
        g = ThreadGroup(1)
        g.fail_steps = {3}  # call 0 is init's handshake: this is step 2
        pb = dpb.Piggyback(lambda p: g.member(0)(p, 5000), 1)
        bal = dpb.DpBalance(1, 0, COMMON, allgather=pb, library=PLUGIN)
        reqs = [dpb.Request(1, 100)]
        for s in range(2):
            self.assertEqual(pb.step(bal, reqs, b"abc").payloads, [b"abc"])
        with self.assertRaises(ConnectionError):
            pb.step(bal, reqs, b"abc")  # the engine's own sync failed: it must hear of it
        self.assertEqual(bal.last_result, dpb.DISABLED)
        res = pb.step(bal, reqs, b"abd")  # later steps: default lengths, the sync still runs
        self.assertEqual((res.verify_len, res.draft_depth, res.payloads), ([3], 3, [b"abd"]))
        with self.assertRaises(ValueError) as e:  # payload sizes that disagree across ranks
            dpb.Piggyback(lambda p: p + b"x", 1).step(None, [], b"ab")
        self.assertIn("expected 1 ranks x 514", str(e.exception))
        bal.close()

    def test_bad_flag_names_it(self):
        with self.assertRaises(dpb.DpBalanceError) as e:
            dpb.DpBalance(1, 0, "k_max=nine", allgather=lambda s, t: s, library=PLUGIN)
        self.assertIn("k_max=nine", str(e.exception))
        self.assertIn("dpbInvalidArgument", str(e.exception))

    def test_check_flags_names_a_bad_value_before_any_init(self):
        old = os.environ.get("DPB_MODE")
        try:
            os.environ["DPB_MODE"] = "bogus"
            bad = dpb.check_flags("", 2, library=PLUGIN)
            self.assertFalse(bad.ok)
            self.assertIn("environment variable DPB_MODE: 'bogus'", bad.error)
            del os.environ["DPB_MODE"]
            good = dpb.check_flags("default_k=2;draft_us=0", 2, library=PLUGIN)
            self.assertTrue(good.ok, good.error)
            self.assertEqual((good.settings["default_k"], good.settings["draft_us"],
                              good.settings["mode"]), ("2", "0", "goodput"))
            self.assertFalse(dpb.check_flags("k_max=nine", 1, library=PLUGIN).ok)
        finally:
            os.environ.pop("DPB_MODE", None)
            if old is not None:
                os.environ["DPB_MODE"] = old

    def test_last_step_gives_the_reported_plans_prediction(self):
        bal = dpb.DpBalanceV2(1, 0, COMMON, allgather=lambda s, t: s, library=PLUGIN)
        self.assertEqual(bal.last_step()["plan_id"], -1)
        reqs = [dpb.Request(f"r{i}", 4000 + 100 * i, k_cap=7) for i in range(6)]
        predicted = 0
        for step in range(8):
            res = bal.plan(reqs)
            bal.report(800.0 + step, 5000.0, [dpb.Accepted(q.request_id, n, n)
                                               for q, n in zip(reqs, res.verify_len)])
            info = bal.last_step()
            self.assertEqual(info["plan_id"], res.plan_id)
            self.assertEqual(info["measured_attention_us"], 800.0 + step)
            self.assertFalse(info["extend"])
            predicted += info["predicted_attention_us"] > 0
        self.assertGreater(predicted, 4)
        # The step terms it priced with: learnt online (the default), from the flags' prior.
        terms = bal.step_terms()
        self.assertTrue(terms["online"])
        self.assertEqual(terms["resets"], 0)
        self.assertGreaterEqual(terms["rows"], 1)
        for k in ("ffn_fixed_us", "ffn_per_token_us", "draft_us", "step_overhead_us"):
            self.assertGreaterEqual(terms[k], 0.0, k)
        bal.close()
        self.assertIsNone(bal.last_step())
        self.assertIsNone(bal.step_terms())

    def test_v2_ids_are_packed_once_while_they_stay_the_same(self):
        # ABI v2 sends each id as (address, length) into one bytes object. An engine passes the
        # same ids every step (and report() the plan's), so the packing is reused then; a changed
        # list, or a mutable id, is packed again.
        bal = dpb.DpBalanceV2(1, 0, COMMON, allgather=lambda s, t: s, library=PLUGIN)

        def sent(items, what="requests"):
            ids, keep = bal._ids(items, what)
            return ids, [ctypes.string_at(a, n) for a, n in ids], keep

        first, got, keep = sent([dpb.Request("a", 10), dpb.Request("bb", 10)])
        self.assertEqual(got, [b"a", b"bb"])
        again, got, _ = sent([dpb.Accepted("a", 1, 1), dpb.Accepted("bb", 1, 0)], "accepted")
        self.assertIs(again, first)
        self.assertEqual(got, [b"a", b"bb"])
        self.assertEqual(sent([dpb.Request("a", 10), dpb.Request("cc", 10)])[1], [b"a", b"cc"])
        self.assertEqual(sent([dpb.Request("a", 10)])[1], [b"a"])
        self.assertEqual(sent([dpb.Request(b"a", 10)])[1], [b"a"])
        mutable = bytearray(b"x1")
        self.assertEqual(sent([dpb.Request(mutable, 10)])[1], [b"x1"])
        mutable[0] = ord("y")
        self.assertEqual(sent([dpb.Request(mutable, 10)])[1], [b"y1"])
        # A bytearray packed as b"x1" and changed to b"z1" since compares equal to b"z1": a list
        # with a mutable id is never kept, so b"z1" is packed as itself.
        mutable[0] = ord("x")
        self.assertEqual(sent([dpb.Request(mutable, 10)])[1], [b"x1"])
        mutable[0] = ord("z")
        self.assertEqual(sent([dpb.Request(b"z1", 10)])[1], [b"z1"])
        # Plans and reports through the reused packing still reach the plugin whole.
        reqs = [dpb.Request(f"r{i}", 4000 + 100 * i, k_cap=7) for i in range(4)]
        for step in range(6):
            res = bal.plan(reqs)
            self.assertEqual(bal.report(900.0, 5000.0, [dpb.Accepted(q.request_id, n, n) for q, n
                                                        in zip(reqs, res.verify_len)]), dpb.SUCCESS)
        self.assertEqual(bal.stats()["missing_reports"], 0)
        bal.close()

    def test_bad_arguments_name_the_field(self):
        with self.assertRaises(ValueError) as e:
            dpb.DpBalance(2, 2, "", allgather=lambda s, t: s, library=PLUGIN)
        self.assertIn("rank = 2", str(e.exception))
        bal = dpb.DpBalance(1, 0, COMMON, allgather=lambda s, t: s, library=PLUGIN)
        # A value the plugin rejects: this step falls back to the default lengths, no raise.
        lens, _ = bal.plan([dpb.Request(1, 100, k_cap=5), dpb.Request(2, -5, k_cap=1)])
        self.assertEqual(bal.last_result, dpb.FALLBACK)
        self.assertEqual(lens, [3, 1])
        # Values that cannot be marshalled at all raise, naming the field.
        with self.assertRaises(TypeError) as e:
            bal.plan([dpb.Request(1, 100), dpb.Request(2, 100, k_cap=2.5)])
        self.assertIn("requests[1].k_cap = 2.5", str(e.exception))
        with self.assertRaises(ValueError) as e:
            bal.plan([dpb.Request(1, 1 << 70)])
        self.assertIn("requests[0].ctx_tokens", str(e.exception))
        with self.assertRaises(TypeError) as e:
            bal.report(1.0, 2.0, [dpb.Accepted(1, 2, None)])
        self.assertIn("accepted[0].accepted = None", str(e.exception))
        self.assertEqual(bal.plan([])[0], [])
        self.assertEqual(bal.last_result, dpb.SUCCESS)
        self.assertEqual(bal.report(1000.0, 2000.0, []), dpb.SUCCESS)
        # Confidences ride along (a pointer the plugin reads during the call).
        lens, _ = bal.plan([dpb.Request(1, 100, k_cap=4, draft_confidence=[0.9, 0.8, 0.7, 0.6])])
        self.assertEqual(bal.last_result, dpb.SUCCESS)
        lens, _ = bal.plan([dpb.Request(1, 100, k_cap=4, draft_confidence=[float("nan")])])
        self.assertEqual(bal.last_result, dpb.FALLBACK)
        self.assertEqual(lens, [3])
        lens, depth = bal.plan([dpb.Request(1, 100, k_cap=4), dpb.Request(2, 100, k_cap=0)])
        self.assertEqual(len(lens), 2)
        self.assertEqual(lens[1], 0)
        self.assertLessEqual(lens[0], 4)
        bal.close()
        with self.assertRaises(dpb.DpBalanceError):
            bal.plan([])

    def test_library_resolution(self):
        with self.assertRaises(dpb.DpBalanceError) as e:
            dpb.DpBalance(1, 0, "", library="/nonexistent/libnope.so")
        self.assertIn("/nonexistent/libnope.so", str(e.exception))
        self.assertIsNone(dpb.DpBalance.load(1, 0, library="none"))
        self.assertEqual(dpb.resolve_library("dpbalance"), "libdpbalance.so")
        self.assertEqual(dpb.resolve_library("/x/y.so"), "/x/y.so")
        old = os.environ.get("DPB_PLUGIN")
        try:
            os.environ["DPB_PLUGIN"] = PLUGIN
            self.assertEqual(dpb.resolve_library(), PLUGIN)
        finally:
            if old is None:
                os.environ.pop("DPB_PLUGIN")
            else:
                os.environ["DPB_PLUGIN"] = old


class RouterTest(unittest.TestCase):
    # Terms (B, B + s*C) under V2 with one query token per request: rank 0 holds max B, rank 1
    # the mix maximum; ranks 2, 3, 4 leave both unchanged, rank 2 has the fewest requests and
    # the most context (tests/runtime/routing_test.cc has the same case through C++).
    LOADS = [dpb.RankLoad(6, 0, 0, 10**6), dpb.RankLoad(4, 300000, 300000, 10**6),
             dpb.RankLoad(4, 150000, 150000, 10**6), dpb.RankLoad(5, 0, 0, 10**6),
             dpb.RankLoad(4, 120000, 120000, 10**6)]

    def test_routes_through_the_router_abi(self):
        with dpb.Router(5, "routing=E;route_query_tokens=1", library=PLUGIN) as r:
            self.assertEqual(r.route(self.LOADS, 1000, 100), 2)
            r.observe_finished(300)
            # No rank with batch room: the request waits.
            full = [l._replace(max_requests=l.num_requests) for l in self.LOADS]
            self.assertIsNone(r.route(full, 1000, 100))
        with dpb.Router(5, "routing=A", library=PLUGIN) as r:  # fewest requests, then context
            self.assertEqual(r.route(self.LOADS, 1000, 100), 4)
        self.assertIsNone(dpb.Router.load(5, library="none"))

    def test_bad_router_input_is_named(self):
        with self.assertRaises(dpb.DpBalanceError) as e:
            dpb.Router(5, "routing=F", library=PLUGIN)
        self.assertIn("routing=F", str(e.exception))
        r = dpb.Router(5, "", library=PLUGIN)
        with self.assertRaises(ValueError) as e:
            r.route(self.LOADS[:4], 10, 10)
        self.assertIn("4 rank loads for 5 ranks", str(e.exception))
        bad = list(self.LOADS)
        bad[3] = bad[3]._replace(ctx_tokens=-1)
        with self.assertRaises(ValueError) as e:  # the plugin rejects it; its log names it
            r.route(bad, 10, 10)
        self.assertIn("dpbInvalidArgument", str(e.exception))
        bad[3] = bad[3]._replace(ctx_tokens=2.5)
        with self.assertRaises(TypeError) as e:  # cannot be marshalled: named here
            r.route(bad, 10, 10)
        self.assertIn("loads[3].ctx_tokens = 2.5", str(e.exception))
        with self.assertRaises(ValueError):
            r.observe_finished(-1)
        r.close()
        with self.assertRaises(dpb.DpBalanceError):
            r.route(self.LOADS, 10, 10)


def run_processes(test, ctx, q, target, args_per_rank):
    """Starts one process per rank; returns their run_steps records in rank order. Each target
    puts (rank, record) on `q`; every process must exit cleanly."""
    procs = [ctx.Process(target=target, args=args) for args in args_per_rank]
    for p in procs:
        p.start()
    got = [rec for _, rec in sorted(q.get(timeout=120) for _ in procs)]
    for p in procs:
        p.join(60)
        test.assertEqual(p.exitcode, 0)
    return got


def _process_rank(rank, world, shared, barrier, plugin, q):
    """A rank as its own process; the all-gather goes through shared memory and a barrier."""
    def allgather(send, timeout_ms):
        n = len(send)
        shared[rank * n:(rank + 1) * n] = send
        barrier.wait(timeout_ms / 1000)
        out = bytes(shared[:world * n])
        barrier.wait(timeout_ms / 1000)
        return out

    bal = dpb.DpBalance(world, rank, COMMON, allgather=allgather, library=plugin)
    q.put((rank, run_steps(bal, rank, 30, skewed_batch, random.Random(rank))))


class ProcessTest(unittest.TestCase):
    def test_ranks_as_processes(self):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")  # as an engine's workers: nothing inherited
        world = 3
        shared = ctx.RawArray("B", world * 4096)
        barrier = ctx.Barrier(world)
        q = ctx.Queue()
        got = run_processes(self, ctx, q, _process_rank,
                            [(r, world, shared, barrier, PLUGIN, q) for r in range(world)])
        self.assertTrue(got[0]["depths"] == got[1]["depths"] == got[2]["depths"])  # one agreed depth
        for rec in got:
            self.assertTrue(all(x == dpb.SUCCESS for x in rec["results"]), rec["results"])
            stats = rec["stats"]
            self.assertEqual(stats["fallbacks"], 0)
            self.assertGreater(stats["balanced_steps"], 15)
            self.assertGreater(stats["goodput_tok_per_s"], 0)
            self.assertTrue(0 <= stats["bubble_fraction"] < 1, stats["bubble_fraction"])
        # The light rank verifies more.
        self.assertGreater(mean_len(got[0], 10), max(mean_len(got[1], 10), mean_len(got[2], 10)) + 0.5)


def _torch_rank(rank, world, store_path, plugin, q, piggyback):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        gather, plan, rec = dpb.torch_allgather(), None, {}
        if piggyback:  # the engine's own sync over the same gloo group carries the record
            pb = dpb.Piggyback(lambda payload: gather(payload, 0), world)
            bal = dpb.DpBalance(world, rank, COMMON, allgather=pb, library=plugin)
            plan = piggyback_plan(bal, pb, rank, rec)
        else:
            bal = dpb.DpBalance(world, rank, COMMON, allgather=gather, library=plugin)
        heavy_or_light = lambda r, step, rng: skewed_batch(0 if r == 0 else 3, step, rng)  # noqa: E731
        q.put((rank, {**run_steps(bal, rank, 20, heavy_or_light, random.Random(rank), plan), **rec}))
    finally:
        dist.destroy_process_group()


class TorchGlooTest(unittest.TestCase):
    def run_gloo(self, piggyback):
        try:
            import torch.multiprocessing as mp
        except ImportError as e:  # a failure, not a skip: a skipped case passes the ctest
            self.fail(f"torch is not installed ({e}): run scripts/install_deps.sh (python3-torch)")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            store = os.path.join(d, "store")
            got = run_processes(self, ctx, q, _torch_rank,
                                [(r, 2, store, PLUGIN, q, piggyback) for r in range(2)])
        self.assertEqual(got[0]["depths"], got[1]["depths"])  # the same agreed depth on both ranks
        for rec in got:
            self.assertTrue(all(x == dpb.SUCCESS for x in rec["results"]), rec["results"])
            self.assertEqual(rec["stats"]["fallbacks"], 0)
            self.assertGreater(rec["stats"]["balanced_steps"], 10)
            if piggyback:
                self.assertTrue(all(rec["payloads_ok"]))

    def test_two_processes_over_gloo(self):
        self.run_gloo(piggyback=False)

    def test_two_processes_piggyback_on_a_gloo_sync(self):
        self.run_gloo(piggyback=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python_adapter_test.py PLUGIN_SO ABI_LAYOUT [unittest args]")
    PLUGIN = os.path.abspath(sys.argv.pop(1))
    ABI_LAYOUT = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
