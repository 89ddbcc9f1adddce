"""Warp-specialized k-grouped weight-gradient GEMM for Hopper in Gluon (``@gluon.jit`` only; launcher in
megamoe.ops.wgrad_gluon, ``launch_gluon_wgrad_ws``).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``); E
experts; C[e] = P[rows_e]^T @ Q[rows_e] is (M, N); BLOCK_K rows of an expert per reduction chunk (nch chunks
per expert, at least one); a unit is one (expert, m-tile); a tile is one (unit, n-tile); a step is one (tile,
chunk) pair; STAGES slots of the TMA load ring.

Why: a weight gradient at ~128-256 rows per expert reduces only 2-5 chunks per 128x128 output tile, so one
tile's epilogue (cast, store of 32 KiB) costs about as much as its wgmmas. The persistent kernel of
megamoe.kernels.wgrad_gluon runs them one after the other in one warpgroup and measured latency bound
(docs/perf.md). Here the tiles of a program alternate between two MMA warpgroups (ping-pong),
so one tile's epilogue runs while the other warpgroup's wgmmas keep the tensor cores busy, and a TMA load warp
keeps the ring full across tiles; no address arithmetic is left on the MMA warps (the P and Q rows must be
contiguous: the EP receive buffers, or rows copied into expert order).

Partitions: the load warp copies every step's P chunk (BLOCK_K x BLOCK_M, at [row0, m0]) and Q chunk
(BLOCK_K x BLOCK_N, at [row0, n0]) with TMA; consumer c takes the program's tiles c, c + 2, ... (in the
program's order: its units pid, pid + G, ..., m-tile fastest, each unit's n-tiles in order). Rows past R are
zero-filled by TMA; rows of the next expert that an expert's last chunk covers are zeroed in shared memory by
the consumer before its wgmma (both operands, so nothing of another expert, not even a NaN, reaches the sum).

Handshakes (mbarriers):
  ready[slot]  (count 1) the step's two TMA copies landed (expect-tx);
  empty[slot]  (count 1) its consumer's wgmma of that step completed;
  turn[c]      (count 1) consumer c may start its next tile's ready-waits: the other consumer has passed every
               ready-wait of the tile before (otherwise a wait two ring passes ahead could see an old phase).
Step s (a program's flat index) uses slot s % STAGES, phase (s // STAGES) & 1. A consumer walks every tile of
the program and advances s by nch over the other consumer's tiles.

P on chip (RES > 0; measured not faster, docs/perf.md; the table streams P): a unit whose
expert has at most RES chunks gets its P chunks once into p_buf (p_ready, expect-tx of all RES chunks), the
consumer of the unit's first tile zeroes the next expert's rows in the last one and arrives p_zeroed (the
other consumer waits for it), and the load warp reuses p_buf for the next unit only after both consumers
arrived p_free (after their last wgmma of the unit); larger experts stream P through the ring as above.

Epilogue: with TMA_C (M % BLOCK_M == 0 and room beside the ring) each MMA warpgroup casts its tile into a
staging buffer of its own and a TMA store writes it out, overlapping that warpgroup's next tile; otherwise a
layout change through shared memory and masked stores.

Bits: the sums of megamoe.kernels.grouped_gemm.k_grouped_gemm_kernel (each output tile reduces its expert's
rows from the expert's first row in BLOCK_K chunks in row order, fp32 from zeros, one cast; zero rows past the
expert), so the result equals the Triton kernels' bit for bit (tests/test_wgrad_gluon_gpu.py).

Design after CUTLASS's SM90 ping-pong warp-specialized GEMM (KernelTmaWarpSpecializedPingpong) and Triton's
Gluon warp-specialization tutorial; the reduction order is this project's (docs/design.md).
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

from .gluon_compat import cta_barrier, tma_load, tma_store


@gluon.jit
def _unit(unit, row_offsets_ptr, tiles_m, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
    """(expert, m0, first row, end row, chunks) of unit ``unit``; an expert without rows runs one chunk whose
    rows are all zeroed, so its tiles store zeros."""
    expert = unit // tiles_m
    m0 = (unit - expert * tiles_m) * BLOCK_M
    row_start = gl.load(row_offsets_ptr + expert)
    row_end = gl.load(row_offsets_ptr + expert + 1)
    nch = gl.maximum(gl.cdiv(row_end - row_start, BLOCK_K), 1)
    return expert, m0, row_start, row_end, nch


@gluon.jit
def _ws_wgrad_load(p_desc, q_desc, p_buf, q_ring, ready, empty, p_ready, p_free, row_offsets_ptr, num_units, tiles_m,
                   tiles_n, STAGES: gl.constexpr, RES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr):
    """One warp: per unit, the P chunks once (resident unit) and then every step's Q chunk, or P and Q chunk pairs
    through the ring (streamed unit), in order, each into a slot its consumer released."""
    G = gl.num_programs(0)
    s = 0  # the program's step count
    u = 0  # the program's unit count
    unit = gl.program_id(0)
    while unit < num_units:
        _, m0, row_start, _, nch = _unit(unit, row_offsets_ptr, tiles_m, BLOCK_M, BLOCK_K)
        resident = nch <= RES
        if RES > 0:  # p_buf is reused by this unit: both consumers are done with the last one's (fresh: passes)
            mbarrier.wait(p_free, (u & 1) ^ 1)
        if resident:  # all RES chunks (a constant byte count for the barrier; those past nch are never read)
            mbarrier.expect(p_ready, RES * p_desc.block_type.nbytes)
            for c in gl.static_range(RES):
                tma_load(p_desc, [row_start + c * BLOCK_K, m0], p_ready, p_buf.index(c))
        for n in range(tiles_n):
            c = gl.to_tensor(0)
            while c < nch:  # a while loop: see megamoe.kernels.wgrad_gluon (Triton 3.6 and range() bounds)
                slot = s % STAGES
                mbarrier.wait(empty.index(slot), ((s // STAGES) & 1) ^ 1)  # a fresh slot passes at once
                bar = ready.index(slot)
                row0 = row_start + c * BLOCK_K
                if resident:
                    mbarrier.expect(bar, q_desc.block_type.nbytes)
                else:
                    mbarrier.expect(bar, p_desc.block_type.nbytes + q_desc.block_type.nbytes)
                    tma_load(p_desc, [row0, m0], bar, p_buf.index(slot))
                tma_load(q_desc, [row0, n * BLOCK_N], bar, q_ring.index(slot))
                s += 1
                c += 1
        u += 1
        unit += G


@gluon.jit
def _zero_rows(buf, valid, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Zero rows [valid, ROWS) of a (ROWS, COLS) shared-memory chunk (one warpgroup, 16-byte accesses)."""
    LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // COLS, COLS // 8], [4, 1], [1, 0])
    v = buf.load(LAYOUT)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LAYOUT))
    buf.store(gl.where((rows < valid)[:, None], v, gl.zeros_like(v)))


