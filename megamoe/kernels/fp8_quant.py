"""Block-scaled FP8 (e4m3) quantization: the jit helpers other kernels fuse, and the three quantizer kernels.

The recipe is specified in megamoe.reference_fp8 (read it first); these produce its bytes and scales bit for
bit. Scales are fp32 powers of two ``s = 2**e`` (dequantization multipliers), ``q = e4m3(x * 2**-e)``.

Legend: R rows, C columns of the tensor quantized; E experts; N x K one expert's weight; B = ceil(C / 128) scale
blocks of a row; NB 128-row blocks of an expert-grouped buffer; q the e4m3 bytes (stored as uint8, or four to an
int32 word by the K-major 128x1 variant), s the scales.

Public helpers (``@triton.jit``; import them into a GEMM epilogue to quantize a tile where it is produced):
  * :func:`as_fp32`: exact widening to fp32 (bf16 through its bits: the interpreter's bf16 -> fp32 conversion
    is wrong for bf16 subnormals).
  * :func:`abs_bits`: int32 bit patterns of ``|x|`` for fp32 x; their integer max is the block's amax, with
    NaN > Inf > every finite value, so one max also detects non-finite blocks.
  * :func:`pow2_scale`: the exponent rule on an amax bit pattern -> (inverse scale ``2**-e``, scale ``2**e``
    or NaN for a non-finite block, finite flag). Integers only (no log2 / exp2, no division).
  * :func:`e4m3_bytes`: fp32 -> e4m3 bit patterns (uint8), round to nearest even, for ``|y| <= 448``.
  * :func:`quantize_block_rows` (1x128: one scale per row of a (rows, 128) tile),
    :func:`quantize_block_cols` (128x1: one scale per column of a (128, cols) tile),
    :func:`quantize_block` (128x128: one scale for the tile): (bytes uint8, scales fp32). The tile is fp32
    with zeros where it is masked (zeros never raise an amax). A non-finite block gets scale NaN and bytes 0.
    Bytes go to memory through a uint8 view of the e4m3 tensor; ``.to(tl.float8e4nv, bitcast=True)`` turns them
    into e4m3 operands of ``tl.dot``.

HW_CAST (constexpr): True on the GPU: ``.to(tl.float8e4nv)`` (cvt.rn.satfinite: round to nearest even,
identical to the integer path since ``|y| <= 448``); False under the CPU interpreter, so :func:`e4m3_bytes`
rounds with integer operations there. Both give the bytes of torch's ``.to(torch.float8_e4m3fn)``.
The CPU interpreter and fp8 (Triton 3.6 and 3.9 alike): its fp32 -> fp8e4nv conversion adds the first cut bit
(ties round up, not to even) and does not carry a rounded-up mantissa into the exponent (about 1% of uniform
values in [0, 448] come out wrong); its bf16 -> fp32 conversion loses bits of bf16 subnormals (hence
:func:`as_fp32`); fp8 -> fp32 is exact for every finite byte (0x7F / 0xFF read as +-480, not NaN); fp8 tensors
are uint8 arrays inside it, and bitcasts uint8 <-> fp8e4nv are free. So bytes are stored through uint8
pointers (a uint8 view of the e4m3 tensor) on both paths. (Its fp32 -> bf16 conversion does not round to nearest
even either: about half of random values differ from torch's by one bf16 step, so an epilogue that rounds to
bf16 before quantizing matches a torch reference bit for bit only on the GPU, or with fp32 outputs.)

Kernels (one program per block group; no atomics; every output element written by exactly one program). The input is
laid out like the output (contiguous; the launchers copy other inputs first) and each kernel loads and stores
through the same offsets, so that Triton gives the loaded tile the store's layout and the bytes are cast in the
layout that stores them. Where the load and the store differed (a column-major input, or row strides / alignments
that vectorize the load and not the store), Triton (3.6, sm_90a) cast in the load's layout and then moved the e4m3
bytes to the store's layout through shared memory (a ``ttg.convert_layout`` of the i8 tile after ``tt.fp_to_fp``),
and on the GPU a column-major input got wrong bytes that way (the pattern of the fp8 layout-conversion bug triton-
lang/triton#11111). tests/test_fp8_quant.py compiles each launch specialization and checks that no byte tile changes
layout; a GEMM epilogue that fuses these helpers should be checked the same way.
  * ``quantize_1x128_kernel``: x (R, C) -> q (R, C), s (R, ceil(C/128)); program = BLOCK_R rows x 128 columns.
  * ``quantize_128x128_kernel``: w (E, N, K) -> q (E, N, K), s (E, ceil(N/128), ceil(K/128)).
  * ``kmajor_128x128_kernel``: the blocks q (E, N, K) (bytes), s (E, NB, KB) copied with each expert's two
    dimensions stored in the other order (the input-gradient GEMMs' K-major weight operand); no cast.
  * ``quantize_128x1_grouped_kernel``: 128-row blocks of an expert-grouped buffer (rows gathered through an
    int32 index when GATHER; more than one column then, so that the store's rows are strided like the load's)
    -> q (R, C) in the buffer's order, s (NB, C); program = one 128-row block x BLOCK_C
    columns, its expert found from the m-tile table (BLOCK_M = 128; kernels.tiles.expert_of_tile). Programs past
    the last real block return at once. KMAJOR: the bytes go block-padded and transposed (the weight-gradient GEMM's
    K-major operand), packed four to an int32 word before they change layout. Its hardware cast is inline PTX on
    fp32 pairs: with Triton's cast of the tiles and the bytes packed into words (Triton 3.6, sm_90a, H200) this
    variant stored wrong bytes (0xFC in 8 of every 64 rows); tests/test_fp8_quant.py's GPU cases check both
    layouts bit for bit.
"""

