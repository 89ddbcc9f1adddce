"""Fixed-order slot reductions of the fused MoE path (``@triton.jit`` only; launchers in megamoe.ops).

Legend: T tokens, K slots (top-k), D hidden size, R rows of the expert-grouped buffer,
P row-dot partials per row (N-tiles of the dgrad GEMM), S chunks.

* ``combine_fwd_kernel``: ``out[t] = cast(sum_{k=0..K-1} w[t,k] * float(y[row_of[t,k]]) + float(shared[t]))``,
  fp32, slots in order 0..K-1, shared expert added last, one cast: the formula of
  ``megamoe.reference.combine``. Grid: (token blocks, D blocks).
* ``chunk_sum_kernel``: ``out[m, n] = cast(sum_{s=0..S-1} parts[s, m, n])``, fp32, chunks in order 0..S-1, one
  cast (the router's weight gradient over fixed token chunks, megamoe.autograd.router_wgrad; the three bf16-piece
  products of its fp32 GEMMs). Grid: element blocks.
* ``slot_sum_bwd_kernel``: ``dx[t] = cast(sum_k float(dx_rows[row_of[t,k]]) + float(dx_shared[t]))`` in
  the same fixed order, and (programs of the first D block) the routing-weight gradient
  ``dw[t,k] = sum_p part[row_of[t,k], p]``.

Each element is computed by one program in a fixed order (the combine and slot sums from its own token's data
only): bitwise deterministic (and for those two batch invariant); no atomics.
"""

import triton
import triton.language as tl


@triton.jit
def combine_fwd_kernel(
    y_ptr, row_of_ptr, w_ptr, shared_ptr,  # inputs: y [R, D], row_of [T, K], w [T, K], shared [T, D]
    out_ptr,                               # output [T, D]
    T, D, stride_y, stride_s, stride_o,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    tk = offs_t.to(tl.int64) * K
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(row_of_ptr + tk + k, mask=mask_t, other=0).to(tl.int64)
        w = tl.load(w_ptr + tk + k, mask=mask_t, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row[:, None] * stride_y + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = acc + w[:, None] * y
    if HAS_SHARED:
        s_ptrs = shared_ptr + offs_t.to(tl.int64)[:, None] * stride_s + offs_d[None, :]
        acc = acc + tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
    o_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def slot_sum_bwd_kernel(
    dxr_ptr, row_of_ptr, dxs_ptr, part_ptr,  # inputs: dx rows [R, D], row_of [T, K], dx shared [T, D], part [R, P]
    dx_ptr, dw_ptr,                           # outputs: dx [T, D], dw [T, K]
    T, D, P, stride_r, stride_s, stride_o,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
    P_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    tk = offs_t.to(tl.int64) * K
    if HAS_DX:
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(row_of_ptr + tk + k, mask=mask_t, other=0).to(tl.int64)
            acc = acc + tl.load(dxr_ptr + row[:, None] * stride_r + offs_d[None, :], mask=mask,
                                other=0.0).to(tl.float32)
        if HAS_SHARED:
            s_ptrs = dxs_ptr + offs_t.to(tl.int64)[:, None] * stride_s + offs_d[None, :]
            acc = acc + tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
        o_ptrs = dx_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_d[None, :]
        tl.store(o_ptrs, acc.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_DW:
        if tl.program_id(1) == 0:
            offs_p = tl.arange(0, P_POW2)
            mask_p = mask_t[:, None] & (offs_p < P)[None, :]
            for k in tl.static_range(K):
                row = tl.load(row_of_ptr + tk + k, mask=mask_t, other=0).to(tl.int64)
                part = tl.load(part_ptr + row[:, None] * P + offs_p[None, :], mask=mask_p, other=0.0)
                tl.store(dw_ptr + tk + k, tl.sum(part, axis=1).to(dw_ptr.dtype.element_ty), mask=mask_t)


@triton.jit
def chunk_sum_kernel(parts_ptr, out_ptr, numel, N, stride_s, stride_m, S: tl.constexpr, ROWS_CONTIGUOUS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """parts [S, M, N] fp32 (strides stride_s, stride_m, 1; ROWS_CONTIGUOUS: stride_m == N) -> out [M * N]
    contiguous: the S partials of each element added in chunk order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if ROWS_CONTIGUOUS:
        src = offs
    else:
        src = (offs // N) * stride_m + offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(S):
        acc = acc + tl.load(parts_ptr + s * stride_s + src, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
