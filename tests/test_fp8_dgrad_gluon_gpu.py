"""The FP8 dgrad with the SwiGLU backward in its epilogue (one Gluon kernel) on a Hopper GPU, against the two
kernels it replaces: the Gluon GEMM writing the fp32 accumulator, then the SwiGLU-backward pass on it.

Proves: bitwise the same dgu, hw, row-dot partials and dgu's 1x128 bytes and scales as
``fp8_swiglu_bwd(fp8_grouped_mm_nt_gluon(..., out_dtype=torch.float32), gu, ...)`` (the composition that
tests/test_fp8_gemm.py checks against megamoe.reference) on experts of 0, 1, 127, 128, 129 and 300 rows with rows
past the last expert (never written: poisoned outputs keep them), with and without routing weights and row dots,
bf16 and fp16 activations, zero and huge accumulators (all-zero blocks, non-finite values following the pass), and
at the qwen3-30b-a3b (D = 2048, F = 768, 128 experts) and deepseek-v3 (D = 7168, F = 2048) dgrad shapes with random
routing; no host sync; capturable in a CUDA graph.

Run: python -m pytest tests/test_fp8_dgrad_gluon_gpu.py -q   (skipped without a Hopper GPU)
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3 = torch.float8_e4m3fn
NAMES = ("dgu", "hw", "row_dot", "dgq", "dgs")


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (the Gluon kernel targets sm_90)")


def _problem(counts, F, D, extra_rows, seed, dtype=torch.bfloat16, gu_scale=2.0):
    """Random dY rows (1x128 e4m3 + scales), K-major w2 blocks (E, F, D), [g | u] and routing weights for experts
    of ``counts`` rows, plus ``extra_rows`` rows past the last expert."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    E, R = len(counts), sum(counts) + extra_rows
    aq = (torch.randn(R, D, generator=g, device=DEV) * 4).to(E4M3)
    as_ = torch.rand(R, D // 128, generator=g, device=DEV) + 0.25
    bq = (torch.randn(E, F, D, generator=g, device=DEV) * 4).to(E4M3)
    bs = torch.rand(E, F // 128, D // 128, generator=g, device=DEV) * 0.01 + 1e-3
    gu = (torch.randn(R, 2 * F, generator=g, device=DEV) * gu_scale).to(dtype)
    scale = torch.rand(R, generator=g, device=DEV)
    offsets = torch.tensor([0] + counts, device=DEV).cumsum(0).to(torch.int32)
    return aq, as_, bq, bs, offsets, gu, scale


def _outputs(prob, *, use_scale, row_dot, fused):
    from megamoe.ops.fp8_gemm_gluon import fp8_dgrad_swiglu_gluon, fp8_grouped_mm_nt_gluon
    from megamoe.ops.fp8_swiglu import fp8_swiglu_bwd

    aq, as_, bq, bs, offsets, gu, scale = prob
    scale = scale if use_scale else None
    if fused:
        return fp8_dgrad_swiglu_gluon(aq, as_, bq, bs, offsets, gu, row_scale_R=scale, row_dot=row_dot)
    acc = fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets, out_dtype=torch.float32)
    return fp8_swiglu_bwd(acc, gu, valid_rows_1=offsets[-1:], row_scale_R=scale, row_dot=row_dot)


def _poison_next(shapes_dtypes):
    """Fill the caching allocator's next blocks of these shapes with NaN bytes, then free them: the kernel's
    outputs land there when allocated in the same order (then rows never written are still NaN)."""
    blocks = [torch.full(s, 0xFF, dtype=torch.uint8, device=DEV).view(d) for s, d in shapes_dtypes]
    ptrs = [b.data_ptr() for b in blocks]
    del blocks
    return ptrs


def _check(counts, F, D, extra_rows, *, use_scale=True, row_dot=True, seed=0, **kw):
    prob = _problem(counts, F, D, extra_rows, seed, **kw)
    n, R = sum(counts), prob[0].shape[0]
    want = _outputs(prob, use_scale=use_scale, row_dot=row_dot, fused=False)
    torch.cuda.synchronize()
    el = prob[5].element_size()
    shapes = [((R, 2 * F * el), prob[5].dtype), ((R, F * el), prob[5].dtype)]
    shapes += [((R, F // 128 * 4), torch.float32)] if row_dot else []
    ptrs = _poison_next(shapes + [((R, 2 * F), E4M3), ((R, 2 * F // 128 * 4), torch.float32)])
    got = _outputs(prob, use_scale=use_scale, row_dot=row_dot, fused=True)
    torch.cuda.synchronize()
    for name, w, o in zip(NAMES, want, got):
        if w is None:
            assert o is None, name
            continue
        assert o.shape == w.shape and o.dtype == w.dtype, name
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[o.element_size()]
        same = o[:n].view(ints) == w[:n].view(ints)
        assert bool(same.all()), (f"{name}: {int((~same).sum())} of {same.numel()} elements differ; first "
                                  f"{torch.nonzero(~same)[:5].tolist()}")
    poisoned = [o for o in got if o is not None and o.data_ptr() in ptrs]
    if extra_rows:
        assert poisoned, "no output landed in a poisoned block: the check of unwritten rows did not run"
    for o in poisoned:  # rows past the last expert never written: still 0xFF bytes
        assert bool((o[n:].contiguous().view(torch.uint8) == 0xFF).all())
    return got, n


@needs_hopper
@pytest.mark.parametrize("D", [128, 2048])
@pytest.mark.parametrize("F", [128, 768])
def test_bitwise_pass_on_edge_experts(F, D):
    _check([0, 1, 127, 128, 129, 300, 0], F, D, extra_rows=7)


@needs_hopper
@pytest.mark.parametrize("use_scale, row_dot", [(False, True), (True, False), (False, False)])
def test_bitwise_pass_without_weights_or_row_dots(use_scale, row_dot):
    _check([5, 0, 200, 64], 256, 256, extra_rows=3, use_scale=use_scale, row_dot=row_dot)


@needs_hopper
def test_bitwise_pass_fp16_and_all_rows_on_one_expert():
    _check([0, 0, 517, 0], 384, 512, extra_rows=0, dtype=torch.float16, seed=1)


@needs_hopper
def test_zero_and_non_finite_blocks_follow_the_pass():
    """gu of zeros gives all-zero dgu blocks (exact signed zeros, finite scales); huge gate values overflow exp and the
    products to Inf / NaN, which the fused epilogue must turn into the pass's bytes and NaN scales."""
    got, n = _check([130, 0, 129], 256, 256, extra_rows=0, gu_scale=0.0)
    assert bool((got[3][:n].view(torch.uint8) & 0x7F == 0).all()) and bool(torch.isfinite(got[4][:n]).all())  # +-0
    _check([130, 0, 129], 256, 256, extra_rows=0, gu_scale=1e38, dtype=torch.bfloat16, seed=3)


def _routing_counts(T, E, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=E).tolist()


@needs_hopper
@pytest.mark.parametrize("E, F, D, T, top_k", [(128, 768, 2048, 1024, 8), (32, 2048, 7168, 256, 8)],
                         ids=["qwen3-30b-a3b", "deepseek-v3-like"])
def test_bitwise_pass_model_shapes(E, F, D, T, top_k):
    _check(_routing_counts(T, E, top_k, seed=E), F, D, extra_rows=5)


@needs_hopper
def test_no_host_sync_and_cuda_graph():
    from megamoe.ops.fp8_gemm_gluon import fp8_dgrad_swiglu_gluon

    prob = _problem([100, 0, 300], 256, 512, 0, seed=2)
    aq, as_, bq, bs, offsets, gu, scale = prob
    want = fp8_dgrad_swiglu_gluon(aq, as_, bq, bs, offsets, gu, row_scale_R=scale)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fp8_dgrad_swiglu_gluon(aq, as_, bq, bs, offsets, gu, row_scale_R=scale)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_dgrad_swiglu_gluon(aq, as_, bq, bs, offsets, gu, row_scale_R=scale)  # warm-up off the graph
        with torch.cuda.graph(graph, stream=stream):
            got = fp8_dgrad_swiglu_gluon(aq, as_, bq, bs, offsets, gu, row_scale_R=scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    for name, w, o in zip(NAMES, want, got):
        assert torch.equal(o.view(torch.uint8), w.view(torch.uint8)), name
