"""Experiments (megamoe.autograd_fp8.SPLIT_DGRAD, SPLIT_GATE_UP, SPLIT_128X1): the FP8 GEMMs with a row gather and a
SwiGLU epilogue as plain GEMMs on rows quantized straight into expert order, and SwiGLU passes on their outputs: the
dgrad into fp32 and a SwiGLU-backward pass (megamoe.ops.fp8_gemm.fp8_swiglu_bwd), the gate/up into [g | u] and a SwiGLU
pass (fp8_swiglu); against the Triton GEMMs with the gather and the epilogue (fp8_swiglu_dgrad, fp8_gate_up_swiglu);
and the SwiGLU-backward pass that also makes dgu's and hw's 128x1 K-major blocks (fp8_swiglu_bwd_128x1) against the
row pass and the 128x1 quantizer. Under TRITON_INTERPRET=1 on the CPU.

Proves: the rows quantized through ``idx_R`` are the reference's 1x128 blocks of the gathered rows, bit for bit;
each SwiGLU pass gives its fused kernel's outputs bit for bit (dgu, hw, row-dot partials, dgu blocks; h blocks and
[g | u]), for all rows or a device count of them (the rest of the outputs not written: NaN-poisoned); the pass with
128x1 outputs gives quantize_128x1_grouped(kmajor=True)'s bytes and scales of the row pass's dgu and hw, and the row
pass's row dots and dgu blocks (fp32 and bf16, experts of 0..300 rows, an all-zero channel, a receive buffer's rows
past the round's poisoned and not written); the whole FP8 layer's output and every gradient are bitwise the same
with either, both or neither split, and with the 128x1 pass (an empty expert, all tokens on one expert, top-k = E,
T = 1, no tokens, a shared expert, routing weights).
"""

import math

import pytest
import torch

from interpreter import interpreted
from megamoe import reference as ref
from megamoe.ops import fp8_gemm, fp8_quant, tile_offsets_for
from poison import poisoned_allocations
from test_fp8_layer import CASES, _case_inputs, _run


