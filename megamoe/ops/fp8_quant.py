"""Host launchers of the block-scaled FP8 quantizers: validate, allocate, grid, launch (no sync, no autograd).

The formats are megamoe.reference_fp8's (the specification; bytes and scales equal its functions' bit for
bit): e4m3 values (``torch.float8_e4m3fn``) with fp32 power-of-two scales that multiply on dequantization.

Legend: R rows, C columns, B = ceil(C / 128), E experts (groups), N / K a weight's output / input size,
T rows of a token matrix that rows are gathered from, NB = ceil(R / 128) + E (the static bound on the 128-row
blocks of an expert-grouped buffer).

  * :func:`quantize_1x128` (activations, output gradients): x (R, C) -> q (R, C), s (R, B).
  * :func:`quantize_128x128` (weights): w (E, N, K) or (N, K) -> q like w, s (E, ceil(N/128), ceil(K/128)).
  * :func:`kmajor_128x128` (the input-gradient GEMMs' weight operand): 128x128 blocks (q, s) -> the same values
    with each expert's two dimensions stored in the other order (a byte copy, no requantization).
  * :func:`quantize_128x1_grouped` (weight-gradient operands): rows of an expert-grouped buffer, cut into 128-row
    blocks from each expert's first row -> q (R, C) in the buffer's row order, or with ``kmajor=True`` block-padded
    and transposed (NB * 128, C) (the weight-gradient GEMM's K-major operand), s (NB, C).

Inputs: bf16, fp16 or fp32, any strides: read in place when contiguous and 16-byte aligned, otherwise first copied
to such a tensor (one extra read and write of the input). The kernels read the input through the offsets they write
the output with, so that each e4m3 byte tile is cast in the layout that stores it (kernels.fp8_quant says why; the
K-major variant moves int32 words, not bytes). Outputs are contiguous and 16-byte aligned (the K-major bytes: a
transposed view of such a buffer); pass ``out`` / ``scale_out`` to write into existing buffers (every element of
the specified part is overwritten). Nothing reads device values on the host: no sync, CUDA-graph
capturable (grids depend on shapes only). CPU tensors work when TRITON_INTERPRET=1 was set before triton was
imported.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.fp8_quant import (
    kmajor_128x128_kernel,
    quantize_1x128_kernel,
    quantize_128x1_grouped_kernel,
    quantize_128x128_kernel,
)
from ._common import check_device, check_row_count, is_interpreted, pow2
from .routing import tile_offsets_for

__all__ = ["quantize_1x128", "quantize_128x128", "kmajor_128x128", "quantize_128x1_grouped", "E4M3", "SCALE_BLOCK"]

E4M3 = torch.float8_e4m3fn
SCALE_BLOCK = 128
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ROWS_PER_PROGRAM = 32  # 1x128: a (32, 128) tile per program
_COLS_PER_PROGRAM = 64  # 128x1: a (128, 64) tile per program, 4 warps
# 128x1 written K-major: a (128, 128) tile per program, 2 warps (H200, qwen3-30b-a3b:16384's gathered x rows:
# 0.28 ms against 0.46 for (128, 64) with 4 warps; 8 warps was slowest at every width)
_KMAJOR_COLS, _KMAJOR_WARPS = 128, 2
_ALIGN = 16  # bytes: the pointer alignment Triton specializes on


def _check_input(name: str, x, dims: tuple[int, ...], where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        raise ValueError(f"{where}: {name} must be {' or '.join(f'{d}-D' for d in dims)}, got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{where}: {name} dtype {x.dtype} not supported (bf16, fp16, fp32)")


def _output(out, shape: tuple, dtype: torch.dtype, device, name: str, where: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous()
            or (dtype == E4M3 and out.data_ptr() % _ALIGN)):
        raise ValueError(f"{where}: {name} must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}"
                         f"{f', {_ALIGN}-byte aligned' if dtype == E4M3 else ''}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device} at {out.data_ptr() % _ALIGN} bytes past an alignment")
    return out


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x itself when contiguous and 16-byte aligned (laid out like the kernels' outputs), else such a copy."""
    if x.is_contiguous() and x.data_ptr() % _ALIGN == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def _check_int32(name: str, t, shape: tuple, where: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{where}: {name} must be a contiguous int32 tensor of shape {shape}, got {got}")


def quantize_1x128(x_RC: torch.Tensor, *, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                   valid_rows_1: torch.Tensor | None = None,
                   idx_R: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 block quantization of rows: x (R, C) -> (q_RC e4m3, s_RB fp32), as
    megamoe.reference.quantize_1x128 (bit for bit). out / scale_out: optional (R, C) e4m3 / (R, B) fp32.
    valid_rows_1: optional (1,) int32 device tensor n: only rows [0, min(n, R)) are quantized (the rows of a receive
    round, whose count only the device knows), the other rows of q and s are not written. idx_R: optional (R,)
    int32 device row index into x (then a (T, C) token matrix): row r of q is ``x[idx_R[r]]`` quantized, the rows
    gathered into expert order for a GEMM without a gather (indices trusted, as by the grouped GEMMs). Sync: none."""
    where = "quantize_1x128"
    _check_input("x_RC", x_RC, (2,), where)
    if idx_R is not None:
        _check_int32("idx_R", idx_R, (idx_R.shape[0] if isinstance(idx_R, torch.Tensor) else -1,), where)
    check_row_count(where, valid_rows_1)
    dev = check_device(quantize_1x128_kernel, where, x_RC=x_RC, out=out, scale_out=scale_out,
                       valid_rows_1=valid_rows_1, idx_R=idx_R)
    x_RC = _dense(x_RC)
    R, C = x_RC.shape
    if idx_R is not None:
        R = idx_R.shape[0]
    B = triton.cdiv(C, SCALE_BLOCK)
    q = _output(out, (R, C), E4M3, dev, "out", where)
    s = _output(scale_out, (R, B), torch.float32, dev, "scale_out", where)
    if R and C:
        grid = (triton.cdiv(R, _ROWS_PER_PROGRAM), B)
        quantize_1x128_kernel[grid](x_RC, q.view(torch.uint8), s, s if valid_rows_1 is None else valid_rows_1,
                                    s if idx_R is None else idx_R, R, C, BLOCK_R=_ROWS_PER_PROGRAM,
                                    HW_CAST=not is_interpreted(quantize_1x128_kernel),
                                    HAS_COUNT=valid_rows_1 is not None, HAS_IDX=idx_R is not None, num_warps=4,
                                    enable_fp_fusion=True)
    return q, s


def quantize_128x128(w_ENK: torch.Tensor, *, out: torch.Tensor | None = None,
                     scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block quantization of weights: w (E, N, K) -> (q e4m3 (E, N, K), s fp32 (E, ceil(N/128),
    ceil(K/128))); a 2-D (N, K) weight gives q (N, K), s (ceil(N/128), ceil(K/128)). As
    megamoe.reference.quantize_128x128 (bit for bit). out / scale_out: optional, shaped like the results."""
    where = "quantize_128x128"
    _check_input("w", w_ENK, (2, 3), where)
    dev = check_device(quantize_128x128_kernel, where, w=w_ENK, out=out, scale_out=scale_out)
    w3 = _dense(w_ENK if w_ENK.dim() == 3 else w_ENK.unsqueeze(0))
    E, N, K = w3.shape
    lead = tuple(w_ENK.shape[:-2])
    q = _output(out, (*lead, N, K), E4M3, dev, "out", where)
    s = _output(scale_out, (*lead, triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK)), torch.float32, dev,
                "scale_out", where)
    if E and N and K:
        grid = (triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK), E)
        quantize_128x128_kernel[grid](w3, q.view(torch.uint8), s, N, K,
                                      HW_CAST=not is_interpreted(quantize_128x128_kernel), num_warps=8,
                                      enable_fp_fusion=True)
    return q, s


