"""The whole fused EP layer (megamoe.functional_ep) on the CPU protocol: real Triton kernels under
TRITON_INTERPRET=1, one spawned process per simulated rank, shared-memory CPU tensors standing in for peer
memory (tests/test_ep_protocol_interpret.py tests the protocol itself).

Proves: output and gradients bitwise equal to the single-GPU fused path on the global batch (one round,
several rounds, a rank with no tokens, the result rows from the GEMM epilogue or the push kernel), the same
bits whatever the layer keeps from forward to backward (pre-activations, dispatched x rows); two layers'
interleaved exchanges (the backward restores its routing plan); the kept x rows are what the backward reads
(a poisoned pool); a second backward of a retained graph; nothing kept when no backward can follow; the split
experts' fp32 sums across rounds.

Legend: W ranks, T tokens of a rank, K top-k, D hidden (Dm in workers), E global experts, L = E / W, F expert
FFN, S shared FFN, C capacity rows.
"""

from types import SimpleNamespace

import pytest
import torch

from ep_utils import expert_counts, model_rounds, routing, spawn_ranks, split_experts

ENV = {"TRITON_INTERPRET": "1"}
SAVE_VARIANTS = ((True, True), (False, False), (False, True), (True, False))  # (save_preact, save_dispatched)


def _draw(seed, Ts, K, E, F, Dm, kind="uniform", S=0):
    """One problem on the global batch, drawn in a fixed order: experts (w13 E x 2F x D, w2 E x D x F), the
    optional shared expert (width S), each rank's tokens, ids (``ep_utils.routing``), routing weights and
    output gradients. ``local(rank, W)``: leaves of that rank's tokens and experts (x, w, w13, w2)."""
    g = torch.Generator().manual_seed(seed)
    p = SimpleNamespace(w13=torch.randn(E, 2 * F, Dm, generator=g) * Dm ** -0.5,
                        w2=torch.randn(E, Dm, F, generator=g) * F ** -0.5)
    p.sw13 = torch.randn(2 * S, Dm, generator=g) * Dm ** -0.5 if S else None
    p.sw2 = torch.randn(Dm, S, generator=g) * S ** -0.5 if S else None
    p.xs = [torch.randn(T, Dm, generator=g) for T in Ts]
    p.ids = [routing(kind, T, K, E, seed, r) for r, T in enumerate(Ts)]
    p.wts = [torch.rand(T, K, generator=g) + 0.1 for T in Ts]
    p.gos = [torch.randn(T, Dm, generator=g) for T in Ts]

    def local(rank, W):
        L = E // W
        return [t.clone().requires_grad_(True) for t in (p.xs[rank], p.wts[rank], p.w13[rank * L:(rank + 1) * L],
                                                          p.w2[rank * L:(rank + 1) * L])]
    p.local = local
    return p


def _spawn_small(worker, Ts, *args, W=2, K=2, E=4, Dm=32, F=16):
    """``worker(rank, W, buffers, spec_args, Ts, K, E, F, *args)`` on W simulated ranks sharing one fp32
    workspace of hidden size Dm for Ts tokens per rank; returns each rank's result."""
    from megamoe.distributed import EPWorkspace, WorkspaceSpec

    spec = WorkspaceSpec(W, max(Ts), Dm, K, E, torch.float32)
    return spawn_ranks(worker, W, EPWorkspace.allocate_shared(spec), (W, spec.max_tokens, Dm, K, E, torch.float32),
                       Ts, K, E, F, *args, env=ENV)


def _count_calls(module, name, counts, key):
    """Replace ``module.name`` by a wrapper that adds 1 to ``counts[key]`` per call (workers only: each spawned
    process patches its own import)."""
    real = getattr(module, name)

    def counted(*a, **kw):
        counts[key] += 1
        return real(*a, **kw)
    setattr(module, name, counted)


