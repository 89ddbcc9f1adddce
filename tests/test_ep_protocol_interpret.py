"""The expert-parallel dispatch / combine protocol on CPU: real Triton kernels under TRITON_INTERPRET=1,
one spawned process per simulated rank, shared-memory CPU tensors standing in for peer memory.

Proves: the schedule (receive order (expert, global token, slot), segment counts and offsets, global token
offsets) equals a Python model exactly; every received row carries its (source rank, token) payload; each
owner's (token, slot) slot gets the right expert's row, so the fixed-order combine equals a PyTorch
computation bitwise; capacity rounds (including the worst case: every token to one rank's experts) and
unused rounds; T = 0 ranks and unequal T; repeated exchanges (epochs grow, nothing reset); a peer that
never signals gives an EPTimeoutError naming the rank and stage.

Legend: W ranks, T tokens of a rank, K top-k, D hidden, E global experts, L = E / W, C capacity rows.
"""

import os

import pytest
import torch

from ep_utils import model_schedule, payload_rows, routing, spawn_ranks

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


def _protocol_worker(rank, W, buffers, spec_args, ids_all, w_all, C, rounds, repeats, timeout, silent_rank):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.ops import ep_comm as ops

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
    for rep in range(repeats):
        ops.publish(ws, ids, x)
        bufs = ops.ExchangeBuffers(ws, C, backward=False)
        ops.build_schedule(ws, bufs, rounds, timeout)
        recv = []
        for r in range(rounds):
            ops.dispatch_round(ws, bufs, r, False)
            y = _expert_rows(bufs.xr_CD, bufs.roff_L1, rank, L)
            ops.push_round(ws, bufs, r, y)
            valid = bufs.rowtab_3C[0] >= 0
            recv.append((bufs.rowtab_3C[:, valid].clone(), bufs.xr_CD[valid, :2].clone(), bufs.roff_L1.clone()))
        ops.signal_done(ws)
        ops.wait_done(ws, timeout)
        out = torch.full((T, spec.hidden), float("nan"))
        ops.reduce_slots(ws, T, w, None, out)
        ws.check()
        outs.append(out)
    return {"sched": bufs.sched.clone(), "recv": recv, "out": outs, "epoch": ws.epoch()}


def _run(W, Ts, K, E, kind, C, rounds=None, repeats=1, timeout=60.0, silent_rank=-1, seed=0):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec, max_rounds

    spec = WorkspaceSpec(W, max(max(Ts), 1), D, K, E, torch.float32)
    rounds = rounds or max_rounds(spec, C)
    ids_all = []
    for r, T in enumerate(Ts):
        if kind == "one_rank":  # every token of every rank routed to rank 0's experts
            ids_all.append(routing("uniform", T, K, E // W, seed, r))
        else:
            ids_all.append(routing(kind, T, K, E, seed, r))
    w_all = [torch.rand(T, K, generator=torch.Generator().manual_seed(r)) + 0.5 for r, T in enumerate(Ts)]
    buffers = EPWorkspace.allocate_shared(spec)
    res = spawn_ranks(_protocol_worker, W, buffers, (W, spec.max_tokens, D, K, E, torch.float32), ids_all, w_all,
                      C, rounds, repeats, timeout, silent_rank, env=ENV)
    return res, ids_all, w_all, rounds


def _check(res, ids_all, w_all, W, E):
    L = E // W
    for d in range(W):
        got = res[d]
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
])
def test_protocol(W, Ts, K, E, kind, C):
    res, ids_all, w_all, _ = _run(W, Ts, K, E, kind, C)
    _check(res, ids_all, w_all, W, E)


def test_repeated_exchanges_epochs_grow():
    res, ids_all, w_all, _ = _run(2, [5, 3], 2, 4, "hot", 32, repeats=3)
    _check(res, ids_all, w_all, 2, 4)
    assert [r["epoch"] for r in res] == [3, 3]
    assert all(torch.equal(r["out"][0], r["out"][i]) for r in res for i in range(3))


def test_silent_peer_times_out_naming_rank_and_stage():
    from megamoe.distributed import EPTimeoutError  # noqa: F401 - the worker raises it

    with pytest.raises(AssertionError) as info:
        _run(2, [3, 3], 2, 4, "uniform", 32, timeout=1.0, silent_rank=1)
    msg = str(info.value)
    assert "EPTimeoutError" in msg and "rank 0 of 2" in msg and "from rank 1" in msg and "dispatch" in msg
