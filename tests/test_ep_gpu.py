"""Expert parallelism on W GPUs (one spawned process per GPU, NCCL + symmetric memory).

The EP sizes come from the launch: ``MEGAMOE_TEST_EP_SIZES`` (comma-separated, default "1,2"; e.g. "1,2,4,8"
on an 8-GPU machine); sizes larger than the visible GPU count are skipped, unless the ranks share GPUs
(``MEGAMOE_TEST_EP_SHARED_GPU=1``, below; set the sizes too, e.g. "2,4,8"). W = 1 (one process, a one-rank
NCCL group, symmetric memory of one rank) runs the EP path's kernels on a one-GPU machine: the same code as
W > 1, with the pool of the only rank as the "peer" memory. For each W one spawned group
runs every case (process start and NCCL init cost more than the cases) and returns a report; the tests
below assert on it. Proves, for each W, bf16:
  * output, input gradient, routing-weight gradient and the local experts' weight gradients are bitwise
    equal to the single-GPU fused path on the global batch (every rank recomputes it from the seed);
    the shared expert's per-rank gradients sum to the EP=1 gradient within fp32 rounding;
  * the output and gradients are within 2x (+tiny) of PyTorch's own bf16 error against fp64;
  * routings: uniform, Zipf, one hot expert, every token on rank 0's experts, a rank with 0 tokens,
    ties; capacity forcing several rounds (every expert of at most C rows bitwise, the rounds being cut at
    expert boundaries; an expert of more than C rows split, to fp32 rounding); 50 repeated runs bitwise equal;
    clean under
    ``torch.cuda.set_sync_debug_mode("error")``; CUDA-graph capture and replay (forward, and forward +
    backward in one graph); a peer that never calls gives EPTimeoutError naming rank and stage within a
    few seconds (W > 1);
  * the weight gradients through ``torch._grouped_mm`` keep every bit, forced (a torch_mm "wgrad"
    entry of the KernelConfig, case "torch_wgrad") and where the table picks it on the EP path's contiguous receive
    buffers (case "torch_table", 256 rows and more per local expert); call counts show which kernel ran on which
    side;
  * the FP8 routed experts (``fp8=True``: the default capacity, a rank with zero tokens, several used rounds, an
    expert split across rounds): output and every gradient bitwise equal to the fused FP8 path on the global
    batch, the split expert's weight gradients too;
  * result rows stored from the GEMM epilogue into the owners' slots (the default) and through the separate
    push kernel (``EPOptions(push_kernel=True)``, case "push_kernel") give the same bits;
  * the shared expert inline on one stream (the default), beside the exchange on the side stream with 16 SMs
    left to the exchange (``EPOptions(comm_sms=16)``, case "overlap", also under CUDA-graph capture and the
    sync check) and with 64 (case "comm_sms_64") give the same bits; a record of each shared-expert block
    shows which way ran and the SM budget inside it.
At W = 1 the "zero_tokens" and "one_rank" cases are plain routings of one rank (no peer to leave empty).

With ``MEGAMOE_TEST_EP_SHARED_GPU=1`` the W ranks share the visible GPUs (rank r on GPU r mod n, gloo for
the setup collectives, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``; tests/ep_utils.py): every case above
at W = 2, 4, 8 on a one-GPU machine, the peers' pools mapped from the same GPU's memory and the ranks'
kernels time-sliced by the driver. That checks the protocol and the compiled kernels at W > 1 (the bits,
rounds, flags and the timeout), not NVLink and not speed.

Legend: W ranks, T tokens of a rank, K top-k, D hidden, F FFN, E experts, L = E / W, S shared FFN.
"""

import contextlib
import os
import time

import pytest
import torch

from ep_utils import ep_inputs, expert_counts, model_rounds, rank_device, shared_gpu, spawn_ranks, split_experts
from ep_utils import leaf as _leaf
from megamoe.config import EPOptions, GemmConfig, KernelConfig

pytestmark = [pytest.mark.gpu]

D, F, K, S = 256, 128, 4, 128
EP_SIZES = [int(w) for w in os.environ.get("MEGAMOE_TEST_EP_SIZES", "1,2").split(",") if w.strip()]
# MEGAMOE_TEST_EP_CASES (comma-separated, default all): the spawned ranks run only these cases (names of the
# suite's case table, plus "graphs" for the sync / CUDA-graph checks and "timeout" for the silent peer); the
# tests of the others skip. For a few cases at large W with the ranks sharing one GPU.
ONLY_CASES = {c.strip() for c in os.environ.get("MEGAMOE_TEST_EP_CASES", "").split(",") if c.strip()}


