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
def _tile_mn(t, num_tiles, tiles_m, tiles_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(expert, m0, n0) of tile t, clamped into range (callers mask tiles past the end)."""
    t = gl.minimum(t, num_tiles - 1)
    per_expert = tiles_m * tiles_n
    expert = t // per_expert
    rem = t - expert * per_expert
    return expert, (rem // tiles_n) * BLOCK_M, (rem % tiles_n) * BLOCK_N


@gluon.jit
def _tile_rows(t, num_tiles, row_offsets_ptr, tiles_m, tiles_n):
    """(first row, end row) of tile t's expert (clamped like _tile_mn). Loaded one tile ahead of use."""
    expert = gl.minimum(t, num_tiles - 1) // (tiles_m * tiles_n)
    return gl.load(row_offsets_ptr + expert), gl.load(row_offsets_ptr + expert + 1)


@gluon.jit
def _num_chunks(row_start, row_end, BLOCK_K: gl.constexpr):
    """Ring steps of a tile: its BLOCK_K-row chunks, and one all-zero step for an expert with no rows (its
    tile then stores the zeros of an accumulator that only ever added zero products)."""
    return gl.maximum(gl.cdiv(row_end - row_start, BLOCK_K), 1)


@gluon.jit
def _chunk_src(idx_ptr, row0, row_end, valid, GATHER: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT: gl.constexpr):
    """Source rows (int32: idx[rows] when GATHER) and row mask of the chunk starting at row0."""
    rows = row0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, LAYOUT))
    mask_r = (rows < row_end) & valid
    if GATHER:
        src = gl.load(idx_ptr + rows, mask=mask_r, other=0)
    else:
        src = rows
    return src, mask_r


@gluon.jit
def _copy_chunk(src_ptr, smem, src, mask_r, col0, ncols, stride_r, COLS: gl.constexpr, LAYOUT: gl.constexpr):
    """cp.async rows ``src`` x columns [col0, col0 + COLS) into smem (16-byte copies; zeros where masked)."""
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    ptrs = src_ptr + src.to(gl.int64)[:, None] * stride_r + cols[None, :]
    async_copy.async_copy_global_to_shared(smem, ptrs, mask=mask_r[:, None] & (cols < ncols)[None, :])


@gluon.jit
def _issue(p_ptr, q_ptr, p_smem, q_smem, slot, p_src, q_src, pmask, qmask, pj, pid, G, num_tiles, tiles_m, tiles_n,
           M, N, stride_pr, stride_qr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr,
           LAYOUT_Q: gl.constexpr):
    """One ring step: the producer's prepared chunk of P (m-slice) and Q (n-slice) into ``slot``, one commit
    group (all-masked past this program's last tile, so every step commits exactly one group)."""
    _, m0, n0 = _tile_mn(pid + pj * G, num_tiles, tiles_m, tiles_n, BLOCK_M, BLOCK_N)
    _copy_chunk(p_ptr, p_smem.index(slot), p_src, pmask, m0, M, stride_pr, BLOCK_M, LAYOUT)
    _copy_chunk(q_ptr, q_smem.index(slot), q_src, qmask, n0, N, stride_qr, BLOCK_N, LAYOUT_Q)
    async_copy.commit_group()


