"""dpbalance's request routing in vLLM's DP load balancer.

`DPB_ROUTING=A|B|C|D|E` routes every new request that names no DP rank with the Router ABI
(dpbalance_router_v1.h: the strategies of docs/design.md "Routing", the same code the replay
runs; DPB_Z, DPB_GROUPS and the other routing flags as in docs/flags.md). Unset (or `vllm`):
vLLM's own rule. It needs DPB_PLUGIN (the library) and, for loads as fresh as the last engine
step, `--scheduler-cls dpbalance_vllm.scheduler.DpbScheduler`.

vLLM 0.32.0 routes in the process that owns the engine client (the API server, or AsyncLLM's):
`DPLBAsyncMPClient.get_core_engine_for_request` (vllm/v1/engine/core_client.py) scores each
engine by max(its in-flight count, the coordinator's waiting + running) plus a KV-pressure term,
from snapshots the DP coordinator publishes about every 100 ms. vLLM documents no extension point
for it, so this module wraps that method (and `process_engine_outputs`, for E's mean output
length) on the class, in every process that loads the plugin: the narrowest patch, no file of
vLLM's changed. A request with `data_parallel_rank` set, or a streaming-input session's later
chunk, keeps vLLM's path. The wrapper lets vLLM's own method do its bookkeeping (the in-flight
maps aborts and its own counts read) with the chosen rank as the request's rank, then clears it.

The loads. Each engine core's DpbScheduler writes its rank's load after every `schedule()` (and
once more after the step's output, its finished requests gone) into a shared-memory board
(`LoadBoard`, one 128-byte slot a rank, a sequence lock): its requests (running and waiting),
their contexts summed and the longest, the KV they reserve (contexts plus the outputs still to
come), its KV capacity, the count of requests it has been handed, the step index and time. At routing time a rank's load is its last record plus the requests this client
routed to it that the record has not yet counted (routed after it: exact while one client
routes). The board is a file under /dev/shm named by `DPBALANCE_VLLM_LOADS`, which the first
process to load the plugin sets and the engine cores inherit; engine cores on another node
(multi-node DP) do not see it, and their ranks are routed on this client's own counts (its
in-flight requests, their prompts and outputs so far), which the log marks `age_steps: null`.

`DPBALANCE_VLLM_ROUTE_LOG=FILE` logs every routing decision (either rule) as one JSON line:
the request, the rank, who chose it (`dpbalance`, `vllm`, `pinned`: a rank named by the request,
`fallback`: dpbalance had no rank for it), the loads the router saw ([requests, context tokens,
longest context, reserved KV, KV capacity, batch cap] a rank) and how old each rank's record was in
steps and milliseconds; each engine core appends the ids it was handed to FILE.dpN.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import time
from typing import Optional

log = logging.getLogger("vllm.dpbalance")

STRATEGIES = ("A", "B", "C", "D", "E")
BOARD_ENV = "DPBALANCE_VLLM_LOADS"
LOG_ENV = "DPBALANCE_VLLM_ROUTE_LOG"

# One rank's slot: sequence (odd while written), step index, time (CLOCK_MONOTONIC ns), mean
# step interval (ns), requests, batch cap, context sum, longest context, reserved KV, KV
# capacity (tokens), requests handed to the rank so far.
_SLOT = struct.Struct("<QQqqiiqqqqQ")
SLOT_BYTES = 128
# A record older than this many seconds is not a load (the rank stopped stepping: idle, or gone).
STALE_S = 2.0


def strategy() -> Optional[str]:
    """DPB_ROUTING as this package reads it: a strategy letter, or None for vLLM's rule. Any
    other value raises: the message names it and where it came from."""
    raw = os.environ.get("DPB_ROUTING")
    if raw is None or raw.strip().lower() in ("", "vllm", "off"):
        return None
    v = raw.strip().upper()
    if v not in STRATEGIES:
        raise RuntimeError(f"dpbalance_vllm: DPB_ROUTING={raw!r} (environment) is not one of "
                           f"A, B, C, D, E, or vllm/off for vLLM's own routing")
    return v


def active() -> bool:
    """Whether this package takes part in routing at all: routing by DPB_ROUTING, or only the
    log of vLLM's own decisions."""
    return strategy() is not None or bool(os.environ.get(LOG_ENV))


