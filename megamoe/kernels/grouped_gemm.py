"""Grouped GEMM kernels for the routed experts (``@triton.jit`` only; launchers in megamoe.ops).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``,
ordered by (expert, token, slot)); E groups (experts); N output columns; K reduction size; F FFN width;
G = 2F (gate columns [0, F), then up columns [F, 2F)); P number of N-tiles of a row-dot partial.

Two kernel families (GEMM naming after DeepGEMM: which dimension is grouped):

* ``m_grouped_gemm_kernel``: ``C[r] = A[row(r)] @ B[e(r)]`` for every row r of the buffer, where B[e] is
  addressed through strides, so the same kernel runs the "nt" forward GEMMs (B[e] stored [N, K], the
  nn.Linear layout) and the "nn" dgrad GEMMs (B[e] stored [K, N]). ``row(r)`` is r, or
  ``a_idx[r]`` when HAS_GATHER (rows are gathered straight from the token matrix, no permuted copy).
  Persistent grid: program p walks the tiles p, p + num_programs, ...; a tile is (m-tile, n-tile) with the
  n-tile fastest. The tile body is four helpers (``m_tile_rows``: the tile's expert and rows;
  ``m_tile_product``: the K loop; ``m_tile_store``: the epilogues below; ``row_scaled``), which the
  expert-parallel kernels of megamoe.kernels.ep_tiles wrap with a pull-wait prologue (tiles from a counter,
  each waiting for its rows) or a push epilogue (rows stored into their owners' slots): the same arithmetic.
  M-tiles never straddle two experts: expert e owns ``ceil(count_e / BLOCK_M)`` m-tiles starting at
  ``tile_offsets[e]`` (exclusive prefix sum on the device), so the grid is sized from a static bound on rows
  and programs past the real work exit. Operand loads: pointer loads, or
  (TMA_B) the weight tile through a TMA tensor descriptor over the 2-D view of B, (TMA_A) also the A tile
  when A's rows are not gathered; the hardware zero-fills past the view's edges, and rows of a
  neighbouring expert or token only ever reach output rows / columns that are masked at the store.
  Epilogues:
    0 PLAIN:      C = cast(acc [* scale[r]]) (``m_grouped_push_kernel`` stores the same values into the
                  owners' slots instead).
    1 SWIGLU:     two accumulators (gate columns n, up columns N + n of B[e]); g, u rounded to the output
                  dtype, ``h = cast(silu(g) * u)``; optionally stores [g | u] (the pre-activations) in AUX.
    2 SWIGLU_BWD: acc = dY @ W2[e] (dh before scaling); reads the saved [g | u], recomputes h exactly as
                  the forward did, writes the row-dot partial ``sum_n acc * h`` (routing-weight gradient),
                  ``dh = cast(acc * scale)``, the SwiGLU backward ``[dg | du]`` into C ([R, 2N]) and
                  ``cast(h * scale)`` into AUX (the down-projection weight-gradient operand). One row-dot
                  partial per DOT_N = min(BLOCK_N, 128) columns (a 256-wide tile writes two), so on the
                  GPU's tiles (BLOCK_N 128 or 256) the partials, and the routing-weight gradient summed
                  from them, do not depend on the tile width.
* ``k_grouped_gemm_kernel``: ``C[e] = P[rows_e]^T @ Q[rows_e]`` (weight gradients). One program per
  (expert, m-tile, n-tile); its reduction walks the expert's rows from the expert's first row in
  BLOCK_K chunks, in row order, fp32 accumulation, one cast. No atomics, no split-K: bitwise
  deterministic and independent of how many other experts / rows the buffer holds. An expert with no
  rows stores exact zeros.
* ``k_grouped_resident_kernel``: the same sums, for experts with few rows. One program per (expert,
  m-tile) walks all n-tiles; when the expert has at most CHUNKS * BLOCK_K rows, its P chunks are loaded
  once and stay on chip while Q's n-tiles stream past, so each output byte costs ~rows / BLOCK_M bytes of
  loads instead of ~rows * (1 / BLOCK_M + 1 / BLOCK_N). Larger experts take the per-tile reduction above
  inside the same program. Both paths add the same BLOCK_K chunks in the same order (a chunk past the
  expert's rows is skipped, not added as zeros), so the bits equal ``k_grouped_gemm_kernel``'s.

Every output row of the m-grouped kernel depends only on its own input row (clamped rows past a group
are computed and dropped, never mixed in; columns past N are zero-filled), and the K loop order is fixed by the
tile config, so a token's result is independent of the rest of the batch (batch invariance, docs/design.md).
SiLU: silu(x) = x * s, silu'(x) = s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)) (PyTorch's backward formula)
(Shazeer, arXiv 2002.05202 for SwiGLU).
"""

