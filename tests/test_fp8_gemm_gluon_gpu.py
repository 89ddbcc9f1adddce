"""The warp-specialized Gluon FP8 m-grouped GEMM on a Hopper GPU, against the Triton kernel.

Proves: bitwise the same (R, N) rows as megamoe.ops.fp8_gemm.fp8_grouped_mm_nt (the Triton kernel, which the
interpreter tests check against megamoe.reference) on experts of 0, 1, 127, 128, 129 and 300 rows, R not a multiple
of the 128-row tile and rows past the last expert (never written: a poisoned output keeps them), N = 256 and 2048,
K of one and of several K-loop chunks, bf16 / fp16 / fp32 outputs, and at the qwen3-30b-a3b down (K = 768,
N = 2048) and dx (K = 1536) shapes with random routing over 128 experts (more tiles than programs: every
program walks many tiles and experts); no host sync; capturable in a CUDA graph.

Run: python -m pytest tests/test_fp8_gemm_gluon_gpu.py -q   (skipped without a Hopper GPU)
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3 = torch.float8_e4m3fn


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (the Gluon kernel targets sm_90)")


def _problem(counts, N, K, extra_rows, seed):
    """Random e4m3 operands and fp32 scales (not powers of two: the promotion's rounding is exercised) for experts
    of ``counts`` rows, plus ``extra_rows`` rows past the last expert."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    E, R = len(counts), sum(counts) + extra_rows
    aq = (torch.randn(R, K, generator=g, device=DEV) * 4).to(E4M3)
    as_ = torch.rand(R, K // 128, generator=g, device=DEV) + 0.25
    bq = (torch.randn(E, N, K, generator=g, device=DEV) * 4).to(E4M3)
    bs = torch.rand(E, N // 128, K // 128, generator=g, device=DEV) * 0.01 + 1e-3
    offsets = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    return aq, as_, bq, bs, offsets


def _poisoned_run(fn, R, N, dtype):
    """Run fn with the caching allocator's next (R, N) block filled with NaN first; returns (out, poisoned): whether
    out landed in that block (then rows never written are still NaN)."""
    poison = torch.full((R, N), float("nan"), dtype=dtype, device=DEV)
    ptr = poison.data_ptr()
    del poison
    out = fn()
    return out, out.data_ptr() == ptr


def _check(counts, N, K, extra_rows, out_dtype=torch.bfloat16, seed=0):
    from megamoe.ops.fp8_gemm import fp8_grouped_mm_nt
    from megamoe.ops.fp8_gemm_gluon import fp8_grouped_mm_nt_gluon

    aq, as_, bq, bs, offsets = _problem(counts, N, K, extra_rows, seed)
    n = sum(counts)
    want = fp8_grouped_mm_nt(aq, as_, bq, bs, offsets, out_dtype=out_dtype)
    torch.cuda.synchronize()
    got, poisoned = _poisoned_run(lambda: fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, out_dtype=out_dtype),
                                  aq.shape[0], N, out_dtype)
    torch.cuda.synchronize()
    assert got.shape == (aq.shape[0], N) and got.dtype == out_dtype
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got[:n].view(ints) == want[:n].view(ints)
    assert bool(same.all()), (f"{int((~same).sum())} of {same.numel()} elements differ; first rows "
                              f"{torch.nonzero(~same)[:5].tolist()}")
    assert bool(torch.isfinite(got[:n].float()).all())
    if poisoned and extra_rows:  # rows past the last expert never written
        assert bool(torch.isnan(got[n:].float()).all())
    return got


COUNTS = [0, 1, 127, 128, 129, 300, 0, 5]


@needs_hopper
@pytest.mark.parametrize("N", [256, 2048])
@pytest.mark.parametrize("K", [128, 768, 2048])
def test_bitwise_triton_on_edge_experts(N, K):
    """Experts of 0, 1, 127, 128, 129, 300 rows (partial, full and multi-tile m-tiles; both MMA warpgroups' halves
    partial, empty or full), 37 rows past the last expert (R not a multiple of 128, poison kept); K of one
    K-block, one K-loop chunk (768: 6 K-blocks) and two chunks (2048)."""
    _check(COUNTS, N, K, extra_rows=37)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_bitwise_triton_other_out_dtypes(out_dtype):
    _check(COUNTS, 256, 768, extra_rows=3, out_dtype=out_dtype, seed=1)


def _routing_counts(T, E, top_k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.rand(T, E, device=DEV, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=E).tolist()


@needs_hopper
@pytest.mark.parametrize("K", [768, 1536], ids=["down", "dx"])
def test_bitwise_triton_qwen3_shapes(K):
    """qwen3-30b-a3b: E = 128 experts, top-8 of 2048 tokens (16384 rows, ~128 per expert), N = D = 2048; K = F
    (down) or 2F (dx on the K-major weight copy)."""
    _check(_routing_counts(2048, 128, 8, seed=K), 2048, K, extra_rows=0, seed=K)


@needs_hopper
def test_no_host_sync_and_cuda_graph():
    from megamoe.ops.fp8_gemm_gluon import fp8_grouped_mm_nt_gluon

    aq, as_, bq, bs, offsets = _problem(COUNTS, 256, 768, 0, seed=2)
    cache = {}
    want = fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, tile_cache=cache)  # compiles, fills the tile cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, tile_cache=cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, tile_cache=cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