class LoadBoard:
    """The per-rank load records in shared memory: written by each rank's scheduler, read by the
    router. Readers never block a writer; a torn read is retried, then treated as no record."""

    def __init__(self, path: str, dp_size: int, create: bool):
        self.path, self.dp_size = path, dp_size
        size = SLOT_BYTES * dp_size
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # every rank asks for the same size: no rank shrinks it
            if os.fstat(fd).st_size < size:
                raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {size}")
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._seq = [0] * dp_size
        self._last_ns = [0] * dp_size
        self._interval_ns = [0.0] * dp_size

    def write(self, rank: int, step: int, num_requests: int, max_requests: int, ctx: int,
              max_ctx: int, reserved: int, capacity: int, handed: int, tick: bool = True) -> None:
        """One record; `tick`: a new step (the mean step interval learns from it), else the same
        step's record after its output (finished requests gone), stamped now."""
        now = time.monotonic_ns()
        if tick and self._last_ns[rank]:
            gap = now - self._last_ns[rank]
            iv = self._interval_ns[rank]
            self._interval_ns[rank] = gap if iv == 0 else 0.9 * iv + 0.1 * gap
        if tick:
            self._last_ns[rank] = now
        off = rank * SLOT_BYTES
        seq = self._seq[rank] + 1
        struct.pack_into("<Q", self._mm, off, seq)  # odd: being written
        _SLOT.pack_into(self._mm, off, seq, step, now, int(self._interval_ns[rank]), num_requests,
                        max_requests, ctx, max_ctx, reserved, capacity, handed)
        self._seq[rank] = seq + 1
        struct.pack_into("<Q", self._mm, off, seq + 1)

    def read(self, rank: int) -> Optional[dict]:
        off = rank * SLOT_BYTES
        for _ in range(3):
            v = _SLOT.unpack_from(self._mm, off)
            if v[0] == 0 or v[0] & 1 or struct.unpack_from("<Q", self._mm, off)[0] != v[0]:
                continue
            return dict(step=v[1], t_ns=v[2], interval_ns=v[3], num_requests=v[4],
                        max_requests=v[5], ctx=v[6], max_ctx=v[7], reserved=v[8], capacity=v[9],
                        handed=v[10])
        return None

    def close(self) -> None:
        self._mm.close()


def board_path() -> str:
    """The board's file: DPBALANCE_VLLM_LOADS, set here (and so inherited by the engine cores
    this process starts) when unset."""
    path = os.environ.get(BOARD_ENV)
    if not path:
        path = f"/dev/shm/dpbalance-loads-{os.getpid()}-{time.monotonic_ns() & 0xffffff:x}"
        os.environ[BOARD_ENV] = path
        import atexit

        def remove() -> None:  # the process that named the board outlives its engine cores
            try:
                os.unlink(path)
            except OSError:
                pass
        atexit.register(remove)
    return path