import triton
import triton.language as tl

from .tiles import expert_of_tile, load_2d, mma

PLAIN: tl.constexpr = tl.constexpr(0)
SWIGLU: tl.constexpr = tl.constexpr(1)
SWIGLU_BWD: tl.constexpr = tl.constexpr(2)


@triton.jit
def swiglu_h(gate, up):
    """silu(gate) * up in fp32 (the FP8 layer's SwiGLU pass computes h with it too, megamoe.kernels.fp8_swiglu)."""
    return gate * (1.0 / (1.0 + tl.exp(-gate))) * up


@triton.jit
def _swiglu_bwd_half(acc, offs_n, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, N,
                     stride_gm, stride_cm, stride_xm, HAS_SCALE: tl.constexpr):
    """SwiGLU backward on a column block: stores [dg | du] and h * scale; returns sum_n acc * h per row."""
    out_ty = c_ptr.dtype.element_ty
    mask_n = offs_n < N
    mask = mask_m[:, None] & mask_n[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_gm + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0).to(tl.float32)
    up = tl.load(g_ptrs + N, mask=mask_n[None, :], other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    h = (gate * sig * up).to(out_ty).to(tl.float32)  # bitwise the forward's h
    part = tl.sum(tl.where(mask_n[None, :], acc * h, 0.0), axis=1)
    x_ptrs = aux_ptr + out_rows[:, None] * stride_xm + offs_n[None, :]
    if HAS_SCALE:
        acc = acc * scale[:, None]
        h = h * scale[:, None]
    tl.store(x_ptrs, h.to(out_ty), mask=mask)
    dh = acc.to(out_ty).to(tl.float32)
    c_ptrs = c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs + N, (dh * (gate * sig)).to(out_ty), mask=mask)
    d_gate = (dh * up) * sig * (1.0 + gate * (1.0 - sig))
    tl.store(c_ptrs, d_gate.to(out_ty), mask=mask)
    return part