def _wanted(name: str) -> bool:
    return not ONLY_CASES or name in ONLY_CASES


def _need(report, *keys: str) -> None:
    """Skip the calling test when a case it reads was left out by MEGAMOE_TEST_EP_CASES."""
    missing = [k for k in keys if k not in report[0]]
    if missing:
        pytest.skip(f"not run (MEGAMOE_TEST_EP_CASES): {', '.join(missing)}")


def _num_experts(W: int) -> int:
    """16, or 4 per rank when W > 4 (the one-rank case needs L >= K distinct experts on rank 0)."""
    return max(16, K * W)


def _inputs(Ts, kind, seed, dev, dtype=torch.bfloat16):
    return ep_inputs(Ts, kind, seed, dev, E=_num_experts(len(Ts)), D=D, F=F, S=S, K=K, dtype=dtype)


# a "wgrad" entry that sends every weight gradient to torch._grouped_mm wherever the operands allow
TORCH_WGRAD = KernelConfig({"wgrad": GemmConfig(128, 128, 64, 8, 3, torch_mm=True)})


def _case(rank, W, group, Ts, kind, seed, capacity=None, repeats=1, options=None, kernels=None, save=(True, True),
          fp8=False):
    """One routing case; with the EP ``options`` (EPOptions) and ``kernels`` (KernelConfig, both sides), and
    ``save`` = (save_preact, save_dispatched) of the EP calls (the defaults: both kept). Counts the calls of
    torch's weight-gradient kernel (megamoe.ops.grouped_gemm.torch_wgrad) on the EP side ("ep_torch_calls": the
    repeated EP runs) and in the EP=1 fused run it is compared with ("fused_torch_calls"), so a case can check
    which kernel ran where."""
    import megamoe.ops.ep_comm as ec
    import megamoe.ops.ep_dispatch as ee
    import megamoe.ops.grouped_gemm as gg
    from megamoe.ops import _common
    real, calls = gg.torch_wgrad, []
    gg.torch_wgrad = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    real_push, row_copies = ec.push_round, []  # pushes that copy result rows (not only the backward's dots)
    ec.push_round = (lambda ws, bufs, r, y, dots=None:
                     row_copies.append(y is not None) or real_push(ws, bufs, r, y, dots))
    # per shared-expert block: (side stream asked for?, SM budget inside, current stream inside is another one?)
    real_beside, shared_blocks = ee._beside, []

    @contextlib.contextmanager
    def beside(side):
        dev = rank_device(rank)
        outer = torch.cuda.current_stream(dev)
        with real_beside(side):
            shared_blocks.append((side is not None, _common.sm_budget(dev), torch.cuda.current_stream(dev) != outer))
            yield
    ee._beside = beside
    real_pull, pulls = ec.pull_beside, []  # round 0's pulls beside a GEMM (EPOptions.pull_programs): programs
    ec.pull_beside = lambda *a, **kw: pulls.append(kw["programs"]) or real_pull(*a, **kw)
    try:
        r = _run_case(rank, W, group, Ts, kind, seed, capacity, repeats, calls, save, options, kernels, fp8)
        r["fused_torch_calls"] = len(calls) - r["ep_torch_calls"]
        r["row_copies"] = sum(row_copies)
        r["pulls_beside"] = pulls
        r["shared_blocks"] = shared_blocks
        r["sms"] = _common.sm_count(rank_device(rank).index)
        return r
    finally:
        gg.torch_wgrad = real
        ec.push_round = real_push
        ec.pull_beside = real_pull
        ee._beside = real_beside


def _rounds_and_capacity(group, T, capacity, dev) -> tuple[int, int]:
    """(rounds each exchange of the case launched, capacity C): enough rounds for the worst routing at C (1 at
    W <= 2 and more at W >= 4 with the default C, whatever the routing used)."""
    from megamoe.distributed import default_capacity_rows, get_workspace, max_rounds
    ws = get_workspace(group, num_tokens=T, hidden=D, top_k=K, num_experts=_num_experts(group.size()),
                       dtype=torch.bfloat16, device=dev)  # the case's own (cached) workspace: no collective
    C = capacity or default_capacity_rows(ws.spec)
    return max_rounds(ws.spec, C), C


