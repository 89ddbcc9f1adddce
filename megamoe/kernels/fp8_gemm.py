"""Block-scaled FP8 (e4m3) grouped GEMM kernels of the routed experts (``@triton.jit`` only; launchers in
megamoe.ops.fp8_gemm). The formats are DeepSeek-V3's: 1x128 row blocks for activations and gradients, 128x128
blocks for weights, 128x1 token blocks for the weight-gradient operands, fp32 power-of-two dequantization
scales (docs of megamoe.ops.fp8_gemm).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``);
E experts; N output columns; K reduction size (multiples of 128); QB = 128, the scale group; NB scale blocks.

* ``fp8_m_grouped_kernel``: ``C[r] = cast(deq(A)[r] @ deq(B[e]))`` (forward "nt": B[e] stored (N, K); dgrad
  "nn": the same bytes read (K, N) through strides, the scale grid transposed the same way). Persistent
  grid over (m-tile, n-tile) tiles, m-tiles never straddling two experts (megamoe.kernels.tiles.
  expert_of_tile). Promotion: BLOCK_K = QB, every K-block's ``p = dot(a, b)`` starts from zero (the tensor
  cores' FP8 accumulation never spans more than 128 of K) and is added as
  ``acc += p * (sa[:, None] * sb[None, :])`` in fp32, K-blocks in increasing order: bitwise reproducible, no
  atomics, no split-K. The SwiGLU (backward) that follows the gate/up GEMM (the dgrad) is a separate pass
  (megamoe.kernels.fp8_swiglu).
* ``fp8_k_grouped_kernel``: ``C[e] = sum over expert e's 128-row blocks b of
  (P_b^T @ Q_b) * (ps[b, m] * qs[b, n])`` on 128x1-quantized operands (scales (NB, M) / (NB, N), block
  ``block_offsets[e] + j`` = the expert's j-th block), fp32, one cast; no atomics, no split-K; an expert with
  no rows stores exact zeros. Operand rows: the buffer's (rows past an expert masked), or PADDED: block b is
  rows [128b, 128b + 128) of a block-padded buffer (zeros past each expert's rows, nothing masked: with rows
  contiguous, i.e. the operands stored transposed, the FP8 tensor cores' K-major layout, the loads are
  16-byte vectors the pipeline can copy asynchronously).

Interpreter (TRITON_INTERPRET=1): dots run in fp32 (``mma``'s FP32_DOT; exact products of e4m3 values).
"""

import triton
import triton.language as tl

from .tiles import expert_of_tile, load_2d, mma


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
def _k_loop(a_ptrs, as_ptrs, b_ptrs, bs_ptrs, mask_n, stride_bk, stride_bsk, K: tl.constexpr, FP32_DOT: tl.constexpr,
            EVEN_N: tl.constexpr, ONE_SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile's K loop in K-blocks of 128 from the pointers of K-block 0: ``acc = deq(A) @ deq(B)``. The scales
    of K-block k + 1 are loaded during K-block k (they are small loads the pipeline does not prefetch)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sa, sb = _load_scales(as_ptrs, bs_ptrs, mask_n, True, EVEN_N, ONE_SB)
    for k0 in range(0, K, 128):
        a = tl.load(a_ptrs)  # rows clamped into the buffer, K a multiple of 128
        b = load_2d(b_ptrs, mask_n, mask_n, True, EVEN_N)  # all K rows valid (FULL_R): only columns masked
        sa_next, sb_next = _load_scales(as_ptrs + 1, bs_ptrs + stride_bsk, mask_n, k0 + 128 < K, EVEN_N, ONE_SB)
        acc = promote(a, b, sa, sb, acc, FP32_DOT, ONE_SB)
        sa, sb = sa_next, sb_next
        a_ptrs += 128
        as_ptrs += 1
        b_ptrs += 128 * stride_bk
        bs_ptrs += stride_bsk
    return acc


@triton.jit
def fp8_m_grouped_kernel(
    # inputs: A e4m3 (R, K) + row scales (R, K / 128); B e4m3 + its scale grid; group tables
    a_ptr, as_ptr, b_ptr, bs_ptr, row_offsets_ptr, tile_offsets_ptr,
    # output (R, N)
    c_ptr,
    # shapes (K is a compile-time constant: a weight dimension)
    num_rows, N, num_experts, K: tl.constexpr,
    # strides, in elements (every last dimension is contiguous except B's, whose strides are given)
    stride_am, stride_asm, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk, stride_cm,
    # variant
    FP32_DOT: tl.constexpr, EVEN_N: tl.constexpr, E_POW2: tl.constexpr,
    # tile config (BLOCK_K is 128)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_N % 128 == 0)
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
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, 128)
        e64 = expert.to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + e64 * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        if BLOCK_N == 128:  # the tile's 128 columns share one weight block: one scale per K-block
            bs_ptrs = bs_ptr + e64 * stride_bse + n_tile * stride_bsn
        else:
            bs_ptrs = bs_ptr + e64 * stride_bse + (offs_n // 128) * stride_bsn
        acc = _k_loop(a_ptrs, as_ptr + rows * stride_asm, b_ptrs, bs_ptrs, mask_n, stride_bk, stride_bsk, K,
                      FP32_DOT, EVEN_N, BLOCK_N == 128, BLOCK_M, BLOCK_N)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
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