@interpreted
def test_gathered_rows_are_the_reference_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-3, 3, 37)[:, None]
    x[5] = 0.0
    idx = torch.randint(0, 37, (90,), generator=g, dtype=torch.int64).to(torch.int32)
    q, s = fp8_quant.quantize_1x128(x, idx_R=idx)
    rq, rs = ref.quantize_1x128(x[idx.long()])
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    n = torch.tensor([41], dtype=torch.int32)
    q2 = torch.full((90, 300), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s2 = torch.full((90, 3), math.nan)
    fp8_quant.quantize_1x128(x, idx_R=idx, valid_rows_1=n, out=q2, scale_out=s2)
    assert torch.equal(q2[:41].view(torch.uint8), rq[:41].view(torch.uint8)) and torch.equal(s2[:41], rs[:41])
    assert (q2[41:].view(torch.uint8) == 0x7F).all() and s2[41:].isnan().all()
    with pytest.raises(ValueError, match="idx_R"):
        fp8_quant.quantize_1x128(x, idx_R=idx.long())


@pytest.mark.parametrize("valid", [None, 0, 200, 333])
@interpreted
def test_swiglu_pass_is_the_fused_epilogue(valid):
    """fp8_swiglu_bwd on fp8_grouped_mm_nn's fp32 accumulator vs fp8_swiglu_dgrad, on the same operands (experts of
    0, 1, 127, 128, 129 and 300 rows; routing weights; gathered dout rows)."""
    g = torch.Generator().manual_seed(1)
    counts = [0, 1, 127, 128, 129, 0, 300]
    E, D, F, T = len(counts), 256, 256, 150
    R = sum(counts)
    off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    dout = torch.randn(T, D, generator=g)
    idx = torch.randint(0, T, (R,), generator=g, dtype=torch.int64).to(torch.int32)
    w2q, w2s = ref.quantize_128x128(torch.randn(E, D, F, generator=g) * F ** -0.5)
    w2q = w2q.transpose(1, 2).contiguous().transpose(1, 2)  # the K-major copy the recipe reads
    gu = torch.randn(R, 2 * F, generator=g)
    scale = torch.rand(R, generator=g) + 0.1
    dq, ds = fp8_quant.quantize_1x128(dout)
    fused = fp8_gemm.fp8_swiglu_dgrad(dq, ds, w2q, w2s, off, gu, gather_idx_R=idx, row_scale_R=scale)
    gq, gs = fp8_quant.quantize_1x128(dout, idx_R=idx)
    acc = fp8_gemm.fp8_grouped_mm_nn(gq, gs, w2q, w2s, off, out_dtype=torch.float32)
    n = R if valid is None else min(valid, R)
    count = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    with poisoned_allocations():
        split = fp8_gemm.fp8_swiglu_bwd(acc, gu, valid_rows_1=count, row_scale_R=scale)
    for name, a, b in zip(("dgu", "hw", "row_dot", "dgq", "dgs"), split, fused):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert (a[n:] == 0x7F).all(), f"{name}: rows past the count were written"
        else:
            assert a[n:].isnan().all(), f"{name}: rows past the count were written"
        assert torch.equal(a[:n], b[:n]), name


@pytest.mark.parametrize("valid", [None, 0, 200, 333])
@interpreted
def test_swiglu_pass_is_the_fused_gate_up_epilogue(valid):
    """fp8_swiglu on fp8_grouped_mm_nt's [g | u] (gathered x rows quantized in expert order) vs
    fp8_gate_up_swiglu's h blocks and [g | u] (experts of 0, 1, 127, 128, 129 and 300 rows)."""
    g = torch.Generator().manual_seed(2)
    counts = [0, 1, 127, 128, 129, 0, 300]
    E, D, F, T = len(counts), 256, 256, 150
    R = sum(counts)
    off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(T, D, generator=g) * 2
    idx = torch.randint(0, T, (R,), generator=g, dtype=torch.int64).to(torch.int32)
    w13q, w13s = ref.quantize_128x128(torch.randn(E, 2 * F, D, generator=g) * D ** -0.5)
    xq, xs = fp8_quant.quantize_1x128(x)
    hq, hs, gu = fp8_gemm.fp8_gate_up_swiglu(xq, xs, w13q, w13s, off, gather_idx_R=idx, out_dtype=torch.float32)
    gq, gs = fp8_quant.quantize_1x128(x, idx_R=idx)
    gu2 = fp8_gemm.fp8_grouped_mm_nt(gq, gs, w13q, w13s, off, out_dtype=torch.float32)
    assert torch.equal(gu2, gu), "[g | u]"
    n = R if valid is None else min(valid, R)
    count = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    with poisoned_allocations():
        hq2, hs2 = fp8_gemm.fp8_swiglu(gu2, valid_rows_1=count)
    assert torch.equal(hq2[:n].view(torch.uint8), hq[:n].view(torch.uint8)) and torch.equal(hs2[:n], hs[:n])
    assert (hq2[n:].view(torch.uint8) == 0x7F).all() and hs2[n:].isnan().all(), "rows past the count were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@interpreted
def test_swiglu_pass_128x1_is_the_row_pass_quantized(dtype):
    """fp8_swiglu_bwd_128x1 vs fp8_swiglu_bwd + quantize_128x1_grouped(kmajor=True) of its dgu and hw: experts of
    0, 1, 127, 128, 129, 300 rows, a receive buffer's rows past the round's (NaN) never read, an all-zero channel;
    outputs NaN-poisoned (what the pass leaves unwritten shows up)."""
    g = torch.Generator().manual_seed(3)
    counts = [0, 1, 127, 128, 129, 0, 300]
    F = 256
    n = sum(counts)
    R = n + 21
    off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    acc = torch.randn(R, F, generator=g) * 3
    gu = (torch.randn(R, 2 * F, generator=g) * 2).to(dtype)
    gu[:, [5, F + 5]] = 0  # h, dg and du all zero in channel 5
    scale = torch.rand(R, generator=g) + 0.1
    for t in (acc, gu, scale):
        t[n:] = math.nan
    blocks = tile_offsets_for(off, 128)
    nb = int(blocks[-1])
    dgu, hw, part, dgq, dgs = fp8_gemm.fp8_swiglu_bwd(acc, gu, valid_rows_1=off[-1:], row_scale_R=scale)
    with poisoned_allocations():
        dgu_k, hw_k, part2, dgq2, dgs2 = fp8_gemm.fp8_swiglu_bwd_128x1(acc, gu, off, block_offsets_E1=blocks,
                                                                       row_scale_R=scale)
    for name, x, (kq, ks) in (("dgu", dgu, dgu_k), ("hw", hw, hw_k)):
        rq, rs = fp8_quant.quantize_128x1_grouped(x, off, None, blocks, kmajor=True)
        assert kq.shape == rq.shape and ks.shape == rs.shape, name
        assert torch.equal(kq[:128 * nb].view(torch.uint8), rq[:128 * nb].view(torch.uint8)), f"{name} bytes"
        assert torch.equal(ks[:nb], rs[:nb]), f"{name} scales"
        assert (ks[:nb, 5] == 2.0 ** -126).all(), f"{name}: the zero channel"
    for name, a, b in (("row_dot", part2, part), ("dgq", dgq2, dgq), ("dgs", dgs2, dgs)):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert (a[n:] == 0x7F).all(), f"{name}: rows past the round's were written"
        else:
            assert a[n:].isnan().all(), f"{name}: rows past the round's were written"
        assert torch.equal(a[:n], b[:n]), name


@pytest.mark.parametrize("case", list(CASES))
@interpreted
def test_layer_bits_do_not_change(case, monkeypatch):
    from megamoe import autograd_fp8
    from megamoe.functional import moe_experts

    inputs, _ = _case_inputs(case)
    inputs, dout = inputs
    got = {}
    arms = ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
            (True, False, True), (True, True, True))
    for split in arms:
        for name, on in zip(("SPLIT_DGRAD", "SPLIT_GATE_UP", "SPLIT_128X1"), split):
            monkeypatch.setattr(autograd_fp8, name, on)
        got[split] = _run(moe_experts, inputs, dout, backend="fused", fp8=True)
    for split, res in got.items():
        for name, a, b in zip(("out", "dx", "dw", "dw13", "dw2", "ds13", "ds2"), got[arms[0]], res):
            assert torch.equal(a, b), f"(split dgrad, split gate/up, 128x1 pass) = {split}: {name}"
