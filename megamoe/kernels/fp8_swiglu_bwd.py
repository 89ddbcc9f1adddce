"""The FP8 SwiGLU-backward pass that also makes the weight-gradient operands' 128x1 blocks (``@triton.jit`` only;
launcher: megamoe.ops.fp8_gemm.fp8_swiglu_bwd_128x1).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``), E experts,
F the FFN width (N here), NB 128-row blocks (the m-tile table for BLOCK_M = 128), QB = 128.

``swiglu_bwd_128x1_kernel``: program (b, p) = one 128-row block b of one expert x the 128 columns [128p, 128p + 128)
of a dgrad accumulator a plain GEMM wrote in fp32 (acc (R, F)). The values are megamoe.kernels.fp8_gemm's
``swiglu_bwd_values`` on the same accumulator, saved [g | u] and row scale, on two 64-column halves as the fused
epilogue and the row pass compute them (so h * scale, dg and du are rounded to the activation dtype first, and
the row-dot partial is the same two-half sum), and the program writes:
  * dgu's 1x128 blocks (the dx GEMM's operand) and the row-dot partials, per row, as the row pass does;
  * dgu's and hw's 128x1 blocks, block-padded and transposed (K-major: column c's block b at
    ``q[c * ld + 128 b:][:128]``, the weight-gradient GEMM's operand), rows past the expert's end as zeros, and
    their scales (NB, 2F) / (NB, F): the bytes and scales of megamoe.kernels.fp8_quant's K-major 128x1 quantizer
    on the 16-bit dgu and hw, which are never written.
The block's rows are read as two (64, 128) tiles, rows 4w + k of k = 0, 1 and of k = 2, 3 (cut into the four (32, .)
tiles of rows 4w + k that megamoe.kernels.fp8_quant.store_128x1_kmajor packs into K-major words), and h, dg, du are
made one at a time (each pass reloads the tiles and recomputes the cheap SwiGLU pieces), so that one value's two
tiles are live at once (held in the 16-bit dtype: the values are rounded to it anyway). With 8 warps a (64, 64) tile
gets the row pass's per-row layout (a row's 64 columns over 4 lanes of 16, warps along rows): the row-dot partial is a
``tl.sum`` whose association on the GPU follows that layout (tests/test_fp8_gemm_compile.py checks it). Rows past the
expert's end are never loaded from acc (masked) nor stored; their [g | u] and scale loads read the expert's last row
(clamped) and the values are replaced by zeros.
"""

import triton
import triton.language as tl

from .fp8_gemm import store_pair_quantized, swiglu_bwd_values
from .fp8_quant import as_fp32, store_128x1_kmajor
from .tiles import expert_of_tile


@triton.jit
def _values(acc_ptr, scale_ptr, gu_ptr, r, row_end, n0, N, stride_am, stride_gm, HAS_SCALE: tl.constexpr):
    """Rows r (64,) x columns [n0, n0 + 128): (valid rows, row-dot partial, h * scale, dg, du), the last three as
    (lo, hi) 64-column halves rounded to [g | u]'s dtype (held in fp32), zeros in rows past row_end."""
    valid = r < row_end
    rows = tl.minimum(r, row_end - 1).to(tl.int64)  # clamped into the expert: loaded, never stored
    offs_lo = n0 + tl.arange(0, 64)
    mask = valid[:, None] & (offs_lo < N)[None, :]
    acc_ptrs = acc_ptr + rows[:, None] * stride_am + offs_lo[None, :]
    acc_lo = tl.load(acc_ptrs, mask=mask, other=0.0)
    acc_hi = tl.load(acc_ptrs + 64, mask=mask, other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows).to(tl.float32)
    else:
        scale = tl.full(r.shape, 1.0, tl.float32)
    part_lo, h_lo, dg_lo, du_lo = swiglu_bwd_values(acc_lo, offs_lo, rows, offs_lo < N, scale, gu_ptr, gu_ptr, N,
                                                    stride_gm, HAS_SCALE)
    part_hi, h_hi, dg_hi, du_hi = swiglu_bwd_values(acc_hi, offs_lo + 64, rows, offs_lo < N, scale, gu_ptr, gu_ptr,
                                                    N, stride_gm, HAS_SCALE)
    z = valid[:, None]
    return (valid, part_lo + part_hi, tl.where(z, h_lo, 0.0), tl.where(z, h_hi, 0.0), tl.where(z, dg_lo, 0.0),
            tl.where(z, dg_hi, 0.0), tl.where(z, du_lo, 0.0), tl.where(z, du_hi, 0.0))


