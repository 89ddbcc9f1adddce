"""The FP8 mode of the layer (``moe_experts(..., fp8=True)``, ``MoE(..., fp8=True)``): the stage loop with the FP8
recipe's Triton kernels on CPU under TRITON_INTERPRET=1, against megamoe.reference.moe_experts_fp8; the weight
cache; bad input.

Tolerance: the truth is the FP8 reference on fp64 inputs (the recipe's quantization and fp64 GEMMs on the
dequantized values, no rounding to the activation dtype); the fused path must be within 2x the fp32 reference's
own error against it, plus 1e-5 of the largest value (the flash-attention style criterion of
tests/test_kernels_interpret.py). The CPU cases run in fp32 because the Triton interpreter rounds fp32 -> bf16
toward zero (the GPU rounds to nearest even), which would blur the bound; bf16 is checked on the GPU
(``-m gpu``), where the same criterion holds.

Run: python -m pytest tests/test_fp8_layer.py -q (each interpreted case runs in a process with
TRITON_INTERPRET=1: tests/interpreter.py).
"""

from __future__ import annotations

import pytest
import torch

from interpreter import interpreted
from megamoe import reference
from megamoe.config import MoEConfig
from megamoe.functional import moe_experts
from megamoe.ops.fp8_weights import Fp8WeightCache

NAMES = ("out", "x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2")


def _make(T, D, F, E, K, S, *, seed=0, ids=None, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = (torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T
               else torch.zeros(0, K, dtype=torch.int64))
    x = torch.randn(T, D, generator=g)
    w = torch.rand(T, K, generator=g) + 0.1
    w13 = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, F, generator=g) * F ** -0.5
    s13 = torch.randn(2 * S, D, generator=g) * D ** -0.5 if S else None
    s2 = torch.randn(D, S, generator=g) * S ** -0.5 if S else None
    dout = torch.randn(T, D, generator=g)
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return ([cast(x), ids.to(device), cast(w).float(), cast(w13), cast(w2), cast(s13), cast(s2)], cast(dout))


def _run(fn, inputs, dout, dtype=None, **kw):
    """fn's output and the gradients of every floating input (None entries skipped), as a list by NAMES."""
    leaves = [t if t is None or not t.is_floating_point() else
              (t.detach().to(dtype) if dtype else t.detach().clone()).requires_grad_() for t in inputs]
    out = fn(*leaves, **kw)
    wrt = [t for i, t in enumerate(leaves) if i != 1 and t is not None]
    return [out.detach()] + list(torch.autograd.grad(out, wrt, dout.to(out.dtype)))


def _check_against_reference(inputs, dout, got):
    truth = _run(reference.moe_experts_fp8, inputs, dout, dtype=torch.float64)
    ref32 = _run(reference.moe_experts_fp8, inputs, dout)
    for name, g, r, t in zip(NAMES, got, ref32, truth):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        err = (g.double() - t).abs().max().item() if t.numel() else 0.0
        ref_err = (r.double() - t).abs().max().item() if t.numel() else 0.0
        bound = 2 * ref_err + 1e-5 * (t.abs().max().item() if t.numel() else 0.0)
        assert err <= bound, f"{name}: fused fp8 error {err:.3g} > 2 x reference error {ref_err:.3g} + atol"


CASES = {  # T, D, F, E, K, S, ids
    "shared": (8, 256, 128, 4, 2, 128, None),
    "no_shared_T1": (1, 128, 256, 3, 2, 0, None),
    "empty_expert": (10, 128, 128, 4, 2, 128, "avoid_last"),
    "one_expert": (17, 128, 128, 4, 1, 0, "all_zero"),
    "topk_is_E": (5, 128, 128, 3, 3, 0, None),
    "no_tokens": (0, 128, 128, 4, 2, 128, None),
    "small": (4, 128, 128, 3, 2, 0, None),
}


def _case_inputs(name):
    T, D, F, E, K, S, kind = CASES[name]
    ids = None
    if kind == "avoid_last":  # expert E-1 gets no row
        g = torch.Generator().manual_seed(7)
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    elif kind == "all_zero":
        ids = torch.zeros(T, K, dtype=torch.int64)
    return _make(T, D, F, E, K, S, ids=ids), E


@pytest.mark.parametrize("case", [c for c in CASES if c != "small"])
@interpreted
def test_fused_fp8_matches_the_fp8_reference(case):
    """Output and every gradient (x, routing weights, w13, w2, shared weights) of the fused FP8 path within the
    reference-derived bound; an expert without rows gets exact zero weight gradients; dtypes follow the inputs."""
    (inputs, dout), E = _case_inputs(case)
    got = _run(moe_experts, inputs, dout, fp8=True)
    _check_against_reference(inputs, dout, got)
    dw13, dw2 = got[3], got[4]
    if case == "empty_expert":
        assert not dw13[E - 1].any() and not dw2[E - 1].any()
    if case == "no_tokens":
        assert not dw13.any() and not dw2.any()


