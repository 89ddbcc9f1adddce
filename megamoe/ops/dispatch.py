"""Dispatchers of the routed experts: where each round's rows come from and where the results go.

Legend: T tokens (of this rank), D hidden, F expert FFN, G = 2F, E experts of the dispatcher's GEMMs (single
GPU: all of them; EP: the L local ones), K top-k, N = T*K (token, slot) rows, R rows of one round (N for the
local dispatcher, at most the capacity C for NVLink), P routing-weight partial dots per row, S shared FFN.

The stage order of the routed experts, forward and backward, lives in one place
(:class:`megamoe.autograd.MoEExpertsFunction`); a dispatcher gives it, per pass and per round, the rows to
compute on (:class:`RoundRows`) and takes the results back. Two dispatchers, both built from one routing plan
(:func:`megamoe.ops.routing.build_routing_plan`):

* :class:`LocalDispatcher` (W = 1, one GPU): one round; the GEMMs gather x / dout rows from the token
  matrices through the plan's ``row_token_N``, the results stay in (N, D) buffers in expert-sorted order.
* :class:`megamoe.ops.ep_dispatch.NVLinkDispatcher` (W > 1): rows pulled from the owners over NVLink into
  capacity-sized receive buffers, round by round, results stored into the owners' (token, slot) slots.

The interface is :class:`Dispatcher`; the stage loop calls, per pass: ``open_forward`` / ``open_backward``, the
shared expert inside ``beside()``, ``start_exchange()``, ``join()``, then per round ``forward_rows`` /
``backward_rows``, the GEMMs, ``forward_results`` / ``backward_results``, and ``finish_forward`` /
``finish_backward`` for the rows the fixed-order reductions read.

Determinism: dispatchers only move rows and build integer tables; every floating-point reduction is one of
the stage loop's kernels, in the order it fixes (the NVLink dispatcher's one exception: an expert of more than
C rows, split across rounds, sums fp32 partials in round order, ops/wgrad_rounds.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from .ep_tiles import RowPull, RowPush
from .grouped_gemm import k_grouped_wants_rows_in_order
from .routing import build_routing_plan, single_group_offsets
from .tile_config import DEFAULT_KERNELS, KernelConfig

__all__ = ["Dispatcher", "RoundRows", "RoundSplit", "Needs", "LocalDispatcher"]


@dataclass(frozen=True)
class Needs:
    """Which gradients the backward computes (``ctx.needs_input_grad`` of the experts' autograd function)."""

    x: bool
    weights: bool
    w13: bool
    w2: bool
    shared_w13: bool
    shared_w2: bool


@dataclass
class RoundRows:
    """One round's rows for the expert GEMMs of the stage loop.

    x_RD: x rows: the (T, D) token matrix read through ``x_idx_R``, or R contiguous rows (x_idx_R None).
    offsets_E1: int32 (E+1,) group offsets of the round's rows.  tiles: their m-tile cache (a dict, see
        ``ops.grouped_gemm.gate_up_swiglu``).
    pull: the round's rows still arriving (:class:`RowPull`, for the first GEMM over them), or None.
    push: where plain-epilogue result rows go (:class:`RowPush`), or None (an output tensor).
    h_out / gu_out: preallocated gate/up outputs, or None.  keep_preact: whether the forward's gate/up writes
        its pre-activations (round 0 keeps them for the backward).  y_out: preallocated down-projection rows.
    Backward: dy_RD / dy_idx_R the output-gradient rows, like x_RD / x_idx_R; scale_R fp32 (R,) routing weight
        of each row; row_dot: whether the dgrad computes the routing-weight partial dots; need_dx: whether the
        x rows' gradient is computed; rows_per_group: the weight gradients' kernel-choice estimate (None: R/E).
    """

    x_RD: torch.Tensor
    x_idx_R: torch.Tensor | None
    offsets_E1: torch.Tensor
    tiles: dict
    pull: RowPull | None = None
    push: RowPush | None = None
    h_out: torch.Tensor | None = None
    gu_out: torch.Tensor | None = None
    keep_preact: bool = True
    y_out: torch.Tensor | None = None
    dy_RD: torch.Tensor | None = None
    dy_idx_R: torch.Tensor | None = None
    scale_R: torch.Tensor | None = None
    row_dot: bool = True
    need_dx: bool = True
    rows_per_group: float | None = None


@dataclass(frozen=True)
class RoundSplit:
    """Round ``round_idx`` of an exchange launched in several rounds, for its weight gradients
    (megamoe.ops.wgrad_rounds), besides the round's rows and their round-local offsets (``RoundRows.offsets_E1``):
    the whole receive order's expert offsets ``full_off_L1``, the round table ``round_starts_Q1``, the fp32 slots
    of the experts split across rounds ``scratch_JMN`` for this gradient, and the capacity C."""

    round_idx: int
    full_off_L1: torch.Tensor
    round_starts_Q1: torch.Tensor
    scratch_JMN: torch.Tensor
    capacity_rows: int


class Dispatcher(Protocol):
    """Where the routed experts' rows come from and where the results go (one object per layer call)."""

    rounds: int  # rounds of the stage loop (1 for the local dispatcher)
    kernel_config: KernelConfig  # tile overrides of every GEMM of the loop (only BLOCK_K can change bits)
    keeps_shared_preact: bool  # the forward keeps the shared expert's gate/up pre-activations
    side: object  # the side stream the shared expert runs on, or None (inline)

    def open_forward(self, x_TD, topk_ids_TK, F: int, keep: bool, has_shared: bool) -> None:
        """Plan the forward (local: the routing plan; NVLink: publish rows and plan, allocate buffers)."""

    def beside(self):
        """Context the shared expert runs in: inline, or on a side stream beside the exchange's start."""

    def start_exchange(self) -> None:
        """The exchange's first steps after the shared expert was enqueued (NVLink: schedule, round 0's pull)."""

    def join(self) -> None:
        """The current stream waits for the side stream (also on an error)."""

    def shared_offsets(self, T: int, dev) -> torch.Tensor:
        """(2,) int32 group offsets of the shared expert's one group of T rows."""

    def shared_tiles(self) -> dict:
        """The m-tile cache of the shared expert's GEMMs."""

    def shared_out(self, x_TD) -> torch.Tensor | None:
        """A preallocated (T, D) shared-expert output, or None."""

    def hand_over(self, *tensors) -> None:
        """Tensors made inside ``beside()`` that the current stream uses after the join."""

    def forward_rows(self, r: int) -> RoundRows:
        """Round r's rows for gate/up and the down projection (round r's pull enqueued first)."""

    def forward_results(self, r: int, y_RD) -> None:
        """The down projection's rows of round r (None when the GEMM pushed them)."""

    def finish_forward(self) -> tuple:
        """(rows_RD, row_of_TK): the result rows the combine reads, (token, slot) -> row."""

    def saved(self) -> tuple:
        """Tensors the backward needs (saved with ``ctx.save_for_backward``), given back to ``open_backward``."""

    def open_backward(self, saved: tuple, x_TD, topk_ids_TK, topk_weights_TK, dout_TD, w13_EGD, w2_EDF,
                      saved_gu: bool, need: Needs, has_shared: bool) -> None:
        """Plan the backward (NVLink: publish x, dout and weights, the forward's plan restored)."""

    def backward_rows(self, r: int, recompute: bool) -> RoundRows:
        """Round r's rows for the backward GEMMs (with gate/up buffers when gu is ``recompute``d)."""

    def wgrad_x_rows(self, rows: RoundRows) -> tuple:
        """(q, q_idx_R): the x rows the w13 gradient reads (rows or a gather)."""

    def round_split(self, r: int, which: str) -> RoundSplit | None:
        """What round r's weight gradient ``which`` ("w13" / "w2") needs besides its rows when several rounds
        run (later rounds and experts split across rounds), or None with one round."""

    def backward_results(self, r: int, dx_RD, part_RP) -> None:
        """The dgrad's dx rows (None when pushed or not needed) and routing-weight partial dots of round r."""

    def finish_backward(self, dw13, dw2) -> tuple:
        """(rows_RD, row_of_TK, dots_RP) for the slot sums; the weight gradients completed."""


class LocalDispatcher:
    """W = 1: the routed rows of one GPU, in one round. The GEMMs gather x and dout rows through the routing
    plan (no permuted copies, except the row-order copies torch's weight-gradient kernel needs), the results
    stay in (N, D) rows in expert-sorted order, and the slot reductions read them through ``row_of_TK``.

    Saved between the passes: the plan's offsets_E1, row_token_N, row_src_N and row_of_TK (3 int32 per
    (token, slot) plus E + 1), and the m-tile tables of both passes' GEMMs (``tiles``). ``kernel_config``: tile
    overrides of every GEMM (only a BLOCK_K other than the table's changes bits). ``fp8``: the routed experts run
    the FP8 recipe, whose weight-gradient operands are gathered while they are quantized: no row-order copies."""

    rounds = 1
    keeps_shared_preact = True
    side = None

    def __init__(self, num_experts: int, kernel_config: KernelConfig = DEFAULT_KERNELS, *, fp8: bool = False):
        self.num_experts, self.kernel_config, self.fp8 = num_experts, kernel_config, fp8
        self.tiles: dict = {}  # the m-tile offsets of each group-offset table, shared by the GEMMs of both passes
        self.one_2: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------ common
    def beside(self):
        return contextlib.nullcontext()

    def start_exchange(self) -> None:
        pass

    def join(self) -> None:
        pass

    def shared_offsets(self, T: int, dev: torch.device) -> torch.Tensor:
        if self.one_2 is None:  # kept for the backward: the tile cache is keyed by this tensor
            self.one_2 = single_group_offsets(T, dev, tile_cache=self.tiles)  # its m-tiles from T on the host
        return self.one_2

    def shared_tiles(self) -> dict:
        return self.tiles

    def hand_over(self, *tensors) -> None:
        pass

    # ------------------------------------------------------------------------------------------ forward
    def open_forward(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, F: int, keep: bool,
                     has_shared: bool) -> None:
        self.x_TD = x_TD
        self.plan = build_routing_plan(topk_ids_TK, self.num_experts)

    def shared_out(self, x_TD: torch.Tensor) -> None:
        return None

    def forward_rows(self, r: int) -> RoundRows:
        return RoundRows(self.x_TD, self.plan.row_token_N, self.plan.offsets_E1, self.tiles)

    def forward_results(self, r: int, y_ND: torch.Tensor) -> None:
        self.y_ND = y_ND

    def finish_forward(self):
        y_ND, row_of_TK = self.y_ND, self.plan.row_of_TK
        del self.y_ND, self.x_TD
        return y_ND, row_of_TK

    def saved(self) -> tuple:
        p = self.plan
        del self.plan
        return p.offsets_E1, p.row_token_N, p.row_src_N, p.row_of_TK

    # ------------------------------------------------------------------------------------------ backward
    def open_backward(self, saved: tuple, x_TD, topk_ids_TK, topk_weights_TK, dout_TD, w13_EGD, w2_EDF,
                      saved_gu: bool, need: Needs, has_shared: bool) -> None:
        self.offsets_E1, self.row_token_N, row_src_N, self.row_of_TK = saved
        self.x_TD, self.dout_TD, self.need = x_TD, dout_TD, need
        self.scale_N = topk_weights_TK.reshape(-1).index_select(0, row_src_N).float()
        D = x_TD.shape[1]
        G, F, N = w13_EGD.shape[1], w2_EDF.shape[2], self.row_token_N.shape[0]
        rows_est = N / max(w13_EGD.shape[0], 1)  # k_grouped_mm's own estimate: its kernel choice
        kc = self.kernel_config
        torch_rows = not self.fp8  # the FP8 weight gradients gather rows as they quantize them
        self.copy_dy = torch_rows and need.w2 and k_grouped_wants_rows_in_order(D, F, w2_EDF.dtype, x_TD.device,
                                                                                 rows_est, kc)
        self.copy_x = torch_rows and need.w13 and k_grouped_wants_rows_in_order(G, D, w13_EGD.dtype, x_TD.device,
                                                                                 rows_est, kc)

    def backward_rows(self, r: int, recompute: bool) -> RoundRows:
        # torch's weight-gradient kernel takes contiguous rows only: dout's rows copied into row order (then
        # also read by the dgrad without a gather)
        if self.copy_dy:
            dy_ND, dy_idx_N = self.dout_TD.index_select(0, self.row_token_N), None
        else:
            dy_ND, dy_idx_N = self.dout_TD, self.row_token_N
        return RoundRows(self.x_TD, self.row_token_N, self.offsets_E1, self.tiles, dy_RD=dy_ND, dy_idx_R=dy_idx_N,
                         scale_R=self.scale_N, row_dot=self.need.weights, need_dx=self.need.x)

    def wgrad_x_rows(self, rows: RoundRows):
        if self.copy_x:
            return self.x_TD.index_select(0, self.row_token_N), None
        return self.x_TD, self.row_token_N

    def round_split(self, r: int, which: str) -> None:
        return None

    def backward_results(self, r: int, dx_ND, part_NP) -> None:
        self.dx_ND, self.part_NP = dx_ND, part_NP

    def finish_backward(self, dw13, dw2):
        out = self.dx_ND, self.row_of_TK, self.part_NP
        del self.dx_ND, self.part_NP, self.x_TD, self.dout_TD
        return out
