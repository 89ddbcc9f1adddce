"""The m-grouped GEMM's side of the pull that runs beside it (``ops.grouped_gemm.RowPull``,
EPOptions.pull_programs), under TRITON_INTERPRET=1 in a spawned process, with a stand-in pull: a Python
``launch`` that writes A's rows (and row scales), then sets the ready flags of the blocks it was asked to.

Proves: gate/up + SwiGLU and dgrad + SwiGLU beside a pull give the bits of the plain GEMM on the same rows
(an empty expert, rows not a multiple of any block), waiting only for the blocks that hold rows, the pull is
launched exactly once, and the tiles came from the counter; a block whose flag never comes (the first, a middle or the last of the rows) turns into
stage 5 in the workspace's status word within the bound, and ``EPWorkspace.check`` raises naming the rank,
the stage and the switch; bad RowPull arguments raise ValueError before anything is launched.
(tests/test_ep_protocol_interpret.py checks the real pull's flags; tests/test_ep_layer_interpret.py and
tests/test_ep_gpu.py the whole layer with the switch.)

Legend: R rows, C capacity rows (R <= C), E experts, D hidden, F FFN width.
"""

import time

import pytest
import torch

from ep_utils import spawn_ranks

ENV = {"TRITON_INTERPRET": "1"}
R, C, D, F = 60, 96, 32, 16
# three experts, the middle one empty; the last m-tile reaches past row R into block 2, which holds no rows and
# is never flagged: a GEMM waiting for more blocks than its rows need hangs (expires) there
OFFS = [0, 40, 40, R]


def _worker(rank, W, buffers, spec_args, op, skip, timeout_s):
    from megamoe.distributed import EPTimeoutError, EPWorkspace, WorkspaceSpec
    from megamoe.ops.ep_comm import _wait_args
    from megamoe.ops.grouped_gemm import RowPull, gate_up_swiglu, swiglu_dgrad

    ws = EPWorkspace.from_shared_buffers(WorkspaceSpec(*spec_args), 1, buffers)  # as rank 1 of 2
    g = torch.Generator().manual_seed(7)
    E = len(OFFS) - 1
    off = torch.tensor(OFFS, dtype=torch.int32)
    a_src = torch.randn(C, D, generator=g)
    scale_src = torch.rand(C, generator=g) + 0.5
    w13 = torch.randn(E, 2 * F, D, generator=g) * D ** -0.5
    w2 = torch.randn(E, D, F, generator=g) * F ** -0.5
    gu = torch.randn(C, 2 * F, generator=g)
    blocks = (C + 31) // 32
    a = torch.full_like(a_src, float("nan"))  # poisoned until the stand-in pull writes it
    scale = torch.full_like(scale_src, float("nan"))
    ready = torch.zeros(1 + blocks, dtype=torch.int32)
    launches = []

    def launch():  # the stand-in pull: every row, then the flags of the used blocks but ``skip``
        launches.append(int(ready.abs().sum()))
        a.copy_(a_src)
        scale.copy_(scale_src)
        for b in range(blocks):
            if b * 32 < R and b != skip:
                ready[1 + b] = 1

    max_iters, timeout_ns, use_timer = _wait_args(timeout_s, torch.device("cpu"))
    pull = RowPull(ready, 32, ws.flags, ws.rank, max_iters, timeout_ns, use_timer, pdl=False, launch=launch)
    t0 = time.monotonic()
    if op == "gate_up":
        got = gate_up_swiglu(a, w13, off, save_preact=True, pull=pull)
        want = gate_up_swiglu(a_src, w13, off, save_preact=True)
    else:
        got = swiglu_dgrad(a, w2, off, gu, row_scale_R=scale, pull=pull)
        want = swiglu_dgrad(a_src, w2, off, gu, row_scale_R=scale_src)
    took = time.monotonic() - t0
    err = None
    try:
        ws.check()
    except EPTimeoutError as e:
        err = str(e)
    same = all(torch.equal(x[:R], y[:R]) for x, y in zip(got, want))
    return {"same": same, "launches": launches, "counter": int(ready[0]), "err": err, "took": took}