@interpreted
def test_fused_fp8_without_the_w2_gradient_gives_the_same_bits():
    """With w2 frozen the dout rows are quantized 1x128 alone; with its gradient asked for, 1x128 and 128x1 from one
    read of them (ops.quantize_1x128_and_128x1_grouped): x's, the routing weights' and w13's gradients are the same
    bits either way."""
    (inputs, dout), _ = _case_inputs("shared")
    full = _run(moe_experts, inputs, dout, fp8=True)
    leaves = [t if t is None or not t.is_floating_point() else t.detach().clone().requires_grad_(i != 4)
              for i, t in enumerate(inputs)]
    out = moe_experts(*leaves, fp8=True)
    wrt = [t for i, t in enumerate(leaves) if i not in (1, 4) and t is not None]
    grads = torch.autograd.grad(out, wrt, dout)
    assert torch.equal(out, full[0])
    for name, a, b in zip(("x", "topk_weights", "w13", "shared_w13", "shared_w2"), grads, full[1:4] + full[5:]):
        assert torch.equal(a, b), name


@pytest.mark.slow  # ~12 s on 2 CPU cores; on the GPU test_gpu_bf16_fp8_matches_the_fp8_reference repeats bitwise
@interpreted
def test_fused_fp8_is_bitwise_repeatable():
    """Two calls, and a second backward of a retained graph, give the same bits."""
    (inputs, dout), _ = _case_inputs("small")
    a = _run(moe_experts, inputs, dout, fp8=True)
    b = _run(moe_experts, inputs, dout, fp8=True)
    for name, u, v in zip(NAMES, a, b):
        assert torch.equal(u, v), name
    leaves = [t if t is None or not t.is_floating_point() else t.clone().requires_grad_() for t in inputs]
    out = moe_experts(*leaves, fp8=True)
    wrt = [t for i, t in enumerate(leaves) if i != 1 and t is not None]
    first = torch.autograd.grad(out, wrt, dout, retain_graph=True)
    second = torch.autograd.grad(out, wrt, dout)
    assert all(torch.equal(u, v) and torch.equal(u, w) for u, v, w in zip(first, second, a[1:]))


@interpreted
def test_weights_are_quantized_once_per_version(monkeypatch):
    """Two micro-batches without an update quantize each weight once (the backward reuses the forward's blocks);
    an in-place update (an optimizer step, add_) quantizes it again, and the result follows the new values."""
    import megamoe.ops.fp8_quant as fq

    calls = []
    real = fq.quantize_128x128
    monkeypatch.setattr(fq, "quantize_128x128", lambda w, **kw: calls.append(tuple(w.shape)) or real(w, **kw))
    (inputs, dout), _ = _case_inputs("small")
    x, ids, w, w13, w2, s13, s2 = inputs
    w13, w2 = w13.clone().requires_grad_(), w2.clone().requires_grad_()
    for _ in range(2):  # two micro-batches
        torch.autograd.grad(moe_experts(x, ids, w, w13, w2, s13, s2, fp8=True), [w13, w2], dout)
    assert sorted(calls) == sorted([tuple(w13.shape), tuple(w2.shape)])
    opt = torch.optim.SGD([w13, w2], lr=0.1)
    w13.grad, w2.grad = torch.ones_like(w13), torch.zeros_like(w2)
    opt.step()  # both versions bumped
    out = moe_experts(x, ids, w, w13, w2, s13, s2, fp8=True)
    assert len(calls) == 4
    with torch.no_grad():
        w2.add_(0.5)
    out2 = moe_experts(x, ids, w, w13, w2, s13, s2, fp8=True)
    assert len(calls) == 5 and calls[-1] == tuple(w2.shape)
    ref = reference.moe_experts_fp8(x, ids, w, w13.detach(), w2.detach(), s13, s2)
    scale = ref.abs().max()
    assert (out2 - ref).abs().max() < 1e-5 * scale and (out - out2).abs().max() > 1e-2 * scale  # not stale blocks


@interpreted
def test_layer_fp8_forward_backward_keeps_dtypes():
    """MoE(..., fp8=True) on the fused backend: forward and backward run; parameters and their gradients keep
    the module's dtype (bf16); outputs are finite and close to the reference backend's FP8 layer."""
    from megamoe import MoE

    cfg = MoEConfig(128, 128, 4, 2, n_shared_experts=1, dtype=torch.bfloat16)
    fused = MoE(cfg, backend="fused", fp8=True, seed=0)
    ref = MoE(cfg, backend="reference", fp8=True, seed=0)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    outs = []
    for moe in (fused, ref):
        out = moe(x)
        out.float().square().sum().backward()
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        for name, p in moe.named_parameters():
            want = torch.float32 if name == "router.w_ED" else torch.bfloat16
            assert p.dtype == want and p.grad is not None and p.grad.dtype == want, name
            assert torch.isfinite(p.grad).all(), name
        outs.append(out.detach().float())
    assert (outs[0] - outs[1]).abs().max() <= 0.05 * outs[1].abs().max()  # bf16 (interpreter: toward-zero casts)
    assert "fp8=True" in repr(fused)


