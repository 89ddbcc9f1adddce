"""Persistent k-grouped weight-gradient GEMM for Hopper, written in Gluon (``@gluon.jit`` only; launcher in
megamoe.ops.grouped_gemm).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``);
E experts; C[e] = P[rows_e]^T @ Q[rows_e] is (M, N); BLOCK_K rows of an expert per reduction chunk;
STAGES shared-memory slots of the load ring.

Same sums as ``megamoe.kernels.grouped_gemm._k_grouped_gemm_kernel`` (one output tile reduces its expert's
rows from the expert's first row, in BLOCK_K chunks, in row order, fp32, one cast; rows past the expert
are zero-filled, never another expert's), so the bits are the same as the Triton kernels' (checked on
H200 by tests/test_fused_gpu.py), but the structure differs where the Triton kernels lose time:

* persistent: one program per SM walks the tiles pid, pid + G, ... (expert slowest, n-tile fastest, so the
  programs running at once share an expert's rows in L2);
* the load ring runs across tile boundaries: while a tile's last chunk is multiplied and its result
  stored, the next tile's chunks are already being copied (``cp.async``, zero fill past the expert's
  rows, optionally gathered through a row index), STAGES - 2 chunks ahead;
* ``wgmma`` is issued asynchronously with one group in flight;
* the epilogue writes the bf16 tile to one of two shared-memory buffers and stores it with TMA
  (``cp.async.bulk.tensor``), so the store of tile j overlaps the main loop of tile j + 1. When M is not a
  multiple of BLOCK_M (a TMA tile would cross into the next expert) plain masked stores are used.

Slot reuse (no mbarriers): every program step s waits for its own copies of chunk s
(``cp.async.wait_group``), then a CTA barrier; each warpgroup had waited for its wgmma of step s - 2
before reaching that barrier, so the loads issued at step s go to the slot of step s - 2.

Design after the persistent / pipelined matmuls of Triton's Gluon tutorials (07-persistence, 04-tma) and
CUTLASS's SM90 multistage mainloop (cp.async + GMMA); the reduction order is this project's (docs/design.md).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


@gluon.jit
def _tile_params(t, num_tiles, row_offsets_ptr, tiles_m, tiles_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(expert, m0, n0, row_start, row_end) of tile t (clamped into range: callers mask invalid tiles)."""
    t = gl.minimum(t, num_tiles - 1)
    per_expert = tiles_m * tiles_n
    expert = t // per_expert
    rem = t - expert * per_expert
    m0 = (rem // tiles_n) * BLOCK_M
    n0 = (rem % tiles_n) * BLOCK_N
    row_start = gl.load(row_offsets_ptr + expert)
    row_end = gl.load(row_offsets_ptr + expert + 1)
    return expert, m0, n0, row_start, row_end


@gluon.jit
def _copy_chunk(src_ptr, idx_ptr, smem, rows, mask_r, col0, ncols, stride_r,
                GATHER: gl.constexpr, COLS: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async rows ``rows`` (or idx[rows]) x columns [col0, col0 + COLS) into smem; zeros where masked."""
    if GATHER:
        src = gl.load(idx_ptr + rows, mask=mask_r, other=0).to(gl.int64)
    else:
        src = rows.to(gl.int64)
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    ptrs = src_ptr + src[:, None] * stride_r + cols[None, :]
    mask = mask_r[:, None] & (cols < ncols)[None, :]
    async_copy.async_copy_global_to_shared(smem, ptrs, mask=mask)


@gluon.jit
def _issue_chunk(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_smem, q_smem, slot, row0, row_end, m0, n0, M, N,
                 stride_pr, stride_qr, valid, P_GATHER: gl.constexpr, Q_GATHER: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT: gl.constexpr):
    """One ring step: chunk rows [row0, row0 + BLOCK_K) of P (m-slice) and Q (n-slice), one commit group
    (an empty-masked group when ``valid`` is false, so every step commits exactly one group)."""
    rows = row0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, LAYOUT))
    mask_r = (rows < row_end) & valid
    _copy_chunk(p_ptr, p_idx_ptr, p_smem.index(slot), rows, mask_r, m0, M, stride_pr, P_GATHER, BLOCK_M, LAYOUT)
    _copy_chunk(q_ptr, q_idx_ptr, q_smem.index(slot), rows, mask_r, n0, N, stride_qr, Q_GATHER, BLOCK_N, LAYOUT)
    async_copy.commit_group()


@gluon.jit
def _next_nonempty(j, my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """First of this program's tiles at index >= j whose expert has rows (my_tiles if none)."""
    _, m0, n0, rs, re = _tile_params(pid + j * G, num_tiles, row_offsets_ptr, tiles_m, tiles_n, BLOCK_M, BLOCK_N)
    while (j < my_tiles) & (rs >= re):
        j += 1
        _, m0, n0, rs, re = _tile_params(pid + j * G, num_tiles, row_offsets_ptr, tiles_m, tiles_n, BLOCK_M, BLOCK_N)
    return j, m0, n0, rs, re


@gluon.jit
def _producer_step(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_smem, q_smem, slot, pj, pc, pm0, pn0, prs, pre,
                   my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n, M, N, stride_pr, stride_qr,
                   P_GATHER: gl.constexpr, Q_GATHER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, LAYOUT: gl.constexpr):
    """Issue the producer's current chunk into ``slot`` and advance it (chunk, then next non-empty tile)."""
    _issue_chunk(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_smem, q_smem, slot, prs + pc * BLOCK_K, pre, pm0, pn0, M, N,
                 stride_pr, stride_qr, pj < my_tiles, P_GATHER, Q_GATHER, BLOCK_M, BLOCK_N, BLOCK_K, LAYOUT)
    pc += 1
    if prs + pc * BLOCK_K >= pre:
        pc = 0
        pj, pm0, pn0, prs, pre = _next_nonempty(pj + 1, my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m,
                                                tiles_n, BLOCK_M, BLOCK_N)
    return pj, pc, pm0, pn0, prs, pre


@gluon.jit
def _k_grouped_wgrad_kernel(
    # inputs
    p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, row_offsets_ptr,
    # output [E, M, N] (last dimension contiguous); c_desc: TMA descriptor over its (E * M, N) view (TMA_C)
    c_ptr, c_desc,
    # shapes
    num_experts, M, N,
    # strides, in elements (P, Q: row strides; the columns are contiguous)
    stride_pr, stride_qr, stride_ce, stride_cm,
    # variant
    P_GATHER: gl.constexpr, Q_GATHER: gl.constexpr, TMA_C: gl.constexpr,
    # tile config
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(STAGES >= 3, "the ring needs STAGES >= 3 (STAGES - 2 chunks in flight)")
    dtype: gl.constexpr = p_ptr.dtype.element_ty
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], SMEM)  # P chunk, M contiguous
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], SMEM)  # Q chunk, N contiguous
    if TMA_C:
        c_smem = gl.allocate_shared_memory(out_ty, [2, BLOCK_M, BLOCK_N], c_desc.layout)

    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_experts * tiles_m * tiles_n
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    my_tiles = gl.cdiv(num_tiles - pid, G)

    # producer: next chunk to copy (tile index pj of this program, chunk pc), STAGES - 2 chunks ahead
    pj, pm0, pn0, prs, pre = _next_nonempty(gl.to_tensor(0), my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n,
                                            BLOCK_M, BLOCK_N)
    pc = gl.to_tensor(0)
    for i in gl.static_range(STAGES - 2):
        pj, pc, pm0, pn0, prs, pre = _producer_step(
            p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_smem, q_smem, i, pj, pc, pm0, pn0, prs, pre, my_tiles, pid, G,
            num_tiles, row_offsets_ptr, tiles_m, tiles_n, M, N, stride_pr, stride_qr, P_GATHER, Q_GATHER,
            BLOCK_M, BLOCK_N, BLOCK_K, LOAD)

    step = gl.to_tensor(0)
    for j in range(my_tiles):
        expert, m0, n0, rs, re = _tile_params(pid + j * G, num_tiles, row_offsets_ptr, tiles_m, tiles_n,
                                              BLOCK_M, BLOCK_N)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
        for c in range(gl.cdiv(re - rs, BLOCK_K)):
            slot = step % STAGES
            async_copy.wait_group(STAGES - 3)  # this thread's copies of chunk `step` have landed
            gl.thread_barrier()  # everyone's have; every warpgroup is done with the slot of step - 2
            acc = warpgroup_mma(p_smem.index(slot).permute((1, 0)), q_smem.index(slot), acc, is_async=True)
            pj, pc, pm0, pn0, prs, pre = _producer_step(
                p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_smem, q_smem, (step + STAGES - 2) % STAGES, pj, pc, pm0,
                pn0, prs, pre, my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n, M, N, stride_pr,
                stride_qr, P_GATHER, Q_GATHER, BLOCK_M, BLOCK_N, BLOCK_K, LOAD)
            acc = warpgroup_mma_wait(1, deps=[acc])
            step += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        if TMA_C:
            buf = c_smem.index(j % 2)
            tma.store_wait(1)  # the store that last used this buffer (tile j - 2) has read it
            gl.thread_barrier()
            buf.store(acc.to(out_ty))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(c_desc, [expert * M + m0, n0], buf)
        else:
            out = gl.convert_layout(acc.to(out_ty), LOAD)
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD))
            ptrs = (c_ptr + expert.to(gl.int64) * stride_ce + offs_m.to(gl.int64)[:, None] * stride_cm
                    + offs_n[None, :])
            gl.store(ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    if TMA_C:
        tma.store_wait(0)