class RankWriter:
    """The engine core's side (DpbScheduler): this rank's load after every schedule()."""

    def __init__(self, dp_rank: int, dp_size: int):
        self.dp_rank, self.handed, self.steps = dp_rank, 0, 0
        self._board: Optional[LoadBoard] = None
        self._ids = None
        path = os.environ.get(BOARD_ENV)
        if path and dp_size > 1:
            try:
                self._board = LoadBoard(path, dp_size, create=True)
            except OSError as e:
                log.warning("dpbalance_vllm: DP rank %d cannot write the routing loads board %s: "
                            "%s; the router routes it on its own counts", dp_rank, path, e)
        log_path = os.environ.get(LOG_ENV)
        if log_path:
            self._ids = open(f"{log_path}.dp{dp_rank}", "a", buffering=1)

    def added(self, request_id: str) -> None:
        self.handed += 1
        if self._ids is not None:
            self._ids.write(json.dumps({"id": request_id, "rank": self.dp_rank,
                                        "t": round(time.time(), 4)}) + "\n")

    def publish(self, scheduler, tick: bool = True) -> None:
        """This rank's load: after schedule() (`tick`, a step), and after update_from_output()
        (the step's finished requests gone). Without the second, a rank whose last requests
        finished kept a busy record until it next scheduled, which the router drops as stale
        after STALE_S: it then routed that idle rank on its own counts."""
        if self._board is None:
            return
        if tick:
            self.steps += 1
        n = ctx = longest = reserved = 0
        for queue in (scheduler.running, scheduler.waiting):
            for r in queue:
                tokens = int(r.num_tokens)
                left = (int(r.max_tokens) - int(r.num_output_tokens)
                        if r.max_tokens is not None else 0)
                n += 1
                ctx += tokens
                longest = max(longest, tokens)
                reserved += tokens + max(0, left)
        blocks = scheduler.cache_config.num_gpu_blocks or 0
        self._board.write(self.dp_rank, self.steps, n, int(scheduler.max_num_running_reqs), ctx,
                          longest, reserved, int(blocks) * int(scheduler.block_size), self.handed,
                          tick=tick)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None
        if self._ids is not None:
            self._ids.close()
            self._ids = None


