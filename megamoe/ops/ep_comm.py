"""Host launchers of the expert-parallel protocol: validate, allocate, pick grids, launch.

Legend: W EP world size, E global experts, L = E / W local experts, T tokens of this rank, K top-k,
D hidden, C receive capacity in rows per round, R rows received by this rank, N = T*K, n_r rows of round r.

One *exchange* moves the rows of one MoE call to the experts' ranks and the results back:

1. :func:`publish` (owner): stage token rows (and, backward, output-gradient rows and weights) in the
   pool, build the expert-sorted routing plan on the device, advance the epoch, signal "ready" to all.
2. :func:`build_schedule` (destination): wait for every source's "ready", derive the receive schedule and
   cut it into rounds of at most C rows at expert boundaries (an expert is cut only when it alone has more
   than C rows; kernels/ep_comm.py).
3. per round r < ``rounds``: :func:`dispatch_round` pulls the round's n_r receive rows from the owners, the
   caller runs the expert GEMMs on them, and the results reach the owners' (token, slot) slots either from
   the GEMM's epilogue (:func:`push_target`, the default) or by :func:`push_round`'s copy; rounds the
   routing did not need exit at once (no host sync decides how many run).
4. :func:`signal_done` (destination) then :func:`wait_done` (owner); the owner then reduces its slots
   with the single-GPU fixed-order kernels (``combine_fwd`` / ``slot_sum_bwd``) through
   :func:`slot_views`.

Nothing here synchronises with the host; all waits are bounded device spins (see kernels/ep_comm.py).
Tile sizes are constants (not autotuned), so results do not depend on timing.
"""

from __future__ import annotations

import torch
import triton

from ..config import EPOptions
from ..distributed import FLAG_READY, P_MAX, EPWorkspace
from ..kernels import ep_comm as K_
from ..validation import interpreter_active
from .ep_tiles import RowPull, RowPush
from .routing import PoolPlan, build_routing_plan

__all__ = ["ExchangeBuffers", "expert_offsets", "round_starts", "publish", "routing_plan", "save_plan", "restore_plan",
           "build_schedule", "dispatch_round", "push_round", "signal_done", "wait_done", "slot_views", "sched_size",
           "push_target", "fused_push", "shared_expert_stream", "pull_beside"]

# rows per program, columns per copy step, warps of the dispatch (pull) and push kernels; combine's rows per
# program. Copies only: these never change bits. Copy shapes from 8 to 32 rows x 256 to 1024 columns, 4 or 8
# warps, are equal within the run-to-run spread (H200 x2, T=4096 per rank, interleaved rounds: pull
# 0.79-0.84 ms deepseek-v3, 0.67-0.71 ms mok-bench; scripts/comm_bench.py --sweep, 2026-11-30, log in git
# history: git log -- benchmarks/results/2026-11-30-s4). A first, non-interleaved sweep had shown 32 rows
# 13-22% faster than 16; that was the order of measurement, not the shape.
_BM, _BD, _NW, _BT = 32, 256, 4, 16
# columns per copy step and warps of the pull beside a GEMM (pull_beside): its few programs each need more bytes
# in flight than the full grid's: 32 x 256 with 4 warps moved ~15 GB/s per program (H200, W = 1, deepseek-v3
# M = 8192: 8 programs took ~8 ms per pass), latency-bound
_BD_BESIDE, _NW_BESIDE = 1024, 16


def _pow2(n: int, lo: int = 2) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def _wait_args(timeout_s: float, device: torch.device) -> tuple[int, int, bool]:
    """(max_iters, timeout_ns, use_timer): GPU waits read %globaltimer; the interpreter counts spins."""
    if not (timeout_s > 0):
        raise ValueError(f"megamoe EP: timeout_s must be > 0, got {timeout_s!r}")
    use_timer = device.type == "cuda" and not interpreter_active()
    max_iters = min(2**31 - 1, int(timeout_s * 3_000)) if not use_timer else 2**31 - 1
    return max_iters, int(timeout_s * 1e9), use_timer


def sched_size(num_experts: int, local_experts: int, rounds: int) -> int:
    """int32 entries of the schedule table (kernels/ep_comm.py): header, segments, expert offsets, rounds."""
    return K_.SCHED_SEG + 3 * num_experts + local_experts + 1 + rounds + 1


