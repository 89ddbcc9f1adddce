"""Warp-specialized block-scaled FP8 GEMMs for Hopper in Gluon (``@gluon.jit`` only; launchers in
megamoe.ops.fp8_gemm_gluon): the m-grouped GEMM with a plain epilogue (below) and the k-grouped weight gradient
(the second half of this file, its own legend there).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``); E
experts; N output columns; K reduction size; KB = K / 128 K-blocks (the scale group); a tile is (m-tile, n-tile),
n-tile fastest, m-tiles never straddling two experts (``tile_offsets``, megamoe.kernels.tiles.expert_of_tile);
a step is one (tile, K-block) pair; STAGES slots of the TMA load ring.

``C[r] = cast(acc)``, ``acc = sum over K-blocks kb in increasing order of p_kb * (sa[r, kb] * sb[e, n // 128, kb])``
with ``p_kb = dot(A[r, kb], B[e][n, kb])`` an FP8 (e4m3) dot of 128 from zero (fp32 out), acc starting from
zeros and each promotion one fused multiply-add: the arithmetic of megamoe.kernels.fp8_gemm.fp8_m_grouped_kernel
(PLAIN, 128-column tiles: ``acc + p * (sa * sb)[:, None]``), hence its bits. A (R, K) and B (E, N, K) e4m3 are
K-major (the layout the FP8 tensor cores read); sa (R, KB), sb (E, N / 128, KB) fp32.

Why: the Triton kernel waits for each K-block's wgmma before promoting it, so the tensor cores idle during every
promotion. Here each MMA warpgroup issues K-block kb + 1's wgmma asynchronously (into a fresh accumulator) and
promotes K-block kb while it runs (``warpgroup_mma_wait(1)``: one wgmma stays in flight across the promotion).
Holding the running sum, the block being promoted and the block in flight takes 3 x 64 registers per thread for a
64 x 128 warpgroup tile; the K loop is unrolled (KB is a constant), so no in-flight accumulator is loop-carried.

Partitions of one program (persistent, tiles pid, pid + G, ...): a TMA load warp and two MMA warpgroups
working on every tile together (cooperative), warpgroup c on rows [64c, 64c + 64) of the 128 x 128 tile. The load
warp copies a step's A block (128 x 128 at [row0, 128 kb]) and B block (128 x 128 at [e N + n0, 128 kb] of B's
(E N, K) view) into slot s % STAGES; rows past R are zero-filled, rows of the next expert are computed and never
stored. Scales are loaded by the MMA warpgroups from global memory one K-block ahead of their use.

Handshakes (mbarriers): ready[slot] (count 1) the step's two TMA copies landed (expect-tx); empty[slot] (count
2) both warpgroups' wgmmas of that step completed. Step s uses slot s % STAGES, phase (s // STAGES) & 1.

Epilogue (per warpgroup, its 64 rows): the tile cast to C's dtype into the warpgroup's staging buffer; rows all
inside the expert leave by a TMA store (overlapping the warpgroup's next tile), otherwise a masked copy from the
staging buffer (rows past the expert's end are never written).

Design after DeepGEMM's SM90 FP8 GEMM and CUTLASS's SM90 cooperative warp-specialized kernel; the reduction order
is this project's (docs/fp8.md).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_compat import cta_barrier, smem_reinterpret, tma_load, tma_store

QB = gl.constexpr(128)  # the scale group: K-block and B's scale block


@gluon.jit
def _tile_coords(tile, tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles, E_POW2: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT_E: gl.constexpr):
    """(expert, first row, end row, n-tile) of tile ``tile``; empty experts own no tiles."""
    m_tile = tile // num_n_tiles
    n_tile = tile - m_tile * num_n_tiles
    offs_e = gl.arange(0, E_POW2, layout=LAYOUT_E)
    tile_ends = gl.load(tile_offsets_ptr + 1 + offs_e, mask=offs_e < num_experts, other=2147483647)
    expert = gl.minimum(gl.sum((tile_ends <= m_tile).to(gl.int32), axis=0), num_experts - 1)
    first_tile = gl.load(tile_offsets_ptr + expert)
    row_start = gl.load(row_offsets_ptr + expert) + (m_tile - first_tile) * BLOCK_M
    row_end = gl.load(row_offsets_ptr + expert + 1)
    return expert, row_start, row_end, n_tile


@gluon.jit
def _load_warp(a_desc, b_desc, a_ring, b_ring, ready, empty, tile_offsets_ptr, row_offsets_ptr, num_experts, N,
               num_n_tiles, num_tiles, KB: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: TMA copies of every step of the program's tiles, in order, each into a slot both MMA warpgroups
    released."""
    LAYOUT_E: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    G = gl.num_programs(0)
    s = 0
    tile = gl.program_id(0)
    while tile < num_tiles:
        expert, row, _, n_tile = _tile_coords(tile, tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles,
                                              E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
        b_row = expert * N + n_tile * BLOCK_N
        for kb in range(KB):
            slot = s % STAGES
            mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)  # a fresh slot passes at once
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma_load(a_desc, [row, kb * QB], bar, a_ring.index(slot))
            tma_load(b_desc, [b_row, kb * QB], bar, b_ring.index(slot))
            s += 1
        tile += G


