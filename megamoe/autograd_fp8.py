"""The FP8 recipe of the routed experts' GEMMs, for the one stage loop of megamoe.autograd.

Legend: T tokens, D hidden, F expert FFN, G = 2F, E experts of the GEMMs, R rows of one round (N = T*K on one
GPU), B = ceil(columns / 128) scale blocks of a row, P row-dot partials.

:class:`Fp8Experts` is what ``MoEExpertsFunction`` is given (``fp8=``) when the layer runs in FP8: at each
routed-expert GEMM of the stage order (megamoe.autograd's module docstring) the loop calls the recipe's method
instead of the 16-bit launcher; the order of the stages, the dispatcher's rows and the combine / slot sums are
the same. Block-scaled FP8 in the DeepSeek-V3 recipe (docs/fp8.md): e4m3 operands, fp32 power-of-two scales,
fp32 accumulation promoted every 128 of K::

  forward   weights: 128x128 blocks, once per weight version (megamoe.ops.fp8_weights cache)
            x rows: 1x128, once per round (on one GPU the T token rows; the GEMM gathers them)
            gate/up: e4m3 x rows @ w13 blocks -> gu (x's dtype, kept), h quantized 1x128 in the epilogue
            down: e4m3 h @ w2 blocks -> y (x's dtype)
  backward  dout rows: 1x128, once per round
            dgrad + SwiGLU bwd: e4m3 dout @ w2 blocks (read transposed) -> dgu, hw, row dots; dgu quantized 1x128
            in the epilogue (SPLIT_128X1: dgu and hw quantized 128x1 there too, never written in 16 bits)
            dx rows: e4m3 dgu @ w13 blocks (read transposed)
            weight gradients: both operands quantized 128 rows x 1 column along the expert's rows, from the
            16-bit values (dout rows and hw for w2, dgu and x rows for w13), written transposed in 128-row blocks
            padded with zeros (K-major for the tensor cores), fp32 sums, one cast to the weight dtype

On a Hopper GPU the down and dx GEMMs (plain epilogue, no gather) and the weight gradients run on the
warp-specialized Gluon kernels (megamoe.ops.fp8_gemm_gluon: the same bits, the promotion overlapped with the
next wgmma); elsewhere, and for the GEMMs with a gather or a SwiGLU epilogue, on the Triton kernels of
megamoe.ops.fp8_gemm.

The backward reuses the forward's weight blocks (kept by the recipe between the passes; the compiled ops of
megamoe.custom_ops quantize them again instead) and reads K-major copies of them for the input gradients.
Extra memory kept between the passes: the weight blocks (shared with the cache). Tiles: the FP8 GEMMs' own table
(megamoe.ops.fp8_gemm.fp8_config, BLOCK_K = 128 = the scale group); the 16-bit ``KernelConfig`` overrides apply to
the shared expert only. Sync: none.
"""

from __future__ import annotations

import torch

from .ops import fp8_gemm, fp8_gemm_gluon, fp8_quant
from .ops.dispatch import RoundSplit
from .ops.fp8_weights import WEIGHT_CACHE, Fp8WeightCache
from .ops.wgrad_rounds import fp8_k_grouped_round

__all__ = ["Fp8Experts"]

# experiment: dgrad + SwiGLU backward as a plain GEMM (Gluon on Hopper) and a SwiGLU-backward pass on its fp32
# accumulator, instead of the Triton GEMM with the row gather and the SwiGLU epilogue (the same bits)
SPLIT_DGRAD = True
# experiment: gate/up + SwiGLU as a plain GEMM (Gluon on Hopper) into [g | u] and a SwiGLU pass, instead of the
# Triton GEMM with the row gather, two accumulators and the SwiGLU epilogue (the same bits)
SPLIT_GATE_UP = True
# experiment (with SPLIT_DGRAD): the SwiGLU-backward pass also makes dgu's and hw's 128x1 K-major weight-gradient
# blocks (per expert-aligned 128-row block), so the 16-bit dgu and hw are neither written nor read again (the same
# bits)
SPLIT_128X1 = True


def _rows_1x128(t_RC: torch.Tensor, idx_R: torch.Tensor | None, offsets_E1: torch.Tensor):
    """1x128 blocks of a round's rows: all T token rows when the GEMM gathers them through ``idx_R`` (one GPU), else
    only the rows the round holds (``offsets_E1[-1]``, on the device) of a receive buffer sized for the capacity."""
    return fp8_quant.quantize_1x128(t_RC, valid_rows_1=offsets_E1[-1:] if idx_R is None else None)


