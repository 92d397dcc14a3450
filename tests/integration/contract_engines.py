"""The engine side of the contract tests (contract_test.py): one OS process per engine process,
exchanging over real gloo groups through torch.distributed, each reproducing one engine's
per-step DP sync around ABI v2's `plan`.

Read from the engines' public sources (the search tool's stored copies):
  - SGLang, sgl-project/sglang at commit 0129413b0e0534a39ec7184c5223bcc1a44d2898,
    python/sglang/srt/managers/scheduler_components/dp_attn.py: `MLPSyncBatchInfo` and
    `prepare_mlp_sync_batch_raw`. Each process of the TP group fills an int64 row of 8 fields
    (`_get_local_tensor`: num_tokens, num_tokens_for_logprob, can_run_decode_cuda_graph,
    is_extend_in_batch, local_can_run_tbo, local_forward_mode, can_run_prefill_cuda_graph,
    prefill_cuda_graph_max_prefix_len); `all_gather` starts from `fallback_tensor.repeat(dp_size,
    tp_size * cp_size, 1)` (the idle fallback row: 0, 0, 1, 0, 1, IDLE, 0, 0), gathers every
    process's row over the TP group's CPU group (`all_gather_into_tensor`), overwrites the rows
    of inactive ranks (`tp_active_ranks == 0`) with the fallback row, and reads attn-TP rank 0's
    row of each DP rank (`global_info_tensor[:, 0, :]`) for `global_num_tokens`.
    Here our record rides in extra int64 columns of the same row (W = 8 + record/8), and the
    engine then takes each DP rank's num_tokens and the padded size from `plan`'s result.
    Torch 1.13 (Debian's python3-torch) has no `all_gather_into_tensor` for gloo
    ("no support for _allgather_base in Gloo process group"), so the gather writes the same
    bytes into the (dp * attn_tp, W) rows with `all_gather` over per-row views.
  - vLLM, vllm-project/vllm at commit 00746147f8cf4b7715d9cdc591d5dd6f4d12b27f,
    vllm/v1/worker/gpu/dp_utils.py: `sync_cudagraph_and_dp_padding` fills its own column of a
    zero (6, dp) int32 tensor (num_tokens, cudagraph mode, uniform token count or 0, max query
    len or -1, allow_ubatching, num_reqs) and sums it with `dist.all_reduce` over the DP group's
    CPU group; all-zero token counts return early (no rank has work); otherwise the cudagraph
    dispatch pads max(num_tokens_across_dp) to a captured size and every rank's count becomes
    that size. Here the function first runs `plan` (our record goes through a second gloo
    all-gather, on a group of its own with the plugin's timeout), fills num_tokens from the
    lengths it returned, and takes the padded size from `padded_tokens`.
  - a plain all-gather: `torch_allgather` over a gloo group, the only collective of the step.
"""
import datetime
import os
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "integration", "adapters", "python"))
import dpbalance_plugin as dpb  # noqa: E402

# SGLang's ForwardMode values (python/sglang/srt/model_executor/forward_batch_info.py): the row
# carries them; nothing here depends on the exact numbers beyond IDLE marking the fallback row.
FM_EXTEND, FM_DECODE, FM_MIXED, FM_IDLE = 1, 2, 3, 4
# vLLM's CUDAGraphMode values (NONE, PIECEWISE, FULL).
CG_NONE, CG_PIECEWISE, CG_FULL = 0, 1, 2
KINDS = ("decode", "idle", "extend", "no_verify")


def default_len(default_k, k_cap):
    return max(0, min(default_k, k_cap))


