"""The NVLink symmetric-memory dispatcher of the routed experts (W > 1): one exchange per forward and one per
backward, around the stage loop of megamoe.autograd.MoEExpertsFunction (interface: megamoe.ops.dispatch).

Legend: W EP world size, T tokens of this rank, K top-k, D hidden, F expert FFN, G = 2F, L local experts, C
receive capacity (rows per round), P routing-weight partial dots per row, S shared FFN, H = 2S, J fp32 slots of
the experts split across rounds (ops/wgrad_rounds.py), Q rounds launched, n_r rows of round r.

Forward (every rank is both owner of its tokens and host of its L experts)::

    open_forward: publish(x, ids)         stage x, routing plan, epoch += 1, "ready" -> all
    shared = down(swiglu(x @ sw13))       with EPOptions.comm_sms=n > 0: on a side stream, all SMs but n,
    start_exchange: build_schedule;       beside these two (wait "ready" of all, receive order (expert,
      pull round 0                        global token, slot), cut into rounds of n_r <= C rows at expert
                                          boundaries; round 0's rows); then join
    for round r < rounds:                 round r's rows (forward_rows: r > 0 pulls first); unused rounds exit
        h = gate_up_swiglu(xr);  down_proj(h) -> owner slot (t, k)   (epilogue stores)
    finish_forward: signal_done; wait_done   every owner waits for all pushes
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
(backward: the side stream is a high-priority stream cached per device by ``ep_comm.shared_expert_stream``,
whose freed blocks must not be reused before the current stream's uses are done); the join also runs
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
:class:`megamoe.config.KernelConfig`, passed to every expert GEMM by the stage loop and to the rounds' weight
gradients here) are arguments of the dispatcher; neither changes bits.

With one round (always the case for W <= 2 at the default capacity) the output, the input gradient and the
expert weight gradients are bitwise those of the single-GPU fused path on the global batch. Several rounds are
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
from .dispatch import Needs, RoundRows, RoundSplit
from .routing import single_group_offsets
from .tile_config import DEFAULT_KERNELS
from .wgrad_rounds import finalize_split, split_slots

_NO_OPTIONS = EPOptions()  # every variant off

__all__ = ["NVLinkDispatcher", "wgrad_rows_estimate"]


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


def wgrad_rows_estimate(T: int, K: int, C: int, L: int, max_tokens: int) -> float:
    """Rows per local expert that the weight gradients' kernel choice assumes (host-side, no sync): as if every
    rank routed its T tokens like this one, ``min(T * K, C) / L``. A rank without tokens still receives the
    others' rows; it assumes the workspace's token capacity ``max_tokens`` (at least the group's largest T)
    instead of T = 0, which would pick the slowest kernel. The choice never changes bits: every weight-gradient
    kernel adds the same BLOCK_K row chunks in the same order (megamoe.ops.grouped_gemm.k_grouped_mm)."""
    return min((T if T > 0 else max_tokens) * K, C) / L


class NVLinkDispatcher:
    """W > 1: rows pulled from their owners over NVLink (symmetric memory, :class:`EPWorkspace` ``ws``) into
    receive buffers of ``capacity_rows`` rows per round, ``rounds`` rounds; results stored into the owners'
    (token, slot) slots. ``save_preact`` / ``save_dispatched``: keep round 0's gate/up pre-activations gu_CG
    (C x 2F) / received x rows xr_CD (C x D) from forward to backward; the routing plan (T*K + 4 + E int32) is
    kept whenever a backward can follow and restored into the pool by the backward instead of rebuilt.
    ``options``: the exchange's variants (:class:`EPOptions`); ``kernel_config``: tile overrides of the GEMMs.
    ``gemm_buffers``: allocate the 16-bit GEMMs' output buffers (h_CF, gu_CG, y_CD); False for the FP8 recipe,
    whose GEMMs return their own outputs (megamoe.autograd_fp8: up to C x (3F + D) 16-bit elements a pass saved)."""

    keeps_shared_preact = False

    def __init__(self, ws: EPWorkspace, *, capacity_rows: int, rounds: int, timeout_s: float,
                 save_preact: bool = False, save_dispatched: bool = False, options: EPOptions = _NO_OPTIONS,
                 kernel_config: KernelConfig = DEFAULT_KERNELS, gemm_buffers: bool = True):
        self.ws, self.C, self.rounds, self.timeout_s = ws, capacity_rows, rounds, timeout_s
        self.gemm_buffers = gemm_buffers
        self.options, self.kernel_config = options, kernel_config
        self.save_preact, self.save_dispatched = save_preact, save_dispatched
        self.side = None

    # ------------------------------------------------------------------------------------------ common
    def _options(self, has_shared: bool, pull_overlap: bool) -> None:
        """The exchange's variants for this pass."""
        self.fused = X.fused_push(self.ws, self.options)  # result rows stored by the GEMM epilogue into the slots
        side = X.shared_expert_stream(self.ws, self.options)
        self.overlap = self.options.pull_programs if pull_overlap else 0
        self.side = side if has_shared else None

    def beside(self):
        return _beside(self.side)

    def start_exchange(self) -> None:
        X.build_schedule(self.ws, self.bufs, self.timeout_s)
        if not self.overlap:
            X.dispatch_round(self.ws, self.bufs, 0, backward=self.backward, pull_x=self.pull_x0)

    def join(self) -> None:
        _join(self.side)

    def shared_offsets(self, T: int, dev: torch.device) -> torch.Tensor:
        return single_group_offsets(T, dev)

    def shared_tiles(self) -> dict:
        return {}  # m-tile offsets of one_2, computed once for the pass's shared GEMMs (ops.grouped_gemm tile_cache)

    def hand_over(self, *tensors) -> None:
        """Tensors made on the side stream and used on the current one after the join: the side stream (a
        high-priority stream cached per device) runs ahead of the current one, so their blocks must not be
        reused before the current stream's uses are done."""
        if self.side is not None:
            cur = torch.cuda.current_stream(self.side[0].device)
            for t in tensors:
                if t is not None:
                    t.record_stream(cur)

    def _round_pull(self, r: int) -> None:
        """Round r > 0's pull (round 0's ran in start_exchange, or runs beside the round's first GEMM)."""
        if r == 1 and self.xr0_CD is not None:  # round 0's rows stay for the backward (a second backward with
            self.bufs.xr_CD = torch.empty_like(self.xr0_CD)  # retain_graph reads them again)
        X.dispatch_round(self.ws, self.bufs, r, backward=self.backward)

    def _push(self):
        return X.push_target(self.ws, self.bufs) if self.fused else None

    # ------------------------------------------------------------------------------------------ forward
    def open_forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, F: int, keep: bool,
                     has_shared: bool) -> None:
        """Publish this rank's rows and plan (kept when ``keep``: a backward can follow), allocate the pass's
        buffers. ``has_shared``: the shared expert runs in this pass (beside the exchange's start)."""
        ws, C = self.ws, self.C
        T, D = x_TD.shape
        dev, dtype = x_TD.device, x_TD.dtype
        self.T, self.backward, self.pull_x0 = T, False, True
        self._options(has_shared, pull_overlap=True)
        X.publish(ws, topk_ids_TK, x_TD)
        self.plan = X.save_plan(ws, T, topk_ids_TK.shape[1]) if keep else None
        self.bufs = X.ExchangeBuffers(ws, C, backward=False, rounds=self.rounds)
        self.xr0_CD = self.bufs.xr_CD if self.save_dispatched else None
        alloc = self.gemm_buffers
        self.h_CF = torch.empty(C, F, dtype=dtype, device=dev) if alloc else None
        self.y_CD = torch.empty(C, D, dtype=dtype, device=dev) if alloc and not self.fused else None
        self.gu_CG = torch.empty(C, 2 * F, dtype=dtype, device=dev) if alloc and self.save_preact else None

    def shared_out(self, x_TD: torch.Tensor) -> torch.Tensor:
        # on the current stream: it outlives the side stream's block
        return torch.empty(x_TD.shape[0], x_TD.shape[1], dtype=x_TD.dtype, device=x_TD.device)

    def forward_rows(self, r: int) -> RoundRows:
        pull = None
        if r:
            self._round_pull(r)
        elif self.overlap:  # round 0's pull beside gate/up, which waits for each tile's rows
            pull = X.pull_beside(self.ws, self.bufs, 0, backward=False, programs=self.overlap,
                                 timeout_s=self.timeout_s)
        keep = self.save_preact and r == 0
        # rt: this round's m-tile offsets (roff_L1 is rewritten by every round's dispatch)
        return RoundRows(self.bufs.xr_CD, None, self.bufs.roff_L1, {}, pull=pull, push=self._push(), h_out=self.h_CF,
                         gu_out=self.gu_CG if keep else None, keep_preact=keep, y_out=self.y_CD)

    def forward_results(self, r: int, y_CD) -> None:
        if not self.fused:
            X.push_round(self.ws, self.bufs, r, y_CD)

    def finish_forward(self):
        X.signal_done(self.ws)
        X.wait_done(self.ws, self.timeout_s)
        rows, row_of_TK, _ = X.slot_views(self.ws, self.T)
        self.bufs = self.h_CF = self.y_CD = self.gu_CG = None
        return rows, row_of_TK

    def saved(self) -> tuple:
        plan_E, plan_N = self.plan if self.plan is not None else (None, None)
        xr0_CD, self.plan, self.xr0_CD = self.xr0_CD, None, None
        return xr0_CD, plan_E, plan_N

    # ------------------------------------------------------------------------------------------ backward
    def open_backward(self, saved: tuple, x_TD, topk_ids_TK, topk_weights_TK, dout_TD, w13_LGD, w2_LDF,
                      saved_gu: bool, need: Needs, has_shared: bool) -> None:
        """Publish x, the output gradient and the weights (the forward's plan restored), allocate the pass's
        buffers. round 0 pulls x rows for dW13 and for a gu recompute only; the kept ones are already here."""
        ws = self.ws
        xr0_CD, plan_E, plan_N = saved
        T = x_TD.shape[0]
        self.T, self.backward, self.need, self.x_dtype = T, True, need, x_TD.dtype
        # round 0's pull beside dgrad + SwiGLU, its first GEMM, when the pre-activations are kept (else the first
        # GEMM is the gate/up recompute, and the pull runs first)
        self._options(has_shared, pull_overlap=saved_gu)
        X.publish(ws, topk_ids_TK, x_TD, dout_TD=dout_TD, topk_weights_TK=topk_weights_TK,
                  saved_plan=(plan_E, plan_N) if plan_E is not None else None)
        self.bufs = X.ExchangeBuffers(ws, self.C, backward=True, rounds=self.rounds, xr_CD=xr0_CD)
        self.xr0_CD = xr0_CD
        self.pull_x0 = xr0_CD is None and (need.w13 or not saved_gu)
        L, G, _ = w13_LGD.shape
        self.F = G // 2
        self.h_CF = self.gu_CG = None  # recompute buffers, allocated only for a round without saved pre-activations
        self.rows_est = wgrad_rows_estimate(T, topk_ids_TK.shape[1], self.C, L, ws.spec.max_tokens)
        self.P = 1
        if self.rounds > 1:  # rounds launched for the worst case: later rounds touch only experts with rows there,
            # experts of more than C rows (split across rounds) sum fp32 partials in slots (ops/wgrad_rounds.py)
            J = split_slots(max_received_rows(ws.spec), self.C, L)
            self.full_off_L1 = X.expert_offsets(ws, self.bufs)
            self.round_starts_Q1 = X.round_starts(ws, self.bufs)
            D, dev = ws.spec.hidden, ws.device
            self.part13_JGD = torch.empty(J, G, D, dtype=torch.float32, device=dev) if need.w13 else None
            self.part2_JDF = torch.empty(J, D, self.F, dtype=torch.float32, device=dev) if need.w2 else None

    def backward_rows(self, r: int, recompute: bool) -> RoundRows:
        if r:
            self._round_pull(r)
        if recompute and self.h_CF is None and self.gemm_buffers:
            C, dev = self.C, self.ws.device
            self.h_CF = torch.empty(C, self.F, dtype=self.x_dtype, device=dev)
            self.gu_CG = torch.empty(C, 2 * self.F, dtype=self.x_dtype, device=dev)
        pull = (X.pull_beside(self.ws, self.bufs, 0, backward=True, programs=self.overlap, timeout_s=self.timeout_s,
                              pull_x=self.pull_x0) if r == 0 and self.overlap else None)
        b = self.bufs
        # the receive buffers' rows are contiguous, so the table's torch._grouped_mm (more than ~154 rows per
        # expert) needs no row copies here (docs/perf.md); round 0 is the one-round GEMM
        return RoundRows(b.xr_CD, None, b.roff_L1, {}, pull=pull, push=self._push(), h_out=self.h_CF,
                         gu_out=self.gu_CG, dy_RD=b.gr_CD, scale_R=b.wr_C, row_dot=True, need_dx=True,
                         rows_per_group=self.rows_est)

    def wgrad_x_rows(self, rows: RoundRows):
        return rows.x_RD, None

    def round_split(self, r: int, which: str) -> RoundSplit | None:
        """Rounds launched for the worst case: round r's tables and the fp32 slots of the experts split across
        rounds for the weight gradient ``which`` ("w13" or "w2"); None with one round."""
        if self.rounds == 1:
            return None
        part = self.part13_JGD if which == "w13" else self.part2_JDF
        return RoundSplit(r, self.full_off_L1, self.round_starts_Q1, part, self.C)

    def backward_results(self, r: int, dx_CD, part_CP) -> None:
        self.P = part_CP.shape[1]
        X.push_round(self.ws, self.bufs, r, dx_CD, part_CP)

    def finish_backward(self, dw13, dw2):
        X.signal_done(self.ws)
        X.wait_done(self.ws, self.timeout_s)
        if self.rounds > 1:
            if dw13 is not None:
                finalize_split(self.part13_JGD, self.full_off_L1, dw13, capacity_rows=self.C)
            if dw2 is not None:
                finalize_split(self.part2_JDF, self.full_off_L1, dw2, capacity_rows=self.C)
        rows, row_of_TK, dots = X.slot_views(self.ws, self.T, self.P)
        self.bufs = self.h_CF = self.gu_CG = self.part13_JGD = self.part2_JDF = None
        return rows, row_of_TK, dots