class ClientRouting:
    """The client's side: one per DPLBAsyncMPClient (vLLM routes on its event loop's thread)."""

    def __init__(self, client, letter: Optional[str]):
        from . import engine_plan  # the bundled adapter and library resolution

        self.num_ranks = len(client.core_engines)
        self.letter = letter
        self.router = None
        if letter is not None:
            try:
                self.router = engine_plan.adapter.Router(self.num_ranks,
                                                         library=engine_plan.library_path())
            except (engine_plan.adapter.DpBalanceError, OSError) as e:
                # install() checked the library and the flags; what is left (DPB_GROUPS above
                # this instance's ranks) routes by vLLM's rule, said once.
                log.error("dpbalance_vllm: DPB_ROUTING=%s: no router for %d ranks (%s); routing "
                          "by vLLM's rule", letter, self.num_ranks, e)
        sched = client.vllm_config.scheduler_config
        self.max_requests = int(getattr(sched, "max_num_seqs", 0) or 0)
        self.board: Optional[LoadBoard] = None
        self._board_path = os.environ.get(BOARD_ENV)
        # Requests this client routed: id -> [rank, input, max output, tokens out so far].
        self.inflight: dict = {}
        # Per rank: the requests routed to it, and the (input, output) of those no record has
        # counted yet, oldest first.
        self.routed = [0] * self.num_ranks
        self.unseen: list = [[] for _ in range(self.num_ranks)]
        log_path = os.environ.get(LOG_ENV)
        self._log = open(log_path, "a", buffering=1) if log_path else None
        self.refused = 0  # requests the router refused (ValueError): the first is logged

    def _board(self) -> Optional[LoadBoard]:
        if self.board is None and self._board_path:
            try:
                self.board = LoadBoard(self._board_path, self.num_ranks, create=False)
            except OSError:
                return None  # not written yet (no engine stepped), or another node's ranks
        return self.board

    def loads(self):
        """Per rank: (RankLoad, age in steps or None, age in ms or None)."""
        from . import engine_plan

        board, now = self._board(), time.monotonic_ns()
        recs = [board.read(r) if board is not None else None for r in range(self.num_ranks)]
        # The ranks of a DP instance step together (an idle rank runs vLLM's dummy batch), so a
        # rank that has not yet timed two steps of its own is aged by the others' interval.
        step_ns = max((x["interval_ns"] for x in recs if x is not None), default=0)
        out = []
        for r in range(self.num_ranks):
            rec = recs[r]
            if rec is not None and (now - rec["t_ns"]) > STALE_S * 1e9 and rec["num_requests"]:
                rec = None  # a busy rank that stopped writing: its record says nothing now
            if rec is not None:
                unseen = self.unseen[r]
                # Requests the record has counted leave the list (the rank counts all it was
                # handed; those routed by another client make this list shorter, not wrong).
                drop = max(0, len(unseen) - max(0, self.routed[r] - rec["handed"]))
                del unseen[:drop]
                n, ctx = rec["num_requests"], rec["ctx"]
                longest, reserved = rec["max_ctx"], rec["reserved"]
                for inp, outp in unseen:
                    n += 1
                    ctx += inp
                    longest = max(longest, inp)
                    reserved += inp + outp
                age_ms = (now - rec["t_ns"]) / 1e6
                iv = rec["interval_ns"] or step_ns
                age_steps = (now - rec["t_ns"]) / iv if iv else None
                load = engine_plan.adapter.RankLoad(n, ctx, reserved, rec["capacity"] or (1 << 50),
                                                    rec["max_requests"], longest)
            else:  # this client's own count of what it sent the rank
                mine = [v for v in self.inflight.values() if v[0] == r]
                ctx = sum(v[1] + v[3] for v in mine)
                load = engine_plan.adapter.RankLoad(
                    len(mine), ctx, sum(v[1] + v[2] for v in mine), 1 << 50, self.max_requests,
                    max((v[1] + v[3] for v in mine), default=0))
                age_steps = age_ms = None
            out.append((load, age_steps, age_ms))
        return out

    def sent(self, request_id: str, rank: int, inp: int, outp: int) -> None:
        self.inflight[request_id] = [rank, inp, outp, 0]
        self.routed[rank] += 1
        self.unseen[rank].append((inp, outp))
        if len(self.unseen[rank]) > 4096:  # a rank that never writes its record
            del self.unseen[rank][:2048]

    def outputs(self, outputs) -> None:
        for o in getattr(outputs, "outputs", None) or ():
            v = self.inflight.get(o.request_id)
            if v is None:
                continue
            v[3] += len(o.new_token_ids)
            if o.finish_reason is not None:
                del self.inflight[o.request_id]
                if self.router is not None:
                    self.router.observe_finished(v[3])
        for rid in getattr(outputs, "finished_requests", None) or ():
            self.inflight.pop(rid, None)  # aborted

    def record(self, request, rank: int, by: str, inp: int, outp: int, loads) -> None:
        if self._log is None:
            return
        self._log.write(json.dumps({
            "t": round(time.time(), 4), "id": request.request_id, "rank": rank, "by": by,
            "in": inp, "out": outp,
            "loads": None if loads is None else [
                [l.num_requests, l.ctx_tokens, l.max_ctx_tokens, l.reserved_tokens,
                 l.capacity_tokens, l.max_requests] for l, _, _ in loads],
            "age_steps": None if loads is None else [
                None if a is None else round(a, 2) for _, a, _ in loads],
            "age_ms": None if loads is None else [
                None if a is None else round(a, 2) for _, _, a in loads]}) + "\n")


def _lengths(request) -> tuple:
    inp = len(request.prompt_token_ids) if request.prompt_token_ids is not None else (
        int(request.prompt_embeds.shape[0]) if request.prompt_embeds is not None else 0)
    sp = request.sampling_params
    outp = int(sp.max_tokens) if sp is not None and sp.max_tokens is not None else 0
    return inp, outp


INSTALLED = False