class ExchangeBuffers:
    """Local (non-symmetric) buffers of one exchange on the destination side, sized by capacity C.

    sched: int32 schedule table of ``rounds`` rounds; rowtab_3C: int32 [3, C] (source, token, slot) of the
    round's rows; roff_L1: int32 [L + 1] round-local expert offsets; xr_CD: received x rows (``xr_CD`` given:
    that (C, D) tensor, e.g. the forward's round-0 rows kept for the backward, instead of a new one); backward
    only: gr_CD received output-gradient rows, wr_C fp32 routing weight of each row.
    """

    def __init__(self, ws: EPWorkspace, capacity_rows: int, backward: bool, *, rounds: int,
                 xr_CD: torch.Tensor | None = None):
        s = ws.spec
        L, dev = s.num_experts // s.world, ws.device
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"megamoe EP: rounds must be an int >= 1, got {rounds!r}")
        self.C = capacity_rows
        self.rounds = rounds
        self.sched = torch.zeros(sched_size(s.num_experts, L, rounds), dtype=torch.int32, device=dev)
        self.rowtab_3C = torch.empty(3, capacity_rows, dtype=torch.int32, device=dev)
        self.roff_L1 = torch.zeros(L + 1, dtype=torch.int32, device=dev)
        if xr_CD is not None and (xr_CD.shape != (capacity_rows, s.hidden) or xr_CD.dtype != s.dtype
                                  or xr_CD.device != dev or not xr_CD.is_contiguous()):
            raise ValueError(f"megamoe EP: kept x rows of shape {tuple(xr_CD.shape)}, {xr_CD.dtype} on {xr_CD.device} "
                             f"do not fit C={capacity_rows} rows of D={s.hidden}, {s.dtype} on {dev}")
        self.xr_CD = torch.empty(capacity_rows, s.hidden, dtype=s.dtype, device=dev) if xr_CD is None else xr_CD
        self.gr_CD = torch.empty(capacity_rows, s.hidden, dtype=s.dtype, device=dev) if backward else self.xr_CD
        self.wr_C = torch.empty(capacity_rows if backward else 1, dtype=torch.float32, device=dev)


def expert_offsets(ws: EPWorkspace, bufs: ExchangeBuffers) -> torch.Tensor:
    """int32 [L + 1] view of ``bufs.sched``: local expert l's rows are ``[off[l], off[l+1])`` of the whole receive
    order (all rounds). Valid after :func:`build_schedule`."""
    s = ws.spec
    L = s.num_experts // s.world
    start = K_.SCHED_SEG + 3 * s.num_experts
    return bufs.sched[start:start + L + 1]


def round_starts(ws: EPWorkspace, bufs: ExchangeBuffers) -> torch.Tensor:
    """int32 [rounds + 1] view of ``bufs.sched``: round r holds rows ``[rs[r], rs[r+1])`` of the whole receive
    order (at most C; ``rs[rounds]`` = R unless the rows overflowed the launched rounds, an error the schedule
    reports). Valid after :func:`build_schedule`."""
    s = ws.spec
    start = K_.SCHED_SEG + 3 * s.num_experts + s.num_experts // s.world + 1
    return bufs.sched[start:start + bufs.rounds + 1]


def publish(ws: EPWorkspace, topk_ids_TK: torch.Tensor, x_TD: torch.Tensor, dout_TD: torch.Tensor | None = None,
            topk_weights_TK: torch.Tensor | None = None, saved_plan: tuple | None = None) -> None:
    """Owner: stage rows (+ backward extras), build the plan (or restore ``saved_plan``, what :func:`save_plan`
    kept of an earlier exchange with the same ids), advance the epoch, signal "ready"."""
    s = ws.spec
    T, K = topk_ids_TK.shape
    _check_tokens(ws, T)
    if T:
        ws.rows_2TD[0, :T].copy_(x_TD)
        if dout_TD is not None:
            ws.rows_2TD[1, :T].copy_(dout_TD)
        if topk_weights_TK is not None:
            ws.weights_N[:T * K].copy_(topk_weights_TK.reshape(-1))
    if saved_plan is None:
        routing_plan(ws, topk_ids_TK)
    else:
        restore_plan(ws, saved_plan, T, K)
    K_.ep_signal_kernel[(1,)](ws.ptrs_W, ws.flags, ws.rank, WORD0=FLAG_READY, W=s.world, BUMP=True, num_warps=1,
                              enable_fp_fusion=True)


def _check_tokens(ws: EPWorkspace, T: int) -> None:
    if T > ws.spec.max_tokens:
        raise ValueError(f"megamoe EP: T={T} tokens exceeds the workspace's max_tokens={ws.spec.max_tokens} "
                         "(megamoe.distributed.reserve_workspace)")


