"""The FP8 layer's row passes with a device row count (a receive round's rows), under TRITON_INTERPRET=1 on the CPU:
the quantizer that gathers token rows into expert order (megamoe.ops.fp8_quant.quantize_1x128 with ``idx_R``) and the
SwiGLU passes (megamoe.ops.fp8_swiglu); their values against plain PyTorch are tests/test_fp8_gemm.py's.

Proves: the rows quantized through ``idx_R`` are the reference's 1x128 blocks of the gathered rows, bit for bit;
each SwiGLU pass with a device count of rows gives the all-rows pass's outputs on those rows, bit for bit, and
writes nothing past them (outputs NaN-poisoned), also for a count of 0 and one past the buffer's rows.
"""

import math

import pytest
import torch

from interpreter import interpreted
from megamoe import reference as ref
from megamoe.ops import fp8_quant, fp8_swiglu
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


def _passes_case(seed):
    g = torch.Generator().manual_seed(seed)
    R, F = 300, 256
    acc = torch.randn(R, F, generator=g)
    gu = torch.randn(R, 2 * F, generator=g) * 2
    scale = torch.rand(R, generator=g) + 0.1
    return acc, gu, scale


def _check_counted(name, counted, full, n):
    if counted.dtype == torch.float8_e4m3fn:
        counted, full = counted.view(torch.uint8), full.view(torch.uint8)
        assert (counted[n:] == 0x7F).all(), f"{name}: rows past the count were written"
    else:
        assert counted[n:].isnan().all(), f"{name}: rows past the count were written"
    assert torch.equal(counted[:n], full[:n]), name


@pytest.mark.parametrize("valid", [0, 131, 300, 333])
@interpreted
def test_swiglu_backward_pass_counts_rows(valid):
    acc, gu, scale = _passes_case(1)
    full = fp8_swiglu.fp8_swiglu_bwd(acc, gu, row_scale_R=scale)
    with poisoned_allocations():
        counted = fp8_swiglu.fp8_swiglu_bwd(acc, gu, valid_rows_1=torch.tensor([valid], dtype=torch.int32),
                                            row_scale_R=scale)
    for name, a, b in zip(("dgu", "hw", "row_dot", "dgq", "dgs"), counted, full):
        _check_counted(name, a, b, min(valid, acc.shape[0]))


@pytest.mark.parametrize("valid", [0, 131, 300, 333])
@interpreted
def test_swiglu_pass_counts_rows(valid):
    _, gu, _ = _passes_case(2)
    full = fp8_swiglu.fp8_swiglu(gu)
    with poisoned_allocations():
        counted = fp8_swiglu.fp8_swiglu(gu, valid_rows_1=torch.tensor([valid], dtype=torch.int32))
    for name, a, b in zip(("hq", "hs"), counted, full):
        _check_counted(name, a, b, min(valid, gu.shape[0]))


@pytest.mark.parametrize("gather", [False, True])
@interpreted
def test_both_quantizations_from_one_read_are_the_two_quantizers(gather):
    """quantize_1x128_and_128x1_grouped: its 1x128 rows are quantize_1x128's of the (gathered) rows and its K-major
    128x1 blocks quantize_128x1_grouped(kmajor=True)'s, bit for bit (experts of 0, 1, 127, 128, 129 and 300 rows,
    C not a multiple of 128, 7 rows past the last expert not written: poisoned)."""
    g = torch.Generator().manual_seed(3)
    counts = [0, 1, 127, 128, 129, 0, 300]
    R, C, T = sum(counts) + 7, 300, 150
    off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(T if gather else R, C, generator=g) * torch.logspace(-3, 3, C)[None, :]
    x[:, 5] = 0.0
    idx = torch.randint(0, T, (R,), generator=g, dtype=torch.int64).to(torch.int32) if gather else None
    with poisoned_allocations():
        (q1, s1), (qk, sk) = fp8_quant.quantize_1x128_and_128x1_grouped(x, off, idx)
    n = int(off[-1])
    rq, rs = fp8_quant.quantize_1x128(x, idx_R=idx) if gather else fp8_quant.quantize_1x128(x)
    assert torch.equal(q1[:n].view(torch.uint8), rq[:n].view(torch.uint8)) and torch.equal(s1[:n], rs[:n])
    assert (q1[n:].view(torch.uint8) == 0x7F).all() and s1[n:].isnan().all(), "rows past the experts were written"
    wq, ws = fp8_quant.quantize_128x1_grouped(x, off, idx, kmajor=True)
    used = int(ref.block_offsets_for(off)[-1])  # the blocks the experts use
    assert torch.equal(qk[:128 * used].view(torch.uint8), wq[:128 * used].view(torch.uint8))
    assert torch.equal(sk[:used], ws[:used])
