"""The expert-parallel dispatch / combine protocol on CPU: real Triton kernels under TRITON_INTERPRET=1,
one spawned process per simulated rank, shared-memory CPU tensors standing in for peer memory.

Proves: the schedule (receive order (expert, global token, slot), segment counts and offsets, global token
offsets) equals a Python model exactly; every received row carries its (source rank, token) payload; each
owner's (token, slot) slot gets the right expert's row, so the fixed-order combine equals a PyTorch
computation bitwise; capacity rounds (including the worst case: every token to one rank's experts) and
unused rounds (more than one fill block of them), the round table equal to a Python model and cut only at
expert boundaries unless one expert has more than C rows, no round above C rows, any two consecutive rounds
above C; rows left over after the launched rounds reported as an error (stage 4); T = 0 ranks and unequal T;
repeated exchanges (epochs grow, nothing reset); a peer that never signals gives an EPTimeoutError naming the
rank and stage; an out-of-range expert id is reported by its owner.

Legend: W ranks, T tokens of a rank, K top-k, D hidden, E global experts, L = E / W, C capacity rows.
"""


import pytest
import torch

from ep_utils import (
    check_round_table,
    expert_counts,
    model_rounds,
    model_schedule,
    offsets_of,
    payload_rows,
    routing,
    spawn_ranks,
)

ENV = {"TRITON_INTERPRET": "1"}
D = 32


def _expert_rows(xr_CD, roff_L1, rank, L):
    """Toy expert: local expert l multiplies its rows by (global id + 1) (exact in fp32)."""
    y = torch.zeros_like(xr_CD)
    offs = roff_L1.tolist()
    for l in range(L):
        a, b = offs[l], offs[l + 1]
        y[a:b] = xr_CD[a:b] * float(rank * L + l + 1)
    return y


def _protocol_worker(rank, W, buffers, spec_args, ids_all, w_all, C, rounds, repeats, timeout, silent_rank,
                     plan_by_sort, beside=0):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.ops import ep_comm as ops
    from megamoe.ops.combine import combine_fwd

    if plan_by_sort:  # the owner's plan through the device sort (large T*K*E) instead of the per-expert scan
        import megamoe.ops.routing as routing
        routing.SCAN_MAX = -1

    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    ws.timeout_s = timeout
    if rank == silent_rank:
        return None  # a peer that never calls
    L = spec.num_experts // W
    ids, w = ids_all[rank], w_all[rank]
    T = ids.shape[0]
    x = payload_rows(rank, T, spec.hidden)
    outs = []
    for _ in range(repeats):
        ops.publish(ws, ids, x)
        bufs = ops.ExchangeBuffers(ws, C, backward=False, rounds=rounds)
        ops.build_schedule(ws, bufs, timeout)
        recv, ready = [], []
        for r in range(rounds):
            if beside:  # the pull that runs beside a GEMM (ops.grouped_gemm.RowPull), launched alone here
                bufs.roff_L1.fill_(-7)  # must come from the round-offsets kernel: the pull itself does not write it
                pull = ops.pull_beside(ws, bufs, r, False, beside, timeout)
                assert int(pull.ready_B1.abs().sum()) == 0, "ready flags set before the pull ran"
                pull.launch()
                ready.append(pull.ready_B1.clone())
            else:
                ops.dispatch_round(ws, bufs, r, False)
            y = _expert_rows(bufs.xr_CD, bufs.roff_L1, rank, L)
            ops.push_round(ws, bufs, r, y)
            valid = bufs.rowtab_3C[0] >= 0
            recv.append((bufs.rowtab_3C[:, valid].clone(), bufs.xr_CD[valid, :2].clone(), bufs.roff_L1.clone()))
        ops.signal_done(ws)
        ops.wait_done(ws, timeout)
        rows, row_of, _ = ops.slot_views(ws, T)
        out = torch.full((T, spec.hidden), float("nan"))
        combine_fwd(rows, row_of, w, None, out=out)
        ws.check()
        outs.append(out)
    return {"sched": bufs.sched.clone(), "rounds": ops.round_starts(ws, bufs).clone(), "recv": recv, "out": outs,
            "epoch": ws.epoch(), "ready": ready}


