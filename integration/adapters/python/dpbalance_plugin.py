"""dpbalance for Python decode engines: the C plugin ABI (v1 and v2) through ctypes.

A Python engine (SGLang, vLLM, ...) loads `libdpbalance.so` the way a C++ engine does: by
`DPB_PLUGIN` (a name, file or path; `none` disables), the exported symbol
`dpbalancePlugin_v1` or `dpbalancePlugin_v2`, and `DPB_*` flags (docs/flags.md). This module
adds nothing to the plugin's logic; it only marshals the C structs and lets a Python callable be
the all-gather, so the ranks exchange their summaries over the engine's own CPU group (no second
NCCL comm). ABI v1 (`DpBalance`, integer request ids):

    from dpbalance_plugin import DpBalance, Request, Accepted, torch_allgather

    dpb = DpBalance.load(num_ranks=dp_size, rank=dp_rank, config="default_k=3;k_max=7",
                         allgather=torch_allgather(cpu_group))   # None if DPB_PLUGIN=none
    # every decode step, on every DP rank, before the verify forward:
    lens, depth = dpb.plan([Request(rid, ctx, k_min=0, k_cap=min(7, left - 1)) for ...])
    ... draft to `depth`, verify lens[i] drafts of request i, accept ...
    dpb.report(attention_us, step_us, [Accepted(rid, lens[i], accepted_i, finished_i) ...])

ABI v2 (`DpBalanceV2`, or `DpBalance.load(..., abi=2)`; dpbalance_plugin_v2.h): the engine's
string request ids, attention-TP groups (every process of a DP rank calls it), step kinds
(decode, idle, extend, no_verify), and every DP rank's token total and the agreed padded size
from the one exchange, so the engine fills its own DP sync's token counts from `plan`:

    dpb = DpBalance.load(dp_size, dp_rank, config, allgather=torch_allgather(cpu_group), abi=2,
                         attn_tp_size=attn_tp, attn_tp_rank=attn_tp_rank,
                         token_tiers=cuda_graph_token_sizes)
    res = dpb.plan([Request(req.rid, ctx, k_cap=...) ...], kind="decode", extra_tokens=0)
    res.verify_len, res.draft_depth, res.rank_tokens, res.padded_tokens, res.verify_budget
    dpb.report(attention_us, step_us, [Accepted(req.rid, res.verify_len[i], acc_i, fin_i) ...])

Failure contract (the plugin's, kept here): `plan` never raises for a balancing failure. When
the plugin falls back it still fills every verify length with the engine's default
(`DPB_DEFAULT_K`, capped by k_cap) and `plan` returns those; `last_result` says why
(dpbFallback for one step, dpbDisabled for the rest of the run). An all-gather callable that
raises, times out or returns the wrong number of bytes disables balancing on that rank (v1: after
a failed collective the ranks can no longer be known to be in lockstep, so it is not called
again; v2: the plugin sees a negative or short byte count and falls back as the v2 header says).
Only programming errors raise: a bad argument, a library that cannot be loaded, or `init`
refusing the flags (DpBalanceError, naming them).

The all-gather callable: `allgather(send: bytes, timeout_ms: int) -> bytes` (every process's
`send`, group order), or an object that also has `gather_into(send, recv, timeout_ms) -> int`,
writing into `recv` (a writable memoryview of exactly the plugin's receive buffer, so it cannot
write past it) and returning the bytes written, or -1. `torch_allgather` is both.

`Piggyback` carries the exchange on the engine's own per-step DP sync instead of a second
collective, so that it fails on every rank or none (docs/engines.md).

`check_flags(config, dp_size)` checks the DPB_* flags as init would, without starting anything
(dpbalance_inspect_v1.h), for an engine to refuse or report a bad value at its start; a
balancer's `last_step()` gives the prediction of the step it last reported.

`Router` is the request routing (strategies A-E, docs/design.md "Routing") for the engine's DP
router, through the library's second symbol `dpbalanceRouter_v1` (dpbalance_router_v1.h):

    router = Router.load(num_ranks=dp_size, config="routing=E")   # None if DPB_PLUGIN=none
    rank = router.route([RankLoad(n, ctx_sum, reserved, capacity, max_requests, max_ctx) ...],
                        input_tokens, max_new_tokens)              # None: no rank has room yet
    router.observe_finished(output_tokens)                          # as requests finish
"""
from __future__ import annotations

import ctypes
import logging
import operator
import os
import struct
from typing import Callable, NamedTuple, Optional, Sequence

__all__ = ["DpBalance", "DpBalanceV2", "DpBalanceError", "Request", "Accepted", "PlanResult",
           "Piggyback", "StepResult", "Router", "RankLoad", "RESULT_NAMES", "RECORD_BYTES",
           "IDLE_ROW", "STEP_KINDS", "GRANULARITIES", "RANK_FLAG_NAMES", "resolve_library",
           "torch_allgather", "TorchAllGather", "check_flags", "FlagCheck"]

log = logging.getLogger("dpbalance")

SYMBOL = "dpbalancePlugin_v1"
SYMBOL_V2 = "dpbalancePlugin_v2"
ABI_VERSION_2 = 2
ROUTER_SYMBOL = "dpbalanceRouter_v1"
INSPECT_SYMBOL = "dpbalanceInspect_v1"
INSPECT_SYMBOL_V2 = "dpbalanceInspect_v2"
DEFAULT_LIBRARY = "libdpbalance.so"

# dpbResult_t
SUCCESS, FALLBACK, INVALID_ARGUMENT, INTERNAL_ERROR, DISABLED = range(5)
RESULT_NAMES = {SUCCESS: "dpbSuccess", FALLBACK: "dpbFallback",
                INVALID_ARGUMENT: "dpbInvalidArgument", INTERNAL_ERROR: "dpbInternalError",
                DISABLED: "dpbDisabled"}
# dpbBackend_t
BACKEND_FROM_FLAGS, BACKEND_IN_PROCESS, BACKEND_CALLBACK, BACKEND_NCCL = range(4)
# Bytes of one rank's summary record in ABI v1 (what the all-gather callback exchanges). ABI v2
# passes the size to the callback (send_bytes); nothing here assumes it.
RECORD_BYTES = 512
# The idle row (dpbalance/summary.h, IdleRowRecord): what an engine writes itself into its
# per-step sync for a DP rank that has no work this step and makes no plan there (SGLang's
# fallback row for an inactive rank): the summary magic "DPB1", the record's version
# (kSummaryVersion: 6 since the record carries the engine cycle and the step terms' digest), the idle flag, and
# zeros. Every plugin plans that rank as one that runs nothing and keeps balancing. A row of
# zeros instead is a rank without a working plugin: every rank pauses balancing that step.
SUMMARY_VERSION = 6
IDLE_ROW = struct.pack("=IHH", 0x31425044, SUMMARY_VERSION, 1 << 3) + bytes(RECORD_BYTES - 8)
# dpbStepKind_t
STEP_DECODE, STEP_IDLE, STEP_EXTEND, STEP_NO_VERIFY = range(4)
STEP_KINDS = {"decode": STEP_DECODE, "idle": STEP_IDLE, "extend": STEP_EXTEND,
              "no_verify": STEP_NO_VERIFY}
# dpbGranularity_t
GRANULARITIES = {"request": 0, "budget": 1}
# rank_flags bits (DPB_RANK_*)
RANK_PLANNED, RANK_EXTEND, RANK_NO_VERIFY, RANK_IDLE, RANK_UNKNOWN = 1, 2, 4, 8, 16
RANK_FLAG_NAMES = {RANK_PLANNED: "planned", RANK_EXTEND: "extend", RANK_NO_VERIFY: "no_verify",
                   RANK_IDLE: "idle", RANK_UNKNOWN: "unknown"}


