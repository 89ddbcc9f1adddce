"""The warp-specialized Gluon FP8 m-grouped GEMM on a Hopper GPU, against the Triton kernel.

Proves: bitwise the same (R, N) rows as megamoe.ops.fp8_gemm.fp8_grouped_mm_nt (the Triton kernel, which the
interpreter tests check against megamoe.reference) on experts of 0, 1, 127, 128, 129 and 300 rows, R not a multiple
of the 128-row tile and rows past the last expert (never written: a poisoned output keeps them), N = 256 and 2048,
K of one and of several K-loop chunks, bf16 / fp16 / fp32 outputs, and at the qwen3-30b-a3b gate/up (K = 2048,
N = 1536), down (K = 768, N = 2048), dgrad (K = 2048, N = 768, fp32 out) and dx (K = 1536, N = 2048) shapes with
random routing over 128 experts (more tiles than programs: every program walks many tiles and experts); no host
sync; capturable in a CUDA graph.

And the k-grouped weight-gradient kernel (fp8_k_grouped_mm_gluon): bitwise the same (E, M, N) as
megamoe.ops.fp8_gemm.fp8_k_grouped_mm(..., padded=True) on the block-padded K-major operands that
megamoe.ops.fp8_quant.quantize_128x1_grouped(..., kmajor=True) writes from random 16-bit rows (as the FP8 layer's
wgrad does), fp32 and bf16 outputs: experts of 0, 1, 127, 128, 129, 300 and 5 rows with rows past the last expert
(scale and byte blocks past the table never read), all experts empty, the qwen3-30b-a3b dW13 (M = 1536, N = 2048,
Q gathered from token rows) and dW2 (M = 2048, N = 768) shapes with ~1024 rows per expert and deepseek-like ~256
rows per expert over 256 experts; one and three programs walking many tiles each (a tile's epilogue during the
next tile's first wgmma, tiles after an empty expert's block of zeros, the load ring wrapping); every element
written (a poisoned output; empty experts exact zeros); no host sync; capturable in a CUDA graph.

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
@pytest.mark.parametrize("N, K, out_dtype", [(1536, 2048, torch.bfloat16), (2048, 768, torch.bfloat16),
                                             (768, 2048, torch.float32), (2048, 1536, torch.bfloat16)],
                         ids=["gate_up", "down", "dgrad", "dx"])
def test_bitwise_triton_qwen3_shapes(N, K, out_dtype):
    """qwen3-30b-a3b: E = 128 experts, top-8 of 2048 tokens (16384 rows, ~128 per expert), D = 2048, F = 768:
    gate/up (N = 2F, K = D), down (N = D, K = F), the dgrad on the K-major w2 copy (N = F, K = D, fp32 out) and dx on
    the K-major w13 copy (N = D, K = 2F)."""
    _check(_routing_counts(2048, 128, 8, seed=K), N, K, extra_rows=0, out_dtype=out_dtype, seed=K + N)


def _sync_free_then_graph(calls, captured):
    """Run ``calls()`` under torch's sync check (an error on any host sync), then capture ``captured()`` in a CUDA
    graph on a side stream and replay it; returns the replayed output."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = captured()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return got


@needs_hopper
def test_no_host_sync_and_cuda_graph():
    from megamoe.ops.fp8_gemm_gluon import fp8_grouped_mm_nt_gluon

    aq, as_, bq, bs, offsets = _problem(COUNTS, 256, 768, 0, seed=2)
    cache = {}
    want = fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, tile_cache=cache)  # compiles, fills the tile cache
    run = lambda: fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, tile_cache=cache)  # noqa: E731
    got = _sync_free_then_graph(run, run)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# ---------------------------------------------------------------------------------------------- k-grouped (wgrad)
