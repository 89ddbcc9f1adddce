"""The fused single-GPU MoE path on a CUDA GPU (bf16), against megamoe.reference.

Proves: forward and every gradient within 2x PyTorch's own bf16 error (vs an fp64 reference, + a tiny
absolute term) on scaled-down presets and edge cases (expert with no tokens -> exact zero weight
gradient, all tokens on one expert, T = 0, T = 1, T not a multiple of any block, K = 1, K = E, D = 64 and
D = 7168, non-contiguous input); routing plan bitwise equal to a torch construction; NaN-poisoned output
buffers fully overwritten; 50 repeated fwd + bwd bitwise equal; batch invariance (a token's output and
input gradients do not depend on the rest of the batch); no host sync (set_sync_debug_mode("error"));
CUDA-graph capture + replay bitwise equal to eager; router logits (fp32 of bf16 x as bf16 GEMMs of exact bf16
pieces: within fp32's accuracy, not TF32's; in the model dtype on tensor cores: within PyTorch's bf16 error; both
batch invariant and independent of the tiles around BLOCK_K).

Run: python -m pytest tests/test_fused_gpu.py -q   (skipped without a CUDA GPU)
"""

import pytest
import torch

from megamoe import reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
NAMES = ("out", "x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2")


def _make(T, D, F, E, K, S, *, seed=0, ids=None, dtype=BF16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, generator=g, device=DEV).to(dtype)
    if ids is None:
        scores = torch.rand(T, E, generator=g, device=DEV)
        ids = scores.topk(K, dim=1).indices
    w = torch.softmax(torch.randn(T, K, generator=g, device=DEV), dim=-1) * 2.5
    w13 = (torch.randn(E, 2 * F, D, generator=g, device=DEV) / D ** 0.5).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g, device=DEV) / F ** 0.5).to(dtype)
    s13 = (torch.randn(2 * S, D, generator=g, device=DEV) / D ** 0.5).to(dtype) if S else None
    s2 = (torch.randn(D, S, generator=g, device=DEV) / S ** 0.5).to(dtype) if S else None
    return x, ids, w, w13, w2, s13, s2


def _run(fn, x, ids, w, w13, w2, s13, s2, dout):
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in (x, w, w13, w2, s13, s2)]
    out = fn(params[0], ids, *params[1:])
    live = [p for p in params if p is not None]
    it = iter(torch.autograd.grad(out, live, dout))
    return [out.detach()] + [next(it) if p is not None else None for p in params]


def _fused(*args, kernel_config=None):
    from megamoe.functional import moe_experts
    return moe_experts(*args, backend="fused", kernel_config=kernel_config)


