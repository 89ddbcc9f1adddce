"""The FP8 routed experts of the specification (megamoe.reference.moe_experts_fp8), on CPU.

Proves: the forward equals the bf16 reference computed in fp64 on the dequantized operands within the bound that
quantizing h alone allows (``|dh| <= max(|h| * 2**-4, s_h * 2**-10)`` per element, through ``|w2|`` and the
routing weights); the gradients equal the recipe's formulas composed per (token, slot) in fp64 (dout and dgu
1x128, the weight-gradient operands 128x1 per expert from the unquantized values); the quantizers are called on
exactly the recipe's tensors in the recipe's layouts; every gradient (x, routing weights, w13, w2, shared
weights) is present, finite and within twice the error that quantizing the operands (x, w13, w2) gives PyTorch's
fp64 gradients, and the shared expert's (bf16 path, unquantized) gradients are the reference's; bf16 inputs
agree with the fp64-accumulation counterpart (``acc_dtype=torch.float64``) to bf16 rounding, bitwise
repeatable; an expert without rows gets exact zero weight gradients, T = 0 works; a NaN in one token makes that
token's output NaN and no other's; D or F not a multiple of 128 raises a clear ValueError.
"""

import pytest
import torch

from megamoe import reference as ref

NAMES = ("x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2")


def _make(T, D, F, E, K, S, *, seed=0, dtype=torch.float64, spread=0):
    """Random inputs; ``spread``: token magnitudes vary over 2**-spread..2**spread (a range beyond e4m3's, so that
    a 128x1 block over tokens quantizes differently from the tokens' own 1x128 blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-spread, spread + 1, (T, 1), generator=g).double())
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
    w = torch.rand(T, K, generator=g, dtype=torch.float32) + 0.1
    w13 = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64) / D ** 0.5
    w2 = torch.randn(E, D, F, generator=g, dtype=torch.float64) / F ** 0.5
    s13 = torch.randn(2 * S, D, generator=g, dtype=torch.float64) / D ** 0.5 if S else None
    s2 = torch.randn(D, S, generator=g, dtype=torch.float64) / S ** 0.5 if S else None
    cast = lambda t: t.to(dtype) if t is not None else None  # noqa: E731
    return cast(x), ids, w, cast(w13), cast(w2), cast(s13), cast(s2)


def _run(fn, x, ids, w, w13, w2, s13, s2, dout, **kw):
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in (x, w, w13, w2, s13, s2)]
    out = fn(params[0], ids, *params[1:], **kw)
    live = [p for p in params if p is not None]
    it = iter(torch.autograd.grad(out, live, dout))
    return out.detach(), [next(it) if p is not None else None for p in params]


def _deq_operands(x, w13, w2):
    """The dequantized x (1x128), w13 and w2 (128x128), in x's dtype."""
    return (ref.dequantize_1x128(*ref.quantize_1x128(x)).to(x.dtype),
            ref.dequantize_128x128(*ref.quantize_128x128(w13)).to(x.dtype),
            ref.dequantize_128x128(*ref.quantize_128x128(w2)).to(x.dtype))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


CASE = dict(T=24, D=256, F=128, E=5, K=2, S=128)


def test_forward_within_the_bound_of_quantizing_h():
    x, ids, w, w13, w2, s13, s2 = _make(**CASE)
    out = ref.moe_experts_fp8(x, ids, w, w13, w2, s13, s2)
    xd, w13d, w2d = _deq_operands(x, w13, w2)
    want = ref.combine(ref.routed_experts(xd, ids, w13d, w2d), w, ref.shared_expert(x, s13, s2), x.dtype)
    F = CASE["F"]
    gu = torch.einsum("td,tkgd->tkg", xd, w13d[ids])
    h = ref.swiglu(gu[..., :F], gu[..., F:])  # (T, K, F), what the FP8 forward quantizes
    s_h = ref.quantize_1x128(h.reshape(-1, F))[1].reshape(h.shape[0], h.shape[1], 1)
    dh = torch.maximum(h.abs() * 2.0 ** -4, s_h * 2.0 ** -10)  # e4m3 rounding: 3 fraction bits, step 2**-9
    bound = torch.einsum("tkf,tkdf,tk->td", dh, w2d[ids].abs(), w.double())
    err = (out - want).abs()
    assert (err <= bound + 1e-12 * want.abs().max()).all(), f"max excess {(err - bound).max():.3g}"
    assert err.max() > 0.01 * bound.max()  # h was quantized
    assert (ref.moe_experts_fp8(x, ids, w, w13d, w2d, s13, s2) - out).abs().max() == 0  # weights quantized once


