"""Host side of the expert-parallel MoE: one exchange per forward and one per backward.

Legend: W EP world size, T tokens of this rank, K top-k, D hidden, F expert FFN, G = 2F, L local
experts, C receive capacity (rows per round), P routing-weight partial dots per row, S shared FFN,
H = 2S, J fp32 slots of the experts split across rounds (ops/wgrad_rounds.py), Q rounds launched, n_r
rows of round r.

Forward (every rank is both owner of its tokens and host of its L experts)::

    publish(x, ids)                       stage x, routing plan, epoch += 1, "ready" -> all
    shared = down(swiglu(x @ sw13))       with EPOptions.comm_sms=n > 0: on a side stream, all SMs but n,
    build_schedule; pull round 0          beside these two (wait "ready" of all, receive order (expert,
                                          global token, slot), cut into rounds of n_r <= C rows at expert
                                          boundaries; round 0's rows); then join
    for round r < rounds:                 round r's rows; r > 0 pulls first; unused rounds exit at once
        h = gate_up_swiglu(xr);  down_proj(h) -> owner slot (t, k)   (epilogue stores)
    signal_done; wait_done                every owner waits for all pushes
    out = combine_fwd(slots, w, shared)   fp32, slot order, shared last, one cast

With ``EPOptions.pull_programs=n`` (n > 0; off by default: slower at W = 1, docs/perf.md)
round 0's pull is not run before the loop but as n programs beside round 0's first GEMM (forward gate/up;
backward dgrad + SwiGLU when gu is kept), which waits per 32-row block (``ep_comm.pull_beside``,
``ops.ep_tiles.RowPull``); the shared expert then runs beside the schedule build only.

The shared expert needs only this rank's tokens, so it can run beside the exchange: with
``EPOptions.comm_sms=n`` (n > 0) on a high-priority side stream (``ep_comm.shared_expert_stream``), its
persistent grids sized for all SMs but n (``_common.reserve_sms``), while the current stream waits for the
peers' plans and pulls round 0 (the overlap of Megatron-core's ``moe_shared_expert_overlap``; the SM split as
DeepEP's fixed communication SMs). The default (0), CPU and the interpreter run the same steps in this order
on one stream: at W = 1 the overlap measured level to worse (docs/perf.md), at W > 1 it is
not measured yet. Either way the same kernels see the same rows: the bits do not depend on it. Memory: what
outlives the block is allocated on the current stream (forward) or marked with ``record_stream`` for it
(backward: the side stream comes from torch's stream pool, which other code may share); the join also runs
when an error is raised in between.

Backward: the same exchange with x and the output gradient staged (the shared expert's gate/up recompute,
SwiGLU backward and dx beside the schedule build and round 0's pull, its weight gradients after the join on
the whole GPU); the destination uses the forward's x rows of round 0 (kept when ``save_dispatched``: C x D
elements between the passes; round 0 then pulls only dout rows and weights) or pulls them again, the forward's
gu of round 0 (kept when ``save_preact``: C x 2F elements) or recomputes it from the x rows, runs
``swiglu_dgrad`` (row scale = w), the weight gradients over its rows and ``dx_rows = dgu @ w13``, and pushes
dx rows plus the P partial dots of each row; the owner reduces with ``slot_sum_bwd``.

The result rows (forward y, backward dx) are stored by the GEMM's epilogue straight into the owners' slots
(``ops.ep_tiles.RowPush``, local or across NVLink): no (C, D) round buffer and no copy pass, the same
bits. ``EPOptions.push_kernel`` keeps the earlier round buffer + ``push_round`` copy (A/B runs, tests).

The options (``options``, a :class:`megamoe.config.EPOptions`) and the kernel choices (``kernel_config``, a
:class:`megamoe.config.KernelConfig`, passed to every expert GEMM) are arguments of both passes; neither
changes bits.

The expert GEMMs are megamoe's batch-invariant kernels (megamoe.ops.grouped_gemm; the weight gradients of
experts with many rows go to ``torch._grouped_mm`` where the table says so, with the same bits), so with one round
(always the case for W <= 2 at the default capacity) the output, the input gradient and the expert
weight gradients are bitwise those of the single-GPU fused path on the global batch. Several rounds are
launched when the worst routing needs them (W >= 4 at the default capacity), whether or not the routing
does. Rounds are cut at expert boundaries (kernels/ep_comm.py), so every expert's rows sit in one round, in
the one-round order, unless the expert alone has more than C rows: round 0's weight gradients are the
one-round GEMMs, later rounds store only the experts they hold (bitwise the same), and only an expert of
more than C rows (never at the default C with distinct ids and W <= 2K) is cut into C-row pieces and sums
fp32 partials in round order (equal up to fp32 rounding; ops/wgrad_rounds.py). So with several rounds too,
output, input gradient and expert weight gradients are bitwise the single-GPU fused path's.
"""

