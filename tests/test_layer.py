"""megamoe.MoE (nn.Module) on the reference backend: API, errors, statistics, init; the router in the model dtype
(``router_dtype="model"``) on both backends (the fused one under the Triton interpreter)."""

import pytest
import torch
import torch.nn.functional as F

from interpreter import interpreted
from megamoe import MoE, get_preset
from megamoe import reference as ref


@pytest.fixture
def cfg():
    return get_preset("tiny").replace(dtype=torch.float32)


def test_forward_matches_functional_reference(cfg):
    m = MoE(cfg, seed=0)
    x = torch.randn(3, 5, cfg.hidden_size)
    y = m(x)
    out, r = ref.moe_layer(x.reshape(-1, cfg.hidden_size), m.router_w_ED, m.expert_bias_E, m.w13_LGD, m.w2_LDF,
                           m.shared_w13_HD, m.shared_w2_DS, cfg)
    assert torch.equal(y, out.view_as(x))
    assert torch.equal(m.last_stats.tokens_per_expert_E, ref.tokens_per_expert(r.topk_ids_TK, cfg.num_experts))
    torch.testing.assert_close(m.last_stats.aux_loss,
                               ref.seq_balance_loss(r.scores_TE, r.topk_ids_TK, 5, cfg.top_k, cfg.seq_aux_loss_coef))


def test_backward_matches_the_reference_for_every_parameter(cfg):
    # the module's gradients (main loss + aux loss) are bitwise those of the functional reference on the same
    # parameters: every parameter is reached, and through the same math
    m = MoE(cfg, seed=0)
    x = torch.randn(7, cfg.hidden_size, requires_grad=True)
    (m(x).square().sum() + m.last_stats.aux_loss).backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    xr = x.detach().clone().requires_grad_()
    out, r = ref.moe_layer(xr, params["router.w_ED"], m.expert_bias_E, params["experts.w13_LGD"],
                           params["experts.w2_LDF"], params["shared_expert.w13_HD"], params["shared_expert.w2_DS"], cfg)
    aux = ref.seq_balance_loss(r.scores_TE, r.topk_ids_TK, 7, cfg.top_k, cfg.seq_aux_loss_coef)
    assert aux.item() > 0
    (out.square().sum() + aux).backward()
    assert set(params) == {n for n, _ in m.named_parameters()}
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, params[name].grad), name
    assert torch.equal(x.grad, xr.grad)


def test_model_dtype_router_is_the_reference_and_keeps_an_fp32_weight(cfg):
    """router_dtype="model" in a bf16 layer: the router's logits are ``F.linear`` in bf16 from the fp32 weight cast
    to bf16, routing as the specification routes them, the weight and its gradient stay fp32; the whole step's
    gradients are bitwise the functional reference's; the repr names the mode."""
    cfg = cfg.replace(dtype=torch.bfloat16, router_dtype="model")
    m = MoE(cfg, seed=0)
    x = torch.randn(2, 7, cfg.hidden_size).bfloat16()
    assert m.router_w_ED.dtype == torch.float32 and "router_dtype=model" in repr(m)
    x_TD = x.reshape(-1, cfg.hidden_size)
    logits = m.router(x_TD)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, F.linear(x_TD, m.router_w_ED.bfloat16()))
    xg = x.clone().requires_grad_()
    (m(xg).float().square().sum() + m.last_stats.aux_loss).backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
    xr = x_TD.clone().requires_grad_()
    out, r = ref.moe_layer(xr, params["router.w_ED"], m.expert_bias_E, params["experts.w13_LGD"],
                           params["experts.w2_LDF"], params["shared_expert.w13_HD"], params["shared_expert.w2_DS"], cfg)
    assert torch.equal(m.last_stats.topk_ids_TK, r.topk_ids_TK)
    aux = ref.seq_balance_loss(r.scores_TE, r.topk_ids_TK, 7, cfg.top_k, cfg.seq_aux_loss_coef)
    (out.float().square().sum() + aux).backward()
    assert m.router_w_ED.grad.dtype == torch.float32
    for name, p in m.named_parameters():
        assert torch.equal(p.grad, params[name].grad), name
    assert torch.equal(xg.grad.reshape(-1, cfg.hidden_size), xr.grad)