class DpBalanceError(RuntimeError):
    """The plugin could not be loaded or initialised (the message names what and why)."""


# --- the C structs of dpbalance_plugin_v1.h, field for field -------------------------------

AllGatherFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_size_t, ctypes.c_int32)


class _InitArgs(ctypes.Structure):
    _fields_ = [("num_ranks", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("config", ctypes.c_char_p), ("backend", ctypes.c_int),
                ("allgather_fn", AllGatherFn), ("allgather_user", ctypes.c_void_p),
                ("nccl_comm", ctypes.c_void_p), ("cuda_stream", ctypes.c_void_p),
                ("nccl_unique_id", ctypes.c_void_p), ("cuda_device", ctypes.c_int32)]


class _Request(ctypes.Structure):
    _fields_ = [("request_id", ctypes.c_int64), ("ctx_tokens", ctypes.c_int64),
                ("k_min", ctypes.c_int32), ("k_cap", ctypes.c_int32),
                ("draft_confidence", ctypes.POINTER(ctypes.c_float)),
                ("num_confidence", ctypes.c_int32)]


class _Accepted(ctypes.Structure):
    _fields_ = [("request_id", ctypes.c_int64), ("verify_len", ctypes.c_int32),
                ("accepted", ctypes.c_int32), ("finished", ctypes.c_int32)]


class _Stats(ctypes.Structure):
    _fields_ = [("steps", ctypes.c_int64), ("balanced_steps", ctypes.c_int64),
                ("fallbacks", ctypes.c_int64), ("enabled", ctypes.c_int32),
                ("bubble_fraction", ctypes.c_double), ("bubble_us", ctypes.c_double),
                ("predicted_error", ctypes.c_double), ("tokens_per_step", ctypes.c_double),
                ("goodput_tok_per_s", ctypes.c_double),
                ("ab_on_epochs", ctypes.c_int64), ("ab_off_epochs", ctypes.c_int64),
                ("ab_on_bubble", ctypes.c_double), ("ab_on_bubble_ci95", ctypes.c_double),
                ("ab_on_goodput", ctypes.c_double), ("ab_on_goodput_ci95", ctypes.c_double),
                ("ab_off_bubble", ctypes.c_double), ("ab_off_bubble_ci95", ctypes.c_double),
                ("ab_off_goodput", ctypes.c_double), ("ab_off_goodput_ci95", ctypes.c_double)]


class _Plugin(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("init", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_InitArgs),
                                  ctypes.POINTER(ctypes.c_void_p))),
        ("plan", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Request),
                                  ctypes.c_int32, ctypes.c_int64, ctypes.POINTER(ctypes.c_int32),
                                  ctypes.POINTER(ctypes.c_int32))),
        ("report", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_double,
                                    ctypes.c_double, ctypes.POINTER(_Accepted), ctypes.c_int32)),
        ("stats", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_Stats))),
        ("finalize", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)),
    ]


class _RouterArgs(ctypes.Structure):
    _fields_ = [("num_ranks", ctypes.c_int32), ("config", ctypes.c_char_p)]


class _RankLoad(ctypes.Structure):
    _fields_ = [("num_requests", ctypes.c_int32), ("max_requests", ctypes.c_int32),
                ("ctx_tokens", ctypes.c_int64), ("max_ctx_tokens", ctypes.c_int64),
                ("reserved_tokens", ctypes.c_int64), ("capacity_tokens", ctypes.c_int64)]


class _Router(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("create", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_RouterArgs),
                                    ctypes.POINTER(ctypes.c_void_p))),
        ("route", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_RankLoad),
                                   ctypes.c_int32, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.POINTER(ctypes.c_int32))),
        ("observe_finished", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)),
        ("destroy", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)),
    ]


# --- the C structs of dpbalance_plugin_v2.h, field for field ------------------------------

AllGatherFnV2 = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32)


class _InitArgsV2(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("dp_size", ctypes.c_int32),
                ("dp_rank", ctypes.c_int32), ("attn_tp_size", ctypes.c_int32),
                ("attn_tp_rank", ctypes.c_int32), ("config", ctypes.c_char_p),
                ("backend", ctypes.c_int), ("allgather_fn", AllGatherFnV2),
                ("allgather_user", ctypes.c_void_p), ("nccl_comm", ctypes.c_void_p),
                ("cuda_stream", ctypes.c_void_p), ("nccl_unique_id", ctypes.c_void_p),
                ("cuda_device", ctypes.c_int32), ("token_tiers", ctypes.POINTER(ctypes.c_int32)),
                ("num_token_tiers", ctypes.c_int32), ("granularity", ctypes.c_int)]


class _RequestV2(ctypes.Structure):
    _fields_ = [("id", ctypes.c_void_p), ("id_bytes", ctypes.c_int32),
                ("ctx_tokens", ctypes.c_int64), ("k_min", ctypes.c_int32),
                ("k_cap", ctypes.c_int32), ("draft_confidence", ctypes.POINTER(ctypes.c_float)),
                ("num_confidence", ctypes.c_int32)]


class _StepV2(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("requests", ctypes.POINTER(_RequestV2)),
                ("num_requests", ctypes.c_int32), ("kv_free_tokens", ctypes.c_int64),
                ("extra_tokens", ctypes.c_int64)]


class _PlanResultV2(ctypes.Structure):
    _fields_ = [("verify_len", ctypes.POINTER(ctypes.c_int32)),
                ("rank_tokens", ctypes.POINTER(ctypes.c_int64)),
                ("rank_flags", ctypes.POINTER(ctypes.c_uint32)),
                ("draft_depth", ctypes.c_int32), ("verify_budget", ctypes.c_int32),
                ("padded_tokens", ctypes.c_int64), ("any_rank_flags", ctypes.c_uint32),
                ("balanced", ctypes.c_int32), ("plan_id", ctypes.c_int64)]


class _AcceptedV2(ctypes.Structure):
    _fields_ = [("id", ctypes.c_void_p), ("id_bytes", ctypes.c_int32),
                ("verify_len", ctypes.c_int32), ("accepted", ctypes.c_int32),
                ("finished", ctypes.c_int32)]


class _ReportV2(ctypes.Structure):
    _fields_ = [("plan_id", ctypes.c_int64),
                ("attention_us", ctypes.c_double), ("step_us", ctypes.c_double),
                ("accepted", ctypes.POINTER(_AcceptedV2)), ("num_accepted", ctypes.c_int32)]


class _StatsV2(ctypes.Structure):
    _fields_ = [("v1", _Stats), ("missing_reports", ctypes.c_int64),
                ("tp_mismatches", ctypes.c_int64), ("exchange_failures", ctypes.c_int64),
                ("max_exchange_ms", ctypes.c_double)]


class _PluginV2(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
        ("init", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_InitArgsV2),
                                  ctypes.POINTER(ctypes.c_void_p))),
        ("plan", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_StepV2),
                                  ctypes.POINTER(_PlanResultV2))),
        ("report", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_ReportV2))),
        ("stats", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_StatsV2))),
        ("finalize", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)),
    ]


# --- the C structs of dpbalance_inspect_v1.h, field for field ------------------------------

