"""The fused single-GPU path's Triton kernels on CPU, under TRITON_INTERPRET=1, on tiny fp32 shapes.

Proves: the routing plan equals a plain-PyTorch construction bitwise (ties, empty experts, T = 0, token
offset); forward and every gradient (x, topk weights, w13, w2, shared weights) match megamoe.reference in
fp64 within 2x PyTorch's own fp32 error (+ a tiny absolute term) for edge cases (expert with no tokens ->
exact zero weight gradient, all tokens on one expert, T = 0, T = 1, T not a multiple of any block, K = 1,
K = E, non-contiguous input); NaN-poisoned output buffers are fully overwritten; results are bitwise
repeatable; the two weight-gradient kernels (per-tile, and resident with 1-4 chunks on chip and its
fallback) agree bitwise and match float64; the routing-weight row-dot partials come per 128 columns with
128- and 256-column tiles; router logits and their gradients; bad input raises a clear error.

Run: python -m pytest tests/test_kernels_interpret.py -q (each case runs in a process with TRITON_INTERPRET=1:
tests/interpreter.py).
"""

import pytest
import torch

from interpreter import interpreted
from megamoe import reference
from megamoe.functional import moe_experts, router_logits
from megamoe.ops import (
    build_routing_plan,
    chunk_sum,
    down_proj,
    gate_up_swiglu,
    grouped_mm_nn,
    k_grouped_mm,
    single_group_offsets,
    split_bf16x3,
    swiglu_dgrad,
)

NAMES = ("x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2")


def _routing_ref(ids_TK, E, token_offset=0):
    """Plain-Python plan: rows sorted by (expert, token, slot)."""
    T, K = ids_TK.shape
    rows = sorted((int(ids_TK[t, k]), t, k) for t in range(T) for k in range(K))
    counts = [0] * E
    for e, _, _ in rows:
        counts[e] += 1
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    row_of = torch.empty(T, K, dtype=torch.int32)
    for r, (_, t, k) in enumerate(rows):
        row_of[t, k] = r
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return dict(counts_E=i32(counts), offsets_E1=i32(offsets), row_src_N=i32([t * K + k for _, t, k in rows]),
                row_token_N=i32([t + token_offset for _, t, k in rows]), row_slot_N=i32([k for _, _, k in rows]),
                row_of_TK=row_of)


def _make(T, D, F, E, K, S, *, seed=0, ids=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    if ids is None:
        ids = (torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T
               else torch.zeros(0, K, dtype=torch.int64))
    w = torch.rand(T, K, generator=g, dtype=torch.float32) + 0.1
    w13 = torch.randn(E, 2 * F, D, generator=g, dtype=dtype) / D ** 0.5
    w2 = torch.randn(E, D, F, generator=g, dtype=dtype) / F ** 0.5
    s13 = torch.randn(2 * S, D, generator=g, dtype=dtype) / D ** 0.5 if S else None
    s2 = torch.randn(D, S, generator=g, dtype=dtype) / S ** 0.5 if S else None
    return x, ids, w, w13, w2, s13, s2


def _run(fn, x, ids, w, w13, w2, s13, s2, dout):
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in (x, w, w13, w2, s13, s2)]
    out = fn(params[0], ids, *params[1:])
    live = [p for p in params if p is not None]
    grads = torch.autograd.grad(out, live, dout, allow_unused=True) if out.numel() or True else None
    it = iter(grads)
    return out.detach(), [next(it) if p is not None else None for p in params]