@gluon.jit
def _resident_p_ready(p_buf, p_ready, p_zeroed, owner, ur, nch, row_start, row_end, tiles_n, BLOCK_M: gl.constexpr,
                      BLOCK_K: gl.constexpr):
    """A resident unit's P chunks usable by this consumer: the owner (the consumer of the unit's first tile) waits
    for them and zeroes the next expert's rows in the last chunk, once for both consumers; the other consumer,
    if it has tiles in this unit, waits for that."""
    if owner:
        mbarrier.wait(p_ready, ur & 1)
        last_valid = row_end - (row_start + (nch - 1) * BLOCK_K)
        if last_valid < BLOCK_K:
            _zero_rows(p_buf.index(nch - 1), last_valid, BLOCK_K, BLOCK_M)
            fence_async_shared()
            cta_barrier()  # the warpgroup's stores are visible to both warpgroups' wgmmas
        mbarrier.arrive(p_zeroed)
    elif tiles_n > 1:  # the other consumer has tiles in this unit
        mbarrier.wait(p_zeroed, ur & 1)


@gluon.jit
def _store_tile(acc, c_ptr, c_desc, c_smem, expert, m0, n, M, N, stride_ce, stride_cm, CONSUMER: gl.constexpr,
                TMA_C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A consumer's epilogue of the tile at (m0, n-tile n) of C[expert]: through its staging buffer and a TMA
    store (TMA_C), else masked stores."""
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    if TMA_C:
        buf = c_smem.index(CONSUMER)
        tma.store_wait(0)  # this warpgroup's previous tile store has read the buffer
        cta_barrier()
        buf.store(acc.to(out_ty))
        fence_async_shared()
        cta_barrier()  # the whole tile is in shared memory before the store reads it
        tma_store(c_desc, [expert * M + m0, n * BLOCK_N], buf)
    else:
        STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
        out = gl.convert_layout(acc.to(out_ty), STORE)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, STORE))
        offs_n = n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, STORE))
        ptrs = c_ptr + expert.to(gl.int64) * stride_ce + offs_m.to(gl.int64)[:, None] * stride_cm + offs_n[None, :]
        gl.store(ptrs, out, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@gluon.jit
def _ws_wgrad_mma(p_buf, q_ring, ready, empty, turn, p_ready, p_zeroed, p_free, c_ptr, c_desc, c_smem, row_offsets_ptr,
                  num_units, tiles_m, tiles_n, M, N, stride_ce, stride_cm, CONSUMER: gl.constexpr,
                  STAGES: gl.constexpr, RES: gl.constexpr, TMA_C: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """One warpgroup: the wgmmas and the epilogue of the program's tiles CONSUMER, CONSUMER + 2, ... (TMA_C: the
    tile goes through this warpgroup's staging buffer and a TMA store, which overlaps its next tile)."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    G = gl.num_programs(0)
    s = 0  # the program's step count
    j = 0  # the program's tile count
    i = 0  # this consumer's tile count
    ur = 0  # the program's resident-unit count (the phase of p_ready / p_zeroed)
    unit = gl.program_id(0)
    while unit < num_units:
        expert, m0, row_start, row_end, nch = _unit(unit, row_offsets_ptr, tiles_m, BLOCK_M, BLOCK_K)
        resident = nch <= RES
        owner = j % 2 == CONSUMER  # this consumer takes the unit's first tile
        if resident:
            _resident_p_ready(p_buf, p_ready, p_zeroed, owner, ur, nch, row_start, row_end, tiles_n, BLOCK_M, BLOCK_K)
        if RES > 0:
            if not owner and tiles_n == 1:  # no tile of this unit: its P is not ours to hold
                mbarrier.arrive(p_free)
        for n in range(tiles_n):
            if j % 2 == CONSUMER:
                mbarrier.wait(turn.index(CONSUMER), (i & 1) ^ (1 - CONSUMER))  # consumer 0's first tile passes
                acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
                c = gl.to_tensor(0)
                while c < nch:
                    slot = s % STAGES
                    mbarrier.wait(ready.index(slot), (s // STAGES) & 1)
                    valid = row_end - (row_start + c * BLOCK_K)
                    if valid < BLOCK_K:  # the expert's last chunk reaches into the next expert's rows
                        if not resident:
                            _zero_rows(p_buf.index(slot), valid, BLOCK_K, BLOCK_M)
                        _zero_rows(q_ring.index(slot), valid, BLOCK_K, BLOCK_N)
                        fence_async_shared()
                        cta_barrier()  # the warpgroup's stores are visible to its wgmma
                    p_op = p_buf.index(gl.where(resident, c, slot)).permute((1, 0))
                    acc = warpgroup_mma(p_op, q_ring.index(slot), acc, is_async=True)
                    acc = warpgroup_mma_wait(1, deps=[acc])  # the step before is complete: release its slot
                    if c > 0:
                        mbarrier.arrive(empty.index((s - 1) % STAGES))
                    s += 1
                    c += 1
                mbarrier.arrive(turn.index(1 - CONSUMER))  # every ready-wait of this tile passed
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(empty.index((s - 1) % STAGES))
                if RES > 0:
                    if n + 2 >= tiles_n:  # this consumer's last tile of the unit: done with its P
                        mbarrier.arrive(p_free)
                _store_tile(acc, c_ptr, c_desc, c_smem, expert, m0, n, M, N, stride_ce, stride_cm, CONSUMER, TMA_C,
                            BLOCK_M, BLOCK_N)
                i += 1
            else:
                s += nch
            j += 1
        if resident:
            ur += 1
        unit += G
    if TMA_C:
        tma.store_wait(0)


@gluon.jit
def k_grouped_wgrad_ws_kernel(
    # inputs: TMA descriptors of P (R, M) and Q (R, N), blocks (BLOCK_K, BLOCK_M) and (BLOCK_K, BLOCK_N)
    p_desc, q_desc, row_offsets_ptr,
    # output [E, M, N], last dimension contiguous; c_desc: TMA descriptor over its (E * M, N) view (TMA_C)
    c_ptr, c_desc,
    # shapes and output strides (elements)
    num_experts, M, N, stride_ce, stride_cm,
    # tile config (num_warps = 4: the default partition is consumer 0); RES: P chunks kept on chip (0: streamed);
    # TMA_C: tiles stored by TMA from a staging buffer per MMA warpgroup (M % BLOCK_M == 0), else masked stores
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, RES: gl.constexpr,
    TMA_C: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one MMA warpgroup")
    gl.static_assert(STAGES >= 2, "the ring needs STAGES >= 2")
    dtype: gl.constexpr = p_desc.dtype
    P_SLOTS: gl.constexpr = RES if RES > STAGES else STAGES
    p_buf = gl.allocate_shared_memory(dtype, [P_SLOTS] + p_desc.block_type.shape, p_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())  # p_ready, p_zeroed, p_free
    if TMA_C:
        c_smem = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [2, BLOCK_M, BLOCK_N], c_desc.layout)
    else:
        c_smem = p_bars  # unused
    for k in gl.static_range(STAGES):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    for k in gl.static_range(2):
        mbarrier.init(turn.index(k), count=1)
    mbarrier.init(p_bars.index(0), count=1)
    mbarrier.init(p_bars.index(1), count=1)
    mbarrier.init(p_bars.index(2), count=2)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    num_units = num_experts * tiles_m
    p_ready, p_zeroed, p_free = p_bars.index(0), p_bars.index(1), p_bars.index(2)
    gl.warp_specialize([
        (_ws_wgrad_mma, (p_buf, q_ring, ready, empty, turn, p_ready, p_zeroed, p_free, c_ptr, c_desc, c_smem,
                         row_offsets_ptr, num_units, tiles_m, tiles_n, M, N, stride_ce, stride_cm, 0, STAGES, RES,
                         TMA_C, BLOCK_M, BLOCK_N, BLOCK_K)),
        (_ws_wgrad_mma, (p_buf, q_ring, ready, empty, turn, p_ready, p_zeroed, p_free, c_ptr, c_desc, c_smem,
                         row_offsets_ptr, num_units, tiles_m, tiles_n, M, N, stride_ce, stride_cm, 1, STAGES, RES,
                         TMA_C, BLOCK_M, BLOCK_N, BLOCK_K)),
        (_ws_wgrad_load, (p_desc, q_desc, p_buf, q_ring, ready, empty, p_ready, p_free, row_offsets_ptr, num_units,
                          tiles_m, tiles_n, STAGES, RES, BLOCK_M, BLOCK_N, BLOCK_K)),
    ], [4, 1], [232, 56])
