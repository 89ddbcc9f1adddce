"""Tile helpers shared by the grouped GEMM kernels (``@triton.jit`` only).

expert_of_tile: the expert and row range of a global m-tile of an expert-grouped row buffer (m-tiles never
straddle two experts; ``tile_offsets`` is the exclusive prefix sum of ``ceil(count_e / BLOCK_M)``).
load_2d: a masked tile load that masks only the dimensions not known to be full.
mma: ``acc + a @ b`` in fp32, IEEE fp32 dots for fp32 operands and under the interpreter.
"""

import triton
import triton.language as tl


@triton.jit
def expert_of_tile(tile_offsets_ptr, row_offsets_ptr, m_tile, num_experts,
                   E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of global m-tile ``m_tile``; empty experts own no tiles."""
    offs_e = tl.arange(0, E_POW2)
    tile_ends = tl.load(tile_offsets_ptr + 1 + offs_e, mask=offs_e < num_experts, other=2147483647)
    expert = tl.sum((tile_ends <= m_tile).to(tl.int32), axis=0)
    first_tile = tl.load(tile_offsets_ptr + expert)
    row_start = tl.load(row_offsets_ptr + expert) + (m_tile - first_tile) * BLOCK_M
    row_end = tl.load(row_offsets_ptr + expert + 1)
    return expert, row_start, row_end


@triton.jit
def load_2d(ptrs, mask_r, mask_c, FULL_R: tl.constexpr, FULL_C: tl.constexpr):
    """Load a tile, masking (zero fill) only the dimensions that are not known to be full."""
    if FULL_R and FULL_C:
        tile = tl.load(ptrs)
    elif FULL_R:
        tile = tl.load(ptrs, mask=mask_c[None, :], other=0.0)
    elif FULL_C:
        tile = tl.load(ptrs, mask=mask_r[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=mask_r[:, None] & mask_c[None, :], other=0.0)
    return tile


@triton.jit
def mma(a, b, acc, FP32_DOT: tl.constexpr):
    if FP32_DOT:  # fp32 operands (and every dtype under the interpreter, whose bf16 dot is wrong)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
