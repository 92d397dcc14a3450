#!/usr/bin/env python3
"""dpbalance_vllm/routing.py on vLLM's own routing code, without engines.

vLLM's `DPLBAsyncMPClient` (vllm/v1/engine/core_client.py) is built without its __init__ (which
starts engine processes and sockets) and given the state its routing reads; its own
`get_core_engine_for_request` and `process_engine_outputs` run under the package's wrappers.
Checked: a bad DPB_ROUTING is an error naming the value; the load board round-trips and a torn
record reads as none; each request goes to the rank the Router ABI picks from the loads (the
rank's record plus the requests routed since), vLLM's bookkeeping (in-flight maps, abort
routing) holds the chosen rank, a pinned request keeps vLLM's path, E learns output lengths from
the outputs, a failure of ours falls back to vLLM's rule, with DPB_ROUTING unset vLLM's own
rule routes (and is logged), and DPB_ROUTING without the library or with refused flags is an
error at start-up.

Run with the vLLM venv's python (ctest does). The real `vllm serve` case is vllm_serve_test.py
route.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))
from script_checks import Checks  # noqa: E402

CHECKS = Checks()


def CHECK(ok: bool, what: str, detail: str = "") -> None:
    CHECKS.check(what, bool(ok), detail)


class _Sched:  # what RankWriter.publish reads off vLLM's Scheduler
    def __init__(self, reqs, max_seqs=16, blocks=10000, block_size=16):
        self.running, self.waiting = reqs, []
        self.max_num_running_reqs = max_seqs
        self.block_size = block_size

        class _C:
            num_gpu_blocks = blocks
        self.cache_config = _C()


class _Req:
    def __init__(self, tokens, out_done, max_tokens):
        self.num_tokens, self.num_output_tokens, self.max_tokens = tokens, out_done, max_tokens


def client(dp: int):
    """vLLM's DPLBAsyncMPClient with the state its routing reads, and no engines."""
    from vllm.v1.engine import core_client

    c = object.__new__(core_client.DPLBAsyncMPClient)
    c.core_engines = [bytes([i, 0]) for i in range(dp)]
    c.reqs_in_flight = {}
    c.engine_inflight = Counter()
    c.client_count, c.client_index, c.eng_start_index = 1, 0, 0
    c.lb_engines = [[0, 0, 0.0] for _ in range(dp)]

    class _Sc:
        max_num_seqs = 16

    class _V:
        scheduler_config = _Sc()
    c.vllm_config = _V()
    return c


def request(rid: str, n_in: int, n_out: int, rank=None):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(n_in)), mm_features=None,
                             sampling_params=SamplingParams(max_tokens=n_out), pooling_params=None,
                             arrival_time=0.0, lora_request=None, cache_salt=None,
                             data_parallel_rank=rank)


