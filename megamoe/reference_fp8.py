"""The executable specification of megamoe's block-scaled FP8 recipe (DeepSeek-V3 style), in plain PyTorch.

Re-exported by :mod:`megamoe.reference`; the Triton quantizers (megamoe.kernels.fp8_quant) and the FP8 GEMMs
match these functions: bytes and scales bit for bit, GEMM results up to fp32 accumulation order.

Legend: R rows, C columns (channels), B 128-column blocks of a row (ceil(C / 128)), NB 128-row blocks of an
expert-grouped buffer, E experts, N / K a weight's output / input size, T tokens, D hidden size, F expert FFN
size, G = 2F, S shared FFN size, H = 2S, K (in ``topk_*_TK``) top-k.

Format: e4m3 (``torch.float8_e4m3fn``, largest finite value 448) with fp32 scales that are *dequantization
multipliers* and powers of two: ``s = 2**e``, ``q = e4m3(x * 2**-e)``, ``x ~ q * s``.

Why powers of two: ``x * 2**-e`` is exact in fp32 (no rounding besides the one e4m3 cast), so the kernels and
this reference agree bit for bit whatever the order of their arithmetic; and a 128x128 weight block's bytes
and scale serve its transpose unchanged (the dgrad GEMM reads the forward's blocks, no requantization).
Transformer Engine rounds its block scales down to powers of two by default for the same reasons.

The exponent rule (integers only, bit-exact): a block's amax ``a`` = max of ``|x|`` as fp32 (taken on the
fp32 bit patterns with the sign cleared, an integer max that orders NaN > Inf > finite);
``E = a_bits >> 23``, ``m = a_bits & 0x7FFFFF``; ``e = max(E - 127 - 8 + (m > 0x600000), -126)``: the
smallest ``e >= -126`` with ``a * 2**-e <= 448`` (448 = 1.75 * 2**8, and ``m > 0x600000`` means the
significand exceeds 1.75). Zero and subnormal amaxes (E == 0) get ``e = -126``: finite scale ``2**-126``,
finite inverse ``2**126``. ``2**-e`` and ``2**e`` are built from their fp32 bits (``(127 -+ e) << 23``), never
through log2 / exp2.

Non-finite policy (the bf16 path's: a non-finite input makes what depends on it non-finite, never a
silently finite wrong value): a block holding any NaN or +-Inf gets scale NaN and bytes 0x00, so its
dequantization is NaN throughout. A finite block never yields a NaN byte (0x7F / 0xFF): ``|x * 2**-e| <= 448``.
An all-zero block gives bytes 0x00 (exact zeros) and the finite scale ``2**-126``.

Layouts (all row-major, contiguous):
  * 1x128 (activations, output gradients): x (R, C) -> q (R, C), s (R, B); block b of row r = columns
    [128b, min(128b + 128, C)).
  * 128x128 (weights): w (E, N, K) -> q (E, N, K), s (E, ceil(N/128), ceil(K/128)).
  * 128x1 grouped (weight-gradient operands): rows of an expert-grouped buffer (expert e owns rows
    ``offsets[e]:offsets[e+1]``, row r read as ``x[idx_R[r]]`` when a row index is given) cut into 128-row
    blocks from each expert's first row; expert e's block j is global block ``block_offsets[e] + j`` with
    ``block_offsets`` the exclusive prefix sum of ``ceil(count_e / 128)`` (megamoe's m-tile table for
    BLOCK_M = 128) -> q (R, C) in the buffer's row order, s (NB, C) with the static bound
    ``NB = ceil(R / 128) + E``. Rows outside every expert and scale rows past the last block are unspecified
    (here: zeros) and never read.

Inputs are converted to fp32 first (exact for bf16, fp16 and fp32).
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "SCALE_BLOCK",
    "block_offsets_for",
    "dequantize_128x1_grouped",
    "dequantize_128x128",
    "dequantize_1x128",
    "pow2_exponent",
    "quantize_128x1_grouped",
    "quantize_128x128",
    "quantize_1x128",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_BLOCK = 128  # the scale group: 128 channels (1x128, 128x1) or 128 x 128 (weights)

_ABS_MASK = 0x7FFFFFFF
_NONFINITE = 0x7F800000  # |x| bits >= this: Inf or NaN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_exponent(amax_bits: torch.Tensor) -> torch.Tensor:
    """The exponent rule on int32 amax bit patterns (``|a|`` as fp32 viewed as int32): int32 ``e``, the
    smallest ``e >= -126`` with ``a * 2**-e <= 448`` (see the module doc). Meaningless for non-finite amax
    (callers apply the non-finite policy)."""
    E = (amax_bits >> 23) & 0xFF
    m = amax_bits & 0x7FFFFF
    e = E - (127 + 8) + (m > 0x600000).to(torch.int32)
    return torch.clamp_min(e, -126)  # E == 0 (zero or subnormal amax): e = -126 as well


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**e`` for int32 e in [-126, 127], from its bit pattern."""
    return ((e + 127) << 23).to(torch.int32).view(torch.float32)