def install() -> None:
    """Wraps vLLM's DP load balancer's routing (see the module's docstring). Called by the
    plugin's register() in every vLLM process when DPB_ROUTING or the route log is set; a bad
    DPB_ROUTING raises here, so vLLM stops at start-up with the value named."""
    global INSTALLED
    letter = strategy()
    if INSTALLED:
        return
    # vLLM first: its torch must load its own NCCL before the dpbalance library brings the
    # system's (in vLLM's processes torch is imported long before the plugins load anyway).
    from vllm.v1.engine import core_client

    if letter is not None:
        from . import engine_plan

        lib = engine_plan.library_path()
        if lib is None:
            raise RuntimeError(f"dpbalance_vllm: DPB_ROUTING={letter} (environment) needs the "
                               f"dpbalance library: set DPB_PLUGIN=dpbalance (it is unset or none)")
        try:  # the flags, on as many ranks as any group setting allows
            engine_plan.adapter.Router(1 << 16, library=lib).close()
        except engine_plan.adapter.DpBalanceError as e:
            raise RuntimeError(f"dpbalance_vllm: DPB_ROUTING={letter}: the router refuses its "
                               f"flags: {e}") from e
    board_path()

    cls = core_client.DPLBAsyncMPClient
    own_route = cls.get_core_engine_for_request
    own_outputs = cls.process_engine_outputs  # a staticmethod: the function itself

    def state(self) -> ClientRouting:
        st = self.__dict__.get("_dpb_routing")
        if st is None:
            st = self.__dict__["_dpb_routing"] = ClientRouting(self, strategy())
            log.warning("dpbalance_vllm: routing %s over %d DP ranks (pid %d)",
                        st.letter or "by vLLM's rule (logged)", st.num_ranks, os.getpid())
        return st

    def get_core_engine_for_request(self, request):
        try:
            return routed(self, request)
        except Exception as e:  # noqa: BLE001  (ours failed: vLLM's rule, said once per client)
            request.data_parallel_rank = None
            if not self.__dict__.get("_dpb_routing_failed"):
                self.__dict__["_dpb_routing_failed"] = True
                log.exception("dpbalance_vllm: routing failed (%s); vLLM's rule for this request "
                              "and any other that fails", e)
            if request.request_id in self.reqs_in_flight:
                return self.reqs_in_flight[request.request_id]
            return own_route(self, request)

    def routed(self, request):
        st = state(self)
        inp, outp = _lengths(request)
        if (request.data_parallel_rank is not None or request.request_id in self.reqs_in_flight
                or request.pooling_params is not None):
            engine = own_route(self, request)  # pinned, a session's later chunk, or pooling
            rank = self.core_engines.index(engine)
            st.record(request, rank, "pinned", inp, outp, None)
            if request.request_id not in st.inflight:
                st.sent(request.request_id, rank, inp, outp)
            return engine
        loads = st.loads() if (st.router is not None or st._log is not None) else None
        rank, by = None, "vllm"
        if st.router is not None:
            try:
                rank = st.router.route([l for l, _, _ in loads], inp, outp)
                by = "dpbalance" if rank is not None else "fallback"
            except ValueError as e:  # input the router refused: vLLM's rule (logged once)
                if st.refused == 0:
                    log.error("dpbalance_vllm: %s; routing by vLLM's rule", e)
                st.refused += 1
                by = "fallback"
        if rank is None:
            engine = own_route(self, request)
            rank = self.core_engines.index(engine)
        else:
            request.data_parallel_rank = rank
            try:
                engine = own_route(self, request)  # vLLM's bookkeeping for the chosen rank
            finally:
                request.data_parallel_rank = None
        st.sent(request.request_id, rank, inp, outp)
        st.record(request, rank, by, inp, outp, loads)
        return engine

    async def process_engine_outputs(self, outputs):
        st = self.__dict__.get("_dpb_routing")
        if st is not None:
            st.outputs(outputs)
        await own_outputs(self, outputs)

    cls.get_core_engine_for_request = get_core_engine_for_request
    cls.process_engine_outputs = staticmethod(process_engine_outputs)
    INSTALLED = True
