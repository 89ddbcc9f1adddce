"""Router edge cases, checked against an independent per-token brute-force implementation; the router logits in
the model dtype (``MoEConfig.router_dtype="model"``): the reference is ``F.linear`` in that dtype, and megamoe's
fused GEMM (under the Triton interpreter here, on a GPU in tests/test_fused_gpu.py) matches it within PyTorch's own
error, batch invariant and repeatable bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from interpreter import interpreted
from megamoe import get_preset
from megamoe.reference import route, router_logits


def brute_route(logits_E, bias_E, cfg):
    """Per-token, list-based restatement of the DeepSeek-V3 router (independent of reference.route)."""
    E, K = cfg.num_experts, cfg.top_k
    s = torch.sigmoid(logits_E) if cfg.score_func == "sigmoid" else torch.softmax(logits_E, -1)
    sel = [float(s[e]) + (float(bias_E[e]) if bias_E is not None else 0.0) for e in range(E)]
    allowed = set(range(E))
    if cfg.n_group > 1:
        per = E // cfg.n_group
        gscore = []
        for g in range(cfg.n_group):
            vals = sorted(sel[g * per:(g + 1) * per], reverse=True)
            gscore.append(vals[0] + vals[1] if cfg.score_func == "sigmoid" else vals[0])
        kept = sorted(range(cfg.n_group), key=lambda g: (-gscore[g], g))[:cfg.topk_group]
        allowed = {e for e in range(E) if e // per in kept}
    ids = sorted(allowed, key=lambda e: (-sel[e], e))[:K]
    w = torch.stack([s[e] for e in ids])
    if cfg.norm_topk_prob:
        w = w / (w.sum() + 1e-20)
    return ids, w * cfg.routed_scaling_factor


CONFIGS = {
    "tiny-groups": get_preset("tiny"),
    "small-groups": get_preset("small"),
    "softmax-groups": get_preset("small").replace(score_func="softmax", n_group=4, topk_group=3),
    "softmax-qwen": get_preset("small").replace(score_func="softmax", n_group=1, topk_group=1,
                                                  routed_scaling_factor=1.0, use_expert_bias=False),
    "k1": get_preset("tiny").replace(top_k=1),
    "k-equals-e": get_preset("tiny").replace(top_k=8, n_group=1, topk_group=1),
    "no-norm": get_preset("tiny").replace(norm_topk_prob=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_route_matches_brute_force(name, seed):
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(seed)
    T, D, E = 13, cfg.hidden_size, cfg.num_experts
    x = torch.randn(T, D, generator=g)
    w = torch.randn(E, D, generator=g) * D ** -0.5
    bias = torch.randn(E, generator=g) * 0.1
    r = route(x, w, bias, cfg)
    logits = x @ w.t()
    assert r.topk_ids_TK.dtype == torch.int64 and r.topk_ids_TK.shape == (T, cfg.top_k)
    for t in range(T):
        ids, wt = brute_route(logits[t], bias, cfg)
        assert r.topk_ids_TK[t].tolist() == ids, f"token {t}"
        torch.testing.assert_close(r.topk_weights_TK[t], wt, rtol=1e-6, atol=1e-7)


def test_ties_go_to_lower_index():
    cfg = get_preset("small").replace(n_group=1, topk_group=1)
    x = torch.zeros(3, cfg.hidden_size)
    r = route(x, torch.randn(cfg.num_experts, cfg.hidden_size), torch.zeros(cfg.num_experts), cfg)
    assert r.topk_ids_TK.tolist() == [list(range(cfg.top_k))] * 3
    # ties between groups as well: every group equal -> the lowest groups are kept
    cfg_g = get_preset("small")
    r = route(x, torch.randn(cfg_g.num_experts, cfg_g.hidden_size), torch.zeros(cfg_g.num_experts), cfg_g)
    assert r.topk_ids_TK.tolist() == [list(range(cfg_g.top_k))] * 3
    want = torch.full((3, cfg_g.top_k), cfg_g.routed_scaling_factor / cfg_g.top_k)
    torch.testing.assert_close(r.topk_weights_TK, want)


def test_bias_changes_selection_not_weights():
    cfg = get_preset("tiny").replace(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    E, D = cfg.num_experts, cfg.hidden_size
    x, w = torch.randn(5, D), torch.randn(E, D)
    bias = torch.zeros(E)
    bias[6] = 10.0
    r = route(x, w, bias, cfg)
    assert (r.topk_ids_TK[:, 0] == 6).all()
    torch.testing.assert_close(r.topk_weights_TK, torch.sigmoid(x @ w.t()).gather(1, r.topk_ids_TK))


def test_group_limited_with_negative_scores():
    """Biased scores all negative: masked groups must use -inf (a 0 mask would wrongly win)."""
    cfg = get_preset("small")  # 16 experts, 4 groups, keep 2, top-4
    E, D = cfg.num_experts, cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, D, generator=g), torch.randn(E, D, generator=g)
    bias = -5.0 - torch.rand(E, generator=g)
    r = route(x, w, bias, cfg)
    logits = x @ w.t()
    per = E // cfg.n_group
    for t in range(9):
        ids, _ = brute_route(logits[t], bias, cfg)
        assert r.topk_ids_TK[t].tolist() == ids
        assert len({e // per for e in ids}) <= cfg.topk_group


def test_tiny_sigmoid_with_large_bias():
    cfg = get_preset("tiny").replace(n_group=1, topk_group=1)
    E, D = cfg.num_experts, cfg.hidden_size
    x = torch.ones(4, D)
    w = torch.full((E, D), -10.0)  # logits -640 -> sigmoid underflows to 0
    bias = torch.zeros(E)
    bias[3], bias[5] = 1.0, 0.5
    r = route(x, w, bias, cfg)
    assert r.topk_ids_TK.tolist() == [[3, 5]] * 4
    assert torch.isfinite(r.topk_weights_TK).all()


def test_nan_logits_raise_by_default():
    cfg = get_preset("tiny")
    x = torch.randn(4, cfg.hidden_size)
    x[2, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        route(x, torch.randn(cfg.num_experts, cfg.hidden_size), None, cfg)


def test_nan_logits_propagate_policy_keeps_ids_in_range():
    cfg = get_preset("tiny").replace(nan_policy="propagate")
    x = torch.randn(4, cfg.hidden_size)
    x[2] = float("nan")
    r = route(x, torch.randn(cfg.num_experts, cfg.hidden_size), torch.zeros(cfg.num_experts), cfg)
    assert ((r.topk_ids_TK >= 0) & (r.topk_ids_TK < cfg.num_experts)).all()
    assert torch.isnan(r.topk_weights_TK[2]).all()
    assert torch.isfinite(r.topk_weights_TK[[0, 1, 3]]).all()


def test_nan_in_one_router_row_propagates_to_every_token():
    """A NaN router weight row: the expert is never selected, but no token may silently look healthy."""
    cfg = get_preset("tiny").replace(nan_policy="propagate", n_group=1, topk_group=1)
    w = torch.randn(cfg.num_experts, cfg.hidden_size)
    w[5] = float("nan")
    r = route(torch.randn(6, cfg.hidden_size), w, torch.zeros(cfg.num_experts), cfg)
    assert (r.topk_ids_TK != 5).all() and ((r.topk_ids_TK >= 0) & (r.topk_ids_TK < cfg.num_experts)).all()
    assert torch.isnan(r.topk_weights_TK).all()


def test_router_module_is_the_spec_and_production_paths_do_not_import_the_reference():
    """megamoe.reference re-exports the router (one code for both), and importing the layer, the fused paths or
    the transformers integration does not import the specification module."""
    import subprocess
    import sys

    import megamoe.reference as ref
    import megamoe.router as router
    for name in router.__all__:
        assert getattr(ref, name) is getattr(router, name), name
    modules = ["megamoe.layer", "megamoe.functional", "megamoe.functional_ep", "megamoe.autograd",
               "megamoe.ops.ep_dispatch", "megamoe.router"]
    code = ("import importlib, importlib.util, sys\n"
            f"mods = {modules!r}\n"
            "if importlib.util.find_spec('transformers') is not None:\n"
            "    mods.append('megamoe.integrations.transformers')\n"
            "for m in mods:\n"
            "    importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('megamoe.reference'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# ---------------------------------------------------------------------------------------------------
# router logits in the model dtype (MoEConfig.router_dtype="model")
# ---------------------------------------------------------------------------------------------------
def test_model_dtype_reference_is_f_linear_and_scores_are_fp32():
    """The specification: logits ``F.linear(x, w.to(x.dtype))`` in x's dtype (the fp32 weight's gradient is the
    cast's), then the scores in fp32 from those rounded logits; "fp32" keeps the fp32 product; bad names refused."""
    cfg = get_preset("small").replace(score_func="softmax", n_group=1, topk_group=1, use_expert_bias=False,
                                      dtype=torch.bfloat16, router_dtype="model")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, cfg.hidden_size, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(cfg.num_experts, cfg.hidden_size, generator=g) * cfg.hidden_size ** -0.5).requires_grad_()
    logits = router_logits(x, w, "model")
    want = F.linear(x, w.bfloat16())
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want)
    dl = torch.randn(logits.shape, generator=g).bfloat16()
    got_g, want_g = torch.autograd.grad(logits, [x, w], dl), torch.autograd.grad(want, [x, w], dl)
    assert got_g[1].dtype == torch.float32 and all(torch.equal(a, b) for a, b in zip(got_g, want_g))
    assert router_logits(x, w).dtype == torch.float32  # the default: "fp32"
    r = route(x, w, None, cfg)
    assert r.scores_TE.dtype == r.topk_weights_TK.dtype == torch.float32
    torch.testing.assert_close(r.scores_TE, torch.softmax(want.float(), -1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="router_dtype"):
        router_logits(x, w, "bf16")


def _bf16_errors(got, torch_bf16, want64):
    """(max error of got, of PyTorch's own bf16 result, half a bf16 ulp at the largest magnitude) vs fp64."""
    scale = want64.abs().max().item()
    half_ulp = 2.0 ** (torch.tensor(max(scale, 1e-30)).log2().floor().item() - 8)
    return ((got.double() - want64).abs().max().item(), (torch_bf16.double() - want64).abs().max().item(), half_ulp)


def _fused_model_logits(x, w):
    from megamoe.functional import router_logits as fused

    return fused(x, w, router_dtype="model")


@interpreted
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_fused_model_dtype_logits_and_gradients_match_torch(w_dtype):
    """Logits, dx and dW of the fused model-dtype GEMM (bf16 x; an fp32 master weight or a bf16 one) within 2x
    PyTorch's own bf16 error against fp64 (``F.linear`` in bf16 and its autograd), plus half a bf16 ulp: the
    interpreter rounds fp32 to bf16 toward zero (the GPU to nearest). Dtypes as autograd of the reference gives.
    T = 45 (not a multiple of any block), D = 80 (not a multiple of BLOCK_K), E = 6."""
    g = torch.Generator().manual_seed(5)
    T, D, E = 45, 80, 6
    x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, D, generator=g) * D ** -0.5).to(w_dtype).requires_grad_()
    dl = torch.randn(T, E, generator=g).bfloat16()
    got = _fused_model_logits(x, w)
    got_g = torch.autograd.grad(got, [x, w], dl)
    pt = F.linear(x, w.bfloat16())
    pt_g = torch.autograd.grad(pt, [x, w], dl)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    l64 = F.linear(x64, w64)
    want_g = torch.autograd.grad(l64, [x64, w64], dl.double())
    assert got.dtype == torch.bfloat16 and got_g[0].dtype == torch.bfloat16 and got_g[1].dtype == w_dtype
    for name, a, b, c in (("logits", got, pt, l64), ("dx", got_g[0], pt_g[0], want_g[0]),
                          ("dW", got_g[1], pt_g[1], want_g[1])):
        err, err_pt, half_ulp = _bf16_errors(a, b, c)
        assert err <= 2 * err_pt + half_ulp, f"{name}: err {err:.3g} vs torch bf16 {err_pt:.3g}"


