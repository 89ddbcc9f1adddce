"""Block-scaled FP8 (e4m3) grouped GEMM kernels of the routed experts (``@triton.jit`` only; launchers in
megamoe.ops.fp8_gemm). The formats are DeepSeek-V3's: 1x128 row blocks for activations and gradients, 128x128
blocks for weights, 128x1 token blocks for the weight-gradient operands, fp32 power-of-two dequantization
scales (docs of megamoe.ops.fp8_gemm).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``);
E experts; N output columns; K reduction size (multiples of 128); F FFN width (N of the SwiGLU GEMMs);
QB = 128, the scale group; NB scale blocks.

* ``fp8_m_grouped_kernel``: ``C[r] = deq(A)[row(r)] @ deq(B[e])`` (forward "nt": B[e] stored (N, K); dgrad
  "nn": the same bytes read (K, N) through strides, the scale grid transposed the same way). Persistent
  grid over (m-tile, n-tile) tiles, m-tiles never straddling two experts (megamoe.kernels.tiles.
  expert_of_tile); ``row(r)`` is r or ``a_idx[r]`` (gather: A's row scales are gathered the same way).
  Promotion: BLOCK_K = QB, every K-block's ``p = dot(a, b)`` starts from zero (the tensor cores'
  FP8 accumulation never spans more than 128 of K) and is added as ``acc += p * (sa[:, None] * sb[None, :])``
  in fp32, K-blocks in increasing order: bitwise reproducible, no atomics, no split-K. Epilogues
  (megamoe.kernels.grouped_gemm's numbering):
    PLAIN:      C = cast(acc [* scale[r]]).
    SWIGLU:     two accumulators (gate columns n, up columns N + n of B[e]); g, u rounded to the output
                dtype, optionally stored as [g | u]; ``h = cast(silu(g) * u)`` quantized 1x128 into
                (HQ e4m3, HS fp32): the bf16 path's g, u, h bits for the same accumulators.
    SWIGLU_BWD: acc = dY @ W2[e]: row-dot partials ``sum_n acc * h`` per 128 columns (h recomputed from the
                saved [g | u] as the forward did), ``dh = cast(acc * scale)``, ``[dg | du]`` into C (R x 2F)
                and quantized 1x128 into (HQ, HS) (R x 2F, R x 2F/QB), ``cast(h * scale)`` into AUX.
* ``fp8_k_grouped_kernel``: ``C[e] = sum over expert e's 128-row blocks b of
  (P_b^T @ Q_b) * (ps[b, m] * qs[b, n])`` on 128x1-quantized operands (scales (NB, M) / (NB, N), block
  ``block_offsets[e] + j`` = the expert's j-th block), fp32, one cast; no atomics, no split-K; an expert with
  no rows stores exact zeros. Operand rows: the buffer's (rows past an expert masked), or PADDED: block b is
  rows [128b, 128b + 128) of a block-padded buffer (zeros past each expert's rows, nothing masked: with rows
  contiguous, i.e. the operands stored transposed, the FP8 tensor cores' K-major layout, the loads are
  16-byte vectors the pipeline can copy asynchronously).

Quantization in the epilogues: megamoe.kernels.fp8_quant's helpers (the exponent rule, the non-finite policy,
e4m3 bytes by the hardware cast on the GPU and by integer rounding under the interpreter); bytes are stored
through uint8 pointers (HQ is the e4m3 output viewed as uint8). Interpreter (TRITON_INTERPRET=1): dots run in
fp32 (``mma``'s FP32_DOT; exact products of e4m3 values); HW_CAST is False there.
"""

import triton
import triton.language as tl

from .fp8_quant import abs_bits, as_fp32, e4m3_bytes, pow2_scale, quantize_block_rows
from .grouped_gemm import PLAIN, SWIGLU
from .tiles import expert_of_tile, load_2d, mma


@triton.jit
def swiglu_h(gate, up):
    """silu(gate) * up in fp32, the expression of the bf16 path (megamoe.kernels.grouped_gemm)."""
    return gate * (1.0 / (1.0 + tl.exp(-gate))) * up