@interpreted
def test_fused_layer_runs_the_model_dtype_router():
    """The fused layer with router_dtype="model" (bf16): its router is megamoe's model-dtype GEMM (bf16 logits,
    bitwise megamoe.functional.router_logits), its routing the specification's on those logits, and the fp32
    router weight gets an fp32 gradient within bf16 error of the reference backend's (same weights)."""
    from megamoe.functional import router_logits

    cfg = get_preset("tiny").replace(dtype=torch.bfloat16, router_dtype="model")
    fused, spec = MoE(cfg, backend="fused", seed=0), MoE(cfg, seed=0)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    x_TD = x.reshape(-1, cfg.hidden_size)
    logits = fused.router(x_TD)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, router_logits(x_TD, fused.router_w_ED, router_dtype="model"))
    for m in (fused, spec):
        (m(x).float().square().sum() + m.last_stats.aux_loss).backward()
    r = ref.route(x_TD, fused.router_w_ED, fused.expert_bias_E, cfg, logits_TE=logits)
    assert torch.equal(fused.last_stats.topk_ids_TK, r.topk_ids_TK)
    got, want = fused.router_w_ED.grad, spec.router_w_ED.grad
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # (fixed inputs with no top-k tie within bf16 rounding: both backends route alike)
    assert torch.equal(fused.last_stats.topk_ids_TK, spec.last_stats.topk_ids_TK)
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())


def test_dtype_roundtrip_and_noncontiguous(cfg):
    m = MoE(cfg.replace(dtype=torch.bfloat16), seed=1)
    x = torch.randn(cfg.hidden_size, 6).t()  # fp32, non-contiguous
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU BLAS may split work differently between calls when multi-threaded
    try:
        y = m(x)
        y_contig = m(x.contiguous())
    finally:
        torch.set_num_threads(threads)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, y_contig)


def test_bias_update_uses_accumulated_counts(cfg):
    m = MoE(cfg, seed=0)
    x = torch.randn(32, cfg.hidden_size)
    m(x)
    c1 = m.last_stats.tokens_per_expert_E.clone()
    m(x)
    expect = torch.zeros(cfg.num_experts)
    ref.update_expert_bias_(expect, 2 * c1, cfg.bias_update_rate)
    m.update_expert_bias()
    assert torch.equal(m.expert_bias_E, expect)
    assert int(m.counts_since_update_E.sum()) == 0


def test_seeded_init_is_reproducible(cfg):
    a, b = MoE(cfg, seed=3), MoE(cfg, seed=3)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.w13_LGD, MoE(cfg, seed=4).w13_LGD)


def test_state_dict_and_repr(cfg):
    m = MoE(cfg, seed=0)
    keys = set(m.state_dict())
    assert {"router.w_ED", "experts.w13_LGD", "experts.w2_LDF", "shared_expert.w13_HD", "shared_expert.w2_DS",
            "expert_bias_E"} == keys
    assert [n for n, _ in m.named_parameters()] == ["router.w_ED", "experts.w13_LGD", "experts.w2_LDF",
                                                   "shared_expert.w13_HD", "shared_expert.w2_DS"]  # earlier order
    assert (m.router_w_ED, m.w13_LGD, m.w2_LDF, m.shared_w13_HD, m.shared_w2_DS) == tuple(m.parameters())
    # a state dict from before the parameters moved into submodules (top-level keys) loads into them
    old_names = {"router.w_ED": "router_w_ED", "experts.w13_LGD": "w13_LGD", "experts.w2_LDF": "w2_LDF",
                 "shared_expert.w13_HD": "shared_w13_HD", "shared_expert.w2_DS": "shared_w2_DS"}
    old = {old_names.get(k, k): v.clone() + 1 for k, v in m.state_dict().items()}
    m2 = MoE(cfg, seed=1)
    m2.load_state_dict(old)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, old[old_names.get(k, k)]), k
    assert "E=8" in repr(m) and "backend=reference" in repr(m)
    no_shared = MoE(cfg.replace(n_shared_experts=0, shared_intermediate_size=0, use_expert_bias=False), seed=0)
    assert no_shared.shared_w13_HD is None and no_shared.expert_bias_E is None
    no_shared(torch.randn(4, cfg.hidden_size)).sum().backward()


def test_bad_inputs(cfg):
    with pytest.raises(ValueError, match="backend"):
        MoE(cfg, backend="cuda")
    with pytest.raises(TypeError, match="MoEConfig"):
        MoE({"hidden_size": 64})
    m = MoE(cfg, seed=0)
    with pytest.raises(ValueError, match="last dim must be D=64"):
        m(torch.randn(4, 32))
    with pytest.raises(TypeError, match="floating-point"):
        m(torch.ones(4, 64, dtype=torch.int64))
    bad = torch.randn(4, 64)
    bad[1, 3] = float("inf")
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        m(bad)