def _check(case, *, x_view=None, seed=7):
    x, ids, w, w13, w2, s13, s2 = case
    dout = torch.randn(x.shape, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(x.dtype)
    got = _run(_fused, x if x_view is None else x_view, ids, w, w13, w2, s13, s2, dout)
    up = lambda t: t.double() if t is not None else None  # noqa: E731
    r64 = _run(reference.moe_experts, up(x), ids, up(w), up(w13), up(w2), up(s13), up(s2), dout.double())
    rpt = _run(reference.moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    for name, a, b64, bpt in zip(NAMES, got, r64, rpt):
        if b64 is None:
            continue
        assert a.shape == b64.shape and a.dtype == bpt.dtype, name
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        if a.numel() == 0:
            continue
        err = (a.double() - b64).abs().max().item()
        err_pt = (bpt.double() - b64).abs().max().item()
        scale = b64.abs().max().item()
        assert err <= 2 * err_pt + 1e-3 * scale + 1e-6, \
            f"{name}: err {err:.3g} vs torch bf16 {err_pt:.3g} (max {scale:.3g})"
        rel = (a.double() - b64).norm() / b64.norm().clamp_min(1e-30)
        rel_pt = (bpt.double() - b64).norm() / b64.norm().clamp_min(1e-30)
        assert rel <= 2 * rel_pt + 1e-4, f"{name}: rel rms {rel:.3g} vs torch {rel_pt:.3g}"
    return got


CASES = {
    "small-T300-D256-F128-E16-K4-S128": (300, 256, 128, 16, 4, 128),
    "qwen-like-T257-D2048-F768-E16-K8": (257, 2048, 768, 16, 8, 0),
    "dsv3-like-T70-D7168-F256-E8-K2-S256": (70, 7168, 256, 8, 2, 256),
    "D64-T45-F32-E8-K2-S32": (45, 64, 32, 8, 2, 32),
    "T1": (1, 256, 128, 8, 2, 64),
    "K1": (133, 256, 128, 8, 1, 0),
    "KE": (77, 256, 128, 4, 4, 64),
}


@pytest.mark.parametrize("shape", list(CASES.values()), ids=list(CASES))
def test_fused_matches_reference(shape):
    _check(_make(*shape))


def test_expert_with_no_tokens_zero_grad():
    x, ids, w, w13, w2, s13, s2 = _make(200, 256, 128, 8, 2, 0, seed=1)
    ids = torch.where(ids == 5, torch.where(ids[:, :1] == 6, 7, 6).expand_as(ids), ids)
    got = _check((x, ids, w, w13, w2, s13, s2))
    assert torch.count_nonzero(got[3][5]) == 0 and torch.count_nonzero(got[4][5]) == 0


def test_all_tokens_on_one_expert():
    ids = torch.full((300, 1), 2, device=DEV)
    _check(_make(300, 256, 128, 4, 1, 64, seed=2, ids=ids))


def test_zero_tokens():
    x, ids, w, w13, w2, s13, s2 = _make(0, 256, 128, 4, 2, 64)
    got = _run(_fused, x, ids, w, w13, w2, s13, s2, torch.zeros(0, 256, device=DEV, dtype=BF16))
    assert got[0].shape == (0, 256)
    for g, p in zip(got[1:], (x, w, w13, w2, s13, s2)):
        assert g.shape == p.shape and torch.count_nonzero(g) == 0


def test_non_contiguous_input():
    case = _make(150, 256, 128, 8, 2, 64, seed=3)
    big = torch.zeros(256, 300, device=DEV, dtype=BF16)
    big[:, ::2] = case[0].t()
    _check(case, x_view=big[:, ::2].t())


def test_routing_plan_exact():
    from megamoe.ops import build_routing_plan
    g = torch.Generator(device=DEV).manual_seed(4)
    for T, K, E in ((0, 2, 8), (1, 1, 4), (1000, 8, 128), (4097, 6, 256)):
        ids = torch.randint(0, E, (T, K), generator=g, device=DEV)
        if T > 10:
            ids[:, 0] = 3
            ids[ids == 7] = 0
        plan = build_routing_plan(ids, E, token_offset=5)
        N = T * K
        key = ids.reshape(-1).cpu() * max(N, 1) + torch.arange(N)
        order = torch.argsort(key)
        counts = torch.bincount(ids.reshape(-1).cpu(), minlength=E)
        want = dict(counts_E=counts, offsets_E1=torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]),
                    row_src_N=order, row_token_N=order // K + 5, row_slot_N=order % K,
                    row_of_TK=torch.empty(N, dtype=torch.int64).scatter_(0, order, torch.arange(N)).view(T, K))
        for name, v in want.items():
            got = getattr(plan, name)
            assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), v), name


def test_poisoned_outputs_overwritten():
    from megamoe.ops import build_routing_plan, down_proj, gate_up_swiglu, grouped_mm_nn, k_grouped_mm, swiglu_dgrad
    x, ids, w, w13, w2, _, _ = _make(333, 256, 192, 8, 3, 0, seed=5)
    plan = build_routing_plan(ids, 8)
    N = ids.numel()
    nan = lambda *s: torch.full(s, float("nan"), device=DEV, dtype=BF16)  # noqa: E731
    h, gu = nan(N, 192), nan(N, 384)
    gate_up_swiglu(x, w13, plan.offsets_E1, gather_idx_R=plan.row_token_N, out=h, preact_out=gu)
    y = down_proj(h, w2, plan.offsets_E1, out=nan(N, 256))
    dw = k_grouped_mm(y, x, plan.offsets_E1, q_idx_R=plan.row_token_N, out=nan(8, 256, 256))
    dgu, hs, part = swiglu_dgrad(x, w2, plan.offsets_E1, gu, gather_idx_R=plan.row_token_N)
    dx = grouped_mm_nn(dgu, w13, plan.offsets_E1, out=nan(N, 256))
    for t in (h, gu, y, dw, dgu, hs, part, dx):
        assert torch.isfinite(t).all()