import triton
import triton.language as tl

from .tiles import expert_of_tile

SCALE_BLOCK: tl.constexpr = tl.constexpr(128)


@triton.jit
def as_fp32(x):
    """x as fp32, exactly. bf16 is widened through its bits (the CPU interpreter's bf16 -> fp32 conversion
    loses bits of bf16 subnormals; on the GPU this is the same shift the conversion does)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def abs_bits(x):
    """int32 bit patterns of |x| (x fp32): ordered like |x| for finite values, Inf = 0x7F800000, NaN above."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def pow2_scale(amax_bits):
    """The exponent rule: for amax bits ``a`` (from :func:`abs_bits`), ``e = max(E - 135 + (m > 0x600000), -126)``
    (E, m: a's exponent field and mantissa), the smallest e >= -126 with ``amax * 2**-e <= 448``.

    Returns (inv_scale ``2**-e``, scale ``2**e``, or NaN when the amax is Inf / NaN, finite flag), fp32 built
    from their bit patterns. Zero and subnormal amaxes give e = -126: scale 2**-126, inverse 2**126, both finite."""
    E = (amax_bits >> 23) & 0xFF
    m = amax_bits & 0x7FFFFF
    e = tl.maximum(E - 135 + (m > 0x600000).to(tl.int32), -126)
    finite = amax_bits < 0x7F800000
    inv_scale = ((127 - e) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(finite, ((127 + e) << 23).to(tl.float32, bitcast=True), float("nan"))
    return inv_scale, scale, finite


@triton.jit
def e4m3_bytes(y, HW_CAST: tl.constexpr):
    """e4m3 bit patterns (uint8) of fp32 ``y`` with ``|y| <= 448``, rounded to nearest even (torch's
    ``.to(torch.float8_e4m3fn)``); -0.0 and negative values rounding to zero give 0x80, as torch does."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    if HW_CAST:  # the sign ORed in again: -0 for a negative fp32 subnormal even where the cast flushes it to +0
        byte = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32) | sign
    else:  # (a branch of its own: Gluon kernels call this with HW_CAST, and tl.full below needs a layout there)
        a = bits & 0x7FFFFFFF
        exp32 = a >> 23
        # normal e4m3 (|y| >= 2**-6): drop 20 mantissa bits, ties to even; a carry moves into the exponent field,
        # and (exp32 << 3 | m3) - (120 << 3) rebiases the exponent (127 -> 7)
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        # subnormal e4m3 (|y| < 2**-6): k * 2**-9 with k = round-to-nearest-even(|y| * 2**9) in 0..8
        mant = (a & 0x7FFFFF) | 0x800000
        sh = tl.minimum(tl.maximum(141 - exp32, 1), 31)
        half_m1 = (tl.full(sh.shape, 1, tl.int32) << (sh - 1)) - 1
        sub = (mant + half_m1 + ((mant >> sh) & 1)) >> sh
        byte = tl.where(exp32 >= 121, normal, sub) | sign
    return byte.to(tl.uint8)


@triton.jit
def quantize_block_rows(x, HW_CAST: tl.constexpr):
    """1x128 blocks: x (BLOCK_R, 128) fp32, zeros where masked -> (bytes uint8 (BLOCK_R, 128), scale (BLOCK_R,))."""
    inv, scale, finite = pow2_scale(tl.max(abs_bits(x), axis=1))
    y = tl.where(finite[:, None], x * inv[:, None], 0.0)
    return e4m3_bytes(y, HW_CAST), scale


@triton.jit
def quantize_block_cols(x, HW_CAST: tl.constexpr):
    """128x1 blocks: x (128, BLOCK_C) fp32, zeros where masked -> (bytes uint8 (128, BLOCK_C), scale (BLOCK_C,))."""
    inv, scale, finite = pow2_scale(tl.max(abs_bits(x), axis=0))
    y = tl.where(finite[None, :], x * inv[None, :], 0.0)
    return e4m3_bytes(y, HW_CAST), scale


@triton.jit
def quantize_block(x, HW_CAST: tl.constexpr):
    """One 128x128 block: x (128, 128) fp32, zeros where masked -> (bytes uint8 (128, 128), scalar scale)."""
    inv, scale, finite = pow2_scale(tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    y = tl.where(finite, x * inv, 0.0)
    return e4m3_bytes(y, HW_CAST), scale


@triton.jit
def quantize_1x128_kernel(x_ptr, q_ptr, s_ptr, n_ptr, idx_ptr, R, C, BLOCK_R: tl.constexpr, HW_CAST: tl.constexpr,
                          HAS_COUNT: tl.constexpr, HAS_IDX: tl.constexpr):
    """Program (i, b): rows [i * BLOCK_R, ...) x columns [128b, 128b + 128) of x (R, C) contiguous -> q (R, C)
    uint8 (e4m3 bytes), s (R, ceil(C / 128)). HAS_COUNT: only the first ``n_ptr[0]`` rows (a count on the device,
    e.g. a receive round's rows); the programs past it load and store nothing. HAS_IDX: row r of q is row
    ``idx[r]`` of x (a (T, C) token matrix; the rows gathered into expert order)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1)
    cols = b * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    if HAS_COUNT:
        R = tl.minimum(R, tl.load(n_ptr))
    mask_r = rows < R
    mask = mask_r[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)
    offs = r64[:, None] * C + cols[None, :]  # of q (and of x without a gather)
    if HAS_IDX:
        src = tl.load(idx_ptr + rows, mask=mask_r, other=0).to(tl.int64)
        x = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=mask, other=0.0)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    q, s = quantize_block_rows(as_fp32(x), HW_CAST)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + r64 * tl.cdiv(C, SCALE_BLOCK) + b, s, mask=mask_r)