def main() -> int:
    work = tempfile.mkdtemp(prefix="dpb-routing-")
    os.environ["DPB_PLUGIN"] = os.environ.get("DPB_PLUGIN", "dpbalance")
    os.environ["DPBALANCE_VLLM_LOADS"] = os.path.join(work, "board")
    route_log = os.path.join(work, "route.jsonl")
    os.environ["DPBALANCE_VLLM_ROUTE_LOG"] = route_log
    from dpbalance_vllm import engine_plan, routing

    # A bad value is an error that names it and where it came from.
    os.environ["DPB_ROUTING"] = "Q"
    try:
        routing.strategy()
        CHECK(False, "DPB_ROUTING=Q is refused")
    except RuntimeError as e:
        CHECK("DPB_ROUTING='Q' (environment)" in str(e), "DPB_ROUTING=Q is refused, named", str(e))
    for v, want in (("d", "D"), ("vllm", None), ("", None)):
        os.environ["DPB_ROUTING"] = v
        CHECK(routing.strategy() == want, f"DPB_ROUTING={v!r} reads as {want}")

    # The board: what a rank writes is read back; a record being written reads as none.
    board = routing.LoadBoard(os.path.join(work, "b2"), 3, create=True)
    board.write(1, 7, 5, 16, 9000, 4000, 9500, 160000, 11)
    got = routing.LoadBoard(os.path.join(work, "b2"), 3, create=False).read(1)
    CHECK(got is not None and (got["step"], got["num_requests"], got["ctx"], got["max_ctx"],
                               got["reserved"], got["capacity"], got["handed"])
          == (7, 5, 9000, 4000, 9500, 160000, 11), "a record round-trips", str(got))
    CHECK(board.read(0) is None, "a rank that never wrote has no record")
    import struct
    struct.pack_into("<Q", board._mm, SLOT := routing.SLOT_BYTES, 99)  # odd: mid-write
    CHECK(board.read(1) is None, "a torn record reads as none")
    del SLOT

    # Routing D over vLLM's own method: two ranks, rank 0 busy with long contexts.
    os.environ["DPB_ROUTING"] = "D"
    routing.install()
    c = client(2)
    writers = [routing.RankWriter(r, 2) for r in range(2)]
    for _ in range(2):  # two steps: the records know their step interval
        writers[0].publish(_Sched([_Req(6000, 10, 300), _Req(5000, 5, 300)]))
        writers[1].publish(_Sched([_Req(300, 10, 300)]))
    ref = engine_plan.adapter.Router(2, library=engine_plan.library_path())
    picks = []
    for i, n_in in enumerate((1200, 800, 3000, 200, 2500)):
        loads = [l for l, _, _ in c._dpb_routing.loads()] if i else None
        engine = c.get_core_engine_for_request(request(f"r{i}", n_in, 64))
        rank = c.core_engines.index(engine)
        picks.append(rank)
        if loads is not None:  # the router ABI on the same loads picks the same rank
            CHECK(ref.route(loads, n_in, 64) == rank, f"request r{i} on the Router's pick",
                  f"rank {rank}")
        CHECK(c.reqs_in_flight.get(f"r{i}") == engine, f"vLLM's in-flight map holds r{i}'s rank")
    rows = [json.loads(x) for x in open(route_log)]
    CHECK([r["by"] for r in rows] == ["dpbalance"] * 5, "every request routed by dpbalance",
          str([r["by"] for r in rows]))
    CHECK(rows[0]["loads"][0][1] == 11000 and rows[0]["loads"][1][1] == 300,
          "the first route saw both ranks' records", str(rows[0]["loads"]))
    CHECK(all(a is not None for r in rows for a in r["age_steps"]), "each decision names the "
          "records' age in steps")
    CHECK(picks[0] == 1, "the first request goes to the rank with less context", str(picks))
    # The requests routed since the records count: the second route saw the first one.
    CHECK(rows[1]["loads"][1][0] == 2 and rows[1]["loads"][1][1] == 1500,
          "a request routed after the record is counted on its rank", str(rows[1]["loads"]))
    CHECK(c.engine_inflight[c.core_engines[1]] == picks.count(1),
          "vLLM's in-flight count per engine follows the picks")
    # Once rank 1's record counts them they are not counted twice.
    writers[1].handed = picks.count(1)
    writers[1].publish(_Sched([_Req(300, 10, 300)] + [_Req(1000, 0, 64)] * picks.count(1)))
    l1 = c._dpb_routing.loads()[1][0]
    CHECK(l1.num_requests == 1 + picks.count(1), "requests the record counts are not added again",
          str(l1))

    # After its output a step's finished requests leave the record, which keeps its step and
    # interval; a rank whose last requests finished is idle, not stale, however long it waits.
    before = c._dpb_routing.board.read(1)
    writers[1].publish(_Sched([]), tick=False)
    after = c._dpb_routing.board.read(1)
    CHECK(after["num_requests"] == 0 and after["step"] == before["step"]
          and after["interval_ns"] == before["interval_ns"] and after["t_ns"] > before["t_ns"],
          "the record after the step's output: requests gone, same step and interval",
          f"{before} -> {after}")
    stale, routing.STALE_S = routing.STALE_S, 0.0
    try:
        CHECK(c._dpb_routing.loads()[1][1] is not None, "an idle rank's record is used however old")
        writers[1].publish(_Sched([_Req(300, 10, 300)]), tick=False)
        CHECK(c._dpb_routing.loads()[1][1] is None, "a busy rank's record past STALE_S is not")
    finally:
        routing.STALE_S = stale

    # A rank that has timed no step interval of its own yet is aged by the instance's.
    fresh = routing.RankWriter(0, 2)  # a new record for rank 0: one step, no interval
    fresh._board._seq = list(c._dpb_routing.board._seq)  # (a second writer of the same slot)
    fresh.publish(_Sched([_Req(100, 1, 64)]))
    got = c._dpb_routing.loads()
    CHECK(c._dpb_routing.board.read(0)["interval_ns"] == 0 and got[0][1] is not None,
          "a rank without its own step interval is aged by the other ranks'", str(got[0]))

    # A pinned request keeps vLLM's path.
    e = c.get_core_engine_for_request(request("p0", 100, 8, rank=0))
    CHECK(e == c.core_engines[0] and json.loads(open(route_log).readlines()[-1])["by"] == "pinned",
          "a request with data_parallel_rank keeps it")

    # E learns the output length from the outputs (vLLM's own process_engine_outputs runs).
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    done = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r0", new_token_ids=[1] * 64,
                                                       finish_reason=FinishReason.LENGTH)],
                             finished_requests={"r0"})
    asyncio.run(type(c).process_engine_outputs(c, done))
    CHECK("r0" not in c.reqs_in_flight and "r0" not in c._dpb_routing.inflight,
          "a finished request leaves vLLM's and dpbalance's in-flight maps")

    # A failure of ours routes by vLLM's rule (and vLLM books it).
    def broken():
        raise KeyError("a load the board lost")
    c._dpb_routing.loads = broken
    e = c.get_core_engine_for_request(request("x0", 100, 8))
    CHECK(c.reqs_in_flight.get("x0") == e, "routing that fails falls back to vLLM's rule")

    # DPB_ROUTING=vllm: vLLM's rule routes, logged.
    os.environ["DPB_ROUTING"] = "vllm"
    client(2).get_core_engine_for_request(request("v0", 100, 8))
    last = json.loads(open(route_log).readlines()[-1])
    CHECK(last["by"] == "vllm" and last["id"] == "v0", "DPB_ROUTING=vllm: vLLM's rule, logged")

    # At start-up: DPB_ROUTING without the library, or with flags the router refuses, is an
    # error naming them (install() runs in vLLM's plugin loading, before any engine starts).
    for env, needle in (({"DPB_ROUTING": "E", "DPB_PLUGIN": "none"}, "needs the dpbalance library"),
                        ({"DPB_ROUTING": "D", "DPB_Z": "-3"}, "refuses its flags")):
        saved = dict(os.environ)
        os.environ.update(env)
        routing.INSTALLED = False  # its checks run before it wraps anything
        try:
            routing.install()
            CHECK(False, f"{env} refused at start-up")
        except RuntimeError as err:
            CHECK(needle in str(err), f"{env} refused at start-up", str(err)[:160])
        finally:
            os.environ.clear()
            os.environ.update(saved)
            routing.INSTALLED = True
    CHECKS.finish()


if __name__ == "__main__":
    main()