@interpreted
def test_fused_model_dtype_logits_are_batch_invariant_and_repeatable():
    """A token's logits (bf16 and fp16) are bitwise the same whatever the batch around it: row blocks of a batch of
    T = 53 against batches of 1, 17 (not multiples of any block) and 0 rows; a second call gives the same bits,
    gradients included. fp32 x: the "model" mode is bitwise the "fp32" mode."""
    from megamoe.functional import router_logits as fused

    g = torch.Generator().manual_seed(6)
    D, E = 48, 5
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(53, D, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(E, D, generator=g) * D ** -0.5).requires_grad_()
        full = _fused_model_logits(x, w)
        for lo, hi in ((7, 8), (30, 47), (53, 53)):
            part = _fused_model_logits(x[lo:hi].detach(), w.detach())
            assert part.shape == (hi - lo, E) and torch.equal(part, full[lo:hi]), (dtype, lo, hi)
        dl = torch.randn(full.shape, generator=g).to(dtype)
        grads = torch.autograd.grad(full, [x, w], dl)
        again = _fused_model_logits(x, w)
        assert torch.equal(again, full)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, [x, w], dl), grads))
        empty = x[:0].detach().requires_grad_()
        out0 = _fused_model_logits(empty, w)
        dx0, dw0 = torch.autograd.grad(out0, [empty, w], torch.zeros(0, E, dtype=dtype))
        assert out0.shape == (0, E) and dx0.shape == (0, D) and torch.equal(dw0, torch.zeros_like(w))
    x = torch.randn(19, D, generator=g).requires_grad_()
    w = (torch.randn(E, D, generator=g) * D ** -0.5).requires_grad_()
    dl = torch.randn(19, E, generator=g)
    results = []
    for mode in ("fp32", "model"):
        out = fused(x, w, router_dtype=mode)
        results.append([out, *torch.autograd.grad(out, [x, w], dl)])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match="router_dtype"):
        fused(x, w, router_dtype="bf16")