class _StepInfo(ctypes.Structure):
    _fields_ = [("plan_id", ctypes.c_int64), ("predicted_attention_us", ctypes.c_double),
                ("measured_attention_us", ctypes.c_double),
                ("planned_barrier_us", ctypes.c_double), ("extend", ctypes.c_int32)]


class _StepTerms(ctypes.Structure):  # dpbStepTerms_v1_t (dpbalance_inspect_v2.h)
    _fields_ = [("ffn_fixed_us", ctypes.c_double), ("ffn_per_token_us", ctypes.c_double),
                ("draft_us", ctypes.c_double), ("step_overhead_us", ctypes.c_double),
                ("online", ctypes.c_int32), ("per_token_learnt", ctypes.c_int32),
                ("draft_learnt", ctypes.c_int32), ("reserved", ctypes.c_int32),
                ("rows", ctypes.c_int64), ("fits", ctypes.c_int64), ("resets", ctypes.c_int64)]


class _Inspect(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("check_flags", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int32,
                                         ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                         ctypes.c_size_t)),
        ("last_step", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_StepInfo))),
    ]


class _InspectV2(ctypes.Structure):  # dpbalanceInspect_v2_t: v1's functions and step_terms
    _fields_ = _Inspect._fields_ + [
        ("step_terms", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(_StepTerms))),
    ]


# --- what the engine passes --------------------------------------------------------------

class Request(NamedTuple):
    """One request of this rank's batch, this step (dpbRequest_v1_t / dpbRequest_v2_t).
    `request_id`: an int for ABI v1; the engine's id as str (sent as UTF-8) or bytes for v2."""
    request_id: object
    ctx_tokens: int          # tokens in KV before this step
    k_min: int = 0           # floor on the verify length (e.g. the engine's own SLO rule)
    k_cap: int = 7           # min(draft depth limit, tokens the request may still emit - 1)
    draft_confidence: Optional[Sequence[float]] = None  # per-position confidence, optional


class Accepted(NamedTuple):
    """What a request's verify did this step (dpbAccepted_v1_t). NamedTuples, as Request: a
    plain tuple in field order works too. `request_id` as in Request."""
    request_id: object
    verify_len: int
    accepted: int
    finished: bool = False


class RankLoad(NamedTuple):
    """One DP rank's load as the engine's router sees it (dpbRankLoad_v1_t)."""
    num_requests: int
    ctx_tokens: int          # sum of its requests' current contexts (token usage)
    reserved_tokens: int     # KV reserved: contexts + the outputs still to come
    capacity_tokens: int     # KV capacity
    max_requests: int = 0    # batch cap; 0: none
    max_ctx_tokens: int = 0  # its longest context (fitted models' critical path); 0: unknown


def resolve_library(library: Optional[str] = None) -> Optional[str]:
    """The file to dlopen: `library`, else $DPB_PLUGIN, else libdpbalance.so; None for `none`.

    NCCL's convention, as the reference engine: a bare name `foo` means `libfoo.so`."""
    name = library if library else os.environ.get("DPB_PLUGIN", "") or DEFAULT_LIBRARY
    if name == "none":
        return None
    if "/" not in name and ".so" not in name:
        name = f"lib{name}.so"
    return name


def _int_field(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"dpbalance: {what} = {value!r} is not an integer")
    if not lo <= value <= hi:
        raise ValueError(f"dpbalance: {what} = {value} is out of range {lo}..{hi}")
    return value


