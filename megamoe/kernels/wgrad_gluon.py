"""Persistent k-grouped weight-gradient GEMM for Hopper, written in Gluon (``@gluon.jit`` only; launcher in
megamoe.ops.wgrad_gluon).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``);
E experts; C[e] = P[rows_e]^T @ Q[rows_e] is (M, N); BLOCK_K rows of an expert per reduction chunk (nch
chunks per expert); a unit is one (expert, m-tile) with all its n-tiles; STAGES slots of the load ring;
RES chunks of P that can stay in shared memory.

Same sums as ``megamoe.kernels.grouped_gemm.k_grouped_gemm_kernel`` (one output tile reduces its expert's
rows from the expert's first row, in BLOCK_K chunks, in row order, fp32, one cast; rows past the expert
are zero-filled, never another expert's), so the bits are the Triton kernels' (tests/test_wgrad_gluon_gpu.py
on H200). What differs is the structure:

* persistent over units: program pid walks the units pid, pid + G, ... (m-tile fastest, so the programs
  running at once stream the same expert's Q rows through L2);
* P stays on chip: a unit whose expert has nch <= RES chunks loads its nch P^T chunks once and keeps them
  in shared memory while Q's chunks stream past for every n-tile, so each FLOP costs 1 / BLOCK_M bytes of
  operand loads instead of 1 / BLOCK_M + 1 / BLOCK_N (this was expected to be the limit at ~128-256 rows
  per expert; measured, it moved the time by +11% to -22%: the kernel is latency bound at one program per
  SM, docs/perf.md); a larger expert streams P and Q chunk pairs through the same ring;
* within a unit the ring runs across n-tile boundaries (the next tile's chunks are copied while a tile's
  last chunk is multiplied and stored), STAGES - 2 chunks ahead, with ``cp.async`` (zero fill past the
  expert's rows, optionally gathered through a row index; the indices are requested a step ahead);
* ``wgmma`` is issued asynchronously with one group in flight;
* the epilogue stores the tile with TMA from a shared-memory staging buffer, so the store overlaps the
  next tile's main loop (masked stores where a 128-row tile would cross into the next expert).

Slot reuse (no mbarriers): every step s waits for its own copies of chunk s (``cp.async.wait_group``), then
a CTA barrier; each warpgroup waited for its wgmma of step s - 2 before reaching that barrier, so the
loads issued at step s go to the slot of step s - 2. A unit ends with every copy and wgmma drained, so the
resident chunks of the next unit never overwrite a slot still in use.

Note (Triton 3.6): a loop-carried scalar used as an inner ``range()`` bound is replaced by its initial value
(seen on the CPU-side compile of a 10-line @triton.jit kernel); the chunk loops here are ``while`` loops.

Design after the persistent / pipelined matmuls of Triton's Gluon tutorials (07-persistence, 04-tma) and
CUTLASS's SM90 multistage mainloop (cp.async + GMMA); the reduction order is this project's (docs/design.md).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_compat import cp_async_load, cta_barrier, tma_store


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
    cp_async_load(smem, ptrs, mask=mask_r[:, None] & (cols < ncols)[None, :])


@gluon.jit
def _step_src(p_idx_ptr, q_idx_ptr, kc, kn, tiles_n, row_start, row_end, P_GATHER: gl.constexpr,
              Q_GATHER: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT_P: gl.constexpr, LAYOUT_Q: gl.constexpr):
    """Source rows and masks of the ring step for chunk kc of n-tile kn (steps past the unit's last n-tile
    are all-masked)."""
    row0 = row_start + kc * BLOCK_K
    p_src, pmask = _chunk_src(p_idx_ptr, row0, row_end, kn < tiles_n, P_GATHER, BLOCK_K, LAYOUT_P)
    q_src, qmask = _chunk_src(q_idx_ptr, row0, row_end, kn < tiles_n, Q_GATHER, BLOCK_K, LAYOUT_Q)
    return p_src, pmask, q_src, qmask


@gluon.jit
def _next_step(k, kc, kn, nch):
    """Advance the producer (step count, chunk, n-tile) without integer division (they were a large share of
    the per-step instructions, docs/perf.md)."""
    wrap = kc + 1 == nch
    return k + 1, gl.where(wrap, 0, kc + 1), kn + wrap.to(gl.int32)


@gluon.jit
def _issue_step(p_ptr, q_ptr, p_buf, q_ring, k, kn, m0, M, N, stride_pr, stride_qr, p_src, pmask, q_src, qmask,
                resident, STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                LAYOUT_P: gl.constexpr, LAYOUT_Q: gl.constexpr):
    """Copy ring step k (n-tile kn): the Q chunk into ring slot k % STAGES, and (streamed P) the P chunk into
    p_buf slot k % STAGES; one commit group per step."""
    slot = k % STAGES
    _copy_chunk(q_ptr, q_ring.index(slot), q_src, qmask, kn * BLOCK_N, N, stride_qr, BLOCK_N, LAYOUT_Q)
    if not resident:
        _copy_chunk(p_ptr, p_buf.index(slot), p_src, pmask, m0, M, stride_pr, BLOCK_M, LAYOUT_P)
    async_copy.commit_group()


@gluon.jit
def _prime_ring(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_buf, q_ring, nch, tiles_n, row_start, row_end, m0, M, N,
                stride_pr, stride_qr, resident, P_GATHER: gl.constexpr, Q_GATHER: gl.constexpr, STAGES: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT_P: gl.constexpr,
                LAYOUT_Q: gl.constexpr):
    """A unit's first STAGES - 2 ring steps issued; returns the producer's next step (k, chunk kc, n-tile kn) and
    its source rows and masks."""
    k = gl.to_tensor(0)
    kc = gl.to_tensor(0)
    kn = gl.to_tensor(0)
    p_src, pmask, q_src, qmask = _step_src(p_idx_ptr, q_idx_ptr, kc, kn, tiles_n, row_start, row_end, P_GATHER,
                                           Q_GATHER, BLOCK_K, LAYOUT_P, LAYOUT_Q)
    for _i in gl.static_range(STAGES - 2):
        _issue_step(p_ptr, q_ptr, p_buf, q_ring, k, kn, m0, M, N, stride_pr, stride_qr, p_src, pmask, q_src, qmask,
                    resident, STAGES, BLOCK_M, BLOCK_N, LAYOUT_P, LAYOUT_Q)
        k, kc, kn = _next_step(k, kc, kn, nch)
        p_src, pmask, q_src, qmask = _step_src(p_idx_ptr, q_idx_ptr, kc, kn, tiles_n, row_start, row_end, P_GATHER,
                                               Q_GATHER, BLOCK_K, LAYOUT_P, LAYOUT_Q)
    return k, kc, kn, p_src, pmask, q_src, qmask


@gluon.jit
def _load_resident_p(p_ptr, p_idx_ptr, p_buf, nch, row_start, row_end, m0, M, stride_pr, P_GATHER: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT_P: gl.constexpr):
    """A resident unit's nch P^T chunks into p_buf slots 0 .. nch - 1, loaded once (one commit group, older than
    every Q step)."""
    c = gl.to_tensor(0)
    while c < nch:
        p_src, pmask = _chunk_src(p_idx_ptr, row_start + c * BLOCK_K, row_end, True, P_GATHER, BLOCK_K, LAYOUT_P)
        _copy_chunk(p_ptr, p_buf.index(c), p_src, pmask, m0, M, stride_pr, BLOCK_M, LAYOUT_P)
        c += 1
    async_copy.commit_group()


@gluon.jit
def _store_tile_tma(acc, c_desc, c_smem, row0, n0):
    """TMA_C epilogue: the tile through the staging buffer ``c_smem`` to rows [row0, row0 + BLOCK_M) of the
    (E * M, N) view; the store overlaps the next tile's main loop."""
    tma.store_wait(0)  # the previous tile's store has read the staging buffer
    cta_barrier()
    c_smem.store(acc.to(c_smem.dtype))
    fence_async_shared()
    cta_barrier()
    tma_store(c_desc, [row0, n0], c_smem)