def _layer_worker(rank, W, buffers, spec_args, Ts, K, E, F, S, kind, C, seed, push, overlap=0):
    import torch.nn.functional

    from megamoe.config import EPOptions
    from megamoe.ops import ep_comm
    # result rows from the GEMM epilogue or the separate push kernel; round 0's pull beside its first GEMM, or
    # before it
    options = EPOptions(pull_programs=overlap, push_kernel=push == "kernel")
    # which way the result rows went, and how often round 0's pull ran beside a GEMM (counted, then asserted)
    pushes = {"epilogue": 0, "row_copies": 0, "pulls_beside": 0}
    real_push = ep_comm.push_round
    _count_calls(ep_comm, "push_target", pushes, "epilogue")
    _count_calls(ep_comm, "pull_beside", pushes, "pulls_beside")

    def counted_push(ws, bufs, r, y_CD, dots_CP=None):
        pushes["row_copies"] += y_CD is not None
        return real_push(ws, bufs, r, y_CD, dots_CP)

    ep_comm.push_round = counted_push

    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional import moe_experts
    from megamoe.functional_ep import moe_experts_ep_workspace

    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    p = _draw(seed, Ts, K, E, F, spec.hidden, kind, S)
    w13, w2, sw13, sw2, xs, ids, ws_, gos = p.w13, p.w2, p.sw13, p.sw2, p.xs, p.ids, p.wts, p.gos

    def leaf(t):
        return None if t is None else t.clone().requires_grad_(True)

    x, w, l13, l2 = p.local(rank, W)  # EP: this rank's tokens and experts
    s13, s2 = leaf(sw13), leaf(sw2)
    outs, grads = [], []
    # four times: keeping x rows and pre-activations, neither (x pulled again, gu recomputed), only the x rows
    # (gu recomputed from them), only gu (x pulled again); bitwise the same, epochs advance
    for preact, dispatched in SAVE_VARIANTS:
        out = moe_experts_ep_workspace(x, ids[rank], w, l13, l2, s13, s2, workspace=ws, capacity_rows=C, timeout_s=60,
                                       save_preact=preact, save_dispatched=dispatched, options=options)
        params = [t for t in (x, w, l13, l2, s13, s2) if t is not None]
        gr = torch.autograd.grad(out, params, gos[rank])
        outs.append(out.detach())
        grads.append([t.clone() for t in gr])
    res = {"out": outs, "grads": grads, "pushes": pushes}
    if rank == 0:  # single-GPU fused path on the global batch, once (every rank's slice of it: _ref_slices)
        X, Wt = leaf(torch.cat(xs)), leaf(torch.cat(ws_))
        G13, G2, S13, S2 = leaf(w13), leaf(w2), leaf(sw13), leaf(sw2)
        ref = moe_experts(X, torch.cat(ids), Wt, G13, G2, S13, S2, backend="fused")
        ref_params = [t for t in (X, Wt, G13, G2, S13, S2) if t is not None]
        res["ref"] = (ref.detach(), torch.autograd.grad(ref, ref_params, torch.cat(gos)))
    return res


def _ref_slices(ref, Ts, rank, L):
    """Rank ``rank``'s part of the global-batch result ``ref`` = (out, grads): (out, [dx, dw, dw13, dw2])."""
    out, rg = ref
    lo = sum(Ts[:rank])
    sl, el = slice(lo, lo + Ts[rank]), slice(rank * L, (rank + 1) * L)
    return out[sl], [rg[0][sl], rg[1][sl], rg[2][el], rg[3][el]]