# ---------------------------------------------------------------------------------------------------
# the model-dtype weight gradient over fixed token chunks (megamoe.autograd.router_wgrad)
# ---------------------------------------------------------------------------------------------------
def test_router_wgrad_chunks_are_a_function_of_the_shapes():
    """S: a power of two, 1 for small T and for many output tiles (deepseek-v3), 8 at qwen3-30b-a3b's E 128 x
    D 2048 from T = 8192 on (8 x 64 tiles >= 2 programs per SM of a 132-SM GPU), never more as T grows."""
    from megamoe.ops import router_wgrad_chunks

    E, D = 128, 2048
    assert [router_wgrad_chunks(T, E, D) for T in (0, 1, 1000, 2047, 2048, 4096, 8192, 16384, 10 ** 6)] == \
        [1, 1, 1, 1, 2, 4, 8, 8, 8]
    assert router_wgrad_chunks(16384, 8, 4096) == 8 and router_wgrad_chunks(4096, 256, 7168) == 1
    assert router_wgrad_chunks(16384, 128, 4096) == 4 and router_wgrad_chunks(16384, 0, 2048) == 1


@interpreted
def test_router_wgrad_over_token_chunks(monkeypatch):
    """dW = dlogits^T @ x in bf16 over S fixed token chunks (fp32 partials summed in chunk order, one cast) within
    2x PyTorch's own bf16 error against fp64 plus half a bf16 ulp (the interpreter truncates to bf16), bitwise
    repeatable; T not a multiple of S, T < S (empty chunks), T = 0 (exact zeros), S = 1; the chunk offsets; and
    the autograd backward of the model-dtype router takes this path with S = ops.router_wgrad_chunks."""
    import megamoe.autograd as ag
    from megamoe.functional import router_logits as fused
    from megamoe.ops import chunk_offsets

    assert chunk_offsets(45, 4, "cpu").tolist() == [0, 12, 24, 36, 45]
    assert chunk_offsets(3, 5, "cpu").tolist() == [0, 1, 2, 3, 3, 3]
    assert chunk_offsets(0, 3, "cpu").tolist() == [0, 0, 0, 0]
    assert chunk_offsets(64, 2, "cpu").tolist() == [0, 32, 64]
    g = torch.Generator().manual_seed(7)
    D, E = 40, 6
    for T, S in ((45, 4), (45, 1), (64, 2), (3, 5), (0, 3)):
        x = torch.randn(T, D, generator=g).bfloat16()
        dl = torch.randn(T, E, generator=g).bfloat16()
        got = ag.router_wgrad(dl, x, chunks=S)
        assert got.dtype == torch.bfloat16 and got.shape == (E, D)
        assert torch.equal(ag.router_wgrad(dl, x, chunks=S), got), (T, S)
        want64 = dl.double().t() @ x.double()
        if T == 0:
            assert torch.equal(got, torch.zeros(E, D, dtype=torch.bfloat16))
            continue
        err, err_pt, half_ulp = _bf16_errors(got, dl.t() @ x, want64)
        assert err <= 2 * err_pt + half_ulp, f"T {T}, S {S}: err {err:.3g} vs torch bf16 {err_pt:.3g}"
    calls, offsets = [], ag.chunk_offsets
    monkeypatch.setattr(ag, "router_wgrad_chunks", lambda t, e, d: 3)
    monkeypatch.setattr(ag, "chunk_offsets", lambda t, s, dev: calls.append((t, s)) or offsets(t, s, dev))
    x = torch.randn(29, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, D, generator=g) * D ** -0.5).bfloat16().requires_grad_()
    dl = torch.randn(29, E, generator=g).bfloat16()
    dw = torch.autograd.grad(fused(x, w, router_dtype="model"), [w], dl)[0]
    assert calls == [(29, 3)] and torch.equal(dw, ag.router_wgrad(dl, x.detach(), chunks=3))


@interpreted
def test_router_gemms_take_their_tiles_from_the_host(monkeypatch):
    """Forward and backward of the router GEMM (both modes) build the m-tile offsets of their one group [0, T]
    from T on the host (no tile-offsets kernel) and make those offsets once, in the forward."""
    import megamoe.autograd as ag
    import megamoe.ops.routing as rt
    from megamoe.functional import router_logits as fused

    kernels, groups = [], []
    real_tiles, real_group = rt.tile_offsets_for, ag.single_group_offsets
    monkeypatch.setattr(rt, "tile_offsets_for", lambda *a, **kw: kernels.append(1) or real_tiles(*a, **kw))
    monkeypatch.setattr(ag, "single_group_offsets", lambda *a, **kw: groups.append(1) or real_group(*a, **kw))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(21, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(6, 32, generator=g) * 32 ** -0.5).requires_grad_()
    for mode in ("fp32", "model"):
        out = fused(x, w, router_dtype=mode)
        torch.autograd.grad(out, [x, w], torch.randn(out.shape, generator=g).to(out.dtype))
    assert kernels == [] and len(groups) == 2