def _wgrad_operands(counts, M, N, extra_rows, seed, tokens=None, cache=None):
    """128x1 block-quantized K-major operands of a weight gradient, as Fp8Experts.wgrad makes them: random bf16 P
    (R, M) and Q (R, N) rows (magnitudes varying by row and column: the 128x1 scales differ), or with ``tokens``
    Q gathered from that many token rows (the dW13 x rows); returns (pq, ps, qq, qs, offsets_E1, block table)."""
    from megamoe.ops import fp8_gemm, fp8_quant

    g = torch.Generator(device=DEV).manual_seed(seed)
    R = sum(counts) + extra_rows

    def rows(n, c):
        x = torch.randn(n, c, generator=g, device=DEV)
        x *= torch.exp2(torch.randint(-6, 7, (n, 1), generator=g, device=DEV).float())
        x *= torch.rand(1, c, generator=g, device=DEV) + 0.5
        return x.to(torch.bfloat16)

    offsets = torch.tensor([0] + list(counts), device=DEV).cumsum(0).to(torch.int32)
    blocks = fp8_gemm.table_for(offsets, 128, cache)
    p = rows(R, M)
    if tokens:
        q, q_idx = rows(tokens, N), torch.randint(0, tokens, (R,), generator=g, device=DEV, dtype=torch.int32)
    else:
        q, q_idx = rows(R, N), None
    pq, ps = fp8_quant.quantize_128x1_grouped(p, offsets, None, blocks, kmajor=True)
    qq, qs = fp8_quant.quantize_128x1_grouped(q, offsets, q_idx, blocks, kmajor=True)
    return pq, ps, qq, qs, offsets, blocks


def _check_wgrad(counts, M, N, extra_rows=0, out_dtype=torch.float32, seed=0, tokens=None):
    from megamoe.ops.fp8_gemm import fp8_k_grouped_mm
    from megamoe.ops.fp8_gemm_gluon import fp8_k_grouped_mm_gluon

    pq, ps, qq, qs, offsets, blocks = _wgrad_operands(counts, M, N, extra_rows, seed, tokens)
    assert pq.t().is_contiguous() and qq.t().is_contiguous()  # K-major, block-padded
    E = len(counts)
    want = fp8_k_grouped_mm(pq, ps, qq, qs, offsets, block_offsets_E1=blocks, padded=True, out_dtype=out_dtype)
    torch.cuda.synchronize()
    got, poisoned = _poisoned_run(
        lambda: fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, block_offsets_E1=blocks, out_dtype=out_dtype),
        E * M, N, out_dtype)
    torch.cuda.synchronize()
    assert got.shape == (E, M, N) and got.dtype == out_dtype
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got.view(ints) == want.view(ints)
    assert bool(same.all()), (f"{int((~same).sum())} of {same.numel()} elements differ; first (e, m, n) "
                              f"{torch.nonzero(~same)[:5].tolist()}")
    # NaN only where an element was never written (poisoned output); fp16 sums may overflow to inf in both kernels
    assert not bool(torch.isnan(got.float()).any()), "an element not written (poisoned output)"
    empty = [e for e, c in enumerate(counts) if c == 0]
    if empty:  # exact (+0.0) zeros, not merely equal to zero
        assert bool((got[empty].view(ints) == 0).all())
    return poisoned


@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("M, N", [(128, 128), (256, 384), (640, 256)])
def test_wgrad_bitwise_triton_on_edge_experts(M, N, out_dtype):
    """Experts of 0, 1, 127, 128, 129, 300, 0 and 5 rows (one partial block, one full, a full and a partial, three
    blocks; empty experts first, in the middle), 37 rows past the last expert (R not a multiple of 128: byte and
    scale blocks past the table are left unwritten by the quantizer and must not be read); every element
    written: the output lands in a NaN-poisoned block. One, two and three 128 x 128 tiles across N."""
    poisoned = _check_wgrad(COUNTS, M, N, extra_rows=37, out_dtype=out_dtype, seed=M + N)
    assert poisoned, "the output was not allocated in the poisoned block: the all-written check did not run"