def routing_plan(ws: EPWorkspace, topk_ids_TK: torch.Tensor) -> None:
    """Owner: write this rank's routing plan into its pool, for peers to read in :func:`build_schedule`.

    topk_ids_TK: (T, K) int32 / int64 expert ids, T <= the workspace's max_tokens (ValueError otherwise).
    Writes ``ws.sorted_N[:T*K]`` (int32 flat rows ``t*K + k`` in (expert, token, slot) order) and
    ``ws.plan`` (``[0]`` = T, ``[4 + e]`` = rows with id e) through the one routing-plan builder
    (:func:`megamoe.ops.routing.build_routing_plan` with the pool's views); an id outside [0, E) sets the
    bad-id status (stage 3), which ``EPWorkspace.check`` raises. No host sync.
    """
    _check_tokens(ws, topk_ids_TK.shape[0])
    build_routing_plan(topk_ids_TK, ws.spec.num_experts, pool=PoolPlan(ws.plan, ws.sorted_N, ws.flags, ws.rank))


def save_plan(ws: EPWorkspace, T: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of this rank's routing plan as :func:`routing_plan` left it (``plan`` header [4 + E] and the
    sorted rows [T*K], int32, T*K*4 + (4 + E)*4 bytes): the forward keeps them so that the backward, whose ids
    are the same, restores them instead of rebuilding the plan (another MoE layer's exchange may have
    overwritten the pool in between). Two device copies, no sync."""
    return ws.plan.clone(), ws.sorted_N[:T * K].clone()


def restore_plan(ws: EPWorkspace, saved: tuple[torch.Tensor, torch.Tensor], T: int, K: int) -> None:
    """Write a :func:`save_plan` copy back into the pool. ValueError if it is not one for T*K rows of this
    workspace (a mismatch would route rows wrongly, so it is checked on the host: shapes only, no sync)."""
    plan, sorted_N = saved
    if plan.shape != ws.plan.shape or sorted_N.shape != (T * K,) or plan.device != ws.device:
        raise ValueError(f"megamoe EP: saved routing plan of shapes {tuple(plan.shape)} / {tuple(sorted_N.shape)} "
                         f"does not fit T*K = {T * K} rows of this workspace (plan {tuple(ws.plan.shape)})")
    ws.plan.copy_(plan)
    ws.sorted_N[:T * K].copy_(sorted_N)


def build_schedule(ws: EPWorkspace, bufs: ExchangeBuffers, timeout_s: float) -> None:
    """Destination: wait for all plans (bounded) and build ``bufs.sched`` with its ``bufs.rounds`` rounds
    (kernels/ep_comm.py)."""
    s = ws.spec
    L = s.num_experts // s.world
    max_iters, timeout_ns, use_timer = _wait_args(timeout_s, ws.device)
    K_.ep_schedule_kernel[(1,)](ws.ptrs_W, ws.flags, bufs.sched, ws.rank, L, bufs.C, bufs.rounds, max_iters,
                                timeout_ns, ws.offsets["plan"], READY=FLAG_READY, W=s.world, E=s.num_experts,
                                W_PAD=_pow2(s.world), E_PAD=_pow2(s.num_experts), L_PAD=_pow2(L + 1),
                                USE_TIMER=use_timer, num_warps=4, enable_fp_fusion=True)


def dispatch_round(ws: EPWorkspace, bufs: ExchangeBuffers, r: int, backward: bool, pull_x: bool = True) -> None:
    """Pull round r's rows into ``bufs.xr_CD`` (backward: also output-gradient rows and weights; ``pull_x``
    False, backward only: not the x rows, which ``bufs.xr_CD`` already holds or the caller does not need)."""
    _launch_dispatch(ws, bufs, r, backward, pull_x, None, triton.cdiv(bufs.C, _BM))


def _launch_dispatch(ws, bufs, r, backward, pull_x, ready, programs) -> None:
    beside = ready is not None
    if not (pull_x or backward):
        raise ValueError("megamoe EP: the forward dispatch always pulls x rows")
    s = ws.spec
    L = s.num_experts // s.world
    C = bufs.C
    _check_round(bufs, r)
    K_.ep_dispatch_kernel[(programs,)](ws.ptrs_W, bufs.sched, bufs.rowtab_3C, bufs.roff_L1, bufs.xr_CD, bufs.gr_CD,
                                      bufs.wr_C, ready if ready is not None else bufs.roff_L1,
                                      r, C, s.hidden, s.top_k, L, ws.offsets["sorted"], ws.offsets["weights"],
                                      ws.offsets["rows"], s.max_tokens * s.hidden, W=s.world, E=s.num_experts,
                                      E_PAD=_pow2(s.num_experts), L_PAD=_pow2(L + 1), BM=_BM,
                                      BD=_BD_BESIDE if beside else _BD, BWD=backward, ALIGNED=ws.aligned,
                                      PULL_X=pull_x, READY=beside, PDL=beside and _pdl_device(ws.device),
                                      num_warps=_NW_BESIDE if beside else _NW, enable_fp_fusion=True)


def pull_beside(ws: EPWorkspace, bufs: ExchangeBuffers, r: int, backward: bool, programs: int, timeout_s: float,
                pull_x: bool = True) -> RowPull:
    """Round r's pull (what :func:`dispatch_round` does) as a :class:`~megamoe.ops.ep_tiles.RowPull` for
    the first GEMM over its rows (``gate_up_swiglu`` forward, ``swiglu_dgrad`` backward), which launches it and
    runs beside it. Enqueues now: the round's expert offsets ``bufs.roff_L1`` (so the GEMM's m-tile table can
    be built before the pull) and the zeroed ready flags; the pull itself, ``programs`` persistent programs
    (at most one per block of rows), when the GEMM launcher calls ``launch``. Valid after
    :func:`build_schedule`. No host sync; graph capturable."""
    s = ws.spec
    L = s.num_experts // s.world
    C = bufs.C
    _check_round(bufs, r)
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"megamoe EP: the pull beside the GEMM needs programs >= 1, got {programs!r}")
    blocks = triton.cdiv(C, _BM)
    ready = torch.zeros(1 + blocks, dtype=torch.int32, device=ws.device)
    K_.ep_round_offsets_kernel[(1,)](bufs.sched, bufs.roff_L1, r, C, L, E=s.num_experts, L_PAD=_pow2(L + 1),
                                     num_warps=1, enable_fp_fusion=True)
    max_iters, timeout_ns, use_timer = _wait_args(timeout_s, ws.device)
    n = min(programs, blocks)

    def launch() -> None:
        _launch_dispatch(ws, bufs, r, backward, pull_x, ready, n)

    return RowPull(ready, _BM, ws.flags, ws.rank, max_iters, timeout_ns, use_timer, pdl=_pdl_device(ws.device),
                   launch=launch)


def _pdl_device(dev: torch.device) -> bool:
    """Programmatic dependent launch (``griddepcontrol``): compiled GPU kernels on sm_90 and later. Elsewhere
    (the interpreter, an older GPU) the GEMM starts after the pull has finished: the same bits, no overlap."""
    return dev.type == "cuda" and not interpreter_active() and torch.cuda.get_device_capability(dev)[0] >= 9


def push_round(ws: EPWorkspace, bufs: ExchangeBuffers, r: int, y_CD: torch.Tensor | None,
               dots_CP: torch.Tensor | None = None) -> None:
    """Push round r's result rows (and backward the routing-weight partial dots) into the owners' slots.
    y_CD None: the rows are already there (the GEMM stored them through :func:`push_target`); only the
    dots are pushed (nothing at all without them)."""
    s = ws.spec
    C = bufs.C
    _check_round(bufs, r)
    if y_CD is None and dots_CP is None:
        return
    P = dots_CP.shape[1] if dots_CP is not None else 1
    if P > P_MAX:
        raise ValueError(f"megamoe EP: {P} partial dots per row exceed the workspace's P_MAX={P_MAX}")
    y = y_CD if y_CD is not None else dots_CP
    K_.ep_push_kernel[(triton.cdiv(C, _BM),)](ws.ptrs_W, bufs.sched, bufs.rowtab_3C, y,
                                              dots_CP if dots_CP is not None else y, r, C, s.hidden,
                                              s.top_k, s.num_experts // s.world, P, ws.offsets["slots"],
                                              ws.offsets["dots"], E=s.num_experts, BM=_BM, BD=_BD,
                                              HAS_DOT=dots_CP is not None, P_POW2=_pow2(P),
                                              HAS_ROWS=y_CD is not None, ALIGNED=ws.aligned, num_warps=_NW,
                                              enable_fp_fusion=True)


def _check_round(bufs: ExchangeBuffers, r: int) -> None:
    if not isinstance(r, int) or not 0 <= r < bufs.rounds:
        raise ValueError(f"megamoe EP: round {r!r} outside the exchange's {bufs.rounds} rounds")


def push_target(ws: EPWorkspace, bufs: ExchangeBuffers) -> RowPush:
    """The current round's result rows as a :class:`~megamoe.ops.ep_tiles.RowPush` for the plain-epilogue
    GEMMs (``down_proj`` forward, ``grouped_mm_nn`` dx backward): row i goes to slot (token, slot) of its
    source rank's slot buffer, which is where :func:`push_round` would copy it; valid after
    :func:`dispatch_round` of the round wrote ``bufs.rowtab_3C``. The same bits, without the (C, D) round
    buffer and the separate copy pass."""
    return RowPush(_slot_rows(ws), ws.slot_deltas_W, bufs.rowtab_3C, ws.spec.top_k)


def _slot_rows(ws: EPWorkspace) -> torch.Tensor:
    s = ws.spec
    return ws.slots_TKD.view(s.max_tokens * s.top_k, s.hidden)


def fused_push(ws: EPWorkspace, options: EPOptions) -> bool:
    """Whether the EP path stores result rows from the GEMM epilogue (default) or with the separate push
    kernel (``EPOptions.push_kernel``: the earlier path, kept for A/B runs and as a test reference; also
    taken when the workspace has no aligned slot-offset table, ``EPWorkspace.slot_deltas_W``)."""
    return not options.push_kernel and ws.slot_deltas_W is not None


# SMs left to the exchange while the shared expert runs beside it (megamoe.ops.ep_dispatch); DeepEP likewise
# gives its intranode kernels a fixed number of SMs. Off by default: at W = 1 (H200, 2026-12-01,
# docs/perf.md) 16 SMs gave deepseek-v3 M=8192 -0.39 / -0.24 ms and mok-bench M=4096 +0.48 / +0.65 ms on two
# machines; 8 SMs was worse on both, 32 worse on deepseek-v3 and level on mok-bench; the pull there is a local HBM
# copy that wants the whole GPU. At W > 1 (rows over NVLink, the wait for the peers' plans hidden too) it is not
# measured yet: EPOptions(comm_sms=16) is the A/B.
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def shared_expert_stream(ws: EPWorkspace, options: EPOptions) -> tuple[torch.cuda.Stream, int] | None:
    """(side stream, SMs to leave free) for the shared expert of an EP call, or None to run it inline (CPU /
    interpreter, or ``EPOptions.comm_sms`` 0). The stream is one high-priority stream per device, so that the
    shared expert's programs are placed first when both streams have work queued and the exchange takes the
    SMs they leave. Creating it is not a sync; it is made once per device (outside any captured region when
    the first call is eager, as megamoe's graph users warm up first)."""
    n = options.comm_sms
    if n == 0 or ws.device.type != "cuda" or interpreter_active():
        return None
    idx = ws.device.index if ws.device.index is not None else torch.cuda.current_device()
    st = _SIDE_STREAMS.get(idx)
    if st is None:
        # a lower number is a higher priority; torch maps values outside the device's range to its edge
        st = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx, priority=-1)
    return st, n


