"""The FP8 layer's gate/up and dgrad (megamoe.autograd_fp8.Fp8Experts): plain GEMMs on rows quantized straight into
expert order, and SwiGLU passes on their outputs: the dgrad into fp32 and a SwiGLU-backward pass
(megamoe.ops.fp8_gemm.fp8_swiglu_bwd), the gate/up into [g | u] and a SwiGLU pass (fp8_swiglu); against the Triton
GEMMs with the gather and the epilogue that the layer ran before (fp8_swiglu_dgrad, fp8_gate_up_swiglu), whose bits
they keep. Under TRITON_INTERPRET=1 on the CPU.

Proves: the rows quantized through ``idx_R`` are the reference's 1x128 blocks of the gathered rows, bit for bit;
each SwiGLU pass gives its fused kernel's outputs bit for bit (dgu, hw, row-dot partials, dgu blocks; h blocks and
[g | u]), for all rows or a device count of them (the rest of the outputs not written: NaN-poisoned).
"""

import math

import pytest
import torch

from interpreter import interpreted
from megamoe import reference as ref
from megamoe.ops import fp8_gemm, fp8_quant
from poison import poisoned_allocations


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
