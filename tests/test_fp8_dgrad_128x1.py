"""The weight gradients' 128x1 operands made in the dgrad + SwiGLU-backward epilogue
(``megamoe.ops.fp8_gemm.fp8_swiglu_dgrad(..., kmajor_128x1=True)``, ``Fp8Experts.fuse_128x1``) against the
separate K-major 128x1 quantizer on the 16-bit dgu and hw the plain epilogue writes; CPU under TRITON_INTERPRET=1.

Proves: the epilogue's e4m3 bytes (block-padded, transposed) and fp32 scales equal
``quantize_128x1_grouped(dgu_RG / hw_RF, kmajor=True)``'s bit for bit, i.e. they are quantized from the values
rounded to the output dtype (bf16, fp16; fp32 too), for experts of 0, 1, 127, 128, 129 and 300 rows (padded rows
zeros, written into poisoned memory), all-zero blocks and channels (finite scale 2**-126, zero bytes), a column
amax of 448 and one just above it, and tiny values (the exponent's lower clamp; normal values, as the
interpreter's conversions of bf16 subnormals are not the GPU's); the other outputs (row dots, dgu's
1x128 blocks) are the plain epilogue's; and the FP8 layer (``moe_experts(..., fp8=True)``) gives the same output and
gradients, bit for bit, with the fused epilogue and with the separate quantizers. The interpreter rounds fp32 ->
bf16 toward zero, but both sides read the same rounded values, so the comparisons are exact.

Run: python -m pytest tests/test_fp8_dgrad_128x1.py -q
"""

import pytest
import torch

from interpreter import interpreted
from megamoe import reference as ref
from megamoe.ops import fp8_gemm as F8
from megamoe.ops import fp8_quant as Q
from poison import poisoned_allocations

COUNTS = [0, 1, 127, 128, 129, 300]
TINY, ZERO, BOUNDARY = 3, 4, 5  # the experts with tiny values, all-zero rows, columns at amax 448 and above


def _u8(q):
    return q.view(torch.uint8)


def _case(out_dtype, D=128, F=256, seed=0):
    """dY token rows (gathered), the saved [g | u], w2 and row scales for COUNTS, with the special experts above
    and an all-zero up channel (zero h and dg columns in every block)."""
    g = torch.Generator().manual_seed(seed)
    R, E = sum(COUNTS), len(COUNTS)
    off = torch.tensor([0] + torch.tensor(COUNTS).cumsum(0).tolist(), dtype=torch.int32)
    rows = lambda e: slice(int(off[e]), int(off[e + 1]))  # noqa: E731
    T = R + 5
    dy = torch.randn(T, D, generator=g)
    dy[T - 1] = 0.0
    dy[T - 2] = 1.0
    idx = torch.randint(0, T - 2, (R,), generator=g, dtype=torch.int32)
    idx[rows(ZERO)] = T - 1  # the zero expert's dY rows are the zero token row
    idx[rows(TINY)] = T - 2  # the tiny expert's are ones: with w2 = 1/D, acc = 1
    gu = torch.randn(R, 2 * F, generator=g)
    gu[rows(ZERO)] = 0.0  # h = 0 there too
    rs = torch.rand(R, generator=g) + 0.5
    # tiny values, all normal (the interpreter's bf16 conversions of subnormals differ from the GPU's): gate 32
    # (silu(g) = g exactly in fp32), |up| in [1, 2), acc = 1, row scale 2**-124: hw, dg, du in [2**-124, 2**-117),
    # below 1.75 * 2**-118, so every column's exponent is the lower clamp, -126
    gu[rows(TINY), :F] = 32.0
    gu[rows(TINY), F:] = (1.0 + torch.rand(COUNTS[TINY], F, generator=g)) * torch.randn(COUNTS[TINY], F,
                                                                                        generator=g).sign()
    rs[rows(TINY)] = 2.0 ** -124
    b = rows(BOUNDARY)  # gate 32, h = 32 u; u chosen so h's column amax is 448 / 452
    gu[b, :2] = 32.0
    gu[b, F:F + 2] = torch.rand(COUNTS[BOUNDARY], 2, generator=g) * 13.0
    gu[int(off[BOUNDARY]) + 7, F] = 14.0  # h = 448 = 1.75 * 2**8: the largest amax of exponent 0
    gu[int(off[BOUNDARY]) + 9, F + 1] = 14.125  # h = 452: exponent 1
    rs[b] = 1.0
    gu[:, F + 5] = 0.0  # an all-zero up channel: h and dg columns 5 are zero
    w2 = torch.randn(E, D, F, generator=g) / F ** 0.5
    w2[TINY] = 1.0 / D
    dq, ds = ref.quantize_1x128(dy)
    w2q, w2s = ref.quantize_128x128(w2)
    return dict(dq=dq, ds=ds, w2q=w2q, w2s=w2s, off=off, gu=gu.to(out_dtype), idx=idx, rs=rs)