def kmajor_128x128(q_ENK: torch.Tensor, s_E_NB_KB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 weight blocks (:func:`quantize_128x128`'s q (E, N, K) or (N, K) e4m3 and s (E, NB, KB) or (NB, KB)
    fp32, both contiguous) with each expert's last two dimensions stored in the other order: (qk, sk) of the same
    shapes and values, ``qk.transpose(-2, -1)`` and ``sk.transpose(-2, -1)`` contiguous (the K-major weight operand
    of the input-gradient GEMMs, which read w[e] as (K, N)). A byte copy, bit for bit
    ``t.transpose(-2, -1).contiguous().transpose(-2, -1)`` of each, in one launch."""
    where = "kmajor_128x128"
    for name, t, dtype in (("q", q_ENK, E4M3), ("s", s_E_NB_KB, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.dim() not in (2, 3) or not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be a contiguous 2-D or 3-D {dtype} tensor, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")
    N, K = q_ENK.shape[-2:]
    want = (*q_ENK.shape[:-2], triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK))
    if tuple(s_E_NB_KB.shape) != want:
        raise ValueError(f"{where}: s must be the scales of q's 128x128 blocks, shape {want}, got "
                         f"{tuple(s_E_NB_KB.shape)}")
    dev = check_device(kmajor_128x128_kernel, where, q=q_ENK, s=s_E_NB_KB)
    lead = tuple(q_ENK.shape[:-2])
    qk = torch.empty((*lead, K, N), dtype=E4M3, device=dev)
    sk = torch.empty((*lead, want[-1], want[-2]), dtype=torch.float32, device=dev)
    E = q_ENK.shape[0] if lead else 1
    if E and N and K:
        kmajor_128x128_kernel[(want[-2], want[-1], E)](q_ENK.view(torch.uint8), s_E_NB_KB, qk.view(torch.uint8), sk,
                                                       N, K, num_warps=4, enable_fp_fusion=True)
    return qk.transpose(-2, -1), sk.transpose(-2, -1)


def quantize_128x1_grouped(x: torch.Tensor, offsets_E1: torch.Tensor, idx_R: torch.Tensor | None = None,
                           block_offsets: torch.Tensor | None = None, *, num_rows: int | None = None,
                           kmajor: bool = False, out: torch.Tensor | None = None,
                           scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 block quantization along the rows of an expert-grouped buffer: (q_RC e4m3, s_BC fp32), as
    megamoe.reference.quantize_128x1_grouped (bit for bit on the specified part).

    Args:
        x: (R, C) the buffer, or with ``idx_R`` a (T, C) token matrix whose rows are gathered (row r is
            ``x[idx_R[r]]``).
        offsets_E1: (E+1,) int32, non-decreasing, ``offsets_E1[E] <= R``: expert e owns rows
            ``offsets[e]:offsets[e+1]``.
        idx_R: optional (R,) int32 row index into x.
        block_offsets: optional (E+1,) int32, the m-tile table for BLOCK_M = 128 of these offsets
            (``megamoe.ops.tile_offsets_for(offsets_E1, 128)``, e.g. from a GEMM's tile cache); computed when
            None.
        num_rows: R when neither idx_R nor x gives it (default: idx_R's length, else x's rows).
        kmajor: write the bytes block-padded and transposed (the layout the FP8 weight-gradient GEMM reads fastest,
            ``megamoe.ops.fp8_gemm.fp8_k_grouped_mm(..., padded=True)``) instead of in the buffer's row order.
        out / scale_out: optional (R, C) e4m3 / (NB, C) fp32 buffers, NB = ceil(R / 128) + E (``out`` not with
            kmajor).

    Returns q (R, C): rows ``offsets[0]:offsets[E]`` written; or with kmajor q (NB * 128, C), the transposed view
    ``buf.t()`` of a contiguous (C, NB * 128) buffer, block b = rows [128b, 128b + 128): expert e's block j at
    b = ``block_offsets[e] + j``, its rows past the expert's last written as zeros, blocks from
    ``block_offsets[E]`` on not written; s (NB, C): rows ``[0, block_offsets[E])`` written (expert e's block j
    is row ``block_offsets[e] + j``). Other rows are not written (unspecified).
    Device values are trusted (offsets in range, idx in [0, T)), as by the grouped GEMMs: no sync.
    """
    where = "quantize_128x1_grouped"
    _check_input("x", x, (2,), where)
    if offsets_E1.dim() != 1 or offsets_E1.shape[0] < 1:
        raise ValueError(f"{where}: offsets_E1 must be 1-D of E + 1 >= 1 entries, got {tuple(offsets_E1.shape)}")
    E = offsets_E1.shape[0] - 1
    _check_int32("offsets_E1", offsets_E1, (E + 1,), where)
    R = num_rows if num_rows is not None else (idx_R.shape[0] if idx_R is not None else x.shape[0])
    if idx_R is not None:
        _check_int32("idx_R", idx_R, (R,), where)
    elif R > x.shape[0]:
        raise ValueError(f"{where}: num_rows={R} exceeds x's {x.shape[0]} rows (no idx_R)")
    if block_offsets is not None:
        _check_int32("block_offsets", block_offsets, (E + 1,), where)
    dev = check_device(quantize_128x1_grouped_kernel, where, x=x, offsets_E1=offsets_E1, idx_R=idx_R,
                       block_offsets=block_offsets, out=out, scale_out=scale_out)
    if idx_R is not None and x.shape[1] == 1:  # one column: gathered here (the kernel's rows would differ)
        x, idx_R = x.index_select(0, idx_R), None
    x = _dense(x)
    C = x.shape[1]
    NB = triton.cdiv(R, SCALE_BLOCK) + E
    if kmajor and out is not None:
        raise ValueError(f"{where}: out is not taken with kmajor=True (the bytes go to a new transposed buffer)")
    if kmajor:
        q_buf = torch.empty((C, NB * SCALE_BLOCK), dtype=E4M3, device=dev)  # rows of 128 * NB bytes: aligned
        q = q_buf.t()
    else:
        q = q_buf = _output(out, (R, C), E4M3, dev, "out", where)
    s = _output(scale_out, (NB, C), torch.float32, dev, "scale_out", where)
    if R == 0 or C == 0 or E == 0:
        return q, s
    if block_offsets is None:
        block_offsets = tile_offsets_for(offsets_E1, SCALE_BLOCK)
    cols, warps = (_KMAJOR_COLS, _KMAJOR_WARPS) if kmajor else (_COLS_PER_PROGRAM, 4)
    grid = (NB, triton.cdiv(C, cols))
    quantize_128x1_grouped_kernel[grid](
        x, idx_R if idx_R is not None else offsets_E1, offsets_E1, block_offsets,
        q_buf.view(torch.int32) if kmajor else q_buf.view(torch.uint8), s, C, E, q_buf.shape[1],
        GATHER=idx_R is not None, E_POW2=pow2(E), BLOCK_C=cols, KMAJOR=kmajor,
        HW_CAST=not is_interpreted(quantize_128x1_grouped_kernel), num_warps=warps, enable_fp_fusion=True)
    return q, s
