"""Host launchers of the fixed-order slot reductions (combine forward, dx / routing-weight backward).

Legend: T tokens, K slots, D hidden size, R rows of the expert-grouped buffer, P row-dot partials per row,
S chunks, M / N the sizes of a chunked weight gradient.
Determinism: fp32 sums in slot order 0..K-1, shared expert last (chunk sums: chunk order 0..S-1), one cast; no
atomics; no sync.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.combine import chunk_sum_kernel, combine_fwd_kernel, slot_sum_bwd_kernel
from ._common import check_device, is_interpreted, pow2
from .tile_config import combine_block

__all__ = ["chunk_sum", "combine_fwd", "slot_sum_bwd"]

_CHUNK_SUM_BLOCK = 1024
_CHUNK_SUM_BLOCK_INTERPRET = 256


def combine_fwd(y_RD: torch.Tensor, row_of_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                shared_TD: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = cast(sum_{k=0..K-1} w[t,k] * float(y[row_of[t,k]]) + float(shared[t]))`` (reference.combine).

    Args:
        y_RD: (R, D) expert outputs, one row per (token, slot), last dim contiguous.
        row_of_TK: (T, K) int32 row of each (token, slot).
        topk_weights_TK: (T, K) routing weights (any float dtype; used in fp32).
        shared_TD: optional (T, D) shared-expert output.
    Returns:
        out_TD (T, D) in out_dtype (default y's dtype).
    """
    where = "combine_fwd"
    if row_of_TK.dim() != 2 or row_of_TK.dtype != torch.int32:
        raise TypeError(f"{where}: row_of_TK must be 2-D int32, got {row_of_TK.dtype} {tuple(row_of_TK.shape)}")
    T, K = row_of_TK.shape
    D = y_RD.shape[1]
    if topk_weights_TK.shape != (T, K):
        raise ValueError(f"{where}: topk_weights_TK must have shape {(T, K)}, got {tuple(topk_weights_TK.shape)}")
    if shared_TD is not None and shared_TD.shape != (T, D):
        raise ValueError(f"{where}: shared_TD must have shape {(T, D)}, got {tuple(shared_TD.shape)}")
    dev = check_device(combine_fwd_kernel, where, y_RD=y_RD, row_of_TK=row_of_TK, topk_weights_TK=topk_weights_TK,
                       shared_TD=shared_TD)
    out = torch.empty((T, D), dtype=out_dtype or y_RD.dtype, device=dev) if out is None else out
    if T == 0 or D == 0:
        return out
    w = topk_weights_TK.contiguous()
    bt, bd = combine_block(D, interpret=is_interpreted(combine_fwd_kernel))
    grid = (triton.cdiv(T, bt), triton.cdiv(D, bd))
    combine_fwd_kernel[grid](
        y_RD, row_of_TK, w, shared_TD if shared_TD is not None else y_RD, out,
        T, D, y_RD.stride(0), shared_TD.stride(0) if shared_TD is not None else 0, out.stride(0),
        K=K, HAS_SHARED=shared_TD is not None, BLOCK_T=bt, BLOCK_D=bd, num_warps=4, enable_fp_fusion=True,
    )
    return out