@triton.jit
def _swiglu_bwd_cols(acc, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, N, stride_gm, stride_cm,
                     stride_xm, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    """SwiGLU backward on columns [n0, n0 + COLS) of a tile, run on two column halves to halve the live
    registers; returns the row-dot partial (first half's sum + second half's sum)."""
    acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, COLS // 2)), (0, 2, 1)))
    offs_lo = n0 + tl.arange(0, COLS // 2)
    part = _swiglu_bwd_half(acc_lo, offs_lo, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, N,
                            stride_gm, stride_cm, stride_xm, HAS_SCALE)
    part += _swiglu_bwd_half(acc_hi, offs_lo + COLS // 2, rows, out_rows, mask_m, scale, gu_ptr, c_ptr,
                             aux_ptr, N, stride_gm, stride_cm, stride_xm, HAS_SCALE)
    return part


@triton.jit
def _k_loop(a_ptr, a_desc, b_ptr, b_desc, a_rows, expert, row_start, n_tile, mask_m, offs_n, mask_n, N,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, K: tl.constexpr, EPILOGUE: tl.constexpr,
            FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, TMA_A: tl.constexpr,
            TMA_B: tl.constexpr, B_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """One tile's K loop: ``acc = A[a_rows] @ B[expert]`` over columns ``offs_n`` in BLOCK_K steps, fp32; with
    the SWIGLU epilogue also ``acc_up`` over the up columns N + offs_n of B (else ``acc_up`` is ``acc``'s
    initial zeros, unused)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    b_row = expert * B_ROWS + n_tile * BLOCK_N  # TMA_B == 1: row of B viewed as (E * B_ROWS, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EPILOGUE == SWIGLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc_up = acc
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        if TMA_A:  # rows [row_start, row_start + BLOCK_M) of A (R, K); rows past R zero-filled
            a = a_desc.load([row_start, k0])
        else:
            a = load_2d(a_ptrs, mask_m, mask_k, True, EVEN_K)  # clamped rows are in bounds
        if TMA_B == 1:  # B[e] stored (N, K): tile (BLOCK_N, BLOCK_K) of the (E * B_ROWS, K) view
            b = tl.trans(b_desc.load([b_row, k0]))
        elif TMA_B == 2:  # B[e] stored (K, N): tile (BLOCK_K, BLOCK_N) of the (E * K, N) view (EVEN_K)
            b = b_desc.load([expert * K + k0, n_tile * BLOCK_N])
        else:
            b = load_2d(b_ptrs, mask_k, mask_n, EVEN_K, EVEN_N)
        acc = mma(a, b, acc, FP32_DOT)
        if EPILOGUE == SWIGLU:
            if TMA_B == 1:
                b_up = tl.trans(b_desc.load([b_row + N, k0]))
            else:
                b_up = load_2d(b_ptrs + N * stride_bn, mask_k, mask_n, EVEN_K, EVEN_N)
            acc_up = mma(a, b_up, acc_up, FP32_DOT)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, acc_up


@triton.jit
def _swiglu_epilogue(acc, acc_up, c_ptrs, aux_ptr, out_rows, offs_n, mask, N, stride_xm, SAVE_AUX: tl.constexpr):
    """SwiGLU forward on a tile: g, u rounded to the output dtype, optionally stored as [g | u] in AUX, and
    ``h = cast(silu(g) * u)`` stored through ``c_ptrs``."""
    out_ty = c_ptrs.dtype.element_ty
    gate = acc.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    if SAVE_AUX:
        x_ptrs = aux_ptr + out_rows[:, None] * stride_xm + offs_n[None, :]
        tl.store(x_ptrs, gate.to(out_ty), mask=mask)
        tl.store(x_ptrs + N, up.to(out_ty), mask=mask)
    tl.store(c_ptrs, swiglu_h(gate, up).to(out_ty), mask=mask)


@triton.jit
def _swiglu_bwd_epilogue(acc, n_tile, rows, out_rows, mask_m, scale_ptr, gu_ptr, c_ptr, aux_ptr, dot_ptr, N,
                         stride_gm, stride_cm, stride_xm, HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_N: tl.constexpr):
    """SwiGLU backward on a tile (acc = dY @ W2[e], N = F): [dg | du] into C (R x 2F), h * scale into AUX (R x F)
    and, with HAS_DOT, one row-dot partial per DOT_N columns into ``dot`` (R x cdiv(N, DOT_N))."""
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows).to(tl.float32)
    else:
        scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    n0 = n_tile * BLOCK_N
    num_p = tl.cdiv(N, DOT_N)
    if BLOCK_N == DOT_N:
        part = _swiglu_bwd_cols(acc, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, N,
                                stride_gm, stride_cm, stride_xm, HAS_SCALE, BLOCK_M, DOT_N)
        if HAS_DOT:
            tl.store(dot_ptr + out_rows * num_p + n_tile, part, mask=mask_m)
    else:  # BLOCK_N == 2 * DOT_N: two partials per tile, the same sums as two DOT_N-wide tiles
        acc_a, acc_b = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, DOT_N)), (0, 2, 1)))
        part_a = _swiglu_bwd_cols(acc_a, n0, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr, N,
                                  stride_gm, stride_cm, stride_xm, HAS_SCALE, BLOCK_M, DOT_N)
        part_b = _swiglu_bwd_cols(acc_b, n0 + DOT_N, rows, out_rows, mask_m, scale, gu_ptr, c_ptr, aux_ptr,
                                  N, stride_gm, stride_cm, stride_xm, HAS_SCALE, BLOCK_M, DOT_N)
        if HAS_DOT:
            p = 2 * n_tile
            tl.store(dot_ptr + out_rows * num_p + p, part_a, mask=mask_m)
            tl.store(dot_ptr + out_rows * num_p + p + 1, part_b, mask=mask_m & (out_rows * 0 + p + 1 < num_p))


@triton.jit
def m_tile_rows(tile, num_n_tiles, tile_offsets_ptr, row_offsets_ptr, num_experts, E_POW2: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """(expert, n-tile, first row, end row, rows ``offs_m`` and their mask) of persistent tile ``tile`` (the
    n-tile fastest)."""
    m_tile = tile // num_n_tiles
    n_tile = tile % num_n_tiles
    expert, row_start, row_end = expert_of_tile(tile_offsets_ptr, row_offsets_ptr, m_tile, num_experts, E_POW2,
                                                 BLOCK_M)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_end
    return expert, n_tile, row_start, row_end, offs_m, mask_m


@triton.jit
def m_tile_product(a_ptr, a_desc, a_idx_ptr, b_ptr, b_desc, expert, row_start, n_tile, rows, mask_m, N,
                   stride_am, stride_ak, stride_be, stride_bn, stride_bk, K: tl.constexpr, EPILOGUE: tl.constexpr,
                   HAS_GATHER: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                   TMA_A: tl.constexpr, TMA_B: tl.constexpr, B_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile's products before its epilogue: (acc, acc_up, offs_n, mask_n), ``acc = A[row(rows)] @ B[expert]``
    over the n-tile's columns (and with SWIGLU ``acc_up`` over the up columns; :func:`_k_loop`)."""
    if HAS_GATHER:
        a_rows = tl.load(a_idx_ptr + rows).to(tl.int64)
    else:
        a_rows = rows
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc, acc_up = _k_loop(a_ptr, a_desc, b_ptr, b_desc, a_rows, expert, row_start, n_tile, mask_m, offs_n, mask_n,
                          N, stride_am, stride_ak, stride_be, stride_bn, stride_bk, K, EPILOGUE, FP32_DOT, EVEN_K,
                          EVEN_N, TMA_A, TMA_B, B_ROWS, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc, acc_up, offs_n, mask_n


@triton.jit
def row_scaled(acc, scale_ptr, rows, HAS_SCALE: tl.constexpr):
    """The plain epilogue's ``acc * scale[r]`` on the fp32 accumulator (HAS_SCALE), else ``acc``."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rows).to(tl.float32)[:, None]
    return acc


@triton.jit
def m_tile_store(acc, acc_up, n_tile, rows, offs_m, mask_m, offs_n, mask_n, scale_ptr, gu_ptr, c_ptr, aux_ptr,
                 dot_ptr, N, stride_cm, stride_gm, stride_xm, EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr,
                 SAVE_AUX: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_N: tl.constexpr):
    """A tile's epilogue into rows ``offs_m`` of C (and AUX, dot): PLAIN, SWIGLU or SWIGLU_BWD."""
    mask = mask_m[:, None] & mask_n[None, :]
    out_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + out_rows[:, None] * stride_cm + offs_n[None, :]
    if EPILOGUE == PLAIN:
        acc = row_scaled(acc, scale_ptr, rows, HAS_SCALE)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == SWIGLU:
        _swiglu_epilogue(acc, acc_up, c_ptrs, aux_ptr, out_rows, offs_n, mask, N, stride_xm, SAVE_AUX)
    else:  # SWIGLU_BWD: acc = dY @ W2[e], N = F, C = [dg | du] (R x 2F), AUX = h * scale (R x F)
        _swiglu_bwd_epilogue(acc, n_tile, rows, out_rows, mask_m, scale_ptr, gu_ptr, c_ptr, aux_ptr, dot_ptr, N,
                             stride_gm, stride_cm, stride_xm, HAS_SCALE, HAS_DOT, BLOCK_M, BLOCK_N, DOT_N)


@triton.jit
def m_grouped_gemm_kernel(
    # inputs
    a_ptr, a_desc, a_idx_ptr, b_ptr, b_desc, row_offsets_ptr, tile_offsets_ptr, scale_ptr, gu_ptr,
    # outputs
    c_ptr, aux_ptr, dot_ptr,
    # shapes (K is a compile-time constant: a weight dimension, D or F)
    num_rows, N, num_experts, K: tl.constexpr,
    # strides, in elements (the last dimension of C, AUX, GU is contiguous)
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_gm, stride_xm,
    # variant
    EPILOGUE: tl.constexpr, HAS_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, SAVE_AUX: tl.constexpr,
    HAS_DOT: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    E_POW2: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr, B_ROWS: tl.constexpr,
    # tile config; DOT_N: columns per row-dot partial of SWIGLU_BWD (BLOCK_N or BLOCK_N / 2)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_N: tl.constexpr,
):
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    tile = tl.program_id(0)
    while tile < num_tiles:
        expert, n_tile, row_start, row_end, offs_m, mask_m = m_tile_rows(tile, num_n_tiles, tile_offsets_ptr,
                                                                         row_offsets_ptr, num_experts, E_POW2,
                                                                         BLOCK_M)
        rows = tl.minimum(offs_m, num_rows - 1).to(tl.int64)  # clamped rows: computed, never stored
        acc, acc_up, offs_n, mask_n = m_tile_product(
            a_ptr, a_desc, a_idx_ptr, b_ptr, b_desc, expert, row_start, n_tile, rows, mask_m, N, stride_am,
            stride_ak, stride_be, stride_bn, stride_bk, K, EPILOGUE, HAS_GATHER, FP32_DOT, EVEN_K, EVEN_N, TMA_A,
            TMA_B, B_ROWS, BLOCK_M, BLOCK_N, BLOCK_K)
        m_tile_store(acc, acc_up, n_tile, rows, offs_m, mask_m, offs_n, mask_n, scale_ptr, gu_ptr, c_ptr, aux_ptr,
                     dot_ptr, N, stride_cm, stride_gm, stride_xm, EPILOGUE, HAS_SCALE, SAVE_AUX, HAS_DOT, BLOCK_M,
                     BLOCK_N, DOT_N)
        tile += tl.num_programs(0)


@triton.jit
def k_step(acc, it, row_start, row_end, p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, offs_m, offs_n, mask_m, mask_n,
            stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr,
            FP32_DOT: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = row_start + it * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_r = rows < row_end
    rows = tl.minimum(rows, row_end - 1).to(tl.int64)
    if P_GATHER:
        p_rows = tl.load(p_idx_ptr + rows).to(tl.int64)
    else:
        p_rows = rows
    if Q_GATHER:
        q_rows = tl.load(q_idx_ptr + rows).to(tl.int64)
    else:
        q_rows = rows
    p = load_2d(p_ptr + p_rows[:, None] * stride_pr + offs_m[None, :] * stride_pm, mask_r, mask_m, False, EVEN_M)
    q = load_2d(q_ptr + q_rows[:, None] * stride_qr + offs_n[None, :] * stride_qn, mask_r, mask_n, False, EVEN_N)
    return mma(tl.trans(p), q, acc, FP32_DOT)


@triton.jit
def _per_tile_reduction(n_tile, num_iters, row_start, row_end, p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows, offs_m,
                        mask_m, N, stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER: tl.constexpr,
                        Q_GATHER: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
                        EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """One (expert, m-tile, n-tile) output tile: the expert's rows in BLOCK_K chunks, P and Q chunks both
    loaded per step, fp32 accumulation, one cast and store (the whole of k_grouped_gemm_kernel's work, and
    the resident kernel's fallback for experts with more rows than it keeps on chip)."""
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INTERPRET:  # the interpreter cannot range() over a loaded bound
        it = 0
        while it < num_iters:
            acc = k_step(acc, it, row_start, row_end, p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, offs_m, offs_n, mask_m,
                          mask_n, stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER, FP32_DOT, EVEN_M,
                          EVEN_N, BLOCK_K)
            it += 1
    else:
        for it in range(0, num_iters):
            acc = k_step(acc, it, row_start, row_end, p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, offs_m, offs_n, mask_m,
                          mask_n, stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER, FP32_DOT, EVEN_M,
                          EVEN_N, BLOCK_K)
    tl.store(c_rows + offs_n[None, :], acc.to(c_rows.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def k_grouped_gemm_kernel(
    # inputs
    p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, row_offsets_ptr,
    # output [E, M, N], last dimension contiguous
    c_ptr,
    # shapes
    M, N,
    # strides, in elements
    stride_pr, stride_pm, stride_qr, stride_qn, stride_ce, stride_cm,
    # variant
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    # tile config
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_expert = tl.cdiv(M, BLOCK_M) * num_n_tiles
    expert = pid // tiles_per_expert  # experts slowest: concurrent programs share the expert's rows in L2
    pid_m = (pid % tiles_per_expert) // num_n_tiles
    pid_n = pid % num_n_tiles
    row_start = tl.load(row_offsets_ptr + expert)
    row_end = tl.load(row_offsets_ptr + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    c_rows = c_ptr + expert.to(tl.int64) * stride_ce + offs_m.to(tl.int64)[:, None] * stride_cm
    _per_tile_reduction(pid_n, tl.cdiv(row_end - row_start, BLOCK_K), row_start, row_end, p_ptr, p_idx_ptr, q_ptr,
                        q_idx_ptr, c_rows, offs_m, mask_m, N, stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER,
                        Q_GATHER, FP32_DOT, INTERPRET, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _chunk_rows(idx_ptr, row_start, row_end, chunk, GATHER: tl.constexpr, BLOCK_K: tl.constexpr):
    """Source rows (int64) and row mask of reduction chunk ``chunk`` of an expert's rows."""
    rows = row_start + chunk * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_r = rows < row_end
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=mask_r, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return src, mask_r


@triton.jit
def _p_chunk(p_ptr, p_idx_ptr, row_start, row_end, chunk, offs_m, mask_m, stride_pr, stride_pm,
             P_GATHER: tl.constexpr, EVEN_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """P^T chunk (BLOCK_M, BLOCK_K) of an expert (zeros past its rows)."""
    src, mask_r = _chunk_rows(p_idx_ptr, row_start, row_end, chunk, P_GATHER, BLOCK_K)
    return tl.trans(load_2d(p_ptr + src[:, None] * stride_pr + offs_m[None, :] * stride_pm, mask_r, mask_m,
                             False, EVEN_M))


@triton.jit
def _q_chunk(q_ptr, q_src, mask_r, offs_n, mask_n, stride_qr, stride_qn, EVEN_N: tl.constexpr):
    return load_2d(q_ptr + q_src[:, None] * stride_qr + offs_n[None, :] * stride_qn, mask_r, mask_n, False, EVEN_N)


@triton.jit
def _resident_tile(n_tile, p0, p1, p2, p3, q0, q1, q2, q3, r0, r1, r2, r3, q_ptr, c_rows, mask_m, N, stride_qr,
                   stride_qn, FP32_DOT: tl.constexpr, EVEN_N: tl.constexpr, NUM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One n-tile: NUM dots of the resident P^T chunks with freshly loaded Q chunks, in row order; store."""
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = mma(p0, _q_chunk(q_ptr, q0, r0, offs_n, mask_n, stride_qr, stride_qn, EVEN_N), acc, FP32_DOT)
    if NUM > 1:
        acc = mma(p1, _q_chunk(q_ptr, q1, r1, offs_n, mask_n, stride_qr, stride_qn, EVEN_N), acc, FP32_DOT)
    if NUM > 2:
        acc = mma(p2, _q_chunk(q_ptr, q2, r2, offs_n, mask_n, stride_qr, stride_qn, EVEN_N), acc, FP32_DOT)
    if NUM > 3:
        acc = mma(p3, _q_chunk(q_ptr, q3, r3, offs_n, mask_n, stride_qr, stride_qn, EVEN_N), acc, FP32_DOT)
    tl.store(c_rows + offs_n[None, :], acc.to(c_rows.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _resident_n_loop(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows, row_start, row_end, offs_m, mask_m, N,
                     stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr,
                     FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                     NUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """All n-tiles of one (expert, m-tile) whose rows span exactly NUM BLOCK_K chunks: the NUM P^T chunks
    are loaded once (they stay in shared memory), each n-tile streams NUM Q chunks and adds NUM dots in
    row order; a separate loop per NUM keeps the loop free of branches, so its loads are pipelined."""
    p0 = _p_chunk(p_ptr, p_idx_ptr, row_start, row_end, 0, offs_m, mask_m, stride_pr, stride_pm, P_GATHER, EVEN_M,
                  BLOCK_K)
    q0, r0 = _chunk_rows(q_idx_ptr, row_start, row_end, 0, Q_GATHER, BLOCK_K)
    p1, q1, r1 = p0, q0, r0  # unused unless NUM > 1 (likewise below)
    p2, q2, r2 = p0, q0, r0
    p3, q3, r3 = p0, q0, r0
    if NUM > 1:
        p1 = _p_chunk(p_ptr, p_idx_ptr, row_start, row_end, 1, offs_m, mask_m, stride_pr, stride_pm, P_GATHER,
                      EVEN_M, BLOCK_K)
        q1, r1 = _chunk_rows(q_idx_ptr, row_start, row_end, 1, Q_GATHER, BLOCK_K)
    if NUM > 2:
        p2 = _p_chunk(p_ptr, p_idx_ptr, row_start, row_end, 2, offs_m, mask_m, stride_pr, stride_pm, P_GATHER,
                      EVEN_M, BLOCK_K)
        q2, r2 = _chunk_rows(q_idx_ptr, row_start, row_end, 2, Q_GATHER, BLOCK_K)
    if NUM > 3:
        p3 = _p_chunk(p_ptr, p_idx_ptr, row_start, row_end, 3, offs_m, mask_m, stride_pr, stride_pm, P_GATHER,
                      EVEN_M, BLOCK_K)
        q3, r3 = _chunk_rows(q_idx_ptr, row_start, row_end, 3, Q_GATHER, BLOCK_K)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    if INTERPRET:  # the interpreter cannot range() over a run-time bound
        n_tile = 0
        while n_tile < num_n_tiles:
            _resident_tile(n_tile, p0, p1, p2, p3, q0, q1, q2, q3, r0, r1, r2, r3, q_ptr, c_rows, mask_m, N, stride_qr,
                           stride_qn, FP32_DOT, EVEN_N, NUM, BLOCK_M, BLOCK_N)
            n_tile += 1
    else:
        for n_tile in range(0, num_n_tiles):
            _resident_tile(n_tile, p0, p1, p2, p3, q0, q1, q2, q3, r0, r1, r2, r3, q_ptr, c_rows, mask_m, N, stride_qr,
                           stride_qn, FP32_DOT, EVEN_N, NUM, BLOCK_M, BLOCK_N)


@triton.jit
def k_grouped_resident_kernel(
    # inputs
    p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, row_offsets_ptr,
    # output [E, M, N], last dimension contiguous
    c_ptr,
    # shapes
    M, N,
    # strides, in elements
    stride_pr, stride_pm, stride_qr, stride_qn, stride_ce, stride_cm,
    # variant
    P_GATHER: tl.constexpr, Q_GATHER: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, CHUNKS: tl.constexpr,
    # tile config
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tl.static_assert(CHUNKS >= 1 and CHUNKS <= 4)
    pid = tl.program_id(0)
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    expert = pid // num_m_tiles  # experts slowest: neighbouring programs stream the same Q rows
    pid_m = pid % num_m_tiles
    row_start = tl.load(row_offsets_ptr + expert)
    row_end = tl.load(row_offsets_ptr + expert + 1)
    num_iters = tl.cdiv(row_end - row_start, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    c_rows = c_ptr + expert.to(tl.int64) * stride_ce + offs_m.to(tl.int64)[:, None] * stride_cm
    if num_iters == 1:
        _resident_n_loop(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows, row_start, row_end, offs_m, mask_m, N,
                         stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER, FP32_DOT, INTERPRET, EVEN_M,
                         EVEN_N, 1, BLOCK_M, BLOCK_N, BLOCK_K)
    elif CHUNKS > 1 and num_iters == 2:
        _resident_n_loop(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows, row_start, row_end, offs_m, mask_m, N,
                         stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER, FP32_DOT, INTERPRET, EVEN_M,
                         EVEN_N, 2, BLOCK_M, BLOCK_N, BLOCK_K)
    elif CHUNKS > 2 and num_iters == 3:
        _resident_n_loop(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows, row_start, row_end, offs_m, mask_m, N,
                         stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER, FP32_DOT, INTERPRET, EVEN_M,
                         EVEN_N, 3, BLOCK_M, BLOCK_N, BLOCK_K)
    elif CHUNKS > 3 and num_iters == 4:
        _resident_n_loop(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows, row_start, row_end, offs_m, mask_m, N,
                         stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER, FP32_DOT, INTERPRET, EVEN_M,
                         EVEN_N, 4, BLOCK_M, BLOCK_N, BLOCK_K)
    else:  # no rows (exact zeros), or more rows than stay on chip: the per-tile reduction, n-tiles in turn
        num_n_tiles = tl.cdiv(N, BLOCK_N)
        if INTERPRET:
            n_tile = 0
            while n_tile < num_n_tiles:
                _per_tile_reduction(n_tile, num_iters, row_start, row_end, p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows,
                                    offs_m, mask_m, N, stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER,
                                    FP32_DOT, INTERPRET, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)
                n_tile += 1
        else:
            for n_tile in range(0, num_n_tiles):
                _per_tile_reduction(n_tile, num_iters, row_start, row_end, p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, c_rows,
                                    offs_m, mask_m, N, stride_pr, stride_pm, stride_qr, stride_qn, P_GATHER, Q_GATHER,
                                    FP32_DOT, INTERPRET, EVEN_M, EVEN_N, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def tile_offsets_kernel(offsets_ptr, tiles_ptr, num_groups, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """One program: ``tiles[0] = 0``, ``tiles[e + 1] = sum over j <= e of ceil(count_j / BLOCK_M)`` with
    ``count_j = offsets[j + 1] - offsets[j]`` (>= 0): the first m-tile of each group (exact integers)."""
    e = tl.arange(0, E_POW2)
    m = e < num_groups
    lo = tl.load(offsets_ptr + e, mask=m, other=0)
    hi = tl.load(offsets_ptr + e + 1, mask=m, other=0)
    tiles = tl.where(m, (hi - lo + (BLOCK_M - 1)) // BLOCK_M, 0)
    tl.store(tiles_ptr + 1 + e, tl.cumsum(tiles, axis=0), mask=m)
    tl.store(tiles_ptr + e, 0, mask=e == 0)