def _check_epilogue(device, out_dtype):
    c = {k: v.to(device) for k, v in _case(out_dtype).items()}
    args = (c["dq"], c["ds"], c["w2q"], c["w2s"], c["off"], c["gu"])
    kw = dict(gather_idx_R=c["idx"], row_scale_R=c["rs"])
    dgu, hw, part, dgq, dgs = F8.fp8_swiglu_dgrad(*args, **kw)
    with poisoned_allocations():
        (kgq, kgs), (khq, khs), part_f, dgq_f, dgs_f = F8.fp8_swiglu_dgrad(*args, kmajor_128x1=True, **kw)
    assert torch.equal(part_f, part) and torch.equal(_u8(dgq_f), _u8(dgq)) and torch.equal(dgs_f, dgs)
    off = c["off"]
    used = int(ref.block_offsets_for(off)[-1])
    for name, (q, s), x in (("dgu", (kgq, kgs), dgu), ("hw", (khq, khs), hw)):
        wq, ws = Q.quantize_128x1_grouped(x, off, kmajor=True)
        assert q.shape == wq.shape and s.shape == ws.shape and q.stride() == wq.stride(), name
        assert torch.equal(_u8(q[:128 * used]), _u8(wq[:128 * used])), f"{name}: bytes differ from the quantizer's"
        assert torch.equal(s[:used], ws[:used]), f"{name}: scales differ from the quantizer's"
        # independently of the quantizer: the reference's bytes, block-padded (zeros past each expert's rows)
        rq, rs = ref.quantize_128x1_grouped(x, off)
        padded = ref.pad_128x1_blocks(rq, off, s.shape[0])
        assert torch.equal(_u8(q[:128 * used]), _u8(padded[:128 * used])) and torch.equal(s[:used], rs[:used]), name
    blocks = ref.block_offsets_for(off).tolist()
    zero, tiny, first = blocks[ZERO], blocks[TINY], blocks[BOUNDARY]
    for q, s in ((kgq, kgs), (khq, khs)):  # all-zero blocks and channel 5: zero bytes, the finite scale 2**-126
        assert not _u8(q[128 * zero:128 * blocks[ZERO + 1]]).any() and (s[zero:blocks[ZERO + 1]] == 2.0 ** -126).all()
        assert (s[:used, 5] == 2.0 ** -126).all() and not (_u8(q[:128 * used, 5]) & 0x7F).any()  # +-0 (dg: dh * -0)
        assert (s[tiny] == 2.0 ** -126).all(), "tiny values: the exponent's lower clamp"
        if out_dtype != torch.float16:  # fp16 flushes them to zero
            assert _u8(q[128 * tiny:128 * blocks[TINY + 1], 6:]).all(), "tiny values: no zero byte"
    assert khs[first, 0] == 1.0 and khs[first, 1] == 2.0, khs[first, :2]  # h's column amax 448 and 452


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@interpreted
def test_dgrad_epilogue_128x1_blocks_equal_the_quantizer(out_dtype):
    _check_epilogue("cpu", out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_dgrad_epilogue_128x1_blocks_equal_the_quantizer(out_dtype):
    _check_epilogue("cuda", out_dtype)


def _layer_case(T=136, D=128, F=128, E=3, K=2, S=128, device="cpu"):
    """An FP8 layer problem in bf16: expert 0 on every token (T rows: with T = 136 two 128-row blocks), a shared
    expert."""
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(E - 1, generator=g)[:K - 1]])
                       for _ in range(T)])
    x = torch.randn(T, D, generator=g)
    w = torch.rand(T, K, generator=g) + 0.1
    w13 = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, F, generator=g) * F ** -0.5
    s13 = torch.randn(2 * S, D, generator=g) * D ** -0.5 if S else None
    s2 = torch.randn(D, S, generator=g) * S ** -0.5 if S else None
    dout = torch.randn(T, D, generator=g)
    bf = lambda t: None if t is None else t.to(device=device, dtype=torch.bfloat16)  # noqa: E731
    return [bf(x), ids.to(device), w.to(device), bf(w13), bf(w2), bf(s13), bf(s2)], bf(dout)


def _layer(inputs, dout, fuse, monkeypatch):
    from megamoe.autograd_fp8 import Fp8Experts
    from megamoe.functional import moe_experts
    from megamoe.ops.fp8_weights import WEIGHT_CACHE

    monkeypatch.setattr(Fp8Experts, "fuse_128x1", fuse)
    WEIGHT_CACHE.clear()
    leaves = [t if t is None or not t.is_floating_point() else t.detach().clone().requires_grad_() for t in inputs]
    out = moe_experts(*leaves, fp8=True)
    wrt = [t for i, t in enumerate(leaves) if i != 1 and t is not None]
    return [out.detach()] + list(torch.autograd.grad(out, wrt, dout))


def _check_layer(monkeypatch, **case):
    inputs, dout = _layer_case(**case)
    fused = _layer(inputs, dout, True, monkeypatch)
    separate = _layer(inputs, dout, False, monkeypatch)
    for name, a, b in zip(("out", "x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2"), fused, separate):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert fused[3].abs().sum() > 0 and fused[4].abs().sum() > 0


@interpreted
def test_fp8_layer_bits_equal_with_and_without_the_fused_128x1_epilogue(monkeypatch):
    """Output and every gradient (x, routing weights, w13, w2, shared weights) of the bf16 FP8 layer bitwise equal
    with the 128x1 operands made in the dgrad epilogue and with the separate quantizers."""
    _check_layer(monkeypatch)


@pytest.mark.gpu
def test_gpu_fp8_layer_bits_equal_with_and_without_the_fused_128x1_epilogue(monkeypatch):
    """The same on the GPU at qwen3-30b-a3b's D and F (128 experts, top-8, 2048 tokens; expert 0 on every
    token)."""
    _check_layer(monkeypatch, T=2048, D=2048, F=768, E=128, K=8, S=0, device="cuda")
