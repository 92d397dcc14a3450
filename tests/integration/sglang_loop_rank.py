"""One SGLang scheduler process running SGLang 0.5.23's own event loop on CPUs (driver:
sglang_loop_probe.py).

What runs is SGLang's: `Scheduler.__init__` as `run_scheduler_process` calls it (ServerArgs
published with `publish`, SGLang's PortArgs, the TP worker and its ModelRunner built from a
config.json model with load_format=dummy and the torch_native attention backend, SGLang's memory
pools, radix cache, the speculative worker), requests sent as SGLang's TokenizedGenerateReqInput
over the scheduler's own zmq input socket (as the DP controller sends them), then
`Scheduler.event_loop_normal` or `Scheduler.event_loop_overlap` itself: `ingest_requests`,
`get_next_batch_to_run` (with its MLP syncs over SGLang's gloo TP group), `run_batch`,
`batch.copy()` into `result_queue`, `process_batch_result`, the speculative worker's step logic,
and the outputs SGLang sends back on its tokenizer socket (read here to see requests finish).

What stands in for SGLang is only below the model forward, where this CPU cannot run SGLang's
code (no GPU, no Triton driver, no CUDA graphs); every stand-in is in the section "STAND-INS"
below, each with the SGLang function it replaces and why. sglang_loop_NOTES.md has the details.

Observation (not stand-ins: each wrapper calls SGLang's own function and only records): the
iteration counter on `Scheduler.ingest_requests` (the loop's first call per iteration; it also
sends the requests due at that iteration into the scheduler's socket, and raises StopLoop after
case["iterations"] iterations, which ends SGLang's `while True` loop: both ranks stop at the
same iteration, since every iteration holds a collective), `Scheduler.get_next_batch_to_run`,
`SchedulerDPAttnAdapter.prepare_mlp_sync_batch` (the MLP sync: counted), `Scheduler.run_batch`,
`ScheduleBatch.copy`, `Scheduler.process_batch_result`, `Scheduler.on_idle`, the loop entered
(`event_loop_overlap` / `event_loop_normal`, reached through SGLang's `run_event_loop`), the
speculative worker's `forward_batch_generation` (the depth it runs), `activate_step_by_batch`
and `on_verify_complete_cpu` (adaptive EAGLE), DSpark's `DSparkVerifyPlanner.schedule_layout`
and `_maybe_gather_dp_verify_tier`.

case (a dict; sglang_loop_probe.make_case builds one): name, loop ("overlap" | "normal"), spec
("none" | "eagle" | "eagle_adaptive" | "dspark" | "dspark_sps"), iterations, requests (list of
{rid, dp, prompt_len, max_new_tokens, at[, prompt_key]}), seed, accept (probability that the
draft guesses the target's token), accept_by_dp ({"0": p, ...}), env (set in both processes
before anything is imported; DPB_PLUGIN among them), proc_env ({"0": {...}}: one process),
load_plugins ("before_scheduler": where run_scheduler_process calls SGLang's load_plugins(),
the default | "after_scheduler" | "no"), eagle ({steps, adaptive_config}), dspark
({sps_table}), server_args (extra ServerArgs fields), model_seed.

The record (JSON-able) put on the queue: per iteration `iter`, `events` (the loop phases in
the order they ran: ("sync", local batch, synced batch, global_num_tokens), ("run_batch", ...),
("copy", ...), ("process_batch_result", {batch, accept_lens, num_correct_drafts}), ("on_idle",),
adaptive and DSpark events), `syncs`, `batch` (mode and size get_next_batch_to_run returned),
`spec` (per worker step: mode, bs, steps = draft depth, DSpark's gamma), `dspark_layout`,
`seconds`; and totals, timing, the outputs SGLang sent per request (ids, finish reason, and
whether they equal the target's greedy chain), stand-in call counts, the adaptive controller's
states, dpbalance_sglang's own summary when DPB_PLUGIN is set.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
import zlib
from array import array


VOCAB = 256
# The target: a dense Llama whose decoder stack is stood in (below). hidden_size == vocab_size
# so that the stand-in's hidden states can be one-hot rows that SGLang's own LM head (identity
# weights, set after the dummy load) and LogitsProcessor turn into the intended logits.
TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": VOCAB,
          "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
          "hidden_act": "silu"}
# The DSpark draft: SGLang's dense DSparkDraftModel (a DFlash block-parallel draft with a
# Markov head and a confidence head), one layer, block_size 4 (gamma 4: verify windows of 5,
# anchor included), reading the target's layer 1; it shares the target's embedding and LM head.
DSPARK_DRAFT = dict(TARGET, architectures=["DSparkDraftModel"], num_hidden_layers=1,
                    head_dim=64, num_target_layers=2, block_size=4,
                    dflash_config={"target_layer_ids": [1], "mask_token_id": VOCAB - 1,
                                   "block_size": 4},
                    markov_rank=8, markov_head_type="vanilla",
                    dspark_config={"markov_rank": 8, "markov_head_type": "vanilla"})
DEFAULT_SPS_TABLE = {"sample_batch_tokens": [1, 4, 8, 12, 16, 24, 32, 64],
                     "sample_steps_per_sec": [100.0, 98.0, 92.0, 80.0, 66.0, 50.0, 40.0, 22.0],
                     "max_batch_tokens": 256}
# The EAGLE draft (one layer, SGLang's LlamaForCausalLMEagle; it shares the target's embedding
# and LM head, as EAGLE does).
EAGLE_DRAFT = dict(TARGET, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)


ITERATION = [0]  # the loop's current iteration (the observation's counter sets it)


class StopLoop(Exception):
    """Raised by the iteration counter at the top of an iteration to leave SGLang's loop."""


# --------------------------------------------------------------------------------------------
# The deterministic "model": what the target predicts after token t at position p, and what the
# draft predicts (the target's token with probability case["accept"], else another one).
# --------------------------------------------------------------------------------------------