# The interpreter's numpy matmul is not batch invariant across a row's position inside a tile, and the
# shared expert's rows sit at different tile positions for EP=1 (global batch) and EP=2 (local batch):
# bitwise checks run without a shared expert; with one, outputs agree to fp32 rounding (on the GPU the
# shared rows are bitwise too: tests/test_ep_gpu.py).
# overlap > 0: round 0's pull runs as that many programs beside its first GEMM (EPOptions.pull_programs); under
# the interpreter the pull still finishes first, so these cases prove the flags, the tile counter and the
# launch order give the same bits (tests/test_ep_gpu.py runs them side by side)
@pytest.mark.parametrize("W,Ts,K,E,kind,C,S,push,overlap", [
    (2, [5, 3], 2, 4, "uniform", 64, 0, "epilogue", 0),
    (2, [4, 0], 2, 4, "hot", 8, 0, "epilogue", 0),    # rank with no tokens; capacity 8: several rounds
    (2, [4, 0], 2, 4, "hot", 8, 0, "kernel", 0),      # the same through the separate push kernel
    (2, [3, 6], 2, 4, "zipf", 64, 16, "epilogue", 0),  # shared expert
    (2, [6, 5], 2, 4, "uniform", 4, 0, "epilogue", 0),  # capacity 4: several used rounds, experts of > 4 rows split
    (2, [6, 5], 2, 4, "uniform", 9, 0, "epilogue", 0),  # capacity 9: two used rounds, no expert above 9 rows
    (4, [3, 5, 0, 4], 2, 8, "uniform", 9, 0, "epilogue", 0),  # the same at W = 4, a rank with no tokens
    (2, [41, 30], 2, 4, "uniform", 64, 0, "epilogue", 2),  # pull beside the GEMM: several 32-row blocks
    (2, [4, 0], 2, 4, "hot", 8, 0, "kernel", 1),  # beside, one program; several rounds; a rank with no tokens
])
def test_moe_experts_ep_bitwise_equals_single_gpu_fused(W, Ts, K, E, kind, C, S, push, overlap):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec, max_rounds

    Dm, F = 32, 16
    spec = WorkspaceSpec(W, max(Ts), Dm, K, E, torch.float32)
    buffers = EPWorkspace.allocate_shared(spec)
    res = spawn_ranks(_layer_worker, W, buffers, (W, spec.max_tokens, Dm, K, E, torch.float32), Ts, K, E, F, S,
                      kind, C, 0, push, overlap, env=ENV)
    multi_round = max_rounds(spec, C) > 1
    shared_sum = None
    ids_all = [routing(kind, T, K, E, 0, s) for s, T in enumerate(Ts)]
    splits = [split_experts(ids_all, r, E // W, C) for r in range(W)]
    # a split expert's rows in a later round sit at other tile positions than at EP=1: on the GPU the kernels
    # are batch invariant (tests/test_ep_gpu.py), the interpreter's numpy matmul is not (see above). Whole
    # experts keep their tile positions in any round (rounds are cut at expert boundaries), so with no split
    # expert every row is bitwise, however many rounds were used.
    split_any = any(any(sp) for sp in splits)
    rows_exact = not S and not split_any
    for r in range(W):
        got = res[r]
        # the result rows took the way asked for: GEMM-epilogue stores, or the copy kernel's row copies
        if push == "epilogue":
            assert got["pushes"]["epilogue"] > 0 and got["pushes"]["row_copies"] == 0, got["pushes"]
        else:
            assert got["pushes"]["epilogue"] == 0 and got["pushes"]["row_copies"] > 0, got["pushes"]
        # beside: every forward, and the backwards that kept the pre-activations (their first GEMM reads dout)
        want = (len(SAVE_VARIANTS) + sum(p for p, _ in SAVE_VARIANTS)) if overlap else 0
        assert got["pushes"]["pulls_beside"] == want, (got["pushes"], want)
        for v in range(1, len(SAVE_VARIANTS)):
            assert torch.equal(got["out"][0], got["out"][v]), "not repeatable"
            for a, b in zip(got["grads"][0], got["grads"][v]):
                assert torch.equal(a, b), f"gradients differ between (save_preact, save_dispatched) = " \
                    f"{SAVE_VARIANTS[0]} and {SAVE_VARIANTS[v]} (or not repeatable)"
        gx, gw, g13, g2 = got["grads"][0][:4]
        ref_out, (rx, rw, r13, r2) = _ref_slices(res[0]["ref"], Ts, r, E // W)
        if not rows_exact:
            torch.testing.assert_close(got["out"][0], ref_out, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got["out"][0], ref_out), f"rank {r}: output differs from EP=1 fused"
            assert torch.equal(gx, rx), f"rank {r}: dx differs from EP=1 fused"
        if not split_any:
            assert torch.equal(gw, rw), f"rank {r}: d(topk_weights) differs from EP=1 fused"
        else:
            torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)
        # several rounds: an expert of more than C rows is split and sums fp32 partials (equal up to fp32
        # rounding); every other expert is bitwise the one-round result (megamoe.ops.wgrad_rounds)
        split = splits[r]
        for l in range(E // W):
            if multi_round and split[l]:
                torch.testing.assert_close(g13[l], r13[l], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(g2[l], r2[l], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(g13[l], r13[l]) and torch.equal(g2[l], r2[l]), \
                    f"rank {r}: local expert {l}'s weight grads differ (split across rounds: {split[l]})"
        sh = got["grads"][0][4:]
        shared_sum = sh if shared_sum is None else [a + b for a, b in zip(shared_sum, sh)]
    for a, b in zip(shared_sum or [], res[0]["ref"][1][4:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if C == 4:
        assert sum(map(sum, splits)) > 0, "the capacity-4 case must split an expert across rounds"
    if C == 9:  # several used rounds somewhere, and nothing split: everything above was bitwise
        used = [sum(1 for a, b in zip(st, st[1:]) if b > a) for st in
                (model_rounds(expert_counts(ids_all, r, E // W), C, max_rounds(spec, C)) for r in range(W))]
        assert max(used) > 1 and not split_any and rows_exact, (used, splits)


def _two_layer_worker(rank, W, buffers, spec_args, Ts, K, E, F):
    """Two MoE layers with different routings share one workspace, as layers of one shape do in a model: forward
    A, forward B, backward B, backward A. A's backward must restore A's routing plan (B's forward overwrote the
    pool). Counts the plan builds and restores."""
    import megamoe.ops.ep_comm as ep_comm
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional import moe_experts
    from megamoe.functional_ep import moe_experts_ep_workspace

    counts = {"built": 0, "restored": 0}
    _count_calls(ep_comm, "routing_plan", counts, "built")
    _count_calls(ep_comm, "restore_plan", counts, "restored")
    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    L, Dm = E // W, spec.hidden
    res = {}
    layers = {}
    for name, seed in (("A", 3), ("B", 4)):
        layers[name] = _draw(seed, Ts, K, E, F, Dm, "zipf" if name == "A" else "uniform")
    eps = {}
    for name in ("A", "B"):  # both forwards first
        params = layers[name].local(rank, W)
        out = moe_experts_ep_workspace(params[0], layers[name].ids[rank], *params[1:], None, None, workspace=ws,
                                       capacity_rows=64, timeout_s=60)
        eps[name] = (out, params)
    for name in ("B", "A"):  # backwards in reverse order
        p = layers[name]
        w13, w2, xs, ids, wts, gos = p.w13, p.w2, p.xs, p.ids, p.wts, p.gos
        out, params = eps[name]
        gr = torch.autograd.grad(out, params, gos[rank])
        leaves = [t.clone().requires_grad_(True) for t in (torch.cat(xs), torch.cat(wts), w13, w2)]
        ref = moe_experts(leaves[0], torch.cat(ids), *leaves[1:], None, None, backend="fused")
        rg = torch.autograd.grad(ref, leaves, torch.cat(gos))
        lo = sum(Ts[:rank])
        sl, el = slice(lo, lo + Ts[rank]), slice(rank * L, (rank + 1) * L)
        res[name] = [torch.equal(out.detach(), ref.detach()[sl]), torch.equal(gr[0], rg[0][sl]),
                     torch.equal(gr[1], rg[1][sl]), torch.equal(gr[2], rg[2][el]), torch.equal(gr[3], rg[3][el])]
    res["counts"] = counts
    return res


def test_backward_restores_its_routing_plan_after_another_layers_exchange():
    """The backward restores the forward's routing plan (megamoe.ops.ep_comm.save_plan / restore_plan) rather
    than rebuilding it: with two layers' exchanges interleaved (forward A, forward B, backward B, backward A)
    every output and gradient is bitwise the single-GPU fused path's, the plan is built once per forward and
    restored once per backward on each rank."""
    res = _spawn_small(_two_layer_worker, [5, 3])
    for r, got in enumerate(res):
        assert got["A"] == [True] * 5 and got["B"] == [True] * 5, (r, got)
        assert got["counts"] == {"built": 2, "restored": 2}, (r, got["counts"])


def _poisoned_pool_worker(rank, W, buffers, spec_args, Ts, K, E, F):
    """Forward, then a backward whose publish stages NaN x rows in this rank's pool (the peers' and its own
    pulls would read them); the shared expert reads x directly, so only pulled x rows can carry NaN into a
    gradient. Per save_dispatched: whether every gradient is finite, whether every gradient equals a clean
    run's, and the pull_x argument of each backward dispatch launch."""
    import megamoe.ops.ep_comm as ep_comm
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional_ep import moe_experts_ep_workspace

    real_publish, real_dispatch = ep_comm.publish, ep_comm.dispatch_round
    pulls = {True: [], False: []}  # pull_x of every backward dispatch launch, per save_dispatched
    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    p = _draw(3, Ts, K, E, F, spec.hidden, S=F)
    res = {}
    for dispatched in (True, False):
        for poison in (False, True):
            def publish(ws_arg, ids_arg, x_TD, dout_TD=None, **kw):
                if poison and dout_TD is not None:  # noqa: B023 - the backward's staging only; used at once
                    x_TD = torch.full_like(x_TD, float("nan"))
                return real_publish(ws_arg, ids_arg, x_TD, dout_TD, **kw)
            def dispatch(ws_arg, bufs, r, backward, pull_x=True):
                if backward:
                    pulls[dispatched].append(pull_x)  # noqa: B023 - used in this iteration
                return real_dispatch(ws_arg, bufs, r, backward, pull_x)
            ep_comm.publish, ep_comm.dispatch_round = publish, dispatch
            leaves = p.local(rank, W) + [p.sw13.clone().requires_grad_(True), p.sw2.clone().requires_grad_(True)]
            out = moe_experts_ep_workspace(leaves[0], p.ids[rank], *leaves[1:], workspace=ws, capacity_rows=64,
                                           timeout_s=60, save_dispatched=dispatched)
            res[(dispatched, poison)] = torch.autograd.grad(out, leaves, p.gos[rank])
    ep_comm.publish, ep_comm.dispatch_round = real_publish, real_dispatch
    return {d: (all(bool(t.isfinite().all()) for t in res[(d, True)]),
                all(torch.equal(a, b) for a, b in zip(res[(d, True)], res[(d, False)])), pulls[d])
            for d in (True, False)}


def test_backward_uses_the_kept_x_rows_not_the_pool():
    """With save_dispatched (the default) the backward's round 0 neither pulls x rows (the pull launches are
    recorded) nor reads any: NaN x rows staged in every pool for the backward leave every gradient bitwise a
    clean run's. Without it the backward pulls x again, and the same poison reaches the gradients (so this test
    sees pulled rows that are used)."""
    res = _spawn_small(_poisoned_pool_worker, [5, 3])
    for r, got in enumerate(res):
        assert got[True][:2] == (True, True), f"rank {r}: kept x rows, yet the pool's x reached a gradient"
        assert got[True][2] == [False, False], f"rank {r}: kept x rows, yet the backward pulled x: {got[True][2]}"
        assert got[False][0] is False, f"rank {r}: x pulled again, yet the poisoned pool left no trace"
        assert got[False][2] == [True, True], f"rank {r}: the backward without kept rows must pull x: {got[False][2]}"


def _retain_graph_worker(rank, W, buffers, spec_args, Ts, K, E, F, C):
    """One forward, two backwards of its graph (retain_graph): the kept rows and pre-activations of round 0
    must come through the first backward unchanged, also when later rounds pull rows of their own."""
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional_ep import moe_experts_ep_workspace

    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    p = _draw(7, Ts, K, E, F, spec.hidden)
    leaves = p.local(rank, W)
    out = moe_experts_ep_workspace(leaves[0], p.ids[rank], *leaves[1:], None, None, workspace=ws, capacity_rows=C,
                                   timeout_s=60)
    first = torch.autograd.grad(out, leaves, p.gos[rank], retain_graph=True)
    second = torch.autograd.grad(out, leaves, p.gos[rank])
    return [torch.equal(a, b) for a, b in zip(first, second)]


def test_second_backward_of_a_retained_graph_keeps_the_bits():
    """Capacity 4: several used rounds. The backward gives rounds after the first their own x rows buffer, so
    the rows kept from the forward are read, never overwritten: a second backward gives the same bits."""
    res = _spawn_small(_retain_graph_worker, [6, 5], 4)
    for r, same in enumerate(res):
        assert all(same), f"rank {r}: the second backward's gradients differ (x, w, w13, w2): {same}"


def _keep_flags_worker(rank, W, buffers, spec_args, Ts, K, E, F):
    """What the forward is asked to keep, per call: (save_preact, save_dispatched) as the NVLink dispatcher receives
    them, under no_grad, with grad mode on but nothing requiring grad, and with x requiring grad."""
    import megamoe.ops.ep_dispatch as ep_dispatch
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional_ep import moe_experts_ep_workspace

    real, seen = ep_dispatch.NVLinkDispatcher.__init__, []

    def recorded(self, *a, save_preact, save_dispatched, **kw):
        seen.append((save_preact, save_dispatched))
        real(self, *a, save_preact=save_preact, save_dispatched=save_dispatched, **kw)
    ep_dispatch.NVLinkDispatcher.__init__ = recorded
    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    p = _draw(5, Ts, K, E, F, spec.hidden)
    x, w, l13, l2 = (t.detach() for t in p.local(rank, W))

    def call(x_TD):
        return moe_experts_ep_workspace(x_TD, p.ids[rank], w, l13, l2, None, None, workspace=ws, capacity_rows=64,
                                        timeout_s=60)
    with torch.no_grad():
        call(x.clone().requires_grad_(True))
    call(x)
    call(x.clone().requires_grad_(True))
    return seen


def test_nothing_is_kept_when_no_backward_can_follow():
    """Rows and pre-activations are kept (both defaults on) only when a backward can follow: not under no_grad,
    not when no input requires grad."""
    res = _spawn_small(_keep_flags_worker, [4, 3])
    for r, seen in enumerate(res):
        assert seen == [(False, False), (False, False), (True, True)], f"rank {r}: {seen}"


def _fp8_worker(rank, W, buffers, spec_args, Ts, K, E, F, C, kind):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec, max_rounds
    from megamoe.functional import moe_experts
    from megamoe.functional_ep import moe_experts_ep_workspace

    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    p = _draw(1, Ts, K, E, F, spec.hidden, kind)
    x, w, l13, l2 = p.local(rank, W)
    res = {"rounds": max_rounds(spec, C), "refused": None}
    if res["rounds"] > 1:  # several rounds need C on the 128-row weight-gradient blocks
        try:
            moe_experts_ep_workspace(x, p.ids[rank], w, l13, l2, workspace=ws, capacity_rows=C + 64, fp8=True)
        except ValueError as e:
            res["refused"] = str(e)
    out = moe_experts_ep_workspace(x, p.ids[rank], w, l13, l2, workspace=ws, capacity_rows=C, timeout_s=60,
                                   fp8=True)
    res.update(out=out.detach(), grads=torch.autograd.grad(out, [x, w, l13, l2], p.gos[rank]))
    if rank == 0:  # the single-GPU fused FP8 path on the global batch
        leaves = [t.clone().requires_grad_(True) for t in (torch.cat(p.xs), torch.cat(p.wts), p.w13, p.w2)]
        ref = moe_experts(leaves[0], torch.cat(p.ids), *leaves[1:], fp8=True)
        res["ref"] = (ref.detach(), torch.autograd.grad(ref, leaves, torch.cat(p.gos)))
    return res


@pytest.mark.parametrize("W,Ts,K,E,kind,C", [
    (2, [5, 3], 2, 4, "uniform", 64),  # one round
    (2, [150, 120], 2, 4, "hot", 128),  # several rounds: expert 0's 270 rows split in three
    (4, [100, 120, 0, 90], 2, 8, "uniform", 128),  # W = 4: whole experts in a later round; a rank with no tokens
])
def test_fp8_ep_bitwise_equals_single_gpu_fused_fp8(W, Ts, K, E, kind, C):
    """moe_experts_ep(..., fp8=True) (the push kernel returns the rows): output and every gradient bitwise equal
    to the single-GPU FP8 path on the global batch, in one round and in several. The rows are quantized per row
    (1x128) and the weight-gradient blocks start at each expert's first row in both; an expert split across
    rounds is cut every C rows (a multiple of 128) and carries its fp32 sum from round to round, so the bytes,
    scales and sums are the same. A C off the 128-row blocks is refused when rounds are launched."""
    from megamoe.distributed import EPWorkspace, WorkspaceSpec

    Dm, F = 128, 128
    spec = WorkspaceSpec(W, max(Ts), Dm, K, E, torch.float32)
    res = spawn_ranks(_fp8_worker, W, EPWorkspace.allocate_shared(spec), (W, spec.max_tokens, Dm, K, E, torch.float32),
                      Ts, K, E, F, C, kind, env=ENV)
    ids_all = [routing(kind, T, K, E, 1, s) for s, T in enumerate(Ts)]
    if kind == "hot":
        assert split_experts(ids_all, 0, E // W, C)[0], "the case must split expert 0 across rounds"
    if W == 4:  # some rank uses two rounds, no expert split: whole experts in round 1
        used = [sum(1 for a, b in zip(st, st[1:]) if b > a) for st in
                (model_rounds(expert_counts(ids_all, r, E // W), C, 8) for r in range(W))]
        assert max(used) > 1 and not any(map(any, (split_experts(ids_all, r, E // W, C) for r in range(W)))), used
    for r in range(W):
        assert (res[r]["rounds"] > 1) == (C >= 128), res[r]["rounds"]
        if res[r]["rounds"] > 1:
            assert "multiple of 128" in (res[r]["refused"] or ""), res[r]["refused"]
        ref_out, ref_grads = _ref_slices(res[0]["ref"], Ts, r, E // W)
        assert torch.equal(res[r]["out"], ref_out), f"rank {r}: output"
        for name, a, b in zip(("dx", "dw", "dw13", "dw2"), res[r]["grads"], ref_grads):
            assert torch.equal(a, b), f"rank {r}: {name}"
