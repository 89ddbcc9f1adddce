"""The router's fused top-k selection (megamoe.functional.topk_select, one kernel forward and one backward) against
megamoe.router.route's PyTorch selection on the same scores, under the CPU interpreter.

Proves, per router shape (softmax and sigmoid scores, selection bias, group-limited routing with both group
scores, K = 1 and K = E, E not a power of two, normalised or not, a scaling factor, T not a multiple of the
kernel's token block and T = 0): the same ids bit for bit, ties included (quantized logits make many equal
scores: both pick the lower id); the weights within fp32 rounding of the K-term sum (the fused sum runs in slot
order); under nan_policy "propagate" NaN weights on exactly the tokens with a non-finite logit and no gradient
through them; the scores' gradient within fp32 rounding of autograd's through the PyTorch selection; the fused
selection is what route() runs when given ``select`` (no PyTorch sort in the forward); bad shapes refused.
"""

import dataclasses

import pytest
import torch

from interpreter import interpreted
from megamoe import get_preset
from megamoe.router import route

BASE = get_preset("tiny")
CASES = {
    "qwen3-softmax": dict(num_experts=128, top_k=8, score_func="softmax", n_group=1, topk_group=1,
                          use_expert_bias=False, routed_scaling_factor=1.0),
    "deepseek-sigmoid-groups": dict(num_experts=256, top_k=8, score_func="sigmoid", n_group=8, topk_group=4,
                                    use_expert_bias=True, routed_scaling_factor=2.5),
    "softmax-groups-max": dict(num_experts=64, top_k=6, score_func="softmax", n_group=4, topk_group=2,
                               use_expert_bias=False, routed_scaling_factor=1.0),
    "mixtral-k2": dict(num_experts=8, top_k=2, score_func="softmax", n_group=1, topk_group=1, use_expert_bias=False,
                       routed_scaling_factor=1.0),
    "k1": dict(num_experts=16, top_k=1, score_func="sigmoid", n_group=1, topk_group=1, use_expert_bias=True,
               routed_scaling_factor=1.0),
    "k-equals-e": dict(num_experts=8, top_k=8, score_func="softmax", n_group=1, topk_group=1, use_expert_bias=False,
                       routed_scaling_factor=1.0),
    "e60-unnormalised": dict(num_experts=60, top_k=4, score_func="softmax", n_group=1, topk_group=1,
                             use_expert_bias=False, routed_scaling_factor=1.0, norm_topk_prob=False),
    "glm-e160-negative-bias": dict(num_experts=160, top_k=8, score_func="sigmoid", n_group=1, topk_group=1,
                                   use_expert_bias=True, routed_scaling_factor=2.5),
}
BIAS_SHIFT = {"glm-e160-negative-bias": -3.0}  # every biased score below 0: the padded columns (0) must never win


def _cfg(name, **extra):
    return dataclasses.replace(BASE, **{**CASES[name], **extra})


def _both(cfg, logits, bias):
    from megamoe.functional import topk_select

    out = {}
    for fused in (False, True):
        lg = logits.clone().requires_grad_()
        r = route(None, None, bias, cfg, logits_TE=lg, select=topk_select if fused else None)
        out[fused] = (r, lg)
    return out


@interpreted
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("T, ties", [(37, False), (21, True), (0, False)])
def test_fused_selection_matches_route(name, T, ties):
    cfg = _cfg(name)
    E = cfg.num_experts
    g = torch.Generator().manual_seed(T + E)
    logits = torch.randn(T, E, generator=g) * 2
    if ties:  # few distinct values: many equal scores at the K-th place
        logits = logits.round()
    bias = None
    if cfg.use_expert_bias:
        bias = (torch.randn(E, generator=g) * 0.1).round(decimals=1) + BIAS_SHIFT.get(name, 0.0)
    res = _both(cfg, logits, bias)
    ref, got = res[False][0], res[True][0]
    assert got.topk_ids_TK.dtype == torch.int64 and got.topk_weights_TK.dtype == torch.float32
    assert torch.equal(got.topk_ids_TK, ref.topk_ids_TK)
    assert torch.equal(got.scores_TE, ref.scores_TE)
    torch.testing.assert_close(got.topk_weights_TK, ref.topk_weights_TK, rtol=4e-7 * cfg.top_k, atol=0)
    dw = torch.randn(T, cfg.top_k, generator=g)
    ds = torch.randn(T, E, generator=g)  # a balance loss's gradient through the scores, added by autograd
    grads = [torch.autograd.grad((r.topk_weights_TK * dw).sum() + (r.scores_TE * ds).sum(), lg)[0]
             for r, lg in (res[False], res[True])]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@interpreted
