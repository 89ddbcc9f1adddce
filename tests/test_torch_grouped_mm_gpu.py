"""torch._grouped_mm for the plain m-grouped GEMMs on a Hopper GPU, against megamoe's Triton kernel.

Proves: where the tile table picks it (down projection and dgrad dx, bf16, N <= 2048), the launcher really
calls ``torch._grouped_mm`` and its rows are bitwise the Triton kernel's with the table's tiles, on experts
of 0, 1, 127, 128, 129, 300 ... rows, buffer rows past the last expert (EP capacity slack), "nt" and "nn"
weights, and at qwen3-30b-a3b's expert shape (2048 x 768, ~1000 rows per expert); a row's result does not
depend on the rest of its group (batch invariance); it runs clean under ``set_sync_debug_mode("error")`` and
replays bitwise from a CUDA graph; gathered rows, a preallocated output, fp16 and ``MEGAMOE_TORCH_MM=0`` take
the Triton kernel. The layer's tests (tests/test_fused_gpu.py) run their down / dgrad GEMMs through it too;
its bit-invariance test compares them with every Triton / Gluon tile variant.

Run: python -m pytest tests/test_torch_grouped_mm_gpu.py -q   (skipped without a Hopper GPU)
"""

import pytest
import torch

from test_wgrad_gluon_gpu import BF16, DEV, needs_hopper  # the same device / Hopper checks

pytestmark = [pytest.mark.gpu, needs_hopper]

COUNTS = [0, 1, 127, 128, 129, 300, 0, 7, 256, 45]
PAD = 13  # buffer rows past the last expert: not part of any expert


def _problem(kind, N, K, counts, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    off = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    R = int(off[-1])
    a = torch.randn(R + PAD, K, generator=g, device=DEV).to(BF16)
    shape = (len(counts), N, K) if kind == "down" else (len(counts), K, N)
    w = (torch.randn(*shape, generator=g, device=DEV) / K ** 0.5).to(BF16)
    return a, w, off, R


def _gemm(kind, a, w, off, **kw):
    from megamoe.ops import down_proj, grouped_mm_nn
    return down_proj(a, w, off, **kw) if kind == "down" else grouped_mm_nn(a, w, off, **kw)


class _Spy:
    """Counts the launcher's calls of torch._grouped_mm (ops.grouped_gemm.torch_grouped_mm)."""

    def __init__(self, monkeypatch):
        from megamoe.ops import grouped_gemm
        self.calls, real = 0, grouped_gemm.torch_grouped_mm

        def spy(*args):
            self.calls += 1
            return real(*args)
        monkeypatch.setattr(grouped_gemm, "torch_grouped_mm", spy)


def _triton(kind, a, w, off):
    """The same GEMM on the Triton kernel with the table's tiles (an explicit override: no torch_mm)."""
    import dataclasses

    from megamoe.ops import m_grouped_config, tile_config
    N, K = (w.shape[1], w.shape[2]) if kind == "down" else (w.shape[2], w.shape[1])
    cfg = m_grouped_config(kind, N, K, BF16, interpret=False)
    assert cfg.torch_mm, "the table should pick torch._grouped_mm for this shape"
    saved = dict(tile_config._OVERRIDES)
    tile_config._OVERRIDES[(kind, N, K)] = dataclasses.replace(cfg, torch_mm=False)
    try:
        return _gemm(kind, a, w, off)
    finally:
        tile_config._OVERRIDES.clear()
        tile_config._OVERRIDES.update(saved)


@pytest.mark.parametrize("kind,N,K,scale", [("down", 320, 768, 1), ("down", 2048, 96, 1), ("dgrad", 384, 1536, 1),
                                            ("dgrad", 200, 128, 1), ("down", 2048, 768, 8), ("dgrad", 2048, 1536, 8)])
def test_bitwise_equal_to_triton_kernel(monkeypatch, kind, N, K, scale):
    a, w, off, R = _problem(kind, N, K, [c * scale for c in COUNTS], seed=N + K)
    spy = _Spy(monkeypatch)
    got = _gemm(kind, a, w, off)
    assert spy.calls == 1, "torch._grouped_mm did not run"
    ref = _triton(kind, a, w, off)
    assert spy.calls == 1
    assert torch.equal(got[:R], ref[:R]), f"torch._grouped_mm differs from the Triton kernel ({kind}, N={N}, K={K})"
    want = torch.cat([a[int(off[e]):int(off[e + 1])].double() @ (w[e].double().t() if kind == "down" else w[e].double())
                      for e in range(w.shape[0])])
    err = (got[:R].double() - want).abs()
    assert (err <= 2 ** -7 * want.abs() + 1e-2).all(), err.max().item()
    # batch invariance: the first half of every group alone gives the same rows
    counts = [c * scale for c in COUNTS]
    keep = torch.cat([torch.arange(int(off[e]), int(off[e]) + counts[e] // 2, device=DEV) for e in range(len(counts))])
    half_off = torch.tensor([0] + [c // 2 for c in counts], device=DEV).cumsum(0).to(torch.int32)
    assert torch.equal(_gemm(kind, a[keep].contiguous(), w, half_off)[:keep.numel()], got[keep])


def test_no_host_sync_and_cuda_graph(monkeypatch):
    a, w, off, R = _problem("down", 512, 256, COUNTS, seed=1)
    spy = _Spy(monkeypatch)
    eager = _gemm("down", a, w, off)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = _gemm("down", a, w, off)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again[:R], eager[:R])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _gemm("down", a, w, off)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gemm("down", a, w, off)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:R], eager[:R])
    assert spy.calls >= 4


def test_other_operands_take_the_triton_kernel(monkeypatch):
    from megamoe.ops import grouped_mm_nt
    a, w, off, R = _problem("down", 256, 256, COUNTS, seed=2)
    spy = _Spy(monkeypatch)
    base = _gemm("down", a, w, off)
    assert spy.calls == 1
    out = torch.full_like(base, float("nan"))
    _gemm("down", a, w, off, out=out)  # a preallocated output: the Triton kernel writes into it
    idx = torch.arange(R, device=DEV, dtype=torch.int32)
    gathered = grouped_mm_nt(a, w, off, gather_idx_R=idx)
    half = _gemm("down", a.half(), w.half(), off)
    monkeypatch.setenv("MEGAMOE_TORCH_MM", "0")
    off_switch = _gemm("down", a, w, off)
    assert spy.calls == 1, "torch._grouped_mm ran where the Triton kernel should have"
    for t in (out, gathered, off_switch):
        assert torch.equal(t[:R], base[:R])
    assert torch.isnan(out[R:]).all(), "a row past the last expert was written"
    assert torch.isfinite(half[:R]).all()
