"""The FP8 recipe of the routed experts' GEMMs, for the one stage loop of megamoe.autograd.

Legend: T tokens, D hidden, F expert FFN, G = 2F, E experts of the GEMMs, R rows of one round (N = T*K on one
GPU), B = ceil(columns / 128) scale blocks of a row, P row-dot partials.

:class:`Fp8Experts` is what ``MoEExpertsFunction`` is given (``fp8=``) when the layer runs in FP8: at each
routed-expert GEMM of the stage order (megamoe.autograd's module docstring) the loop calls the recipe's method
instead of the 16-bit launcher; the order of the stages, the dispatcher's rows and the combine / slot sums are
the same. Block-scaled FP8 in the DeepSeek-V3 recipe (docs/fp8.md): e4m3 operands, fp32 power-of-two scales,
fp32 accumulation promoted every 128 of K::

  forward   weights: 128x128 blocks, once per weight version (megamoe.ops.fp8_weights cache)
            x rows: 1x128, once per round, gathered into expert order (on one GPU from the T token rows)
            gate/up: e4m3 x rows @ w13 blocks -> gu (x's dtype, kept), then a SwiGLU pass: h quantized 1x128
            down: e4m3 h @ w2 blocks -> y (x's dtype)
  backward  dout rows: 1x128, once per round, gathered into expert order
            dgrad + SwiGLU bwd: e4m3 dout @ w2 blocks (read transposed) -> fp32, then a SwiGLU-backward pass:
            dgu, hw, row dots; dgu quantized 1x128
            dx rows: e4m3 dgu @ w13 blocks (read transposed)
            weight gradients: both operands quantized 128 rows x 1 column along the expert's rows, from the
            16-bit values (dout rows and hw for w2, dgu and x rows for w13), written transposed in 128-row blocks
            padded with zeros (K-major for the tensor cores), fp32 sums, one cast to the weight dtype

On a Hopper GPU every FP8 GEMM runs on the warp-specialized Gluon kernels (megamoe.ops.fp8_gemm_gluon: the same
bits; a promotion overlaps the warpgroup's next wgmma, in the weight gradients the other warpgroup's), elsewhere on
the Triton kernels of megamoe.ops.fp8_gemm; none gathers rows or ends in a SwiGLU epilogue: the quantizers gather
(TMA cannot), and the SwiGLU passes of
megamoe.ops.fp8_swiglu follow the GEMMs.

The backward reuses the forward's weight blocks (kept by the recipe between the passes; under compile the forward
op of megamoe.custom_ops returns them and the backward op hands them over, :meth:`Fp8Experts.adopt_blocks`) and
reads K-major copies of them for the input gradients.
Extra memory kept between the passes: the weight blocks (shared with the cache). Tiles: the FP8 GEMMs' own table
(megamoe.ops.fp8_gemm.fp8_config, BLOCK_K = 128 = the scale group); the 16-bit ``KernelConfig`` overrides apply to
the shared expert only. Sync: none.
"""

from __future__ import annotations

import torch

from .ops import fp8_gemm, fp8_gemm_gluon, fp8_quant, fp8_swiglu
from .ops.dispatch import RoundSplit
from .ops.fp8_weights import WEIGHT_CACHE, Fp8WeightCache
from .ops.wgrad_rounds import fp8_k_grouped_round

__all__ = ["Fp8Experts"]


def _rows_1x128(t_RC: torch.Tensor, idx_R: torch.Tensor | None, offsets_E1: torch.Tensor):
    """1x128 blocks of a round's rows in expert order: the token rows ``t_RC[idx_R]`` gathered on one GPU, else only
    the rows the round holds (``offsets_E1[-1]``, on the device) of a receive buffer sized for the capacity."""
    return fp8_quant.quantize_1x128(t_RC, idx_R=idx_R, valid_rows_1=offsets_E1[-1:] if idx_R is None else None)