def _run(W, Ts, K, E, kind, C, rounds=None, repeats=1, timeout=60.0, silent_rank=-1, seed=0, bad_id=None,
         plan_by_sort=False, beside=0):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec, max_rounds

    spec = WorkspaceSpec(W, max(max(Ts), 1), D, K, E, torch.float32)
    rounds = rounds or max_rounds(spec, C)
    ids_all = []
    for r, T in enumerate(Ts):
        if kind in ("one_rank", "one_rank_repeat"):  # every token of every rank routed to rank 0's experts
            ids_all.append(routing("uniform" if kind == "one_rank" else "repeat", T, K, E // W, seed, r))
        else:
            ids_all.append(routing(kind, T, K, E, seed, r))
    if bad_id is not None:  # (rank, token, slot, id): plant an expert id outside [0, E)
        r, t, k, v = bad_id
        ids_all[r][t, k] = v
    w_all = [torch.rand(T, K, generator=torch.Generator().manual_seed(r)) + 0.5 for r, T in enumerate(Ts)]
    buffers = EPWorkspace.allocate_shared(spec)
    res = spawn_ranks(_protocol_worker, W, buffers, (W, spec.max_tokens, D, K, E, torch.float32), ids_all, w_all,
                      C, rounds, repeats, timeout, silent_rank, plan_by_sort, beside, env=ENV)
    return res, ids_all, w_all, rounds


def _check_rounds(got, counts, C, rounds):
    """The round table against the model and its properties, and each round's row table and local offsets."""
    starts = got["rounds"].tolist()
    assert starts == model_rounds(counts, C, rounds), (starts, counts, C)
    sizes = check_round_table(starts, counts, C)
    off = offsets_of(counts)
    for r, (tab, _, roff) in enumerate(got["recv"]):
        assert tab.shape[1] == sizes[r], (r, tab.shape, sizes)
        assert roff.tolist() == [min(max(o - starts[r], 0), sizes[r]) for o in off], (r, roff)


def _check(res, ids_all, w_all, W, E, C, rounds):
    L = E // W
    for d in range(W):
        got = res[d]
        _check_rounds(got, expert_counts(ids_all, d, L), C, rounds)
        model = model_schedule(ids_all, d, L)
        # schedule table
        sched = got["sched"]
        assert int(sched[0]) == len(model)
        Ts = [ids.shape[0] for ids in ids_all]
        assert sched[8:8 + W + 1].tolist() == [sum(Ts[:s]) for s in range(W + 1)]
        cnt = sched[80:80 + E].view(L, W)
        for l in range(L):
            for s in range(W):
                assert int(cnt[l, s]) == sum(1 for m in model if m[0] == l and m[1] == s)
        # received rows, all rounds, in order; payload names its (source, token)
        tab = torch.cat([r[0] for r in got["recv"]], 1)
        pay = torch.cat([r[1] for r in got["recv"]], 0)
        assert [(int(a), int(b), int(c)) for a, b, c in tab.t()] == [(s, t, k) for _, s, t, k in model]
        assert torch.equal(pay[:, 0].long(), tab[0].long()) and torch.equal(pay[:, 1].long(), tab[1].long())
    for s in range(W):
        ids, w = ids_all[s], w_all[s]
        x = payload_rows(s, ids.shape[0], D)
        acc = torch.zeros(ids.shape[0], D)
        for k in range(ids.shape[1]):
            acc = acc + w[:, k:k + 1] * (x * (ids[:, k:k + 1].float() + 1.0))
        for out in res[s]["out"]:
            assert torch.equal(out, acc), f"rank {s}: combine differs from the fp32 model"


@pytest.mark.parametrize("W,Ts,K,E,kind,C", [
    (1, [7], 2, 4, "uniform", 64),
    (2, [5, 9], 2, 8, "zipf", 128),
    (2, [6, 0], 3, 8, "ties", 128),          # rank with 0 tokens, all tokens tie on experts 0..K-1
    (2, [4, 6], 2, 8, "one_rank", 8),        # worst case, capacity 8 rows: several rounds, some unused
    (4, [3, 5, 0, 2], 2, 8, "uniform", 16),
    (8, [2, 0, 3, 1, 0, 4, 1, 2], 2, 16, "zipf", 8),  # the largest EP size in one NVLink domain; rounds
    (2, [6, 5], 2, 4, "hot", 4),             # experts of more than C rows: rounds cut inside them
    (2, [5, 4], 3, 4, "repeat", 8),          # repeated ids in a token, K > L: up to K rows per token and rank
    (2, [5, 4], 3, 4, "one_rank_repeat", 20),  # ... all on rank 0: more rows than W * T_cap * L = 20
])
def test_protocol(W, Ts, K, E, kind, C):
    res, ids_all, w_all, rounds = _run(W, Ts, K, E, kind, C)
    _check(res, ids_all, w_all, W, E, C, rounds)


@pytest.mark.parametrize("W,Ts,K,E,kind,C", [
    (2, [5, 9], 2, 8, "zipf", 128),
    (2, [6, 0], 3, 8, "ties", 128),
    (4, [3, 5, 0, 2], 2, 8, "uniform", 16),
])
def test_protocol_with_sorted_plan(W, Ts, K, E, kind, C):
    """The owner's plan through the device sort (taken for large T*K*E) gives the same exchange."""
    res, ids_all, w_all, rounds = _run(W, Ts, K, E, kind, C, plan_by_sort=True)
    _check(res, ids_all, w_all, W, E, C, rounds)


@pytest.mark.parametrize("W,Ts,K,E,kind,C,programs", [
    (2, [40, 29], 2, 4, "hot", 80, 2),   # several 32-row blocks; one hot expert: rounds of different sizes
    (2, [6, 0], 3, 8, "ties", 128, 1),   # one program for every block; a rank with no tokens
    (2, [4, 6], 2, 8, "one_rank", 8, 5),  # more programs than blocks; several rounds, some unused
])
def test_pull_beside_a_gemm_moves_the_same_rows_and_flags_each_used_block(W, Ts, K, E, kind, C, programs):
    """``ops.ep_comm.pull_beside`` (the pull a GEMM runs beside, EPOptions.pull_programs): the same exchange as
    ``dispatch_round``, the round offsets written before the pull, and after it exactly the flags of the blocks
    holding the round's rows set (the GEMM's wait must never need a flag that is not coming), the tile counter
    untouched."""
    from megamoe.ops.ep_comm import _BM

    res, ids_all, w_all, rounds = _run(W, Ts, K, E, kind, C, beside=programs)
    _check(res, ids_all, w_all, W, E, C, rounds)
    for d in range(W):
        starts = res[d]["rounds"].tolist()
        for r, ready in enumerate(res[d]["ready"]):
            n = starts[r + 1] - starts[r]
            want = [0] + [1 if b * _BM < n else 0 for b in range(ready.shape[0] - 1)]
            assert ready.tolist() == want, (d, r, n, ready.tolist())
    assert any(len(res[d]["ready"]) > 1 for d in range(W)) or rounds == 1


def _schedule_sweep_worker(rank, W, buffers, spec_args, cases):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.ops import ep_comm as ops

    ws = EPWorkspace.from_shared_buffers(WorkspaceSpec(*spec_args), rank, buffers)
    out = []
    for ids, C, rounds in cases:
        ops.publish(ws, ids, payload_rows(rank, ids.shape[0], spec_args[2]))
        bufs = ops.ExchangeBuffers(ws, C, backward=False, rounds=rounds)
        ops.build_schedule(ws, bufs, 60.0)
        out.append(ops.round_starts(ws, bufs).tolist())
        # finish the exchange so that the next one starts from a consistent epoch (no rows moved: no rounds)
        ops.signal_done(ws)
        ops.wait_done(ws, 60.0)
        ws.check()
    return out


def test_round_table_sweep_against_the_model():
    """The schedule kernel alone at W = 1 on 40 random skewed routings (some experts empty, some far above C,
    C from 1 row up): its round table equals the model and has the model's properties."""
    from megamoe.distributed import EPWorkspace, WorkspaceSpec, max_rounds

    K, E, T_max = 3, 12, 40
    spec = WorkspaceSpec(1, T_max, D, K, E, torch.float32)
    g = torch.Generator().manual_seed(5)
    cases = []
    for _ in range(40):
        T = int(torch.randint(0, T_max + 1, (1,), generator=g))
        weight = torch.rand(E, generator=g) ** 4 + 1e-3 * (torch.rand(E, generator=g) > 0.3)  # skewed, some ~0
        ids = (torch.multinomial(weight.expand(T, E), K, replacement=False, generator=g) if T else
               torch.zeros(0, K, dtype=torch.int64))
        C = int(torch.randint(1, 2 * T * K // 3 + 2, (1,), generator=g))
        cases.append((ids, C, max_rounds(spec, C)))
    buffers = EPWorkspace.allocate_shared(spec)
    got = spawn_ranks(_schedule_sweep_worker, 1, buffers, (1, T_max, D, K, E, torch.float32), cases, env=ENV)[0]
    n_cut_inside = 0
    for (ids, C, rounds), starts in zip(cases, got):
        counts = expert_counts([ids], 0, E)
        assert starts == model_rounds(counts, C, rounds), (starts, counts, C)
        check_round_table(starts, counts, C)
        n_cut_inside += sum(1 for c in starts if c not in offsets_of(counts))
    assert n_cut_inside > 0, "the sweep must cut inside an expert of more than C rows somewhere"


def test_many_unused_rounds_fill_the_table():
    """150 rounds launched, 4 used: the unused rounds' entries (more than one 64-entry fill block) are all R."""
    res, ids_all, w_all, rounds = _run(1, [7], 2, 4, "uniform", 4, rounds=150)
    _check(res, ids_all, w_all, 1, 4, 4, rounds)
    assert rounds == 150 and res[0]["rounds"][-1] == 14 and len(res[0]["rounds"]) == 151


def test_rows_beyond_the_launched_rounds_are_an_error():
    """Fewer rounds launched than the rows need (the layer always launches ``max_rounds``, so only the ops layer
    can ask for this): the schedule reports stage 4, the exchange still completes (no hang), ``check`` raises."""
    with pytest.raises(AssertionError) as info:
        _run(1, [7], 2, 4, "uniform", 4, rounds=1)
    msg = str(info.value)
    assert "EPTimeoutError" in msg and "rank 0 of 1" in msg and "exceed the launched rounds" in msg, msg[-800:]


def test_repeated_exchanges_epochs_grow():
    res, ids_all, w_all, rounds = _run(2, [5, 3], 2, 4, "hot", 32, repeats=3)
    _check(res, ids_all, w_all, 2, 4, 32, rounds)
    assert [r["epoch"] for r in res] == [3, 3]
    assert all(torch.equal(r["out"][0], r["out"][i]) for r in res for i in range(3))


def test_silent_peer_times_out_naming_rank_and_stage():
    from megamoe.distributed import EPTimeoutError  # noqa: F401 - the worker raises it

    with pytest.raises(AssertionError) as info:
        _run(2, [3, 3], 2, 4, "uniform", 32, timeout=1.0, silent_rank=1)
    msg = str(info.value)
    assert "EPTimeoutError" in msg and "rank 0 of 2" in msg and "from rank 1" in msg and "dispatch" in msg


@pytest.mark.parametrize("by_sort", [False, True])
@pytest.mark.parametrize("bad", [4, -1])
def test_bad_expert_id_is_reported_by_its_owner(bad, by_sort):
    """An id outside [0, E) that got past the caller's checks: the owner's plan flags it (status stage 3),
    the exchange still completes on every rank (no hang, no out-of-range row read), and the owner's
    ``check`` raises naming the rank and the stage."""
    with pytest.raises(AssertionError) as info:
        _run(2, [4, 3], 2, 4, "uniform", 32, bad_id=(1, 2, 1, bad), plan_by_sort=by_sort)
    msg = str(info.value)
    assert "EPTimeoutError" in msg and "rank 1 of 2" in msg and "expert id out of range" in msg


def _bad_options_worker(rank, W, buffers, spec_args, bad, good):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional_ep import moe_experts_ep_workspace

    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    g = torch.Generator().manual_seed(1)
    E, D, F = spec.num_experts, spec.hidden, 16
    x = torch.randn(4, D, generator=g)
    ids = routing("uniform", 4, spec.top_k, E, 0, rank)
    w = torch.rand(4, spec.top_k, generator=g)
    w13, w2 = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    before = ws.epoch()
    try:
        moe_experts_ep_workspace(x, ids, w, w13, w2, None, None, workspace=ws, capacity_rows=64, timeout_s=10,
                                 options=bad)
        msg = None
    except TypeError as e:
        msg = str(e)
    after_bad = ws.epoch()
    out = moe_experts_ep_workspace(x, ids, w, w13, w2, None, None, workspace=ws, capacity_rows=64, timeout_s=10,
                                   options=good)
    return {"msg": msg, "epochs": (before, after_bad, ws.epoch()), "finite": bool(torch.isfinite(out).all())}


@pytest.mark.parametrize("bad", ["kernel", {"comm_sms": 16}])
def test_bad_ep_options_are_a_clear_error_before_the_exchange(bad):
    """``options`` must be a megamoe.config.EPOptions (whose fields are checked when it is made,
    tests/test_config.py): anything else raises TypeError naming the argument before this rank publishes (its
    epoch does not move, so no peer waits on it), and the workspace works afterwards with good options."""
    from megamoe.config import EPOptions
    from megamoe.distributed import EPWorkspace, WorkspaceSpec

    spec = WorkspaceSpec(1, 4, D, 2, 4, torch.float32)
    res = spawn_ranks(_bad_options_worker, 1, EPWorkspace.allocate_shared(spec), (1, 4, D, 2, 4, torch.float32),
                      bad, EPOptions(comm_sms=16, push_kernel=True), env=ENV)[0]
    assert res["msg"] and "options" in res["msg"] and "EPOptions" in res["msg"], res
    before, after_bad, after_good = res["epochs"]
    assert after_bad == before and after_good > before, res["epochs"]
    assert res["finite"]


def test_release_workspaces_forgets_only_that_group():
    """megamoe.distributed.release_workspaces drops a group's cached workspaces and reserved capacity (so a
    re-created group of the same name cannot get the old group's workspace) and leaves other groups'."""
    from megamoe import distributed as mdist

    class _Group:
        def __init__(self, name):
            self.group_name = name

    a, b = _Group("release-test-a"), _Group("release-test-b")
    saved_ws, saved_res = dict(mdist._WORKSPACES), dict(mdist._RESERVED)
    try:
        for g in (a, b):
            mdist._WORKSPACES[mdist._ws_key(g, 64, 2, 8, torch.bfloat16)] = object()
            mdist._WORKSPACES[mdist._ws_key(g, 128, 2, 8, torch.bfloat16)] = object()
            mdist.reserve_workspace(g, 512)
        mdist.release_workspaces(a)
        assert not [k for k in mdist._WORKSPACES if k[0] == "release-test-a"]
        assert len([k for k in mdist._WORKSPACES if k[0] == "release-test-b"]) == 2
        assert "release-test-a" not in mdist._RESERVED and mdist._RESERVED["release-test-b"] == 512
    finally:
        mdist._WORKSPACES.clear()
        mdist._WORKSPACES.update(saved_ws)
        mdist._RESERVED.clear()
        mdist._RESERVED.update(saved_res)
