"""The FP8 down-projection dgrad with the SwiGLU backward in its epilogue, warp-specialized for Hopper in Gluon
(``@gluon.jit`` only; launcher megamoe.ops.fp8_gemm_gluon.fp8_dgrad_swiglu_gluon).

Legend: R rows of an expert-grouped row buffer, E experts, D the hidden size (K of this GEMM), F the expert FFN
width (N of this GEMM; [g | u] and [dg | du] have G = 2F columns), QB = 128 the scale group.

The main loop is megamoe.kernels.fp8_gemm_gluon's m-grouped kernel (a TMA load warp, two MMA warpgroups of 64 rows
on every 128 x 128 tile, K-block kb + 1's wgmma in flight while K-block kb is promoted), so ``acc = dY rows @ W2[e]``
(fp32) has that kernel's bits. Its epilogue, instead of writing acc out for a separate SwiGLU-backward pass
(megamoe.kernels.fp8_swiglu.swiglu_bwd_rows_kernel) to read back, runs that pass's code on the tile: each MMA
warpgroup puts its 64 x 128 fp32 block in its staging buffer, then reads it back 32 rows x two 64-column halves at
a time in the layout the pass compiles to (so the row-dot partial is summed in the same order, hence the same
bits), loads the saved [g | u] and the routing weights of those rows, and stores dgu, hw, the row-dot partials and
dgu's 1x128 blocks (a tile's 128 columns are one block of dg and one of du). Rows past the expert's end are
computed and never stored. Saves the fp32 accumulator's trip through memory (R x F x 4 bytes written and read).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .fp8_gemm_gluon import QB, k_loop, load_warp, tile_coords
from .fp8_swiglu import swiglu_bwd_cols
from .gluon_compat import cta_barrier

CHUNK = gl.constexpr(32)  # rows per epilogue step: the pass's BLOCK_M


@gluon.jit
def _swiglu_bwd_chunk(stage, c, row, row_end, n0, num_rows, scale_ptr, gu_ptr, dgu_ptr, hw_ptr, dot_ptr, q_ptr,
                      qs_ptr, N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE: gl.constexpr,
                      HAS_DOT: gl.constexpr):
    """The SwiGLU backward on rows [row + 32c, +32) of the warpgroup's staged block (columns [n0, n0 + 128))."""
    # the layout megamoe.kernels.fp8_swiglu.swiglu_bwd_rows_kernel compiles to (BLOCK_M = 32, 4 warps)
    BLK: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    block = stage.slice(c * CHUNK, CHUNK, dim=0)
    acc_lo = block.slice(0, 64, dim=1).load(BLK)
    acc_hi = block.slice(64, 64, dim=1).load(BLK)
    offs_m = row + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, BLK))
    mask_m = offs_m < row_end
    rows = gl.minimum(offs_m, num_rows - 1).to(gl.int64)  # clamped rows: computed, never stored
    if HAS_SCALE:
        scale = gl.load(scale_ptr + rows).to(gl.float32)
    else:
        scale = gl.full([CHUNK], 1.0, gl.float32, gl.SliceLayout(1, BLK))
    offs_lo = n0 + gl.arange(0, 64, layout=gl.SliceLayout(0, BLK))
    out_rows = offs_m.to(gl.int64)
    part = swiglu_bwd_cols(acc_lo, acc_hi, offs_lo, rows, out_rows, mask_m, scale, gu_ptr, dgu_ptr, hw_ptr, q_ptr,
                           qs_ptr, N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm, HAS_SCALE, True)
    if HAS_DOT:
        gl.store(dot_ptr + out_rows * (N // QB) + n0 // QB, part, mask=mask_m)


@gluon.jit
def _dgrad_warpgroup(a_ring, b_ring, ready, empty, c_smem, as_ptr, bs_ptr, tile_offsets_ptr, row_offsets_ptr,
                     scale_ptr, gu_ptr, dgu_ptr, hw_ptr, dot_ptr, q_ptr, qs_ptr, num_rows, num_experts, num_n_tiles,
                     num_tiles, N, stride_asm, stride_bse, stride_bsn, stride_gm, stride_cm, stride_xm, stride_qm,
                     stride_qsm, CONSUMER: gl.constexpr, KB: gl.constexpr, UNROLL: gl.constexpr,
                     STAGES: gl.constexpr, E_POW2: gl.constexpr, HAS_SCALE: gl.constexpr, HAS_DOT: gl.constexpr):
    """One warpgroup: rows [64 CONSUMER, +64) of every tile of the program: wgmmas, promotion, the SwiGLU
    backward on the block."""
    ROWS: gl.constexpr = QB // 2
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, QB, 32])
    LAYOUT_E: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    stage = c_smem.index(CONSUMER)
    G = gl.num_programs(0)
    s = 0
    tile = gl.program_id(0)
    while tile < num_tiles:
        expert, row, row_end, n_tile = tile_coords(tile, tile_offsets_ptr, row_offsets_ptr, num_experts,
                                                   num_n_tiles, E_POW2, QB, QB, LAYOUT_E)
        row += CONSUMER * ROWS
        offs_m = row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        as_ptrs = as_ptr + gl.minimum(offs_m, num_rows - 1).to(gl.int64) * stride_asm
        bs_tile = bs_ptr + expert.to(gl.int64) * stride_bse + n_tile * stride_bsn
        acc = k_loop(a_ring, b_ring, ready, empty, s, as_ptrs, bs_tile, CONSUMER, KB, UNROLL, STAGES, ROWS, QB, MMA)
        cta_barrier()  # the warpgroup has read its previous block out of the staging buffer
        stage.store(acc)
        cta_barrier()
        for c in gl.static_range(ROWS // CHUNK):
            _swiglu_bwd_chunk(stage, c, row, row_end, n_tile * QB, num_rows, scale_ptr, gu_ptr, dgu_ptr, hw_ptr,
                              dot_ptr, q_ptr, qs_ptr, N, stride_gm, stride_cm, stride_xm, stride_qm, stride_qsm,
                              HAS_SCALE, HAS_DOT)
        s += KB
        tile += G


@gluon.jit
def fp8_dgrad_swiglu_ws_kernel(
    # inputs: TMA descriptors of dY rows (R, D) e4m3 and of W2's K-major blocks as an (E F, D) view, blocks
    # (128, 128); dY's row scales (R, D / 128) fp32, W2's scale grid (E, F / 128, D / 128) fp32; expert row
    # offsets, m-tile table
    a_desc, b_desc, as_ptr, bs_ptr, row_offsets_ptr, tile_offsets_ptr,
    # the SwiGLU backward: routing weight per row (R,) fp32, saved [g | u] (R, 2F); outputs dgu (R, 2F), hw (R, F)
    # in gu's dtype, row-dot partials (R, F / 128) fp32, dgu's 1x128 blocks: bytes (R, 2F) uint8, scales
    # (R, 2F / 128) fp32 (rows contiguous)
    scale_ptr, gu_ptr, dgu_ptr, hw_ptr, dot_ptr, q_ptr, qs_ptr,
    # shapes and strides (elements; D a weight dimension)
    num_rows, N, num_experts, stride_asm, stride_bse, stride_bsn, stride_gm, stride_cm, stride_xm, stride_qm,
    stride_qsm, K: gl.constexpr,
    # variant and config (num_warps = 4: the default partition is MMA warpgroup 0; UNROLL divides D / 128)
    HAS_SCALE: gl.constexpr, HAS_DOT: gl.constexpr, E_POW2: gl.constexpr, STAGES: gl.constexpr,
    UNROLL: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "the default partition is one MMA warpgroup")
    gl.static_assert(K % QB == 0 and K >= QB, "K must be a positive multiple of 128")
    gl.static_assert(STAGES >= 2, "the ring needs STAGES >= 2")
    KB: gl.constexpr = K // QB
    gl.static_assert(KB % UNROLL == 0, "UNROLL must divide K / 128")
    dtype: gl.constexpr = a_desc.dtype
    a_ring = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    STAGE: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QB // 2, QB], gl.float32)
    c_smem = gl.allocate_shared_memory(gl.float32, [2, QB // 2, QB], STAGE)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups read every slot
    num_n_tiles = gl.cdiv(N, QB)
    num_tiles = gl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    gl.warp_specialize([
        (_dgrad_warpgroup, (a_ring, b_ring, ready, empty, c_smem, as_ptr, bs_ptr, tile_offsets_ptr, row_offsets_ptr,
                            scale_ptr, gu_ptr, dgu_ptr, hw_ptr, dot_ptr, q_ptr, qs_ptr, num_rows, num_experts,
                            num_n_tiles, num_tiles, N, stride_asm, stride_bse, stride_bsn, stride_gm, stride_cm,
                            stride_xm, stride_qm, stride_qsm, 0, KB, UNROLL, STAGES, E_POW2, HAS_SCALE, HAS_DOT)),
        (_dgrad_warpgroup, (a_ring, b_ring, ready, empty, c_smem, as_ptr, bs_ptr, tile_offsets_ptr, row_offsets_ptr,
                            scale_ptr, gu_ptr, dgu_ptr, hw_ptr, dot_ptr, q_ptr, qs_ptr, num_rows, num_experts,
                            num_n_tiles, num_tiles, N, stride_asm, stride_bse, stride_bsn, stride_gm, stride_cm,
                            stride_xm, stride_qm, stride_qsm, 1, KB, UNROLL, STAGES, E_POW2, HAS_SCALE, HAS_DOT)),
        (load_warp, (a_desc, b_desc, a_ring, b_ring, ready, empty, tile_offsets_ptr, row_offsets_ptr, num_experts,
                     N, num_n_tiles, num_tiles, KB, STAGES, E_POW2, QB, QB)),
    ], [4, 1], [232, 40])