def test_zero_tokens(cfg):
    m = MoE(cfg, seed=0)
    x = torch.randn(0, cfg.hidden_size, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert y.shape == (0, cfg.hidden_size)
    assert m.w13_LGD.grad is not None and (m.w13_LGD.grad == 0).all()


def test_eval_forward_does_not_count(cfg):
    m = MoE(cfg, seed=0).eval()
    m(torch.randn(8, cfg.hidden_size))
    assert int(m.counts_since_update_E.sum()) == 0 and int(m.last_stats.tokens_per_expert_E.sum()) == 8 * cfg.top_k


def test_bad_setups_fail_early_and_clearly(cfg, monkeypatch):
    with pytest.raises(TypeError, match="ProcessGroup"):
        MoE(cfg, group=1)
    with pytest.raises(TypeError, match="ep_save_preact must be a bool"):
        MoE(cfg, backend="fused", ep_save_preact="yes")
    with pytest.raises(TypeError, match="ep_save_dispatched must be a bool"):
        MoE(cfg, backend="fused", ep_save_dispatched=1)
    with pytest.raises(TypeError, match="kernel_config must be a megamoe.config.KernelConfig"):
        MoE(cfg, backend="fused", kernel_config={"down": None})
    with pytest.raises(TypeError, match="ep_options must be a megamoe.config.EPOptions"):
        MoE(cfg, backend="fused", ep_options="kernel")
    with pytest.raises(ValueError, match="float64"):
        MoE(cfg.replace(dtype=torch.float64), backend="fused")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = MoE(cfg, backend="fused", seed=0)
    with pytest.raises(ValueError, match="use backend='reference' on CPU"):
        m(torch.randn(4, cfg.hidden_size))


@pytest.mark.parametrize("preact,dispatched", [(True, False), (False, True)])
def test_ep_save_switches_reach_the_ep_path(cfg, monkeypatch, preact, dispatched):
    """MoE(ep_save_preact=, ep_save_dispatched=, ep_options=, kernel_config=) hands each to moe_experts_ep
    unchanged, with the EP group (recorded through a stand-in: the fused EP path needs CUDA; its bits under each
    setting are tested in tests/test_ep_layer_interpret.py)."""
    import megamoe.functional_ep as fep
    from megamoe.config import EPOptions, GemmConfig, KernelConfig

    seen = {}

    def stand_in(x_TD, *args, group, save_preact, save_dispatched, options, kernel_config):
        seen.update(group=group, save_preact=save_preact, save_dispatched=save_dispatched, options=options,
                    kernel_config=kernel_config)
        return torch.zeros_like(x_TD)
    monkeypatch.setattr(fep, "moe_experts_ep", stand_in)
    opts, kc = EPOptions(comm_sms=16), KernelConfig({"down": GemmConfig(128, 128, 64, 8, 3)})
    experts = MoE(cfg, backend="fused", seed=0, ep_save_preact=preact, ep_save_dispatched=dispatched,
                  ep_options=opts, kernel_config=kc).experts
    experts.group = group = object()  # any group object: the stand-in only records it
    x = torch.randn(4, cfg.hidden_size)
    ids = torch.zeros(4, cfg.top_k, dtype=torch.long) + torch.arange(cfg.top_k)
    assert torch.equal(experts(x, ids, torch.full((4, cfg.top_k), 0.5)), torch.zeros_like(x))
    assert seen == dict(group=group, save_preact=preact, save_dispatched=dispatched, options=opts, kernel_config=kc)


def test_functional_fused_on_cpu_names_itself_and_the_way_out(cfg, monkeypatch):
    from megamoe.functional import moe_experts
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = MoE(cfg, seed=0)
    x = torch.randn(4, cfg.hidden_size)
    ids = torch.zeros(4, cfg.top_k, dtype=torch.long) + torch.arange(cfg.top_k)
    w = torch.full((4, cfg.top_k), 1.0 / cfg.top_k)
    with pytest.raises(ValueError, match=r"moe_experts: the fused backend runs on CUDA.*backend='reference'"):
        moe_experts(x, ids, w, m.w13_LGD.detach(), m.w2_LDF.detach())
    # the way out the message names: the reference backend, which is the specification's own function
    assert torch.equal(moe_experts(x, ids, w, m.w13_LGD.detach(), m.w2_LDF.detach(), backend="reference"),
                       ref.moe_experts(x, ids, w, m.w13_LGD.detach(), m.w2_LDF.detach()))
