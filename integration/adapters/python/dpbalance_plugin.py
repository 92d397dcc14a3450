"""dpbalance for Python decode engines: the C plugin ABI (v1) through ctypes.

A Python engine (SGLang, vLLM, ...) loads `libdpbalance.so` the way a C++ engine does: by
`DPB_PLUGIN` (a name, file or path; `none` disables), the exported symbol
`dpbalancePlugin_v1`, and `DPB_*` flags (docs/flags.md). This module adds nothing to the
plugin's logic; it only marshals the C structs and lets a Python callable be the all-gather,
so the ranks exchange their summaries over the engine's own CPU group (no second NCCL comm):

    from dpbalance_plugin import DpBalance, Request, Accepted, torch_allgather

    dpb = DpBalance.load(num_ranks=dp_size, rank=dp_rank, config="default_k=3;k_max=7",
                         allgather=torch_allgather(cpu_group))   # None if DPB_PLUGIN=none
    # every decode step, on every DP rank, before the verify forward:
    lens, depth = dpb.plan([Request(rid, ctx, k_min=0, k_cap=min(7, left - 1)) for ...])
    ... draft to `depth`, verify lens[i] drafts of request i, accept ...
    dpb.report(attention_us, step_us, [Accepted(rid, lens[i], accepted_i, finished_i) ...])

Failure contract (the plugin's, kept here): `plan` never raises for a balancing failure. When
the plugin falls back it still fills every verify length with the engine's default
(`DPB_DEFAULT_K`, capped by k_cap) and `plan` returns those; `last_result` says why
(dpbFallback for one step, dpbDisabled for the rest of the run). An all-gather callable that
raises, times out or returns the wrong number of bytes disables balancing on that rank: after a
failed collective the ranks can no longer be known to be in lockstep, so it is not called again.
Only programming errors raise: a bad argument, a library that cannot be loaded, or `init`
refusing the flags (DpBalanceError, naming them).

`Piggyback` carries the exchange on the engine's own per-step DP sync instead of a second
collective, so that it fails on every rank or none (docs/engines.md).

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
import os
import struct
from typing import Callable, NamedTuple, Optional, Sequence

__all__ = ["DpBalance", "DpBalanceError", "Request", "Accepted", "Piggyback", "StepResult",
           "Router", "RankLoad", "RESULT_NAMES", "RECORD_BYTES", "resolve_library",
           "torch_allgather"]

log = logging.getLogger("dpbalance")

SYMBOL = "dpbalancePlugin_v1"
ROUTER_SYMBOL = "dpbalanceRouter_v1"
DEFAULT_LIBRARY = "libdpbalance.so"

# dpbResult_t
SUCCESS, FALLBACK, INVALID_ARGUMENT, INTERNAL_ERROR, DISABLED = range(5)
RESULT_NAMES = {SUCCESS: "dpbSuccess", FALLBACK: "dpbFallback",
                INVALID_ARGUMENT: "dpbInvalidArgument", INTERNAL_ERROR: "dpbInternalError",
                DISABLED: "dpbDisabled"}
# dpbBackend_t
BACKEND_FROM_FLAGS, BACKEND_IN_PROCESS, BACKEND_CALLBACK, BACKEND_NCCL = range(4)
# Bytes of one rank's summary record in ABI v1 (what the all-gather callback exchanges).
RECORD_BYTES = 512


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


# --- what the engine passes --------------------------------------------------------------

class Request(NamedTuple):
    """One request of this rank's batch, this step (dpbRequest_v1_t)."""
    request_id: int
    ctx_tokens: int          # tokens in KV before this step
    k_min: int = 0           # floor on the verify length (e.g. the engine's own SLO rule)
    k_cap: int = 7           # min(draft depth limit, tokens the request may still emit - 1)
    draft_confidence: Optional[Sequence[float]] = None  # per-position confidence, optional


class Accepted(NamedTuple):
    """What a request's verify did this step (dpbAccepted_v1_t). NamedTuples, as Request: a
    plain tuple in field order works too."""
    request_id: int
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


# The records packed straight into the ctypes arrays (native layout, as the structs above; the
# python_adapter test checks both against the compiler's offsets).
_REQUEST_PACK = struct.Struct("@qqiiPi4x")
_ACCEPTED_PACK = struct.Struct("@qiii4x")
_RANK_LOAD_PACK = struct.Struct("@iiqqqq")
_I64, _I32 = (-(1 << 63), (1 << 63) - 1), (-(1 << 31), (1 << 31) - 1)
_REQUEST_FIELDS = [("request_id", _I64), ("ctx_tokens", _I64), ("k_min", _I32), ("k_cap", _I32)]
_ACCEPTED_FIELDS = [("request_id", _I64), ("verify_len", _I32), ("accepted", _I32)]
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