@triton.jit
def _weight_block(N, K):
    """Program (n, k, e)'s 128x128 block of w[e] (N, K), w (E, N, K) contiguous: (n, k, e (int64), rows, cols,
    mask, the elements' offsets in w, the block's offset in the scale grid (E, NB, KB))."""
    n = tl.program_id(0)
    k = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = n * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    cols = k * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    offs = e * N * K + rows.to(tl.int64)[:, None] * K + cols[None, :]
    return n, k, e, rows, cols, mask, offs, (e * tl.cdiv(N, SCALE_BLOCK) + n) * tl.cdiv(K, SCALE_BLOCK) + k


@triton.jit
def quantize_128x128_kernel(w_ptr, q_ptr, s_ptr, N, K, HW_CAST: tl.constexpr):
    """Program (n, k, e): the 128x128 block (n, k) of w[e] (N, K), w (E, N, K) contiguous -> q (E, N, K) uint8,
    s (E, NB, KB)."""
    _, _, _, _, _, mask, offs, s_off = _weight_block(N, K)  # offs: of w and q alike
    q, s = quantize_block(as_fp32(tl.load(w_ptr + offs, mask=mask, other=0.0)), HW_CAST)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + s_off, s)


@triton.jit
def kmajor_128x128_kernel(q_ptr, s_ptr, qk_ptr, sk_ptr, N, K):
    """Program (n, k, e): block (n, k) of q[e] (N, K) contiguous bytes -> qk[e] stored (K, N) (element (n, k) at
    ``k * N + n``), and its scale s[e, n, k] -> sk[e] stored (KB, NB). A copy: the bytes change layout, never
    their values (no cast)."""
    n, k, e, rows, cols, mask, offs, s_off = _weight_block(N, K)
    tile = tl.load(q_ptr + offs, mask=mask)
    tl.store(qk_ptr + e * N * K + cols.to(tl.int64)[None, :] * N + rows[:, None], tile, mask=mask)
    tl.store(sk_ptr + (e * tl.cdiv(K, SCALE_BLOCK) + k) * tl.cdiv(N, SCALE_BLOCK) + n, tl.load(s_ptr + s_off))