@gluon.jit
def _issue(a_ring, b_ring, ready, s, spare, CONSUMER: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr):
    """Wait for step s's operands and issue its wgmma (this warpgroup's rows, a dot of 128 from zero), async, into
    the registers of ``spare`` (a dead accumulator: its values are not read, use_acc=False)."""
    slot = s % STAGES
    mbarrier.wait(ready.index(slot), (s // STAGES) & 1)
    a_op = a_ring.index(slot).slice(CONSUMER * ROWS, ROWS, dim=0)
    return warpgroup_mma(a_op, b_ring.index(slot).permute((1, 0)), spare, use_acc=False, is_async=True)


@gluon.jit
def _scales(as_ptrs, bs_ptr, kb):
    """K-block kb's scale product per row: ``sa * sb`` in fp32 (the Triton kernel's ONE_SB order)."""
    return gl.load(as_ptrs + kb) * gl.load(bs_ptr + kb)


@gluon.jit
def _promote(p, acc, sc, empty, s, STAGES: gl.constexpr):
    """Wait until step s's wgmma (p) is complete, the one issued after it still in flight, release its slot and
    return ``(acc + p * sc[:, None], p)`` (one FMA per element; p is then dead: the next wgmma's registers). acc
    passes through the wait, so the promotion before stays before it and this one after it (LLVM would otherwise
    interleave promotions: more accumulators live)."""
    p, acc = warpgroup_mma_wait(1, deps=[p, acc])
    mbarrier.arrive(empty.index(s % STAGES))
    return acc + p * sc[:, None], p


@gluon.jit
def _chunk(p, sc, acc, a_ring, b_ring, ready, empty, s, k0, as_ptrs, bs_ptr, CONSUMER: gl.constexpr,
           UNROLL: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr):
    """UNROLL K-blocks from k0 (step s + k0), unrolled, whose first wgmma (p, scales sc) is already issued: K-block
    kb + 1's wgmma runs while K-block kb is promoted. Three accumulators rotate (the sum, the block being promoted,
    the block in flight): each wgmma writes the registers of the block promoted just before it. Only the last
    promotion waits for the tensor cores to drain (the other MMA warpgroup's wgmmas fill that gap)."""
    spare = gl.zeros([ROWS, BLOCK_N], gl.float32, MMA)
    for u in gl.static_range(1, UNROLL):
        nxt = _issue(a_ring, b_ring, ready, s + k0 + u, spare, CONSUMER, STAGES, ROWS)
        sc_next = _scales(as_ptrs, bs_ptr, k0 + u)
        acc, spare = _promote(p, acc, sc, empty, s + k0 + u - 1, STAGES)
        p = nxt
        sc = sc_next
    p, acc = warpgroup_mma_wait(0, deps=[p, acc])
    mbarrier.arrive(empty.index((s + k0 + UNROLL - 1) % STAGES))
    return acc + p * sc[:, None]


@gluon.jit
def _k_loop(p0, sc0, a_ring, b_ring, ready, empty, s, as_ptrs, bs_ptr, CONSUMER: gl.constexpr, KB: gl.constexpr,
            UNROLL: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
            MMA: gl.constexpr):
    """One tile's K loop from step s, acc from zeros, K-blocks in order, K-block 0's wgmma (p0, scales sc0) issued
    by the caller. It runs over chunks of UNROLL K-blocks (:func:`_chunk`) with no wgmma in flight across the loop's
    back edge (ptxas serializes every wgmma of a loop whose in-flight accumulators other instructions read across
    iterations)."""
    acc = _chunk(p0, sc0, gl.zeros([ROWS, BLOCK_N], gl.float32, MMA), a_ring, b_ring, ready, empty, s, 0, as_ptrs,
                 bs_ptr, CONSUMER, UNROLL, STAGES, ROWS, BLOCK_N, MMA)
    for c in range(1, KB // UNROLL):
        k0 = c * UNROLL
        p = _issue(a_ring, b_ring, ready, s + k0, gl.zeros([ROWS, BLOCK_N], gl.float32, MMA), CONSUMER, STAGES,
                   ROWS)
        acc = _chunk(p, _scales(as_ptrs, bs_ptr, k0), acc, a_ring, b_ring, ready, empty, s, k0, as_ptrs, bs_ptr,
                     CONSUMER, UNROLL, STAGES, ROWS, BLOCK_N, MMA)
    return acc


@gluon.jit
def _store_rows(acc, c_ptr, c_desc, stage, row, row_end, n0, stride_cm, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """This warpgroup's epilogue: ``cast(acc)`` into rows [row, row + ROWS) below row_end, columns [n0, n0 +
    BLOCK_N), through its staging buffer: a TMA store when every row is inside the expert, else a masked copy."""
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    tma.store_wait(0)  # this warpgroup's previous store has read the staging buffer
    cta_barrier()
    stage.store(acc.to(out_ty))
    fence_async_shared()
    cta_barrier()  # the warpgroup's whole block is in shared memory
    if row + ROWS <= row_end:
        tma_store(c_desc, [row, n0], stage)
    else:
        VEC: gl.constexpr = 128 // c_ptr.dtype.element_ty.primitive_bitwidth  # 16-byte vectors
        STORE: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BLOCK_N, BLOCK_N // VEC], [4, 1], [1, 0])
        out = stage.load(STORE)
        offs_m = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, STORE))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, STORE))
        ptrs = c_ptr + offs_m.to(gl.int64)[:, None] * stride_cm + offs_n[None, :]
        gl.store(ptrs, out, mask=(offs_m < row_end)[:, None] & (offs_n >= 0)[None, :])


