"""When torch._grouped_mm takes a weight gradient: the host-side logic, on the CPU.

Proves: the tile table sends bf16 weight gradients of more than the resident window's rows per expert to it and
nothing else, and a KernelConfig "wgrad" entry replaces that choice (with torch_mm: everywhere); the operand
conditions accept contiguous, 16-byte aligned bf16
rows and refuse fp16 / fp32, other output dtypes, misaligned bases, non-unit column strides, row strides
that are not 16-byte multiples, different row counts and M or N not multiples of 8; gathered rows, a
preallocated output and CPU tensors are never eligible; and the wrapper's call (P^T, offsets without their
leading 0) computes per-expert ``P_e^T @ Q_e`` with exact zeros for an empty expert and rows past the last
expert ignored (torch's CPU implementation of _grouped_mm; the GPU test compares the CUDA kernel bitwise with
megamoe's Triton kernels).
"""

import pytest
import torch

from megamoe.config import GemmConfig, KernelConfig
from megamoe.ops.torch_grouped_mm import torch_wgrad, torch_wgrad_eligible, wgrad_operands_fit

BF16 = torch.bfloat16


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


def test_never_eligible_for_gathers_out_or_cpu():
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


TORCH_EVERYWHERE = GemmConfig(128, 128, 64, 8, 3, torch_mm=True)  # a "wgrad" entry: torch's kernel where it can
TRITON_ONLY = GemmConfig(128, 128, 64, 8, 3)  # a "wgrad" entry: megamoe's own kernels


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_table_rule():
    """bf16 weight gradients of more than the resident window's ~154 expected rows per expert go to torch's
    kernel; fewer rows, fp16 / fp32, the interpreter, allow_torch=False and a Triton "wgrad" entry keep the
    Triton / Gluon kernels; an explicit torch_mm entry wins unless torch is not allowed."""
    from megamoe.ops import k_grouped_config, tile_config
    def cfg(rows, **kw):
        return k_grouped_config(1536, 2048, kw.pop("dtype", BF16), interpret=kw.pop("interpret", False),
                                rows_per_group=rows, **kw)
    assert cfg(1024).torch_mm and cfg(155).torch_mm and cfg(512).torch_mm
    assert not cfg(154).torch_mm and cfg(154).resident_chunks == 3  # 1.25 x 154 = 192 rows: 3 chunks of 64
    assert not cfg(128).torch_mm and not cfg(None).torch_mm and not cfg(0).torch_mm
    assert not cfg(1024, dtype=torch.float16).torch_mm and not cfg(1024, dtype=torch.float32).torch_mm
    assert not cfg(1024, interpret=True).torch_mm
    assert not cfg(1024, allow_torch=False).torch_mm
    assert cfg(1024, kernel_config=KernelConfig({"wgrad": TRITON_ONLY})) is TRITON_ONLY
    forced = KernelConfig({("wgrad", 1536, 2048): TORCH_EVERYWHERE})
    assert cfg(64, kernel_config=forced) is TORCH_EVERYWHERE
    assert not cfg(64, allow_torch=False, kernel_config=forced).torch_mm
    with pytest.raises(ValueError, match="torch_mm"):
        GemmConfig(128, 128, 64, 8, 3, torch_mm=True, resident_chunks=2)
    with pytest.raises(ValueError, match="weight-gradient"):
        tile_config.parse_tiles("down:128,256,64,8,3,torch_mm=1")
    assert tile_config.parse_tiles("wgrad:128,128,64,8,3,torch_mm=1")["wgrad"].torch_mm


def test_rows_in_order_only_where_torch_runs():
    """k_grouped_wants_rows_in_order (the autograd's reason to copy gathered rows): never on the CPU or for
    non-bf16 weights, whatever the KernelConfig says."""
    from megamoe.ops import k_grouped_wants_rows_in_order
    for kc in (KernelConfig(), KernelConfig({"wgrad": TORCH_EVERYWHERE})):
        assert not k_grouped_wants_rows_in_order(1536, 2048, BF16, torch.device("cpu"), 1024.0, kc)


def test_rows_in_order_follows_the_table_on_hopper(monkeypatch):
    """With a Hopper device assumed (the device check patched): rows are wanted in order exactly where the
    table picks torch's kernel (more than ~154 rows per expert), everywhere with a torch_mm "wgrad" entry, and
    nowhere with a Triton one."""
    from megamoe.ops import grouped_gemm, k_grouped_wants_rows_in_order
    monkeypatch.setattr(grouped_gemm, "torch_wgrad_device", lambda device: True)
    monkeypatch.setattr(grouped_gemm, "is_interpreted", lambda kernel: False)
    def want(rows, kc=None):
        return k_grouped_wants_rows_in_order(1536, 2048, BF16, torch.device("cuda"), rows, kc or KernelConfig())
    assert want(1024.0) and want(155.0) and not want(154.0) and not want(128.0)
    for dtype in (torch.float16, torch.float32):
        assert not k_grouped_wants_rows_in_order(1536, 2048, dtype, torch.device("cuda"), 1024.0)
    # torch's kernel cannot take M or N that are not multiples of 8: no copies for it then
    assert not k_grouped_wants_rows_in_order(2048, 100, BF16, torch.device("cuda"), 1024.0)
    everywhere = KernelConfig({"wgrad": TORCH_EVERYWHERE})
    assert want(128.0, everywhere) and want(1024.0, everywhere)
    # a Triton entry for the shape: the launcher runs it, so no copies
    assert not want(1024.0, KernelConfig({("wgrad", 1536, 2048): TRITON_ONLY}))
    assert want(1024.0, KernelConfig({("wgrad", 2048, 1536): TRITON_ONLY}))  # another shape's entry