def _within(a, b) -> bool:
    return bool((a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max() + 1e-30)


def _run_case(rank, W, group, Ts, kind, seed, capacity, repeats, calls, save, options, kernels, fp8=False):
    from megamoe import reference as ref
    from megamoe.functional import moe_experts
    from megamoe.functional_ep import moe_experts_ep

    dev = rank_device(rank)
    L = _num_experts(W) // W
    w13, w2, s13, s2, xs, ids, ws, gos = _inputs(Ts, kind, seed, dev)
    x, w = _leaf(xs[rank]), _leaf(ws[rank])
    l13, l2, p13, p2 = _leaf(w13[rank * L:(rank + 1) * L]), _leaf(w2[rank * L:(rank + 1) * L]), _leaf(s13), _leaf(s2)
    params = (x, w, l13, l2, p13, p2)
    runs = []
    for _ in range(repeats):
        out = moe_experts_ep(x, ids[rank], w, l13, l2, p13, p2, group=group, capacity_rows=capacity,
                             save_preact=save[0], save_dispatched=save[1], options=options, kernel_config=kernels,
                             fp8=fp8)
        runs.append((out.detach(), torch.autograd.grad(out, params, gos[rank])))
    ep_calls = len(calls)
    same = all(torch.equal(runs[0][0], o) and all(torch.equal(a, b) for a, b in zip(runs[0][1], g)) for o, g in runs)
    out, grads = runs[0]
    # EP=1 fused on the global batch
    X, Wt, G13, G2, P13, P2 = (_leaf(t) for t in (torch.cat(xs), torch.cat(ws), w13, w2, s13, s2))
    o1 = moe_experts(X, torch.cat(ids), Wt, G13, G2, P13, P2, backend="fused", kernel_config=kernels, fp8=fp8)
    g1 = torch.autograd.grad(o1, (X, Wt, G13, G2, P13, P2), torch.cat(gos))
    lo = sum(Ts[:rank])
    sl, el = slice(lo, lo + Ts[rank]), slice(rank * L, (rank + 1) * L)
    rounds, C = _rounds_and_capacity(group, Ts[rank], capacity, dev)
    st = model_rounds(expert_counts(ids, rank, L), C, rounds)
    r = {"repeat_same": same, "ep_torch_calls": ep_calls,
         "out_eq": torch.equal(out, o1[sl]), "dx_eq": torch.equal(grads[0], g1[0][sl]),
         "dw_eq": torch.equal(grads[1], g1[1][sl]), "d13_eq": torch.equal(grads[2], g1[2][el]),
         "d2_eq": torch.equal(grads[3], g1[3][el]),
         "d13_close": torch.allclose(grads[2].float(), g1[2][el].float(), rtol=2e-2, atol=1e-3),
         # per local expert: split across receive rounds (more than C rows)?, (dW13, dW2) bitwise?, within 2^-7
         # of the expert's largest entry (one bf16 rounding step either way of an fp32 sum that differs by fp32
         # rounding)?
         "split": split_experts(ids, rank, L, C), "rounds": rounds,
         # rounds the routing used on this rank (the protocol's round table, modelled in tests/ep_utils.py)
         "rounds_used": sum(1 for a, b in zip(st, st[1:]) if b > a),
         "w_exp": [(torch.equal(grads[2][l], g1[2][el][l]), torch.equal(grads[3][l], g1[3][el][l]),
                    _within(grads[2][l], g1[2][el][l]), _within(grads[3][l], g1[3][el][l])) for l in range(L)],
         "shared": [grads[4].float().cpu(), grads[5].float().cpu()],
         "shared_ref": [g1[4].float().cpu(), g1[5].float().cpu()]}
    # tolerance against fp64 (our error <= 2x torch bf16's own error + tiny)
    R64 = [t.double() for t in (torch.cat(xs), torch.cat(ws), w13, w2, s13, s2)]
    o64 = ref.moe_experts(R64[0], torch.cat(ids), *R64[1:])
    obf = ref.moe_experts(torch.cat(xs), torch.cat(ids), torch.cat(ws), w13, w2, s13, s2)
    err = (out.double() - o64[sl]).abs().max().item() if Ts[rank] else 0.0
    err_t = (obf.double() - o64).abs().max().item() if sum(Ts) else 0.0
    # FP8: bitwise against the fused FP8 path above; its error bound is tests/test_fp8_layer.py's
    r["tol_ok"] = fp8 or err <= 2 * err_t + 1e-6
    r["err"] = (err, err_t)
    return r


def _capture(fn, warmups: int):
    """torch's capture recipe: ``warmups`` calls of ``fn`` on a side stream, a barrier (every rank's eager
    exchanges done), then ``fn`` captured; returns (graph, what the captured call returned)."""
    import torch.distributed as dist

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _sync_and_graph(rep, tag, group, args, x0, go, options=None):
    """No host sync in forward + backward (after the workspace exists): ``rep["sync_free" + tag]``; CUDA-graph
    capture and replay of the forward equal to eager and following its input: ``graph_same`` / ``graph_moves``;
    the same for forward + backward captured in one graph (the input gradient): ``graph_bwd_same`` /
    ``graph_bwd_moves``."""
    from megamoe.functional_ep import moe_experts_ep

    torch.cuda.synchronize()
    x = _leaf(x0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = moe_experts_ep(*args(x), group=group, options=options)
        torch.autograd.grad(out, (x,), go)
        rep["sync_free" + tag] = True
    except RuntimeError as exc:
        rep["sync_free" + tag] = f"{exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_x = x0.clone()
    eager = moe_experts_ep(*args(static_x), group=group, options=options)
    graph, static_out = _capture(lambda: moe_experts_ep(*args(static_x), group=group, options=options), warmups=1)
    outs = []
    for i in range(3):
        static_x.copy_(x0 * (i + 1))
        graph.replay()
        outs.append(static_out.clone())
    static_x.copy_(x0)
    graph.replay()
    rep["graph_same" + tag] = torch.equal(static_out, eager)
    rep["graph_moves" + tag] = not torch.equal(outs[0], outs[1])
    _graph_fwd_bwd(rep, tag, group, args, x0, go, options=options)


def _graph_fwd_bwd(rep, tag, group, args, x0, go, capacity=None, options=None):
    """Forward + backward captured in one graph (the backward's exchange; with the overlap its side-stream
    block; with ``capacity`` several rounds and their weight-gradient kernels): every gradient (x, topk
    weights, the local experts' w13 and w2) equal to eager at two inputs: ``graph_bwd_same`` / ``graph_bwd_moves``."""
    from megamoe.functional_ep import moe_experts_ep

    x_, ids_, w_, l13_, l2_, s13_, s2_ = args(x0)

    def step(x):
        leaves = (x, _leaf(w_), _leaf(l13_), _leaf(l2_))
        out = moe_experts_ep(x, ids_, *leaves[1:], s13_, s2_, group=group, capacity_rows=capacity, options=options)
        return torch.autograd.grad(out, leaves, go)

    eager = [step(_leaf(x0 * scale)) for scale in (1, 2)]
    static_xg = _leaf(x0)
    graph_fb, static_grads = _capture(lambda: step(static_xg), warmups=2)
    replayed = []
    for scale in (2, 1):
        with torch.no_grad():
            static_xg.copy_(x0 * scale)
        graph_fb.replay()
        replayed.append([g.clone() for g in static_grads])
    same = lambda a, b: all(torch.equal(u, v) for u, v in zip(a, b))  # noqa: E731
    rep["graph_bwd_same" + tag] = same(replayed[1], eager[0]) and same(replayed[0], eager[1])
    rep["graph_bwd_moves" + tag] = not torch.equal(replayed[0][0], replayed[1][0])


def _suite(rank, W):
    import torch.distributed as dist

    from megamoe.distributed import EPTimeoutError, get_workspace
    from megamoe.functional_ep import moe_experts_ep

    group = dist.group.WORLD
    rep = {}
    def per_rank(*pattern):  # token counts of the W ranks, cycling through the pattern
        return [pattern[r % len(pattern)] for r in range(W)]

    E = _num_experts(W)
    cases = {"uniform": (per_rank(64, 48), "uniform", None, 1), "zipf": (per_rank(80), "zipf", None, 1),
             "hot": (per_rank(64), "hot", None, 1), "one_rank": (per_rank(64), "one_rank", None, 1),
             "zero_tokens": (per_rank(96, 0), "uniform", None, 1), "ties": (per_rank(40, 56), "ties", None, 1),
             # capacity 128 W: every expert of rank 0 whole (below C), 2-3 used of 255 launched rounds at each W
             "rounds": (per_rank(64), "one_rank", 128 * W, 1), "repeat50": (per_rank(64, 48), "uniform", None, 50),
             "torch_wgrad": (per_rank(64, 48), "zipf", None, 2), "torch_table": (per_rank(1024), "uniform", None, 1),
             "push_kernel": (per_rank(80, 40), "zipf", None, 1), "overlap": (per_rank(80, 40), "zipf", None, 1),
             "comm_sms_64": (per_rank(80, 40), "zipf", None, 1),
             "overlap_repeat50": (per_rank(64, 48), "uniform", None, 50),
             "overlap_rounds": (per_rank(64), "one_rank", 128 * W, 1),
             # capacity 64 W + 32 below the hot expert's 128 W rows: expert 0 split at each W
             "rounds_split": (per_rank(128), "hot", 64 * W + 32, 1),
             # what the forward keeps for the backward: nothing, only gu, only the dispatched x rows (also with
             # several used rounds, whose x rows go to a buffer of their own in both passes)
             "keep_nothing": (per_rank(80, 40), "zipf", None, 1), "keep_gu_only": (per_rank(80, 40), "zipf", None, 1),
             "keep_x_only": (per_rank(80, 40), "zipf", None, 1),
             "rounds_keep_x_only": (per_rank(64), "one_rank", 128 * W, 1),
             # round 0's pull beside its first GEMM (8 programs; 1 program), 50 times, with several used
             # rounds, and on 4096 rows per rank (128 blocks of 32 rows, the GEMM's tiles waiting on them)
             "pull_beside": (per_rank(80, 40), "zipf", None, 1), "pull_beside_1": (per_rank(96, 0), "hot", None, 1),
             "pull_beside_repeat50": (per_rank(64, 48), "uniform", None, 50),
             "pull_beside_rounds": (per_rank(64), "one_rank", 128 * W, 1),
             "pull_beside_big": (per_rank(1024), "uniform", None, 2),
             "pull_beside_big_1": (per_rank(1024), "uniform", None, 2),  # one program: the GEMM outruns it
             # the FP8 experts at the default capacity (several rounds launched at W >= 4), a rank with no tokens,
             # several used rounds, and the hot expert's 160 W rows split across rounds of 128 W
             "fp8": (per_rank(80, 40), "zipf", None, 2), "fp8_zero_tokens": (per_rank(96, 0), "hot", None, 1),
             "fp8_rounds": (per_rank(64), "one_rank", 128 * W, 1),
             "fp8_rounds_split": (per_rank(160), "hot", 128 * W, 1)}
    saves = {"keep_nothing": (False, False), "keep_gu_only": (True, False), "keep_x_only": (False, True),
             "rounds_keep_x_only": (False, True)}
    opts = {"push_kernel": EPOptions(push_kernel=True),  # result rows by the separate push kernel, not the epilogue
            "overlap": EPOptions(comm_sms=16),  # the shared expert beside the exchange, 16 SMs left to it
            "comm_sms_64": EPOptions(comm_sms=64),  # beside it, with 64 SMs left to the exchange
            "overlap_repeat50": EPOptions(comm_sms=16), "overlap_rounds": EPOptions(comm_sms=16),
            # beside the exchange and the GEMM at once
            "pull_beside": EPOptions(pull_programs=8, comm_sms=16),
            "pull_beside_1": EPOptions(pull_programs=1),
            "pull_beside_repeat50": EPOptions(pull_programs=8),
            "pull_beside_rounds": EPOptions(pull_programs=8),
            "pull_beside_big": EPOptions(pull_programs=16), "pull_beside_big_1": EPOptions(pull_programs=1)}
    kernels = {"torch_wgrad": TORCH_WGRAD}  # both sides (EP and EP=1 fused) through torch's kernel
    unknown = ONLY_CASES - set(cases) - {"graphs", "timeout"}
    if unknown:
        raise ValueError(f"MEGAMOE_TEST_EP_CASES names no case of the suite: {sorted(unknown)}")
    for name, (Ts, kind, cap, reps) in cases.items():
        if not _wanted(name):
            continue
        rep[name] = _case(rank, W, group, Ts, kind, seed=len(name), capacity=cap, repeats=reps, options=opts.get(name),
                          kernels=kernels.get(name), save=saves.get(name, (True, True)), fp8=name.startswith("fp8"))
    dev = rank_device(rank)
    w13, w2, s13, s2, xs, ids, ws, gos = _inputs([64] * W, "uniform", 7, dev)
    L = E // W
    l13, l2 = w13[rank * L:(rank + 1) * L].contiguous(), w2[rank * L:(rank + 1) * L].contiguous()
    args = lambda x: (x, ids[rank], ws[rank], l13, l2, s13, s2)  # noqa: E731
    if _wanted("graphs"):
        # inline / the shared expert beside the exchange / round 0's pull beside its GEMM (programmatic launch)
        for tag, options in (("", None), ("_overlap", EPOptions(comm_sms=16)),
                             ("_pull", EPOptions(pull_programs=8))):
            _sync_and_graph(rep, tag, group, args, xs[rank], gos[rank], options=options)
        # several rounds launched (32 W - 1 at capacity 1024), their weight-gradient kernels inside the graph
        _graph_fwd_bwd(rep, "_rounds", group, args, xs[rank], gos[rank], capacity=1024)
    torch.cuda.synchronize()
    ws0 = get_workspace(group, num_tokens=64, hidden=D, top_k=K, num_experts=E, dtype=torch.bfloat16, device=dev)
    ws0.check()
    rep["aligned"] = ws0.aligned  # the pull / push kernels' 16-byte row copies
    dist.barrier()
    # a peer that never calls: rank 1 stays out, rank 0 must get a readable error within seconds (W > 1)
    if rank == 0 and W > 1 and _wanted("timeout"):
        t0 = time.time()
        moe_experts_ep(*args(xs[0]), group=group, timeout_s=2.0)
        ws_ = get_workspace(group, num_tokens=64, hidden=D, top_k=K, num_experts=E, dtype=torch.bfloat16, device=dev)
        try:
            ws_.check()
            rep["timeout"] = "no error"
        except EPTimeoutError as exc:
            rep["timeout"] = (str(exc), time.time() - t0)
    dist.barrier()  # rank 1 stays alive (its memory mapped) until rank 0 is done
    return rep


SHARED = shared_gpu()  # the ranks share the visible GPUs (one is enough): the protocol and kernels, not NVLink


@pytest.fixture(scope="module", ids=[f"W{w}" for w in EP_SIZES],
                params=[pytest.param(w, marks=[pytest.mark.multigpu] if w > 1 and not SHARED else [])
                        for w in EP_SIZES])
def report(request):
    W = request.param
    if torch.cuda.device_count() < W and not SHARED:
        pytest.skip(f"EP size {W} needs {W} GPUs, {torch.cuda.device_count()} visible "
                    "(MEGAMOE_TEST_EP_SHARED_GPU=1 runs it with ranks sharing GPUs)")
    return spawn_ranks(_suite, W, cuda=True, timeout=400 * (1 + W // 2 if SHARED else 1))


CASES = ["uniform", "zipf", "hot", "one_rank", "zero_tokens", "ties", "repeat50", "torch_wgrad", "torch_table",
         "push_kernel", "overlap", "comm_sms_64", "overlap_repeat50", "keep_nothing", "keep_gu_only", "keep_x_only",
         "pull_beside", "pull_beside_1", "pull_beside_repeat50", "pull_beside_big", "pull_beside_big_1", "fp8",
         "fp8_zero_tokens", "fp8_rounds", "fp8_rounds_split"]


@pytest.mark.parametrize("case", CASES)
def test_bitwise_equal_to_single_gpu_fused(report, case):
    _need(report, case)
    for r, rep in enumerate(report):
        c = rep[case]
        assert c["repeat_same"], f"rank {r}: repeated runs differ"
        assert c["out_eq"] and c["dx_eq"] and c["dw_eq"], f"rank {r}: {case}: {c}"
        assert c["d13_eq"] and c["d2_eq"], f"rank {r}: {case}: expert weight gradients differ"
        assert c["tol_ok"], f"rank {r}: error vs fp64 {c['err']}"


def _torch_kernel_usable() -> bool:
    from megamoe.ops.torch_grouped_mm import torch_wgrad_device
    return (torch.cuda.is_available() and hasattr(torch, "_grouped_mm")
            and torch_wgrad_device(torch.device("cuda", 0)))


def test_weight_gradients_take_torch_kernel_where_the_table_says(report):
    """Which weight-gradient kernel ran: per EP call four weight gradients (the local experts' dW2 and
    dW13, the shared expert's pair; every rank here has tokens). ``torch_wgrad`` (forced by a torch_mm
    "wgrad" entry of the KernelConfig): all four through torch._grouped_mm on the EP side, 2 repeats, and in the
    fused run. ``torch_table`` (1024 tokens per rank: 256 rows per local expert at W = 1, more at W > 1,
    above the table's window): the table alone sends all four there. ``uniform`` (16-64 rows per local
    expert, 48-64 shared rows): none on the EP side."""
    _need(report, "torch_wgrad", "torch_table", "uniform")
    if not _torch_kernel_usable():
        pytest.skip("torch._grouped_mm weight gradients need a CUDA device of compute capability 9.x")
    for r, rep in enumerate(report):
        forced, table, uniform = rep["torch_wgrad"], rep["torch_table"], rep["uniform"]
        assert forced["ep_torch_calls"] == 2 * 4 and forced["fused_torch_calls"] == 4, (r, forced)
        assert table["ep_torch_calls"] == 4 and table["fused_torch_calls"] == 4, (r, table)
        assert uniform["ep_torch_calls"] == 0, (r, uniform["ep_torch_calls"])


@pytest.mark.parametrize("case", CASES)
def test_shared_expert_partial_gradients_sum(report, case):
    _need(report, case)
    got = [sum(parts) for parts in zip(*(rep[case]["shared"] for rep in report))]
    for a, b in zip(got, report[0][case]["shared_ref"]):
        # two bf16-rounded partials summed vs one bf16 rounding of the whole sum: a few bf16 ulps of the
        # gradient's scale (bf16 has 8 significant bits)
        assert (a - b).abs().max() <= 2 ** -6 * b.abs().max(), (a - b).abs().max()


def test_result_rows_take_the_push_asked_for(report):
    """By default the EP path's result rows go from the GEMM epilogue into the owners' slots: no row copies
    on the EP side; ``push_kernel`` (EPOptions.push_kernel) copies them with the push kernel, one forward and
    one backward copy per run and round launched (rounds: 1 at W <= 2, more at W >= 4)."""
    _need(report, "uniform", "torch_table", "push_kernel")
    for r, rep in enumerate(report):
        assert rep["uniform"]["row_copies"] == 0 and rep["torch_table"]["row_copies"] == 0, (r, rep["uniform"])
        pk = rep["push_kernel"]
        assert pk["row_copies"] == 2 * pk["rounds"], (r, pk["row_copies"], pk["rounds"])
        assert (pk["rounds"] == 1) == (len(report) <= 2), ("one round exactly when W <= 2", pk["rounds"])


def test_shared_expert_runs_beside_the_exchange_as_asked(report):
    """Every rank here has tokens and a shared expert: one shared-expert block per forward and per backward.
    By default (EPOptions.comm_sms 0) it runs inline with every SM; ``overlap`` (16) on another stream
    with all SMs but 16 for its persistent grids, ``comm_sms_64`` with all but 64. (The tests' shared expert
    is too small for a grid to reach the budget: the CPU test of ops._common.reserve_sms covers the sizing.)"""
    _need(report, "uniform", "overlap", "overlap_repeat50", "comm_sms_64")
    for r, rep in enumerate(report):
        sms = rep["uniform"]["sms"]
        assert rep["uniform"]["shared_blocks"] == [(False, sms, False)] * 2, (r, rep["uniform"]["shared_blocks"])
        assert rep["overlap"]["shared_blocks"] == [(True, sms - 16, True)] * 2, (r, rep["overlap"]["shared_blocks"])
        assert rep["overlap_repeat50"]["shared_blocks"] == [(True, sms - 16, True)] * 100, r
        assert rep["comm_sms_64"]["shared_blocks"] == [(True, sms - 64, True)] * 2, (r, rep["comm_sms_64"])


def test_fp8_cases_use_several_rounds_and_split_an_expert(report):
    """The FP8 round cases do what they are for (their bits: test_bitwise_equal_to_single_gpu_fused): rank 0 uses
    several rounds in ``fp8_rounds`` and ``fp8_rounds_split``, and the latter splits its expert 0 across them;
    the default capacity launches one round exactly when W <= 2."""
    _need(report, "fp8", "fp8_rounds", "fp8_rounds_split")
    rep = report[0]
    assert rep["fp8_rounds"]["rounds_used"] > 1 and rep["fp8_rounds_split"]["rounds_used"] > 1, rep["fp8_rounds"]
    assert rep["fp8_rounds_split"]["split"][0] and not any(rep["fp8_rounds"]["split"])
    assert (rep["fp8"]["rounds"] == 1) == (len(report) <= 2), rep["fp8"]["rounds"]


@pytest.mark.parametrize("case", ["rounds", "overlap_rounds", "rounds_split", "rounds_keep_x_only",
                                  "pull_beside_rounds"])
def test_capacity_rounds(report, case):
    """Capacity 128 W, every token on rank 0's experts (``rounds_split``: capacity 64 W + 32, expert 0 in every
    token): several used rounds. Output, dx and d topk_weights bitwise; each local expert's dW13 and dW2 bitwise
    unless it has more than C rows, so that the rounds split it (then within one bf16 rounding step of the
    expert's largest entry: fp32 partial sums in round order). ``rounds`` splits nothing: every weight gradient
    bitwise with several rounds used; ``rounds_split`` splits expert 0 at every W; ``rounds_keep_x_only`` is
    ``rounds`` keeping only the dispatched x rows (gu recomputed from them in round 0, later rounds' rows in
    buffers of their own)."""
    _need(report, case)
    n_split = 0
    assert max(rep[case]["rounds_used"] for rep in report) > 1, "the case must use several rounds"
    for r, rep in enumerate(report):
        c = rep[case]
        assert c["out_eq"] and c["dx_eq"] and c["dw_eq"], f"rank {r}: {c}"
        for l, (split, (eq13, eq2, near13, near2)) in enumerate(zip(c["split"], c["w_exp"])):
            if split:
                assert near13 and near2, f"rank {r} expert {l} (split): {(eq13, eq2, near13, near2)}"
            else:
                assert eq13 and eq2, f"rank {r} expert {l} (in one round): weight gradients differ from EP=1"
        n_split += sum(c["split"])
    if case == "rounds_split":
        assert report[0][case]["split"][0], "expert 0 (in every token, more than C rows) must be split"
    else:
        assert n_split == 0, "no expert has more than C rows here: nothing may be split"


@pytest.mark.parametrize("tag", ["", "_overlap", "_pull"])
def test_sync_free_and_cuda_graph(report, tag):
    """Inline (the default), with the shared expert beside the exchange (EPOptions(comm_sms=16)), and with
    round 0's pull beside its first GEMM (EPOptions(pull_programs=8): a programmatic dependent launch, also
    inside the captured graphs)."""
    _need(report, "sync_free" + tag)
    for r, rep in enumerate(report):
        assert rep["sync_free" + tag] is True, rep["sync_free" + tag]
        assert rep["graph_same" + tag] and rep["graph_moves" + tag], f"rank {r}: graph replay differs from eager"
        assert rep["graph_bwd_same" + tag] and rep["graph_bwd_moves" + tag], \
            f"rank {r}: forward + backward graph replay differs from eager"


def test_cuda_graph_of_several_rounds(report):
    """Forward + backward captured with capacity 1024 (32 W - 1 rounds launched; the rounds' weight-gradient and
    finalize kernels are in the graph): every gradient equal to eager."""
    _need(report, "graph_bwd_same_rounds")
    for r, rep in enumerate(report):
        assert rep["graph_bwd_same_rounds"] and rep["graph_bwd_moves_rounds"], f"rank {r}"


def test_pull_runs_beside_the_gemm_as_asked(report):
    """With EPOptions(pull_programs=n), every forward and every backward (each keeps its pre-activations here)
    runs round 0's pull beside its first GEMM with n programs; by default none does."""
    _need(report, "uniform", "pull_beside", "pull_beside_1", "pull_beside_repeat50", "pull_beside_big",
          "pull_beside_big_1")
    for r, rep in enumerate(report):
        assert rep["uniform"]["pulls_beside"] == [], (r, rep["uniform"]["pulls_beside"])
        for case, n, reps in (("pull_beside", 8, 1), ("pull_beside_1", 1, 1), ("pull_beside_repeat50", 8, 50),
                              ("pull_beside_big", 16, 2), ("pull_beside_big_1", 1, 2)):
            assert rep[case]["pulls_beside"] == [n] * (2 * reps), (r, case, rep[case]["pulls_beside"])


def test_symmetric_pools_are_16_byte_aligned(report):
    """Every rank's pool base is 16-byte aligned, so the pull and push kernels move rows in 16-byte vectors
    (tests/test_ep_comm_compile.py shows the difference in the compiled code)."""
    assert all(rep["aligned"] is True for rep in report), [rep["aligned"] for rep in report]


def test_silent_peer_times_out(report):
    if len(report) == 1:
        pytest.skip("W = 1 has no peer to stay silent")
    _need(report, "timeout")
    msg, secs = report[0]["timeout"]
    assert f"rank 0 of {len(report)}" in msg and "from rank" in msg and "dispatch" in msg, msg
    assert secs < 10, secs