def test_gradients_within_twice_the_error_of_quantized_operands():
    x, ids, w, w13, w2, s13, s2 = _make(**CASE, seed=1)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out, g8 = _run(ref.moe_experts_fp8, x, ids, w, w13, w2, s13, s2, dout)
    xd, w13d, w2d = _deq_operands(x, w13, w2)
    _, g_deq = _run(ref.moe_experts, xd, ids, w, w13d, w2d, s13, s2, dout)
    _, g64 = _run(ref.moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    for name, a, b, c in zip(NAMES, g8, g_deq, g64):
        assert a is not None and a.shape == c.shape and a.dtype == c.dtype and torch.isfinite(a).all(), name
        if name.startswith("shared"):  # the bf16 path: unquantized
            assert _rel(a, c) < 1e-12, name
            continue
        err, err_in = _rel(a, b), _rel(b, c)
        assert 0 < err <= 2 * err_in, f"{name}: {err:.3g} vs the quantized operands' own {err_in:.3g}"


def _recipe_grads(x, ids, w, w13, w2, dout):
    """The routed experts' gradients composed per (token, slot) from the recipe's formulas, in fp64."""
    T, K = ids.shape
    E, G, D = w13.shape
    F = G // 2
    xd, w13d, w2d = _deq_operands(x, w13, w2)
    dd = ref.dequantize_1x128(*ref.quantize_1x128(dout)).double()
    gu = torch.einsum("td,tkgd->tkg", xd, w13d[ids])
    g, u = gu[..., :F], gu[..., F:]
    h = ref.swiglu(g, u)
    a = torch.einsum("td,tkdf->tkf", dd, w2d[ids])
    dw = (a * h).sum(-1)
    dh = a * w.double()[..., None]
    sig = torch.sigmoid(g)
    dgu = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], dim=-1)  # (T, K, 2F)
    dgu_d = ref.dequantize_1x128(*ref.quantize_1x128(dgu.reshape(T * K, G))).double().reshape(T, K, G)
    dx = torch.einsum("tkg,tkgd->td", dgu_d, w13d[ids])
    order = torch.sort(ids.flatten(), stable=True).indices  # the expert-grouped rows, (token, slot) order
    off = torch.tensor([0, *torch.bincount(ids.flatten(), minlength=E).cumsum(0).tolist()])
    tok = torch.div(order, K, rounding_mode="floor")

    def q128x1(rows, idx=None):
        return ref.dequantize_128x1_grouped(*ref.quantize_128x1_grouped(rows, off, idx), off).double()

    dout_r, x_r = q128x1(dout, tok), q128x1(x, tok)
    hw_r = q128x1((h * w.double()[..., None]).reshape(T * K, F)[order])
    dgu_r = q128x1(dgu.reshape(T * K, G)[order])
    dw2 = torch.stack([dout_r[lo:hi].t() @ hw_r[lo:hi] for lo, hi in zip(off[:-1], off[1:])])
    dw13 = torch.stack([dgu_r[lo:hi].t() @ x_r[lo:hi] for lo, hi in zip(off[:-1], off[1:])])
    return dx, dw, dw13, dw2


def test_gradients_equal_the_recipe_composed_per_token():
    x, ids, w, w13, w2, _, _ = _make(**CASE, seed=6, spread=10)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    dout *= torch.exp2(torch.randint(-10, 11, (x.shape[0], 1), generator=torch.Generator().manual_seed(10)).double())
    _, g8 = _run(ref.moe_experts_fp8, x, ids, w, w13, w2, None, None, dout)
    for name, a, b in zip(("x", "topk_weights", "w13", "w2"), g8[:4], _recipe_grads(x, ids, w, w13, w2, dout)):
        tol = 1e-6 if name == "topk_weights" else 1e-10  # the routing-weight gradient is fp32
        assert (a.double() - b).abs().max() <= tol * b.abs().max(), name