def test_deterministic_50_runs():
    case = _make(1024, 512, 256, 16, 4, 256, seed=6)
    dout = torch.randn(1024, 512, device=DEV).to(BF16)
    first = _run(_fused, *case, dout)
    for _ in range(49):
        again = _run(_fused, *case, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_batch_invariance():
    x, ids, w, w13, w2, s13, s2 = _make(700, 512, 256, 16, 4, 128, seed=8)
    dout = torch.randn(700, 512, device=DEV).to(BF16)
    full = _run(_fused, x, ids, w, w13, w2, s13, s2, dout)
    for sub in (slice(0, 1), slice(13, 300), slice(299, 700)):
        part = _run(_fused, x[sub], ids[sub], w[sub], w13, w2, s13, s2, dout[sub])
        for i in range(3):  # out, dx, dw: per-token results, bitwise independent of the batch
            assert torch.equal(part[i], full[i][sub]), (NAMES[i], sub)


def test_no_host_sync():
    case = _make(512, 256, 128, 8, 2, 64, seed=9)
    dout = torch.randn(512, 256, device=DEV).to(BF16)
    _run(_fused, *case, dout)  # compile / warm up
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in (case[0],) + case[2:]]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _fused(params[0], case[1], *params[1:])
        out.backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_graph_replay_matches_eager():
    x, ids, w, w13, w2, s13, s2 = _make(384, 256, 128, 8, 2, 64, seed=10)
    dout = torch.randn(384, 256, device=DEV).to(BF16)
    eager = _run(_fused, x, ids, w, w13, w2, s13, s2, dout)
    params = [p.detach().clone().requires_grad_() for p in (x, w, w13, w2, s13, s2)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out = _fused(params[0], ids, *params[1:])
            grads = torch.autograd.grad(out, params, dout)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _fused(params[0], ids, *params[1:])
        grads = torch.autograd.grad(out, params, dout)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[0])
        assert all(torch.equal(g, e) for g, e in zip(grads, eager[1:]))


