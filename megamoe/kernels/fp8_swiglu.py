"""The FP8 layer's SwiGLU passes (``@triton.jit`` only; launchers in megamoe.ops.fp8_swiglu): they run on the
output of a plain FP8 grouped GEMM (megamoe.kernels.fp8_gemm or the Gluon kernel) and quantize what the next GEMM
reads 1x128.

Legend: R rows of a round's expert-ordered row buffer; F the expert FFN width (G = 2F: gate columns [0, F), up
columns [F, 2F)); QB = 128, the scale group.

* ``swiglu_rows_kernel`` (forward): ``h = cast(silu(g) * u)`` from [g | u] (R, 2F) rounded to the activation
  dtype (the bf16 path's expression, megamoe.kernels.grouped_gemm), quantized 1x128 into (q, s).
* ``swiglu_bwd_rows_kernel`` (backward): on the dgrad's fp32 accumulator ``acc = dY @ W2[e]`` (R, F) and the saved
  [g | u]: the row-dot partials ``sum_n acc * h`` per 128 columns (h recomputed exactly as the forward did; the
  routing-weight gradient), ``dh = cast(acc * scale)``, ``[dg | du]`` (R, 2F) stored and quantized 1x128,
  ``cast(h * scale)`` (the down weight gradient's operand). The bf16 path's expressions; a 128-column block is
  read as two 64-column halves, and its row-dot partial is the first half's sum plus the second's.

Program (i, p): BLOCK_M rows x the 128 columns [128p, 128p + 128); only the first ``n_ptr[0]`` rows (a count on the
device: a receive round's rows) are read and written. Bytes are stored through uint8 pointers; quantization by
megamoe.kernels.fp8_quant's helpers (HW_CAST: the hardware cast on the GPU, integer rounding under the
interpreter). SiLU: silu(x) = x * s, silu'(x) = s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)).
"""

import triton
import triton.language as tl

from .fp8_quant import abs_bits, as_fp32, e4m3_bytes, pow2_scale, quantize_block_rows
from .grouped_gemm import swiglu_h


