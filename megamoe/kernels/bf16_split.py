"""An fp32 matrix as the exact sum of three bf16 pieces (``@triton.jit`` only; launcher in megamoe.ops.bf16_split).

``x = hi + mid + lo`` with ``hi = bf16(x)``, ``mid = bf16(x - hi)``, ``lo = bf16(x - hi - mid)`` (round to nearest
even; both subtractions are exact in fp32), so the three 8-bit significands hold all 24 of x's: a product of a
piece with a bf16 value is exact in fp32, which lets the router's fp32 GEMMs run on bf16 tensor cores
(megamoe.autograd.router_logits_forward). Exact for finite |x| up to bf16's largest value (about 3.39e38; above it
hi rounds to inf and the pieces are not finite) and down to about 2^-110 (below, the bits under bf16's smallest
subnormal, 2^-133, are lost). Infinite x: hi = x, mid = lo = 0; NaN: NaN in all three. A product of an infinite
piece-split value with a zero piece is NaN where an fp32 product is infinite: non-finite either way.

``bf16_split_kernel`` writes the pieces into SLOTS slots of its output, slot s holding piece
``(PATTERN >> 2 s) & 3`` (0 hi, 1 mid, 2 lo) at ``out + s * stride_os``: stacked row blocks or column blocks,
as the launcher's strides say. Grid: (row blocks, column blocks).
"""

import triton
import triton.language as tl


@triton.jit
def bf16_split_kernel(x_ptr, out_ptr, n_rows, n_cols, stride_xr, stride_or, stride_os,
                      PATTERN: tl.constexpr, SLOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0)
    hi = x.to(tl.bfloat16)
    hi32 = hi.to(tl.float32)
    rest = tl.where(hi32 == x, 0.0, x - hi32)  # exact; 0 where x is hi (an inf among them), NaN stays NaN
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    base = out_ptr + rows[:, None] * stride_or + cols[None, :]
    for s in tl.static_range(SLOTS):  # unrolled: one store per slot, its piece picked at compile time
        tl.store(base + s * stride_os, _piece(hi, mid, lo, (PATTERN >> (2 * s)) & 3), mask=mask)


@triton.jit
def _piece(hi, mid, lo, PIECE: tl.constexpr):
    """Piece PIECE (0 hi, 1 mid, 2 lo). A helper, not a constexpr local of the slot loop: the compiler refuses to
    bind one constexpr name twice in the unrolled loop's scope."""
    if PIECE == 0:
        return hi
    elif PIECE == 1:
        return mid
    else:
        return lo