@gluon.jit
def _advance(pj, pc, prs, pre, nrs, nre, my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n,
             p_idx_ptr, q_idx_ptr, P_GATHER: gl.constexpr, Q_GATHER: gl.constexpr, BLOCK_K: gl.constexpr,
             LAYOUT: gl.constexpr, LAYOUT_Q: gl.constexpr):
    """Move the producer to its next chunk (the next tile's row range is already loaded; the one after is
    requested now) and request that chunk's gather indices, which the next step will use."""
    pc += 1
    if pc >= _num_chunks(prs, pre, BLOCK_K):
        pj += 1
        pc = 0
        prs = nrs
        pre = nre
        nrs, nre = _tile_rows(pid + (pj + 1) * G, num_tiles, row_offsets_ptr, tiles_m, tiles_n)
    p_src, pmask = _chunk_src(p_idx_ptr, prs + pc * BLOCK_K, pre, pj < my_tiles, P_GATHER, BLOCK_K, LAYOUT)
    q_src, qmask = _chunk_src(q_idx_ptr, prs + pc * BLOCK_K, pre, pj < my_tiles, Q_GATHER, BLOCK_K, LAYOUT_Q)
    return pj, pc, prs, pre, nrs, nre, p_src, q_src, pmask, qmask


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
    # cp.async layouts: 8 contiguous elements (16 bytes) per thread, a warp spanning a row of the chunk
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_M, BLOCK_M // 8], [num_warps, 1], [1, 0])
    LOAD_Q: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], SMEM)  # P chunk, M contiguous
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], SMEM)  # Q chunk, N contiguous
    if TMA_C:  # one staging buffer: its TMA store has a whole tile's main loop to finish before reuse
        c_smem = gl.allocate_shared_memory(out_ty, [BLOCK_M, BLOCK_N], c_desc.layout)

    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_tiles = num_experts * tiles_m * tiles_n
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    my_tiles = gl.cdiv(num_tiles - pid, G)

    # Producer: the next ring step to copy is chunk pc of this program's tile pj. Everything it needs is
    # loaded one step (gather indices) or one tile (expert row range) before it is used, so no step waits
    # on a global load: (prs, pre) rows of tile pj, (nrs, nre) of tile pj + 1, p_src / q_src / pmask the
    # prepared source rows of the current chunk.
    pj = gl.to_tensor(0)
    pc = gl.to_tensor(0)
    prs, pre = _tile_rows(pid, num_tiles, row_offsets_ptr, tiles_m, tiles_n)
    nrs, nre = _tile_rows(pid + G, num_tiles, row_offsets_ptr, tiles_m, tiles_n)
    p_src, pmask = _chunk_src(p_idx_ptr, prs, pre, pj < my_tiles, P_GATHER, BLOCK_K, LOAD)
    q_src, qmask = _chunk_src(q_idx_ptr, prs, pre, pj < my_tiles, Q_GATHER, BLOCK_K, LOAD_Q)
    for i in gl.static_range(STAGES - 2):
        _issue(p_ptr, q_ptr, p_smem, q_smem, i, p_src, q_src, pmask, qmask, pj, pid, G, num_tiles, tiles_m, tiles_n,
               M, N, stride_pr, stride_qr, BLOCK_M, BLOCK_N, LOAD, LOAD_Q)
        pj, pc, prs, pre, nrs, nre, p_src, q_src, pmask, qmask = _advance(
            pj, pc, prs, pre, nrs, nre, my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n, p_idx_ptr,
            q_idx_ptr, P_GATHER, Q_GATHER, BLOCK_K, LOAD, LOAD_Q)

    # Consumer: tile j's row range was loaded while tile j - 1 ran.
    step = gl.to_tensor(0)
    crs, cre = _tile_rows(pid, num_tiles, row_offsets_ptr, tiles_m, tiles_n)
    nch = _num_chunks(crs, cre, BLOCK_K)
    for j in range(my_tiles):
        expert, m0, n0 = _tile_mn(pid + j * G, num_tiles, tiles_m, tiles_n, BLOCK_M, BLOCK_N)
        next_rs, next_re = _tile_rows(pid + (j + 1) * G, num_tiles, row_offsets_ptr, tiles_m, tiles_n)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
        # a while loop, not range(nch): Triton 3.6 replaces a loop-carried scalar used as an inner range()
        # bound by its initial value (reproduced with a 10-line @triton.jit kernel; docs/perf.md)
        c = gl.to_tensor(0)
        while c < nch:
            slot = step % STAGES
            async_copy.wait_group(STAGES - 3)  # this thread's copies of chunk `step` have landed
            gl.thread_barrier()  # everyone's have; every warpgroup is done with the slot of step - 2
            # refill the slot of step - 2 with the producer's chunk (step + STAGES - 2)
            _issue(p_ptr, q_ptr, p_smem, q_smem, (step + STAGES - 2) % STAGES, p_src, q_src, pmask, qmask, pj, pid,
                   G, num_tiles, tiles_m, tiles_n, M, N, stride_pr, stride_qr, BLOCK_M, BLOCK_N, LOAD, LOAD_Q)
            acc = warpgroup_mma(p_smem.index(slot).permute((1, 0)), q_smem.index(slot), acc, is_async=True)
            pj, pc, prs, pre, nrs, nre, p_src, q_src, pmask, qmask = _advance(
                pj, pc, prs, pre, nrs, nre, my_tiles, pid, G, num_tiles, row_offsets_ptr, tiles_m, tiles_n,
                p_idx_ptr, q_idx_ptr, P_GATHER, Q_GATHER, BLOCK_K, LOAD, LOAD_Q)
            acc = warpgroup_mma_wait(1, deps=[acc])
            step += 1
            c += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        if TMA_C:
            tma.store_wait(0)  # the previous tile's store has read the staging buffer
            gl.thread_barrier()
            c_smem.store(acc.to(out_ty))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(c_desc, [expert * M + m0, n0], c_smem)
        else:
            out = gl.convert_layout(acc.to(out_ty), LOAD_Q)
            offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD_Q))
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD_Q))
            ptrs = (c_ptr + expert.to(gl.int64) * stride_ce + offs_m.to(gl.int64)[:, None] * stride_cm
                    + offs_n[None, :])
            gl.store(ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
        nch = _num_chunks(next_rs, next_re, BLOCK_K)
    if TMA_C:
        tma.store_wait(0)