@triton.jit
def load_vec(ptrs, mask, FULL: tl.constexpr):
    """A masked vector load (zero fill), unmasked when known full."""
    if FULL:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def add_scaled(acc, p, sa, sb, ONE_SB: tl.constexpr):
    """The promotion: ``acc + p * (sa[:, None] * sb[None, :])`` (p one K-block's dot, fp32); ONE_SB: sb is one
    scalar for the tile (128 columns: one weight block), so the scale product is per row and the promotion one
    FMA per element (the same values, hence the same bits)."""
    if ONE_SB:
        return acc + p * (sa * sb)[:, None]
    else:
        return acc + p * (sa[:, None] * sb[None, :])


@triton.jit
def promote(a, b, sa, sb, acc, FP32_DOT: tl.constexpr, ONE_SB: tl.constexpr):
    """``acc + dot(a, b) * (sa[:, None] * sb[None, :])``: one K-block of 128, its dot from zero."""
    return add_scaled(acc, mma(a, b, tl.zeros(acc.shape, dtype=tl.float32), FP32_DOT), sa, sb, ONE_SB)


@triton.jit
def _load_scales(as_ptrs, bs_ptrs, mask_n, valid, EVEN_N: tl.constexpr, ONE_SB: tl.constexpr):
    """One K-block's scales: A's per row, B's per column (ONE_SB: one scalar for the tile); zeros unless valid."""
    sa = tl.load(as_ptrs, mask=valid, other=0.0)
    if ONE_SB:  # one scale for the tile's 128 columns (bs_ptrs a scalar pointer)
        sb = tl.load(bs_ptrs, mask=valid, other=0.0)
    else:
        sb = tl.load(bs_ptrs, mask=mask_n & valid, other=0.0)
    return sa, sb