# ---------------------------------------------------------------------------------------------- weight cache
def _counting_cache():
    calls = []

    def quantize(w):
        calls.append(w)
        return w.to(torch.float8_e4m3fn), w.new_ones(1)
    return Fp8WeightCache(quantize), calls


def test_weight_cache_hits_until_the_weight_changes():
    cache, calls = _counting_cache()
    w = torch.nn.Parameter(torch.randn(2, 256, 128))
    q1, _ = cache.get(w)
    q2, _ = cache.get(w)
    assert q1 is q2 and len(calls) == 1 and cache.hits == 1
    opt = torch.optim.AdamW([w], lr=1e-3)
    w.grad = torch.randn_like(w)
    opt.step()  # an optimizer step bumps the version counter
    assert cache.get(w)[0] is not q1 and len(calls) == 2
    with torch.no_grad():
        w.add_(1.0)
    cache.get(w)
    assert len(calls) == 3
    w.data = torch.randn(2, 256, 128)  # a new storage
    cache.get(w)
    cache.get(w)
    assert len(calls) == 4 and cache.hits == 2
    other = torch.randn(2, 256, 128)
    cache.get(other)
    assert len(calls) == 5 and len(cache) == 2
    del other  # entries go with their tensors
    assert len(cache) == 1


def test_weight_cache_misses_after_a_fused_optimizer_step_which_keeps_the_version_counter():
    cache, calls = _counting_cache()
    w = torch.nn.Parameter(torch.randn(2, 256, 128))
    opt = torch.optim.AdamW([w], lr=1e-2, fused=True)
    q1, _ = cache.get(w)
    w.grad = torch.randn_like(w)
    opt.step()  # writes w without bumping w._version
    assert cache.get(w)[0] is not q1 and len(calls) == 2, "stale blocks after a fused optimizer step"
    cache.get(w)
    assert len(calls) == 2  # until the next step, the blocks are reused


def test_weight_cache_kmajor_copy_has_the_same_values_swapped_order_and_is_kept_with_its_blocks(monkeypatch):
    import megamoe.ops.fp8_weights as fw

    cache = Fp8WeightCache(lambda w: (w.to(torch.float8_e4m3fn), torch.randn(w.shape[0], 2, 1)))
    w = torch.randn(3, 256, 128)
    blocks = cache.get(w)
    qk, sk = cache.kmajor(blocks)
    assert torch.equal(qk.view(torch.uint8), blocks[0].view(torch.uint8)) and torch.equal(sk, blocks[1])
    assert qk.stride() == (256 * 128, 1, 256) and qk.transpose(1, 2).is_contiguous()  # K-major per expert
    assert cache.kmajor(blocks)[0] is qk  # kept with the blocks
    with torch.no_grad():
        w.add_(1.0)
    fresh = cache.get(w)
    assert cache.kmajor(fresh)[0] is not qk  # new blocks, a new copy
    monkeypatch.setattr(fw, "_capturing", lambda t: True)
    assert cache.kmajor(fresh)[0] is not cache.kmajor(fresh)[0]  # recorded into the graph every time
    monkeypatch.undo()
    with fw.uncached():
        assert cache.kmajor(fresh)[0] is not cache.kmajor(fresh)[0]


def test_weight_cache_never_hits_while_capturing_or_for_inference_tensors(monkeypatch):
    import megamoe.ops.fp8_weights as fw

    cache, calls = _counting_cache()
    w = torch.randn(1, 128, 128)
    cache.get(w)
    monkeypatch.setattr(fw, "_capturing", lambda t: True)  # as under torch.cuda.graph capture
    cache.get(w)
    cache.get(w)
    assert len(calls) == 3 and cache.hits == 0  # recorded every time, nothing read from the cache
    monkeypatch.undo()
    cache.get(w)
    assert len(calls) == 3 and cache.hits == 1  # the eager entry is still the current version's
    with torch.inference_mode():
        v = torch.randn(1, 128, 128)
    cache.get(v)
    cache.get(v)
    assert len(calls) == 5 and len(cache) == 1  # no version counter: never cached