@gluon.jit
def _store_tile_masked(acc, c_ptr, expert, m0, n0, M, N, stride_ce, stride_cm, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Masked-store epilogue: the tile at (m0, n0) of C[expert], rows and columns past (M, N) not written."""
    out = gl.convert_layout(acc.to(c_ptr.dtype.element_ty), LAYOUT)
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LAYOUT))
    ptrs = c_ptr + expert.to(gl.int64) * stride_ce + offs_m.to(gl.int64)[:, None] * stride_cm + offs_n[None, :]
    gl.store(ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@gluon.jit
def k_grouped_wgrad_kernel(
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, RES: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(STAGES >= 3, "the ring needs STAGES >= 3 (STAGES - 2 chunks in flight)")
    dtype: gl.constexpr = p_ptr.dtype.element_ty
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    # cp.async layouts: 8 contiguous elements (16 bytes) per thread, a warp spanning a row of the chunk
    LOAD_P: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_M, BLOCK_M // 8], [num_warps, 1], [1, 0])
    LOAD_Q: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    P_SLOTS: gl.constexpr = RES if RES > STAGES else STAGES
    p_buf = gl.allocate_shared_memory(dtype, [P_SLOTS, BLOCK_K, BLOCK_M], SMEM)  # P^T chunks, M contiguous
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_N], SMEM)  # Q chunks, N contiguous
    if TMA_C:  # one staging buffer: its TMA store has a whole tile's main loop to finish before reuse
        c_smem = gl.allocate_shared_memory(out_ty, [BLOCK_M, BLOCK_N], c_desc.layout)

    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    for unit in range(gl.program_id(0), num_experts * tiles_m, gl.num_programs(0)):
        expert = unit // tiles_m
        m0 = (unit % tiles_m) * BLOCK_M
        row_start = gl.load(row_offsets_ptr + expert)
        row_end = gl.load(row_offsets_ptr + expert + 1)
        # an expert with no rows runs one all-zero chunk: its tiles store the zeros of an accumulator that
        # only ever added zero products
        nch = gl.maximum(gl.cdiv(row_end - row_start, BLOCK_K), 1)
        resident = nch <= RES
        if resident:
            _load_resident_p(p_ptr, p_idx_ptr, p_buf, nch, row_start, row_end, m0, M, stride_pr, P_GATHER, BLOCK_M,
                             BLOCK_K, LOAD_P)
        # producer: next ring step to copy (k), its chunk (kc) and n-tile (kn), and its source rows
        k, kc, kn, p_src, pmask, q_src, qmask = _prime_ring(p_ptr, p_idx_ptr, q_ptr, q_idx_ptr, p_buf, q_ring, nch,
                                                            tiles_n, row_start, row_end, m0, M, N, stride_pr,
                                                            stride_qr, resident, P_GATHER, Q_GATHER, STAGES, BLOCK_M,
                                                            BLOCK_N, BLOCK_K, LOAD_P, LOAD_Q)
        s = gl.to_tensor(0)  # consumer: ring step being multiplied
        for n_tile in range(tiles_n):
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
            c = gl.to_tensor(0)
            while c < nch:
                async_copy.wait_group(STAGES - 3)  # this thread's copies of step s have landed
                cta_barrier()  # everyone's have; every warpgroup is done with the slot of step s - 2
                _issue_step(p_ptr, q_ptr, p_buf, q_ring, k, kn, m0, M, N, stride_pr, stride_qr, p_src, pmask,
                            q_src, qmask, resident, STAGES, BLOCK_M, BLOCK_N, LOAD_P, LOAD_Q)
                p_slot = gl.where(resident, c, s % STAGES)
                acc = warpgroup_mma(p_buf.index(p_slot).permute((1, 0)), q_ring.index(s % STAGES), acc,
                                    is_async=True)
                k, kc, kn = _next_step(k, kc, kn, nch)
                p_src, pmask, q_src, qmask = _step_src(p_idx_ptr, q_idx_ptr, kc, kn, tiles_n, row_start, row_end,
                                                       P_GATHER, Q_GATHER, BLOCK_K, LOAD_P, LOAD_Q)
                acc = warpgroup_mma_wait(1, deps=[acc])
                s += 1
                c += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            n0 = n_tile * BLOCK_N
            if TMA_C:
                _store_tile_tma(acc, c_desc, c_smem, expert * M + m0, n0)
            else:
                _store_tile_masked(acc, c_ptr, expert, m0, n0, M, N, stride_ce, stride_cm, BLOCK_M, BLOCK_N, LOAD_Q)
        async_copy.wait_group(0)  # the unit's trailing (all-masked) steps: nothing in flight past a unit
        cta_barrier()
    if TMA_C:
        tma.store_wait(0)