@pytest.mark.parametrize("w_dtype", [torch.float32, BF16], ids=["fp32-weight", "bf16-weight"])
@pytest.mark.parametrize("T,D,E", [(333, 2048, 128), (77, 7168, 256), (4099, 2048, 128)])
def test_router_logits(T, D, E, w_dtype):
    """The fp32 router of bf16 x (bf16 GEMMs of exact three-piece bf16 splits of the fp32 operands; a bf16 weight as
    itself): logits, dx and dW each with a max error against fp64 of at most 4x the larger of cuBLAS's IEEE fp32
    error and its tensor-core error on the leading pieces (cuBLAS with TF32 on the bf16-rounded operands, whose
    products TF32 holds exactly: the same exact products, accumulated in the tensor cores' fp32, which on Hopper is
    not IEEE round-to-nearest; cuBLAS's own instruction shape, tiles and split-K make its chains differ from
    megamoe's, so the factor 4 is the margin, not a derived constant), plus the dropped piece products' bound
    (2^-22 of the sum of |products|; dx, and dW of a bf16 weight, also half a bf16 ulp, their one cast); with an
    fp32 weight the unrounded results below 1/8 of cuBLAS's TF32 error on the fp32 operands (not TF32's accuracy);
    a token's logits bitwise the same in any batch; bitwise repeatable. dW over 2 token chunks at T = 4099."""
    from megamoe.functional import router_logits
    g = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(T, D, generator=g, device=DEV).to(BF16).requires_grad_()
    rw = torch.randn(E, D, generator=g, device=DEV).to(w_dtype).requires_grad_()
    dl = torch.randn(T, E, generator=g, device=DEV)
    lg = router_logits(x, rw)
    gx, gw = torch.autograd.grad(lg, [x, rw], dl)
    assert (lg.dtype, gx.dtype, gw.dtype) == (torch.float32, BF16, w_dtype)
    x64, rw64, dl64 = x.detach().double(), rw.detach().double(), dl.double()
    want = {"logits": x64 @ rw64.t(), "dx": dl64 @ rw64, "dW": dl64.t() @ x64}
    mass = {"logits": x64.abs() @ rw64.abs().t(), "dx": dl64.abs() @ rw64.abs(), "dW": dl64.abs().t() @ x64.abs()}
    x32, old = x.detach().float(), torch.backends.cuda.matmul.allow_tf32
    w32, w_hi, dl_hi = rw.detach().float(), rw.detach().to(BF16).float(), dl.to(BF16).float()
    cublas = {}
    try:
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            cublas[tf32] = {"logits": x32 @ w32.t(), "dx": dl @ w32, "dW": dl.t() @ x32}
        # the leading pieces' products on the tensor cores (exact in TF32) against fp64 of the same operands
        tensor_cores = {"logits": (x32 @ w_hi.t(), x64 @ w_hi.double().t()), "dx": (dl_hi @ w_hi, dl_hi.double() @
                        w_hi.double()), "dW": (dl_hi.t() @ x32, dl_hi.double().t() @ x64)}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    for name, got in (("logits", lg), ("dx", gx), ("dW", gw)):
        err = (got.double() - want[name]).abs().max().item()
        ieee, tf32 = ((cublas[t][name].double() - want[name]).abs().max().item() for t in (False, True))
        tc = (tensor_cores[name][0].double() - tensor_cores[name][1]).abs().max().item()
        bound = 4 * max(ieee, tc) + 2 ** -22 * mass[name].max().item()
        rounded = name == "dx" or (name == "dW" and w_dtype == BF16)
        if rounded:  # rounded once to bf16: plus half a bf16 ulp (at most 2^-8 of the value)
            bound += 2 ** -8 * want[name].abs().max().item()
        assert err <= bound, (f"{name}: max error {err:.3g} > {bound:.3g} (cuBLAS IEEE fp32 {ieee:.3g}, tensor cores "
                              f"{tc:.3g})")
        if not rounded and w_dtype == torch.float32:
            assert err < tf32 / 8, f"{name}: max error {err:.3g} is not far below TF32's {tf32:.3g}"
    assert torch.equal(router_logits(x[T // 3:T // 3 + 17], rw), lg[T // 3:T // 3 + 17])  # batch invariant
    again = router_logits(x, rw)
    assert torch.equal(again, lg)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, [x, rw], dl), (gx, gw)))


def test_split_bf16x3_matches_torch_rounding_and_is_exact():
    """On the GPU the pieces round to nearest even (hi is torch's own bf16 cast, bitwise) and add up to x exactly
    for fp32 values from 2^-100 to 2^100 in magnitude; subnormal x keeps hi + mid + lo within 2^-133 of x."""
    from megamoe.ops import split_bf16x3
    g = torch.Generator(device=DEV).manual_seed(21)
    x = torch.randn(300, 257, generator=g, device=DEV)
    x = x * torch.exp2(torch.randint(-80, 100, x.shape, generator=g, device=DEV).float())
    p = split_bf16x3(x, ("hi", "mid", "lo"), along="rows").view(3, *x.shape)
    assert torch.equal(p[0], x.to(BF16))
    assert torch.equal((p[0].float() + p[1].float()) + p[2].float(), x)
    tiny = torch.randn(64, 64, generator=g, device=DEV) * 2.0 ** -130
    q = split_bf16x3(tiny, ("hi", "mid", "lo"), along="cols").view(64, 3, 64).float()
    assert ((q.sum(1) - tiny).abs() <= 2.0 ** -133).all()


_IEEE_TILES = [(64, 64, 32, 4, 3), (32, 64, 32, 4, 3), (32, 32, 32, 2, 2), (128, 64, 32, 8, 3, 2),
               (64, 128, 32, 4, 3, 2)]