@triton.jit
def _load_rows(x_ptr, idx_ptr, rows, row_end, cols, mask_c, C, GATHER: tl.constexpr):
    """fp32 rows ``rows`` (< row_end, else zeros) x columns ``cols`` of x (.., C) contiguous, read through idx when
    GATHER."""
    mask_r = rows < row_end
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=mask_r, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return as_fp32(tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=mask_r[:, None] & mask_c[None, :],
                           other=0.0))


@triton.jit
def _quantize_128x1_kmajor(x_ptr, idx_ptr, q_ptr, blk, row_start, row_end, cols, mask_c, C, ld_q,
                           GATHER: tl.constexpr, HW_CAST: tl.constexpr):
    """One 128-row block x the columns ``cols`` written transposed: column c's 128 bytes at
    ``q[c * ld_q + 128 blk:]`` (q_ptr the buffer as int32 words, ld_q in bytes), rows past row_end as zeros;
    returns the scales. The rows are read as four (32, cols) tiles, rows 4w + k, so that word w of a column packs
    bytes k = 0..3 (little-endian) without reshaping a tile, and the words, not the bytes, change layout."""
    w = tl.arange(0, SCALE_BLOCK // 4)
    r0 = row_start + 4 * w
    x0 = _load_rows(x_ptr, idx_ptr, r0, row_end, cols, mask_c, C, GATHER)
    x1 = _load_rows(x_ptr, idx_ptr, r0 + 1, row_end, cols, mask_c, C, GATHER)
    x2 = _load_rows(x_ptr, idx_ptr, r0 + 2, row_end, cols, mask_c, C, GATHER)
    x3 = _load_rows(x_ptr, idx_ptr, r0 + 3, row_end, cols, mask_c, C, GATHER)
    amax = tl.maximum(tl.maximum(tl.max(abs_bits(x0), axis=0), tl.max(abs_bits(x1), axis=0)),
                      tl.maximum(tl.max(abs_bits(x2), axis=0), tl.max(abs_bits(x3), axis=0)))
    inv, scale, finite = pow2_scale(amax)
    words = _e4m3_word(_scaled(x0, inv, finite), _scaled(x1, inv, finite), _scaled(x2, inv, finite),
                       _scaled(x3, inv, finite), HW_CAST)
    w_ptrs = q_ptr + cols.to(tl.int64)[None, :] * (ld_q // 4) + blk * (SCALE_BLOCK // 4) + w[:, None]
    tl.store(w_ptrs, words, mask=mask_c[None, :])
    return scale


@triton.jit
def _scaled(x, inv, finite):
    """x * inv per column, zeros in a non-finite column (its bytes are 0, its scale NaN)."""
    return tl.where(finite[None, :], x * inv[None, :], 0.0)


@triton.jit
def _e4m3_pair(lo, hi):
    """The hardware e4m3 cast of two fp32 tiles (|values| <= 448) as int32: byte 0 e4m3(lo), byte 1 e4m3(hi).
    One ``cvt.rn.satfinite.e4m3x2.f32`` per pair in inline PTX, so no 8-bit values reach the compiler (Triton's own
    cast feeding the packed words stored wrong bytes in this kernel on the GPU)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.u32.u16 $0, t; }",
        "=r,r,r", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _sign_byte(y, shift: tl.constexpr):
    """y's sign bit (fp32) as bit 7 of byte ``shift // 8`` of an int32."""
    return ((y.to(tl.int32, bitcast=True) >> 24) & 0x80) << shift


@triton.jit
def _e4m3_word(y0, y1, y2, y3, HW_CAST: tl.constexpr):
    """int32 words of four fp32 tiles' e4m3 bytes (|values| <= 448), y0 in the low byte: e4m3_bytes's bytes
    (round to nearest even; the sign ORed in again, so a negative value rounding to zero gives 0x80 as torch's cast
    does)."""
    if HW_CAST:
        words = _e4m3_pair(y0, y1) | (_e4m3_pair(y2, y3) << 16)
        return words | _sign_byte(y0, 0) | _sign_byte(y1, 8) | _sign_byte(y2, 16) | _sign_byte(y3, 24)
    else:
        words = e4m3_bytes(y0, False).to(tl.int32) | (e4m3_bytes(y1, False).to(tl.int32) << 8)
        return words | (e4m3_bytes(y2, False).to(tl.int32) << 16) | (e4m3_bytes(y3, False).to(tl.int32) << 24)


@triton.jit
def quantize_128x1_grouped_kernel(x_ptr, idx_ptr, offsets_ptr, block_offsets_ptr, q_ptr, s_ptr, C, num_experts,
                                  ld_q, GATHER: tl.constexpr, E_POW2: tl.constexpr, BLOCK_C: tl.constexpr,
                                  KMAJOR: tl.constexpr, HW_CAST: tl.constexpr):
    """Program (b, j): global 128-row block b (of the m-tile table ``block_offsets``) x columns
    [j * BLOCK_C, ...): its rows of x (.., C) contiguous (gathered through idx when GATHER) -> s[b] (NB, C) and
    the bytes: q rows (R, C) uint8 in the buffer's order, or KMAJOR the block-padded transposed layout, column c's
    block b at ``q[c * ld_q + 128 b:][:128]`` (q_ptr the buffer as int32 words, ld_q in bytes), rows past the
    expert's written as zeros."""
    blk = tl.program_id(0)
    if blk < tl.load(block_offsets_ptr + num_experts):
        _, row_start, row_end = expert_of_tile(block_offsets_ptr, offsets_ptr, blk, num_experts, E_POW2,
                                               SCALE_BLOCK)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = cols < C
        if KMAJOR:
            s = _quantize_128x1_kmajor(x_ptr, idx_ptr, q_ptr, blk, row_start, row_end, cols, mask_c, C, ld_q, GATHER,
                                       HW_CAST)
        else:
            rows = row_start + tl.arange(0, SCALE_BLOCK)
            x = _load_rows(x_ptr, idx_ptr, rows, row_end, cols, mask_c, C, GATHER)
            q, s = quantize_block_cols(x, HW_CAST)
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], q,
                     mask=(rows < row_end)[:, None] & mask_c[None, :])
        tl.store(s_ptr + blk.to(tl.int64) * C + cols, s, mask=mask_c)