def test_weight_cache_is_off_inside_uncached_and_for_fsdp2_wrapped_layers():
    """FSDP2 rewrites its unsharded parameters without bumping their version counters: a layer (or its experts)
    wrapped by fully_shard quantizes at every call (the cache's ``uncached`` block), a plain one uses the cache."""
    from torch.distributed.fsdp import FSDPModule

    from megamoe import MoE
    from megamoe.layer import _fp8_weights_guard
    from megamoe.ops import fp8_weights

    cache, calls = _counting_cache()
    w = torch.randn(1, 128, 128)
    cache.get(w)
    with fp8_weights.uncached():
        cache.get(w)
        cache.get(w)
    assert len(calls) == 3 and cache.hits == 0 and len(cache) == 1
    cache.get(w)
    assert cache.hits == 1

    moe = MoE(MoEConfig(128, 128, 4, 2), backend="reference", fp8=True)
    wrapped = type("FSDPRoutedExperts", (FSDPModule, type(moe.experts)), {})  # what fully_shard makes of a class
    moe.experts.__class__ = wrapped
    for fp8, modules, off in ((True, (moe,), False), (True, (moe, moe.experts), True), (True, (moe.experts,), True),
                              (False, (moe.experts,), False)):
        hits = cache.hits
        with _fp8_weights_guard(fp8, *modules):
            cache.get(w)
        assert cache.hits == hits + (not off), (fp8, modules, off)


# ---------------------------------------------------------------------------------------------- bad input
def test_fp8_bad_input_names_the_constraint():
    from megamoe import MoE

    (inputs, _), _ = _case_inputs("shared")
    with pytest.raises(ValueError, match="multiples of 128.*hidden size D=96"):
        moe_experts(torch.randn(4, 96), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2),
                    torch.randn(3, 256, 96), torch.randn(3, 96, 128), fp8=True, backend="reference")
    with pytest.raises(ValueError, match="expert FFN size F=64"):
        MoE(MoEConfig(128, 64, 4, 2), backend="fused", fp8=True)
    with pytest.raises(TypeError, match="fp8 runs with bf16, fp16 or fp32"):
        moe_experts(*[t.double() if t is not None and t.is_floating_point() else t for t in inputs], fp8=True,
                    backend="reference")
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        moe_experts(*inputs, fp8="yes")
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        MoE(MoEConfig(128, 128, 4, 2), fp8=1)
    with pytest.raises(ValueError, match="cannot cast|fp8 runs with"):
        MoE(MoEConfig(128, 128, 4, 2), backend="reference", fp8=True).double()


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["shared", "empty_expert", "one_expert", "topk_is_E", "no_tokens", "large"])
def test_gpu_bf16_fp8_matches_the_fp8_reference(case):
    """bf16 on the GPU (casts round to nearest even there): the same criterion as the CPU cases."""
    if case == "large":
        inputs, dout = _make(700, 1024, 512, 16, 4, 512, seed=3, dtype=torch.bfloat16, device="cuda")
    else:
        (inputs, dout), E = _case_inputs(case)
        inputs = [t if t is None else t.cuda() for t in inputs]
        inputs = [t.to(torch.bfloat16) if t is not None and t.is_floating_point() and i != 2 else t
                  for i, t in enumerate(inputs)]
        dout = dout.cuda().to(torch.bfloat16)
    got = _run(moe_experts, inputs, dout, fp8=True)
    again = _run(moe_experts, inputs, dout, fp8=True)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    _check_against_reference(inputs, dout, got)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_quantizes_updated_weights():
    """A captured forward + backward records the weight quantization: a replay after an in-place weight update
    gives the new weights' results (never cached blocks), and eager calls around the capture agree."""
    inputs, dout = _make(96, 256, 256, 8, 2, 256, seed=5, dtype=torch.bfloat16, device="cuda")
    x, ids, w, w13, w2, s13, s2 = inputs
    w13 = w13.clone().requires_grad_()

    def step():
        out = moe_experts(x, ids, w, w13, w2, s13, s2, fp8=True)
        (dw13,) = torch.autograd.grad(out, [w13], dout)
        return out, dw13

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (compiles, fills the cache outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, dw13_g = step()
    with torch.no_grad():
        w13.mul_(1.5)
    graph.replay()
    torch.cuda.synchronize()
    out_e, dw13_e = step()
    assert torch.equal(out_g, out_e) and torch.equal(dw13_g, dw13_e)


@pytest.mark.gpu
def test_gpu_layer_fp8_trains_in_bf16():
    from megamoe import MoE, get_preset

    cfg = get_preset("small")
    moe = MoE(cfg, backend="fused", fp8=True, device="cuda", seed=0)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    x = torch.randn(4, 64, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        out = moe(x)
        (out.float().square().mean() + moe.last_stats.aux_loss).backward()
        opt.step()
        opt.zero_grad()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert moe.w13_LGD.dtype == torch.bfloat16