class Pool:
    """One DP rank's running requests, simulated identically by every attn-TP member (the
    engine broadcasts the batch to them): string ids, contexts that grow by what is emitted,
    requests that finish and are replaced. Everything random comes from (seed, dp_rank, step)."""

    def __init__(self, seed, dp_rank, size, ctx_base):
        self.seed, self.dp_rank = seed, dp_rank
        self.ctx_base = ctx_base
        self.next_id = 0
        self.reqs = {}
        self.rng = random.Random(f"{seed}/{dp_rank}/pool")
        for _ in range(size):
            self._admit()

    def _admit(self):
        rid = f"{self.seed}-dp{self.dp_rank}-req{self.next_id:05d}-{self.rng.getrandbits(48):012x}"
        self.next_id += 1
        self.reqs[rid] = {"ctx": self.ctx_base + self.rng.randint(0, self.ctx_base),
                          "left": self.rng.randint(4, 60)}

    def step_kind(self, step, schedule):
        return schedule(self.dp_rank, step)

    def batch(self, kind, k_max, step=0, confidence=False):
        """The step's requests; with `confidence`, each carries the draft's per-position
        confidences (conditional acceptance, what an engine's draft head reports)."""
        if kind == "idle":
            return []
        out = []
        for rid, r in sorted(self.reqs.items()):
            conf = None
            if confidence:
                rng = random.Random(f"{self.seed}/{rid}/{step}/conf")
                conf = [round(rng.uniform(0.2, 0.95), 4) for _ in range(k_max)]
            out.append(dpb.Request(rid, r["ctx"], k_min=0, k_cap=max(0, min(k_max, r["left"] - 1)),
                                   draft_confidence=conf))
        return out

    def advance(self, step, reqs, lens):
        """Accepts drafts (random, the same on every member), returns the Accepted list."""
        rng = random.Random(f"{self.seed}/{self.dp_rank}/{step}/accept")
        out = []
        for r, k in zip(reqs, lens):
            acc = sum(1 for _ in range(k) if rng.random() < 0.7)
            st = self.reqs[r.request_id]
            st["ctx"] += 1 + acc
            st["left"] -= 1 + acc
            fin = st["left"] <= 0
            out.append(dpb.Accepted(r.request_id, k, acc, fin))
            if fin:
                del self.reqs[r.request_id]
        while len(self.reqs) < 6:
            self._admit()
        return out


def attention_us(reqs, lens, noise):
    q = [1 + k for k in lens]
    return 1500.0 + noise + sum(250.0 * qi + 0.02 * qi * r.ctx_tokens for qi, r in zip(q, reqs))


def spread_budget(reqs, budget, depth):
    """An engine's use of a verify-token budget (granularity "budget"): draft positions by
    cumulative confidence (the chance the position is accepted), best first, within k_cap and
    the agreed draft depth (what was drafted)."""
    items = []
    for i, r in enumerate(reqs):
        cum = 1.0
        for j in range(1, min(r.k_cap, depth) + 1):
            cum *= r.draft_confidence[j - 1]
            items.append((-cum, i, j))
    items.sort()
    lens = [0] * len(reqs)
    for _, i, j in items[:budget]:
        lens[i] = max(lens[i], j)
    return lens


def engine_total(lens, extra):
    return sum(1 + k for k in lens) + extra


def tier_of(tiers, tokens):
    for t in tiers:
        if t >= tokens:
            return t
    return tokens


class CountingGather:
    """The engine's callback for a record collective of its own: counts calls, so the engine
    can run the collective with a zero record on a step where the plugin did not (a rank
    without the plugin, or one that stopped exchanging), keeping every process's collectives
    paired."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def __call__(self, send, timeout_ms):
        self.calls += 1
        return self.inner(send, timeout_ms)

    def gather_into(self, send, recv, timeout_ms):
        self.calls += 1
        return self.inner.gather_into(send, recv, timeout_ms)


class Faulty:
    """A callback that misbehaves on chosen calls (every process alike, as a transport does):
    'short' returns 8 bytes fewer than asked; 'long' returns more bytes than the receive buffer
    holds (the adapter must not write them)."""

    def __init__(self, inner, faults):
        self.inner, self.faults, self.calls = inner, faults, 0

    def __call__(self, send, timeout_ms):
        call = self.calls
        self.calls += 1
        out = self.inner(send, timeout_ms)
        fault = self.faults.get(call)
        if fault == "short":
            return out[:-8]
        if fault == "long":
            return out + bytes(len(send))
        return out


class StderrTo:
    """Sends this process's fd 2 (the plugin's spdlog sink, Python's logging) to a file for the
    duration of a case, so the driver can check what the errors named."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)