@gluon.jit
def _mma_warpgroup(a_ring, b_ring, ready, empty, c_smem, c_ptr, c_desc, as_ptr, bs_ptr, tile_offsets_ptr,
                   row_offsets_ptr, num_rows, num_experts, num_n_tiles, num_tiles, stride_asm, stride_bse,
                   stride_bsn, stride_cm, CONSUMER: gl.constexpr, KB: gl.constexpr, UNROLL: gl.constexpr,
                   STAGES: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warpgroup: rows [64 CONSUMER, +64) of every tile of the program: wgmmas, promotion, epilogue."""
    ROWS: gl.constexpr = BLOCK_M // 2
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    LAYOUT_E: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    stage = c_smem.index(CONSUMER)
    G = gl.num_programs(0)
    s = 0
    first = gl.program_id(0)
    tile = first
    # a tile's coordinates are loaded while the tile before it runs (clamped: a real tile)
    expert, row, row_end, n_tile = _tile_coords(gl.maximum(gl.minimum(tile, num_tiles - 1), 0), tile_offsets_ptr,
                                                row_offsets_ptr, num_experts, num_n_tiles, E_POW2, BLOCK_M, BLOCK_N,
                                                LAYOUT_E)
    acc_prev = gl.zeros([ROWS, BLOCK_N], gl.float32, MMA)
    row_prev = 0
    end_prev = 0
    n_prev = 0
    while tile < num_tiles:
        row += CONSUMER * ROWS
        offs_m = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        rows = gl.minimum(offs_m, num_rows - 1).to(gl.int64)  # clamped: computed, never stored
        as_ptrs = as_ptr + rows * stride_asm
        bs_tile = bs_ptr + expert.to(gl.int64) * stride_bse + n_tile * stride_bsn
        p0 = _issue(a_ring, b_ring, ready, s, gl.zeros([ROWS, BLOCK_N], gl.float32, MMA), CONSUMER, STAGES, ROWS)
        sc0 = _scales(as_ptrs, bs_tile, 0)
        if tile != first:  # the previous tile's epilogue while this tile's first wgmma runs
            _store_rows(acc_prev, c_ptr, c_desc, stage, row_prev, end_prev, n_prev, stride_cm, ROWS, BLOCK_N)
        e_next, row_next, end_next, n_next = _tile_coords(gl.minimum(tile + G, num_tiles - 1), tile_offsets_ptr,
                                                          row_offsets_ptr, num_experts, num_n_tiles, E_POW2, BLOCK_M,
                                                          BLOCK_N, LAYOUT_E)
        acc_prev = _k_loop(p0, sc0, a_ring, b_ring, ready, empty, s, as_ptrs, bs_tile, CONSUMER, KB, UNROLL, STAGES,
                           ROWS, BLOCK_N, MMA)
        row_prev = row
        end_prev = row_end
        n_prev = n_tile * BLOCK_N
        expert = e_next
        row = row_next
        row_end = end_next
        n_tile = n_next
        s += KB
        tile += G
    if tile != first:
        _store_rows(acc_prev, c_ptr, c_desc, stage, row_prev, end_prev, n_prev, stride_cm, ROWS, BLOCK_N)
    tma.store_wait(0)


@gluon.jit
def fp8_m_grouped_ws_kernel(
    # inputs: TMA descriptors of A (R, K) e4m3 and of B's (E N, K) view, blocks (BLOCK_M, 128) / (BLOCK_N, 128);
    # A's row scales (R, KB) fp32, B's scale grid (E, N / 128, KB) fp32 (last dimensions contiguous)
    a_desc, b_desc, as_ptr, bs_ptr, row_offsets_ptr, tile_offsets_ptr,
    # output C (R, N), rows contiguous; c_desc: its TMA descriptor, block (BLOCK_M / 2, BLOCK_N)
    c_ptr, c_desc,
    # shapes and strides (elements; K a weight dimension)
    num_rows, N, num_experts, stride_asm, stride_bse, stride_bsn, stride_cm, K: gl.constexpr,
    # variant and tile config (num_warps = 4: the default partition is MMA warpgroup 0; UNROLL divides K / 128)
    E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, UNROLL: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one MMA warpgroup")
    gl.static_assert(BLOCK_M == 128 and BLOCK_N == 128, "128 x 128 tiles: one weight scale block per tile")
    gl.static_assert(K % QB == 0 and K >= QB, "K must be a positive multiple of 128")
    gl.static_assert(STAGES >= 2, "the ring needs STAGES >= 2")
    KB: gl.constexpr = K // QB
    gl.static_assert(KB % UNROLL == 0, "UNROLL must divide K / 128")
    dtype: gl.constexpr = a_desc.dtype
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups read every slot
    num_n_tiles = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    gl.warp_specialize([
        (_mma_warpgroup, (a_ring, b_ring, ready, empty, c_smem, c_ptr, c_desc, as_ptr, bs_ptr, tile_offsets_ptr,
                          row_offsets_ptr, num_rows, num_experts, num_n_tiles, num_tiles, stride_asm, stride_bse,
                          stride_bsn, stride_cm, 0, KB, UNROLL, STAGES, E_POW2, BLOCK_M, BLOCK_N)),
        (_mma_warpgroup, (a_ring, b_ring, ready, empty, c_smem, c_ptr, c_desc, as_ptr, bs_ptr, tile_offsets_ptr,
                          row_offsets_ptr, num_rows, num_experts, num_n_tiles, num_tiles, stride_asm, stride_bse,
                          stride_bsn, stride_cm, 1, KB, UNROLL, STAGES, E_POW2, BLOCK_M, BLOCK_N)),
        (_load_warp, (a_desc, b_desc, a_ring, b_ring, ready, empty, tile_offsets_ptr, row_offsets_ptr, num_experts,
                      N, num_n_tiles, num_tiles, KB, STAGES, E_POW2, BLOCK_M, BLOCK_N)),
    ], [4, 1], [232, 40])


# ---------------------------------------------------------------------------------------------- weight gradient
# k-grouped: ``C[e] = cast(acc)``, ``acc = sum over expert e's 128-row blocks b in increasing order of
# p_b * (sp[b, m] * sq[b, n])`` with ``p_b = dot(P_b^T[m], Q_b^T[n])`` an FP8 dot of 128 rows from zero: the
# arithmetic of megamoe.kernels.fp8_gemm.fp8_k_grouped_kernel (PADDED), hence its bits. P^T (M, 128 NB) and Q^T
# (N, 128 NB) e4m3 are the block-padded K-major buffers of the 128x1 quantizer (zeros past each expert's rows),
# sp (NB, M) and sq (NB, N) fp32. Tiles (expert, m-tile, n-tile), n-tile fastest and experts slowest (concurrent
# programs share an expert's blocks in L2); every tile is stored (an expert without rows gets zeros). The
# K loop's length is the expert's block count (a runtime value). Tiles are 128 x 128 and each warpgroup issues,
# waits for and promotes one block at a time, with no wgmma of its own in flight during a promotion: the other
# warpgroup's wgmma keeps the tensor cores busy meanwhile (the two drift apart on their own). Keeping the next
# block's wgmma in flight instead, as the m-grouped kernel does, needs a third accumulator: at 128 x 128 that
# spills, and the 128 x 64 tiles it fits in read 1.5x the L2 bytes per FLOP (measured 1.15-1.31x the time).
# A tile's epilogue runs while the next tile's first wgmma does (two accumulators live then, as in the loop), so
# the tensor cores do not wait for the stores: at deepseek-v3's ~256 rows per expert a tile has only 2-3 blocks.
# The scales ride the load ring: the load warp copies each block's row of sp (over the tile's 128 rows) and of sq
# (over its 128 columns) by TMA into the block's slot, so a promotion reads them from shared memory (loaded from
# global memory by the warpgroups, they were the kernel's largest stall: the promotion waiting on their latency).
# A slot is released by one thread's mbarrier.arrive, which the compiler puts after a barrier of the warpgroup, so
# every thread has read the slot's scales by then (tests/test_fp8_gemm_gluon_compile.py checks the PTX for it).


@gluon.jit
def _wgrad_coords(tile, row_offsets_ptr, block_offsets_ptr, num_m_tiles, num_n_tiles):
    """(expert, m-tile, n-tile, first 128-row block, number of blocks) of tile ``tile``."""
    per_expert = num_m_tiles * num_n_tiles
    expert = tile // per_expert
    rest = tile - expert * per_expert
    m_tile = rest // num_n_tiles
    n_tile = rest - m_tile * num_n_tiles
    rows = gl.load(row_offsets_ptr + expert + 1) - gl.load(row_offsets_ptr + expert)
    return expert, m_tile, n_tile, gl.load(block_offsets_ptr + expert), (rows + QB - 1) // QB


@gluon.jit
def _wgrad_load_warp(p_desc, q_desc, sp_desc, sq_desc, p_ring, q_ring, sp_ring, sq_ring, ready, empty,
                     row_offsets_ptr, block_offsets_ptr, num_m_tiles, num_n_tiles, num_tiles, STAGES: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: TMA copies of every block of the program's tiles, in order (P^T's rows of the m-tile, Q^T's of
    the n-tile, 128 columns of the block, and the block's row of each scale grid over the tile's rows and
    columns), each into a slot both MMA warpgroups released; a tile of an empty expert gets one block of zeros
    with zero scales (TMA fills a box outside the tensor with zeros)."""
    G = gl.num_programs(0)
    s = 0
    tile = gl.program_id(0)
    while tile < num_tiles:
        _, m_tile, n_tile, first, nb = _wgrad_coords(tile, row_offsets_ptr, block_offsets_ptr, num_m_tiles,
                                                     num_n_tiles)
        for j in range(gl.maximum(nb, 1)):  # an empty expert's tile: one block from out of bounds, zeros
            slot = s % STAGES
            mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)  # a fresh slot passes at once
            bar = ready.index(slot)
            mbarrier.expect(bar, p_desc.block_type.nbytes + q_desc.block_type.nbytes + sp_desc.block_type.nbytes +
                            sq_desc.block_type.nbytes)
            b = first + j if nb > 0 else -1
            tma_load(p_desc, [m_tile * BLOCK_M, b * QB], bar, p_ring.index(slot))
            tma_load(q_desc, [n_tile * BLOCK_N, b * QB], bar, q_ring.index(slot))
            tma_load(sp_desc, [b, m_tile * BLOCK_M], bar, sp_ring.index(slot))
            tma_load(sq_desc, [b, n_tile * BLOCK_N], bar, sq_ring.index(slot))
            s += 1
        tile += G


