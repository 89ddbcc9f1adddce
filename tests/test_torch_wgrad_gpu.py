"""Weight gradients through torch._grouped_mm on a Hopper GPU (the table's torch_mm, or a torch_mm "wgrad" entry).

Proves: with a torch_mm "wgrad" entry of the KernelConfig, ``k_grouped_mm`` on contiguous bf16 rows really calls
``torch._grouped_mm`` and its (E, M, N) result is bitwise the Triton kernels' (a Triton "wgrad" entry), on experts
of 0, 1, 63, 64, 65, 300 ... rows (empty experts: exact zeros), buffer rows past the last expert (EP capacity
slack), M and N multiples of 8 only, and at qwen3-30b-a3b's two weight-gradient shapes with ~1000 rows per expert;
it reads nothing on the host (clean under ``set_sync_debug_mode("error")``) and replays bitwise from a CUDA graph;
gathered rows, a preallocated output and fp16 still take the Triton kernels; the layer's output and every gradient
are bitwise megamoe's kernels' (a Triton "wgrad" entry) with the table's choice and with torch's kernel forced, and
both really send the layer's weight gradients to torch where the table says so (and not below its row window).

Run: python -m pytest tests/test_torch_wgrad_gpu.py -q   (skipped without a Hopper GPU)
"""

import functools

import pytest
import torch

from test_fused_gpu import NAMES, _fused, _make, _run
from test_wgrad_gluon_gpu import BF16, DEV, TORCH_WGRAD, needs_hopper

from megamoe.config import GemmConfig, KernelConfig

pytestmark = [pytest.mark.gpu, needs_hopper]

COUNTS = [0, 1, 63, 64, 65, 300, 0, 7, 128, 129]
PAD = 13  # buffer rows past the last expert: read by no expert


def _problem(M, N, counts, seed, dtype=BF16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    off = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    R = sum(counts)
    p = torch.randn(R + PAD, M, generator=g, device=DEV).to(dtype)
    q = torch.randn(R + PAD, N, generator=g, device=DEV).to(dtype)
    return p, q, off


class _Spy:
    """Counts the launcher's calls of torch._grouped_mm (ops.grouped_gemm.torch_wgrad)."""

    def __init__(self, monkeypatch):
        from megamoe.ops import grouped_gemm
        self.calls, real = 0, grouped_gemm.torch_wgrad

        def spy(*args):
            self.calls += 1
            return real(*args)
        monkeypatch.setattr(grouped_gemm, "torch_wgrad", spy)


TRITON_WGRAD = KernelConfig({"wgrad": GemmConfig(128, 128, 64, 8, 2)})  # megamoe's per-tile kernel everywhere
KERNELS = {"torch": TORCH_WGRAD, "table": KernelConfig()}


def _both(monkeypatch, fn, on="torch"):
    """fn(kernel_config) with megamoe's Triton kernels, then with ``on`` ("torch": torch's kernel wherever the
    operands allow; "table": the table's choice); returns (megamoe's result, the other, torch._grouped_mm
    calls)."""
    spy = _Spy(monkeypatch)
    ref = fn(TRITON_WGRAD)
    assert spy.calls == 0, "a Triton wgrad entry must keep megamoe's kernels"
    return ref, fn(KERNELS[on]), spy.calls


@pytest.mark.parametrize("M,N,scale", [(128, 256, 1), (96, 200, 1), (1536, 2048, 3), (2048, 768, 3),
                                       (1536, 2048, 100)])
def test_bitwise_equal_to_triton_kernel(monkeypatch, M, N, scale):
    from megamoe.ops import k_grouped_mm
    counts = [c * scale for c in COUNTS] if scale < 100 else [1000 + 7 * i for i in range(16)]
    p, q, off = _problem(M, N, counts, seed=M + N + scale)
    ref, got, calls = _both(monkeypatch, lambda kc: k_grouped_mm(p, q, off, kernel_config=kc))
    assert calls == 1, "torch._grouped_mm did not run"
    assert got.shape == ref.shape and got.dtype == ref.dtype
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(got[e], torch.zeros_like(got[e])), f"expert {e} has no rows but a nonzero gradient"
    assert torch.equal(got, ref), f"torch._grouped_mm differs from the Triton kernel (M={M}, N={N})"


def test_other_operands_take_the_triton_kernels(monkeypatch):
    from megamoe.ops import k_grouped_mm
    p, q, off = _problem(128, 128, COUNTS, seed=3)
    idx = torch.arange(p.shape[0], device=DEV, dtype=torch.int32).flip(0)  # one token per row, reversed
    spy = _Spy(monkeypatch)
    k_grouped_mm(p, q, off, p_idx_R=idx, kernel_config=TORCH_WGRAD)
    k_grouped_mm(p, q, off, out=torch.empty(len(COUNTS), 128, 128, device=DEV, dtype=BF16), kernel_config=TORCH_WGRAD)
    k_grouped_mm(p.half(), q.half(), off, kernel_config=TORCH_WGRAD)
    assert spy.calls == 0, "gathered rows, out= or fp16 must not go to torch._grouped_mm"


def test_no_sync_and_graph_replay():
    from megamoe.ops import k_grouped_mm
    p, q, off = _problem(256, 128, COUNTS, seed=4)
    eager = k_grouped_mm(p, q, off, kernel_config=TORCH_WGRAD)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        k_grouped_mm(p, q, off, kernel_config=TORCH_WGRAD)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = k_grouped_mm(p, q, off, kernel_config=TORCH_WGRAD)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)


@pytest.mark.parametrize("on", ["torch", "table"])
def test_layer_gives_the_same_bits(monkeypatch, on):
    """The layer (routed + shared experts, ~512 rows per routed expert, so the table itself picks torch's
    kernel; "torch" forces it): its four weight gradients go to torch (the routed dW2 and dW13 on the row-order
    copies the backward makes, the shared pair), and the output and every gradient keep their bits."""
    T, D, F, E, K, S = 1024, 256, 192, 6, 3, 128
    case = _make(T, D, F, E, K, S, seed=11)
    dout = torch.randn(T, D, generator=torch.Generator(device=DEV).manual_seed(12), device=DEV).to(BF16)
    base, got, calls = _both(monkeypatch, lambda kc: _run(functools.partial(_fused, kernel_config=kc), *case, dout),
                             on=on)
    assert calls == 4, f"expected 4 weight gradients through torch._grouped_mm, got {calls}"
    for name, a, b in zip(NAMES, got, base):
        assert torch.equal(a, b), f"{name} changed bits with torch's weight gradients ({on})"


def test_layer_few_rows_per_expert_keeps_megamoe_kernels(monkeypatch):
    """~150 rows per expert (the resident kernel's window): the table keeps megamoe's routed weight gradients
    (only the shared expert's 300-row pair goes to torch). (Whether the backward copies rows follows
    k_grouped_wants_rows_in_order, tested on the CPU in tests/test_torch_wgrad.py.)"""
    T, D, F, E, K, S = 300, 256, 192, 6, 3, 128
    case = _make(T, D, F, E, K, S, seed=13)
    dout = torch.randn(T, D, generator=torch.Generator(device=DEV).manual_seed(14), device=DEV).to(BF16)
    base, got, calls = _both(monkeypatch, lambda kc: _run(functools.partial(_fused, kernel_config=kc), *case, dout),
                             on="table")
    assert calls == 2, f"expected only the shared expert's 2 weight gradients through torch, got {calls}"
    for name, a, b in zip(NAMES, got, base):
        assert torch.equal(a, b), f"{name} changed bits"
