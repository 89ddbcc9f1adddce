"""The ``MEGAMOE_TORCH_WGRAD`` switch's host-side logic (CPU): when torch._grouped_mm may take a weight gradient.

Proves: the switch is off unless set to 1; the operand conditions accept contiguous, 16-byte aligned bf16
rows and refuse fp16 / fp32, other output dtypes, misaligned bases, non-unit column strides, row strides
that are not 16-byte multiples, different row counts and M or N not multiples of 8; gathered rows, a
preallocated output and CPU tensors are never eligible; and the wrapper's call (P^T, offsets without their
leading 0) computes per-expert ``P_e^T @ Q_e`` with exact zeros for an empty expert and rows past the last
expert ignored (torch's CPU implementation of _grouped_mm; the GPU test compares the CUDA kernel bitwise with
megamoe's Triton kernels).
"""

import pytest
import torch

from megamoe.ops.torch_grouped_mm import torch_wgrad, torch_wgrad_eligible, torch_wgrad_enabled, wgrad_operands_fit

BF16 = torch.bfloat16


def test_switch_is_off_unless_set(monkeypatch):
    monkeypatch.delenv("MEGAMOE_TORCH_WGRAD", raising=False)
    assert not torch_wgrad_enabled()
    for value in ("0", "true", ""):
        monkeypatch.setenv("MEGAMOE_TORCH_WGRAD", value)
        assert not torch_wgrad_enabled()
    monkeypatch.setenv("MEGAMOE_TORCH_WGRAD", "1")
    assert torch_wgrad_enabled() == hasattr(torch, "_grouped_mm")


def test_operand_conditions():
    p, q = torch.zeros(40, 64, dtype=BF16), torch.zeros(40, 32, dtype=BF16)
    assert wgrad_operands_fit(p, q, BF16)
    assert not wgrad_operands_fit(p.half(), q.half(), torch.float16)
    assert not wgrad_operands_fit(p.float(), q.float(), torch.float32)
    assert not wgrad_operands_fit(p, q, torch.float32)
    assert not wgrad_operands_fit(p, q[:39], BF16)
    assert not wgrad_operands_fit(torch.zeros(40, 60, dtype=BF16), q, BF16)  # M not a multiple of 8
    assert not wgrad_operands_fit(p, torch.zeros(40, 33, dtype=BF16)[:, :32], BF16)  # 66-byte rows
    assert not wgrad_operands_fit(p, torch.zeros(32, 40, dtype=BF16).t(), BF16)  # column stride 40
    flat = torch.zeros(40 * 64 + 1, dtype=BF16)
    assert not wgrad_operands_fit(flat[1:].view(40, 64), q, BF16)  # base 2 bytes off
    assert wgrad_operands_fit(torch.zeros(50, 64, dtype=BF16)[:40], q, BF16)  # a row slice keeps the layout


def test_never_eligible_for_gathers_out_or_cpu(monkeypatch):
    monkeypatch.setenv("MEGAMOE_TORCH_WGRAD", "1")
    p, q = torch.zeros(40, 64, dtype=BF16), torch.zeros(40, 32, dtype=BF16)
    assert not torch_wgrad_eligible(p, q, BF16, gathered=False, has_out=False)  # CPU tensors
    assert not torch_wgrad_eligible(p, q, BF16, gathered=True, has_out=False)
    assert not torch_wgrad_eligible(p, q, BF16, gathered=False, has_out=True)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_wrapper_computes_per_expert_products():
    g = torch.Generator().manual_seed(0)
    counts = [0, 5, 17, 0, 9]
    off = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    R, pad = sum(counts), 6
    p = torch.randn(R + pad, 24, generator=g).to(BF16)
    q = torch.randn(R + pad, 16, generator=g).to(BF16)
    p[R:] = float("nan")  # rows past the last expert must not be read
    got = torch_wgrad(p, q, off)
    assert got.shape == (len(counts), 24, 16) and got.dtype == BF16
    for e in range(len(counts)):
        a, b = int(off[e]), int(off[e + 1])
        want = (p[a:b].double().t() @ q[a:b].double())
        if a == b:
            assert torch.equal(got[e], torch.zeros_like(got[e]))
        # bf16 output: one rounding of an fp32 sum of at most 17 exact bf16 products
        torch.testing.assert_close(got[e].double(), want, rtol=2 ** -8, atol=1e-6)