@gluon.jit
def _wgrad_scales(sp_ring, sq_ring, s, STAGES: gl.constexpr, CONSUMER: gl.constexpr, ROWS: gl.constexpr,
                  MMA: gl.constexpr):
    """Step s's scales from its ring slot (landed with its operands): P's for this warpgroup's rows, Q's for the
    tile's columns (each slot holds one (1, 128) row of each grid, read as a (128,) row)."""
    slot = s % STAGES
    ROW: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    sp_row = smem_reinterpret(sp_ring.index(slot), gl.float32, sp_ring.shape[2], ROW)
    sq_row = smem_reinterpret(sq_ring.index(slot), gl.float32, sq_ring.shape[2], ROW)
    return sp_row.slice(CONSUMER * ROWS, ROWS).load(gl.SliceLayout(1, MMA)), sq_row.load(gl.SliceLayout(0, MMA))


@gluon.jit
def _wgrad_store(acc, stage, c_desc, row, n0):
    """A warpgroup's epilogue: ``cast(acc)`` through its staging buffer, out by a TMA store."""
    tma.store_wait(0)  # this warpgroup's previous store has read the staging buffer
    cta_barrier()
    stage.store(acc.to(c_desc.dtype))
    fence_async_shared()
    cta_barrier()  # the warpgroup's whole block is in shared memory
    tma_store(c_desc, [row, n0], stage)