def _mix(*xs):
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h ^= (int(x) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return h


def target_tokens(torch, ids, pos, seed):
    """Vectorised: the target's next token after ids[i] at position pos[i] (never 0-2)."""
    x = ids.long() * 1000003 + pos.long() * 7919 + seed
    x = (x ^ (x >> 7)) * 2654435761
    return (x.abs() % (VOCAB - 3)) + 3


def draft_tokens(torch, ids, pos, seed, accept, shift=1):
    """The draft's guess of the target's token after ids[i] at position pos[i] + shift: right
    with probability accept (per token and position), else another token. EAGLE's draft sees
    token t_{p+1} beside the target's hidden state of position p (its inputs are shifted by one
    against its positions), hence shift 1 there."""
    pos = pos + shift
    t = target_tokens(torch, ids, pos, seed)
    x = ids.long() * 40503 + pos.long() * 9973 + seed * 31 + 17
    x = ((x ^ (x >> 5)) * 2246822519).abs() % 1000
    wrong = (t - 3 + 1 + (x % 7)) % (VOCAB - 3) + 3
    return torch.where(x < int(accept * 1000), t, wrong)


# ============================================================================================
# STAND-INS (every one of them; each replaces one SGLang function that cannot run on this CPU)
#
#  0. Triton: SGLang's Triton kernels run in Triton's own interpreter (TRITON_INTERPRET=1, set
#     in process_main before anything imports triton), on CPU tensors: Triton has no driver
#     here ("0 active drivers ([]). There should only be one.", triton/runtime/driver.py:20).
#     The kernels are SGLang's; only the executor differs.
#  1-5. install_stand_ins, below: pinned memory / record_stream, the torch_native backend's
#     DP padding value, the EAGLE draft's multi-step attention backend, device dispatch to
#     SGLang's Triton paths, and the models' decoder stacks.
#     The target's stand-in still calls each decoder layer's own attention (RadixAttention ->
#     the torch_native backend over the KV cache) on decode and extend forwards, so that what
#     hooks an attention layer runs on its real path; not on verify forwards, which torch_native
#     has no path for (it reads extend_prefix_lens, None there: torch_native_backend.py:101).
#  6. set_identity_lm_head: the dummy-loaded LM head's weights (model data, not code).
#  7. case["draft_moe"]: DSpark's draft counts as MoE (DSparkWorkerV2._draft_is_moe), so that
#     SGLang's DP tier agreement runs; it does for a DeepSeek-V4 draft only, whose model cannot
#     be built here.
#  A-E. install_argument_overrides: SGLang's argument resolution refuses speculative decoding
#     on a CPU device (and adaptive EAGLE under attention DP, unless dpbalance lifts it); those
#     refusals are lifted.
# ============================================================================================

def install_stand_ins(case, stats):
    """Installed before SGLang builds anything, in this process only."""
    _stand_in_pinned_memory()
    _stand_in_dp_fill_value()
    _stand_in_draft_backends()
    _stand_in_device_dispatch()
    _stand_in_decoder_stacks(case, stats)


def _stand_in_pinned_memory():
    import torch

    # 1. Pinned host memory. SGLang allocates page-locked staging tensors (pin_memory=True in
    #    ~190 places: forward_batch_info.prepare_mlp_sync_batch, schedule_batch, samplers...).
    #    Page-locking needs the CUDA driver: torch raises "Found no NVIDIA driver on your
    #    system". On a CPU device pinning changes no value, so the flag is dropped.
    def no_pin(fn):
        @functools.wraps(fn)
        def call(*a, **k):
            k.pop("pin_memory", None)
            return fn(*a, **k)
        return call

    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor",
                 "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided"):
        if hasattr(torch, name):
            setattr(torch, name, no_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    #    Likewise Tensor.record_stream (a hint to the CUDA caching allocator; DSpark's
    #    _forward_decode calls it with torch.cpu.current_stream(), which torch refuses:
    #    "unknown parameter type"): a no-op for CPU tensors.
    shipped_record_stream = torch.Tensor.record_stream

    def record_stream(self, stream):
        if self.device.type == "cpu":
            return None
        return shipped_record_stream(self, stream)

    torch.Tensor.record_stream = record_stream


def _stand_in_dp_fill_value():
    # 2. TorchNativeAttnBackend.get_cuda_graph_seq_len_fill_value. Under DP attention SGLang pads
    #    every rank's ForwardBatch (forward_batch_info._pad_inputs_to_size) with the seq-len fill
    #    value of the attention backend; SGLang's GPU backends (flashinfer, triton, fa3) give 1,
    #    the CPU reference backend torch_native has none (base_attn_backend.py raises
    #    NotImplementedError). The GPU backends need a GPU; the value is theirs.
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    TorchNativeAttnBackend.get_cuda_graph_seq_len_fill_value = lambda self: 1


def _stand_in_draft_backends():
    # 3. DraftBackendFactory.create_decode_backend / create_draft_extend_backend
    #    (speculative/draft_utils.py): the EAGLE draft's multi-step decode backend exists only
    #    for GPU attention backends (flashinfer, triton, fa3, ...: "EAGLE is not supported in
    #    decode attention backend torch_native"); their metadata builders are Triton/CUDA
    #    kernels. With torch_native the factory gives the same shape of object: one
    #    TorchNativeAttnBackend of the draft runner per draft step in `attn_backends`, and one
    #    for draft extend. (The stood-in decoder stack reads no attention metadata.)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.speculative import draft_utils

    class TorchNativeMultiStepDraftBackend:
        def __init__(self, model_runner, topk, speculative_num_steps):
            self.topk = topk
            self.speculative_num_steps = speculative_num_steps
            self.attn_backends = [TorchNativeAttnBackend(model_runner)
                                  for _ in range(max(1, speculative_num_steps - 1))]

        def init_forward_metadata(self, forward_batch):
            for b in self.attn_backends:
                b.init_forward_metadata(forward_batch)

    shipped_decode = draft_utils.DraftBackendFactory.create_decode_backend
    shipped_extend = draft_utils.DraftBackendFactory.create_draft_extend_backend

    def _torch_native(factory):
        from sglang.srt.runtime_context import attention_backends

        return (factory.draft_attn_backend or attention_backends()[1]) == "torch_native"

    def create_decode_backend(self):
        if self.speculative_num_steps <= 1 or not _torch_native(self):
            return shipped_decode(self)
        return TorchNativeMultiStepDraftBackend(self.draft_model_runner, self.topk,
                                                self.speculative_num_steps)

    def create_draft_extend_backend(self):
        if not _torch_native(self):
            return shipped_extend(self)
        return TorchNativeAttnBackend(self.draft_model_runner)

    draft_utils.DraftBackendFactory.create_decode_backend = create_decode_backend
    draft_utils.DraftBackendFactory.create_draft_extend_backend = create_draft_extend_backend


def _stand_in_device_dispatch():
    # 4. EAGLE tree construction and greedy tree verification (kernels/ops/speculative/
    #    spec_tree.py: build_tree_kernel_efficient_func, verify_tree_greedy_func) dispatch by
    #    device to CUDA kernels (sgl_kernel / kernels.ops.speculative.tree), to sgl_kernel's CPU
    #    build, or to SGLang's own Triton versions (sgl_build_tree_kernel_triton,
    #    verify_tree_greedy_triton, the XPU path); anything else is refused
    #    ("Out-of-tree platform DpbCpuPlatform (device 'cpu') reached EAGLE tree
    #    construction"). The module's device flag selects SGLang's Triton versions, which run
    #    in Triton's interpreter (stand-in 0).
    #    The same for the speculative cache-location kernels (kernels/ops/speculative/
    #    cache_locs.py: assign_extend_cache_locs_uniform_func, assign_extend_cache_locs_func,
    #    ...): `_is_cuda or _is_hip or _is_musa or _is_xpu` selects SGLang's Triton kernels, the
    #    ones a GPU runs; otherwise CPU falls to sgl_kernel's CPU ops (not installed) or to a
    #    path that returns None (DSpark's alloc_verify_window: "'NoneType' object has no
    #    attribute 'view'").
    from sglang.kernels.ops.speculative import cache_locs, spec_tree

    spec_tree._is_xpu = True
    cache_locs._is_xpu = True


def _stand_in_decoder_stacks(case, stats):
    # 5. The model's decoder stack: sglang.srt.models.llama.LlamaModel.forward (target) and
    #    sglang.srt.models.llama_eagle.LlamaModel.forward (EAGLE draft). On a GPU these run the
    #    layers' kernels (rotary, RMSNorm, attention through the backend, MLP); on this CPU
    #    SGLang dispatches them to forward_native paths that fail on the DP-attention shapes (an
    #    idle rank's 0-token batch: "cannot reshape tensor of 0 elements", rotary_embedding
    #    base.py:347) and the values would be noise anyway. The stand-in returns, per token, a
    #    one-hot hidden state of the token the deterministic model predicts after it at its
    #    position; SGLang's own LM head (ParallelLMHead, identity weights) and LogitsProcessor
    #    turn it into logits, and SGLang's sampler picks it. The draft predicts the target's
    #    token with probability case["accept"] per (token, position).
    seed = int(case.get("model_seed", 1234))
    accept_rate = _accept_rate_of(case)
    _stand_in_target_stack(case, stats, seed)
    _stand_in_eagle_draft_stack(stats, seed, accept_rate)
    _stand_in_dspark_draft_stack(stats, seed, accept_rate)


def _accept_rate_of(case):
    """The draft's hit probability now (case["accept"], per DP rank with case["accept_by_dp"],
    from an iteration on with case["accept_schedule"]), as a function of no arguments."""
    by_dp = {int(k): float(v) for k, v in case.get("accept_by_dp", {}).items()}

    schedule = sorted((int(f), {int(k): float(v) for k, v in d.items()})
                      for f, d in case.get("accept_schedule", []))

    def accept_rate():
        if schedule:  # acceptance that changes over the run (per DP rank, from an iteration)
            from sglang.srt.runtime_context import get_parallel

            now = [d for f, d in schedule if f <= ITERATION[0]]
            if now and get_parallel().attn_dp_rank in now[-1]:
                return now[-1][get_parallel().attn_dp_rank]
        if by_dp:
            from sglang.srt.runtime_context import get_parallel

            return by_dp.get(get_parallel().attn_dp_rank, float(case.get("accept", 0.7)))
        return float(case.get("accept", 0.7))

    return accept_rate


def one_hot(torch, ids, pos, tokens):
    """The stood-in decoder stacks' hidden states: one row per token, one-hot on `tokens`."""
    out = torch.zeros((ids.shape[0], VOCAB), dtype=torch.float32)
    if ids.shape[0]:
        out[torch.arange(ids.shape[0]), tokens] = 8.0
    return out


def _stand_in_target_stack(case, stats, seed):
    """5, the target: llama.LlamaModel.forward."""
    import torch
    from sglang.srt.models import llama

    def target_attention(model, input_ids, forward_batch):
        """SGLang's own attention layers (RadixAttention -> the torch_native backend's SDPA over
        the KV cache) on zero q/k/v, so that what hooks an attention layer (dpbalance's per-step
        attention timing) runs on its real path; the values are not used. Only on decode and
        extend forwards: torch_native has no path for a speculative verify forward (it reads
        extend_prefix_lens, which a verify batch leaves None: torch_native_backend.py:101);
        those forwards are counted, not run."""
        n = int(input_ids.shape[0])
        mode = forward_batch.forward_mode
        if n == 0 or mode.is_idle():
            return
        if not mode.is_decode() and forward_batch.extend_prefix_lens is None:
            stats["verify_attention_skipped"] += 1
            return
        for i in range(model.start_layer, model.end_layer):
            attn = model.layers[i].self_attn.attn
            q = torch.zeros((n, attn.tp_q_head_num * attn.head_dim))
            kv = torch.zeros((n, attn.tp_k_head_num * attn.head_dim))
            t = time.perf_counter()
            attn(q, kv, kv.clone(), forward_batch)
            stats["attention_us"] += (time.perf_counter() - t) * 1e6
            stats["attention_calls"] += 1

    def target_forward(self, input_ids, positions, forward_batch, input_embeds=None,
                       pp_proxy_tensors=None):
        stats["target_forwards"] += 1
        stats["target_tokens"] += int(input_ids.shape[0])
        if case.get("attention", True):
            target_attention(self, input_ids, forward_batch)
        hidden = one_hot(torch, input_ids, positions,
                         target_tokens(torch, input_ids, positions, seed))
        if getattr(self, "layers_to_capture", None):
            # The layers an EAGLE3 / DSpark draft reads (LlamaModel returns them beside the
            # final hidden states): the same rows stand for each captured layer.
            from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList

            aux = AuxHiddenStateList()
            for _ in self.layers_to_capture:
                aux.capture(hidden)
            return hidden, aux
        return hidden

    llama.LlamaModel.forward = target_forward


def _stand_in_eagle_draft_stack(stats, seed, accept_rate):
    """5, the EAGLE draft: llama_eagle.LlamaModel.forward."""
    import torch

    try:
        from sglang.srt.models import llama_eagle
    except Exception:  # noqa: BLE001 (only the EAGLE cases need it)
        llama_eagle = None
    if llama_eagle is not None:
        def draft_forward(self, input_ids, positions, forward_batch, input_embeds=None,
                          pp_proxy_tensors=None):
            stats["draft_forwards"] += 1
            stats["draft_tokens"] += int(input_ids.shape[0])
            return one_hot(torch, input_ids, positions,
                           draft_tokens(torch, input_ids, positions, seed, accept_rate()))

        llama_eagle.LlamaModel.forward = draft_forward


def _stand_in_dspark_draft_stack(stats, seed, accept_rate):
    import torch

    #    The DSpark draft (sglang.srt.models.dflash.DFlashDraftModel.forward, which
    #    DSparkDraftModel inherits): its layers run attention through the backend over the
    #    injected target context (torch_native's SDPA path finds no cached K/V here: "'NoneType'
    #    object has no attribute 'shape'", torch_native_backend.py:101). The stand-in returns
    #    the block's hidden rows (LogitsProcessorOutput with hidden_states, as the model does):
    #    a decode block is [anchor, mask, ...] per request at positions p, p+1, ...; row j
    #    guesses the token at p+j+1 by following its own chain from the anchor (the target's
    #    token with probability accept, else another). SGLang's own compute_base_logits (the
    #    target's LM head), Markov head, sampler and confidence head then run on these rows.
    from sglang.srt.models import dflash

    def dflash_forward(self, input_ids, positions, forward_batch, input_embeds=None,
                       get_embedding=False, pp_proxy_tensors=None):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        stats["draft_forwards"] += 1
        n = int(input_ids.shape[0])
        stats["draft_tokens"] += n
        bs = int(getattr(forward_batch, "batch_size", 0) or 0)
        if n == 0:
            return LogitsProcessorOutput(next_token_logits=None,
                                         hidden_states=torch.zeros((0, VOCAB)))
        if bs <= 0 or n % bs:
            bs = n
        q = n // bs
        ids = input_ids.view(bs, q).long()
        pos = positions.view(bs, q).long()
        out = torch.empty_like(ids)
        tok = ids[:, 0]
        for j in range(q):
            guess = draft_tokens(torch, tok, pos[:, j], seed, accept_rate(), shift=0)
            out[:, j] = guess
            tok = guess
        return LogitsProcessorOutput(
            next_token_logits=None,
            hidden_states=one_hot(torch, input_ids, positions, out.view(-1)))

    dflash.DFlashDraftModel.forward = dflash_forward


def install_argument_overrides(case):
    """SGLang's argument resolution refuses these configurations on a CPU device or under
    attention DP; each refusal is lifted here, before ServerArgs are resolved (publish), and only
    in this process. The resolution itself (speculative_hook.handle_speculative_decoding and the
    algorithm's handle_server_args) runs as shipped otherwise."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.platforms import current_platform

    # A. The platform's speculative support. speculative_hook._check_oot_speculative_algorithm
    #    asks the out-of-tree platform (here dpbalance's gloo CPU platform, a CpuSRTPlatform)
    #    whether it serves EAGLE / DSPARK; SGLang's interface default says no ("EAGLE speculative
    #    decoding is not supported by DpbCpuPlatform on device 'cpu'"). The GPU platforms serve
    #    them; the model kernels that need the GPU are stood in below the forward.
    type(current_platform).supports_speculative_algorithm = lambda self, algorithm: True
    type(current_platform).supports_speculative_draft_attention_backend = \
        lambda self, algorithm, backend: True

    # B. speculative_hook._disable_overlap_schedule_for_cpu turns the overlap scheduler off for
    #    speculative decoding on device "cpu" ("Overlap schedule is not implemented for
    #    speculative decoding on CPU"). For the overlap loop it is made a no-op, so that SGLang's
    #    default loop, event_loop_overlap, runs with the speculative worker as it does on a GPU.
    if case["loop"] == "overlap":
        speculative_hook._disable_overlap_schedule_for_cpu = lambda server_args: None

    # D. DSpark's device check (_install_dspark_device_override, below).
    if case["spec"].startswith("dspark"):
        _install_dspark_device_override()
        # E. DSpark builds its draft worker with its own attention backend
        #    (draft_worker_common.resolve_draft_worker_attention_backend), from the draft
        #    backends SGLang lists in arg_groups/choices.py; torch_native is not listed, so it
        #    falls back to flashinfer (CUDA only: "name 'BatchPrefillWithRaggedKVCacheWrapper'
        #    is not defined"). SGLang's own extension point for platforms adds it.
        from sglang.srt.arg_groups.choices import add_draft_attention_backend_choices

        add_draft_attention_backend_choices(["torch_native"])

    # C. adaptive_unsupported_reason (speculative/adaptive_spec_params.py), called by
    #    speculative_hook._maybe_disable_adaptive: under attention DP it returns "attention DP is
    #    not supported (adaptive tier decisions are not synchronized across DP ranks)" and
    #    SGLang turns speculative_adaptive off. For eagle_adaptive the shipped function runs with
    #    its attention-DP test (the module's attn_dp_enabled_of) answering False for that one
    #    call, so every other reason it checks still applies; speculative_adaptive=True survives
    #    and SGLang's own _init_adaptive_speculative_params runs. Not with dpbalance on
    #    (DPB_PLUGIN set): its own hook lifts the refusal (dpbalance_sglang/patch/eagle.py), and
    #    that is what runs then.
    if case["spec"] == "eagle_adaptive" and not os.environ.get("DPB_PLUGIN"):
        from sglang.srt.speculative import adaptive_spec_params

        shipped = adaptive_spec_params.adaptive_unsupported_reason

        def adaptive_unsupported_reason(server_args):
            dp_test = adaptive_spec_params.attn_dp_enabled_of
            adaptive_spec_params.attn_dp_enabled_of = lambda view: False
            try:
                return shipped(server_args)
            finally:
                adaptive_spec_params.attn_dp_enabled_of = dp_test

        adaptive_spec_params.adaptive_unsupported_reason = adaptive_unsupported_reason


def _install_dspark_device_override():
    """D. speculative_hook._handle_dspark refuses device "cpu" ("DSpark speculative decoding only
    supports CUDA, NPU or XPU device", arg_groups/speculative_hook.py:669) before it resolves
    anything else. It runs as shipped with its view of the arguments answering device="cuda"
    for that one read path (every other field, and every resolution it declares, is SGLang's)."""
    from sglang.srt.arg_groups import speculative_hook

    shipped = speculative_hook._handle_dspark

    class CudaDeviceView:
        def __init__(self, view):
            object.__setattr__(self, "_view", view)

        def __getattr__(self, name):
            if name == "device":
                return "cuda"
            return getattr(self._view, name)

    def _handle_dspark(server_args):
        rv = speculative_hook.resolving_view
        speculative_hook.resolving_view = lambda sa: CudaDeviceView(rv(sa))
        try:
            return shipped(server_args)
        finally:
            speculative_hook.resolving_view = rv

    speculative_hook._handle_dspark = _handle_dspark


def set_identity_lm_head(model):
    """6. The dummy-loaded LM head (its vocab-parallel shard) as the identity, so that
    logits = the stood-in decoder's hidden states (hidden_size == vocab_size). Weights only:
    SGLang's ParallelLMHead and LogitsProcessor (with its DP gather of hidden states) run."""
    import torch

    head = model.lm_head
    w = head.weight
    start = getattr(getattr(head, "shard_indices", None), "org_vocab_start_index", 0)
    with torch.no_grad():
        w.zero_()
        rows = min(w.shape[0], VOCAB - start)
        idx = torch.arange(rows)
        w[idx, start + idx] = 1.0


def _stand_in_draft_moe(case, scheduler):
    if case.get("draft_moe") and scheduler.draft_worker is not None:
        # STAND-IN 7 (see STAND-INS): DSpark's DP tier agreement runs for an MoE draft only
        # (DSparkWorkerV2._draft_is_moe = draft_is_deepseek_v4(), dspark_worker_v2.py:199: a
        # DeepSeek-V4 draft, whose model and attention backend cannot be built on this CPU).
        # The flag is set after construction, so that SGLang's tier paths (the agreed
        # global_num_reqs, _dp_verify_tier_num_tokens, the idle ranks' verify layout and their
        # draft participation) run for the dense stand-in draft as they do for that one.
        scheduler.draft_worker._draft_is_moe = True


# ============================================================================================
# SGLang's start-up
# ============================================================================================

def write_model(path, cfg):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def server_args_for(case, proc, world, port, model_dir, draft_dir):
    from sglang.srt.server_args import ServerArgs

    kw = dict(model_path=model_dir, device="cpu", tp_size=world, dp_size=case.get("dp", 2),
              enable_dp_attention=True, skip_tokenizer_init=True, disable_cuda_graph=True,
              dist_timeout=120, attention_backend="torch_native", load_format="dummy",
              sampling_backend="pytorch", max_total_tokens=case.get("max_total_tokens", 8192),
              max_running_requests=case.get("max_running_requests", 16),
              chunked_prefill_size=case.get("chunked_prefill_size", 1024),
              skip_server_warmup=True, dtype="float32", nccl_port=port,
              random_seed=case.get("seed", 0), log_level="warning",
              disable_overlap_schedule=(case["loop"] == "normal"))
    spec = case["spec"]
    if spec in ("eagle", "eagle_adaptive"):
        eg = case.get("eagle", {})
        kw.update(speculative_algorithm="EAGLE", speculative_draft_model_path=draft_dir,
                  speculative_draft_load_format="dummy",
                  speculative_num_steps=eg.get("steps", 3), speculative_eagle_topk=1,
                  speculative_num_draft_tokens=eg.get("steps", 3) + 1,
                  speculative_adaptive=(spec == "eagle_adaptive"))
        if spec == "eagle_adaptive" and eg.get("adaptive_config"):
            # SGLang's --speculative-adaptive-config (AdaptiveSpeculativeParams reads it).
            path = os.path.join(os.path.dirname(model_dir), "adaptive.json")
            with open(path, "w") as f:
                json.dump(eg["adaptive_config"], f)
            kw["speculative_adaptive_config"] = path
    elif spec in ("dspark", "dspark_sps"):
        ds = case.get("dspark", {})
        kw.update(speculative_algorithm="DSPARK", speculative_draft_model_path=draft_dir,
                  speculative_draft_load_format="dummy",
                  enable_dp_lm_head=True)  # DSpark under DP attention requires it
        if spec == "dspark_sps":
            # A profiled steps-per-second table (SGLang's SpsCostTable JSON, what
            # --speculative-dspark-sps-table-path reads): throughput falls as the verify
            # tokens grow, so DSpark's budget trims the per-request verify lengths.
            table = ds.get("sps_table", DEFAULT_SPS_TABLE)
            path = os.path.join(os.path.dirname(model_dir), "sps_table.json")
            with open(path, "w") as f:
                json.dump(table, f)
            kw["speculative_dspark_sps_table_path"] = path
    kw.update(case.get("server_args", {}))
    return ServerArgs(**kw)


def port_args_for(port, d):
    from sglang.srt.server_args import PortArgs

    def n(k):
        return f"ipc://{d}/{k}"

    return PortArgs(tokenizer_ipc_name=n("tokenizer"), scheduler_input_ipc_name=n("scheduler_in"),
                    detokenizer_ipc_name=n("detokenizer"), nccl_port=port, rpc_ipc_name=n("rpc"),
                    metrics_ipc_name=n("metrics"), tokenizer_worker_ipc_name=None,
                    decoupled_spec_ipc_config=None)


def make_request(r, seed):
    """SGLang's TokenizedGenerateReqInput, as the tokenizer manager builds it (greedy)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=r["max_new_tokens"], temperature=0.0, ignore_eos=True)
    sp.normalize(None)
    sp.verify(VOCAB)
    key = r.get("prompt_key", r["rid"])
    ids = array("q", [(_mix(seed, zlib.crc32(key.encode()), k) % (VOCAB - 3)) + 3
                      for k in range(r["prompt_len"])])
    return TokenizedGenerateReqInput(
        rid=r["rid"], input_text=None, input_ids=ids, input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=sp, return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False)


def running_plan():
    """With dpbalance on: the plan of the batch whose forward runs (its lengths, every DP rank's
    agreed total and tier), read from dpbalance_sglang's own state; None otherwise."""
    if not os.environ.get("DPB_PLUGIN"):
        return None
    from dpbalance_sglang import engine_step

    st = engine_step.state()
    usable = getattr(st, "usable", None)
    if usable is not None:
        bp = usable()
    else:  # a package before issue #50: the last sync's plan, if its exchange went through
        bp = getattr(st, "last_sync_plan", None)
        bp = bp if bp is not None and bp.exchanged else None
    if bp is None:
        return None
    return {"lens": list(bp.plan.verify_len), "rank_tokens": list(bp.plan.rank_tokens),
            "padded": int(bp.plan.padded_tokens), "depth": int(bp.plan.draft_depth),
            "kind": bp.kind}


def plugin_last_report():
    """With dpbalance on: what its plugin last received in a report (the inspection ABI's
    last_step: plan_id and the measured attention it was given), whatever package sent it."""
    if not os.environ.get("DPB_PLUGIN"):
        return None
    from dpbalance_sglang import engine_step

    dpb = getattr(engine_step.state(), "dpb", None)
    info = dpb.last_step() if dpb is not None else None
    if not info:
        return None
    return {"plan_id": int(info["plan_id"]), "attention_us": float(info["measured_attention_us"])}


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


def _verify_lens(worker, batch, result):
    """The per-request verify lengths the step used, where the worker exposes them."""
    for obj in (result, getattr(batch, "spec_info", None)):
        for name in ("verify_lens_cpu", "verify_lens"):
            v = getattr(obj, name, None)
            if v is not None:
                return _jsonable(v)
    return None


# ============================================================================================
# The run
# ============================================================================================

def run(proc, world, port, case, outdir):
    stats = {"target_forwards": 0, "target_tokens": 0, "draft_forwards": 0, "draft_tokens": 0,
             "attention_calls": 0, "attention_us": 0.0, "verify_attention_skipped": 0}
    rank = start_sglang(proc, world, port, case, outdir, stats)

    # ---- observation (each wrapper calls SGLang's own function) ----
    obs = Observer(case, proc, outdir, rank)
    obs.install(rank.scheduler)
    adaptive = _adaptive_summary(rank.scheduler.draft_worker)

    t_loop = time.perf_counter()
    err = obs.run_loop(rank.scheduler)
    t_end = time.perf_counter()
    time.sleep(0.05)
    obs.drain_outputs()
    rank.to_scheduler.close(linger=0)
    rank.from_scheduler.close(linger=0)
    shutil.rmtree(rank.ipc, ignore_errors=True)

    obs.stream.close()
    return build_record(proc, case, rank, obs, stats, adaptive, err, t_loop, t_end)


def start_sglang(proc, world, port, case, outdir, stats):
    """SGLang's start-up in this process (the stand-ins and argument overrides first): models
    written, load_plugins where case["load_plugins"] says, ServerArgs published, the sockets of
    the DP controller's and the tokenizer's ends bound, the Scheduler built. Returns what the
    run needs of it."""
    import zmq

    t_start = time.perf_counter()
    install_stand_ins(case, stats)
    install_argument_overrides(case)

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

    when_plugins = case.get("load_plugins", "before_scheduler")
    if when_plugins == "before_scheduler":  # SGLang's order (run_scheduler_process)
        load_plugins()
    base = os.path.join(outdir, f"p{proc}")
    model_dir = write_model(os.path.join(base, "target"), TARGET)
    draft_dir = write_model(os.path.join(base, "draft"),
                            DSPARK_DRAFT if case["spec"].startswith("dspark") else EAGLE_DRAFT)
    sa = server_args_for(case, proc, world, port, model_dir, draft_dir)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=proc, dp_rank=proc, gpu_id=proc))
    ipc = tempfile.mkdtemp(prefix=f"ipc{proc}-", dir=outdir)  # zmq ipc files (short paths)
    pa = port_args_for(port, ipc)
    zctx = zmq.Context(1)
    to_scheduler = zctx.socket(zmq.PUSH)  # the DP controller's end of the scheduler's input
    to_scheduler.bind(pa.scheduler_input_ipc_name)
    from_scheduler = zctx.socket(zmq.PULL)  # the tokenizer's end (skip_tokenizer_init)
    from_scheduler.bind(pa.tokenizer_ipc_name)

    t0 = time.perf_counter()
    scheduler = Scheduler(sa, pa)
    t_built = time.perf_counter()
    if when_plugins == "after_scheduler":
        load_plugins()
    target_runner = scheduler.tp_worker.model_runner
    set_identity_lm_head(target_runner.model)
    _stand_in_draft_moe(case, scheduler)

    par = get_parallel()
    dp_rank = par.attn_dp_rank
    my_reqs = [r for r in case["requests"] if r["dp"] == dp_rank]
    return types.SimpleNamespace(
        scheduler=scheduler, server_args=sa, port_args=pa, ipc=ipc, zmq_context=zctx,
        to_scheduler=to_scheduler, from_scheduler=from_scheduler, dp_rank=dp_rank,
        my_reqs=my_reqs, t_start=t_start, t0=t0, t_built=t_built)


def _desc(b):
    if b is None:
        return None
    return {"mode": b.forward_mode.name if b.forward_mode is not None else None,
            "bs": b.batch_size()}


class Observer:
    """The observation wrappers (each calls SGLang's own function and only records) and the
    state they share: `cur` (the iteration running), `iters` (the finished ones), `n_iter`
    (iterations begun), `outputs` (what SGLang sent back per request), `stream` (the finished
    iterations as JSON lines), `entered` (the event loop SGLang entered)."""

    def __init__(self, case, proc, outdir, rank):
        self.case = case
        self.to_scheduler = rank.to_scheduler
        self.from_scheduler = rank.from_scheduler
        self.pending = sorted(rank.my_reqs, key=lambda r: r.get("at", 0))
        self.iters = []
        self.cur = {}
        self.n_iter = 0
        self.limit = int(case["iterations"])
        self.outputs = {}
        self.entered = []
        # Each finished iteration is also appended to a JSON-lines file, so that the iterations
        # of a process that dies in C++ (gloo aborts on a collective mismatch) can still be read.
        self.stream = open(os.path.join(outdir, f"{case['name']}.{proc}.iters.jsonl"), "w")

    def install(self, scheduler):
        self._wrap_iteration_counter()
        self._wrap_mlp_sync()
        self._wrap_loop_phases()
        spec_worker = scheduler.draft_worker
        if spec_worker is not None:
            self._wrap_spec_worker(spec_worker)
        if getattr(spec_worker, "_verify_planner", None) is not None:
            self._wrap_dspark_planner(spec_worker)
        self._wrap_loop_entry()

    def drain_outputs(self):
        import zmq
        from sglang.srt.managers.io_struct import sock_recv

        while True:
            try:
                o = sock_recv(self.from_scheduler, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            rids = getattr(o, "rids", None) or []
            fin = getattr(o, "finished_reasons", None) or [None] * len(rids)
            outs = getattr(o, "output_ids", None) or [None] * len(rids)
            for rid, f, ids in zip(rids, fin, outs):
                d = self.outputs.setdefault(rid, {"tokens": 0, "finished": None, "ids": []})
                if ids is not None:
                    d["tokens"] += len(ids)
                    d["ids"].extend(int(x) for x in ids)
                if f is not None:
                    d["finished"] = f if isinstance(f, (str, dict)) else str(f)

    def finish_iteration(self):
        cur = self.cur
        cur["t1"] = time.perf_counter()
        it = dict(cur)
        self.iters.append(it)
        self.stream.write(json.dumps(dict(it, seconds=round(it["t1"] - it["t0"], 4)),
                                     default=str) + "\n")
        self.stream.flush()

    def run_loop(self, scheduler):
        """SGLang's loop until StopLoop; the traceback of anything else it raised, or None."""
        err = None
        try:
            scheduler.run_event_loop()
        except StopLoop:
            pass
        except BaseException:  # noqa: BLE001 (reported with the record)
            err = traceback.format_exc()
            if self.cur:
                self.cur["error"] = True
                self.finish_iteration()
        return err

    def _wrap_iteration_counter(self):
        from sglang.srt.managers.io_struct import sock_send
        from sglang.srt.managers.scheduler import Scheduler

        obs, cur, case = self, self.cur, self.case
        orig_ingest = Scheduler.ingest_requests

        def ingest_requests(self, *a, **k):
            if cur:
                obs.finish_iteration()
            obs.drain_outputs()
            obs.n_iter += 1
            if obs.n_iter > obs.limit:
                raise StopLoop()
            cur.clear()
            cur.update(iter=obs.n_iter - 1, t0=time.perf_counter(), events=[], syncs=0)
            ITERATION[0] = cur["iter"]
            pending = obs.pending
            while pending and pending[0].get("at", 0) <= cur["iter"]:
                sock_send(obs.to_scheduler, make_request(pending.pop(0), case.get("seed", 0)))
            return orig_ingest(self, *a, **k)

        Scheduler.ingest_requests = ingest_requests

    def _wrap_mlp_sync(self):
        from sglang.srt.managers.scheduler_components import dp_attn

        cur = self.cur
        orig_sync = dp_attn.SchedulerDPAttnAdapter.prepare_mlp_sync_batch

        def prepare_mlp_sync_batch(self, local_batch):
            out = orig_sync(self, local_batch)
            if cur:
                cur["syncs"] += 1
                cur["events"].append(("sync", _desc(local_batch), _desc(out),
                                      list(out.global_num_tokens) if out is not None and
                                      out.global_num_tokens is not None else None))
            return out

        dp_attn.SchedulerDPAttnAdapter.prepare_mlp_sync_batch = prepare_mlp_sync_batch

        # The width of each MLP sync's gathered rows (SGLang's 11 int64 columns at 0.5.23, plus
        # dpbalance's 64 where its record rides).
        orig_all_gather = dp_attn.MLPSyncBatchInfo.all_gather

        def all_gather(self, *a, **k):
            out = orig_all_gather(self, *a, **k)
            if cur and self.tp0_info_cpu is not None:
                cur.setdefault("gather_widths", []).append(int(self.tp0_info_cpu.shape[-1]))
            return out

        dp_attn.MLPSyncBatchInfo.all_gather = all_gather

    def _wrap_loop_phases(self):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler

        cur = self.cur
        orig_gnb = Scheduler.get_next_batch_to_run

        def get_next_batch_to_run(self, *a, **k):
            plan = orig_gnb(self, *a, **k)
            if cur:
                cur["batch"] = _desc(plan.batch_to_run)
            return plan

        orig_run = Scheduler.run_batch

        def run_batch(self, batch, *a, **k):
            res = orig_run(self, batch, *a, **k)
            if cur:
                cur["events"].append(("run_batch", _desc(batch)))
            return res

        orig_copy = ScheduleBatch.copy

        def copy(self, *a, **k):
            out = orig_copy(self, *a, **k)
            if cur:
                cur["events"].append(("copy", _desc(self)))
            return out

        orig_pbr = Scheduler.process_batch_result

        def process_batch_result(self, batch, result, *a, **k):
            out = orig_pbr(self, batch, result, *a, **k)
            if cur:
                ev = {"batch": _desc(batch)}
                acc = getattr(result, "accept_lens", None)
                if acc is not None:
                    ev["accept_lens"] = [int(x) for x in acc.tolist()] if hasattr(acc, "tolist") \
                        else list(acc)
                ncd = getattr(result, "num_correct_drafts_per_req_cpu", None)
                if ncd is not None:
                    ev["num_correct_drafts"] = [int(x) for x in ncd]
                reported = plugin_last_report()
                if reported is not None:
                    ev["plugin_report"] = reported
                cur["events"].append(("process_batch_result", ev))
            return out

        orig_idle = Scheduler.on_idle

        def on_idle(self, *a, **k):
            if cur:
                cur["events"].append(("on_idle",))
            return orig_idle(self, *a, **k)

        Scheduler.get_next_batch_to_run = get_next_batch_to_run
        Scheduler.run_batch = run_batch
        Scheduler.process_batch_result = process_batch_result
        Scheduler.on_idle = on_idle
        ScheduleBatch.copy = copy

    def _wrap_spec_worker(self, spec_worker):
        # The speculative worker's step (EAGLEWorkerV2 / DSparkWorkerV2.forward_batch_generation):
        # the draft depth it ran (its speculative_num_steps during the call) and, for adaptive
        # EAGLE, SGLang's own calls that choose it (activate_step_by_batch before the step,
        # on_verify_complete_cpu from process_batch_result).
        cur, stream = self.cur, self.stream
        wcls = type(spec_worker)
        orig_fbg = wcls.forward_batch_generation

        def forward_batch_generation(self, batch, *a, **k):
            # Recorded before the step runs (the depth it is about to draft), completed after.
            rec = None
            if cur and self is spec_worker:
                rec = {"mode": batch.forward_mode.name if batch.forward_mode else None,
                       "bs": batch.batch_size(),
                       "steps": getattr(self, "speculative_num_steps", None)
                       if not hasattr(self, "gamma") else int(self.gamma),
                       "draft_tokens": getattr(self, "speculative_num_draft_tokens", None),
                       "done": False}
                cur.setdefault("spec", []).append(rec)
                stream.write(json.dumps({"iter": cur["iter"], "partial": True, "events": [],
                                         "spec": cur["spec"], "syncs": cur["syncs"]},
                                        default=str) + "\n")
                stream.flush()
            out = orig_fbg(self, batch, *a, **k)
            if rec is not None:
                rec["done"] = True
                rec["verify_lens"] = _verify_lens(self, batch, out)
            return out

        wcls.forward_batch_generation = forward_batch_generation
        for name in ("activate_step_by_batch", "on_verify_complete_cpu"):
            if hasattr(wcls, name):
                def adaptive_call(self, *a, _orig=getattr(wcls, name), _name=name, **k):
                    before = getattr(self, "speculative_num_steps", None)
                    out = _orig(self, *a, **k)
                    after = getattr(self, "speculative_num_steps", None)
                    if cur:
                        cur["events"].append((_name, {"args": _jsonable(a), "steps_before":
                                                      before, "steps_after": after}))
                    return out
                setattr(wcls, name, adaptive_call)

    def _wrap_dspark_planner(self, spec_worker):
        # DSpark's verify plan per step (DSparkVerifyPlanner.schedule_layout, which
        # _forward_decode calls with the agreed tier from _dp_verify_tier_num_tokens): its
        # per-request verify lengths (anchor included), tier and whether it was the cached
        # verify-all layout.
        cur = self.cur
        wcls = type(spec_worker)
        pcls = type(spec_worker._verify_planner)
        orig_layout = pcls.schedule_layout
        # SGLang's top-k allocator (the one dspark_planner.py calls): its confidence, budget and
        # lengths, attached to the layout it was run for.
        from sglang.kernels.ops.speculative.dspark import dspark_schedule
        topk_cls = dspark_schedule.ScheduleVerifyLensTopk
        orig_topk = topk_cls.execute
        last_topk = []

        def execute(_cls, *a, **k):
            out = orig_topk(*a, **k)
            last_topk[:] = [{"confidence": k["confidence"].float().tolist(),
                             "budget": int(k["budget"]), "lens": out.tolist()}]
            return out

        topk_cls.execute = classmethod(execute)

        def schedule_layout(self, *a, **k):
            last_topk.clear()
            layout = orig_layout(self, *a, **k)
            if cur:
                d = {"verify_all": bool(getattr(self, "_is_verify_all", False)),
                     "plan": running_plan(),
                     "dp_tier_num_tokens": k.get("dp_tier_num_tokens"),
                     "budget": _jsonable(k.get("budget")),
                     "global_num_reqs": k.get("global_num_reqs"),
                     "topk": last_topk[0] if last_topk else None}
                if layout is not None:
                    lens = layout.verify_lens_cpu
                    d["verify_lens"] = list(lens) if lens is not None else \
                        _jsonable(layout.verify_lens)
                    d["graph_num_tokens"] = int(layout.graph_num_tokens)
                cur.setdefault("dspark_layout", []).append(d)
            return layout

        pcls.schedule_layout = schedule_layout
        orig_tier = pcls._maybe_gather_dp_verify_tier

        def _maybe_gather_dp_verify_tier(self, *, batch, local_tier_num_tokens):
            out = orig_tier(self, batch=batch, local_tier_num_tokens=local_tier_num_tokens)
            if cur:
                cur["events"].append(("dspark_tier_gather", {
                    "enabled": bool(self._dp_tier_gather_enabled),
                    "local": int(local_tier_num_tokens),
                    "gathered": _jsonable(getattr(batch, "global_spec_verify_tier_num_tokens",
                                                  None))}))
            return out

        pcls._maybe_gather_dp_verify_tier = _maybe_gather_dp_verify_tier
        # An idle DP rank's verify layout (DSparkWorkerV2._idle_verify_ragged_layout): the token
        # count of the verify forward it joins, which must equal the busy ranks' layouts'.
        orig_idle_layout = wcls._idle_verify_ragged_layout

        def _idle_verify_ragged_layout(self, batch):
            layout = orig_idle_layout(self, batch)
            if cur:
                cur.setdefault("dspark_idle_layout", []).append(
                    {"graph_num_tokens": int(layout.graph_num_tokens) if layout is not None
                     else None, "dp_tier_num_tokens": self._dp_verify_tier_num_tokens(batch),
                     "plan": running_plan()})
            return layout

        wcls._idle_verify_ragged_layout = _idle_verify_ragged_layout

    def _wrap_loop_entry(self):
        from sglang.srt.managers.scheduler import Scheduler

        # SGLang's own entry (run_scheduler_process calls it): stream set-up, then
        # dispatch_event_loop picks event_loop_overlap or event_loop_normal from
        # disable_overlap_schedule. The loop it entered is recorded.
        entered = self.entered
        for name in ("event_loop_overlap", "event_loop_normal"):
            def entry(self, *a, _orig=getattr(Scheduler, name), _name=name, **k):
                entered.append(_name)
                return _orig(self, *a, **k)
            setattr(Scheduler, name, entry)


def _adaptive_summary(spec_worker):
    """The adaptive EAGLE controller's set-up (its candidate depths and per-slot states), or
    None."""
    adaptive = None
    ctl = getattr(spec_worker, "adaptive_controller", None)
    if ctl is not None:
        adaptive = {"controller": type(ctl).__name__,
                    "candidate_steps": list(ctl.candidate_steps),
                    "states": {str(k): type(v).__name__ for k, v in ctl._states.items()},
                    "policy": type(ctl.params).__name__}
    return adaptive


def _dpbalance_summary():
    dpb_summary = None
    if os.environ.get("DPB_PLUGIN"):  # read-only: dpbalance_sglang's own counters
        try:
            from dpbalance_sglang import engine_step

            dpb_summary = engine_step.state().summary()
        except Exception as e:  # noqa: BLE001
            dpb_summary = {"error": repr(e)}
    return dpb_summary


def _check_outputs(case, my_reqs, outputs):
    """Marks each request's output with matches_target (and the expected ids where not)."""
    import torch

    # Greedy speculative decoding is lossless: every request's output must be the target's own
    # chain from its prompt (token after t at position p = target_tokens(t, p)).
    for r in my_reqs:
        d = outputs.get(r["rid"])
        if d is None:
            continue
        prompt = list(make_request(r, case.get("seed", 0)).input_ids)
        tok, pos, want = prompt[-1], len(prompt) - 1, []
        for _ in range(len(d["ids"])):
            tok = int(target_tokens(torch, torch.tensor([tok]), torch.tensor([pos]),
                                    int(case.get("model_seed", 1234)))[0])
            want.append(tok)
            pos += 1
        d["matches_target"] = d["ids"] == want
        if not d["matches_target"]:
            d["expected"] = want


def build_record(proc, case, rank, obs, stats, adaptive, err, t_loop, t_end):
    """The process's record (the module's docstring lists it)."""
    dpb_summary = _dpbalance_summary()
    iters, outputs, my_reqs = obs.iters, obs.outputs, rank.my_reqs
    for it in iters:
        it["seconds"] = round(it.pop("t1", t_end) - it.pop("t0"), 4)
    finished = sorted(r for r, d in outputs.items() if d["finished"] is not None)
    _check_outputs(case, my_reqs, outputs)
    return {
        "proc": proc, "dp_rank": rank.dp_rank, "loop": case["loop"], "spec": case["spec"],
        "error": err, "loop_entered": obs.entered, "iterations": iters,
        "requests": [r["rid"] for r in my_reqs], "finished": finished, "outputs": outputs,
        "stand_in_calls": stats, "adaptive": adaptive, "dpbalance": dpb_summary,
        "totals": {
            "iterations": len(iters),
            "syncs": sum(i["syncs"] for i in iters),
            "run_batches": sum(1 for i in iters for e in i["events"] if e[0] == "run_batch"),
            "results_processed": sum(1 for i in iters for e in i["events"]
                                     if e[0] == "process_batch_result"),
        },
        "timing": {"imports_s": round(rank.t0 - rank.t_start, 2),
                   "scheduler_init_s": round(rank.t_built - rank.t0, 2),
                   "loop_s": round(t_end - t_loop, 2),
                   "per_iteration_s": round((t_end - t_loop) / max(1, len(iters)), 4)},
    }


def process_main(proc, world, port, case, outdir, queue):
    """One scheduler process: environment, SGLang start-up, load_plugins, the loop; puts
    (proc, case name, record) on the queue, or (proc, "__crash__", traceback)."""
    try:
        os.environ["DPBALANCE_SGLANG_CPU"] = "1"  # the gloo CPU platform (entry point)
        os.environ["SGLANG_PLUGINS"] = "dpbalance"
        os.environ["HF_HUB_OFFLINE"] = "1"
        # SGLang's CPU thread binding (bootstrap._bind_threads_if_cpu) asks for one NUMA node per
        # rank unless told which cores each rank has; gpu_id (= proc) indexes this list.
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1))
                                                             for i in range(world))
        # STAND-IN 0 (see STAND-INS): SGLang's Triton kernels run in Triton's own interpreter on
        # the CPU (numpy, one program instance at a time) instead of on a GPU: Triton has no
        # driver here. Set before anything imports triton (case["env"] can override it).
        os.environ["TRITON_INTERPRET"] = "1"
        for k, v in case.get("env", {}).items():
            os.environ[k] = str(v)
        for k, v in case.get("proc_env", {}).get(str(proc), {}).items():
            os.environ[k] = str(v)
        os.makedirs(outdir, exist_ok=True)
        log_path = os.path.join(outdir, f"{case['name']}.{proc}.log")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format="%(name)s %(levelname)s %(message)s")
        import torch

        torch.set_num_threads(1)
        rec = run(proc, world, port, case, outdir)
        queue.put((proc, case["name"], rec))
    except BaseException:  # the driver reports it; the process must not hang the suite
        queue.put((proc, "__crash__", traceback.format_exc()))
        raise