def slot_sum_bwd(dx_rows_RD: torch.Tensor | None, row_of_TK: torch.Tensor, dx_shared_TD: torch.Tensor | None,
                 row_dot_RP: torch.Tensor | None, *, num_cols: int, dx_dtype: torch.dtype, dw_dtype: torch.dtype):
    """Backward reductions over the K slots of each token, in fixed slot order, fp32.

    ``dx[t] = cast(sum_k float(dx_rows[row_of[t,k]]) + float(dx_shared[t]))`` (when dx_rows_RD is given) and
    ``dw[t,k] = sum_p row_dot[row_of[t,k], p]`` (when row_dot_RP is given).

    Returns (dx_TD (T, num_cols) or None, dw_TK (T, K) or None).
    """
    where = "slot_sum_bwd"
    T, K = row_of_TK.shape
    D = num_cols
    dev = check_device(slot_sum_bwd_kernel, where, dx_rows_RD=dx_rows_RD, row_of_TK=row_of_TK,
                       dx_shared_TD=dx_shared_TD, row_dot_RP=row_dot_RP)
    has_dx, has_dw = dx_rows_RD is not None, row_dot_RP is not None
    dx = torch.empty((T, D), dtype=dx_dtype, device=dev) if has_dx else None
    dw = torch.empty((T, K), dtype=dw_dtype, device=dev) if has_dw else None
    if T == 0 or not (has_dx or has_dw):
        return dx, dw
    bt, bd = combine_block(D, interpret=is_interpreted(slot_sum_bwd_kernel))
    num_p = row_dot_RP.shape[1] if has_dw else 1
    grid = (triton.cdiv(T, bt), triton.cdiv(D, bd) if has_dx else 1)
    anyt = dx_rows_RD if has_dx else row_dot_RP
    slot_sum_bwd_kernel[grid](
        dx_rows_RD if has_dx else anyt, row_of_TK, dx_shared_TD if dx_shared_TD is not None else anyt,
        row_dot_RP if has_dw else anyt, dx if has_dx else anyt, dw if has_dw else anyt,
        T, D, num_p, dx_rows_RD.stride(0) if has_dx else 0,
        dx_shared_TD.stride(0) if dx_shared_TD is not None else 0, dx.stride(0) if has_dx else 0,
        K=K, HAS_SHARED=dx_shared_TD is not None, HAS_DX=has_dx, HAS_DW=has_dw, P_POW2=pow2(num_p),
        BLOCK_T=bt, BLOCK_D=bd, num_warps=4, enable_fp_fusion=True,
    )
    return dx, dw


def chunk_sum(parts_SMN: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[m, n] = cast(sum_{s=0..S-1} parts[s, m, n])``: fp32 partials summed in chunk order, one cast.

    parts_SMN: (S, M, N) fp32 with a contiguous last dim (e.g. one k-grouped weight gradient per token chunk, or
    the column blocks of a GEMM's output viewed as (S, M, N)). Returns (M, N) contiguous in out_dtype. Bitwise
    deterministic (one program per element block, a fixed order); no sync.
    """
    where = "chunk_sum"
    if (parts_SMN.dim() != 3 or parts_SMN.dtype != torch.float32
            or (parts_SMN.numel() and parts_SMN.shape[2] > 1 and parts_SMN.stride(2) != 1)):
        raise ValueError(f"{where}: parts_SMN must be a 3-D fp32 tensor with a contiguous last dim, got "
                         f"{parts_SMN.dtype} {tuple(parts_SMN.shape)} strides {tuple(parts_SMN.stride())}")
    S, M, N = parts_SMN.shape
    dev = check_device(chunk_sum_kernel, where, parts_SMN=parts_SMN)
    out = torch.empty((M, N), dtype=out_dtype, device=dev)
    numel = M * N
    if numel == 0:
        return out
    if S == 0:
        return out.zero_()
    if (S - 1) * parts_SMN.stride(0) + (M - 1) * parts_SMN.stride(1) + N >= 2 ** 31:
        raise ValueError(f"{where}: {S} x {M} x {N} partials exceed the kernel's int32 chunk offsets")
    block = _CHUNK_SUM_BLOCK_INTERPRET if is_interpreted(chunk_sum_kernel) else _CHUNK_SUM_BLOCK
    chunk_sum_kernel[(triton.cdiv(numel, block),)](parts_SMN, out, numel, N, parts_SMN.stride(0),
                                                   parts_SMN.stride(1), S=S,
                                                   ROWS_CONTIGUOUS=M == 1 or parts_SMN.stride(1) == N, BLOCK=block,
                                                   num_warps=4, enable_fp_fusion=True)
    return out