@gluon.jit
def _wgrad_mma_warpgroup(p_ring, q_ring, sp_ring, sq_ring, ready, empty, c_smem, c_desc, row_offsets_ptr,
                         block_offsets_ptr, M, num_m_tiles, num_n_tiles, num_tiles, CONSUMER: gl.constexpr,
                         STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warpgroup: rows [64 CONSUMER, +64) of every tile of the program. Per tile: issue block 0's wgmma, run
    the previous tile's epilogue meanwhile (cast, staging buffer, TMA store), then wait and promote block 0
    (``zeros + p * s``) and the other blocks one at a time (issue, wait, promote). An empty expert's tile runs
    its one block of zeros with zero scales: +0.0 out."""
    ROWS: gl.constexpr = BLOCK_M // 2
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    stage = c_smem.index(CONSUMER)
    G = gl.num_programs(0)
    s = 0
    tile = gl.program_id(0)
    acc_prev = gl.zeros([ROWS, BLOCK_N], gl.float32, MMA)
    have = 0  # a previous tile waits for its epilogue
    row_prev = 0
    n_prev = 0
    # a tile's coordinates are loaded while the tile before it runs its first wgmma (clamped: a real tile)
    expert, m_tile, n_tile, _, nb = _wgrad_coords(gl.minimum(tile, num_tiles - 1), row_offsets_ptr,
                                                  block_offsets_ptr, num_m_tiles, num_n_tiles)
    while tile < num_tiles:
        p = _issue(p_ring, q_ring, ready, s, gl.zeros([ROWS, BLOCK_N], gl.float32, MMA), CONSUMER, STAGES, ROWS)
        sp, sq = _wgrad_scales(sp_ring, sq_ring, s, STAGES, CONSUMER, ROWS, MMA)
        e_next, m_next, n_next, _, nb_next = _wgrad_coords(gl.minimum(tile + G, num_tiles - 1), row_offsets_ptr,
                                                           block_offsets_ptr, num_m_tiles, num_n_tiles)
        m0 = m_tile * BLOCK_M + CONSUMER * ROWS
        n0 = n_tile * BLOCK_N
        if have != 0:
            _wgrad_store(acc_prev, stage, c_desc, row_prev, n_prev)
        p = warpgroup_mma_wait(0, deps=[p])
        mbarrier.arrive(empty.index(s % STAGES))
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, MMA)
        acc = acc + p * (sp[:, None] * sq[None, :])
        for j in range(1, nb):
            p = _issue(p_ring, q_ring, ready, s + j, gl.zeros([ROWS, BLOCK_N], gl.float32, MMA), CONSUMER, STAGES,
                       ROWS)
            sp, sq = _wgrad_scales(sp_ring, sq_ring, s + j, STAGES, CONSUMER, ROWS, MMA)
            p, acc = warpgroup_mma_wait(0, deps=[p, acc])
            mbarrier.arrive(empty.index((s + j) % STAGES))
            acc = acc + p * (sp[:, None] * sq[None, :])
        acc_prev = acc
        have = 1
        row_prev = expert * M + m0
        n_prev = n0
        s += gl.maximum(nb, 1)
        tile += G
        expert = e_next
        m_tile = m_next
        n_tile = n_next
        nb = nb_next
    if have != 0:
        _wgrad_store(acc_prev, stage, c_desc, row_prev, n_prev)
    tma.store_wait(0)


@gluon.jit
def fp8_k_grouped_ws_kernel(
    # inputs: TMA descriptors of P^T (M, 128 NB) and Q^T (N, 128 NB) e4m3, blocks (BLOCK_M, 128) / (BLOCK_N, 128),
    # and of their scales sp (NB, M), sq (NB, N) fp32, blocks (1, BLOCK_M) / (1, BLOCK_N); expert row offsets,
    # block table
    p_desc, q_desc, sp_desc, sq_desc, row_offsets_ptr, block_offsets_ptr,
    # output C (E, M, N) as its (E M, N) TMA descriptor, block (BLOCK_M / 2, BLOCK_N)
    c_desc,
    # shapes
    M, N, num_experts,
    # tile config (num_warps = 4: the default partition is MMA warpgroup 0)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one MMA warpgroup")
    gl.static_assert(BLOCK_M == 128, "128-row tiles: two warpgroups of 64 rows")
    gl.static_assert(STAGES >= 2, "the ring needs STAGES >= 2")
    dtype: gl.constexpr = p_desc.dtype
    p_ring = gl.allocate_shared_memory(dtype, [STAGES] + p_desc.block_type.shape, p_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    sp_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + sp_desc.block_type.shape, sp_desc.layout)
    sq_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + sq_desc.block_type.shape, sq_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups read every slot
    num_m_tiles = M // BLOCK_M
    num_n_tiles = N // BLOCK_N
    num_tiles = num_experts * num_m_tiles * num_n_tiles
    gl.warp_specialize([
        (_wgrad_mma_warpgroup, (p_ring, q_ring, sp_ring, sq_ring, ready, empty, c_smem, c_desc, row_offsets_ptr,
                                block_offsets_ptr, M, num_m_tiles, num_n_tiles, num_tiles, 0, STAGES, BLOCK_M,
                                BLOCK_N)),
        (_wgrad_mma_warpgroup, (p_ring, q_ring, sp_ring, sq_ring, ready, empty, c_smem, c_desc, row_offsets_ptr,
                                block_offsets_ptr, M, num_m_tiles, num_n_tiles, num_tiles, 1, STAGES, BLOCK_M,
                                BLOCK_N)),
        (_wgrad_load_warp, (p_desc, q_desc, sp_desc, sq_desc, p_ring, q_ring, sp_ring, sq_ring, ready, empty,
                            row_offsets_ptr, block_offsets_ptr, num_m_tiles, num_n_tiles, num_tiles, STAGES, BLOCK_M,
                            BLOCK_N)),
    ], [4, 1], [232, 40])