@pytest.mark.parametrize("name", ["qwen3-softmax", "deepseek-sigmoid-groups"])
def test_propagate_policy_gives_nan_weights_and_no_gradient(name):
    cfg = _cfg(name, nan_policy="propagate")
    E = cfg.num_experts
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(3))
    logits[2, 5], logits[4, 0], logits[7, E - 1] = float("nan"), float("inf"), -float("inf")
    bias = torch.zeros(E) if cfg.use_expert_bias else None
    res = _both(cfg, logits, bias)
    ref, got = res[False][0], res[True][0]
    assert torch.equal(got.topk_ids_TK, ref.topk_ids_TK)
    bad = torch.tensor([r in (2, 4, 7) for r in range(9)])
    assert got.topk_weights_TK[bad].isnan().all() and not got.topk_weights_TK[~bad].isnan().any()
    assert torch.equal(got.topk_weights_TK.isnan(), ref.topk_weights_TK.isnan())
    dw = torch.ones(9, cfg.top_k)
    grads = [torch.autograd.grad((r.topk_weights_TK * dw).nansum(), lg, allow_unused=True)[0]
             for r, lg in (res[False], res[True])]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6, equal_nan=True)


@interpreted
@pytest.mark.parametrize("case", ["inf-bias-groups", "nan-bias-groups", "zero-scores", "few-finite"])
def test_extreme_scores_and_biases(case):
    """Infinite and NaN selection biases with groups (a group's top-2 sum may be inf + -inf: NaN, ranked as -inf),
    picked scores that are all exactly zero (the divisor's + 1e-20), and fewer finite experts than K in the kept
    groups (the -inf ones picked by lower id): the same ids as the PyTorch selection, weights and gradients
    alike."""
    cfg = _cfg("deepseek-sigmoid-groups")
    E = cfg.num_experts
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(13, E, generator=g)
    bias = torch.zeros(E)
    if case == "inf-bias-groups":
        bias[::7], bias[3::11] = float("inf"), -float("inf")
    elif case == "nan-bias-groups":
        bias[::5] = float("nan")
    elif case == "zero-scores":
        logits = torch.full((13, E), -200.0)  # sigmoid(-200) is exactly 0 in fp32
    else:
        bias[E // 2:] = -float("inf")  # only the first half's experts are finite
        bias[5:E // 2] = -float("inf")  # ... and of those only 5 (< K = 8)
    res = _both(cfg, logits, bias)
    ref, got = res[False][0], res[True][0]
    assert torch.equal(got.topk_ids_TK, ref.topk_ids_TK)
    torch.testing.assert_close(got.topk_weights_TK, ref.topk_weights_TK, rtol=4e-7 * cfg.top_k, atol=0,
                               equal_nan=True)
    dw = torch.randn(13, cfg.top_k, generator=g)
    grads = [torch.autograd.grad((r.topk_weights_TK * dw).nansum(), lg)[0] for r, lg in (res[False], res[True])]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6, equal_nan=True)


@interpreted
def test_second_derivative_raises():
    """The fused selection is differentiable once: a backward that builds a graph for a second derivative is an
    error, not a silently wrong Hessian."""
    cfg = _cfg("qwen3-softmax")
    lg = torch.randn(5, cfg.num_experts, generator=torch.Generator().manual_seed(2)).requires_grad_()
    from megamoe.functional import topk_select

    r = route(None, None, None, cfg, logits_TE=lg, select=topk_select)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(r.topk_weights_TK.square().sum(), lg, create_graph=True)


@interpreted
def test_route_runs_the_fused_selection(monkeypatch):
    """With ``select`` route() sorts nothing (the kernel picks); without it, the PyTorch sort runs."""
    cfg = _cfg("qwen3-softmax")
    logits = torch.randn(12, cfg.num_experts, generator=torch.Generator().manual_seed(5))
    sorts = []
    real = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real(*a, **k))
    _both(cfg, logits, None)
    assert len(sorts) == 1


