#!/usr/bin/env python3
"""`vllm serve` with dpbalance on, as a user runs it: the README's quickstart (scripts/serve_vllm.sh,
DP = 2 on the CPUs, the random-weight Qwen2-MoE), driven with the `openai` client.

  vllm_serve_test.py serve        the quickstart block is the same text in README.md,
                                  docs/live_vllm.md and scripts/serve_vllm.sh; the server starts,
                                  answers concurrent requests (streaming and not, two streams
                                  aborted by the client) completely; both ranks logged `enabled`
                                  and planned steps; Ctrl-C leaves a `final` record per rank and no
                                  process; DPB_MODE=bogus is one error line per rank at start-up
                                  and the server serves without balancing; under DPB_STRICT=1 it
                                  refuses to start
  vllm_serve_test.py draft        a model drafter: vLLM's draft-model proposer (a 1-layer random-weight
                                  draft of the target's vocabulary) under DP = 2 with the plugin,
                                  through vLLM's AsyncLLM (live_bench.py run-arm): every request
                                  served, the draft depth fixed at num_speculative_tokens, the
                                  plan trims verify lengths under it, the records ride vLLM's sync
  vllm_serve_test.py route        DPB_ROUTING=D: dpbalance routes in vLLM's DP load balancer (requests
                                  of 24 to 1,600 prompt tokens in two waves, none pinned): every
                                  request is routed by the Router ABI, the engine core it went to
                                  is the rank the log names, the Router ABI replayed on the logged
                                  loads picks the same ranks, the loads came from the ranks'
                                  records (their age in steps printed); DPB_ROUTING=Q stops
                                  `vllm serve` at start-up with one line naming it
  vllm_serve_test.py prometheus   dpbalance's series in vLLM's /metrics for both ranks, scraped
                                  twice (parsed by prometheus_client, counters moved), a metrics
                                  port in use (one line, serving and balancing go on), an
                                  unwritable multiprocess directory (one line), and
                                  scripts/dpbalance-report on the run's step logs

Run with the vLLM venv's python (ctest does: tests/integration/CMakeLists.txt). It prints the
figures the docs quote: start-up time, request latencies, the start-up error lines, the final
records, the dpbalance_ lines of /metrics.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SERVE = os.path.join(ROOT, "scripts", "serve_vllm.sh")
BEGIN, END = "# --- quickstart: vLLM on CPUs (begin) ---", "# --- quickstart: vLLM on CPUs (end) ---"
START_TIMEOUT_S = float(os.environ.get("VLLM_SERVE_TEST_START_S", "600"))
MAX_TOKENS = 48

FAILED = []


def check(ok: bool, what: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        FAILED.append(what)


def block_of(path: str) -> str:
    text = open(path).read()
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]


def free_port(n: int = 1) -> int:
    """A port p with p .. p + n - 1 free now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n < 65535 and all(_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no free port range")


def _free(p: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False


class Server:
    """scripts/serve_vllm.sh --no-install in its own process group (Ctrl-C stops the group)."""

    def __init__(self, name: str, work: str, env: dict):
        self.name = name
        self.port = free_port()
        self.model = os.path.join(work, "model")
        self.steps = os.path.join(work, f"steps-{name}")
        self.log_path = os.path.join(work, f"{name}.log")
        e = dict(os.environ)
        for k in list(e):  # a clean start: only the flags the case names
            if k.startswith("DPB_") or k.startswith("DPBALANCE_") or k == "PROMETHEUS_MULTIPROC_DIR":
                del e[k]
        e.update(DPBALANCE_PORT=str(self.port), DPBALANCE_MODEL=self.model,
                 DPBALANCE_STEP_DIR=self.steps, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                 HF_HUB_OFFLINE="1")
        e.update(env)
        self.t0 = time.monotonic()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(["bash", SERVE, "--no-install"], cwd=ROOT, env=e,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pgid = self.proc.pid
        self.ready_s = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        while time.monotonic() - self.t0 < timeout_s:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.t0
                        return True
            except OSError:
                pass
            time.sleep(1)
        return False

    def text(self) -> str:
        self.log.flush()
        return open(self.log_path, errors="replace").read()

    def alive(self) -> list:
        """Processes still running in the server's process group (zombies not counted: the
        script's own bash is one until this test reaps it)."""
        self.proc.poll()
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if fields[0] != "Z" and int(fields[2]) == self.pgid:
                out.append(int(d))
        return out

    def stop(self, timeout_s: float = 90) -> tuple:
        """Ctrl-C (SIGINT to the group), as in a terminal; then waits for every process.
        Returns (seconds it took, the processes still running after timeout_s, which it then
        kills)."""
        t = time.monotonic()
        try:
            os.killpg(self.pgid, signal.SIGINT)
        except ProcessLookupError:
            pass
        while time.monotonic() - t < timeout_s and self.alive():
            time.sleep(0.5)
        took = time.monotonic() - t
        left = self.alive()
        if left:
            os.killpg(self.pgid, signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        return took, left

    def step_rows(self, rank: int) -> list:
        return read_rows(self.steps, f"engine_dp{rank}.jsonl")


def prompt(i: int, n: int = 24) -> list:
    # Token ids: the test model has no tokenizer (--skip-tokenizer-init), so vLLM takes ids.
    return [3 + (i * 37 + j * 11) % 2000 for j in range(n)]


async def one_request(client, model: str, i: int, stream: bool, abort_after: int = 0,
                      n_prompt: int = 24) -> dict:
    t0 = time.monotonic()
    out = {"i": i, "stream": stream, "aborted": bool(abort_after)}
    kw = dict(model=model, prompt=prompt(i, n_prompt), max_tokens=MAX_TOKENS, temperature=0.0,
              extra_body={"return_token_ids": True})
    if not stream:
        r = await client.completions.create(**kw)
        c = r.choices[0]
        out.update(tokens=len(c.model_extra.get("token_ids") or []), finish=c.finish_reason,
                   usage=r.usage.completion_tokens, latency_s=time.monotonic() - t0)
        return out
    s = await client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    tokens, chunks, finish, usage, first = 0, 0, None, None, None
    async for chunk in s:
        if chunk.choices:
            c = chunk.choices[0]
            ids = c.model_extra.get("token_ids") or []
            if ids and first is None:
                first = time.monotonic() - t0
            tokens += len(ids)
            finish = c.finish_reason or finish
            chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        if abort_after and chunks >= abort_after:
            await s.close()  # the client goes away mid-stream: vLLM aborts the request
            break
    out.update(tokens=tokens, finish=finish, usage=usage, ttft_s=first,
               latency_s=time.monotonic() - t0)
    return out


async def traffic(port: int, model: str, n_plain: int, n_stream: int, n_abort: int) -> list:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=300)
    jobs = [one_request(client, model, i, False) for i in range(n_plain)]
    jobs += [one_request(client, model, 100 + i, True) for i in range(n_stream)]
    jobs += [one_request(client, model, 200 + i, True, abort_after=3) for i in range(n_abort)]
    res = await asyncio.gather(*jobs)
    await client.close()
    return res


def complete(results: list) -> tuple:
    done = [r for r in results if not r["aborted"]]
    ok = all(r["tokens"] == MAX_TOKENS and r["finish"] == "length" and r["usage"] == MAX_TOKENS
             for r in done)
    return ok, [(r["i"], r["tokens"], r["finish"], r["usage"]) for r in done]


def latency_line(results: list) -> str:
    lat = sorted(r["latency_s"] for r in results if not r["aborted"])
    ttft = sorted(r["ttft_s"] for r in results if r.get("ttft_s") is not None and not r["aborted"])
    mid = lambda xs: xs[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return (f"{len(lat)} complete requests of {MAX_TOKENS} tokens: latency min/median/max "
            f"{lat[0]:.2f}/{mid(lat):.2f}/{lat[-1]:.2f} s; streams' time to first token median "
            f"{mid(ttft):.2f} s")


def lines_with(text: str, needle: str) -> list:
    return [ln for ln in text.splitlines() if needle in ln]


# --- route ------------------------------------------------------------------------------------

def test_route(work: str) -> None:
    log_path = os.path.join(work, "route.jsonl")
    s = Server("route", work, {"DPB_ROUTING": "D", "DPBALANCE_VLLM_ROUTE_LOG": log_path})
    healthy = s.wait_healthy()
    check(healthy, "DPB_ROUTING=D serves: /health OK", f"after {s.ready_s or -1:.0f} s")
    if not healthy:
        print(s.text()[-6000:])
        s.stop()
        return

    async def waves():
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none", timeout=300)
        # Long prompts first, then a mixed wave while they decode: the ranks' loads differ.
        first = [asyncio.ensure_future(one_request(client, s.model, 300 + i, True, n_prompt=n))
                 for i, n in enumerate((1600, 1200, 900))]
        await asyncio.sleep(4)
        second = [one_request(client, s.model, 400 + i, i % 2 == 0, n_prompt=n)
                  for i, n in enumerate((24, 700, 60, 1400, 300, 24, 1000, 150))]
        res = await asyncio.gather(*first, *second)
        await client.close()
        return res

    results = asyncio.run(waves())
    ok, detail = complete(results)
    check(ok, "every routed request is answered completely", str(detail))
    time.sleep(1)
    rows = read_rows(work, "route.jsonl")
    got = {}
    for r in (0, 1):
        for x in read_rows(work, f"route.jsonl.dp{r}"):
            got[x["id"]] = x["rank"]
    routed = [x for x in rows if x["by"] != "pinned"]
    check(len(routed) == len(results) and all(x["by"] == "dpbalance" for x in routed),
          "every request routed by dpbalance's Router", str(Counter(x["by"] for x in rows)))
    check(all(got.get(x["id"]) == x["rank"] for x in routed),
          "each request ran on the DP rank the router chose",
          str([(x["id"][-8:], x["rank"], got.get(x["id"])) for x in routed]))
    check(len(set(x["rank"] for x in routed)) == 2, "both ranks got requests",
          str(Counter(x["rank"] for x in routed)))
    # The Router ABI itself, replayed on the logged loads in the same order, picks the same.
    from dpbalance_vllm import engine_plan
    env = dict(os.environ)
    os.environ.update(DPB_ROUTING="D", DPB_PLUGIN="dpbalance")
    try:
        ref = engine_plan.adapter.Router(2, library=engine_plan.library_path())
        same = [ref.route([engine_plan.adapter.RankLoad(n, c, res, cap, cap_n, m)
                           for n, c, m, res, cap, cap_n in x["loads"]], x["in"], x["out"])
                == x["rank"] for x in routed]
    finally:
        os.environ.clear()
        os.environ.update(env)
    check(all(same), "the Router ABI on the logged loads picks every logged rank",
          f"{sum(same)}/{len(same)}")
    ages = [a for x in routed for a in x["age_steps"] if a is not None]
    fresh = sum(1 for x in routed if all(a is not None for a in x["age_steps"]))
    check(fresh >= len(routed) - 3, "the loads came from both ranks' step records (all but "
          "the first requests, before the ranks stepped)", f"{fresh}/{len(routed)}")
    if ages:
        ages.sort()
        print(f"FIGURE routing: the ranks' records were {ages[len(ages) // 2]:.1f} steps old at "
              f"the median, {ages[-1]:.1f} at most ({len(ages)} rank-decisions)")
    s.stop()

    bad = Server("route-bad", work, {"DPB_ROUTING": "Q"})
    t = time.monotonic()
    while bad.proc.poll() is None and time.monotonic() - t < 240:
        time.sleep(1)
    text = bad.text()
    named = lines_with(text, "DPB_ROUTING='Q' (environment) is not one of")
    check(bad.proc.poll() not in (None, 0) and bool(named),
          "DPB_ROUTING=Q: vllm serve stops at start-up, naming the value",
          f"exit {bad.proc.poll()} after {time.monotonic() - t:.0f} s: "
          f"{(named or ['no such line'])[0][-160:]}")
    bad.stop(timeout_s=30)


# --- serve ------------------------------------------------------------------------------------

def test_serve(work: str) -> None:
    blocks = {p: block_of(os.path.join(ROOT, p)) for p in
              ("README.md", "docs/live_vllm.md", "scripts/serve_vllm.sh")}
    check(all(blocks.values()) and len(set(blocks.values())) == 1,
          "the quickstart block is the same in README.md, docs/live_vllm.md and serve_vllm.sh",
          ", ".join(f"{p}: {len(b)} chars" for p, b in blocks.items()))

    # Every torch.distributed collective is counted in every vLLM process (dpbalance_vllm/audit.py).
    s = Server("serve", work, {"DPBALANCE_VLLM_AUDIT_COLLECTIVES": "1"})
    healthy = s.wait_healthy()
    check(healthy, "the documented command serves: /health OK", f"after {s.ready_s or -1:.0f} s")
    if not healthy:
        print(s.text()[-6000:])
        s.stop()
        return
    print(f"FIGURE start-up (scripts/serve_vllm.sh to /health OK): {s.ready_s:.1f} s")
    t = time.monotonic()
    results = asyncio.run(traffic(s.port, s.model, n_plain=4, n_stream=4, n_abort=2))
    print(f"FIGURE {latency_line(results)}; wall {time.monotonic() - t:.1f} s for "
          f"{len(results)} concurrent requests (2 aborted)")
    ok, detail = complete(results)
    check(ok, "every answer is complete (48 tokens, finish_reason length)", str(detail))
    aborted = [r for r in results if r["aborted"]]
    check(all(0 < r["tokens"] < MAX_TOKENS for r in aborted), "the two streams were aborted "
          "mid-answer", str([(r["i"], r["tokens"]) for r in aborted]))
    after = asyncio.run(traffic(s.port, s.model, n_plain=1, n_stream=0, n_abort=0))
    check(complete(after)[0], "the server answers after the aborts", str(complete(after)[1]))
    text = s.text()
    for r in (0, 1):
        check(bool(lines_with(text, f"dpbalance: enabled on DP rank {r}/2")),
              f"DP rank {r} logged enabled at start-up",
              (lines_with(text, f"dpbalance: enabled on DP rank {r}/2") or ["-"])[0][-200:])
    rows = [s.step_rows(r) for r in (0, 1)]
    planned = [sum(1 for x in rr if "x" in x and x["result"] == "dpbSuccess") for rr in rows]
    busy = [sum(1 for x in rr if "x" in x and x["n"] > 0) for rr in rows]
    check(all(p > 0 for p in planned) and all(b > 0 for b in busy),
          "both ranks planned steps (dpbSuccess) and ran requests",
          f"planned steps {planned}, steps with requests {busy}")

    took, left = s.stop()
    check(not left, "Ctrl-C stops every process", f"in {took:.1f} s, left {left}")
    print(f"FIGURE stop (Ctrl-C to every process gone): {took:.1f} s")
    finals = [[x["final"] for x in s.step_rows(r) if "final" in x] for r in (0, 1)]
    check(all(len(f) == 1 for f in finals), "one final record per rank", str([len(f) for f in finals]))
    if all(finals):
        f0, f1 = finals[0][0], finals[1][0]
        # A rank may make one plan more than its peer that no sync carried (one CI run: 27 plans
        # and 26 syncs on rank 1, 26 and 26 on rank 0, the extra plan after the test's last
        # read, so at Ctrl-C; most likely in the wave's idle tail, where vLLM runs dummy steps
        # until its next DP state sync, dp_sync_interval 16, and the worker was gone before the
        # planned dummy forward ran). It is counted (`unsent`) and leaves no gap (the records
        # are labelled by the sync they ride); the plans that rode a sync match.
        sent = [f["exchanges"] - f.get("unsent", 0) for f in (f0, f1)]
        check(f0["dp_rank"] == 0 and f1["dp_rank"] == 1 and sent[0] == sent[1]
              and (f0.get("worker_ride") or {}).get("syncs") == (f1.get("worker_ride") or {}).get("syncs")
              and f0["desyncs"] == f1["desyncs"] == 0 and f0["enabled"] == f1["enabled"] == 1,
              "the final records: both ranks, the same exchanges riding the same syncs, no desync, "
              "enabled", f"exchanges that rode a sync {sent}")
        for f in (f0, f1):
            keep = ("dp_rank", "exchanges", "unsent", "steps", "balanced_steps", "fallbacks", "enabled",
                    "bubble_fraction", "predicted_error", "goodput_tok_per_s", "max_exchange_ms",
                    "fallback_results", "desyncs", "default_k", "wait_share_window")
            print("FIGURE final " + json.dumps({k: f.get(k) for k in keep}))
        # The quickstart sets no cost flag: the final record names the step terms the plan
        # priced with, learnt online from the flags' defaults, and both ranks hold the same.
        t0, t1 = f0.get("step_terms") or {}, f1.get("step_terms") or {}
        terms = ("ffn_fixed_us", "ffn_per_token_us", "draft_us", "step_overhead_us")
        check(t0.get("online") is True and all(k in t0 for k in terms)
              and all(t0.get(k) == t1.get(k) for k in terms) and t0.get("resets") == 0,
              "the final records name the learnt step terms (FFN, draft, overhead), the same on both ranks",
              json.dumps(t0))
        print("FIGURE step terms " + json.dumps(t0))
        # The record rides vLLM's own DP sync: after init's handshake the package runs no
        # collective of its own, in the engine core or the worker, and every step's sync in the
        # worker carried a record (the test_prometheus server, DPBALANCE_VLLM_EXCHANGE=own, is
        # the control: there the same count sees the package's own all-reduce).
        for f in (f0, f1):
            w = f.get("worker_ride") or {}
            check(f.get("exchange") == "ride" and f.get("audit_own_collectives") == 1
                  and w.get("audit_own_collectives") == 0,
                  f"DP rank {f['dp_rank']}: no collective of the package's own besides init's "
                  "handshake (engine core and worker, counted at torch.distributed)",
                  json.dumps({k: f.get(k) for k in ("exchange", "audit_own_collectives", "worker_ride")}))
            ran = f["steps"] - f.get("unsent", 0)
            check(f.get("missing") == 0 and f.get("carried", 0) >= ran - 1
                  and w.get("carried", 0) >= ran - 1,
                  f"DP rank {f['dp_rank']}: every step's record rode vLLM's sync and every plan "
                  "after the first read the step before's records",
                  json.dumps({k: f.get(k) for k in ("steps", "carried", "missing", "worker_ride")}))
            print("FIGURE ride " + json.dumps({k: f.get(k) for k in (
                "dp_rank", "steps", "carried", "missing", "own_collectives",
                "audit_own_collectives", "worker_ride")}))
        plan_us = [x["plan_us"] for r in (0, 1) for x in s.step_rows(r) if x.get("plan_us")]
        if plan_us:
            plan_us.sort()
            print(f"FIGURE plan call (the exchange included): median {plan_us[len(plan_us) // 2]:.0f} us "
                  f"over {len(plan_us)} steps")

    # DPB_MODE=bogus: one line per rank at start-up, before /health; the server serves anyway.
    b = Server("bogus", work, {"DPB_MODE": "bogus"})
    healthy = b.wait_healthy()
    text = b.text()
    bad = lines_with(text, "bad configuration")
    check(healthy, "DPB_MODE=bogus: the server still starts (balancing off)",
          f"after {b.ready_s or -1:.0f} s")
    for r in (0, 1):
        mine = [ln for ln in bad if f"DP rank {r}:" in ln]
        check(len(mine) == 1 and "DPB_MODE: 'bogus'" in mine[0] and "Balancing is OFF" in mine[0],
              f"DPB_MODE=bogus: one start-up error line on DP rank {r}", (mine or ["-"])[0])
        if mine:
            print("FIGURE start-up error line: " + mine[0].strip())
    check(not lines_with(text, "dpbalance: enabled on DP rank"), "DPB_MODE=bogus: no rank says "
          "enabled")
    if healthy:
        res = asyncio.run(traffic(b.port, b.model, n_plain=2, n_stream=1, n_abort=0))
        check(complete(res)[0], "DPB_MODE=bogus: answers complete", str(complete(res)[1]))
    b.stop()
    configs = [sum(1 for x in b.step_rows(r) if x.get("result") == "config") for r in (0, 1)]
    check(healthy and all(c > 0 for c in configs), "DPB_MODE=bogus: steps ran at vLLM's own "
          "length, counted as refused configuration", str(configs))

    # DPB_STRICT=1: refuses to start.
    t0 = time.monotonic()
    st = Server("strict", work, {"DPB_MODE": "bogus", "DPB_STRICT": "1"})
    healthy = st.wait_healthy(timeout_s=300)
    rc = st.proc.poll()
    took = time.monotonic() - t0
    text = st.text()
    refuse = lines_with(text, "DPB_STRICT=1: refusing to start")
    check(not healthy and rc not in (None, 0), "DPB_STRICT=1 with DPB_MODE=bogus: vLLM exits "
          "without serving", f"exit status {rc} after {took:.0f} s")
    check(bool(refuse) and "DPB_MODE: 'bogus'" in refuse[0], "DPB_STRICT=1: the refusal names "
          "the flag and the value", (refuse or ["-"])[0].strip())
    if refuse:
        print("FIGURE strict refusal line: " + refuse[0].strip())
    _, left = st.stop(timeout_s=30)
    check(not left, "DPB_STRICT=1: no process left", str(left))


# --- prometheus -------------------------------------------------------------------------------

def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def dpb_samples(text: str) -> dict:
    """{(sample name, labels as a sorted tuple): value} of the dpbalance_ series, parsed by
    prometheus_client's own parser (which raises on malformed text)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("dpbalance_"):
                out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = tuple(sorted((k, str(v)) for k, v in labels.items()))
    return sum(v for (n, lab), v in samples.items() if n == name and set(want) <= set(lab))


def test_prometheus_units() -> None:
    """The exporter's failures, in this process: each is one line and no exception."""
    import logging
    from dpbalance_vllm import metrics  # the venv's: installed from this checkout
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("vllm.dpbalance").addHandler(Catch())
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = "/proc/self/fdinfo"  # no file can be made there
    m = metrics.RankMetrics.create(0)
    check(m is None and any("Prometheus series not exported" in s and "/proc/self/fdinfo" in s
                            for s in seen),
          "an unwritable multiprocess directory is one line, no series", (seen or ["-"])[-1])
    if m is None and seen:
        print("FIGURE unwritable-directory line: " + seen[-1])
    # ... and the rank balances all the same (the installed package, its bundled plugin).
    import types
    from dpbalance_vllm import engine_plan
    os.environ.update(DPB_PLUGIN="dpbalance", DPB_LOG_LEVEL="warn")
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(
        data_parallel_size=1, data_parallel_rank=0))
    plan = engine_plan.EnginePlan(cfg, 7, "ngram")
    lens = []
    for _ in range(3):  # three engine steps: plan, then report
        lens.append(plan.exchange([("a", 4000, 7), ("b", 100, 7)]))
        plan.after_step(800.0, 5000.0, [("a", lens[-1][0], 1, False),
                                        ("b", lens[-1][1], 1, False)], 2 + sum(lens[-1]))
    balancing = plan.dpb is not None and plan.dpb.last_result == 0
    plan.close()
    check(plan.metrics is None and balancing and not plan.fallbacks and plan.exchanges == 3
          and all(len(x) == 2 for x in lens), "with the directory unwritable the rank still "
          "balances", f"lens {lens}, fallbacks {plan.fallbacks}")
    for k in ("PROMETHEUS_MULTIPROC_DIR", "DPB_PLUGIN", "DPB_LOG_LEVEL"):
        del os.environ[k]


def test_prometheus(work: str) -> None:
    test_prometheus_units()
    # A metrics port in use for rank 0 (DPBALANCE_VLLM_METRICS_PORT serves rank r on port + r):
    # rank 0 says so and goes on, rank 1 serves its own; vLLM's /metrics has both either way.
    mport = free_port(2)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", mport))
    blocker.listen(1)
    # The plugin's own all-reduce (DPBALANCE_VLLM_EXCHANGE=own), audited: the control of
    # test_serve's check that riding vLLM's sync runs no collective of the package's own.
    s = Server("prometheus", work, {"DPBALANCE_VLLM_METRICS_PORT": str(mport),
                                    "DPBALANCE_VLLM_EXCHANGE": "own",
                                    "DPBALANCE_VLLM_AUDIT_COLLECTIVES": "1"})
    healthy = s.wait_healthy()
    check(healthy, "the server starts", f"after {s.ready_s or -1:.0f} s")
    if not healthy:
        print(s.text()[-6000:])
        s.stop()
        return
    asyncio.run(traffic(s.port, s.model, n_plain=3, n_stream=1, n_abort=0))
    first = scrape(s.port)
    asyncio.run(traffic(s.port, s.model, n_plain=3, n_stream=1, n_abort=0))
    second = scrape(s.port)
    own = ""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{mport + 1}/metrics", timeout=10) as r:
            own = r.read().decode()
    except OSError as e:
        own = f"unreachable: {e}"
    text = s.text()
    took, _ = s.stop()
    blocker.close()
    try:
        a, b = dpb_samples(first), dpb_samples(second)
        parsed = True
    except Exception as e:  # noqa: BLE001 - a parse error fails the check below
        a = b = {}
        parsed = str(e)
    check(parsed is True, "both scrapes parse with prometheus_client's parser", str(parsed))
    from dpbalance_vllm import metrics
    for name, kind, _ in metrics.SERIES:
        sample = name + ("_total" if kind == "counter" else "_count" if kind == "histogram" else "")
        for r in (0, 1):
            check(any(n == sample and ("dp_rank", str(r)) in lab for n, lab in b),
                  f"{sample} for dp_rank {r}")
    for r in (0, 1):
        for name in ("dpbalance_steps_total", "dpbalance_attention_seconds_count",
                     "dpbalance_exchange_seconds_count"):
            check(value(b, name, dp_rank=r) > value(a, name, dp_rank=r) > 0,
                  f"{name} moved between the scrapes on dp_rank {r}",
                  f"{value(a, name, dp_rank=r)} -> {value(b, name, dp_rank=r)}")
        check(value(b, "dpbalance_enabled", dp_rank=r) == 1, f"dpbalance_enabled is 1 on dp_rank {r}")
        check(value(b, "dpbalance_fallbacks_total", dp_rank=r) == 0, f"no fallback on dp_rank {r}")
    check(sum(value(b, "dpbalance_verify_tokens_planned_total", dp_rank=r) for r in (0, 1))
          > sum(value(a, "dpbalance_verify_tokens_planned_total", dp_rank=r) for r in (0, 1)) > 0,
          "verify tokens planned moved")
    check(sum(value(b, "dpbalance_barrier_wait_seconds_count", dp_rank=r) for r in (0, 1)) > 0,
          "barrier waits observed")
    port_lines = lines_with(text, f"cannot serve Prometheus series on port {mport}")
    check(len(port_lines) == 1 and "balancing is not affected" in port_lines[0],
          "a metrics port in use: one line on DP rank 0", (port_lines or ["-"])[0].strip())
    if port_lines:
        print("FIGURE port-in-use line: " + port_lines[0].strip())
    finals = [[x["final"] for x in s.step_rows(r) if "final" in x] for r in (0, 1)]
    counted = [f[-1].get("audit_own_collectives", 0) if f else 0 for f in finals]
    exchanged = [f[-1].get("exchanges", 0) if f else 0 for f in finals]
    check(all(c >= e + 1 > 1 for c, e in zip(counted, exchanged)),
          "DPBALANCE_VLLM_EXCHANGE=own: the audit counts the package's own all-reduce (init + "
          "every exchanged step)", f"counted {counted}, exchanged steps {exchanged}")
    check('dpbalance_steps_total{dp_rank="1"}' in own, "rank 1 serves its own series on "
          "DPBALANCE_VLLM_METRICS_PORT + 1", own[:120])
    check(all(lines_with(text, f"dpbalance: enabled on DP rank {r}/2") for r in (0, 1)),
          "both ranks balanced while the port was in use")
    print(f"FIGURE stop {took:.1f} s; dpbalance_ lines of the second scrape "
          f"(histogram buckets left out):")
    for ln in second.splitlines():
        if ln.startswith("dpbalance_") and "_bucket" not in ln:
            print("  " + ln)
    # The step report of this live run (scripts/dpbalance-report): one self-contained page.
    html = os.path.join(work, "report_live.html")
    r = subprocess.run([os.path.join(ROOT, "scripts", "dpbalance-report"), "--step-log", s.steps,
                        "--out", html], capture_output=True, text=True, timeout=600)
    size = os.path.getsize(html) if os.path.exists(html) else 0
    check(r.returncode == 0 and size > 10000 and "<svg" in open(html).read(),
          "dpbalance-report writes one page from the run's step logs",
          f"exit {r.returncode}, {size} bytes; {r.stderr.strip()[-300:]}")


def test_draft(work: str) -> None:
    lb = os.path.join(ROOT, "integration", "vllm", "live_bench.py")
    model, draft, logs = (os.path.join(work, n) for n in ("model", "draft", "steps-draft"))
    for path, shape in ((model, "decode"), (draft, "draft")):
        subprocess.run([sys.executable, lb, "write-model", path, "--shape", shape], check=True)
    e = {k: v for k, v in os.environ.items()
         if not (k.startswith("DPB_") or k.startswith("DPBALANCE_"))}
    e.update(DPB_PLUGIN="dpbalance", DPBALANCE_VLLM_CPU_DP="1", DPBALANCE_VLLM_STEP_LOG=logs,
             DPBALANCE_VLLM_AUDIT_COLLECTIVES="1", VLLM_CPU_KVCACHE_SPACE="1",
             VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_ENABLE_V1_MULTIPROCESSING="1",
             VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", DPB_LOG_EVERY="0")
    k, n = 3, 16
    t = time.monotonic()
    r = subprocess.run([sys.executable, lb, "run-arm", "--name", "draft", "--mode", "dpbalance",
                        "--model", model, "--log-dir", logs, "--dp", "2", "--k-spec", str(k),
                        "--requests", str(n), "--max-out", "96", "--drafter", "draft_model",
                        "--draft-model", draft, "--trace",
                        os.path.join(ROOT, "integration", "replay", "data",
                                     "mooncake_conversation.jsonl")],
                       env=e, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    check(r.returncode == 0 and f"{n}/{n} requests" in out and "hung=0" in out,
          "the draft-model arm serves every request", out.strip().splitlines()[-1] if out.strip() else "")
    if r.returncode != 0:
        print(out[-4000:])
        return
    print(f"FIGURE draft-model arm: {time.monotonic() - t:.0f} s for {n} requests")
    client = json.load(open(os.path.join(logs, "client.json")))
    check(client.get("drafter") == "draft_model", "vLLM drafted with its draft-model proposer",
          str(client.get("drafter")))
    line = next((ln for ln in out.splitlines() if "dpbalance: enabled on DP rank 0/2" in ln), "")
    check("draft_model drafts, num_speculative_tokens=3" in line and "draft 1500 us/step" in line,
          "the start-up line names the model drafter and its draft cost", line[-300:])
    plans = [[x for x in read_rows(logs, f"engine_dp{r_}.jsonl") if "x" in x] for r_ in (0, 1)]
    finals = [[x["final"] for x in read_rows(logs, f"engine_dp{r_}.jsonl") if "final" in x]
              for r_ in (0, 1)]
    lens = [n_ for p in plans for x in p for n_ in x["lens"]]
    check(bool(lens) and max(lens) <= k, f"every planned verify length within 0..{k}",
          f"{len(lens)} lengths, max {max(lens) if lens else None}")
    changed = sum(1 for p in plans for x in p if x["changed"])
    check(changed > 0, "the plan trimmed some requests below vLLM's 3 drafts", f"{changed} plans")
    worker = [x for r_ in (0, 1) for x in read_rows(logs, f"worker_dp{r_}.jsonl") if "d" in x]
    verified = [d for x in worker for d in x["d"]]
    check(bool(verified) and max(verified) <= k, "vLLM verified what the plan kept",
          f"max drafts verified {max(verified) if verified else None}")
    if all(finals):
        for f in (finals[0][-1], finals[1][-1]):
            terms = f.get("step_terms") or {}
            check(f.get("exchange") == "ride" and f.get("missing") == 0
                  and f.get("carried", 0) >= f["steps"] - 1 and f.get("audit_own_collectives") == 1
                  and terms.get("draft_learnt") is False,
                  f"DP rank {f['dp_rank']}: records on vLLM's sync, no collective of the "
                  "package's own, the draft depth never varied (its cost kept)",
                  json.dumps({q: f.get(q) for q in ("steps", "carried", "missing",
                                                    "audit_own_collectives", "worker_ride")}))
        acc = sum(x["a"][i] for x in worker for i in range(len(x["d"])) if x["a"][i] >= 0)
        ver = sum(d for d in verified)
        print("FIGURE draft-model " + json.dumps({
            "acceptance": round(acc / ver, 3) if ver else None, "plans": sum(map(len, plans)),
            "plans_changed": changed, "mean_verify_len": round(sum(lens) / len(lens), 3),
            "step_terms": finals[0][-1].get("step_terms")}))
    else:
        check(False, "one final record per rank", str([len(f) for f in finals]))


def read_rows(d: str, name: str) -> list:
    path = os.path.join(d, name)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("serve", "prometheus", "draft", "route"):
        print(__doc__)
        return 2
    work = tempfile.mkdtemp(prefix=f"dpb-{mode}-")
    try:
        {"serve": test_serve, "prometheus": test_prometheus, "draft": test_draft,
         "route": test_route}[mode](work)
    finally:
        print(f"(logs in {work})")
    print(f"{'FAILED: ' + ', '.join(FAILED) if FAILED else 'all passed'}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