# --- the per-step engine syncs ------------------------------------------------------------


class SglangSync:
    """MLPSyncBatchInfo.all_gather with our record in extra int64 columns (see the module
    docstring). `inactive(step)` is the set of global process indices whose rows the engine
    overwrites with the fallback row (SGLang's tp_active_ranks == 0); its record columns carry
    the idle row (dpb.IDLE_ROW: the patched engine widens `_get_fallback_tensor` with it), so the
    others plan that DP rank as one that runs nothing. `zero_rows(step)`: processes whose record
    columns arrive as zeros instead (a rank without a working plugin): every rank pauses."""

    FIELDS = 8

    def __init__(self, group, dp, attn_tp, inactive, zero_rows=lambda _step: ()):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.group = torch, dist, group
        self.dp, self.attn_tp, self.inactive, self.zero_rows = dp, attn_tp, inactive, zero_rows
        self.step = -1
        self.gathered = None

    def fallback_row(self, width):
        torch = self.torch
        row = torch.zeros(width, dtype=torch.int64)
        row[:self.FIELDS] = torch.tensor([0, 0, 1, 0, 1, FM_IDLE, 0, 0])
        idle = torch.frombuffer(bytearray(dpb.IDLE_ROW), dtype=torch.int64)
        if width >= self.FIELDS + len(idle):  # a step's row (the handshake's has no fields)
            row[self.FIELDS:self.FIELDS + len(idle)] = idle
        return row

    def __call__(self, payload_and_record: bytes) -> bytes:
        torch = self.torch
        n = len(payload_and_record)
        width = -(-n // 8)
        buf = bytearray(payload_and_record) + bytes(width * 8 - n)
        local = torch.frombuffer(buf, dtype=torch.int64).clone()
        fallback = self.fallback_row(width)
        global_info = fallback.repeat(self.dp, self.attn_tp, 1)
        rows = global_info.view(self.dp * self.attn_tp, width)
        self.dist.all_gather(list(rows.unbind(0)), local, group=self.group)
        for g in self.inactive(self.step):
            rows[g] = fallback
        for g in self.zero_rows(self.step):
            rows[g][self.FIELDS:] = 0
        self.gathered = global_info
        raw = rows.numpy().tobytes()
        return b"".join(raw[g * width * 8:g * width * 8 + n] for g in range(self.dp * self.attn_tp))


def sglang_row(kind, default_total):
    """_get_local_tensor's eight fields as the scheduler fills them before the sync."""
    mode = {"decode": FM_DECODE, "no_verify": FM_DECODE, "idle": FM_IDLE, "extend": FM_EXTEND}[kind]
    num = 0 if kind == "idle" else default_total
    return [num, num, int(kind in ("decode", "no_verify", "idle")), int(kind == "extend"), 1,
            mode, 0, 0]


def vllm_sync_tensor(torch, dp, dp_rank, num_tokens, kind, lens, num_reqs):
    """sync_cudagraph_and_dp_padding's (6, dp) int32 tensor, this rank's column filled."""
    t = torch.zeros(6, dp, dtype=torch.int32)
    uniform = (1 + lens[0]) if lens and len(set(lens)) == 1 and kind != "extend" else 0
    t[0][dp_rank] = num_tokens
    t[1][dp_rank] = CG_FULL if kind in ("decode", "no_verify", "idle") else CG_PIECEWISE
    t[2][dp_rank] = uniform
    t[3][dp_rank] = max([1 + k for k in lens], default=-1) if kind != "extend" else -1
    t[4][dp_rank] = 0
    t[5][dp_rank] = num_reqs
    return t


# --- one process ---------------------------------------------------------------------------


def step_record(step, kind, reqs, extra, res, plan_ms, default_k, **more):
    lens = list(res.verify_len) if res is not None else [default_len(default_k, r.k_cap) for r in reqs]
    rec = {"step": step, "kind": kind, "n": len(reqs), "extra": extra, "plan_ms": plan_ms,
           "caps": [r.k_cap for r in reqs], "mins": [r.k_min for r in reqs], "lens": lens,
           "own_total": engine_total(lens, extra)}
    if res is not None:
        rec.update(result=res.result, balanced=res.balanced, depth=res.draft_depth,
                   budget=res.verify_budget, padded=res.padded_tokens,
                   rank_tokens=list(res.rank_tokens), rank_flags=list(res.rank_flags),
                   any_flags=res.any_rank_flags)
    rec.update(more)
    return rec


class CaseProcess:
    """One process's part in one case: its engine's sync, its plugin (None: none, or its init
    failed) and its requests; `step` runs one engine step around ABI v2's `plan`."""

    def __init__(self, case, proc, groups):
        import torch
        import torch.distributed as dist
        self.torch, self.dist = torch, dist
        self.case, self.proc = case, proc
        self.spec = case["procs"][proc]
        self.dp, self.attn_tp = case["dp"], case.get("attn_tp", 1)
        self.dp_rank, self.tp_rank = self.spec["dp_rank"], self.spec.get("attn_tp_rank", 0)
        self.engine = case["engine"]
        self.pool = Pool(case["seed"], self.dp_rank, 6 + 2 * self.dp_rank,
                         1500 * (1 + 3 * (self.dp_rank % 2)))
        self.tag = dpb.torch_allgather(groups.get(case["name"]))
        self.engine_group = groups.get(case["name"] + "/engine")  # the engine's own sync (vLLM)
        self.sync = self.pb = None
        self.gather = self.tag
        if self.engine == "sglang":
            self.sync = SglangSync(groups.get(case["name"]), self.dp, self.attn_tp,
                                   lambda s: case.get("inactive", {}).get(s, ()),
                                   lambda s: case.get("zero_rows", {}).get(s, ()))
            self.pb = dpb.Piggyback(self.sync, self.dp * self.attn_tp)
            self.gather = self.pb
        elif self.engine in ("vllm", "plain"):
            self.gather = CountingGather(self.tag)
        if self.spec.get("faults"):
            self.gather = Faulty(self.gather, self.spec["faults"])
        self.bal = None

    def load(self, plugin):
        """The plugin's init (none with `no_plugin`); returns (error or None, init ms)."""
        t0 = time.monotonic()
        error = None
        try:
            if not self.spec.get("no_plugin"):
                abi = self.spec.get("abi", 2)
                kw = {}
                if abi == 2:
                    kw = dict(attn_tp_size=self.spec.get("attn_tp_size", self.attn_tp),
                              attn_tp_rank=self.tp_rank, token_tiers=self.case.get("tiers"),
                              granularity=self.case.get("granularity", "request"))
                self.bal = dpb.DpBalance.load(self.spec.get("dp_size", self.dp), self.dp_rank,
                                              self.spec.get("config", self.case["config"]),
                                              allgather=self.gather, library=plugin, abi=abi, **kw)
        except dpb.DpBalanceError as e:
            error = str(e)
            self.bal = None
        return error, (time.monotonic() - t0) * 1e3

    def inputs(self, step):
        """The step's kind, the pool's requests, what the engine passes (faults applied) and its
        prefill tokens."""
        case, spec = self.case, self.spec
        kind = SCHEDULES[case["schedule"]](self.dp_rank, step)
        if self.proc in case.get("inactive", {}).get(step, ()):
            kind = "idle"  # SGLang's inactive rank runs nothing; the engine writes its row
        pool_reqs = [] if kind == "idle" else self.pool.batch(
            kind, case["k_max"], step, case.get("granularity") == "budget")
        reqs = list(pool_reqs)
        if spec.get("bad_ctx_from") is not None and step >= spec["bad_ctx_from"] and reqs:
            reqs[0] = reqs[0]._replace(ctx_tokens=-5)  # bad input from the engine
        if case.get("tp_skew", {}).get(step) == self.proc and reqs:  # a member seeing another batch
            reqs[0] = reqs[0]._replace(ctx_tokens=reqs[0].ctx_tokens + 1)
        extra = (64 + (step * 37 + self.dp_rank * 11) % 300) if kind == "extend" else 0
        return kind, pool_reqs, reqs, extra

    def lens_of(self, res, reqs):
        default_k = self.case["default_k"]
        return list(res.verify_len) if res is not None else [default_len(default_k, r.k_cap) for r in reqs]

    def sglang_step(self, step, kind, reqs, extra):
        k0 = 0 if kind == "no_verify" else self.case["default_k"]
        default_total = engine_total([default_len(k0, r.k_cap) for r in reqs], extra)
        payload = self.torch.tensor(sglang_row(kind, default_total), dtype=self.torch.int64).numpy().tobytes()
        self.sync.step = step
        t = time.monotonic()
        if self.bal is None:
            sr = self.pb.step(None, reqs, payload)
        else:
            sr = self.pb.step(self.bal, reqs, payload, kind=kind, extra_tokens=extra)
        plan_ms = (time.monotonic() - t) * 1e3
        res = sr.plan
        engine_tokens = self.sync.gathered[:, 0, :][:, 0].tolist()
        lens = self.lens_of(res, reqs)
        # The engine takes every DP rank's num_tokens and the padding from our result where the
        # result knows them, its own gathered column otherwise.
        if res is not None and res.result == dpb.SUCCESS:
            global_tokens = [rt if rt >= 0 else e for rt, e in zip(res.rank_tokens, engine_tokens)]
            padded = res.padded_tokens
        else:
            global_tokens = list(engine_tokens)
            global_tokens[self.dp_rank] = engine_total(lens, extra)
            padded = tier_of(self.case.get("tiers") or [], max(global_tokens))
        return res, plan_ms, dict(engine_rows=engine_tokens, engine_tokens=global_tokens,
                                  engine_padded=padded)

    def vllm_step(self, kind, reqs, extra):
        more = {}
        calls = self.gather.calls if self.bal is not None else 0
        res = None
        t = time.monotonic()
        if self.bal is not None:
            res = self.bal.plan(reqs, kind=kind, extra_tokens=extra)
        plan_ms = (time.monotonic() - t) * 1e3
        if self.bal is None or self.gather.calls == calls:  # the record collective runs anyway
            try:
                self.tag(bytes(dpb.RECORD_BYTES), self.case["timeout_ms"])
            except Exception as e:  # noqa: BLE001 (a broken record group: the engine goes on)
                more["zero_record_error"] = str(e)[:200]
        lens = self.lens_of(res, reqs)
        num_tokens = engine_total(lens, extra)
        if res is not None and res.result == dpb.SUCCESS and res.rank_tokens[self.dp_rank] >= 0:
            num_tokens = res.rank_tokens[self.dp_rank]  # the engine fills its sync from our result
        tensor = vllm_sync_tensor(self.torch, self.dp, self.dp_rank, num_tokens, kind, lens, len(reqs))
        self.dist.all_reduce(tensor, group=self.engine_group)
        across = tensor[0].tolist()
        if all(x == 0 for x in across):
            padded = 0  # sync_cudagraph_and_dp_padding returns early: no rank has work
        elif res is not None and res.result == dpb.SUCCESS:
            padded = res.padded_tokens
        else:
            padded = tier_of(self.case.get("tiers") or [], max(across))
        more.update(engine_tokens=across, engine_padded=padded)
        return res, plan_ms, more

    def plain_step(self, kind, reqs, extra):
        """The plugin's all-gather is the step's only collective."""
        res, more = None, {}
        t = time.monotonic()
        if self.bal is not None:
            res = self.bal.plan(reqs, kind=kind, extra_tokens=extra)
        plan_ms = (time.monotonic() - t) * 1e3
        if res is not None and self.case.get("granularity") == "budget":
            # The engine spreads the budget over its requests by draft confidence itself.
            more["spread_lens"] = spread_budget(reqs, res.verify_budget, res.draft_depth)
        return res, plan_ms, more

    def step(self, step, rng):
        kind, pool_reqs, reqs, extra = self.inputs(step)
        late = self.spec.get("late", {}).get(step, 0.0)
        if late:
            time.sleep(late)
        if self.engine == "sglang":
            res, plan_ms, more = self.sglang_step(step, kind, reqs, extra)
        elif self.engine == "vllm":
            res, plan_ms, more = self.vllm_step(kind, reqs, extra)
        else:
            res, plan_ms, more = self.plain_step(kind, reqs, extra)
        rec = step_record(step, kind, reqs, extra, res, plan_ms, self.case["default_k"], **more)
        if self.bal is not None:
            a = attention_us(reqs, rec["lens"], rng.uniform(0, 200))
            acc = self.pool.advance(step, pool_reqs, rec["lens"]) if reqs else []
            rec["report"] = self.bal.report(a, a + 15000.0, acc)
        elif reqs:
            self.pool.advance(step, pool_reqs, rec["lens"])
        return rec


def run_case(case, proc, world, plugin, logdir, groups):
    """Runs one case on this process; returns its record (or None if it takes no part)."""
    if proc >= len(case["procs"]) or case["procs"][proc] is None:
        return None
    cp = CaseProcess(case, proc, groups)
    out = {"case": case["name"], "proc": proc, "dp_rank": cp.dp_rank, "attn_tp_rank": cp.tp_rank,
           "steps": [], "error": None, "stats": {}, "init_ms": None}
    out["error"], out["init_ms"] = cp.load(plugin)
    out["abi"] = cp.spec.get("abi", 2) if cp.bal is not None else None
    rng = random.Random(f"{case['seed']}/{proc}/noise")
    for step in range(case["steps"]):
        out["steps"].append(cp.step(step, rng))
    if cp.bal is not None:
        out["stats"] = cp.bal.stats()
        cp.bal.close()
    return out


# --- step schedules: which kind each DP rank runs at each step -------------------------------

def mixed_schedule(dp_rank, step):
    """Mostly decode; idle ranks (DP rank 0 idle in steps 10-19, every rank idle at steps 40-41),
    prefill (extend) on one rank at a time, verify skipped by all at steps 70-72 and by one rank
    at steps 75-77."""
    if 40 <= step <= 41:
        return "idle"
    if 10 <= step < 20 and dp_rank == 0:
        return "idle"
    if 70 <= step <= 72:
        return "no_verify"
    if 75 <= step <= 77 and dp_rank == 1:
        return "no_verify"
    if step % 9 == 4 and dp_rank == step % 3:
        return "extend"
    if step % 13 == 7 and dp_rank == 1:
        return "idle"
    return "decode"


def decode_schedule(_dp_rank, _step):
    return "decode"


SCHEDULES = {"mixed": mixed_schedule, "decode": decode_schedule}


def process_main(proc, world, store, plugin, suite, logdir, q):
    """One engine process: joins the default gloo group, then runs every case of the suite on a
    gloo group made for it (a timed-out gloo group closes its connections, so each case starts
    clean), and puts (proc, case, record) on `q`."""
    try:
        if os.environ.get("CONTRACT_EXPECT_ASAN"):  # the ASan build: the runtime is loaded
            with open("/proc/self/maps") as m:
                if "libasan" not in m.read():
                    raise RuntimeError("CONTRACT_EXPECT_ASAN is set but libasan is not mapped "
                                       "in this process (LD_PRELOAD did not reach it)")
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=proc, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        for case in suite:
            members = [i for i, s in enumerate(case["procs"]) if s is not None]
            dist.barrier()
            timeout = datetime.timedelta(milliseconds=case["timeout_ms"])
            groups = {case["name"]: dist.new_group(members, timeout=timeout, backend="gloo")}
            groups[case["name"] + "/engine"] = dist.new_group(
                members, timeout=datetime.timedelta(seconds=60), backend="gloo")
            dist.barrier()
            rec = None
            if proc in members:
                with StderrTo(os.path.join(logdir, f"{case['name']}.{proc}.log")):
                    rec = run_case(case, proc, world, plugin, logdir, groups)
            q.put((proc, case["name"], rec))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # the driver reports it; the process must not hang the suite
        q.put((proc, "__crash__", traceback.format_exc()))
        raise