from __future__ import annotations

import contextlib

import torch

from ..config import EPOptions, KernelConfig
from ..distributed import EPWorkspace, max_received_rows
from . import ep_comm as X
from ._common import reserve_sms
from .combine import combine_fwd, slot_sum_bwd
from .grouped_gemm import down_proj, gate_up_swiglu, grouped_mm_nn, k_grouped_mm, swiglu_dgrad
from .routing import single_group_offsets
from .wgrad_rounds import finalize_split, k_grouped_round, split_slots

__all__ = ["ep_moe_forward", "ep_moe_backward"]


@contextlib.contextmanager
def _beside(side):
    """Run the block on the side stream of :func:`ep_comm.shared_expert_stream` (after the current stream's
    work so far), its persistent grids leaving the exchange its SMs; inline when ``side`` is None."""
    if side is None:
        yield
        return
    stream, sms = side
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream), reserve_sms(sms):
        yield


def _join(side) -> None:
    """The current stream waits for the side stream's work (no host sync)."""
    if side is not None:
        stream = side[0]
        torch.cuda.current_stream(stream.device).wait_stream(stream)


def ep_moe_forward(ws: EPWorkspace, x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS,
                   *, capacity_rows: int, rounds: int, timeout_s: float, save_preact: bool = False,
                   save_dispatched: bool = False, save_plan: bool = False, options: EPOptions = EPOptions(),
                   kernel_config: KernelConfig = KernelConfig()):
    """Forward exchange; returns (out_TD in x's dtype, gu_CG or None, xr_CD or None, plan or None). Inputs
    contiguous and validated.

    save_preact: also return the gate/up pre-activations gu_CG (C, 2F) of round 0's received rows (all of them
    unless the routing overflowed the capacity), which :func:`ep_moe_backward` then uses instead of
    recomputing them (C * 2F elements of x's dtype held from forward to backward, whatever W and the number of
    rounds). save_dispatched: also return round 0's received x rows xr_CD (C, D), which the backward then uses
    instead of pulling them again (C * D elements held; with several rounds the forward gives later rounds a
    buffer of their own, C * D more while it runs). save_plan: also return copies of this rank's routing plan
    (``ep_comm.save_plan``: T*K*4 + (4 + E)*4 bytes), which the backward restores instead of rebuilding it. No
    host sync."""
    T, D = x_TD.shape
    F = w2_LDF.shape[2]
    dev = x_TD.device
    kc = kernel_config
    fused = X.fused_push(ws, options)  # result rows stored by down_proj's epilogue into the owners' slots
    side = X.shared_expert_stream(ws, options)
    overlap = options.pull_programs
    X.publish(ws, topk_ids_TK, x_TD)
    plan = X.save_plan(ws, T, topk_ids_TK.shape[1]) if save_plan else None
    shared_TD = None
    bufs = X.ExchangeBuffers(ws, capacity_rows, backward=False, rounds=rounds)
    xr0_CD = bufs.xr_CD if save_dispatched else None
    h_CF = torch.empty(capacity_rows, F, dtype=x_TD.dtype, device=dev)
    y_CD = None if fused else torch.empty(capacity_rows, D, dtype=x_TD.dtype, device=dev)
    gu_CG = torch.empty(capacity_rows, 2 * F, dtype=x_TD.dtype, device=dev) if save_preact else None
    has_shared = shared_w13_HD is not None and T > 0
    if not has_shared:
        side = None
    try:  # the join also on an error, so that nothing the side stream still reads is freed under it
        if has_shared:
            one_2 = single_group_offsets(T, dev)
            shared_TD = torch.empty(T, D, dtype=x_TD.dtype, device=dev)  # on the current stream: it outlives the block
            with _beside(side):
                st = {}  # m-tile offsets of one_2, computed once for both GEMMs (ops.grouped_gemm tile_cache)
                hs_TS, _ = gate_up_swiglu(x_TD, shared_w13_HD.unsqueeze(0), one_2, save_preact=False, tile_cache=st,
                                          kernel_config=kc)
                down_proj(hs_TS, shared_w2_DS.unsqueeze(0), one_2, out=shared_TD, tile_cache=st, kernel_config=kc)
                del hs_TS
        X.build_schedule(ws, bufs, timeout_s)
        if not overlap:
            X.dispatch_round(ws, bufs, 0, backward=False)
    finally:
        _join(side)
    for r in range(rounds):
        pull = None
        if r:
            if r == 1 and xr0_CD is not None:  # round 0's rows stay for the backward
                bufs.xr_CD = torch.empty_like(xr0_CD)
            X.dispatch_round(ws, bufs, r, backward=False)
        elif overlap:  # round 0's pull beside gate/up, which waits for each tile's rows
            pull = X.pull_beside(ws, bufs, 0, backward=False, programs=overlap, timeout_s=timeout_s)
        keep = gu_CG is not None and r == 0
        rt = {}  # this round's m-tile offsets (roff_L1 is rewritten by every round's dispatch)
        gate_up_swiglu(bufs.xr_CD, w13_LGD, bufs.roff_L1, save_preact=keep, out=h_CF,
                       preact_out=gu_CG if keep else None, tile_cache=rt, pull=pull, kernel_config=kc)
        if fused:
            down_proj(h_CF, w2_LDF, bufs.roff_L1, push=X.push_target(ws, bufs), tile_cache=rt, kernel_config=kc)
        else:
            down_proj(h_CF, w2_LDF, bufs.roff_L1, out=y_CD, tile_cache=rt, kernel_config=kc)
            X.push_round(ws, bufs, r, y_CD)
    X.signal_done(ws)
    X.wait_done(ws, timeout_s)
    rows, row_of_TK, _ = X.slot_views(ws, T)
    return combine_fwd(rows, row_of_TK, topk_weights_TK, shared_TD, out_dtype=x_TD.dtype), gu_CG, xr0_CD, plan