def _grouped_mm(a, w, offsets_E1: torch.Tensor, out_dtype: torch.dtype, tiles: dict, *, kmajor: bool = False):
    """The m-grouped FP8 GEMM ``a rows @ w blocks``: a = (q, s) 1x128 rows, w = (q, s) 128x128 blocks, (E, N, K) as
    the forward reads them, or with ``kmajor`` a K-major copy's (E, K, N) view (the input gradients). The
    warp-specialized Gluon kernel on Hopper (K-major operands: the copy transposed back to a contiguous (E, N, K)),
    the Triton kernels elsewhere; the same bits."""
    aq, as_ = a
    if fp8_gemm_gluon.fp8_gluon_runs_on(aq.device):
        wq, ws = (t.transpose(1, 2) for t in w) if kmajor else w
        return fp8_gemm_gluon.fp8_grouped_mm_nt_gluon(aq, as_, wq, ws, offsets_E1, out_dtype=out_dtype,
                                                      tile_cache=tiles)
    mm = fp8_gemm.fp8_grouped_mm_nn if kmajor else fp8_gemm.fp8_grouped_mm_nt
    return mm(aq, as_, *w, offsets_E1, out_dtype=out_dtype, tile_cache=tiles)


class Fp8Experts:
    """The FP8 routed-expert GEMMs of one layer call (a fresh object per call; it carries the weight blocks
    from the forward to the backward). ``cache``: where the weight blocks come from (default: the process-wide
    :data:`megamoe.ops.fp8_weights.WEIGHT_CACHE`)."""

    def __init__(self, cache: Fp8WeightCache = WEIGHT_CACHE):
        self.cache = cache
        self.w13 = self.w2 = None  # (q, s) 128x128 blocks
        self.w13_k = self.w2_k = None  # the same blocks K-major, for the backward's input-gradient GEMMs
        self._dgu = None  # the SwiGLU-backward pass's 1x128 blocks of dgu, for the dx GEMM of the same round

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

    def adopt_blocks(self, w13_blocks: tuple, w2_blocks: tuple, dtype: torch.dtype) -> None:
        """The 128x128 blocks ``(q, s)`` of w13 and w2 that a forward made, and the weights' dtype, instead of
        :meth:`open_forward` (the backward op of megamoe.custom_ops receives them as saved outputs of the forward
        op)."""
        self.w13, self.w2, self.dtype = tuple(w13_blocks), tuple(w2_blocks), dtype

    def gate_up(self, rows, save_preact: bool | None = None):
        """Gate/up + SwiGLU on the round's x rows: (h as its 1x128 blocks (hq_RF, hs_RB), gu_RG or None). The
        GEMM of :meth:`preact`, then a SwiGLU pass: h = silu(g) * u quantized 1x128 from that [g | u]
        (megamoe.ops.fp8_swiglu.fp8_swiglu)."""
        keep = rows.keep_preact if save_preact is None else save_preact
        gu = self.preact(rows)
        hq, hs = fp8_swiglu.fp8_swiglu(gu, valid_rows_1=rows.offsets_E1[-1:])
        return (hq, hs), gu if keep else None

    def preact(self, rows) -> torch.Tensor:
        """[g | u] = x rows @ w13 blocks^T in the activation dtype, gu_RG (the backward's recompute of a round whose
        [g | u] was not kept): x's rows quantized 1x128 straight into expert order (gathered on one GPU; a receive
        round's rows up to its device count under EP), then a plain grouped GEMM (the warp-specialized Gluon kernel
        on Hopper: TMA cannot gather rows, hence the quantizer gathers)."""
        self._check_rows(rows, "gate/up")
        off = rows.offsets_E1
        return _grouped_mm(_rows_1x128(rows.x_RD, rows.x_idx_R, off), self.w13, off, self.dtype, rows.tiles)

    def down(self, h, rows) -> torch.Tensor:
        """Down projection of the round's h blocks: y_RD in the weights' dtype."""
        return _grouped_mm(h, self.w2, rows.offsets_E1, self.dtype, rows.tiles)

    # ------------------------------------------------------------------------------------------ backward
    def open_backward(self) -> None:
        """The forward's weight blocks in K-major order for the input-gradient GEMMs (cached with the blocks)."""
        self._dgu = None
        self.w13_k, self.w2_k = self.cache.kmajor(self.w13), self.cache.kmajor(self.w2)

    def dgrad_swiglu(self, rows, gu_RG: torch.Tensor):
        """dout rows @ w2 blocks with the SwiGLU backward: (dgu_RG, hw_RF, part_RP or None); dgu's 1x128 blocks
        are kept for :meth:`dx` when the round needs dx. dout's rows are quantized 1x128 straight into expert order;
        on Hopper one warp-specialized Gluon kernel runs the GEMM and the SwiGLU backward in its epilogue
        (megamoe.ops.fp8_gemm_gluon.fp8_dgrad_swiglu_gluon), elsewhere a plain GEMM writes ``acc = dout rows @ w2
        blocks`` in fp32 and the SwiGLU-backward pass reads it (megamoe.ops.fp8_swiglu.fp8_swiglu_bwd): the same
        bits."""
        self._check_rows(rows, "dgrad")
        off = rows.offsets_E1
        # the gathered dout blocks (R x D bytes) are freed with the call
        dy = _rows_1x128(rows.dy_RD, rows.dy_idx_R, off)
        if fp8_gemm_gluon.fp8_gluon_runs_on(dy[0].device):
            wq, ws = (t.transpose(1, 2) for t in self.w2_k)
            dgu, hw, part, dgq, dgs = fp8_gemm_gluon.fp8_dgrad_swiglu_gluon(
                *dy, wq, ws, off, gu_RG, row_scale_R=rows.scale_R, row_dot=rows.row_dot, tile_cache=rows.tiles)
        else:
            acc = _grouped_mm(dy, self.w2_k, off, torch.float32, rows.tiles, kmajor=True)
            del dy
            dgu, hw, part, dgq, dgs = fp8_swiglu.fp8_swiglu_bwd(acc, gu_RG, valid_rows_1=off[-1:],
                                                                row_scale_R=rows.scale_R, row_dot=rows.row_dot)
        self._dgu = (dgq, dgs) if rows.need_dx else None
        return dgu, hw, part

    def wgrad(self, rows, p, p_idx_R, q, q_idx_R, out_dtype: torch.dtype, *, out: torch.Tensor | None = None,
              split: RoundSplit | None = None):
        """Weight gradient ``sum over each expert's rows of P^T Q`` on 128x1 blocks of both operands, quantized
        from their 16-bit rows (read through p_idx_R / q_idx_R where given): (E, M, N) in ``out_dtype``. The
        128-row block table is the round's m-tile table for BLOCK_M = 128 (made once, in ``rows.tiles``). The
        operands are written block-padded and transposed (K-major, the layout the FP8 tensor cores read).
        ``split``: the round's tables when the exchange runs several rounds (round 0 makes the gradient, later
        rounds complete ``out`` in place through megamoe.ops.wgrad_rounds.fp8_k_grouped_round)."""
        off = rows.offsets_E1
        blocks = fp8_gemm.table_for(off, fp8_gemm.QB, rows.tiles)
        pq, ps = fp8_quant.quantize_128x1_grouped(p, off, p_idx_R, blocks, kmajor=True)
        qq, qs = fp8_quant.quantize_128x1_grouped(q, off, q_idx_R, blocks, kmajor=True)
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
        """dx rows = dgu blocks (from the SwiGLU-backward pass) @ w13 blocks (read transposed): (R, D)."""
        dgu, self._dgu = self._dgu, None
        return _grouped_mm(dgu, self.w13_k, rows.offsets_E1, self.dtype, rows.tiles, kmajor=True)

    def end_backward(self) -> None:
        """Drops the last round's dgu blocks; the weight blocks stay with the layer call (a retained graph's second
        backward reads them again) until autograd frees it; the K-major copies stay with the cache."""
        self._dgu = None
        self.w13_k = self.w2_k = None
