"""The reference layer: gradients (float64 gradcheck), combine order, losses and statistics."""

import pytest
import torch

from megamoe import get_preset
from megamoe import reference as ref
from megamoe.validation import check_expert_inputs


def make_params(cfg, T, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    D, F, E, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.shared_intermediate_size
    p = dict(
        x_TD=torch.randn(T, D, generator=g, dtype=dtype),
        router_w_ED=torch.randn(E, D, generator=g, dtype=torch.float64) * D ** -0.5,
        w13_EGD=torch.randn(E, 2 * F, D, generator=g, dtype=dtype) * D ** -0.5,
        w2_EDF=torch.randn(E, D, F, generator=g, dtype=dtype) * F ** -0.5,
        shared_w13_HD=torch.randn(2 * S, D, generator=g, dtype=dtype) * D ** -0.5 if S else None,
        shared_w2_DS=torch.randn(D, S, generator=g, dtype=dtype) * S ** -0.5 if S else None,
    )
    return p


def small_cfg(**kw):
    return get_preset("tiny").replace(hidden_size=8, moe_intermediate_size=4, dtype=torch.float64,
                                      **{"num_experts": 4, "n_group": 2, "topk_group": 1, **kw})


@pytest.mark.parametrize("kw", [dict(), dict(top_k=1), dict(top_k=4, n_group=1, topk_group=1),
                                dict(score_func="softmax", n_shared_experts=0, shared_intermediate_size=0)])
def test_gradcheck_full_layer(kw):
    cfg = small_cfg(**kw)
    p = make_params(cfg, T=6)
    names = [k for k, v in p.items() if v is not None]
    for k in names:
        p[k].requires_grad_(True)
    bias = torch.zeros(cfg.num_experts, dtype=torch.float64)

    def f(*tensors):
        q = dict(zip(names, tensors))
        out, _ = ref.moe_layer(q["x_TD"], q["router_w_ED"], bias, q["w13_EGD"], q["w2_EDF"],
                               q.get("shared_w13_HD"), q.get("shared_w2_DS"), cfg)
        return out

    assert torch.autograd.gradcheck(f, tuple(p[k] for k in names), eps=1e-6, atol=1e-6)


def test_gradcheck_experts_with_topk_weights():
    cfg = small_cfg()
    p = make_params(cfg, T=5)
    ids = torch.tensor([[0, 1], [1, 0], [3, 1], [1, 3], [0, 3]])  # expert 2 gets no tokens
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    for k in ("x_TD", "w13_EGD", "w2_EDF", "shared_w13_HD", "shared_w2_DS"):
        p[k].requires_grad_(True)
    f = lambda x, w_, a, b, c, d: ref.moe_experts(x, ids, w_, a, b, c, d)  # noqa: E731
    args = (p["x_TD"], w, p["w13_EGD"], p["w2_EDF"], p["shared_w13_HD"], p["shared_w2_DS"])
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)
    f(*args).sum().backward()
    assert (p["w13_EGD"].grad[2] == 0).all() and (p["w2_EDF"].grad[2] == 0).all()


def test_routed_experts_matches_dense_loop():
    """Each (token, slot) row equals the expert applied to that token alone."""
    cfg = small_cfg()
    p = make_params(cfg, T=7)
    ids = torch.randint(0, cfg.num_experts, (7, 2))
    y = ref.routed_experts(p["x_TD"], ids, p["w13_EGD"], p["w2_EDF"])
    for t in range(7):
        for k in range(2):
            e = ids[t, k]
            h = torch.nn.functional.silu(p["x_TD"][t] @ p["w13_EGD"][e, :4].T) * (p["x_TD"][t] @ p["w13_EGD"][e, 4:].T)
            torch.testing.assert_close(y[t, k], h @ p["w2_EDF"][e].T)


def test_combine_is_fp32_slot_ordered_single_cast():
    torch.manual_seed(0)
    y = torch.randn(4, 3, 16).to(torch.bfloat16)
    w = torch.rand(4, 3)
    sh = torch.randn(4, 16).to(torch.bfloat16)
    out = ref.combine(y, w, sh, torch.bfloat16)
    acc = torch.zeros(4, 16)
    for k in range(3):
        acc = acc + w[:, k:k + 1] * y[:, k].float()
    assert torch.equal(out, (acc + sh.float()).to(torch.bfloat16))