if (_REQUEST_PACK.size, _ACCEPTED_PACK.size, _RANK_LOAD_PACK.size) != (
        ctypes.sizeof(_Request), ctypes.sizeof(_Accepted), ctypes.sizeof(_RankLoad)):
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


class DpBalance(_Closing):
    """One DP rank's balancer, behind the plugin's C ABI. Not thread-safe: one per rank."""

    @classmethod
    def load(cls, num_ranks: int, rank: int, config: str = "", allgather=None,
             library: Optional[str] = None) -> Optional["DpBalance"]:
        """Like the constructor, but returns None when DPB_PLUGIN (or `library`) is `none`."""
        if resolve_library(library) is None:
            log.info("dpbalance: DPB_PLUGIN=none, running without it")
            return None
        return cls(num_ranks, rank, config, allgather, library)

    def __init__(self, num_ranks: int, rank: int, config: str = "",
                 allgather: Optional[Callable[[bytes, int], bytes]] = None,
                 library: Optional[str] = None):
        """`allgather(send: bytes, timeout_ms: int) -> bytes` must return every rank's record
        (num_ranks * len(send) bytes, rank order) and is called on every rank in lockstep.
        Without it the backend comes from the flags (DPB_BACKEND: nccl or inproc)."""
        _int_field(num_ranks, "num_ranks", 1, 1 << 20)
        _int_field(rank, "rank", 0, num_ranks - 1)
        self._lib, self._plugin, path = _load_symbol(library, SYMBOL, _Plugin)
        self.num_ranks, self.rank, self.path = num_ranks, rank, path
        self.name = (self._plugin.name or b"").decode()
        self.last_result = SUCCESS
        self._user_allgather = allgather
        self._callback_error: Optional[BaseException] = None
        # Kept referenced for the context's lifetime: the plugin holds the raw pointer.
        self._cfn = AllGatherFn(self._allgather_trampoline) if allgather else AllGatherFn()
        self._config = (config or "").encode()
        args = _InitArgs(num_ranks=num_ranks, rank=rank, config=self._config,
                         backend=BACKEND_CALLBACK if allgather else BACKEND_FROM_FLAGS,
                         allgather_fn=self._cfn, cuda_device=-1)
        self._ctx = ctypes.c_void_p()
        rc = self._plugin.init(ctypes.byref(args), ctypes.byref(self._ctx))
        if rc != SUCCESS:
            self._ctx = ctypes.c_void_p()
            raise DpBalanceError(
                f"dpbalance: init of rank {rank}/{num_ranks} with config '{config}' returned "
                f"{RESULT_NAMES.get(rc, rc)} (the plugin's log on stderr names the flag or cause)")
        # Buffers reused across steps (grown on demand): no allocation per step in steady state.
        self._cap = self._acc_cap = 0
        self._grow(16)
        self._grow_accepted(16)
        self._depth = ctypes.c_int32(0)

    # The plugin calls this from inside plan(), on this rank's thread.
    def _allgather_trampoline(self, _user, send, recv, record_bytes, timeout_ms) -> int:
        try:
            out = self._user_allgather(ctypes.string_at(send, record_bytes), int(timeout_ms))
            want = record_bytes * self.num_ranks
            if len(out) != want:
                raise ValueError(f"all-gather returned {len(out)} bytes, expected {want} "
                                 f"({self.num_ranks} ranks x {record_bytes})")
            ctypes.memmove(recv, bytes(out), want)
            return 0
        except BaseException as e:  # never let an exception unwind through C
            self._callback_error = e
            return 1

    def _grow(self, n: int) -> None:
        if n > self._cap:
            self._cap = max(n, 2 * self._cap, 16)
            self._reqs, self._reqs_view = _records(_Request, self._cap)
            self._lens = (ctypes.c_int32 * self._cap)()

    def _grow_accepted(self, n: int) -> None:
        if n > self._acc_cap:
            self._acc_cap = max(n, 2 * self._acc_cap, 16)
            self._acc, self._acc_view = _records(_Accepted, self._acc_cap)

    def plan(self, requests: Sequence[Request], kv_free_tokens: int = -1):
        """Returns (verify lengths in request order, draft depth). Call on every rank each step.

        `kv_free_tokens`: KV tokens left for extra verify tokens on this rank (< 0: no limit).
        Values the plugin rejects (a negative context, say) give this step the default lengths
        and a log line naming the value, like any other failure; only values that cannot be
        marshalled into the C struct at all (not an integer, out of the C type's range) raise."""
        if not self._ctx:
            raise DpBalanceError("dpbalance: plan() after close()")
        n = len(requests)
        self._grow(n)
        buf, pack, size = self._reqs_view, _REQUEST_PACK.pack_into, _REQUEST_PACK.size
        conf = []  # keeps confidence arrays alive through the call
        try:
            for i, r in enumerate(requests):
                c = r.draft_confidence
                if c:
                    arr = (ctypes.c_float * len(c))(*c)
                    conf.append(arr)
                    pack(buf, i * size, r.request_id, r.ctx_tokens, r.k_min, r.k_cap,
                         ctypes.addressof(arr), len(c))
                else:
                    pack(buf, i * size, r.request_id, r.ctx_tokens, r.k_min, r.k_cap, 0, 0)
        except (struct.error, TypeError, AttributeError):
            _name_the_bad_field(requests, "requests", _REQUEST_FIELDS)
            raise
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
        self._grow_accepted(n)
        buf, pack, size = self._acc_view, _ACCEPTED_PACK.pack_into, _ACCEPTED_PACK.size
        try:
            for i, a in enumerate(accepted):
                pack(buf, i * size, a.request_id, a.verify_len, a.accepted, 1 if a.finished else 0)
        except (struct.error, TypeError, AttributeError):
            _name_the_bad_field(accepted, "accepted", _ACCEPTED_FIELDS)
            raise
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

    def close(self) -> None:
        if self._ctx:
            self._plugin.finalize(self._ctx)
            self._ctx = ctypes.c_void_p()


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
    strings: every rank's payload concatenated in rank order. Pass the object as the plugin's
    all-gather, then call `step` where the engine runs its exchange:

        pb = Piggyback(my_collective, dp_size)
        dpb = DpBalance.load(dp_size, dp_rank, config, allgather=pb)   # may be None
        res = pb.step(dpb, requests, my_payload)  # res.payloads: what the engine gathered

    Every rank must pass payloads of one size and call `step` every step (also with no plugin,
    or a disabled one: the record slot then goes out as zeros, which every plugin that reads
    it rejects, so all ranks fall back together). An exception from `collective` is the
    engine's own failure: `step` re-raises it (the plugin has then disabled itself). A request
    that cannot be marshalled raises too, after the engine's sync has run with a zero record,
    so the other ranks never wait for this one. One per rank, like DpBalance."""

    def __init__(self, collective: Callable[[bytes], bytes], num_ranks: int):
        _int_field(num_ranks, "num_ranks", 1, 1 << 20)
        self._collective = collective
        self.num_ranks = num_ranks
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
            return self._collective(send)
        try:
            if len(send) != RECORD_BYTES:
                raise ValueError(f"dpbalance: record of {len(send)} bytes, ABI v1 has "
                                 f"{RECORD_BYTES}")
            return self._gather(self._payload, send)
        except BaseException as e:
            self._error = e
            raise

    def step(self, dpb: Optional["DpBalance"], requests: Sequence[Request], payload: bytes,
             kv_free_tokens: int = -1) -> StepResult:
        """One decode step's exchange: plans with `dpb` (None: no plugin) and gathers
        `payload` from every rank, in one collective."""
        self._payload, self._payloads, self._error = bytes(payload), None, None
        try:
            lens = depth = None
            if dpb is not None:
                try:
                    lens, depth = dpb.plan(requests, kv_free_tokens)
                except Exception:
                    # Raised before the exchange (a value that cannot be marshalled): the peers
                    # are in the engine's sync, so it still runs, with a zero record.
                    if self._payloads is None and self._error is None:
                        self._gather(self._payload, bytes(RECORD_BYTES))
                    raise
            if self._error is not None:
                raise self._error
            if self._payloads is None:  # the plugin did not exchange: the engine's sync still runs
                self._gather(self._payload, bytes(RECORD_BYTES))
            return StepResult(lens, depth, self._payloads)
        finally:
            self._payload = None


def torch_allgather(group=None) -> Callable[[bytes, int], bytes]:
    """An all-gather over a torch.distributed group (a gloo CPU group, as engines keep for
    their per-step DP metadata). The group's own timeout bounds the call; torch has no per-call
    one, so create the group with a timeout that suits the engine."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    box = {}

    def allgather(send: bytes, _timeout_ms: int) -> bytes:
        n = len(send)
        if box.get("n") != n:  # buffers reused across steps
            box["n"] = n
            box["send"] = torch.empty(n, dtype=torch.uint8)
            box["recv"] = [torch.empty(n, dtype=torch.uint8) for _ in range(world)]
        box["send"].copy_(torch.frombuffer(bytearray(send), dtype=torch.uint8))
        dist.all_gather(box["recv"], box["send"], group=group)
        return b"".join(t.numpy().tobytes() for t in box["recv"])

    return allgather