@triton.jit
def _store_quantized(x, out_rows, n0, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, NQ, HW_CAST: tl.constexpr):
    """Quantize the (BLOCK_M, 128) tile x (columns [n0, n0 + 128) of an NQ-column matrix) and store bytes and
    scales (rows of mask_m; a tile past NQ stores nothing)."""
    q, s = quantize_block_rows(x, HW_CAST)  # e4m3 bytes (uint8), scale per row
    offs = n0 + tl.arange(0, 128)
    tl.store(q_ptr + out_rows[:, None] * stride_qm + offs[None, :], q,
             mask=mask_m[:, None] & (offs < NQ)[None, :])
    tl.store(qs_ptr + out_rows * stride_qsm + n0 // 128, s, mask=mask_m & (out_rows * 0 + n0 < NQ))


@triton.jit
def _swiglu_bwd_values(acc, offs_n, rows, mask_n, scale, gu_ptr, c_ptr, N, stride_gm, HAS_SCALE: tl.constexpr):
    """SwiGLU backward values on a column block: (row-dot partial ``sum_n acc * h``, h * scale, dg, du), the last
    three rounded to C's dtype (held in fp32). The bf16 path's expressions (megamoe.kernels.grouped_gemm, whose
    epilogue stores them at once); returned here so the caller can quantize dg, du across both halves of a block."""
    out_ty = c_ptr.dtype.element_ty
    g_ptrs = gu_ptr + rows[:, None] * stride_gm + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0).to(tl.float32)
    up = tl.load(g_ptrs + N, mask=mask_n[None, :], other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    h = (gate * sig * up).to(out_ty).to(tl.float32)  # bitwise the forward's h (_swiglu_h)
    part = tl.sum(tl.where(mask_n[None, :], acc * h, 0.0), axis=1)
    if HAS_SCALE:
        acc = acc * scale[:, None]
        h = h * scale[:, None]
    dh = acc.to(out_ty).to(tl.float32)
    d_up = (dh * (gate * sig)).to(out_ty).to(tl.float32)
    d_gate = ((dh * up) * sig * (1.0 + gate * (1.0 - sig))).to(out_ty).to(tl.float32)
    return part, h.to(out_ty).to(tl.float32), d_gate, d_up


@triton.jit
def _store_pair(lo, hi, offs_lo, out_rows, mask_m, ptr, stride, N):
    """Store two 64-column halves (columns offs_lo and offs_lo + 64) of rows out_rows (columns < N)."""
    ptrs = ptr + out_rows[:, None] * stride + offs_lo[None, :]
    mask = mask_m[:, None] & (offs_lo < N)[None, :]
    tl.store(ptrs, lo.to(ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + 64, hi.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_pair_quantized(lo, hi, offs_lo, out_rows, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, NQ,
                          HW_CAST: tl.constexpr):
    """1x128-quantize the block held as two 64-column halves (columns offs_lo, offs_lo + 64 of an NQ-column
    matrix, offs_lo[0] a multiple of 128) and store its bytes and scales."""
    amax_bits = tl.maximum(tl.max(abs_bits(lo), axis=1), tl.max(abs_bits(hi), axis=1))  # NaN > Inf > finite
    inv, s, finite = pow2_scale(amax_bits)
    q_lo = e4m3_bytes(tl.where(finite[:, None], lo * inv[:, None], 0.0), HW_CAST)
    q_hi = e4m3_bytes(tl.where(finite[:, None], hi * inv[:, None], 0.0), HW_CAST)
    _store_pair(q_lo, q_hi, offs_lo, out_rows, mask_m, q_ptr, stride_qm, NQ)
    n0 = tl.min(offs_lo, axis=0)
    tl.store(qs_ptr + out_rows * stride_qsm + n0 // 128, s, mask=mask_m & (out_rows * 0 + n0 < NQ))


@triton.jit
def swiglu_bwd_cols(acc_lo, acc_hi, offs_lo, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr, qs_ptr, N,
                    stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE: tl.constexpr,
                    HW_CAST: tl.constexpr):
    """SwiGLU backward on the 128 columns ``offs_lo[0] + [0, 128)`` (offs_lo: the first 64, offs_lo[0] a multiple
    of 128) given as two 64-column halves of the accumulator (the bf16 path's structure, so the row-dot partial is
    the same sum): h * scale into AUX, [dg | du] into C and quantized 1x128 into (q, qs); returns the row-dot
    partial (first half's sum + second half's). Also called by the Gluon dgrad's epilogue
    (megamoe.kernels.fp8_dgrad_gluon) on tiles in the layout this pass compiles to, hence the same bits."""
    part_lo, h_lo, dg_lo, du_lo = _swiglu_bwd_values(acc_lo, offs_lo, rows, offs_lo < N, scale, gu_ptr, c_ptr, N,
                                                     stride_gm, HAS_SCALE)
    part_hi, h_hi, dg_hi, du_hi = _swiglu_bwd_values(acc_hi, offs_lo + 64, rows, offs_lo < N, scale, gu_ptr, c_ptr,
                                                     N, stride_gm, HAS_SCALE)
    _store_pair(h_lo, h_hi, offs_lo, out_rows, mask_m, aux_ptr, stride_xm, N)
    _store_pair(dg_lo, dg_hi, offs_lo, out_rows, mask_m, c_ptr, stride_cm, N)
    _store_pair(du_lo, du_hi, offs_lo, out_rows, mask_m, c_ptr + N, stride_cm, N)
    _store_pair_quantized(dg_lo, dg_hi, offs_lo, out_rows, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, N, HW_CAST)
    _store_pair_quantized(du_lo, du_hi, offs_lo + N, out_rows, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, 2 * N,
                          HW_CAST)
    return part_lo + part_hi


@triton.jit
def swiglu_rows_kernel(gu_ptr, n_ptr, q_ptr, qs_ptr, num_rows, N, stride_gm, stride_qm, stride_qsm,
                       HW_CAST: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (i, p): h = silu(g) * u on rows [i * BLOCK_M, ...) x columns [128p, 128p + 128) of [g | u]
    (num_rows, 2N) in the activation dtype (megamoe.kernels.grouped_gemm.swiglu_h, the bf16 epilogue's, one
    rounding to that dtype), quantized 1x128 into (q, qs); only the first ``n_ptr[0]`` rows (a count on the device)
    are read and written."""
    out_ty = gu_ptr.dtype.element_ty
    n_valid = tl.minimum(num_rows, tl.load(n_ptr))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_valid
    rows = offs_m.to(tl.int64)
    n0 = tl.program_id(1) * 128
    cols = n0 + tl.arange(0, 128)
    ptrs = gu_ptr + rows[:, None] * stride_gm + cols[None, :]
    mask = mask_m[:, None] & (cols < N)[None, :]
    gate = as_fp32(tl.load(ptrs, mask=mask, other=0.0))
    up = as_fp32(tl.load(ptrs + N, mask=mask, other=0.0))
    h = swiglu_h(gate, up).to(out_ty).to(tl.float32)
    _store_quantized(h, rows, n0, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, N, HW_CAST)


@triton.jit
def swiglu_bwd_rows_kernel(acc_ptr, n_ptr, scale_ptr, gu_ptr, c_ptr, aux_ptr, dot_ptr, q_ptr, qs_ptr, num_rows, N,
                           stride_am, stride_cm, stride_gm, stride_xm, stride_qm, stride_qsm,
                           HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, HW_CAST: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    """Program (i, p): the SwiGLU backward on rows [i * BLOCK_M, ...) x columns [128p, 128p + 128) of a dgrad
    accumulator written in fp32 by a plain GEMM (acc (num_rows, N)), read as two 64-column halves; only the first
    ``n_ptr[0]`` rows (a count on the device) are read and written."""
    n_valid = tl.minimum(num_rows, tl.load(n_ptr))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_valid
    rows = tl.minimum(offs_m, num_rows - 1).to(tl.int64)  # clamped rows: computed, never stored
    p = tl.program_id(1)
    n0 = p * 128
    cols = n0 + tl.arange(0, 64)
    mask = mask_m[:, None] & (cols < N)[None, :]
    acc_ptrs = acc_ptr + rows[:, None] * stride_am + cols[None, :]
    acc_lo = tl.load(acc_ptrs, mask=mask, other=0.0)
    acc_hi = tl.load(acc_ptrs + 64, mask=mask, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows).to(tl.float32)
    else:
        scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    out_rows = offs_m.to(tl.int64)
    part = swiglu_bwd_cols(acc_lo, acc_hi, cols, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr, qs_ptr,
                           N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE, HW_CAST)
    if HAS_DOT:
        tl.store(dot_ptr + out_rows * (N // 128) + p, part, mask=mask_m)
