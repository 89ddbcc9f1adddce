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
  * 128x1 block-padded (the same bytes as the weight-gradient GEMM reads them, :func:`pad_128x1_blocks`):
    (NB * 128, C), block b = rows [128b, 128b + 128), the block's rows past its expert's last row zeros; stored
    transposed by the kernels (``buf.t()`` of a (C, NB * 128) buffer: each column's rows contiguous).

Inputs are converted to fp32 first (exact for bf16, fp16 and fp32).
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "SCALE_BLOCK",
    "block_offsets_for",
    "check_fp8_sizes",
    "dequantize_128x1_grouped",
    "dequantize_128x128",
    "dequantize_1x128",
    "moe_experts_fp8",
    "moe_experts_fp8_backward",
    "pad_128x1_blocks",
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


def pad_128x1_blocks(q_RC: torch.Tensor, offsets_E1: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The block-padded layout of 128x1 grouped bytes (R, C): (num_blocks * 128, C) e4m3, expert e's j-th block
    of rows at rows ``128 b:128 b + 128``, ``b = block_offsets_for(offsets)[e] + j``, zeros elsewhere (the
    block's rows past the expert, and blocks past the last). Contiguous here (the kernels store it transposed)."""
    off = [int(v) for v in offsets_E1.tolist()]
    out = torch.zeros((num_blocks * SCALE_BLOCK, q_RC.shape[1]), dtype=torch.uint8, device=q_RC.device)
    b0 = 0
    for e in range(len(off) - 1):
        n = off[e + 1] - off[e]
        out[b0 * SCALE_BLOCK:b0 * SCALE_BLOCK + n] = q_RC[off[e]:off[e + 1]].view(torch.uint8)
        b0 += _cdiv(n, SCALE_BLOCK)
    return out.view(E4M3)


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


# ---------------------------------------------------------------------------------------------------------------
# The FP8 routed experts (forward and backward numerics of the recipe)
# ---------------------------------------------------------------------------------------------------------------

def check_fp8_sizes(D: int, F: int, where: str) -> None:
    """FP8 mode needs the hidden size D and the expert FFN size F to be multiples of 128 (the scale block)."""
    if D % SCALE_BLOCK or F % SCALE_BLOCK:
        raise ValueError(f"{where}: FP8 mode needs the hidden size D and the expert FFN size F to be multiples of "
                         f"{SCALE_BLOCK} (the 1x128 / 128x128 scale blocks), got D={D}, F={F}")


def _deq_1x128(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    return dequantize_1x128(*quantize_1x128(x)).to(acc)


def _expert_rows(topk_ids_TK: torch.Tensor, E: int):
    """The rows of the expert-grouped buffer: (token_R int64, order_R int64 flat (t, k) index, offsets list),
    sorted by (expert, token, slot), megamoe's routing plan order."""
    K = topk_ids_TK.shape[1]
    flat = topk_ids_TK.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    off = [0] + torch.cumsum(counts, 0).tolist()
    return torch.div(order, K, rounding_mode="floor"), order, off


def _swiglu_bwd(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, acc: torch.dtype, out: torch.dtype):
    """[dg | du] from dh (x's dtype) and the saved pre-activations (PyTorch's silu backward formula)."""
    dh, g, u = dh.to(acc), g.to(acc), u.to(acc)
    sig = torch.sigmoid(g)
    du = dh * (g * sig)
    dg = (dh * u) * sig * (1 + g * (1 - sig))
    return torch.cat([dg.to(out), du.to(out)], dim=1)


def _shared_grads(x_TD, sw13_HD, sw2_DS, dout_TD):
    """The shared expert's (bf16 path) gradients: the vector-Jacobian product of megamoe.reference's shared_expert
    (``torch.func.vjp``: also inside a custom op, where autograd does not record)."""
    from .reference import shared_expert

    _, vjp = torch.func.vjp(shared_expert, x_TD, sw13_HD, sw2_DS)
    return vjp(dout_TD)


def _fp8_forward(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, acc):
    """:func:`moe_experts_fp8`'s forward: (out_TD, what the backward reads: w13d, w2d, gu_RG, token_R, order_R,
    offsets list)."""
    from .reference import combine, shared_expert, swiglu

    T, K = topk_ids_TK.shape
    E, _, D = w13_EGD.shape
    Fdim = w2_EDF.shape[2]
    dt = x_TD.dtype
    token_R, order_R, off = _expert_rows(topk_ids_TK, E)
    w13q, w13s = quantize_128x128(w13_EGD)
    w2q, w2s = quantize_128x128(w2_EDF)
    w13d, w2d = dequantize_128x128(w13q, w13s).to(acc), dequantize_128x128(w2q, w2s).to(acc)
    xd_TD = _deq_1x128(x_TD, acc)
    gu_RG = x_TD.new_empty(T * K, 2 * Fdim)
    y_RD = x_TD.new_zeros(T * K, D)
    for e in range(E):
        lo, hi = off[e], off[e + 1]
        if lo == hi:
            continue
        gu_RG[lo:hi] = (xd_TD[token_R[lo:hi]] @ w13d[e].t()).to(dt)
        h = swiglu(gu_RG[lo:hi, :Fdim], gu_RG[lo:hi, Fdim:])
        y_RD[lo:hi] = (_deq_1x128(h, acc) @ w2d[e].t()).to(dt)
    y_ND = torch.empty_like(y_RD)
    y_ND[order_R] = y_RD
    out = combine(y_ND.view(T, K, D), topk_weights_TK, shared_expert(x_TD, shared_w13_HD, shared_w2_DS), dt)
    return out, (w13d, w2d, gu_RG, token_R, order_R, off)


def _fp8_backward(dout_TD, x_TD, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS, saved, acc, need_w13: bool, need_w2: bool):
    """:func:`moe_experts_fp8`'s hand-written backward on what :func:`_fp8_forward` returned:
    (dx_TD, dw_TK, dw13 or None, dw2 or None, ds13, ds2)."""
    from .reference import swiglu

    w13d, w2d, gu_RG, token_R, order_R, off = saved
    T, D = x_TD.shape
    K = w_TK.shape[1]
    Fdim = w2_EDF.shape[2]
    dt = x_TD.dtype
    dout_TD = dout_TD.to(dt).contiguous()
    dd_TD = _deq_1x128(dout_TD, acc)  # dout quantized 1x128 once (T rows)
    w_R = w_TK.reshape(-1)[order_R].to(acc)
    dgu_RG = x_TD.new_zeros(T * K, 2 * Fdim)
    hw_RF = x_TD.new_zeros(T * K, Fdim)
    dx_RD = torch.zeros(T * K, D, dtype=acc, device=x_TD.device)
    dw_R = torch.zeros(T * K, dtype=acc, device=x_TD.device)
    for e in range(len(off) - 1):
        lo, hi = off[e], off[e + 1]
        if lo == hi:
            continue
        a = dd_TD[token_R[lo:hi]] @ w2d[e]  # (rows, F): dout @ w2, before the routing weight
        g, u = gu_RG[lo:hi, :Fdim], gu_RG[lo:hi, Fdim:]
        h = swiglu(g, u).to(acc)  # recomputed bitwise as the forward did
        dw_R[lo:hi] = (a * h).sum(dim=1)
        dgu_RG[lo:hi] = _swiglu_bwd((a * w_R[lo:hi, None]).to(dt), g, u, acc, dt)
        hw_RF[lo:hi] = (h * w_R[lo:hi, None]).to(dt)
        dx_RD[lo:hi] = (_deq_1x128(dgu_RG[lo:hi], acc) @ w13d[e]).to(dt).to(acc)
    offsets = torch.tensor(off)
    dw13 = dw2 = None
    if need_w2:
        p = dequantize_128x1_grouped(*quantize_128x1_grouped(dout_TD, offsets, token_R), offsets).to(acc)
        q = dequantize_128x1_grouped(*quantize_128x1_grouped(hw_RF, offsets), offsets).to(acc)
        dw2 = torch.stack([p[lo:hi].t() @ q[lo:hi] for lo, hi in zip(off[:-1], off[1:])]).to(w2_EDF.dtype)
    if need_w13:
        p = dequantize_128x1_grouped(*quantize_128x1_grouped(dgu_RG, offsets), offsets).to(acc)
        q = dequantize_128x1_grouped(*quantize_128x1_grouped(x_TD, offsets, token_R), offsets).to(acc)
        dw13 = torch.stack([p[lo:hi].t() @ q[lo:hi] for lo, hi in zip(off[:-1], off[1:])]).to(w13_EGD.dtype)
    dx_ND = torch.empty_like(dx_RD)
    dx_ND[order_R] = dx_RD
    dw_TK = torch.empty_like(dw_R)
    dw_TK[order_R] = dw_R
    dxs = ds13 = ds2 = None
    if sw13_HD is not None:
        dxs, ds13, ds2 = _shared_grads(x_TD, sw13_HD, sw2_DS, dout_TD)
    sum_TD = torch.zeros(T, D, dtype=acc, device=x_TD.device)
    for k in range(K):  # slot order, the shared expert last, one cast
        sum_TD = sum_TD + dx_ND.view(T, K, D)[:, k]
    if dxs is not None:
        sum_TD = sum_TD + dxs.to(acc)
    return sum_TD.to(dt), dw_TK.view(T, K).to(w_TK.dtype), dw13, dw2, ds13, ds2


class _FP8ExpertsFunction(torch.autograd.Function):
    """:func:`_fp8_forward` and its hand-written backward :func:`_fp8_backward`."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, acc):
        out, saved = _fp8_forward(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
                                  acc)
        *tensors, ctx.off = saved
        ctx.acc = acc
        ctx.save_for_backward(x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, *tensors)
        return out

    @staticmethod
    def backward(ctx, dout_TD):
        x_TD, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS, *tensors = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dw_TK, dw13, dw2, ds13, ds2 = _fp8_backward(dout_TD, x_TD, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS,
                                                        (*tensors, ctx.off), ctx.acc, n[3], n[4])
        return dx, None, dw_TK, dw13, dw2, ds13, ds2, None


def moe_experts_fp8(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    w13_EGD: torch.Tensor, w2_EDF: torch.Tensor, shared_w13_HD: torch.Tensor | None = None,
                    shared_w2_DS: torch.Tensor | None = None, *, acc_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed experts in block-scaled FP8 + the bf16 shared expert + combine: (T, D) -> (T, D), x's dtype.

    The numerics every FP8 backend matches (up to fp32 accumulation order; cast = round to x's dtype, deq =
    dequantize, rows = expert e's (token, slot) rows in (token, slot) order):
      forward:  x 1x128, w13 / w2 128x128; ``g, u = cast(deq(x)[rows] @ deq(w13)[e]^T)``,
                ``h = cast(silu(g) * u)``, h 1x128, ``y = cast(deq(h) @ deq(w2)[e]^T)``; combine in fp32 in
                slot order, the shared expert (megamoe.reference, unquantized) last, one cast.
      backward: dout 1x128 (T rows, once); ``a = deq(dout)[rows] @ deq(w2)[e]``; routing-weight gradient
                ``sum_n a * h``; ``dh = cast(a * w)``; SwiGLU backward -> ``dgu = [dg | du]`` (x's dtype),
                ``hw = cast(h * w)``; dgu 1x128, ``dx_rows = cast(deq(dgu) @ deq(w13)[e])``, dx = fp32 slot
                sums + the shared expert's dx, one cast; weight gradients on 128x1 grouped blocks quantized
                from the unquantized values: ``dw2[e] = deq(dout[rows])^T @ deq(hw)``,
                ``dw13[e] = deq(dgu)^T @ deq(x[rows])``, accumulated in acc_dtype, one cast to the weight's
                dtype (exact zeros for an expert without rows).

    Args are those of megamoe.reference.moe_experts; D and F must be multiples of 128 (ValueError otherwise).
    acc_dtype: the dtype the GEMMs accumulate in on the dequantized values (default fp32; fp64 for fp64
    inputs). fp64 with bf16 inputs gives this function's fp64 counterpart at the same roundings, from which a
    backend's tolerance is derived. Host-syncing (loops over experts); runs on CPU.
    """
    if x_TD.dim() != 2 or w13_EGD.dim() != 3 or w2_EDF.dim() != 3:
        raise ValueError("moe_experts_fp8: x_TD must be 2-D, w13_EGD and w2_EDF 3-D")
    check_fp8_sizes(x_TD.shape[1], w2_EDF.shape[2], "moe_experts_fp8")
    acc = acc_dtype or (torch.float64 if x_TD.dtype == torch.float64 else torch.float32)
    return _FP8ExpertsFunction.apply(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD,
                                     shared_w2_DS, acc)


def moe_experts_fp8_backward(dout_TD: torch.Tensor, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                             topk_weights_TK: torch.Tensor, w13_EGD: torch.Tensor, w2_EDF: torch.Tensor,
                             shared_w13_HD: torch.Tensor | None = None, shared_w2_DS: torch.Tensor | None = None, *,
                             need_w13: bool = True, need_w2: bool = True, acc_dtype: torch.dtype | None = None):
    """The gradients :func:`moe_experts_fp8`'s backward gives for the output gradient ``dout_TD``, without autograd
    (the forward rerun for what its backward reads; also inside a custom op, where autograd does not record):
    (dx_TD, dw_TK, dw13 or None, dw2 or None, dshared_w13 or None, dshared_w2 or None)."""
    check_fp8_sizes(x_TD.shape[1], w2_EDF.shape[2], "moe_experts_fp8_backward")
    acc = acc_dtype or (torch.float64 if x_TD.dtype == torch.float64 else torch.float32)
    _, saved = _fp8_forward(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, acc)
    return _fp8_backward(dout_TD, x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, saved, acc,
                         need_w13, need_w2)