@triton.jit
def _h_tile(acc_ptr, scale_ptr, gu_ptr, dot_ptr, r, row_end, p, N, stride_am, stride_gm, HAS_SCALE: tl.constexpr,
            HAS_DOT: tl.constexpr):
    """h * scale of rows r as (lo, hi) halves; stores the rows' row-dot partials (HAS_DOT)."""
    valid, part, h_lo, h_hi, _, _, _, _ = _values(acc_ptr, scale_ptr, gu_ptr, r, row_end, p * 128, N, stride_am,
                                                  stride_gm, HAS_SCALE)
    if HAS_DOT:
        tl.store(dot_ptr + r.to(tl.int64) * (N // 128) + p, part, mask=valid)
    out_ty = gu_ptr.dtype.element_ty
    return h_lo.to(out_ty), h_hi.to(out_ty)


@triton.jit
def _dgu_tile(acc_ptr, scale_ptr, gu_ptr, q_ptr, qs_ptr, r, row_end, n0, N, stride_am, stride_gm, stride_qm,
              stride_qsm, UP: tl.constexpr, HAS_SCALE: tl.constexpr, HW_CAST: tl.constexpr):
    """dg (UP: du) of rows r as (lo, hi) halves; stores their 1x128 block (columns n0, UP: N + n0, of dgu)."""
    valid, _, _, _, dg_lo, dg_hi, du_lo, du_hi = _values(acc_ptr, scale_ptr, gu_ptr, r, row_end, n0, N, stride_am,
                                                         stride_gm, HAS_SCALE)
    offs_lo = n0 + tl.arange(0, 64)
    if UP:
        lo, hi = du_lo, du_hi
        store_pair_quantized(lo, hi, offs_lo + N, r.to(tl.int64), valid, q_ptr, qs_ptr, stride_qm, stride_qsm,
                             2 * N, HW_CAST)
    else:
        lo, hi = dg_lo, dg_hi
        store_pair_quantized(lo, hi, offs_lo, r.to(tl.int64), valid, q_ptr, qs_ptr, stride_qm, stride_qsm, N,
                             HW_CAST)
    out_ty = gu_ptr.dtype.element_ty
    return lo.to(out_ty), hi.to(out_ty)


@triton.jit
def _unpair(x):
    """A (64, 64) tile of rows 4w + k, 4w + k + 1 (rows w, 32 + w) as its two (32, 64) tiles."""
    return tl.split(tl.permute(tl.reshape(x, (2, 32, 64)), (1, 2, 0)))


@triton.jit
def _store_block_128x1(xa, xb, k_ptr, ks_ptr, blk, cols, C, ld_k, HW_CAST: tl.constexpr):
    """The 128x1 block of columns ``cols`` of a C-column operand, held as two (64, 64) tiles (rows 4w + k of k = 0, 1
    and of k = 2, 3): K-major bytes and scales."""
    mask_c = cols < C
    x0, x1 = _unpair(as_fp32(xa))
    x2, x3 = _unpair(as_fp32(xb))
    s = store_128x1_kmajor(x0, x1, x2, x3, k_ptr, blk, cols, mask_c, ld_k, HW_CAST)
    tl.store(ks_ptr + blk.to(tl.int64) * C + cols, s, mask=mask_c)


@triton.jit
def _dgu_pass(acc_ptr, scale_ptr, gu_ptr, q_ptr, qs_ptr, dgk_ptr, dgks_ptr, blk, ra, rb, row_end, n0, N, ld_k,
              stride_am, stride_gm, stride_qm, stride_qsm, UP: tl.constexpr, HAS_SCALE: tl.constexpr,
              HW_CAST: tl.constexpr):
    """dg (UP: du) of the block: its 1x128 blocks per row, then its 128x1 blocks (dgu's columns n0, UP: N + n0)."""
    a0, b0 = _dgu_tile(acc_ptr, scale_ptr, gu_ptr, q_ptr, qs_ptr, ra, row_end, n0, N, stride_am, stride_gm,
                       stride_qm, stride_qsm, UP, HAS_SCALE, HW_CAST)
    a1, b1 = _dgu_tile(acc_ptr, scale_ptr, gu_ptr, q_ptr, qs_ptr, rb, row_end, n0, N, stride_am, stride_gm,
                       stride_qm, stride_qsm, UP, HAS_SCALE, HW_CAST)
    if UP:
        c = N + n0 + tl.arange(0, 64)
    else:
        c = n0 + tl.arange(0, 64)
    _store_block_128x1(a0, a1, dgk_ptr, dgks_ptr, blk, c, 2 * N, ld_k, HW_CAST)
    _store_block_128x1(b0, b1, dgk_ptr, dgks_ptr, blk, c + 64, 2 * N, ld_k, HW_CAST)


@triton.jit
def swiglu_bwd_128x1_kernel(acc_ptr, offsets_ptr, block_offsets_ptr, scale_ptr, gu_ptr, dot_ptr, q_ptr, qs_ptr,
                            dgk_ptr, dgks_ptr, hk_ptr, hks_ptr, num_experts, N, ld_k, stride_am, stride_gm,
                            stride_qm, stride_qsm, HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr,
                            HW_CAST: tl.constexpr, E_POW2: tl.constexpr):
    """Program (b, p): block b of the m-tile table ``block_offsets`` (BLOCK_M = 128) x columns [128p, 128p + 128)
    of acc (R, N): row-dot partials into dot (R, N / 128), dgu's 1x128 blocks into (q (R, 2N) uint8, qs (R, 2N /
    128)), dgu's and hw's 128x1 K-major blocks into dgk / hk (int32 words of (2N, ld_k) / (N, ld_k) byte buffers,
    ld_k = 128 NB bytes) and their scales dgks (NB, 2N) / hks (NB, N). Programs past the last block return."""
    blk = tl.program_id(0)
    if blk < tl.load(block_offsets_ptr + num_experts):
        _, row_start, row_end = expert_of_tile(block_offsets_ptr, offsets_ptr, blk, num_experts, E_POW2, 128)
        p = tl.program_id(1)
        n0 = p * 128
        i = tl.arange(0, 64)
        ra = row_start + 4 * (i % 32) + i // 32  # rows 4w + k of k = 0, 1 as one (64, .) tile
        rb = ra + 2  # k = 2, 3
        ha_lo, ha_hi = _h_tile(acc_ptr, scale_ptr, gu_ptr, dot_ptr, ra, row_end, p, N, stride_am, stride_gm, HAS_SCALE,
                               HAS_DOT)
        hb_lo, hb_hi = _h_tile(acc_ptr, scale_ptr, gu_ptr, dot_ptr, rb, row_end, p, N, stride_am, stride_gm, HAS_SCALE,
                               HAS_DOT)
        c = n0 + tl.arange(0, 64)
        _store_block_128x1(ha_lo, hb_lo, hk_ptr, hks_ptr, blk, c, N, ld_k, HW_CAST)
        _store_block_128x1(ha_hi, hb_hi, hk_ptr, hks_ptr, blk, c + 64, N, ld_k, HW_CAST)
        _dgu_pass(acc_ptr, scale_ptr, gu_ptr, q_ptr, qs_ptr, dgk_ptr, dgks_ptr, blk, ra, rb, row_end, n0, N, ld_k,
                  stride_am, stride_gm, stride_qm, stride_qsm, False, HAS_SCALE, HW_CAST)
        _dgu_pass(acc_ptr, scale_ptr, gu_ptr, q_ptr, qs_ptr, dgk_ptr, dgks_ptr, blk, ra, rb, row_end, n0, N, ld_k,
                  stride_am, stride_gm, stride_qm, stride_qsm, True, HAS_SCALE, HW_CAST)