@triton.jit
def _k_loop(a_ptrs, as_ptrs, b_ptrs, bs_ptrs, mask_n, N, stride_bn, stride_bk, stride_bsn, stride_bsk,
            K: tl.constexpr, UP: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_N: tl.constexpr, ONE_SB: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile's K loop in K-blocks of 128 from the pointers of K-block 0: ``acc = deq(A) @ deq(B)``; with UP
    also ``acc_up`` over columns N + n of B (else ``acc_up`` is ``acc``'s initial zeros, unused). The scales of
    K-block k + 1 are loaded during K-block k (they are small loads the pipeline does not prefetch)."""
    up_cols = N // 128 * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    if UP:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sa, sb = _load_scales(as_ptrs, bs_ptrs, mask_n, True, EVEN_N, ONE_SB)
    sb_up = sb
    if UP:
        sa, sb_up = _load_scales(as_ptrs, bs_ptrs + up_cols, mask_n, True, EVEN_N, ONE_SB)
    for k0 in range(0, K, 128):
        a = tl.load(a_ptrs)  # rows clamped into the buffer, K a multiple of 128
        b = load_2d(b_ptrs, mask_n, mask_n, True, EVEN_N)  # all K rows valid (FULL_R): only columns masked
        more = k0 + 128 < K
        sa_next, sb_next = _load_scales(as_ptrs + 1, bs_ptrs + stride_bsk, mask_n, more, EVEN_N, ONE_SB)
        acc = promote(a, b, sa, sb, acc, FP32_DOT, ONE_SB)
        sb_up_next = sb_next
        if UP:
            b_up = load_2d(b_ptrs + N * stride_bn, mask_n, mask_n, True, EVEN_N)
            sa_next, sb_up_next = _load_scales(as_ptrs + 1, bs_ptrs + stride_bsk + up_cols, mask_n, more, EVEN_N,
                                               ONE_SB)
            acc_up = promote(a, b_up, sa, sb_up, acc_up, FP32_DOT, ONE_SB)
        sa, sb, sb_up = sa_next, sb_next, sb_up_next
        a_ptrs += 128
        as_ptrs += 1
        b_ptrs += 128 * stride_bk
        bs_ptrs += stride_bsk
    return acc, acc_up


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
def _swiglu_cols(acc, acc_up, n0, out_rows, mask_m, aux_ptr, q_ptr, qs_ptr, N, stride_xm, stride_qm, stride_qsm,
                 SAVE_AUX: tl.constexpr, HW_CAST: tl.constexpr):
    """SwiGLU forward on QB columns [n0, n0 + QB): [g | u] saved (SAVE_AUX), h quantized 1x128."""
    out_ty = aux_ptr.dtype.element_ty
    gate = acc.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    offs_n = n0 + tl.arange(0, 128)
    if SAVE_AUX:
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        x_ptrs = aux_ptr + out_rows[:, None] * stride_xm + offs_n[None, :]
        tl.store(x_ptrs, gate.to(out_ty), mask=mask)
        tl.store(x_ptrs + N, up.to(out_ty), mask=mask)
    h = swiglu_h(gate, up).to(out_ty).to(tl.float32)
    _store_quantized(h, out_rows, n0, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, N, HW_CAST)


@triton.jit
def swiglu_bwd_values(acc, offs_n, rows, mask_n, scale, gu_ptr, c_ptr, N, stride_gm, HAS_SCALE: tl.constexpr):
    """SwiGLU backward values on a column block: (row-dot partial ``sum_n acc * h``, h * scale, dg, du), the last
    three rounded to C's dtype (held in fp32). The bf16 path's expressions (megamoe.kernels.grouped_gemm, whose
    epilogue stores them at once); returned here so the caller can quantize dg, du across both halves of a block."""
    out_ty = c_ptr.dtype.element_ty
    g_ptrs = gu_ptr + rows[:, None] * stride_gm + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0).to(tl.float32)
    up = tl.load(g_ptrs + N, mask=mask_n[None, :], other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    h = (gate * sig * up).to(out_ty).to(tl.float32)  # bitwise the forward's h (swiglu_h)
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
def store_pair_quantized(lo, hi, offs_lo, out_rows, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, NQ,
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
def _swiglu_bwd_cols(acc, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr, qs_ptr, N,
                     stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE: tl.constexpr,
                     HW_CAST: tl.constexpr, BLOCK_M: tl.constexpr):
    """SwiGLU backward on 128 columns [n0, n0 + 128), as two 64-column halves (the bf16 path's structure, so the
    row-dot partial is the same sum whatever the tile width): h * scale into AUX, [dg | du] into C and
    quantized 1x128 into (HQ, HS); returns the row-dot partial (first half's sum + second half's)."""
    acc_lo, acc_hi = halves(acc, BLOCK_M, 128)
    offs_lo = n0 + tl.arange(0, 64)
    part_lo, h_lo, dg_lo, du_lo = swiglu_bwd_values(acc_lo, offs_lo, rows, offs_lo < N, scale, gu_ptr, c_ptr, N,
                                                    stride_gm, HAS_SCALE)
    part_hi, h_hi, dg_hi, du_hi = swiglu_bwd_values(acc_hi, offs_lo + 64, rows, offs_lo < N, scale, gu_ptr, c_ptr, N,
                                                    stride_gm, HAS_SCALE)
    _store_pair(h_lo, h_hi, offs_lo, out_rows, mask_m, aux_ptr, stride_xm, N)
    _store_pair(dg_lo, dg_hi, offs_lo, out_rows, mask_m, c_ptr, stride_cm, N)
    _store_pair(du_lo, du_hi, offs_lo, out_rows, mask_m, c_ptr + N, stride_cm, N)
    store_pair_quantized(dg_lo, dg_hi, offs_lo, out_rows, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, N, HW_CAST)
    store_pair_quantized(du_lo, du_hi, offs_lo + N, out_rows, mask_m, q_ptr, qs_ptr, stride_qm, stride_qsm, 2 * N,
                          HW_CAST)
    return part_lo + part_hi


@triton.jit
def halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (BLOCK_M, 2 * QB) tile as its two (BLOCK_M, QB) column halves."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _epilogue(acc, acc_up, n_tile, rows, out_rows, mask_m, offs_n, mask_n, scale_ptr, gu_ptr, c_ptr, aux_ptr,
              dot_ptr, q_ptr, qs_ptr, N, stride_cm, stride_gm, stride_xm, stride_qm, stride_qsm,
              EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, SAVE_AUX: tl.constexpr, HAS_DOT: tl.constexpr,
              HW_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n0 = n_tile * BLOCK_N
    if EPILOGUE == PLAIN:
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows).to(tl.float32)[:, None]
        c_ptrs = c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    elif EPILOGUE == SWIGLU:
        if BLOCK_N == 128:
            _swiglu_cols(acc, acc_up, n0, out_rows, mask_m, aux_ptr, q_ptr, qs_ptr, N, stride_xm, stride_qm,
                         stride_qsm, SAVE_AUX, HW_CAST)
        else:
            acc_a, acc_b = halves(acc, BLOCK_M, BLOCK_N)
            up_a, up_b = halves(acc_up, BLOCK_M, BLOCK_N)
            _swiglu_cols(acc_a, up_a, n0, out_rows, mask_m, aux_ptr, q_ptr, qs_ptr, N, stride_xm, stride_qm,
                         stride_qsm, SAVE_AUX, HW_CAST)
            _swiglu_cols(acc_b, up_b, n0 + 128, out_rows, mask_m, aux_ptr, q_ptr, qs_ptr, N, stride_xm,
                         stride_qm, stride_qsm, SAVE_AUX, HW_CAST)
    else:  # SWIGLU_BWD: one row-dot partial per 128 columns, dot (R, N / 128)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + rows).to(tl.float32)
        else:
            scale = tl.full((BLOCK_M,), 1.0, tl.float32)
        num_p = N // 128
        if BLOCK_N == 128:
            part = _swiglu_bwd_cols(acc, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr, qs_ptr,
                                    N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE, HW_CAST,
                                    BLOCK_M)
            if HAS_DOT:
                tl.store(dot_ptr + out_rows * num_p + n_tile, part, mask=mask_m)
        else:
            acc_a, acc_b = halves(acc, BLOCK_M, BLOCK_N)
            part_a = _swiglu_bwd_cols(acc_a, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr,
                                      qs_ptr, N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE,
                                      HW_CAST, BLOCK_M)
            part_b = _swiglu_bwd_cols(acc_b, n0 + 128, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr,
                                      qs_ptr, N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE,
                                      HW_CAST, BLOCK_M)
            if HAS_DOT:
                p = 2 * n_tile
                tl.store(dot_ptr + out_rows * num_p + p, part_a, mask=mask_m)
                tl.store(dot_ptr + out_rows * num_p + p + 1, part_b, mask=mask_m & (out_rows * 0 + p + 1 < num_p))


@triton.jit
def fp8_m_grouped_kernel(
    # inputs: A e4m3 (R or T, K) + row scales (., K / 128); B e4m3 + its scale grid; group tables; row scale
    # (PLAIN, SWIGLU_BWD); saved [g | u] (SWIGLU_BWD)
    a_ptr, as_ptr, a_idx_ptr, b_ptr, bs_ptr, row_offsets_ptr, tile_offsets_ptr, scale_ptr, gu_ptr,
    # outputs: C (PLAIN, SWIGLU_BWD), AUX ([g | u] of SWIGLU, h * scale of SWIGLU_BWD), row-dot partials,
    # 1x128-quantized output (h of SWIGLU, [dg | du] of SWIGLU_BWD): bytes and scales
    c_ptr, aux_ptr, dot_ptr, q_ptr, qs_ptr,
    # shapes (K is a compile-time constant: a weight dimension)
    num_rows, N, num_experts, K: tl.constexpr,
    # strides, in elements (every last dimension is contiguous except B's, whose strides are given)
    stride_am, stride_asm, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
    stride_cm, stride_gm, stride_xm, stride_qm, stride_qsm,
    # variant
    EPILOGUE: tl.constexpr, HAS_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, SAVE_AUX: tl.constexpr,
    HAS_DOT: tl.constexpr, FP32_DOT: tl.constexpr, HW_CAST: tl.constexpr, EVEN_N: tl.constexpr,
    E_POW2: tl.constexpr,
    # tile config (BLOCK_K is 128)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_N % 128 == 0)
    tl.static_assert(EPILOGUE == PLAIN or BLOCK_N <= 2 * 128)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    tile = tl.program_id(0)
    while tile < num_tiles:
        m_tile = tile // num_n_tiles
        n_tile = tile % num_n_tiles
        expert, row_start, row_end = expert_of_tile(tile_offsets_ptr, row_offsets_ptr, m_tile, num_experts,
                                                     E_POW2, BLOCK_M)
        offs_m = row_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        rows = tl.minimum(offs_m, num_rows - 1).to(tl.int64)  # clamped rows: computed, never stored
        if HAS_GATHER:
            a_rows = tl.load(a_idx_ptr + rows).to(tl.int64)
        else:
            a_rows = rows
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, 128)
        e64 = expert.to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + e64 * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        if BLOCK_N == 128:  # the tile's 128 columns share one weight block: one scale per K-block
            bs_ptrs = bs_ptr + e64 * stride_bse + n_tile * stride_bsn
        else:
            bs_ptrs = bs_ptr + e64 * stride_bse + (offs_n // 128) * stride_bsn
        acc, acc_up = _k_loop(a_ptrs, as_ptr + a_rows * stride_asm, b_ptrs, bs_ptrs, mask_n, N, stride_bn,
                              stride_bk, stride_bsn, stride_bsk, K, EPILOGUE == SWIGLU, FP32_DOT, EVEN_N,
                              BLOCK_N == 128, BLOCK_M, BLOCK_N)
        _epilogue(acc, acc_up, n_tile, rows, offs_m.to(tl.int64), mask_m, offs_n, mask_n, scale_ptr, gu_ptr, c_ptr,
                  aux_ptr, dot_ptr, q_ptr, qs_ptr, N, stride_cm, stride_gm, stride_xm, stride_qm, stride_qsm,
                  EPILOGUE, HAS_SCALE, SAVE_AUX, HAS_DOT, HW_CAST, BLOCK_M, BLOCK_N)
        tile += tl.num_programs(0)


@triton.jit
def wgrad_block(acc, j, row_start, row_end, first_block, p_ptr, ps_ptr, q_ptr, qs_ptr, offs_m, offs_n, p_cols,
                q_cols, mask_m, mask_n, stride_pr, stride_psb, stride_qr, stride_qsb, FP32_DOT: tl.constexpr,
                PADDED: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """``acc + (P_j^T @ Q_j) * (ps[b, m] * qs[b, n])`` for the expert's j-th block of 128 rows (b its global
    block); rows past the expert load as zeros (PADDED: block b is rows [128b, 128b + 128), zero-padded by its
    producer, so no row is masked). p_cols / q_cols: the tile's column offsets in elements (int64: with
    transposed operands a column's stride is the buffer's row count)."""
    b = (first_block + j).to(tl.int64)
    if PADDED:
        rows = b * 128 + tl.arange(0, 128)
        mask_r = rows >= 0
    else:
        rows = row_start + j * 128 + tl.arange(0, 128)
        mask_r = rows < row_end
        rows = rows.to(tl.int64)
    p = load_2d(p_ptr + rows[:, None] * stride_pr + p_cols[None, :], mask_r, mask_m, PADDED, EVEN_M)
    q = load_2d(q_ptr + rows[:, None] * stride_qr + q_cols[None, :], mask_r, mask_n, PADDED, EVEN_N)
    ps = load_vec(ps_ptr + b * stride_psb + offs_m, mask_m, EVEN_M)
    qs = load_vec(qs_ptr + b * stride_qsb + offs_n, mask_n, EVEN_N)
    return promote(tl.trans(p), q, ps, qs, acc, FP32_DOT, False)


@triton.jit
def fp8_k_grouped_kernel(
    # inputs: P e4m3 (R, M) + scales (NB, M); Q e4m3 (R, N) + scales (NB, N); group offsets; block table
    p_ptr, ps_ptr, q_ptr, qs_ptr, row_offsets_ptr, block_offsets_ptr,
    # output (E, M, N), last dimension contiguous
    c_ptr,
    # shapes
    M, N,
    # strides, in elements (scales' last dimension contiguous)
    stride_pr, stride_pm, stride_psb, stride_qr, stride_qn, stride_qsb, stride_ce, stride_cm,
    # variant
    FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr, PADDED: tl.constexpr, EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    # tile config (the reduction walks blocks of 128 rows)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_expert = tl.cdiv(M, BLOCK_M) * num_n_tiles
    expert = pid // tiles_per_expert  # experts slowest: concurrent programs share the expert's rows in L2
    pid_m = (pid % tiles_per_expert) // num_n_tiles
    pid_n = pid % num_n_tiles
    row_start = tl.load(row_offsets_ptr + expert)
    row_end = tl.load(row_offsets_ptr + expert + 1)
    first_block = tl.load(block_offsets_ptr + expert)
    num_blocks = tl.cdiv(row_end - row_start, 128)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    p_cols = offs_m.to(tl.int64) * stride_pm
    q_cols = offs_n.to(tl.int64) * stride_qn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot range() over a loaded bound
        j = 0
        while j < num_blocks:
            acc = wgrad_block(acc, j, row_start, row_end, first_block, p_ptr, ps_ptr, q_ptr, qs_ptr, offs_m, offs_n,
                              p_cols, q_cols, mask_m, mask_n, stride_pr, stride_psb, stride_qr, stride_qsb,
                              FP32_DOT, PADDED, EVEN_M, EVEN_N)
            j += 1
    else:
        for j in range(0, num_blocks):
            acc = wgrad_block(acc, j, row_start, row_end, first_block, p_ptr, ps_ptr, q_ptr, qs_ptr, offs_m, offs_n,
                              p_cols, q_cols, mask_m, mask_n, stride_pr, stride_psb, stride_qr, stride_qsb,
                              FP32_DOT, PADDED, EVEN_M, EVEN_N)
    c_ptrs = c_ptr + expert.to(tl.int64) * stride_ce + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def swiglu_bwd_rows_kernel(acc_ptr, n_ptr, scale_ptr, gu_ptr, c_ptr, aux_ptr, dot_ptr, q_ptr, qs_ptr, num_rows, N,
                           stride_am, stride_cm, stride_gm, stride_xm, stride_qm, stride_qsm,
                           HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, HW_CAST: tl.constexpr,
                           BLOCK_M: tl.constexpr):
    """Program (i, p): the SwiGLU backward of :func:`fp8_m_grouped_kernel`'s SWIGLU_BWD epilogue (the same
    function, :func:`_swiglu_bwd_cols`, hence the same bits) on rows [i * BLOCK_M, ...) x columns [128p, 128p + 128)
    of a dgrad accumulator written in fp32 by a plain GEMM (acc (num_rows, N)); only the first ``n_ptr[0]`` rows (a
    count on the device) are read and written."""
    n_valid = tl.minimum(num_rows, tl.load(n_ptr))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n_valid
    rows = tl.minimum(offs_m, num_rows - 1).to(tl.int64)  # clamped rows: computed, never stored
    p = tl.program_id(1)
    n0 = p * 128
    cols = n0 + tl.arange(0, 128)
    acc = tl.load(acc_ptr + rows[:, None] * stride_am + cols[None, :], mask=mask_m[:, None] & (cols < N)[None, :],
                  other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows).to(tl.float32)
    else:
        scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    out_rows = offs_m.to(tl.int64)
    part = _swiglu_bwd_cols(acc, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, q_ptr, qs_ptr, N,
                            stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE, HW_CAST, BLOCK_M)
    if HAS_DOT:
        tl.store(dot_ptr + out_rows * (N // 128) + p, part, mask=mask_m)


@triton.jit
def swiglu_rows_kernel(gu_ptr, n_ptr, q_ptr, qs_ptr, num_rows, N, stride_gm, stride_qm, stride_qsm,
                       HW_CAST: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (i, p): h = silu(g) * u on rows [i * BLOCK_M, ...) x columns [128p, 128p + 128) of [g | u]
    (num_rows, 2N) in the activation dtype, as :func:`fp8_m_grouped_kernel`'s SWIGLU epilogue computes it from the
    same rounded g and u (:func:`swiglu_h`, one rounding to that dtype), quantized 1x128 into (q, qs); only the
    first ``n_ptr[0]`` rows (a count on the device) are read and written."""
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