@pytest.mark.parametrize("T,D,E", [(1000, 2048, 128), (333, 512, 256)])  # few dW outputs; more
def test_router_bits_do_not_depend_on_tile(monkeypatch, T, D, E):
    """The fp32 router's three GEMMs (logits, dx, dW) give bitwise the same logits and gradients whatever the tiles
    around the table's BLOCK_K: the IEEE fp32 FMA GEMMs of fp32 x (also the fp32 experts' path; block sizes,
    warps, stages, programs per SM) and the bf16-piece GEMMs of bf16 x (ops.tile_config.router_kernel_config's
    entries for the 3E and 6E pieces, TMA or pointer loads), so both tables can change for speed without changing
    results."""
    import megamoe.autograd as ag
    import megamoe.ops.grouped_gemm as gg
    from megamoe.config import GemmConfig as G
    from megamoe.config import KernelConfig
    from megamoe.functional import router_logits

    g = torch.Generator(device=DEV).manual_seed(12)
    rw = (torch.randn(E, D, generator=g, device=DEV) * D ** -0.5).requires_grad_()
    dl = torch.randn(T, E, generator=g, device=DEV)
    m_table, k_table = gg.m_grouped_config, gg.k_grouped_config
    for dtype in (torch.float32, BF16):
        x = torch.randn(T, D, generator=g, device=DEV).to(dtype).requires_grad_()

        def run(x=x):
            lg = router_logits(x, rw)
            return (lg, *torch.autograd.grad(lg, [x, rw], dl))
        base = run()
        if dtype == torch.float32:
            for tile in _IEEE_TILES:
                cfg = G(*tile[:5], programs_per_sm=tile[5] if len(tile) > 5 else 1)
                monkeypatch.setattr(gg, "m_grouped_config", lambda *a, _c=cfg, **kw: _c if a[3] == torch.float32
                                    else m_table(*a, **kw))
                monkeypatch.setattr(gg, "k_grouped_config", lambda *a, _c=cfg, **kw: _c if a[2] == torch.float32
                                    else k_table(*a, **kw))
                for name, a, b in zip(("logits", "dx", "dW"), run(), base):
                    assert torch.equal(a, b), f"router {name} (IEEE fp32) changed bits under tile {tile}"
            monkeypatch.setattr(gg, "m_grouped_config", m_table)
            monkeypatch.setattr(gg, "k_grouped_config", k_table)
            continue
        for down, dgrad, wgrad in [
                (G(64, 128, 64, 4, 3), G(128, 128, 64, 8, 3), G(128, 128, 64, 8, 3)),
                (G(128, 256, 64, 8, 3, tma_b=True, tma_a=True), G(64, 256, 64, 8, 3, programs_per_sm=2),
                 G(64, 128, 64, 4, 2))]:
            kc = KernelConfig({("down", 3 * E, D): down, ("dgrad", D, 6 * E): dgrad, ("wgrad", 3 * E, D): wgrad})
            monkeypatch.setattr(ag, "router_kernel_config", lambda e, d, _kc=kc: _kc)
            for name, a, b in zip(("logits", "dx", "dW"), run(), base):
                assert torch.equal(a, b), f"router {name} (bf16 pieces) changed bits under {kc}"


@pytest.mark.parametrize("T,D,E", [(1000, 2048, 128), (333, 512, 8), (77, 7168, 256), (4099, 2048, 128),
                                   (16384, 2048, 128)])
