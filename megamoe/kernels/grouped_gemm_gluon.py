"""Persistent m-grouped GEMMs for Hopper in Gluon (``@gluon.jit`` only; launcher in megamoe.ops.m_grouped_gluon):
``_m_grouped_plain_kernel`` (one partition, loads pipelined across tiles) and ``_m_grouped_ws_kernel``
(warp-specialized: a TMA load warp and two MMA warpgroups, ping-pong or cooperative; see its section below).
Both compute the plain epilogue only and give the Triton kernel's bits; neither is in the tile table (measured
not faster, docs/perf.md sixth and seventh sessions).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``row_offsets[e]:row_offsets[e+1]``); E
experts; ``C[r] = A[r] @ B[e(r)]`` with A (R, K), C (R, N); a tile is (m-tile, n-tile), n-tile fastest, with
m-tiles that never straddle two experts (``tile_offsets``, as in megamoe.kernels.grouped_gemm); a step is one
(tile, BLOCK_K chunk) pair; STAGES slots of the TMA load ring.

The same sums as ``megamoe.kernels.grouped_gemm._m_grouped_gemm_kernel`` with the PLAIN epilogue and TMA
loads of A and B (K in BLOCK_K chunks in order, fp32 accumulation, ``cast(acc [* scale[r]])``), so the bits
are the Triton kernel's (tests/test_m_grouped_gluon_gpu.py). What differs is the schedule: program pid walks
the tiles pid, pid + G, ... as one flat sequence of steps, and the TMA ring runs STAGES - 1 steps ahead
*across* tile boundaries, so the next tile's first operand tiles are in flight while a tile's last wgmma
drains and its epilogue stores (the Triton kernel refills its pipeline for every tile). B[e] is read in
either layout: stored (N, K) ("nt", the nn.Linear layout; B_NK) through a descriptor over the (E * B_ROWS, K)
view, or stored (K, N) ("nn") over (E * K, N); rows of a neighbouring expert or past R that a tile reads
only reach rows / columns masked at the store.

Slot reuse: step s waits for its slot's mbarrier (phase (s // STAGES) & 1), issues its wgmma asynchronously
and waits until only that one is in flight; after a CTA barrier (both warpgroups are past step s - 1) the
loads of step s + STAGES - 1 go to the slot of step s - 1.

Design after the persistent, pipelined matmul of Triton's Gluon tutorials (07-persistence, 04-tma) and
CUTLASS's SM90 TMA mainloop; the reduction order is this project's (docs/design.md).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_compat import cta_barrier, tma_load


@gluon.jit
def _tile_coords(tile, tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles, E_POW2: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT_E: gl.constexpr):
    """(expert, first row, end row, first column) of global tile ``tile``; empty experts own no tiles."""
    m_tile = tile // num_n_tiles
    n0 = (tile - m_tile * num_n_tiles) * BLOCK_N
    offs_e = gl.arange(0, E_POW2, layout=LAYOUT_E)
    tile_ends = gl.load(tile_offsets_ptr + 1 + offs_e, mask=offs_e < num_experts, other=2147483647)
    # a tile past the last one (a producer that ran ahead of the program's work) gets the last expert's
    # in-bounds coordinates; nothing is loaded or stored for it
    expert = gl.minimum(gl.sum((tile_ends <= m_tile).to(gl.int32), axis=0), num_experts - 1)
    first_tile = gl.load(tile_offsets_ptr + expert)
    row_start = gl.load(row_offsets_ptr + expert) + (m_tile - first_tile) * BLOCK_M
    row_end = gl.load(row_offsets_ptr + expert + 1)
    return expert, row_start, row_end, n0


@gluon.jit
def _issue(a_desc, b_desc, a_ring, b_ring, bars, p, row_start, b_row, n0, k0, STAGES: gl.constexpr,
           B_NK: gl.constexpr):
    """TMA copies of step p (A rows [row_start, +BLOCK_M) x [k0, +BLOCK_K), and B's tile) into slot p % STAGES."""
    slot = p % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [row_start, k0], bar, a_ring.index(slot))
    if B_NK:
        tma_load(b_desc, [b_row + n0, k0], bar, b_ring.index(slot))
    else:
        tma_load(b_desc, [b_row + k0, n0], bar, b_ring.index(slot))


@gluon.jit
def _b_operand(b_ring, slot, B_NK: gl.constexpr):
    """The wgmma B operand (K, N) of ring slot ``slot``: a transposed view of an (N, K) tile, or the tile itself."""
    if B_NK:
        return b_ring.index(slot).permute((1, 0))
    else:
        return b_ring.index(slot)