def _quantize_padded(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 ``x`` (zero-padded to whole blocks) with one scale per reduction over ``dims``:
    returns (q e4m3 shaped like x, s fp32 with ``dims`` kept as size 1)."""
    abs_bits = x.contiguous().view(torch.int32) & _ABS_MASK
    amax_bits = abs_bits.amax(dim=dims, keepdim=True)
    bad = amax_bits >= _NONFINITE
    e = pow2_exponent(amax_bits)
    s = torch.where(bad, torch.full_like(e, 0x7FC00000), (e + 127) << 23).view(torch.float32)
    y = x * _pow2(-e)  # exact: a power of two (values below e4m3's range round to zero either way)
    y = torch.where(bad, torch.zeros_like(y), y)
    return y.to(E4M3), s


def _check_2d(name: str, x: torch.Tensor, where: str) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{where}: {name} must be a 2-D floating-point tensor, got {tuple(x.shape)} {x.dtype}")


def quantize_1x128(x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 block quantization of rows: x (R, C) -> (q_RC e4m3, s_RB fp32), B = ceil(C / 128).

    Block b of row r is columns [128b, min(128b + 128, C)); exponent rule, non-finite policy and zero blocks
    as in the module doc."""
    _check_2d("x_RC", x_RC, "quantize_1x128")
    R, C = x_RC.shape
    B = _cdiv(C, SCALE_BLOCK)
    xp = x_RC.new_zeros((R, B * SCALE_BLOCK), dtype=torch.float32)
    xp[:, :C] = x_RC
    q, s = _quantize_padded(xp.view(R, B, SCALE_BLOCK), (2,))
    return q.view(R, B * SCALE_BLOCK)[:, :C].contiguous(), s.view(R, B)


def dequantize_1x128(q_RC: torch.Tensor, s_RB: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * s`` for the 1x128 layout: (R, C)."""
    C = q_RC.shape[1]
    return q_RC.float() * s_RB.repeat_interleave(SCALE_BLOCK, dim=1)[:, :C]


def quantize_128x128(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block quantization of weights: w (E, N, K) -> (q e4m3 (E, N, K), s fp32 (E, ceil(N/128),
    ceil(K/128))). A 2-D (N, K) weight is taken as E = 1 and returned 2-D (q (N, K), s (NB, KB)).

    The dgrad reads the same bytes as (K, N) blocks with the scale grid transposed (no requantization)."""
    if w_ENK.dim() == 2:
        q, s = quantize_128x128(w_ENK.unsqueeze(0))
        return q[0], s[0]
    if w_ENK.dim() != 3 or not w_ENK.is_floating_point():
        raise ValueError(f"quantize_128x128: w must be a 2-D or 3-D floating-point tensor, "
                         f"got {tuple(w_ENK.shape)} {w_ENK.dtype}")
    E, N, K = w_ENK.shape
    NB, KB = _cdiv(N, SCALE_BLOCK), _cdiv(K, SCALE_BLOCK)
    wp = w_ENK.new_zeros((E, NB * SCALE_BLOCK, KB * SCALE_BLOCK), dtype=torch.float32)
    wp[:, :N, :K] = w_ENK
    q, s = _quantize_padded(wp.view(E, NB, SCALE_BLOCK, KB, SCALE_BLOCK), (2, 4))
    return q.view(E, NB * SCALE_BLOCK, KB * SCALE_BLOCK)[:, :N, :K].contiguous(), s.view(E, NB, KB)


def dequantize_128x128(q_ENK: torch.Tensor, s_ENK: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * s`` for the 128x128 layout (2-D or 3-D, as :func:`quantize_128x128` returns)."""
    N, K = q_ENK.shape[-2:]
    s = s_ENK.repeat_interleave(SCALE_BLOCK, dim=-2).repeat_interleave(SCALE_BLOCK, dim=-1)
    return q_ENK.float() * s[..., :N, :K]


def block_offsets_for(offsets_E1: torch.Tensor) -> torch.Tensor:
    """(E+1,) int64: the first 128-row block of each expert (exclusive prefix sum of ceil(count_e / 128));
    the m-tile table of megamoe's grouped GEMMs for BLOCK_M = 128."""
    counts = (offsets_E1[1:] - offsets_E1[:-1]).to(torch.int64)
    out = torch.zeros(offsets_E1.shape[0], dtype=torch.int64, device=offsets_E1.device)
    torch.cumsum(torch.div(counts + SCALE_BLOCK - 1, SCALE_BLOCK, rounding_mode="floor"), 0, out=out[1:])
    return out


def _grouped_args(x: torch.Tensor, offsets_E1: torch.Tensor, idx_R: torch.Tensor | None, where: str):
    _check_2d("x", x, where)
    if offsets_E1.dim() != 1 or offsets_E1.shape[0] < 1 or offsets_E1.is_floating_point():
        raise ValueError(f"{where}: offsets_E1 must be a 1-D integer tensor of E + 1 >= 1 entries")
    R = x.shape[0] if idx_R is None else idx_R.shape[0]
    off = [int(v) for v in offsets_E1.tolist()]
    if off[0] < 0 or off[-1] > R or any(a > b for a, b in zip(off[:-1], off[1:])):
        raise ValueError(f"{where}: offsets_E1 must be non-decreasing within [0, {R}], got {off}")
    return R, off


def quantize_128x1_grouped(x: torch.Tensor, offsets_E1: torch.Tensor,
                           idx_R: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 block quantization along the rows of an expert-grouped buffer (weight-gradient operands).

    x: (R, C) the buffer, or (T, C) a token matrix whose rows are gathered as ``x[idx_R[r]]`` (idx_R (R,)).
    offsets_E1: (E+1,) expert e owns rows ``offsets[e]:offsets[e+1]``. Returns q (R, C) e4m3 in the buffer's
    row order and s (ceil(R/128) + E, C) fp32; block (b, c) = column c over the block's <= 128 rows, expert
    e's j-th block being ``b = block_offsets_for(offsets)[e] + j``. Unspecified rows (outside every expert)
    and scale rows (past the last block) are zeros here. Host-syncing (reads the offsets)."""
    where = "quantize_128x1_grouped"
    R, off = _grouped_args(x, offsets_E1, idx_R, where)
    E, C = len(off) - 1, x.shape[1]
    rows = x if idx_R is None else x[idx_R.long()]
    q = torch.zeros((R, C), dtype=E4M3, device=x.device)
    s = torch.zeros((_cdiv(R, SCALE_BLOCK) + E, C), dtype=torch.float32, device=x.device)
    b0 = 0
    for e in range(E):
        n = off[e + 1] - off[e]
        nb = _cdiv(n, SCALE_BLOCK)
        if n == 0:
            continue
        xp = x.new_zeros((nb * SCALE_BLOCK, C), dtype=torch.float32)
        xp[:n] = rows[off[e]:off[e + 1]]
        qe, se = _quantize_padded(xp.view(nb, SCALE_BLOCK, C), (1,))
        q[off[e]:off[e + 1]] = qe.view(nb * SCALE_BLOCK, C)[:n]
        s[b0:b0 + nb] = se.view(nb, C)
        b0 += nb
    return q, s


def dequantize_128x1_grouped(q_RC: torch.Tensor, s_BC: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * s`` for the 128x1 grouped layout: (R, C); rows outside every expert are zeros."""
    R, C = q_RC.shape
    off = [int(v) for v in offsets_E1.tolist()]
    out = torch.zeros((R, C), dtype=torch.float32, device=q_RC.device)
    b0 = 0
    for e in range(len(off) - 1):
        n = off[e + 1] - off[e]
        nb = _cdiv(n, SCALE_BLOCK)
        s_rows = s_BC[b0:b0 + nb].repeat_interleave(SCALE_BLOCK, dim=0)[:n]
        out[off[e]:off[e + 1]] = q_RC[off[e]:off[e + 1]].float() * s_rows
        b0 += nb
    return out