def signal_done(ws: EPWorkspace) -> None:
    """Destination: tell every owner that all of this rank's pushes of the exchange are written."""
    K_.ep_signal_kernel[(1,)](ws.ptrs_W, ws.flags, ws.rank, WORD0=FLAG_READY + ws.world, W=ws.world, BUMP=False,
                              num_warps=1, enable_fp_fusion=True)


def wait_done(ws: EPWorkspace, timeout_s: float) -> None:
    """Owner: bounded wait until every rank signalled "done" for the current epoch."""
    max_iters, timeout_ns, use_timer = _wait_args(timeout_s, ws.device)
    K_.ep_wait_done_kernel[(1,)](ws.flags, max_iters, timeout_ns, DONE=FLAG_READY + ws.world, W=ws.world,
                                 USE_TIMER=use_timer, num_warps=1, enable_fp_fusion=True)


def slot_views(ws: EPWorkspace, T: int, P: int = 1):
    """Owner-side views for the fixed-order reductions: (slot rows [T_cap*K, D], row_of [T, K] int32 with
    ``row_of[t, k] = t*K + k``, partial dots [T_cap*K, P] fp32)."""
    s = ws.spec
    K = s.top_k
    rows = _slot_rows(ws)
    row_of = torch.arange(T * K, dtype=torch.int32, device=ws.device).view(T, K)
    dots = ws.dots_NP[:s.max_tokens * K * P].view(s.max_tokens * K, P)
    return rows, row_of, dots