def _run(op, skip, timeout_s=30.0):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec

    spec = WorkspaceSpec(2, 4, D, 2, 4, torch.float32)
    return spawn_ranks(_worker, 1, EPWorkspace.allocate_shared(spec), (2, 4, D, 2, 4, torch.float32), op, skip,
                       timeout_s, env=ENV)[0]


def _tiles(op):
    """m-tiles x n-tiles of the interpreter's tile config for ``op`` (the counter hands out at least these)."""
    from megamoe.ops.tile_config import m_grouped_config

    cfg = m_grouped_config("gate_up" if op == "gate_up" else "dgrad_swiglu", F, D, torch.float32, interpret=True,
                           gathered=False)
    m_tiles = sum(-(-(b - a) // cfg.block_m) for a, b in zip(OFFS, OFFS[1:]))
    return m_tiles * -(-F // cfg.block_n)


@pytest.mark.parametrize("op", ["gate_up", "dgrad_swiglu"])
def test_gemm_beside_a_pull_gives_the_plain_gemms_bits(op):
    res = _run(op, skip=None)
    assert res["err"] is None, res["err"]
    assert res["same"], f"{op} beside the pull differs from the plain GEMM on the same rows"
    assert res["launches"] == [0], res["launches"]  # launched once, before any flag was set
    assert res["counter"] >= _tiles(op), (res["counter"], _tiles(op))  # every tile came from the counter


@pytest.mark.parametrize("op,skip", [("gate_up", 0), ("gate_up", 1), ("dgrad_swiglu", 1)])
def test_a_flag_that_never_comes_is_a_named_timeout(op, skip):
    """Block ``skip`` of the rows (rows 32*skip .. ; 1 is the last, partial block) never flagged: the GEMM's
    bounded wait expires (the interpreter counts spins: 0.2 s worth), writes stage 5, and ``check`` raises."""
    res = _run(op, skip=skip, timeout_s=0.2)
    msg = res["err"]
    assert msg and "rank 1 of 2" in msg and "expert GEMM" in msg and "EPOptions.pull_programs" in msg, msg
    assert res["took"] < 120, res["took"]


def _bad_worker(rank, W, buffers, spec_args):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.ops.grouped_gemm import RowPull, gate_up_swiglu

    ws = EPWorkspace.from_shared_buffers(WorkspaceSpec(*spec_args), 0, buffers)
    E = len(OFFS) - 1
    off = torch.tensor(OFFS, dtype=torch.int32)
    a, w13 = torch.zeros(C, D), torch.zeros(E, 2 * F, D)
    launches = []
    msgs = []
    for ready, idx in ((torch.zeros(2, dtype=torch.int32), None),  # too few flags for C rows
                       (torch.zeros(1 + C // 32, dtype=torch.int64), None),  # not int32
                       (torch.zeros(1 + C // 32, dtype=torch.int32), torch.arange(C, dtype=torch.int32))):  # gathered
        pull = RowPull(ready, 32, ws.flags, 0, 10, 10, False, pdl=False, launch=lambda: launches.append(1))
        try:
            if idx is None:
                gate_up_swiglu(a, w13, off, pull=pull)
            else:
                gate_up_swiglu(a, w13, off, gather_idx_R=idx, pull=pull)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return {"msgs": msgs, "launches": len(launches)}


def test_bad_row_pull_is_a_clear_error_before_any_launch():
    from megamoe.distributed import EPWorkspace, WorkspaceSpec

    spec = WorkspaceSpec(1, 4, D, 2, 4, torch.float32)
    res = spawn_ranks(_bad_worker, 1, EPWorkspace.allocate_shared(spec), (1, 4, D, 2, 4, torch.float32), env=ENV)[0]
    m = res["msgs"]
    assert m[0] and "ready_B1" in m[0] and m[1] and "ready_B1" in m[1], m
    assert m[2] and "gathered" in m[2], m
    assert res["launches"] == 0, res