@interpreted
def test_bad_input_is_refused_and_unsupported_routers_fall_back():
    from megamoe.functional import topk_select
    from megamoe.ops.topk_select import topk_select as op
    from megamoe.ops.topk_select import topk_select_supported

    assert topk_select_supported(256, 8, 8) and topk_select_supported(60, 4, 1)
    assert not topk_select_supported(60, 4, 3) and not topk_select_supported(2048, 8, 1)
    assert topk_select(torch.rand(4, 60), None, None, _cfg("e60-unnormalised", n_group=3, topk_group=1)) is None
    assert topk_select(torch.rand(4, 8, dtype=torch.float64), None, None, _cfg("mixtral-k2")) is None
    with pytest.raises(ValueError, match="scores_TE"):
        op(torch.rand(4, 8, dtype=torch.float16), None, None, top_k=2)
    with pytest.raises(ValueError, match="bias_E"):
        op(torch.rand(4, 8), torch.rand(7), None, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        op(torch.rand(4, 8), None, None, top_k=9)


@pytest.mark.parametrize("E, K, n_group, topk_group, bias, check", [
    (128, 8, 1, 1, False, True), (256, 8, 8, 4, True, True), (60, 4, 1, 1, False, False)])
def test_kernels_compile_for_hopper(E, K, n_group, topk_group, bias, check):
    """Both kernels compile for sm_90 (on the CPU, no GPU needed) at the routers' shapes: Qwen3-MoE's, DeepSeek-V3's
    groups, an E that is not a power of two; registers without spills."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megamoe.bench.kernel_inventory import ptxas_report
    from megamoe.kernels.topk_select import topk_select_bwd_kernel, topk_select_fwd_kernel
    from megamoe.ops.topk_select import block_tokens

    e_pow2, k_pow2 = triton.next_power_of_2(E), max(2, triton.next_power_of_2(K))
    block_t = block_tokens(E)
    fwd_sig = dict(scores_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", ids_ptr="*i64", w_ptr="*fp32",
                   norm_ptr="*fp32", T="i32", E="i32", stride_s="i32", stride_l="i32", scale="fp32")
    fwd_const = dict(K=K, K_POW2=k_pow2, N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP_TOP2=True, HAS_BIAS=bias,
                     CHECK_LOGITS=check, NORM=True, SCALED=True, E_POW2=e_pow2, BLOCK_T=block_t)
    bwd_sig = dict(dw_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i64", norm_ptr="*fp32", ds_ptr="*fp32", T="i32",
                   E="i32", scale="fp32")
    bwd_const = dict(K=K, K_POW2=k_pow2, NORM=True, SCALED=True, FLAGGED=check, E_POW2=e_pow2, BLOCK_T=block_t)
    for kernel, sig, const in ((topk_select_fwd_kernel, fwd_sig, fwd_const),
                               (topk_select_bwd_kernel, bwd_sig, bwd_const)):
        sig = {**sig, **dict.fromkeys(const, "constexpr")}
        k = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, num_stages=1, enable_fp_fusion=True))
        spills = re.search(r"(\d+) bytes spill stores", ptxas_report(k.asm["ptx"]))
        assert spills is None or int(spills.group(1)) == 0, (kernel.__name__, spills.group(0))