def test_bf16_matches_its_fp64_accumulation_counterpart_and_repeats():
    case = _make(**CASE, seed=2, dtype=torch.bfloat16)
    dout = torch.randn(case[0].shape, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    out, grads = _run(ref.moe_experts_fp8, *case, dout)
    out64, grads64 = _run(ref.moe_experts_fp8, *case, dout, acc_dtype=torch.float64)
    again, grads_again = _run(ref.moe_experts_fp8, *case, dout)
    assert out.dtype == torch.bfloat16 and torch.equal(out, again)
    assert _rel(out, out64) < 2.0 ** -8
    for name, a, b, c in zip(NAMES, grads, grads64, grads_again):
        assert a.dtype == b.dtype and torch.isfinite(a).all() and torch.equal(a, c), name
        assert _rel(a, b) < 2.0 ** -7, f"{name}: {_rel(a, b):.3g}"


def test_expert_without_rows_gets_exact_zero_gradients_and_t0():
    x, ids, w, w13, w2, s13, s2 = _make(**CASE, seed=3)
    ids[:, 0] = torch.where(ids[:, 0] == 4, 3, ids[:, 0])
    ids[:, 1] = torch.where(ids[:, 0] == 3, 0, 3)  # distinct slots, expert 4 empty
    dout = torch.randn(x.shape, dtype=torch.float64)
    _, g = _run(ref.moe_experts_fp8, x, ids, w, w13, w2, s13, s2, dout)
    assert torch.count_nonzero(g[2][4]) == 0 and torch.count_nonzero(g[3][4]) == 0
    assert torch.count_nonzero(g[2][3]) > 0
    x0, ids0, w0 = x[:0], ids[:0], w[:0]
    out, g = _run(ref.moe_experts_fp8, x0, ids0, w0, w13, w2, s13, s2, torch.zeros(0, x.shape[1], dtype=x.dtype))
    assert out.shape == (0, x.shape[1]) and all(t.shape == p.shape for t, p in zip(g, (x0, w0, w13, w2, s13, s2)))
    assert all(torch.count_nonzero(t) == 0 for t in g)


def test_nan_in_one_token_stays_in_that_token():
    x, ids, w, w13, w2, _, _ = _make(**CASE, seed=4)
    x[5, 200] = float("nan")
    out = ref.moe_experts_fp8(x, ids, w, w13, w2)
    assert torch.isnan(out[5]).all() and torch.isfinite(out[torch.arange(out.shape[0]) != 5]).all()


@pytest.mark.parametrize("D, F", [(192, 128), (256, 64), (100, 100)])
def test_sizes_not_multiple_of_128_raise(D, F):
    x, ids, w, w13, w2, _, _ = _make(T=4, D=D, F=F, E=3, K=2, S=0)
    with pytest.raises(ValueError, match=f"multiples of 128.*D={D}, F={F}"):
        ref.moe_experts_fp8(x, ids, w, w13, w2)


def test_quantization_points_follow_the_recipe(monkeypatch):
    """Which tensors are quantized, in which layout: x, h per expert, dout and dgu per expert 1x128; w13, w2
    128x128 once; dout, hw, dgu and x 128x1 grouped (from the unquantized values, dout and x through the rows'
    token index)."""
    import megamoe.reference_fp8 as spec

    calls = []

    def spy(name):
        real = getattr(spec, name)

        def f(t, *args, **kw):
            gathered = len(args) > 1 and args[1] is not None
            calls.append((name, tuple(t.shape), t.dtype, gathered))
            return real(t, *args, **kw)
        return f

    for name in ("quantize_1x128", "quantize_128x128", "quantize_128x1_grouped"):
        monkeypatch.setattr(spec, name, spy(name))
    T, D, F, E, K = 16, 256, 128, 3, 2
    x, ids, w, w13, w2, _, _ = _make(T=T, D=D, F=F, E=E, K=K, S=0, seed=5, dtype=torch.float32)
    counts = torch.bincount(ids.flatten(), minlength=E).tolist()
    _run(ref.moe_experts_fp8, x, ids, w, w13, w2, None, None, torch.randn(T, D))
    f32 = torch.float32
    want = ([("quantize_128x128", (E, 2 * F, D), f32, False), ("quantize_128x128", (E, D, F), f32, False),
             ("quantize_1x128", (T, D), f32, False)]
            + [("quantize_1x128", (c, F), f32, False) for c in counts if c]
            + [("quantize_1x128", (T, D), f32, False)]
            + [("quantize_1x128", (c, 2 * F), f32, False) for c in counts if c]
            + [("quantize_128x1_grouped", (T, D), f32, True), ("quantize_128x1_grouped", (T * K, F), f32, False),
               ("quantize_128x1_grouped", (T * K, 2 * F), f32, False), ("quantize_128x1_grouped", (T, D), f32, True)])
    assert calls == want