class Fp8Experts:
    """The FP8 routed-expert GEMMs of one layer call (a fresh object per call; it carries the weight blocks
    from the forward to the backward). ``cache``: where the weight blocks come from (default: the process-wide
    :data:`megamoe.ops.fp8_weights.WEIGHT_CACHE`)."""

    def __init__(self, cache: Fp8WeightCache = WEIGHT_CACHE):
        self.cache = cache
        self.w13 = self.w2 = None  # (q, s) 128x128 blocks
        self.w13_k = self.w2_k = None  # the same blocks K-major, for the backward's input-gradient GEMMs
        self._dgu = None  # the dgrad epilogue's 1x128 blocks of dgu, for the dx GEMM of the same round

    # ------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def _check_rows(rows, where: str) -> None:
        if rows.pull is not None or rows.push is not None:
            raise ValueError(f"fp8 {where}: the FP8 GEMMs take complete rows and return result rows: no pull beside "
                             "the GEMM, no epilogue push (megamoe.functional_ep turns both off for fp8)")

    # ------------------------------------------------------------------------------------------ forward
    def open_forward(self, w13_EGD: torch.Tensor, w2_EDF: torch.Tensor) -> None:
        """The weights' 128x128 blocks (cached per weight version)."""
        self.w13, self.w2 = self.cache.get(w13_EGD), self.cache.get(w2_EDF)
        self.dtype = w13_EGD.dtype

    def gate_up(self, rows, save_preact: bool | None = None):
        """Gate/up + SwiGLU on the round's x rows: (h as its 1x128 blocks (hq_RF, hs_RB), gu_RG or None)."""
        self._check_rows(rows, "gate/up")
        keep = rows.keep_preact if save_preact is None else save_preact
        if SPLIT_GATE_UP:
            return self._gate_up_split(rows, keep)
        xq, xs = _rows_1x128(rows.x_RD, rows.x_idx_R, rows.offsets_E1)
        hq, hs, gu = fp8_gemm.fp8_gate_up_swiglu(xq, xs, *self.w13, rows.offsets_E1, gather_idx_R=rows.x_idx_R,
                                                 out_dtype=self.dtype, save_preact=keep, tile_cache=rows.tiles)
        return (hq, hs), gu

    def _gate_up_split(self, rows, keep: bool):
        """:meth:`gate_up` as a plain GEMM and a SwiGLU pass: x's rows quantized 1x128 straight into expert order
        (gathered on one GPU), ``[g | u] = x rows @ w13 blocks^T`` in the activation dtype (the warp-specialized
        Gluon kernel on Hopper: no gather, no epilogue), then h = silu(g) * u quantized 1x128 from that [g | u].
        The same bits."""
        off = rows.offsets_E1
        count = off[-1:]
        xq, xs = fp8_quant.quantize_1x128(rows.x_RD, idx_R=rows.x_idx_R,
                                          valid_rows_1=count if rows.x_idx_R is None else None)
        if fp8_gemm_gluon.fp8_gluon_runs_on(xq.device):
            gu = fp8_gemm_gluon.fp8_grouped_mm_nt_gluon(xq, xs, *self.w13, off, out_dtype=self.dtype,
                                                        tile_cache=rows.tiles)
        else:
            gu = fp8_gemm.fp8_grouped_mm_nt(xq, xs, *self.w13, off, out_dtype=self.dtype, tile_cache=rows.tiles)
        hq, hs = fp8_gemm.fp8_swiglu(gu, valid_rows_1=count)
        return (hq, hs), gu if keep else None

    def down(self, h, rows) -> torch.Tensor:
        """Down projection of the round's h blocks: y_RD in the weights' dtype."""
        hq, hs = h
        if fp8_gemm_gluon.fp8_gluon_runs_on(hq.device):
            return fp8_gemm_gluon.fp8_grouped_mm_nt_gluon(hq, hs, *self.w2, rows.offsets_E1, out_dtype=self.dtype,
                                                          tile_cache=rows.tiles)
        return fp8_gemm.fp8_grouped_mm_nt(hq, hs, *self.w2, rows.offsets_E1, out_dtype=self.dtype, kind="down",
                                          tile_cache=rows.tiles)

    # ------------------------------------------------------------------------------------------ backward
    def open_backward(self) -> None:
        """The forward's weight blocks in K-major order for the input-gradient GEMMs (cached with the blocks)."""
        self._dgu = None
        self.w13_k, self.w2_k = self.cache.kmajor(self.w13), self.cache.kmajor(self.w2)

    def dgrad_swiglu(self, rows, gu_RG: torch.Tensor):
        """dout rows @ w2 blocks with the SwiGLU backward: (dgu_RG, hw_RF, part_RP or None), dgu and hw as their
        128x1 K-major blocks ``(q, s)`` with SPLIT_DGRAD and SPLIT_128X1 (what :meth:`wgrad` takes); dgu's 1x128
        blocks are kept for :meth:`dx` when the round needs dx."""
        self._check_rows(rows, "dgrad")
        if SPLIT_DGRAD:
            dgu, hw, part, dgq, dgs = self._dgrad_split(rows, gu_RG)
        else:
            dq, ds = _rows_1x128(rows.dy_RD, rows.dy_idx_R, rows.offsets_E1)
            dgu, hw, part, dgq, dgs = fp8_gemm.fp8_swiglu_dgrad(
                dq, ds, *self.w2_k, rows.offsets_E1, gu_RG, gather_idx_R=rows.dy_idx_R, row_scale_R=rows.scale_R,
                row_dot=rows.row_dot, tile_cache=rows.tiles)
        self._dgu = (dgq, dgs) if rows.need_dx else None
        return dgu, hw, part

    def _dgrad_split(self, rows, gu_RG: torch.Tensor):
        """:meth:`dgrad_swiglu` as a plain GEMM and a SwiGLU-backward pass: dout's rows quantized 1x128 straight into
        expert order (gathered on one GPU), ``acc = dout rows @ w2 blocks`` in fp32 (the warp-specialized Gluon
        kernel on Hopper: no gather, no epilogue), then the fused epilogue's SwiGLU backward on acc. The same bits."""
        off = rows.offsets_E1
        count = off[-1:]
        dq, ds = fp8_quant.quantize_1x128(rows.dy_RD, idx_R=rows.dy_idx_R,
                                          valid_rows_1=count if rows.dy_idx_R is None else None)
        if fp8_gemm_gluon.fp8_gluon_runs_on(dq.device):  # the K-major copy as (E, F, D): contiguous again
            wq, ws = (t.transpose(1, 2) for t in self.w2_k)
            acc = fp8_gemm_gluon.fp8_grouped_mm_nt_gluon(dq, ds, wq, ws, off, out_dtype=torch.float32,
                                                         tile_cache=rows.tiles)
        else:
            acc = fp8_gemm.fp8_grouped_mm_nn(dq, ds, *self.w2_k, off, out_dtype=torch.float32, tile_cache=rows.tiles)
        if SPLIT_128X1:  # dgu, hw as the weight gradients' 128x1 blocks
            return fp8_gemm.fp8_swiglu_bwd_128x1(acc, gu_RG, off, row_scale_R=rows.scale_R, row_dot=rows.row_dot,
                                                 tile_cache=rows.tiles)
        return fp8_gemm.fp8_swiglu_bwd(acc, gu_RG, valid_rows_1=count, row_scale_R=rows.scale_R,
                                       row_dot=rows.row_dot)

    def wgrad(self, rows, p, p_idx_R, q, q_idx_R, out_dtype: torch.dtype, *, out: torch.Tensor | None = None,
              split: RoundSplit | None = None):
        """Weight gradient ``sum over each expert's rows of P^T Q`` on 128x1 blocks of both operands, quantized
        from their 16-bit rows (read through p_idx_R / q_idx_R where given), or given as those blocks ``(q, s)``
        (from :meth:`dgrad_swiglu`): (E, M, N) in ``out_dtype``. The
        128-row block table is the round's m-tile table for BLOCK_M = 128 (made once, in ``rows.tiles``). The
        operands are written block-padded and transposed (K-major, the layout the FP8 tensor cores read).
        ``split``: the round's tables when the exchange runs several rounds (round 0 makes the gradient, later
        rounds complete ``out`` in place through megamoe.ops.wgrad_rounds.fp8_k_grouped_round)."""
        off = rows.offsets_E1
        blocks = fp8_gemm.table_for(off, fp8_gemm.QB, rows.tiles)
        pq, ps = p if isinstance(p, tuple) else fp8_quant.quantize_128x1_grouped(p, off, p_idx_R, blocks, kmajor=True)
        qq, qs = q if isinstance(q, tuple) else fp8_quant.quantize_128x1_grouped(q, off, q_idx_R, blocks, kmajor=True)
        if split is None or split.round_idx == 0:
            if fp8_gemm_gluon.fp8_gluon_runs_on(pq.device):
                out = fp8_gemm_gluon.fp8_k_grouped_mm_gluon(pq, ps, qq, qs, off, block_offsets_E1=blocks,
                                                            out_dtype=out_dtype)
            else:
                out = fp8_gemm.fp8_k_grouped_mm(pq, ps, qq, qs, off, block_offsets_E1=blocks, padded=True,
                                                out_dtype=out_dtype)
        if split is not None:
            fp8_k_grouped_round(pq, ps, qq, qs, off, blocks, split.full_off_L1, split.round_starts_Q1, out,
                                split.scratch_JMN, round_idx=split.round_idx, capacity_rows=split.capacity_rows)
        return out

    def dx(self, rows) -> torch.Tensor:
        """dx rows = dgu blocks (from the dgrad epilogue) @ w13 blocks (read transposed): (R, D)."""
        dgq, dgs = self._dgu
        self._dgu = None
        if fp8_gemm_gluon.fp8_gluon_runs_on(dgq.device):  # the K-major copy as (E, D, 2F): contiguous again
            wq, ws = (t.transpose(1, 2) for t in self.w13_k)
            return fp8_gemm_gluon.fp8_grouped_mm_nt_gluon(dgq, dgs, wq, ws, rows.offsets_E1, out_dtype=self.dtype,
                                                          tile_cache=rows.tiles)
        return fp8_gemm.fp8_grouped_mm_nn(dgq, dgs, *self.w13_k, rows.offsets_E1, out_dtype=self.dtype,
                                          tile_cache=rows.tiles)

    def end_backward(self) -> None:
        """Drops the last round's dgu blocks; the weight blocks stay with the layer call (a retained graph's second
        backward reads them again) until autograd frees it; the K-major copies stay with the cache."""
        self._dgu = None
        self.w13_k = self.w2_k = None