def test_router_logits_model_dtype(T, D, E):
    """router_dtype="model" (bf16 tensor cores, fp32 accumulation): logits, dx and dW (an fp32 master weight, as
    megamoe.MoE keeps it) within 2x PyTorch's own bf16 error (autograd of ``F.linear`` in bf16, cuBLAS) against
    fp64, plus a tiny absolute term; the dtypes autograd of that reference gives; a token's logits bitwise the
    same in batches of 1, 17 (not multiples of any block), T and 4T + 5 rows; bitwise repeatable; T = 0. dW over
    token chunks (megamoe.autograd.router_wgrad): 4 uneven ones at T = 4099, 8 at T = 16384."""
    import torch.nn.functional as F

    from megamoe.functional import router_logits
    g = torch.Generator(device=DEV).manual_seed(13)
    x = torch.randn(T, D, generator=g, device=DEV).to(BF16).requires_grad_()
    rw = (torch.randn(E, D, generator=g, device=DEV) * D ** -0.5).requires_grad_()
    dl = torch.randn(T, E, generator=g, device=DEV).to(BF16)
    lg = router_logits(x, rw, router_dtype="model")
    grads = torch.autograd.grad(lg, [x, rw], dl)
    pt = F.linear(x, rw.to(BF16))
    pt_grads = torch.autograd.grad(pt, [x, rw], dl)
    x64, rw64 = x.detach().double().requires_grad_(), rw.detach().double().requires_grad_()
    l64 = F.linear(x64, rw64)
    grads64 = torch.autograd.grad(l64, [x64, rw64], dl.double())
    assert lg.dtype == grads[0].dtype == BF16 and grads[1].dtype == torch.float32
    for name, a, b, c in (("logits", lg, pt, l64), ("dx", grads[0], pt_grads[0], grads64[0]),
                          ("dW", grads[1], pt_grads[1], grads64[1])):
        err, err_pt, scale = ((a.double() - c).abs().max().item(), (b.double() - c).abs().max().item(),
                              c.abs().max().item())
        assert err <= 2 * err_pt + 1e-3 * scale, f"{name}: err {err:.3g} vs torch bf16 {err_pt:.3g} (max {scale:.3g})"
    again = router_logits(x, rw, router_dtype="model")
    assert torch.equal(again, lg)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(again, [x, rw], dl), grads))
    bigger = torch.cat([x.detach(), torch.randn(3 * T + 5, D, generator=g, device=DEV).to(BF16)])
    assert torch.equal(router_logits(bigger, rw.detach(), router_dtype="model")[:T], lg)
    for lo, hi in ((T // 2, T // 2 + 1), (T // 3, T // 3 + 17), (T, T)):
        assert torch.equal(router_logits(x[lo:hi].detach(), rw.detach(), router_dtype="model"), lg[lo:hi])


@pytest.mark.parametrize("T", [1000, 4099])
def test_router_model_dtype_bits_do_not_depend_on_tile(monkeypatch, T):
    """The router's three bf16 GEMMs (logits, dx, dW; at T = 4099 dW over 4 token chunks) give bitwise the same
    results whatever the tiles around BLOCK_K 64 (block sizes, warps, stages, TMA or pointer loads, programs per
    SM), so ops.tile_config.router_kernel_config can change for speed without changing results."""
    import megamoe.autograd as ag
    from megamoe.config import GemmConfig as G
    from megamoe.config import KernelConfig
    from megamoe.functional import router_logits

    D, E = 2048, 128
    g = torch.Generator(device=DEV).manual_seed(14)
    x = torch.randn(T, D, generator=g, device=DEV).to(BF16).requires_grad_()
    rw = (torch.randn(E, D, generator=g, device=DEV) * D ** -0.5).to(BF16).requires_grad_()
    dl = torch.randn(T, E, generator=g, device=DEV).to(BF16)

    def run():
        lg = router_logits(x, rw, router_dtype="model")
        return (lg, *torch.autograd.grad(lg, [x, rw], dl))
    base = run()
    for down, dgrad, wgrad in [
            (G(64, 128, 64, 4, 3), G(128, 128, 64, 8, 3), G(128, 128, 64, 8, 3)),
            (G(128, 256, 64, 8, 3, tma_b=True, tma_a=True), G(64, 256, 64, 8, 3, programs_per_sm=2),
             G(64, 128, 64, 4, 2)),
            (G(128, 64, 64, 4, 4, programs_per_sm=2), G(128, 128, 64, 8, 4, tma_b=True, tma_a=True),
             G(128, 64, 64, 8, 4))]:
        kc = KernelConfig({("down", E, D): down, ("dgrad", D, E): dgrad, ("wgrad", E, D): wgrad})
        monkeypatch.setattr(ag, "router_kernel_config", lambda e, d, _kc=kc: _kc)
        for name, a, b in zip(("logits", "dx", "dW"), run(), base):
            assert torch.equal(a, b), f"router {name} (bf16) changed bits under {kc}"



def test_bits_do_not_depend_on_tile_shape():
    """Every tile shape / load path (BLOCK_M 64 or 128, BLOCK_N 128 or 256, TMA or pointer loads, stages,
    programs per SM, and for the weight gradients the per-tile or the resident kernel with any number of
    chunks on chip; dgrad + SwiGLU with 128- or 256-column tiles) gives bitwise the same layer output and
    gradients as the checked-in table: only
    the K order (BLOCK_K) fixes the bits. This is what lets the table change for speed without changing
    results, and what EP = 1 == EP = W relies on."""
    import functools

    from megamoe.config import GemmConfig, KernelConfig

    T, D, F, E, K, S = 300, 256, 192, 6, 3, 128  # odd rows per expert, F not a multiple of 128
    case = _make(T, D, F, E, K, S, seed=5)
    dout = torch.randn(T, D, generator=torch.Generator(device=DEV).manual_seed(6), device=DEV).to(BF16)
    base = _run(_fused, *case, dout)
    G = GemmConfig
    variants = [
        {k: G(64, 128, 64, 4, 3, programs_per_sm=2) for k in ("gate_up", "down", "dgrad_swiglu", "dgrad")}
        | {"wgrad": G(64, 128, 64, 4, 3)},
        {k: G(128, 256, 64, 8, 4) for k in ("down", "dgrad")}
        | {k: G(128, 128, 64, 8, 4) for k in ("gate_up", "dgrad_swiglu")}
        | {"wgrad": G(128, 256, 64, 8, 2)},
        {k: G(128, 128, 64, 8, 3, tma_b=True, tma_a=True) for k in ("gate_up", "down", "dgrad_swiglu", "dgrad")}
        | {"wgrad": G(128, 128, 64, 8, 2, resident_chunks=3)},  # ~150 rows per expert: all on chip
        {"wgrad": G(128, 128, 64, 8, 2, resident_chunks=1)},  # every expert takes the in-program fallback
        {"wgrad": G(64, 128, 64, 4, 2, resident_chunks=2)},  # some experts on chip, some not
        {"wgrad": G(128, 128, 64, 8, 2)},  # per-tile kernel (the table picks the resident one here)
        {"wgrad": G(128, 128, 64, 8, 4, gluon=True)},  # persistent Gluon kernel (Hopper; else the Triton ones)
        {"wgrad": G(128, 128, 64, 8, 4, resident_chunks=2, gluon=True)},  # ~150 rows: some P on chip, some streamed
        # 256-column dgrad + SwiGLU tiles write two 128-column row-dot partials (F = 192: both in range; the
        # masked second partial, F % 256 <= 128, is checked under the interpreter, test_kernels_interpret.py)
        {"dgrad_swiglu": G(128, 256, 64, 8, 3, tma_b=True)},
        {"dgrad_swiglu": G(128, 256, 64, 8, 3)},
        {k: G(128, 256, 64, 8, 3, tma_b=True, tma_a=True) for k in ("down", "dgrad")},
    ]
    for v in variants:  # each kind's entry applies at every shape of that kind (routed and shared expert)
        got = _run(functools.partial(_fused, kernel_config=KernelConfig(v)), *case, dout)
        for name, a, b in zip(NAMES, got, base):
            assert torch.equal(a, b), f"{name} changed bits under tile variant {v}"


@pytest.mark.parametrize("name", ["qwen3", "deepseek-v3"])
def test_fused_topk_selection_matches_pytorch_and_replays_in_a_graph(name):
    """The router's fused top-k selection (megamoe.functional.topk_select) on the GPU against megamoe.router.route's
    PyTorch selection on the same scores: the same ids (ties included: quantized logits), the weights and the
    scores' gradient within fp32 rounding; bitwise repeatable; no host sync; a CUDA-graph replay bitwise equal to
    eager."""
    import dataclasses

    from megamoe import get_preset
    from megamoe.functional import topk_select
    from megamoe.router import route

    cfg = get_preset("qwen3-30b-a3b" if name == "qwen3" else "deepseek-v3")
    cfg = dataclasses.replace(cfg, nan_policy="propagate")
    E, T = cfg.num_experts, 1000
    g = torch.Generator(device=DEV).manual_seed(31)
    logits = (torch.randn(T, E, generator=g, device=DEV) * 2).round(decimals=1)
    logits[7, 3] = float("nan")
    bias = (torch.randn(E, generator=g, device=DEV) * 0.1) if cfg.use_expert_bias else None
    dw = torch.randn(T, cfg.top_k, generator=g, device=DEV)

    def run(select):
        lg = logits.clone().requires_grad_()
        r = route(None, None, bias, cfg, logits_TE=lg, select=select)
        (grad,) = torch.autograd.grad((r.topk_weights_TK * dw).nansum(), lg)
        return r.topk_ids_TK, r.topk_weights_TK, grad
    want, got = run(None), run(topk_select)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=4e-7 * cfg.top_k, atol=0, equal_nan=True)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = run(topk_select)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(again, got))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(topk_select)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(topk_select)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(captured, got))