@gluon.jit
def _store_tile(acc, row, row_end, n0, c_ptr, scale_ptr, num_rows, N, stride_cm, HAS_SCALE: gl.constexpr,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr, STORE: gl.constexpr):
    """The plain epilogue: ``cast(acc [* scale[r]])`` into rows [row, row + ROWS) below row_end and columns
    [n0, n0 + BLOCK_N) below N of C (scale rows clamped to the buffer: computed, never stored)."""
    out_ty: gl.constexpr = c_ptr.dtype.element_ty
    if HAS_SCALE:
        offs_s = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        acc = acc * gl.load(scale_ptr + gl.minimum(offs_s, num_rows - 1)).to(gl.float32)[:, None]
    out = gl.convert_layout(acc.to(out_ty), STORE)
    offs_m = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, STORE))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, STORE))
    ptrs = c_ptr + offs_m.to(gl.int64)[:, None] * stride_cm + offs_n[None, :]
    gl.store(ptrs, out, mask=(offs_m < row_end)[:, None] & (offs_n < N)[None, :])


@gluon.jit
def _produce(a_desc, b_desc, a_ring, b_ring, bars, p, p_k, p_tile, p_expert, p_row, p_n0, total, G, B_ROWS,
             tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles, K_STEPS: gl.constexpr,
             STAGES: gl.constexpr, B_NK: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT_E: gl.constexpr):
    """The producer's step: load step p (if the program has one left) and advance (p, its k-chunk, its tile
    and the tile's coordinates) without integer division."""
    if p < total:
        _issue(a_desc, b_desc, a_ring, b_ring, bars, p, p_row, p_expert * B_ROWS, p_n0, p_k * BLOCK_K, STAGES, B_NK)
        p += 1
        p_k += 1
        if p_k == K_STEPS:
            p_k = 0
            p_tile += G
            p_expert, p_row, _, p_n0 = _tile_coords(p_tile, tile_offsets_ptr, row_offsets_ptr, num_experts,
                                                    num_n_tiles, E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
    return p, p_k, p_tile, p_expert, p_row, p_n0


@gluon.jit
def _m_grouped_plain_kernel(
    # inputs: TMA descriptors of A (R, K) and of B's 2-D view; optional per-row scale (R,)
    a_desc, b_desc, scale_ptr, row_offsets_ptr, tile_offsets_ptr,
    # output C (R, N), last dimension contiguous
    c_ptr,
    # shapes (K: a weight dimension)
    num_rows, N, num_experts, B_ROWS, stride_cm, K: gl.constexpr,
    # variant
    B_NK: gl.constexpr, HAS_SCALE: gl.constexpr, E_POW2: gl.constexpr,
    # tile config
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(STAGES >= 2, "the ring needs STAGES >= 2")
    dtype: gl.constexpr = a_desc.dtype
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [num_warps, 1], [1, 0])
    LAYOUT_E: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    K_STEPS: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    num_n_tiles = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    my_tiles = gl.where(pid < num_tiles, (num_tiles - pid + G - 1) // G, 0)
    total = my_tiles * K_STEPS

    # producer: next step to load (p), its tile's coordinates and k-chunk (p_k)
    p = gl.to_tensor(0)
    p_k = gl.to_tensor(0)
    p_tile = pid
    p_expert, p_row, _, p_n0 = _tile_coords(p_tile, tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles,
                                            E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
    for i in gl.static_range(STAGES - 1):
        p, p_k, p_tile, p_expert, p_row, p_n0 = _produce(
            a_desc, b_desc, a_ring, b_ring, bars, p, p_k, p_tile, p_expert, p_row, p_n0, total, G, B_ROWS,
            tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles, K_STEPS, STAGES, B_NK, E_POW2, BLOCK_M,
            BLOCK_N, BLOCK_K, LAYOUT_E)

    # consumer: the tile being multiplied (its coordinates stay until its epilogue) and its k-chunk
    c_k = gl.to_tensor(0)
    c_tile = pid
    c_expert, c_row, c_end, c_n0 = _tile_coords(c_tile, tile_offsets_ptr, row_offsets_ptr, num_experts,
                                                num_n_tiles, E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
    for s in range(total):
        slot = s % STAGES
        mbarrier.wait(bars.index(slot), (s // STAGES) & 1)
        acc = warpgroup_mma(a_ring.index(slot), _b_operand(b_ring, slot, B_NK), acc, use_acc=c_k > 0, is_async=True)
        acc = warpgroup_mma_wait(1, deps=[acc])
        cta_barrier()  # both warpgroups are done with step s - 1's slot
        p, p_k, p_tile, p_expert, p_row, p_n0 = _produce(
            a_desc, b_desc, a_ring, b_ring, bars, p, p_k, p_tile, p_expert, p_row, p_n0, total, G, B_ROWS,
            tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles, K_STEPS, STAGES, B_NK, E_POW2, BLOCK_M,
            BLOCK_N, BLOCK_K, LAYOUT_E)
        c_k += 1
        if c_k == K_STEPS:  # the tile's last chunk: drain, store, move to the next tile
            acc = warpgroup_mma_wait(0, deps=[acc])
            _store_tile(acc, c_row, c_end, c_n0, c_ptr, scale_ptr, num_rows, N, stride_cm, HAS_SCALE, BLOCK_M,
                        BLOCK_N, MMA, STORE)
            c_k = 0
            c_tile += G
            c_expert, c_row, c_end, c_n0 = _tile_coords(c_tile, tile_offsets_ptr, row_offsets_ptr, num_experts,
                                                        num_n_tiles, E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


# --- warp-specialized variants: ping-pong (128x128) and cooperative (128x256) -------------------------------
# Partitions of one program: a load warp (TMA producer) and two MMA warpgroups (consumers 0 and 1). Ping-pong:
# a program's j-th tile (j = 0, 1, ...) goes to consumer j % 2, so while one consumer runs its epilogue the
# other's wgmmas keep the tensor cores busy; cooperative (COOP): both consumers take every tile, 64 rows each
# (the two schedules of CUTLASS's SM90 warp-specialized kernels; Gluon's warp_specialize after Triton's
# tutorial 08).
#
# Handshakes (mbarriers):
#   ready[slot]  (count 1) the producer's TMA copies of a step landed (expect-tx);
#   empty[slot]  (count 1, 2 with COOP) the consumer(s) that read the slot are done with it (their wgmma of that
#                step completed);
#   turn[c]      (count 1, ping-pong only) consumer c may start waiting for its next tile's steps: the other
#                consumer has passed every ready-wait of the tiles before it. Without this order a consumer could
#                wait for a step two ring passes ahead and see the parity of an older phase (a false "ready").
# Step s (a program's flat (tile, k-chunk) index) uses slot s % STAGES, phase (s // STAGES) & 1; every slot is
# consumed once per pass, by one consumer (ping-pong) or by both (COOP). The sums are those of
# _m_grouped_plain_kernel (same K chunks in the same order, fp32 accumulation from the first chunk, one cast),
# so the bits are the Triton kernel's.


@gluon.jit
def _ws_load_partition(a_desc, b_desc, a_ring, b_ring, ready, empty, tile_offsets_ptr, row_offsets_ptr,
                       num_experts, num_n_tiles, num_tiles, B_ROWS, K_STEPS: gl.constexpr, STAGES: gl.constexpr,
                       B_NK: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr):
    """One warp: TMA copies of every step of the program's tiles, in order, each into a slot its consumer
    has released."""
    LAYOUT_E: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    G = gl.num_programs(0)
    s = 0
    tile = gl.program_id(0)
    while tile < num_tiles:
        expert, row, _, n0 = _tile_coords(tile, tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles,
                                          E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
        for k in range(K_STEPS):
            mbarrier.wait(empty.index(s % STAGES), ((s // STAGES) & 1) ^ 1)  # a fresh slot passes at once
            _issue(a_desc, b_desc, a_ring, b_ring, ready, s, row, expert * B_ROWS, n0, k * BLOCK_K, STAGES, B_NK)
            s += 1
        tile += G


@gluon.jit
def _ws_mma_partition(a_ring, b_ring, ready, empty, turn, c_ptr, scale_ptr, tile_offsets_ptr, row_offsets_ptr,
                      num_rows, N, num_experts, num_n_tiles, num_tiles, stride_cm, CONSUMER: gl.constexpr,
                      COOP: gl.constexpr, K_STEPS: gl.constexpr, STAGES: gl.constexpr, B_NK: gl.constexpr,
                      HAS_SCALE: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warpgroup: the wgmmas and the epilogue of the program's tiles CONSUMER, CONSUMER + 2, ... (ping-pong),
    or of rows [64 * CONSUMER, +64) of every tile of the program (COOP)."""
    ROWS: gl.constexpr = BLOCK_M // 2 if COOP else BLOCK_M  # rows of a tile this warpgroup multiplies
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    STORE: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N, BLOCK_N // 8], [4, 1], [1, 0])
    LAYOUT_E: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    G = gl.num_programs(0)
    i = 0  # this consumer's tile count
    if COOP:
        tile = gl.program_id(0)
    else:
        tile = gl.program_id(0) + CONSUMER * G
    while tile < num_tiles:
        if COOP:
            s = i * K_STEPS
        else:
            s = (2 * i + CONSUMER) * K_STEPS
            mbarrier.wait(turn.index(CONSUMER), (i & 1) ^ (1 - CONSUMER))  # consumer 0's first tile passes at once
        _, row, row_end, n0 = _tile_coords(tile, tile_offsets_ptr, row_offsets_ptr, num_experts, num_n_tiles,
                                           E_POW2, BLOCK_M, BLOCK_N, LAYOUT_E)
        if COOP:
            row += CONSUMER * ROWS
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, MMA)
        for k in range(K_STEPS):
            slot = s % STAGES
            mbarrier.wait(ready.index(slot), (s // STAGES) & 1)
            if COOP:
                a_op = a_ring.index(slot).slice(CONSUMER * ROWS, ROWS, dim=0)
            else:
                a_op = a_ring.index(slot)
            acc = warpgroup_mma(a_op, _b_operand(b_ring, slot, B_NK), acc, use_acc=k > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # the step before is complete: release its slot
            if k > 0:
                mbarrier.arrive(empty.index((s - 1) % STAGES))
            s += 1
        if not COOP:
            mbarrier.arrive(turn.index(1 - CONSUMER))  # every ready-wait of this tile passed
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((s - 1) % STAGES))
        _store_tile(acc, row, row_end, n0, c_ptr, scale_ptr, num_rows, N, stride_cm, HAS_SCALE, ROWS, BLOCK_N, MMA,
                    STORE)
        if COOP:
            tile += G
        else:
            tile += 2 * G
        i += 1


@gluon.jit
def _m_grouped_ws_kernel(
    # inputs: TMA descriptors of A (R, K) and of B's 2-D view; optional per-row scale (R,)
    a_desc, b_desc, scale_ptr, row_offsets_ptr, tile_offsets_ptr,
    # output C (R, N), last dimension contiguous
    c_ptr,
    # shapes (K: a weight dimension)
    num_rows, N, num_experts, B_ROWS, stride_cm, K: gl.constexpr,
    # variant; COOP: both MMA warpgroups on every tile (64 rows each) instead of tiles in turn
    B_NK: gl.constexpr, HAS_SCALE: gl.constexpr, E_POW2: gl.constexpr, COOP: gl.constexpr,
    # tile config (num_warps = 4: the default partition is consumer 0)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one MMA warpgroup")
    gl.static_assert(STAGES >= 2, "the ring needs STAGES >= 2")
    dtype: gl.constexpr = a_desc.dtype
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if COOP else 1)  # COOP: both warpgroups read every slot
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    K_STEPS: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    num_n_tiles = gl.cdiv(N, BLOCK_N)
    num_tiles = gl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    gl.warp_specialize([
        (_ws_mma_partition, (a_ring, b_ring, ready, empty, turn, c_ptr, scale_ptr, tile_offsets_ptr, row_offsets_ptr,
                             num_rows, N, num_experts, num_n_tiles, num_tiles, stride_cm, 0, COOP, K_STEPS, STAGES, B_NK,
                             HAS_SCALE, E_POW2, BLOCK_M, BLOCK_N)),
        (_ws_mma_partition, (a_ring, b_ring, ready, empty, turn, c_ptr, scale_ptr, tile_offsets_ptr, row_offsets_ptr,
                             num_rows, N, num_experts, num_n_tiles, num_tiles, stride_cm, 1, COOP, K_STEPS, STAGES, B_NK,
                             HAS_SCALE, E_POW2, BLOCK_M, BLOCK_N)),
        (_ws_load_partition, (a_desc, b_desc, a_ring, b_ring, ready, empty, tile_offsets_ptr, row_offsets_ptr,
                              num_experts, num_n_tiles, num_tiles, B_ROWS, K_STEPS, STAGES, B_NK, E_POW2, BLOCK_M,
                              BLOCK_N, BLOCK_K)),
    ], [4, 1], [232, 40])