def ep_moe_backward(ws: EPWorkspace, dout_TD, x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD,
                    shared_w2_DS, *, capacity_rows: int, rounds: int, timeout_s: float, need_w: bool = True,
                    need_w13: bool = True, need_w2: bool = True, need_shared: bool = True, saved_gu_CG=None,
                    saved_xr_CD=None, saved_plan=None, options: EPOptions = EPOptions(),
                    kernel_config: KernelConfig = KernelConfig()):
    """Backward exchange: (dx_TD, dw_TK, dw13_LGD, dw2_LDF, dshared_w13_HD, dshared_w2_DS); None where
    not needed. dx is always computed (every rank must take part in the exchange). saved_gu_CG: the forward's
    pre-activations of round 0 (the schedule, hence the row order, is rebuilt identically from the
    same ids); other rounds, or all without it, recompute them from the pulled x. saved_xr_CD: the forward's
    x rows of round 0 (``save_dispatched``), read, never written: round 0 then pulls only the output
    gradient rows and weights (so does a backward that needs neither dW13 nor a recompute of gu); later
    rounds pull x into a buffer of their own. saved_plan: the forward's
    routing plan (``save_plan``), restored instead of rebuilt from the same ids. No host sync."""
    T, D = x_TD.shape
    L, G, _ = w13_LGD.shape
    F = G // 2
    dev = x_TD.device
    kc = kernel_config
    fused = X.fused_push(ws, options)
    side = X.shared_expert_stream(ws, options)
    # round 0's pull beside dgrad + SwiGLU, its first GEMM, when the pre-activations are kept (else the first
    # GEMM is the gate/up recompute, and the pull runs first)
    overlap = options.pull_programs if saved_gu_CG is not None else 0
    X.publish(ws, topk_ids_TK, x_TD, dout_TD=dout_TD, topk_weights_TK=topk_weights_TK, saved_plan=saved_plan)

    ds13 = ds2 = dxs_TD = None
    bufs = X.ExchangeBuffers(ws, capacity_rows, backward=True, rounds=rounds, xr_CD=saved_xr_CD)
    # round 0 needs x rows for dW13 and for a gu recompute only; the kept ones are already here
    pull_x0 = saved_xr_CD is None and (need_w13 or saved_gu_CG is None)
    has_shared = shared_w13_HD is not None and T > 0
    if not has_shared:
        side = None
        if shared_w13_HD is not None and need_shared:
            ds13, ds2 = torch.zeros_like(shared_w13_HD), torch.zeros_like(shared_w2_DS)

    def shared_wgrads():  # on the whole GPU (torch._grouped_mm where the table says so)
        if need_shared:
            return (k_grouped_mm(dgus_TH, x_TD, one_2, out_dtype=shared_w13_HD.dtype, kernel_config=kc)[0],
                    k_grouped_mm(dout_TD, hs_TS, one_2, out_dtype=shared_w2_DS.dtype, kernel_config=kc)[0])
        return None, None

    try:  # the join also on an error (as in the forward)
        if has_shared:  # the shared expert's gate/up recompute, SwiGLU backward and dx, beside the exchange
            one_2 = single_group_offsets(T, dev)
            with _beside(side):
                st = {}
                _, gus_TH = gate_up_swiglu(x_TD, shared_w13_HD.unsqueeze(0), one_2, save_preact=True, tile_cache=st,
                                           kernel_config=kc)
                dgus_TH, hs_TS, _ = swiglu_dgrad(dout_TD, shared_w2_DS.unsqueeze(0), one_2, gus_TH, row_dot=False,
                                                 tile_cache=st, kernel_config=kc)
                dxs_TD = grouped_mm_nn(dgus_TH, shared_w13_HD.unsqueeze(0), one_2, tile_cache=st, kernel_config=kc)
                del gus_TH
                if side is not None:  # made on the side stream, used on the current one after the join: the
                    # side stream is one of torch's pooled streams, which other code may also use, so its
                    # blocks must not be reused before the current stream's uses are done
                    cur = torch.cuda.current_stream(side[0].device)
                    for t in (dgus_TH, hs_TS, dxs_TD):
                        t.record_stream(cur)
            if side is None:  # inline: the weight gradients before the exchange, as without the switch before
                ds13, ds2 = shared_wgrads()
        X.build_schedule(ws, bufs, timeout_s)
        if not overlap:
            X.dispatch_round(ws, bufs, 0, backward=True, pull_x=pull_x0)
    finally:
        _join(side)
    if has_shared:
        if side is not None:
            ds13, ds2 = shared_wgrads()
        del dgus_TH, hs_TS

    one_round = rounds == 1
    dw13 = dw2 = None
    C = capacity_rows
    if not one_round:  # rounds launched for the worst case: later rounds touch only experts with rows there,
        # experts of more than C rows (split across rounds) sum fp32 partials in slots (ops/wgrad_rounds.py)
        J = split_slots(max_received_rows(ws.spec), C, L)
        full_off_L1 = X.expert_offsets(ws, bufs)
        round_starts_Q1 = X.round_starts(ws, bufs)
        part13_JGD = torch.empty(J, G, D, dtype=torch.float32, device=dev) if need_w13 else None
        part2_JDF = torch.empty(J, D, F, dtype=torch.float32, device=dev) if need_w2 else None
    h_CF = gu_CG = None  # recompute buffers, allocated only for a round without saved pre-activations
    # rows per local expert if every rank routes like this one (a host-side estimate for the kernel choice
    # of the weight gradients; it never changes bits)
    rows_est = min(T * topk_ids_TK.shape[1], capacity_rows) / L
    P = 1
    for r in range(rounds):
        if r:
            if r == 1 and saved_xr_CD is not None:  # the kept rows stay the forward's (a second backward
                bufs.xr_CD = torch.empty_like(saved_xr_CD)  # with retain_graph reads them again)
            X.dispatch_round(ws, bufs, r, backward=True)
        roff = bufs.roff_L1
        rt = {}  # this round's m-tile offsets
        if r == 0 and saved_gu_CG is not None:
            gu_CG = saved_gu_CG
        else:
            if h_CF is None:
                h_CF = torch.empty(capacity_rows, F, dtype=x_TD.dtype, device=dev)
                gu_CG = torch.empty(capacity_rows, G, dtype=x_TD.dtype, device=dev)
            gate_up_swiglu(bufs.xr_CD, w13_LGD, roff, save_preact=True, out=h_CF, preact_out=gu_CG, tile_cache=rt,
                           kernel_config=kc)
        pull = (X.pull_beside(ws, bufs, 0, backward=True, programs=overlap, timeout_s=timeout_s, pull_x=pull_x0)
                if r == 0 and overlap else None)
        dgu_CG, hw_CF, part_CP = swiglu_dgrad(bufs.gr_CD, w2_LDF, roff, gu_CG, row_scale_R=bufs.wr_C, row_dot=True,
                                              tile_cache=rt, pull=pull, kernel_config=kc)
        # the receive buffers' rows are contiguous, so the table's torch._grouped_mm (more than ~154 rows per
        # expert) needs no row copies here (docs/perf.md); round 0 is the one-round GEMM
        if need_w2:
            if r == 0:
                dw2 = k_grouped_mm(bufs.gr_CD, hw_CF, roff, out_dtype=w2_LDF.dtype, rows_per_group=rows_est,
                                   kernel_config=kc)
            if not one_round:
                k_grouped_round(bufs.gr_CD, hw_CF, roff, full_off_L1, round_starts_Q1, dw2, part2_JDF, round_idx=r,
                                capacity_rows=C, kernel_config=kc)
        if need_w13:
            if r == 0:
                dw13 = k_grouped_mm(dgu_CG, bufs.xr_CD, roff, out_dtype=w13_LGD.dtype, rows_per_group=rows_est,
                                    kernel_config=kc)
            if not one_round:
                k_grouped_round(dgu_CG, bufs.xr_CD, roff, full_off_L1, round_starts_Q1, dw13, part13_JGD, round_idx=r,
                                capacity_rows=C, kernel_config=kc)
        if fused:  # dx rows stored by the GEMM's epilogue into the owners' slots, then the dots
            dx_CD = grouped_mm_nn(dgu_CG, w13_LGD, roff, push=X.push_target(ws, bufs), tile_cache=rt, kernel_config=kc)
        else:
            dx_CD = grouped_mm_nn(dgu_CG, w13_LGD, roff, tile_cache=rt, kernel_config=kc)
        P = part_CP.shape[1]
        X.push_round(ws, bufs, r, dx_CD, part_CP)
        del dgu_CG, hw_CF, part_CP, dx_CD
    X.signal_done(ws)
    X.wait_done(ws, timeout_s)
    if not one_round:
        if dw13 is not None:
            finalize_split(part13_JGD, full_off_L1, dw13, capacity_rows=C)
        if dw2 is not None:
            finalize_split(part2_JDF, full_off_L1, dw2, capacity_rows=C)
    rows, row_of_TK, dots = X.slot_views(ws, T, P)
    dx_TD, dw_TK = slot_sum_bwd(rows, row_of_TK, dxs_TD, dots if need_w else None, num_cols=D,
                                dx_dtype=x_TD.dtype, dw_dtype=topk_weights_TK.dtype)
    return dx_TD, dw_TK, dw13, dw2, ds13, ds2
