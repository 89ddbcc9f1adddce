"""Host launchers of the FP8 layer's SwiGLU passes (megamoe/kernels/fp8_swiglu.py): validate, allocate, launch; no
autograd, no host sync, CUDA-graph capturable.

The FP8 layer's gate/up and dgrad are plain grouped GEMMs (megamoe.ops.fp8_gemm, or its Gluon twins on Hopper,
whose operands come through TMA and so cannot be gathered rows or end in a fused epilogue); these passes follow
them:
  * :func:`fp8_swiglu`: h = silu(g) * u from the gate/up GEMM's [g | u] (the activation dtype), quantized 1x128 for
    the down GEMM;
  * :func:`fp8_swiglu_bwd`: the SwiGLU backward on the down dgrad's fp32 accumulator: [dg | du] (and its 1x128
    blocks for the dx GEMM), h * routing weight (the down weight gradient's operand) and the routing weights'
    row-dot partials.
The values are the bf16 path's expressions on the same rounded inputs (megamoe.kernels.grouped_gemm's SwiGLU
epilogues); the 1x128 blocks are megamoe.reference_fp8.quantize_1x128's bits of those values.

Legend: R rows of a round's expert-ordered row buffer, F the expert FFN width (G = 2F), B = G / 128 or F / 128 scale
blocks, P = F / 128 row-dot partials.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.fp8_swiglu import swiglu_bwd_blocks_kernel, swiglu_bwd_rows_kernel, swiglu_rows_kernel
from ._common import check_device, check_row_count, is_interpreted, pow2
from .routing import tile_offsets_for

__all__ = ["fp8_swiglu", "fp8_swiglu_bwd", "fp8_swiglu_bwd_blocks"]

QB = 128  # the scale group
_ROWS, _ROWS_INTERPRET = 32, 16  # rows per program
_E4M3 = torch.float8_e4m3fn
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_rows_2d(where: str, name: str, t, dtypes, shape=None) -> None:
    """A 2-D tensor of one of ``dtypes`` (and ``shape`` where given) with contiguous rows."""
    ok = isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in dtypes and (t.shape[0] == 0 or t.stride(1) == 1)
    if not ok or (shape is not None and tuple(t.shape) != shape):
        want = f"({shape[0]}, {shape[1]}) " if shape is not None else "2-D "
        raise ValueError(f"{where}: {name} must be a {want}{'/'.join(str(d) for d in dtypes)} tensor with contiguous "
                         f"rows, got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def _check_width(where: str, F: int) -> None:
    if F % QB:
        raise ValueError(f"{where}: FP8 block scaling needs the FFN size F to be a multiple of 128, got F = {F}")


def _count(valid_rows_1, R: int, dev: torch.device) -> torch.Tensor:
    return valid_rows_1 if valid_rows_1 is not None else torch.full((1,), R, dtype=torch.int32, device=dev)


def fp8_swiglu(gu_RG: torch.Tensor, *, valid_rows_1: torch.Tensor | None = None):
    """h = cast(silu(g) * u) of [g | u] rows a plain GEMM wrote in the activation dtype, quantized 1x128.

    Args:
        gu_RG: (R, 2F) bf16 / fp16 / fp32, rows contiguous. valid_rows_1: optional (1,) int32 device count of the
            rows to compute (the others are not written); all R when None.
    Returns:
        hq_RF (R, F) e4m3, hs_RB (R, F / 128) fp32. Sync: none.
    """
    where = "fp8_swiglu"
    _check_rows_2d(where, "gu_RG", gu_RG, _DTYPES)
    R, G = gu_RG.shape
    if G % 2:
        raise ValueError(f"{where}: gu_RG must hold [g | u], an even number of columns, got {G}")
    F = G // 2
    _check_width(where, F)
    check_row_count(where, valid_rows_1)
    dev = check_device(swiglu_rows_kernel, where, gu_RG=gu_RG, valid_rows_1=valid_rows_1)
    hq = torch.empty((R, F), dtype=_E4M3, device=dev)
    hs = torch.empty((R, F // QB), dtype=torch.float32, device=dev)
    if R == 0 or F == 0:
        return hq, hs
    interpret = is_interpreted(swiglu_rows_kernel)
    block_m = _ROWS_INTERPRET if interpret else _ROWS
    swiglu_rows_kernel[(triton.cdiv(R, block_m), F // QB)](
        gu_RG, _count(valid_rows_1, R, dev), hq.view(torch.uint8), hs, R, F, gu_RG.stride(0), hq.stride(0),
        hs.stride(0), HW_CAST=not interpret, BLOCK_M=block_m, num_warps=4, enable_fp_fusion=True)
    return hq, hs


def fp8_swiglu_bwd(acc_RF: torch.Tensor, gu_RG: torch.Tensor, *, valid_rows_1: torch.Tensor | None = None,
                   row_scale_R: torch.Tensor | None = None, row_dot: bool = True):
    """The SwiGLU backward on a down-projection dgrad accumulator a plain GEMM wrote in fp32 (``acc_RF = deq(dY) @
    deq(w2)[e]`` per row, e.g. ``fp8_grouped_mm_nn(..., out_dtype=torch.float32)``), h recomputed from the saved
    [g | u] exactly as the forward computed it, s = row_scale_R[r] (1 when None), as the bf16 ``swiglu_dgrad``:
      * ``row_dot_RP[r, p] = sum over columns [128p, 128p + 128) of acc * h`` (fp32);
      * ``dh = cast(acc * s)``, ``dgu_RG = cast([dh * up * silu'(gate) | dh * silu(gate)])``, ``hw_RF = cast(h * s)``;
      * ``dgq_RG, dgs_RB = quant_1x128(dgu_RG)`` (the operand of the dx GEMM).

    Args:
        acc_RF: (R, F) fp32, rows contiguous. gu_RG: (R, 2F) the saved [g | u] (bf16 / fp16 / fp32: the dtype of
            dgu and hw). valid_rows_1: optional (1,) int32 device count of the rows to compute (the others are not
            written); all R when None. row_scale_R: optional (R,) fp32 routing weight of each row. row_dot: also
            return the row-dot partials.
    Returns:
        dgu_RG (R, 2F), hw_RF (R, F) in gu's dtype, row_dot_RP (R, F / 128) fp32 or None, dgq_RG (R, 2F) e4m3,
        dgs_RB (R, 2F / 128) fp32. Sync: none.
    """
    where = "fp8_swiglu_bwd"
    _check_rows_2d(where, "acc_RF", acc_RF, (torch.float32,))
    R, F = acc_RF.shape
    _check_width(where, F)
    _check_rows_2d(where, "gu_RG", gu_RG, _DTYPES, (R, 2 * F))
    if row_scale_R is not None and (not isinstance(row_scale_R, torch.Tensor) or tuple(row_scale_R.shape) != (R,)
                                    or row_scale_R.dtype != torch.float32 or not row_scale_R.is_contiguous()):
        raise ValueError(f"{where}: row_scale_R must be a contiguous fp32 tensor of shape ({R},)")
    check_row_count(where, valid_rows_1)
    dev = check_device(swiglu_bwd_rows_kernel, where, acc_RF=acc_RF, gu_RG=gu_RG, valid_rows_1=valid_rows_1,
                       row_scale_R=row_scale_R)
    dgu = torch.empty((R, 2 * F), dtype=gu_RG.dtype, device=dev)
    hw = torch.empty((R, F), dtype=gu_RG.dtype, device=dev)
    part = torch.empty((R, F // QB), dtype=torch.float32, device=dev) if row_dot else None
    dgq = torch.empty((R, 2 * F), dtype=_E4M3, device=dev)
    dgs = torch.empty((R, 2 * F // QB), dtype=torch.float32, device=dev)
    if R == 0 or F == 0:
        return dgu, hw, part, dgq, dgs
    interpret = is_interpreted(swiglu_bwd_rows_kernel)
    block_m = _ROWS_INTERPRET if interpret else _ROWS
    swiglu_bwd_rows_kernel[(triton.cdiv(R, block_m), F // QB)](
        acc_RF, _count(valid_rows_1, R, dev), row_scale_R if row_scale_R is not None else acc_RF, gu_RG, dgu, hw,
        part if part is not None else acc_RF, dgq.view(torch.uint8), dgs, R, F,
        acc_RF.stride(0), dgu.stride(0), gu_RG.stride(0), hw.stride(0), dgq.stride(0), dgs.stride(0),
        HAS_SCALE=row_scale_R is not None, HAS_DOT=part is not None, HW_CAST=not interpret, BLOCK_M=block_m,
        num_warps=4, enable_fp_fusion=True)
    return dgu, hw, part, dgq, dgs


def _kmajor_blocks(R: int, C: int, NB: int, dev: torch.device):
    """An empty block-padded K-major buffer (C, 128 NB) e4m3 read as its transposed (128 NB, C) view, and its
    (NB, C) fp32 scales: megamoe.ops.fp8_quant.quantize_128x1_grouped(..., kmajor=True)'s layout."""
    buf = torch.empty((C, NB * QB), dtype=_E4M3, device=dev)
    return buf, torch.empty((NB, C), dtype=torch.float32, device=dev)


def fp8_swiglu_bwd_blocks(acc_RF: torch.Tensor, gu_RG: torch.Tensor, offsets_E1: torch.Tensor,
                          block_offsets: torch.Tensor | None = None, *, row_scale_R: torch.Tensor | None = None,
                          row_dot: bool = True, dgu_blocks: bool = True, hw_blocks: bool = True):
    """:func:`fp8_swiglu_bwd` on an expert-grouped accumulator whose weight-gradient operands are wanted in FP8:
    dgu and hw are not written in 16 bits; their 128x1 blocks along each expert's rows are, block-padded and
    K-major (what the FP8 weight-gradient GEMM reads), the bits of ``quantize_128x1_grouped(dgu, offsets_E1,
    kmajor=True)`` and of hw's, from the same values :func:`fp8_swiglu_bwd` stores.

    Args:
        acc_RF, gu_RG, row_scale_R, row_dot: as :func:`fp8_swiglu_bwd`. offsets_E1: (E + 1,) int32 expert row
            offsets (rows ``offsets[0]:offsets[E]`` are computed; ``offsets[E] <= R``). block_offsets: optional
            (E + 1,) int32, the m-tile table for BLOCK_M = 128 of these offsets (computed when None).
            dgu_blocks / hw_blocks: write the blocks of dgu / hw (a weight gradient that is not needed skips them).
    Returns:
        row_dot_RP or None, dgq_RG, dgs_RB (1x128, as :func:`fp8_swiglu_bwd`), ``(dgk, dgks)`` or None: dgu's
        blocks ((NB 128, 2F) e4m3, the transposed view of a contiguous (2F, NB 128) buffer; (NB, 2F) fp32 scales),
        ``(hk, hks)`` or None: hw's ((NB 128, F), (NB, F)); NB = ceil(R / 128) + E, blocks past
        ``block_offsets[E]`` not written. Sync: none.
    """
    where = "fp8_swiglu_bwd_blocks"
    _check_rows_2d(where, "acc_RF", acc_RF, (torch.float32,))
    R, F = acc_RF.shape
    _check_width(where, F)
    _check_rows_2d(where, "gu_RG", gu_RG, _DTYPES, (R, 2 * F))
    if row_scale_R is not None and (not isinstance(row_scale_R, torch.Tensor) or tuple(row_scale_R.shape) != (R,)
                                    or row_scale_R.dtype != torch.float32 or not row_scale_R.is_contiguous()):
        raise ValueError(f"{where}: row_scale_R must be a contiguous fp32 tensor of shape ({R},)")
    for name, t in (("offsets_E1", offsets_E1), ("block_offsets", block_offsets)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32
                              or t.shape[0] < 1 or t.shape[0] != offsets_E1.shape[0]):
            raise ValueError(f"{where}: {name} must be a 1-D int32 tensor of E + 1 >= 1 entries (offsets_E1's "
                             f"length), got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    dev = check_device(swiglu_bwd_blocks_kernel, where, acc_RF=acc_RF, gu_RG=gu_RG, offsets_E1=offsets_E1,
                       block_offsets=block_offsets, row_scale_R=row_scale_R)
    E = offsets_E1.shape[0] - 1
    NB = triton.cdiv(R, QB) + E
    part = torch.empty((R, F // QB), dtype=torch.float32, device=dev) if row_dot else None
    dgq = torch.empty((R, 2 * F), dtype=_E4M3, device=dev)
    dgs = torch.empty((R, 2 * F // QB), dtype=torch.float32, device=dev)
    gk, gks = _kmajor_blocks(R, 2 * F, NB, dev) if dgu_blocks else (None, None)
    hk, hks = _kmajor_blocks(R, F, NB, dev) if hw_blocks else (None, None)
    if R > 0 and F > 0 and E > 0:
        if block_offsets is None:
            block_offsets = tile_offsets_for(offsets_E1, QB)
        swiglu_bwd_blocks_kernel[(NB, F // QB)](
            acc_RF, row_scale_R if row_scale_R is not None else acc_RF, gu_RG, part if part is not None else acc_RF,
            dgq.view(torch.uint8), dgs, (gk if gk is not None else dgq).view(torch.int32),
            gks if gks is not None else dgs, (hk if hk is not None else dgq).view(torch.int32),
            hks if hks is not None else dgs, offsets_E1, block_offsets, R, F, E, NB * QB, acc_RF.stride(0),
            gu_RG.stride(0), dgq.stride(0), dgs.stride(0), HAS_SCALE=row_scale_R is not None,
            HAS_DOT=part is not None, G_BLOCKS=dgu_blocks, H_BLOCKS=hw_blocks, E_POW2=pow2(E),
            HW_CAST=not is_interpreted(swiglu_bwd_blocks_kernel), num_warps=8, enable_fp_fusion=True)
    return (part, dgq, dgs, (gk.t(), gks) if dgu_blocks else None, (hk.t(), hks) if hw_blocks else None)