def test_tokens_per_expert_and_losses():
    T, E, K, S = 12, 6, 2, 4
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(T, E, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    counts = ref.tokens_per_expert(ids, E)
    assert counts.dtype == torch.int64 and counts.tolist() == [int((ids == e).sum()) for e in range(E)]
    # sequence-wise balance loss, written out per sequence
    coef = 0.01
    expect = 0.0
    for b in range(T // S):
        sl = slice(b * S, (b + 1) * S)
        f = torch.tensor([E / (K * S) * float((ids[sl] == e).any(-1).sum()) for e in range(E)])
        P = (scores[sl] / scores[sl].sum(-1, keepdim=True)).mean(0)
        expect += coef * float((f * P).sum())
    assert ref.seq_balance_loss(scores, ids, S, K, coef).item() == pytest.approx(expect / (T // S), rel=1e-6)
    fE = counts.float() / (T * K)
    P = (scores / scores.sum(-1, keepdim=True)).mean(0)
    assert ref.load_balance_loss(scores, ids).item() == pytest.approx(float(E * (fE * P).sum()), rel=1e-6)
    with pytest.raises(ValueError, match="multiple of seq_len"):
        ref.seq_balance_loss(scores, ids, 5, K, coef)


def test_bias_update_rule():
    bias = torch.zeros(4)
    ref.update_expert_bias_(bias, torch.tensor([10, 2, 4, 4]), 0.5)
    assert bias.tolist() == [-0.5, 0.5, 0.5, 0.5]


def test_zero_tokens():
    cfg = small_cfg()
    p = make_params(cfg, T=0)
    out, r = ref.moe_layer(p["x_TD"], p["router_w_ED"], None, p["w13_EGD"], p["w2_EDF"],
                           p["shared_w13_HD"], p["shared_w2_DS"], cfg)
    assert out.shape == (0, cfg.hidden_size) and r.topk_ids_TK.shape == (0, cfg.top_k)


def test_non_contiguous_input():
    cfg = small_cfg()
    p = make_params(cfg, T=6)
    x_nc = torch.randn(cfg.hidden_size, 6, dtype=torch.float64).t()
    assert not x_nc.is_contiguous()
    a, _ = ref.moe_layer(x_nc, p["router_w_ED"], None, p["w13_EGD"], p["w2_EDF"], None, None, cfg)
    b, _ = ref.moe_layer(x_nc.contiguous(), p["router_w_ED"], None, p["w13_EGD"], p["w2_EDF"], None, None, cfg)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # BLAS may take another path for strided x


def test_validation_errors():
    cfg = small_cfg()
    p = make_params(cfg, T=3)
    ids = torch.zeros(3, 2, dtype=torch.int64)
    w = torch.ones(3, 2)
    args = [p["x_TD"], ids, w, p["w13_EGD"], p["w2_EDF"]]
    check_expert_inputs(*args)
    with pytest.raises(ValueError, match="out of range"):
        check_expert_inputs(p["x_TD"], ids + 4, w, p["w13_EGD"], p["w2_EDF"])
    with pytest.raises(ValueError, match="out of range"):
        check_expert_inputs(p["x_TD"], ids - 1, w, p["w13_EGD"], p["w2_EDF"])
    check_expert_inputs(p["x_TD"], ids + 4, w, p["w13_EGD"], p["w2_EDF"], check_ids=False)  # the caller's word
    with pytest.raises(ValueError, match="2-D"):
        check_expert_inputs(p["x_TD"][None], ids, w, p["w13_EGD"], p["w2_EDF"])
    with pytest.raises(TypeError, match="dtype mismatch"):
        check_expert_inputs(p["x_TD"].float(), ids, w, p["w13_EGD"], p["w2_EDF"])
    with pytest.raises(ValueError, match="weight shapes disagree"):
        check_expert_inputs(p["x_TD"], ids, w, p["w13_EGD"][:, :5], p["w2_EDF"])
    with pytest.raises(ValueError, match="must match topk_ids"):
        check_expert_inputs(p["x_TD"], ids, w[:, :1], p["w13_EGD"], p["w2_EDF"])
    with pytest.raises(TypeError, match="int32/int64"):
        check_expert_inputs(p["x_TD"], ids.float(), w, p["w13_EGD"], p["w2_EDF"])
    with pytest.raises(ValueError, match="both shared"):
        check_expert_inputs(*args, p["shared_w13_HD"], None)