def _index_field(value, what: str, lo: int, hi: int) -> int:
    """As _int_field, but any integer type (numpy's, torch's) through operator.index."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"dpbalance: {what} = {value!r} is not an integer") from None
    return _int_field(value, what, lo, hi)


# The records packed straight into the ctypes arrays (native layout, as the structs above; the
# python_adapter test checks both against the compiler's offsets).
_REQUEST_PACK = struct.Struct("@qqiiPi4x")
_ACCEPTED_PACK = struct.Struct("@qiii4x")
_RANK_LOAD_PACK = struct.Struct("@iiqqqq")
_REQUEST_V2_PACK = struct.Struct("@PiqiiPi4x")    # id, id_bytes, ctx, k_min, k_cap, conf, n
_ACCEPTED_V2_PACK = struct.Struct("@Piiii")      # id, id_bytes, verify_len, accepted, finished
_I64, _I32 = (-(1 << 63), (1 << 63) - 1), (-(1 << 31), (1 << 31) - 1)
_REQUEST_FIELDS = [("request_id", _I64), ("ctx_tokens", _I64), ("k_min", _I32), ("k_cap", _I32)]
_ACCEPTED_FIELDS = [("request_id", _I64), ("verify_len", _I32), ("accepted", _I32)]
_REQUEST_V2_FIELDS = [("ctx_tokens", _I64), ("k_min", _I32), ("k_cap", _I32)]
_ACCEPTED_V2_FIELDS = [("verify_len", _I32), ("accepted", _I32)]
_RANK_LOAD_FIELDS = [("num_requests", _I32), ("max_requests", _I32), ("ctx_tokens", _I64),
                     ("max_ctx_tokens", _I64), ("reserved_tokens", _I64),
                     ("capacity_tokens", _I64)]


def _name_the_bad_field(items, what: str, fields) -> None:
    """Raises TypeError/ValueError naming the first field that cannot be marshalled."""
    for i, item in enumerate(items):
        for name, (lo, hi) in fields:
            _int_field(getattr(item, name, None), f"{what}[{i}].{name}", lo, hi)


def _records(struct_type, n):
    """A ctypes array of n records and a byte view of it for struct.pack_into."""
    arr = (struct_type * n)()
    return arr, memoryview(arr).cast("B")


if (_REQUEST_PACK.size, _ACCEPTED_PACK.size, _RANK_LOAD_PACK.size, _REQUEST_V2_PACK.size,
        _ACCEPTED_V2_PACK.size) != (
        ctypes.sizeof(_Request), ctypes.sizeof(_Accepted), ctypes.sizeof(_RankLoad),
        ctypes.sizeof(_RequestV2), ctypes.sizeof(_AcceptedV2)):
    raise ImportError("dpbalance: this platform's struct layout differs from the packed records")


def _load_symbol(library: Optional[str], symbol: str, struct_type):
    """(CDLL, the exported const struct, path) for `library` as resolve_library reads it."""
    path = resolve_library(library)
    if path is None:
        raise DpBalanceError("dpbalance: the plugin is disabled (DPB_PLUGIN=none); "
                             "use load(), which returns None")
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as e:
        raise DpBalanceError(f"dpbalance: cannot load plugin '{path}': {e}") from e
    try:
        return lib, struct_type.in_dll(lib, symbol), path
    except ValueError as e:
        raise DpBalanceError(f"dpbalance: '{path}' has no symbol {symbol}") from e


class FlagCheck(NamedTuple):
    """What `check_flags` found: ok, the reason when not ("" when ok), and the settings in
    effect when ok (name -> value, as strings: mode, k_max, default_k, cost_model, draft_us, ...)."""
    ok: bool
    error: str
    settings: dict


def check_flags(config: str = "", dp_size: int = 1, library: Optional[str] = None) -> FlagCheck:
    """The DPB_* flags of this process's environment and `config` (the string init will get)
    checked as init checks them, through the library's `dpbalanceInspect_v1`
    (dpbalance_inspect_v1.h), without starting anything: for an engine to find a bad value at
    its start, before it says it is ready. Raises DpBalanceError when the library cannot be
    loaded or lacks the symbol (a library older than the inspection ABI)."""
    _int_field(dp_size, "dp_size", 1, 1 << 16)
    _lib, api, _path = _load_symbol(library, INSPECT_SYMBOL, _Inspect)
    error = ctypes.create_string_buffer(2048)
    settings = ctypes.create_string_buffer(2048)
    rc = api.check_flags((config or "").encode(), dp_size, error, len(error), settings,
                         len(settings))
    if rc != SUCCESS:
        return FlagCheck(False, error.value.decode(errors="replace") or RESULT_NAMES.get(rc, str(rc)),
                         {})
    pairs = (kv.split("=", 1) for kv in settings.value.decode(errors="replace").split())
    return FlagCheck(True, "", {k: v for k, v in pairs})


class _Closing:
    """`with` support and a last close() when collected, for the classes that own a C handle."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Balancer(_Closing):
    """What both ABI versions share: loading, the all-gather trampoline's core, the reused
    request and accepted arrays and their packing. Not thread-safe: one per rank (process)."""

    _REQ_T = _ACC_T = None  # the ABI's ctypes records
    _REQ_PACK = _ACC_PACK = None
    _REQ_FIELDS = _ACC_FIELDS = ()

    def _setup(self, allgather, library, symbol, plugin_type) -> None:
        self._lib, self._plugin, self.path = _load_symbol(library, symbol, plugin_type)
        self.name = (self._plugin.name or b"").decode()
        self.last_result = SUCCESS
        self._user_allgather = allgather
        self._callback_error: Optional[BaseException] = None
        self._ctx = ctypes.c_void_p()
        # Buffers reused across steps (grown on demand): no allocation per step in steady state.
        self._cap = self._acc_cap = 0
        self._grow(16)
        self._grow_accepted(16)

    def _inspect_api(self):
        """The library's inspection ABI, looked up once: v2 (v1's functions and step_terms), or
        v1 from a library older than v2 (then `_inspect_v2` is False), or None."""
        if not hasattr(self, "_inspect"):
            self._inspect, self._inspect_v2 = None, False
            self._step_info = _StepInfo()
            for cls, symbol in ((_InspectV2, INSPECT_SYMBOL_V2), (_Inspect, INSPECT_SYMBOL)):
                try:
                    self._inspect = cls.in_dll(self._lib, symbol)
                except ValueError:
                    continue
                self._inspect_v2 = cls is _InspectV2
                break
        return self._inspect

    def last_step(self) -> Optional[dict]:
        """The step of the latest report (dpbStepInfo_v1_t of dpbalance_inspect_v1.h): plan_id,
        predicted_attention_us (< 0: not balanced), measured_attention_us, planned_barrier_us,
        extend. None after close() or when the library lacks the inspection ABI."""
        api = self._inspect_api() if self._ctx else None
        if api is None or api.last_step(self._ctx, ctypes.byref(self._step_info)) != SUCCESS:
            return None
        i = self._step_info
        return {"plan_id": i.plan_id, "predicted_attention_us": i.predicted_attention_us,
                "measured_attention_us": i.measured_attention_us,
                "planned_barrier_us": i.planned_barrier_us, "extend": bool(i.extend)}

    def step_terms(self) -> Optional[dict]:
        """The step terms the plugin prices with now (dpbStepTerms_v1_t of
        dpbalance_inspect_v2.h): ffn_fixed_us, ffn_per_token_us, draft_us, step_overhead_us,
        learnt online (`online`) or the flags, with the fit's rows, fits and resets. None after
        close() or when the library lacks inspection ABI v2."""
        api = self._inspect_api() if self._ctx else None
        t = _StepTerms()
        if api is None or not self._inspect_v2 or api.step_terms(self._ctx, ctypes.byref(t)) != SUCCESS:
            return None
        out = {name: getattr(t, name) for name, _ in _StepTerms._fields_ if name != "reserved"}
        for name in ("online", "per_token_learnt", "draft_learnt"):
            out[name] = bool(out[name])
        return out

    def _init_failed(self, rc: int, what: str, config: str) -> DpBalanceError:
        self._ctx = ctypes.c_void_p()
        why = (f"; its all-gather callback failed: {self._callback_error}"
               if self._callback_error is not None else "")
        return DpBalanceError(
            f"dpbalance: init of {what} with config '{config}' returned "
            f"{RESULT_NAMES.get(rc, rc)} (the plugin's log on stderr names the flag or cause)"
            f"{why}")

    def _gather(self, send: int, send_bytes: int, recv: int, recv_bytes: int,
                timeout_ms: int) -> int:
        """Runs the engine's all-gather on this process's record; returns the bytes written into
        `recv`, never more than recv_bytes. Raises what the callable raised, or ValueError for a
        result that does not fit."""
        data = ctypes.string_at(send, send_bytes)
        into = getattr(self._user_allgather, "gather_into", None)
        if into is not None:
            view = memoryview((ctypes.c_ubyte * recv_bytes).from_address(recv)).cast("B")
            try:
                n = into(data, view, int(timeout_ms))
            finally:
                view.release()
            if isinstance(n, bool) or not isinstance(n, int) or n > recv_bytes:
                raise ValueError(f"gather_into returned {n!r}, the receive buffer holds "
                                 f"{recv_bytes} bytes")
            if n < 0:
                raise ConnectionError(f"gather_into returned {n}")
            return n
        out = self._user_allgather(data, int(timeout_ms))
        n = len(out)
        if n > recv_bytes:  # never past the plugin's buffer
            raise ValueError(f"all-gather returned {n} bytes, the receive buffer holds "
                             f"{recv_bytes} ({recv_bytes // max(send_bytes, 1)} processes x "
                             f"{send_bytes})")
        ctypes.memmove(recv, bytes(out), n)
        return n

    def _grow(self, n: int) -> None:
        if n > self._cap:
            self._cap = max(n, 2 * self._cap, 16)
            self._reqs, self._reqs_view = _records(self._REQ_T, self._cap)
            self._lens = (ctypes.c_int32 * self._cap)()

    def _grow_accepted(self, n: int) -> None:
        if n > self._acc_cap:
            self._acc_cap = max(n, 2 * self._acc_cap, 16)
            self._acc, self._acc_view = _records(self._ACC_T, self._acc_cap)

    def _ids(self, items, what: str):
        """(per item: the id as packed before the other fields, a value to keep alive)."""
        raise NotImplementedError

    def _pack_requests(self, requests: Sequence[Request]) -> list:
        """Packs `requests` into the reused array; returns what must stay alive through plan."""
        self._grow(len(requests))
        ids, keep = self._ids(requests, "requests")
        buf, pack, size = self._reqs_view, self._REQ_PACK.pack_into, self._REQ_PACK.size
        try:
            for i, r in enumerate(requests):
                c = r.draft_confidence
                if c:
                    arr = (ctypes.c_float * len(c))(*c)
                    keep.append(arr)
                    pack(buf, i * size, *ids[i], r.ctx_tokens, r.k_min, r.k_cap,
                         ctypes.addressof(arr), len(c))
                else:
                    pack(buf, i * size, *ids[i], r.ctx_tokens, r.k_min, r.k_cap, 0, 0)
        except (struct.error, TypeError, AttributeError):
            _name_the_bad_field(requests, "requests", self._REQ_FIELDS)
            raise
        return keep

    def _pack_accepted(self, accepted: Sequence[Accepted]) -> list:
        self._grow_accepted(len(accepted))
        ids, keep = self._ids(accepted, "accepted")
        buf, pack, size = self._acc_view, self._ACC_PACK.pack_into, self._ACC_PACK.size
        try:
            for i, a in enumerate(accepted):
                pack(buf, i * size, *ids[i], a.verify_len, a.accepted, 1 if a.finished else 0)
        except (struct.error, TypeError, AttributeError):
            _name_the_bad_field(accepted, "accepted", self._ACC_FIELDS)
            raise
        return keep

    def _warn_callback(self) -> None:
        if self._callback_error is not None:
            log.warning("dpbalance: %s all-gather callback failed (%s); the plugin falls back",
                        self._who(), self._callback_error)

    def _who(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        if self._ctx:
            self._plugin.finalize(self._ctx)
            self._ctx = ctypes.c_void_p()


class DpBalance(_Balancer):
    """One DP rank's balancer, behind the plugin's C ABI v1 (integer request ids). Not
    thread-safe: one per rank. `DpBalance.load(..., abi=2)` gives a DpBalanceV2."""

    _REQ_T, _ACC_T = _Request, _Accepted
    _REQ_PACK, _ACC_PACK = _REQUEST_PACK, _ACCEPTED_PACK
    _REQ_FIELDS, _ACC_FIELDS = _REQUEST_FIELDS, _ACCEPTED_FIELDS

    @classmethod
    def load(cls, num_ranks: int, rank: int, config: str = "", allgather=None,
             library: Optional[str] = None, abi: int = 1, **v2_args):
        """Like the constructor, but returns None when DPB_PLUGIN (or `library`) is `none`.
        abi=2: a DpBalanceV2 (num_ranks is the DP size, rank the DP rank; `v2_args` are its
        keyword arguments: attn_tp_size, attn_tp_rank, token_tiers, granularity)."""
        if abi not in (1, 2):
            raise ValueError(f"dpbalance: abi = {abi!r}, the adapter speaks ABI 1 and 2")
        if abi == 1 and v2_args:
            raise TypeError(f"dpbalance: {sorted(v2_args)} need abi=2")
        if resolve_library(library) is None:
            log.info("dpbalance: DPB_PLUGIN=none, running without it")
            return None
        if abi == 2:
            return DpBalanceV2(num_ranks, rank, config, allgather, library, **v2_args)
        return cls(num_ranks, rank, config, allgather, library)

    def __init__(self, num_ranks: int, rank: int, config: str = "",
                 allgather: Optional[Callable[[bytes, int], bytes]] = None,
                 library: Optional[str] = None):
        """`allgather(send: bytes, timeout_ms: int) -> bytes` must return every rank's record
        (num_ranks * len(send) bytes, rank order) and is called on every rank in lockstep.
        Without it the backend comes from the flags (DPB_BACKEND: nccl or inproc)."""
        _int_field(num_ranks, "num_ranks", 1, 1 << 20)
        _int_field(rank, "rank", 0, num_ranks - 1)
        self.num_ranks, self.rank = num_ranks, rank
        self._setup(allgather, library, SYMBOL, _Plugin)
        # Kept referenced for the context's lifetime: the plugin holds the raw pointer.
        self._cfn = AllGatherFn(self._allgather_trampoline) if allgather else AllGatherFn()
        self._config = (config or "").encode()
        args = _InitArgs(num_ranks=num_ranks, rank=rank, config=self._config,
                         backend=BACKEND_CALLBACK if allgather else BACKEND_FROM_FLAGS,
                         allgather_fn=self._cfn, cuda_device=-1)
        rc = self._plugin.init(ctypes.byref(args), ctypes.byref(self._ctx))
        if rc != SUCCESS:
            raise self._init_failed(rc, f"rank {rank}/{num_ranks}", config)
        self._depth = ctypes.c_int32(0)

    def _who(self) -> str:
        return f"rank {self.rank}"

    def _ids(self, items, what):
        return [(x.request_id,) for x in items], []

    # The plugin calls this from inside plan(), on this rank's thread.
    def _allgather_trampoline(self, _user, send, recv, record_bytes, timeout_ms) -> int:
        try:
            want = record_bytes * self.num_ranks
            n = self._gather(send, record_bytes, recv, want, timeout_ms)
            if n != want:
                raise ValueError(f"all-gather returned {n} bytes, expected {want} "
                                 f"({self.num_ranks} ranks x {record_bytes})")
            return 0
        except BaseException as e:  # never let an exception unwind through C
            self._callback_error = e
            return 1

    def plan(self, requests: Sequence[Request], kv_free_tokens: int = -1):
        """Returns (verify lengths in request order, draft depth). Call on every rank each step.

        `kv_free_tokens`: KV tokens left for extra verify tokens on this rank (< 0: no limit).
        Values the plugin rejects (a negative context, say) give this step the default lengths
        and a log line naming the value, like any other failure; only values that cannot be
        marshalled into the C struct at all (not an integer, out of the C type's range) raise."""
        if not self._ctx:
            raise DpBalanceError("dpbalance: plan() after close()")
        n = len(requests)
        keep = self._pack_requests(requests)  # noqa: F841 (alive through the call)
        self._callback_error = None
        self.last_result = self._plugin.plan(self._ctx, self._reqs, n, int(kv_free_tokens),
                                             self._lens, ctypes.byref(self._depth))
        if self._callback_error is not None:
            log.warning("dpbalance: rank %d all-gather callback failed (%s); default lengths "
                        "from now on", self.rank, self._callback_error)
        return self._lens[:n], self._depth.value

    def report(self, attention_us: float, step_us: float, accepted: Sequence[Accepted]) -> int:
        """After the verify forward: measured attention and step time (µs), accept counts.
        Returns the plugin's result code (also in `last_result`)."""
        if not self._ctx:
            raise DpBalanceError("dpbalance: report() after close()")
        n = len(accepted)
        self._pack_accepted(accepted)
        rc = self._plugin.report(self._ctx, float(attention_us), float(step_us), self._acc, n)
        self.last_result = rc
        return rc

    def stats(self) -> dict:
        """The plugin's live figures (dpbStats_v1_t) as a dict; {} after close()."""
        if not self._ctx:
            return {}
        s = _Stats()
        rc = self._plugin.stats(self._ctx, ctypes.byref(s))
        if rc != SUCCESS:
            return {"result": RESULT_NAMES.get(rc, rc)}
        return {name: getattr(s, name) for name, _ in _Stats._fields_}


class PlanResult(NamedTuple):
    """What `DpBalanceV2.plan` returns (dpbPlanResult_v2_t plus the result code)."""
    verify_len: list      # per request, request order (the defaults unless `balanced`)
    draft_depth: int      # the agreed draft depth
    verify_budget: int    # this rank's verify tokens (sum of verify_len)
    padded_tokens: int    # the agreed per-rank padded size
    rank_tokens: list     # every DP rank's token total, DP rank order; -1: unknown
    rank_flags: list      # every DP rank's RANK_* bits
    any_rank_flags: int   # OR of rank_flags
    balanced: bool        # the lengths are balanced (False: the engine's defaults)
    result: int           # the dpbResult_t code; anything but SUCCESS: defaults, see the log
    plan_id: int = -1     # this plan, for `report(..., plan_id=)` when reports lag a step


def _id_bytes(value, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"dpbalance: {what} = {value!r} is not a str or bytes id (ABI v2)")


class DpBalanceV2(_Balancer):
    """One process's balancer behind ABI v2 (dpbalance_plugin_v2.h): the engine's string ids,
    attention-TP groups, step kinds, every DP rank's token total and the padded size. With
    attn_tp_size > 1 every process of every DP rank makes one (the group is
    dp_size * attn_tp_size processes in (dp_rank, attn_tp_rank) order) and calls plan in
    lockstep. Not thread-safe: one per process."""

    _REQ_T, _ACC_T = _RequestV2, _AcceptedV2
    _REQ_PACK, _ACC_PACK = _REQUEST_V2_PACK, _ACCEPTED_V2_PACK
    _REQ_FIELDS, _ACC_FIELDS = _REQUEST_V2_FIELDS, _ACCEPTED_V2_FIELDS

    @classmethod
    def load(cls, dp_size: int, dp_rank: int, config: str = "", allgather=None,
             library: Optional[str] = None, **kwargs) -> Optional["DpBalanceV2"]:
        """Like the constructor, but returns None when DPB_PLUGIN (or `library`) is `none`."""
        return DpBalance.load(dp_size, dp_rank, config, allgather, library, abi=2, **kwargs)

    def __init__(self, dp_size: int, dp_rank: int, config: str = "", allgather=None,
                 library: Optional[str] = None, attn_tp_size: int = 1, attn_tp_rank: int = 0,
                 token_tiers: Optional[Sequence[int]] = None, granularity: str = "request"):
        """`allgather`: see the module docstring; it gathers from all dp_size * attn_tp_size
        processes. `token_tiers`: the per-rank token sizes the engine captured (CUDA graphs),
        ascending; None: DPB_TIERS. `granularity`: "request" (a verify length per request) or
        "budget" (a verify-token budget for this rank, spread by the engine). Raises
        DpBalanceError when the library, the flags or the arguments are refused."""
        _int_field(dp_size, "dp_size", 1, 1 << 20)
        _int_field(dp_rank, "dp_rank", 0, dp_size - 1)
        _int_field(attn_tp_size, "attn_tp_size", 1, 1 << 20)
        _int_field(attn_tp_rank, "attn_tp_rank", 0, attn_tp_size - 1)
        if granularity not in GRANULARITIES:
            raise ValueError(f"dpbalance: granularity = {granularity!r}, expected one of "
                             f"{sorted(GRANULARITIES)}")
        tiers = [] if token_tiers is None else list(token_tiers)
        for i, t in enumerate(tiers):
            _int_field(t, f"token_tiers[{i}]", *_I32)
        self.num_ranks = self.dp_size = dp_size
        self.rank = self.dp_rank = dp_rank
        self.attn_tp_size, self.attn_tp_rank = attn_tp_size, attn_tp_rank
        self.group_size = dp_size * attn_tp_size
        self._setup(allgather, library, SYMBOL_V2, _PluginV2)
        if self._plugin.abi_version != ABI_VERSION_2:
            raise DpBalanceError(f"dpbalance: '{self.path}' exports {SYMBOL_V2} with abi_version "
                                 f"{self._plugin.abi_version}, expected {ABI_VERSION_2}")
        self._cfn = AllGatherFnV2(self._allgather_trampoline) if allgather else AllGatherFnV2()
        self._config = (config or "").encode()
        self._tiers = (ctypes.c_int32 * max(len(tiers), 1))(*tiers)
        args = _InitArgsV2(struct_size=ctypes.sizeof(_InitArgsV2), dp_size=dp_size,
                           dp_rank=dp_rank, attn_tp_size=attn_tp_size, attn_tp_rank=attn_tp_rank,
                           config=self._config,
                           backend=BACKEND_CALLBACK if allgather else BACKEND_FROM_FLAGS,
                           allgather_fn=self._cfn, cuda_device=-1,
                           token_tiers=self._tiers if token_tiers is not None else None,
                           num_token_tiers=len(tiers), granularity=GRANULARITIES[granularity])
        rc = self._plugin.init(ctypes.byref(args), ctypes.byref(self._ctx))
        if rc != SUCCESS:
            raise self._init_failed(
                rc, f"DP rank {dp_rank}/{dp_size}, attn-TP rank {attn_tp_rank}/{attn_tp_size}",
                config)
        self._rank_tokens = (ctypes.c_int64 * dp_size)()
        self._rank_flags = (ctypes.c_uint32 * dp_size)()
        self._step = _StepV2()
        self._result = _PlanResultV2()
        self._report = _ReportV2()
        self._last_plan_id = -1
        # _ids' last packing, one tuple so it is replaced whole: the ids (str or bytes), each
        # one's (address, length), the bytes they point into (kept alive here while the packing
        # may be reused). None: nothing to reuse.
        self._ids_cache = None

    def _who(self) -> str:
        return f"DP rank {self.dp_rank} (attn-TP rank {self.attn_tp_rank})"

    def _ids(self, items, what):
        """All ids in one bytes object; each record points into it (no copy per id).

        An engine passes the same ids step after step (and report() the ids plan() had), so
        the last list's packing is kept and reused when the ids are equal, in order (immutable
        ids only: a bytearray may have changed since)."""
        try:
            key = [x.request_id for x in items]
        except AttributeError:
            raise TypeError(f"dpbalance: {what} holds an item without request_id") from None
        # Only a list of str or bytes ids is kept: a bytearray may change after the call (and
        # compares equal to the bytes it held), so a list with one is packed every time.
        immutable = all(type(k) in (str, bytes) for k in key)
        cached = self._ids_cache
        if immutable and cached is not None and key == cached[0]:
            return cached[1], [cached[2]]
        raw = [_id_bytes(x, f"{what}[{i}].request_id") for i, x in enumerate(key)]
        blob = b"".join(raw)
        base = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value or 0
        ids, off = [], 0
        for r in raw:
            ids.append((base + off, len(r)))
            off += len(r)
        self._ids_cache = (key, ids, blob) if immutable else None
        return ids, [blob]

    def _allgather_trampoline(self, _user, send, send_bytes, recv, recv_bytes, timeout_ms):
        try:
            return self._gather(send, send_bytes, recv, recv_bytes, timeout_ms)
        except BaseException as e:  # never let an exception unwind through C
            self._callback_error = e
            return -1

    def plan(self, requests: Sequence[Request], kind: str = "decode", kv_free_tokens: int = -1,
             extra_tokens: int = 0) -> PlanResult:
        """Call on every process each step, whatever the step (`kind`: decode, idle, extend,
        no_verify). `extra_tokens`: query tokens this rank runs beside verify (prefill).
        Failures come back as the defaults with a non-SUCCESS `result`, as in v1; only values
        that cannot be marshalled raise (naming them)."""
        if not self._ctx:
            raise DpBalanceError("dpbalance: plan() after close()")
        if kind not in STEP_KINDS:
            raise ValueError(f"dpbalance: step kind {kind!r}, expected one of {list(STEP_KINDS)}")
        n = len(requests)
        keep = self._pack_requests(requests)  # noqa: F841 (alive through the call)
        st, res = self._step, self._result
        st.kind, st.requests, st.num_requests = STEP_KINDS[kind], self._reqs, n
        st.kv_free_tokens = _index_field(kv_free_tokens, "kv_free_tokens", *_I64)
        st.extra_tokens = _index_field(extra_tokens, "extra_tokens", *_I64)
        ctypes.memset(ctypes.byref(res), 0, ctypes.sizeof(res))
        # Unknown until the plugin writes them: a result that leaves them (a failure before the
        # exchange) must not read as the previous step's agreement.
        for r in range(self.dp_size):
            self._rank_tokens[r] = -1
        res.plan_id = -1
        res.verify_len, res.rank_tokens, res.rank_flags = self._lens, self._rank_tokens, self._rank_flags
        self._callback_error = None
        rc = self._plugin.plan(self._ctx, ctypes.byref(st), ctypes.byref(res))
        self.last_result = rc
        self._warn_callback()
        self._last_plan_id = res.plan_id
        return PlanResult(self._lens[:n], res.draft_depth, res.verify_budget, res.padded_tokens,
                          self._rank_tokens[:], self._rank_flags[:], res.any_rank_flags,
                          bool(res.balanced), rc, res.plan_id)

    def report(self, attention_us: float, step_us: float, accepted: Sequence[Accepted],
               plan_id: Optional[int] = None) -> int:
        """After the verify forward: this process's measured attention and step time (µs) and
        the accept counts (ids as passed to plan). `plan_id`: the plan reported (PlanResult's),
        for an engine that plans step t+1 before step t's results are in; default: the latest
        plan. Returns the result code (`last_result`)."""
        if not self._ctx:
            raise DpBalanceError("dpbalance: report() after close()")
        keep = self._pack_accepted(accepted)  # noqa: F841
        r = self._report
        r.plan_id = _index_field(self._last_plan_id if plan_id is None else plan_id, "plan_id", *_I64)
        r.attention_us, r.step_us = float(attention_us), float(step_us)
        r.accepted, r.num_accepted = self._acc, len(accepted)
        rc = self._plugin.report(self._ctx, ctypes.byref(r))
        self.last_result = rc
        return rc

    def stats(self) -> dict:
        """dpbStats_v2_t as one flat dict (the v1 figures and the v2 counters); {} after
        close()."""
        if not self._ctx:
            return {}
        s = _StatsV2()
        rc = self._plugin.stats(self._ctx, ctypes.byref(s))
        if rc != SUCCESS:
            return {"result": RESULT_NAMES.get(rc, rc)}
        out = {name: getattr(s.v1, name) for name, _ in _Stats._fields_}
        out.update({name: getattr(s, name) for name, _ in _StatsV2._fields_[1:]})
        return out


class Router(_Closing):
    """The request routing strategies (A-E; docs/design.md "Routing") behind the router ABI,
    for the engine's DP router: the same code the replay runs. Not thread-safe."""

    @classmethod
    def load(cls, num_ranks: int, config: str = "",
             library: Optional[str] = None) -> Optional["Router"]:
        """Like the constructor, but returns None when DPB_PLUGIN (or `library`) is `none`."""
        if resolve_library(library) is None:
            return None
        return cls(num_ranks, config, library)

    def __init__(self, num_ranks: int, config: str = "", library: Optional[str] = None):
        """`config`: flags as `key=value;...` over DPB_* (routing, z, groups, cost_model, ...;
        docs/flags.md). Raises DpBalanceError when the library or the flags are refused."""
        _int_field(num_ranks, "num_ranks", 1, 1 << 20)
        self._lib, self._api, self.path = _load_symbol(library, ROUTER_SYMBOL, _Router)
        self.num_ranks = num_ranks
        self._config = (config or "").encode()
        self._router = ctypes.c_void_p()
        rc = self._api.create(ctypes.byref(_RouterArgs(num_ranks, self._config)),
                              ctypes.byref(self._router))
        if rc != SUCCESS:
            self._router = ctypes.c_void_p()
            raise DpBalanceError(
                f"dpbalance: router create for {num_ranks} ranks with config '{config}' returned "
                f"{RESULT_NAMES.get(rc, rc)} (the plugin's log on stderr names the flag)")
        self._loads, self._loads_view = _records(_RankLoad, num_ranks)
        self._rank = ctypes.c_int32(-1)

    def route(self, loads: Sequence[RankLoad], input_tokens: int, output_tokens: int):
        """The rank for a new request, or None when no rank has the KV capacity or batch room
        for it now (keep it queued). `loads`: one per rank, rank order. Raises ValueError for
        input the router rejects (the plugin's log names the rank and field); the engine then
        routes by its own rule."""
        if not self._router:
            raise DpBalanceError("dpbalance: route() after close()")
        if len(loads) != self.num_ranks:
            raise ValueError(f"dpbalance: {len(loads)} rank loads for {self.num_ranks} ranks")
        buf, pack, size = self._loads_view, _RANK_LOAD_PACK.pack_into, _RANK_LOAD_PACK.size
        try:
            for i, l in enumerate(loads):
                pack(buf, i * size, l.num_requests, l.max_requests, l.ctx_tokens,
                     l.max_ctx_tokens, l.reserved_tokens, l.capacity_tokens)
        except (struct.error, TypeError, AttributeError):
            _name_the_bad_field(loads, "loads", _RANK_LOAD_FIELDS)
            raise
        _int_field(input_tokens, "input_tokens", *_I64)
        _int_field(output_tokens, "output_tokens", *_I64)
        rc = self._api.route(self._router, self._loads, self.num_ranks, input_tokens,
                             output_tokens, ctypes.byref(self._rank))
        if rc == SUCCESS:
            return self._rank.value
        if rc == FALLBACK:
            return None
        raise ValueError(f"dpbalance: route returned {RESULT_NAMES.get(rc, rc)} for input "
                         f"{input_tokens} + {output_tokens} tokens (the plugin's log names the "
                         f"value)")

    def observe_finished(self, output_tokens: int) -> None:
        """A request left after `output_tokens` tokens (E's running mean output length)."""
        if not self._router:
            raise DpBalanceError("dpbalance: observe_finished() after close()")
        rc = self._api.observe_finished(self._router, _int_field(output_tokens, "output_tokens",
                                                                 0, _I64[1]))
        if rc != SUCCESS:
            raise ValueError(f"dpbalance: observe_finished returned {RESULT_NAMES.get(rc, rc)}")

    def close(self) -> None:
        if self._router:
            self._api.destroy(self._router)
            self._router = ctypes.c_void_p()


class StepResult(NamedTuple):
    """One step through `Piggyback.step`."""
    verify_len: Optional[list]  # per request; None when this rank has no plugin (use defaults)
    draft_depth: Optional[int]  # the instance's agreed depth; None without a plugin
    payloads: list              # every rank's engine payload, rank order
    plan: Optional[PlanResult] = None  # ABI v2: the whole result (token totals, padded size)


class Piggyback:
    """Carries the plugin's per-step record on the engine's own per-step DP collective.

    DP-attention engines already exchange per-rank batch facts every step, before the forward
    (SGLang: `MLPSyncBatchInfo.all_gather`; vLLM: `coordinate_batch_across_dp`'s all-reduce;
    docs/engines.md). Appending the plugin's 512-byte record to that exchange costs no second
    collective, and it makes the exchange fail only when the engine's own does: every rank
    then holds the same bytes, plans from them, and returns the same draft depth. A separate,
    timed collective can time out on one rank and complete on the others, which would leave
    that rank drafting the default depth while the rest draft the agreed one.

    `collective(payload: bytes) -> bytes` is the engine's all-gather of equal-size byte
    strings: every process's payload concatenated in group order. Pass the object as the
    plugin's all-gather, then call `step` where the engine runs its exchange:

        pb = Piggyback(my_collective, dp_size)
        dpb = DpBalance.load(dp_size, dp_rank, config, allgather=pb)   # may be None
        res = pb.step(dpb, requests, my_payload)  # res.payloads: what the engine gathered

    ABI v2 (a DpBalanceV2): `num_ranks` is the group's size, dp_size * attn_tp_size, and
    `step` passes `kind` and `extra_tokens` on to `plan` and returns its PlanResult in `plan`.

    Every process must pass payloads of one size and call `step` every step (also with no
    plugin, or a disabled one: the record slot then goes out as zeros, which every plugin that
    reads it rejects, so all ranks fall back together). On a step the plugin plans without an
    exchange (its quiet mode, DPB_QUIET_AFTER: every rank skips the same steps) the engine's
    collective still runs, with a zero record the plugin never reads, unless `own_collective`
    says the collective exists only for the plugin (the vLLM package's gloo all-reduce): then it
    is skipped too, and `step` returns `payloads` None. The record's size is the one the
    plugin's handshake at `init` sent (RECORD_BYTES before any). An exception from `collective`
    is the engine's own failure: `step` re-raises it (the plugin has then fallen back). A request
    that cannot be marshalled raises too, after the engine's sync has run with a zero record,
    so the other ranks never wait for this one. One per process, like DpBalance."""

    def __init__(self, collective: Callable[[bytes], bytes], num_ranks: int,
                 own_collective: bool = False):
        _int_field(num_ranks, "num_ranks", 1, 1 << 20)
        self._collective = collective
        self.num_ranks = num_ranks
        self.own_collective = bool(own_collective)
        self.quiet_steps = 0  # steps whose plan ran without an exchange (own_collective)
        self.record_bytes = RECORD_BYTES
        self._payload: Optional[bytes] = None
        self._payloads: Optional[list] = None
        self._error: Optional[BaseException] = None

    def _gather(self, payload: bytes, record: bytes) -> bytes:
        """Runs the engine's collective on payload + record; keeps the payloads, returns the
        records (rank order)."""
        row = len(payload) + len(record)
        out = self._collective(payload + record)
        if len(out) != row * self.num_ranks:
            raise ValueError(f"dpbalance: the engine's collective returned {len(out)} bytes, "
                             f"expected {self.num_ranks} ranks x {row} (payload {len(payload)} "
                             f"+ record {len(record)})")
        cut = len(payload)
        self._payloads = [out[i * row:i * row + cut] for i in range(self.num_ranks)]
        return b"".join(out[i * row + cut:(i + 1) * row] for i in range(self.num_ranks))

    def __call__(self, send: bytes, _timeout_ms: int) -> bytes:
        """The plugin's all-gather. Outside `step` (init's handshake) the record travels alone;
        all ranks are in init together. The engine's collective sets its own timeout."""
        if self._payload is None:
            self.record_bytes = len(send)
            return self._collective(send)
        try:
            if len(send) != self.record_bytes:
                raise ValueError(f"dpbalance: record of {len(send)} bytes, the handshake sent "
                                 f"{self.record_bytes}")
            return self._gather(self._payload, send)
        except BaseException as e:
            self._error = e
            raise

    def step(self, dpb, requests: Sequence[Request], payload: bytes, kv_free_tokens: int = -1,
             **plan_args) -> StepResult:
        """One step's exchange: plans with `dpb` (a DpBalance, a DpBalanceV2, or None: no
        plugin) and gathers `payload` from every process, in one collective. `plan_args`
        (v2 only): kind, extra_tokens."""
        self._payload, self._payloads, self._error = bytes(payload), None, None
        try:
            lens = depth = plan = None
            if dpb is not None:
                try:
                    if isinstance(dpb, DpBalanceV2):
                        plan = dpb.plan(requests, kv_free_tokens=kv_free_tokens, **plan_args)
                        lens, depth = plan.verify_len, plan.draft_depth
                    else:
                        if plan_args:
                            raise TypeError(f"dpbalance: {sorted(plan_args)} need ABI v2")
                        lens, depth = dpb.plan(requests, kv_free_tokens)
                except Exception:
                    # Raised before the exchange (a value that cannot be marshalled): the peers
                    # are in the engine's sync, so it still runs, with a zero record.
                    if self._payloads is None and self._error is None:
                        self._gather(self._payload, bytes(self.record_bytes))
                    raise
            if self._error is not None:
                raise self._error
            if self._payloads is None:  # the plugin did not exchange (quiet mode, or no plugin)
                if self.own_collective and dpb is not None and lens is not None:
                    self.quiet_steps += 1  # every rank's plugin skipped this step's exchange
                else:
                    self._gather(self._payload, bytes(self.record_bytes))  # the engine's sync
            return StepResult(lens, depth, self._payloads, plan)
        finally:
            self._payload = None


class TorchAllGather:
    """An all-gather over a torch.distributed group (a gloo CPU group, as engines keep for
    their per-step DP metadata), for both ABIs: call it as `(send, timeout_ms) -> bytes`, or
    through `gather_into` (what DpBalanceV2 uses). Each call first gathers every process's
    (send size, receive capacity): when they disagree (ranks on different ABI versions or
    configs, a receive buffer that does not hold the group's records) every process raises the
    same error, naming the process and the value, before any payload moves, so none is left
    waiting in a collective the others skipped. The group's own timeout bounds the call; torch
    has no per-call one, so create the group with the timeout the engine wants (DPB_TIMEOUT_MS
    for a group of its own). After a gloo timeout the group's connections are closed, and every
    later call fails at once on every process."""

    def __init__(self, group=None):
        import torch
        import torch.distributed as dist
        self._torch, self._dist, self.group = torch, dist, group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._mine = torch.zeros(2, dtype=torch.int64)
        self._sizes = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world)]
        self._n = -1

    def _exchange(self, send: bytes, capacity: int) -> list:
        n = len(send)
        self._mine[0], self._mine[1] = n, capacity
        self._dist.all_gather(self._sizes, self._mine, group=self.group)
        sizes = [(int(t[0]), int(t[1])) for t in self._sizes]
        for r, (s, _) in enumerate(sizes):
            if s != sizes[0][0]:
                raise ValueError(
                    f"dpbalance torch_allgather: process {r} of the group sends {s} bytes, "
                    f"process 0 sends {sizes[0][0]} (this is process {self.rank}): ranks on "
                    f"different ABI versions or record sizes")
        for r, (s, c) in enumerate(sizes):
            if c >= 0 and c != self.world * s:
                raise ValueError(
                    f"dpbalance torch_allgather: process {r}'s receive buffer holds {c} bytes, "
                    f"the group of {self.world} processes gathers {self.world} x {s} = "
                    f"{self.world * s} (this is process {self.rank}): a dp_size or attn_tp_size "
                    f"that does not match the group")
        if self._n != n:  # buffers reused across steps
            self._n = n
            self._send = self._torch.empty(n, dtype=self._torch.uint8)
            self._recv = [self._torch.empty(n, dtype=self._torch.uint8) for _ in range(self.world)]
        self._send.copy_(self._torch.frombuffer(bytearray(send), dtype=self._torch.uint8))
        self._dist.all_gather(self._recv, self._send, group=self.group)
        return self._recv

    def __call__(self, send: bytes, _timeout_ms: int) -> bytes:
        return b"".join(t.numpy().tobytes() for t in self._exchange(send, -1))

    def gather_into(self, send: bytes, recv: memoryview, _timeout_ms: int) -> int:
        """Writes every process's `send` into `recv` (group order); returns the bytes written.
        Raises (the adapter returns -1 to the plugin) when the sizes disagree; never writes past
        `recv`."""
        n = len(send)
        parts = self._exchange(send, len(recv))
        for r, t in enumerate(parts):
            recv[r * n:(r + 1) * n] = t.numpy().tobytes()
        return self.world * n


def torch_allgather(group=None) -> TorchAllGather:
    """The all-gather over a torch.distributed group (see TorchAllGather)."""
    return TorchAllGather(group)