@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("programs", [None, 1, 3], ids=["grid", "1prog", "3prog"])
@pytest.mark.parametrize("M, N", [(128, 128), (256, 384), (640, 256)])
def test_wgrad_coords_ahead_arm_bitwise_triton(M, N, out_dtype, programs, monkeypatch):
    """The A/B arm of scripts/ab_fp8_wgrad_coords.py (a tile's coordinates loaded during the tile before it) on the
    edge experts, with few programs walking many tiles, and on deepseek-v3-like routing: the same bits as the
    Triton kernel, every element written."""
    import megamoe.ops.fp8_gemm_gluon as fg

    monkeypatch.setattr(fg, "WGRAD_COORDS_AHEAD", True)
    if programs is not None:
        monkeypatch.setattr(fg, "sm_budget", lambda device: programs)
        assert _check_wgrad(COUNTS * 3, M, N, extra_rows=37, out_dtype=out_dtype, seed=M + N + programs)
        return
    assert _check_wgrad(COUNTS, M, N, extra_rows=37, out_dtype=out_dtype, seed=M + N)
    if (M, N) == (640, 256):
        _check_wgrad(_routing_counts(8192, 256, 8, seed=3), 1024, 512, out_dtype=out_dtype, seed=3)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("M, N", [(128, 128), (256, 384)])
def test_wgrad_few_programs_many_tiles_each(M, N, programs, out_dtype, monkeypatch):
    """One and three programs for the edge experts three times over: every program runs many tiles in turn, so
    each tile's epilogue runs during the next tile's first wgmma, tiles follow an empty expert's one block of
    zeros, and the load ring wraps; the same bits as the Triton kernel, every element written, empty experts +0.0."""
    import megamoe.ops.fp8_gemm_gluon as fg

    monkeypatch.setattr(fg, "sm_budget", lambda device: programs)
    assert _check_wgrad(COUNTS * 3, M, N, extra_rows=37, out_dtype=out_dtype, seed=M + N + programs)


@needs_hopper
@pytest.mark.parametrize("counts, extra_rows", [([0, 0, 0], 5), ([0, 0], 0), ([0, 0, 300, 0], 0)],
                         ids=["all-empty", "no-rows", "one-expert"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_empty_experts_give_exact_zeros(counts, extra_rows, out_dtype):
    """Experts with no rows (all of them; a buffer of no rows at all; all but one) get exact zeros in every
    element, never NaN from an unwritten (poisoned) output."""
    assert _check_wgrad(counts, 256, 256, extra_rows=extra_rows, out_dtype=out_dtype, seed=7)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M, N, gather", [(1536, 2048, True), (2048, 768, False)], ids=["dW13", "dW2"])
def test_wgrad_bitwise_triton_qwen3_shapes(M, N, gather, out_dtype):
    """qwen3-30b-a3b at 16384 tokens: E = 128 experts, top-8 random routing (~1024 rows, ~8 blocks per expert);
    dW13: P = dgu (M = 2F = 1536), Q = x gathered from the 16384 token rows (N = D = 2048); dW2: P = dout rows
    (M = D = 2048), Q = hw (N = F = 768)."""
    T = 16384
    _check_wgrad(_routing_counts(T, 128, 8, seed=M), M, N, out_dtype=out_dtype, seed=M,
                 tokens=T if gather else None)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wgrad_bitwise_triton_deepseek_like_routing(out_dtype):
    """deepseek-v3-like routing: E = 256 experts, top-8 of 8192 tokens (~256 rows, ~2 blocks per expert: most
    tiles walk a short K loop), at a reduced M x N (the full 7168-wide gradients of 256 experts would take 30 GB
    per output)."""
    _check_wgrad(_routing_counts(8192, 256, 8, seed=3), 1024, 512, out_dtype=out_dtype, seed=3)


@needs_hopper
def test_wgrad_no_host_sync_and_cuda_graph():
    from megamoe.ops.fp8_gemm_gluon import fp8_k_grouped_mm_gluon

    cache = {}
    pq, ps, qq, qs, offsets, blocks = _wgrad_operands(COUNTS, 256, 384, 11, seed=5, cache=cache)
    want = fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, block_offsets_E1=blocks)  # compiles both variants
    fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, block_offsets_E1=blocks, out_dtype=torch.bfloat16)

    def calls():
        fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, block_offsets_E1=blocks)
        # the block table from the tile cache (the one the quantizer used)
        fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, tile_cache=cache)
        fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, block_offsets_E1=blocks, out_dtype=torch.bfloat16)

    got = _sync_free_then_graph(calls, lambda: fp8_k_grouped_mm_gluon(pq, ps, qq, qs, offsets, tile_cache=cache))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