def _check(case, *, x_view=None):
    x, ids, w, w13, w2, s13, s2 = case
    T, D = x.shape
    dout = torch.randn(T, D, generator=torch.Generator().manual_seed(7))
    xin = x if x_view is None else x_view
    out, grads = _run(moe_experts, xin, ids, w, w13, w2, s13, s2, dout)
    up = lambda t: t.double() if t is not None else None  # noqa: E731
    ref64, g64 = _run(reference.moe_experts, up(x), ids, up(w), up(w13), up(w2), up(s13), up(s2), dout.double())
    ref32, g32 = _run(reference.moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    for name, a, b64, b32 in zip(("out",) + NAMES, [out] + grads, [ref64] + g64, [ref32] + g32):
        if b64 is None:
            assert a is None
            continue
        assert a.shape == b64.shape and a.dtype == b32.dtype, name
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        err = (a.double() - b64).abs().max().item() if a.numel() else 0.0
        err_pt = (b32.double() - b64).abs().max().item() if a.numel() else 0.0
        scale = b64.abs().max().item() if a.numel() else 0.0
        assert err <= 2 * err_pt + 1e-5 * scale + 1e-12, f"{name}: err {err:.3g} vs torch fp32 {err_pt:.3g}"
    return out, grads


@interpreted
def test_routing_plan_exact():
    g = torch.Generator().manual_seed(1)
    for T, K, E, offset in ((0, 2, 4, 0), (1, 1, 3, 0), (13, 3, 5, 100), (40, 4, 8, 0)):
        ids = torch.randint(0, E, (T, K), generator=g)
        if T > 3:
            ids[:, 0] = 1  # a hot expert and ties in the sort key
            ids[ids == 2] = 0  # an empty expert
        plan = build_routing_plan(ids.to(torch.int32), E, token_offset=offset)
        for name, want in _routing_ref(ids, E, offset).items():
            got = getattr(plan, name)
            assert got.dtype == torch.int32 and torch.equal(got, want), name


@interpreted
def test_forward_backward_basic_with_shared():
    _check(_make(37, 64, 32, 8, 3, 32))


@interpreted
def test_expert_with_no_tokens_gets_exact_zero_grad():
    case = list(_make(21, 64, 32, 6, 2, 0, seed=2))
    ids = case[1]
    ids[ids == 4] = 5
    ids[:, 0] = torch.where(ids[:, 1] == 0, 1, 0)  # keep slots distinct, expert 4 empty
    case[1] = ids
    _, grads = _check(tuple(case))
    assert torch.count_nonzero(grads[2][4]) == 0 and torch.count_nonzero(grads[3][4]) == 0


@interpreted
def test_all_tokens_on_one_expert():
    ids = torch.full((19, 2), 3, dtype=torch.int64)
    _check(_make(19, 64, 32, 4, 2, 16, seed=3, ids=ids))


@interpreted
def test_single_token_and_k1_and_k_equals_e():
    _check(_make(1, 64, 32, 4, 2, 16, seed=4))
    _check(_make(17, 64, 32, 5, 1, 0, seed=5))
    _check(_make(9, 64, 32, 4, 4, 16, seed=6))


@interpreted
def test_zero_tokens():
    x, ids, w, w13, w2, s13, s2 = _make(0, 64, 32, 4, 2, 16)
    out, grads = _run(moe_experts, x, ids, w, w13, w2, s13, s2, torch.zeros(0, 64))
    assert out.shape == (0, 64)
    for gr, p in zip(grads, (x, w, w13, w2, s13, s2)):
        assert gr.shape == p.shape and torch.count_nonzero(gr) == 0


@interpreted
def test_non_contiguous_input():
    case = _make(23, 64, 32, 4, 2, 0, seed=8)
    big = torch.zeros(64, 2 * 23)
    big[:, ::2] = case[0].t()
    _check(case, x_view=big[:, ::2].t())


@interpreted
def test_odd_sizes():  # D, F, T not multiples of any block
    _check(_make(11, 40, 24, 3, 2, 8, seed=9))


@interpreted
def test_deterministic():
    # Batch invariance is checked on the GPU only: the interpreter's tl.dot is numpy's BLAS, whose
    # result for a row depends on the row's position inside the tile (wgmma's does not).
    x, ids, w, w13, w2, s13, s2 = _make(30, 32, 32, 6, 3, 16, seed=10)
    dout = torch.randn(30, 32)
    a = _run(moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    b = _run(moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    assert torch.equal(a[0], b[0]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


@interpreted
def test_tile_offsets_computed_once_per_offset_table(monkeypatch):
    # the m-grouped GEMMs of one group-offset table share its m-tile offsets (ops.grouped_gemm tile_cache):
    # forward + backward with a shared expert computes them once (the routed offsets; the shared expert's one
    # group of T rows gets its tiles from T on the host, ops.routing.single_group_offsets) instead of once per
    # GEMM (8), with the same bits
    import megamoe.ops.grouped_gemm as gg
    import megamoe.ops.routing as rt
    x, ids, w, w13, w2, s13, s2 = _make(24, 64, 32, 6, 3, 16, seed=13)
    dout = torch.randn(24, 64, generator=torch.Generator().manual_seed(4))
    real_offsets, real_launch, calls = rt.tile_offsets_for, gg._launch_m_grouped, []
    monkeypatch.setattr(rt, "tile_offsets_for", lambda *a, **kw: calls.append(1) or real_offsets(*a, **kw))
    a = _run(moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    cached_calls = len(calls)
    monkeypatch.setattr(gg, "_launch_m_grouped", lambda **kw: real_launch(**{**kw, "tile_cache": None}))
    b = _run(moe_experts, x, ids, w, w13, w2, s13, s2, dout)
    assert (cached_calls, len(calls) - cached_calls) == (1, 8)
    assert torch.equal(a[0], b[0]) and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


@interpreted
def test_poisoned_outputs_overwritten():
    x, ids, w, w13, w2, s13, s2 = _make(29, 64, 32, 5, 2, 0, seed=11)
    plan = build_routing_plan(ids, 5)
    N = 29 * 2
    h = torch.full((N, 32), float("nan"))
    gu = torch.full((N, 64), float("nan"))
    gate_up_swiglu(x, w13, plan.offsets_E1, gather_idx_R=plan.row_token_N, out=h, preact_out=gu)
    y = down_proj(h, w2, plan.offsets_E1, out=torch.full((N, 64), float("nan")))
    dw = k_grouped_mm(y, x, plan.offsets_E1, q_idx_R=plan.row_token_N, out=torch.full((5, 64, 64), float("nan")))
    dgu, hs, part = swiglu_dgrad(x, w2, plan.offsets_E1, gu, gather_idx_R=plan.row_token_N)
    dx = grouped_mm_nn(dgu, w13, plan.offsets_E1, out=torch.full((N, 64), float("nan")))
    for t in (h, gu, y, dw, dgu, hs, part, dx):
        assert torch.isfinite(t).all()
    xs = x[plan.row_token_N.long()]
    bounds = zip(plan.offsets_E1[:-1].tolist(), plan.offsets_E1[1:].tolist())
    gu_ref = torch.cat([xs[a:b] @ w13[e].t() for e, (a, b) in enumerate(bounds)])
    torch.testing.assert_close(gu, gu_ref, rtol=1e-5, atol=1e-5)


@interpreted
def test_tile_offsets_kernel_equals_the_torch_formula():
    # tile_offsets_for runs a Triton kernel (here under the interpreter): the exclusive prefix sum of
    # ceil(count / BLOCK_M) must equal the PyTorch formula exactly, with empty groups, one group, 512 groups
    from megamoe.ops import tile_offsets_for

    g = torch.Generator().manual_seed(9)
    for E in (1, 2, 5, 256, 512):
        counts = torch.randint(0, 300, (E,), generator=g)
        counts[torch.rand(E, generator=g) < 0.3] = 0
        offs = torch.zeros(E + 1, dtype=torch.int32)
        offs[1:] = torch.cumsum(counts, 0)
        for bm in (64, 128):
            ref = torch.zeros(E + 1, dtype=torch.int64)
            ref[1:] = torch.cumsum((counts + bm - 1) // bm, 0)
            got = tile_offsets_for(offs, bm)
            assert got.dtype == torch.int32 and torch.equal(got.long(), ref), (E, bm)


@interpreted
def test_single_group_tiles_from_the_host_equal_the_kernel():
    # single_group_offsets with a tile cache: the launchers' m-tile offsets of [0, T] come from T on the host
    # (one arange), the same int32 values as the kernel's, for every T (0, one row, block edges) and BLOCK_M
    from megamoe.ops import single_group_offsets, tile_offsets_for
    from megamoe.ops.routing import cached_tile_offsets

    for T in (0, 1, 15, 16, 17, 127, 128, 129, 1000):
        cache = {}
        one_2 = single_group_offsets(T, "cpu", tile_cache=cache)
        assert one_2.dtype == torch.int32 and one_2.tolist() == [0, T]
        for bm in (16, 64, 128):
            got = cached_tile_offsets(one_2, bm, cache)
            assert got.dtype == torch.int32 and torch.equal(got, tile_offsets_for(one_2, bm)), (T, bm)
            assert cached_tile_offsets(one_2, bm, cache) is got


@interpreted
def test_row_push_stores_each_row_at_its_slot_bitwise(monkeypatch):
    # RowPush (the EP path's combine from the GEMM epilogue): every row of down_proj / grouped_mm_nn lands
    # at row token*K + slot of its source's buffer (two "ranks": two buffers through an address table),
    # bitwise the row the plain output has; rows with source -1 and untouched slots stay NaN; rows past
    # the last expert are not stored; a bad push table is a clear error.
    from megamoe.ops import RowPush, row_push_deltas

    x, ids, w, w13, w2, s13, s2 = _make(23, 64, 32, 5, 2, 0, seed=13)
    plan = build_routing_plan(ids, 5)
    N, Kk, T = 46, 2, 23
    h, _ = gate_up_swiglu(x, w13, plan.offsets_E1, gather_idx_R=plan.row_token_N, save_preact=False)
    g = torch.Generator().manual_seed(5)
    src = torch.randint(0, 2, (N,), generator=g, dtype=torch.int32)
    src[7] = -1  # a row that is not stored
    tok, slot = plan.row_token_N.clone(), plan.row_slot_N.clone()
    R = N - 3  # the last three rows lie past the (shrunk) last expert
    offs = plan.offsets_E1.clone()
    offs[-1] = R
    offs[:-1] = torch.minimum(offs[:-1], torch.tensor(R, dtype=torch.int32))
    for fn, a, b, dcols in ((down_proj, h, w2, 64), (grouped_mm_nn, torch.randn(N, 64, generator=g), w13, 64)):
        plain = fn(a, b, offs)
        bufs = [torch.full((T * Kk + 5, dcols), float("nan")) for _ in range(2)]
        off_rows = 5  # each rank's destination starts 5 rows into its buffer
        dest = bufs[0][off_rows:]
        deltas = row_push_deltas(dest, [t.data_ptr() + off_rows * dcols * 4 for t in bufs])
        tab = torch.stack([src, tok, slot]).contiguous()
        push = RowPush(dest, deltas, tab, Kk)
        assert fn(a, b, offs, push=push) is None
        for r in range(N):
            dst = off_rows + int(tok[r]) * Kk + int(slot[r])
            if r < R and src[r] >= 0:
                assert torch.equal(bufs[int(src[r])][dst], plain[r]), (fn.__name__, r)
                bufs[int(src[r])][dst] = float("nan")
        for t in bufs:  # everything else untouched
            assert torch.isnan(t).all(), fn.__name__
    with pytest.raises(ValueError, match="rowtab_3C"):
        down_proj(h, w2, offs, push=RowPush(dest, deltas, tab[:, :10].contiguous(), Kk))
    with pytest.raises(TypeError, match="deltas_W"):
        down_proj(h, w2, offs, push=RowPush(dest, deltas.int(), tab, Kk))
    with pytest.raises(ValueError, match="push.dest"):
        down_proj(h, w2, offs, push=RowPush(bufs[0][:, :32], deltas, tab, Kk))
    with pytest.raises(ValueError, match="either out or push"):
        down_proj(h, w2, offs, out=torch.empty(N, 64), push=push)
    with pytest.raises(ValueError, match="multiple of 16 elements"):
        row_push_deltas(dest, [dest.data_ptr() + 4])


@interpreted
def test_swiglu_dgrad_row_dot_partials_per_128_columns(monkeypatch):
    # The routing-weight row-dot partials are written per 128 columns whatever the tile width: a
    # 256-column tile writes two, and with F = 320 the last tile's second partial lies past F and must
    # not be written (it would land on the next row's first partial). Both widths against float64,
    # within 2x torch fp32's own error of the same sums.
    from megamoe.ops import GemmConfig
    from megamoe.ops import grouped_gemm as gg

    g = torch.Generator().manual_seed(31)
    T, D, F, E, K = 13, 32, 320, 3, 2
    x = torch.randn(T, D, generator=g)
    w2 = torch.randn(E, D, F, generator=g) / F ** 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    plan = build_routing_plan(ids, E)
    R = T * K
    gu = torch.randn(R, 2 * F, generator=g)
    dy = x[plan.row_token_N.long()]
    bounds = list(zip(plan.offsets_E1[:-1].tolist(), plan.offsets_E1[1:].tolist()))

    def row_dots(dy, w2, gu):  # [R, 3] sums of acc * h over columns [0, 128), [128, 256), [256, 320)
        acc = torch.cat([dy[a:b] @ w2[e] for e, (a, b) in enumerate(bounds)])
        gate, up = gu[:, :F], gu[:, F:]
        h = gate * torch.sigmoid(gate) * up
        return torch.stack([(acc * h)[:, c:c + 128].sum(1) for c in (0, 128, 256)], 1)

    want = row_dots(dy.double(), w2.double(), gu.double())
    err_pt = (row_dots(dy, w2, gu).double() - want).abs().max().item()
    orig = gg.m_grouped_config
    for block_n in (128, 256):
        cfg = GemmConfig(16, block_n, 16, 4, 1)
        monkeypatch.setattr(gg, "m_grouped_config", lambda kind, n, k, dtype, *, interpret, cfg=cfg, **kw:
                            cfg if kind == "dgrad_swiglu" else orig(kind, n, k, dtype, interpret=interpret, **kw))
        _, _, part = swiglu_dgrad(x, w2, plan.offsets_E1, gu, gather_idx_R=plan.row_token_N)
        assert part.shape == (R, 3), (block_n, part.shape)
        err = (part.double() - want).abs().max().item()
        assert err <= 2 * err_pt + 1e-5 * want.abs().max().item(), f"BLOCK_N {block_n}: err {err:.3g} vs {err_pt:.3g}"


@interpreted
def test_weight_gradient_kernels_agree_bitwise():
    # Experts of 0, 5, 16, 17, 33, 48, 64 and 65 rows against BLOCK_K 16: the resident kernel with 1-4
    # chunks on chip (estimate 10 / 20 / 35 / 50 rows), including experts past its chunks (per-tile
    # fallback inside it), against the per-tile kernel (estimate too large) and a float64 reference;
    # P and Q gathered from token matrices or read as row buffers.
    g = torch.Generator().manual_seed(21)
    counts = [0, 5, 16, 17, 33, 48, 64, 65]
    off = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    R, M, N, T = sum(counts), 20, 24, 70  # M, N: two tiles, neither a multiple of 16
    p_rows, q_rows = torch.randn(R, M, generator=g), torch.randn(R, N, generator=g)
    p_tok, q_tok = torch.randn(T, M, generator=g), torch.randn(T, N, generator=g)
    idx = torch.randint(0, T, (R,), generator=g, dtype=torch.int32)
    for p, q, kw in ((p_rows, q_rows, {}), (p_tok, q_rows, dict(p_idx_R=idx)), (p_rows, q_tok, dict(q_idx_R=idx))):
        pr = p[idx.long()] if "p_idx_R" in kw else p
        qr = q[idx.long()] if "q_idx_R" in kw else q
        bounds = zip(off[:-1].tolist(), off[1:].tolist())
        want = torch.stack([pr[a:b].double().t() @ qr[a:b].double() for a, b in bounds])
        per_tile = k_grouped_mm(p, q, off, rows_per_group=1e9, **kw)
        torch.testing.assert_close(per_tile.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(per_tile[0], torch.zeros(M, N))
        for est in (10, 20, 35, 50):
            got = k_grouped_mm(p, q, off, rows_per_group=est, out=torch.full((8, M, N), float("nan")), **kw)
            assert torch.equal(got, per_tile), f"resident kernel (estimate {est} rows) differs, {kw.keys()}"


@interpreted
def test_router_logits_and_grads():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(21, 64, generator=g).requires_grad_()
    rw = torch.randn(6, 64, generator=g).requires_grad_()
    lg = router_logits(x, rw)
    dl = torch.randn(21, 6, generator=g)
    gx, gw = torch.autograd.grad(lg, [x, rw], dl)
    x64, rw64 = x.detach().double().requires_grad_(), rw.detach().double().requires_grad_()
    l64 = x64 @ rw64.t()
    gx64, gw64 = torch.autograd.grad(l64, [x64, rw64], dl.double())
    for a, b in ((lg, l64), (gx, gx64), (gw, gw64)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 21, 70])
def test_fp32_router_of_bf16_x_on_exact_bf16_pieces(T, w_dtype):
    """The fp32 router of bf16 x (an fp32 weight and dlogits as three exact bf16 pieces, a bf16 weight as itself,
    bf16 GEMMs, the piece products summed in fp32): logits and dW within fp32's error against fp64 (dW of a bf16
    weight within its one bf16 rounding), dx within its one bf16 rounding; a token's logits the same in any
    batch."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(T, 96, generator=g).to(torch.bfloat16).requires_grad_()
    rw = (torch.randn(10, 96, generator=g) * 3).to(w_dtype).requires_grad_()
    dl = torch.randn(T, 10, generator=g)
    lg = router_logits(x, rw)
    gx, gw = torch.autograd.grad(lg, [x, rw], dl)
    x64, rw64, dl64 = x.detach().double(), rw.detach().double(), dl.double()
    assert (lg.dtype, gx.dtype, gw.dtype) == (torch.float32, torch.bfloat16, w_dtype)
    torch.testing.assert_close(lg.double(), x64 @ rw64.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), dl64.t() @ x64, rtol=1e-5 if w_dtype == torch.float32 else 2 ** -7,
                               atol=1e-5)
    torch.testing.assert_close(gx.double(), dl64 @ rw64, rtol=2 ** -7, atol=1e-5)  # one (interpreter) bf16 cast
    if T > 1:
        assert torch.equal(router_logits(x[1:T // 2 + 1].detach(), rw.detach()), lg[1:T // 2 + 1])


@interpreted
def test_split_bf16x3_is_exact_and_follows_its_slots():
    """x = hi + mid + lo exactly (normal fp32 values over a wide exponent range, rows and column blocks, strided
    rows); slots in the order asked for; inf -> (inf, 0, 0), NaN stays NaN; bad input is refused."""
    g = torch.Generator().manual_seed(15)
    x = torch.randn(9, 70, generator=g) * torch.exp2(torch.randint(-60, 60, (9, 70), generator=g).float())
    wide = torch.cat([x, x], dim=1)[:, 3:73]  # strided rows
    for src in (x, wide):
        rows = split_bf16x3(src, ("hi", "mid", "lo", "hi"), along="rows").view(4, 9, 70).float()
        cols = split_bf16x3(src, ("lo", "hi", "mid"), along="cols").view(9, 3, 70).transpose(0, 1).float()
        assert torch.equal((rows[0] + rows[1]) + rows[2], src) and torch.equal(rows[3], rows[0])
        assert torch.equal(cols[1], rows[0]) and torch.equal(cols[2], rows[1]) and torch.equal(cols[0], rows[2])
        assert (rows[1].abs() <= rows[0].abs() * 2 ** -7).all() and (rows[2].abs() <= rows[1].abs() * 2 ** -7).all()
    odd = split_bf16x3(torch.tensor([[float("inf"), -float("inf"), float("nan")]]), ("hi", "mid", "lo"),
                       along="rows").float()
    assert odd[0, :2].tolist() == [float("inf"), -float("inf")] and odd[1:, :2].eq(0).all() and odd[:, 2].isnan().all()
    for bad, match in ((x.double(), "fp32"), (x.t(), "contiguous"), (x[0], "2-D")):
        with pytest.raises(ValueError, match=match):
            split_bf16x3(bad, ("hi",), along="rows")
    with pytest.raises(ValueError, match="pieces"):
        split_bf16x3(x, ("hi", "top"), along="rows")
    with pytest.raises(ValueError, match="along"):
        split_bf16x3(x, ("hi",), along="both")
    view = torch.randn(5, 36, generator=g).view(5, 3, 12).transpose(0, 1)  # chunk_sum: column blocks = a copy
    assert torch.equal(chunk_sum(view, out_dtype=torch.float32), chunk_sum(view.contiguous(), out_dtype=torch.float32))


@interpreted
def test_one_group_launchers_match_dense():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(18, 64, generator=g)
    w = torch.randn(1, 48, 64, generator=g)
    one = single_group_offsets(18, x.device)
    h, gu = gate_up_swiglu(x, w, one)
    torch.testing.assert_close(gu, x @ w[0].t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, reference.swiglu(gu[:, :24], gu[:, 24:]), rtol=1e-5, atol=1e-5)


@interpreted
def test_bad_inputs_raise_clear_errors():
    x, ids, w, w13, w2, s13, s2 = _make(5, 64, 32, 4, 2, 16)
    with pytest.raises(ValueError, match="topk_ids_TK"):
        moe_experts(x, ids + 4, w, w13, w2)
    with pytest.raises(ValueError, match="w2_EDF"):
        moe_experts(x, ids, w, w13, w2[:, :, :16])
    with pytest.raises(TypeError, match="w13_EGD"):
        moe_experts(x, ids, w, w13.double(), w2)
    with pytest.raises(TypeError, match="topk_ids_TK"):
        moe_experts(x, ids.float(), w, w13, w2)
    with pytest.raises(ValueError, match="shared"):
        moe_experts(x, ids, w, w13, w2, s13, None)
    with pytest.raises(ValueError, match="backend"):
        moe_experts(x, ids, w, w13, w2, backend="cuda")
    with pytest.raises(TypeError, match="fused backend"):
        moe_experts(x.double(), ids, w, w13.double(), w2.double())
