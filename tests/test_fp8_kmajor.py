"""The K-major copy of FP8 weight blocks (megamoe.ops.fp8_quant.kmajor_128x128), the input-gradient GEMMs' weight
operand: the same values with each expert's two dimensions stored in the other order.

Its specification is torch's transposed copy (``t.transpose(-2, -1).contiguous().transpose(-2, -1)``): every byte
and scale is compared bit for bit with it, in memory poisoned first, on random bytes (NaN bytes included), shapes
that are not multiples of 128, one row or column, 2-D weights and no experts; on the CPU under the Triton
interpreter and, marked ``gpu``, on CUDA, there also past 2**31 bytes of offset. Bad input gets a clear error.
Run: python -m pytest tests/test_fp8_kmajor.py -q
"""

import pytest
import torch
import triton

from interpreter import interpreted
from megamoe.ops import fp8_quant as ops
from poison import poisoned_allocations

E4M3 = torch.float8_e4m3fn
SHAPES = ((3, 256, 384), (2, 200, 130), (1, 1, 129), (4, 130, 1), (260, 100), (0, 128, 256))


def _swapped(t):
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _assert_bits(got, want, what):
    (qg, sg), (qw, sw) = got, want
    assert qg.dtype == E4M3 and sg.dtype == torch.float32, what
    assert qg.shape == qw.shape and sg.shape == sw.shape, what
    assert qg.transpose(-2, -1).is_contiguous() and sg.transpose(-2, -1).is_contiguous(), f"{what}: not K-major"
    bad = (qg.view(torch.uint8) != qw.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"
    bad = (sg.view(torch.int32) != sw.view(torch.int32)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} scales differ, first at {bad[0].tolist()}"


def _blocks(shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(E4M3).to(device)
    s = torch.randn((*shape[:-2], triton.cdiv(shape[-2], 128), triton.cdiv(shape[-1], 128)), generator=g).exp2()
    return q, s.to(device)


def kmajor_cases(device):
    for i, shape in enumerate(SHAPES):
        q, s = _blocks(shape, device, seed=i)
        with poisoned_allocations():
            got = ops.kmajor_128x128(q, s)
        _assert_bits(got, (_swapped(q), _swapped(s)), f"kmajor {shape}")
    q, s = ops.quantize_128x128(torch.randn(2, 384, 256, device=device).bfloat16())
    _assert_bits(ops.kmajor_128x128(q, s), (_swapped(q), _swapped(s)), "kmajor of quantized weights")


def bad_input_cases(device):
    q, s = ops.quantize_128x128(torch.randn(2, 256, 130, device=device))
    with pytest.raises(ValueError, match="q must be a contiguous"):
        ops.kmajor_128x128(q.transpose(1, 2), s)
    with pytest.raises(ValueError, match="s must be a contiguous"):
        ops.kmajor_128x128(q, s.double())
    with pytest.raises(ValueError, match=r"shape \(2, 2, 2\), got \(2, 2, 1\)"):
        ops.kmajor_128x128(q, s[:, :, :1].contiguous())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ops.kmajor_128x128(q.tolist(), s)


@interpreted
def test_interpret_kmajor_bitexact():
    kmajor_cases("cpu")
    bad_input_cases("cpu")


@pytest.mark.gpu
def test_gpu_kmajor_bitexact():
    kmajor_cases("cuda")
    bad_input_cases("cuda")


@pytest.mark.gpu
def test_gpu_kmajor_offsets_past_int32():
    """3 x 32768 x 24576 bytes: the last expert's elements sit past 2**31 bytes from the start (64-bit offsets)."""
    E, N, K = 3, 32768, 24576
    q = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device="cuda").view(E4M3)
    s = torch.randn(E, N // 128, K // 128, device="cuda").exp2()
    qk, sk = ops.kmajor_128x128(q, s)
    _assert_bits((qk[-1], sk[-1]), (_swapped(q[-1]), _swapped(s[-1])), "the last expert")
