"""DP x EP on the GPU: the fused EP path over EP subgroups of a larger job (two EP groups of 2 in 4 ranks).

Users run EP inside a node and data parallelism across nodes, so the EP group is a subgroup of the job and
several EP groups (each with its own symmetric-memory workspace) run at once. One spawned job of 4 ranks
(4 GPUs, or the ranks sharing the visible GPUs with ``MEGAMOE_TEST_EP_SHARED_GPU=1``: the protocol and
kernels, not NVLink), for EP groups of consecutive ranks ({0, 1}, {2, 3}: a node's GPUs) and strided ones
({0, 2}, {1, 3}), bf16, proves:
  * ``moe_experts_ep`` over the subgroup: output, input gradient, routing-weight gradient and the local
    experts' weight gradients bitwise equal to the single-GPU fused path on that EP group's batch (its
    ranks' tokens in group-rank order), with a rank of 0 tokens, Zipf routing;
  * ``MoE(backend="fused", group=ep_group, dp_group=...)``: output rows bitwise equal to the single-GPU
    layer on the whole job's batch (batch invariance), and the aux-loss-free bias update bitwise equal on
    every rank to the single-GPU update from the whole batch's counts.

And FSDP2 around the fused layer (one rank, NCCL: no real sharding on a one-GPU machine, but FSDP2's
gathered parameters and its gradient reduction around megamoe's kernels): ``fully_shard`` of
``moe.router``, ``moe.experts`` and the layer, with and without a (one-rank) EP group, gives the output,
the input gradient and every parameter gradient bitwise equal to the unwrapped layer's.

Legend: W ranks of the job, N EP size, T tokens of a rank, K top-k, D hidden, F FFN, E experts, L = E / N,
S shared FFN.
"""

import pytest
import torch

from ep_utils import ep_inputs, layout_groups, rank_device, shared_gpu, spawn_ranks
from ep_utils import leaf as _leaf

pytestmark = [pytest.mark.gpu]

W, N = 4, 2
D, F, K, S, E = 256, 128, 4, 128, 16
TOKENS = [64, 0, 48, 80]


def _functional(rank, dev, my_ep, group):
    """moe_experts_ep over the subgroup vs the single-GPU fused path on the EP group's batch."""
    from megamoe.functional import moe_experts
    from megamoe.functional_ep import moe_experts_ep

    w13, w2, s13, s2, xs, ids, ws, gos = ep_inputs(TOKENS, "zipf", 11, dev, E=E, D=D, F=F, S=S, K=K)
    L, e = E // N, my_ep.index(rank)
    el = slice(e * L, (e + 1) * L)
    params = (_leaf(xs[rank]), _leaf(ws[rank]), _leaf(w13[el]), _leaf(w2[el]), _leaf(s13), _leaf(s2))
    out = moe_experts_ep(params[0], ids[rank], *params[1:], group=group)
    grads = torch.autograd.grad(out, params, gos[rank])
    cat = lambda ts: torch.cat([ts[m] for m in my_ep])  # noqa: E731  the EP group's batch, group-rank order
    ref = tuple(_leaf(t) for t in (cat(xs), cat(ws), w13, w2, s13, s2))
    o1 = moe_experts(ref[0], cat(ids), *ref[1:], backend="fused")
    g1 = torch.autograd.grad(o1, ref, cat(gos))
    lo = sum(TOKENS[m] for m in my_ep[:e])
    sl = slice(lo, lo + TOKENS[rank])
    return {"out": torch.equal(out, o1[sl]), "dx": torch.equal(grads[0], g1[0][sl]),
            "dw": torch.equal(grads[1], g1[1][sl]), "dw13": torch.equal(grads[2], g1[2][el]),
            "dw2": torch.equal(grads[3], g1[3][el]), "rows": TOKENS[rank]}


def _cfg():
    from megamoe import MoEConfig
    return MoEConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, top_k=K, score_func="sigmoid",
                     n_group=4, topk_group=2, n_shared_experts=1, shared_intermediate_size=S,
                     use_expert_bias=True, bias_update_rate=1e-3, dtype=torch.bfloat16)


def _layer(rank, dev, group, dp_group):
    """The layer in a DP x EP job: output rows and the bias update against the single-GPU layer."""
    from megamoe import MoE

    cfg = _cfg()
    layer = MoE(cfg, backend="fused", group=group, dp_group=dp_group, device=dev, seed=3)
    layer_1 = MoE(cfg, backend="fused", device=dev, seed=3)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, sum(TOKENS), D, generator=g).to(dev, torch.bfloat16)
    lo = sum(TOKENS[:rank])
    y = layer(x[:, lo:lo + TOKENS[rank]])
    y1 = layer_1(x)
    layer.update_expert_bias()
    layer_1.update_expert_bias()
    return {"layer_out": torch.equal(y, y1[:, lo:lo + TOKENS[rank]]),
            "bias": torch.equal(layer.expert_bias_E, layer_1.expert_bias_E),
            "bias_moved": bool(layer_1.expert_bias_E.abs().max() > 0), "bias_E": layer.expert_bias_E.cpu()}


def _job(rank, world):
    import torch.distributed as dist

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    rep = {}
    for ep_inner in (True, False):
        eps, dps = layout_groups(world, N, ep_inner)
        groups = {tuple(g): dist.new_group(g) for g in eps + dps}  # every rank creates every group, same order
        my_ep = next(g for g in eps if rank in g)
        my_dp = next(g for g in dps if rank in g)
        tag = "consecutive" if ep_inner else "strided"
        rep[tag] = _functional(rank, dev, my_ep, groups[tuple(my_ep)])
        rep[tag].update(_layer(rank, dev, groups[tuple(my_ep)], groups[tuple(my_dp)]))
        torch.cuda.synchronize()
        dist.barrier()
    return rep


SHARED = shared_gpu()


@pytest.fixture(scope="module")
def report():
    if torch.cuda.device_count() < W and not (SHARED and torch.cuda.device_count() > 0):
        pytest.skip(f"DP x EP needs {W} GPUs, {torch.cuda.device_count()} visible "
                    "(MEGAMOE_TEST_EP_SHARED_GPU=1 runs it with the ranks sharing GPUs)")
    return spawn_ranks(_job, W, cuda=True, timeout=600)


@pytest.mark.parametrize("layout", ["consecutive", "strided"])
def test_ep_subgroup_bitwise_equal_to_single_gpu_fused(report, layout):
    for r, rep in enumerate(report):
        got = rep[layout]
        assert all(got[k] for k in ("out", "dx", "dw", "dw13", "dw2")), (r, got)


@pytest.mark.parametrize("layout", ["consecutive", "strided"])
def test_layer_bias_update_is_the_same_on_every_replica(report, layout):
    for r, rep in enumerate(report):
        got = rep[layout]
        assert got["layer_out"] and got["bias"] and got["bias_moved"], (r, {k: v for k, v in got.items()
                                                                             if k != "bias_E"})
        assert torch.equal(got["bias_E"], report[0][layout]["bias_E"]), r


def _fsdp_job(rank, world):
    """One rank: the fused layer wrapped by FSDP2 against the same layer unwrapped, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from megamoe import MoE

    dev = rank_device(rank)
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "ep"))
    everyone = init_device_mesh("cuda", (1,), mesh_dim_names=("all",))
    rep = {}
    for tag, groups in (("single_gpu", {}), ("ep_group", {"group": mesh["ep"].get_group(),
                                                          "dp_group": mesh["dp"].get_group()})):
        plain = MoE(_cfg(), backend="fused", device=dev, seed=3, **groups)
        wrapped = MoE(_cfg(), backend="fused", device=dev, seed=3, **groups)
        fully_shard(wrapped.router, mesh=everyone)
        fully_shard(wrapped.experts, mesh=mesh["dp"])
        fully_shard(wrapped, mesh=everyone)
        g = torch.Generator().manual_seed(13)
        x = torch.randn(2, 72, D, generator=g).to(dev, torch.bfloat16)
        dy = torch.randn(2, 72, D, generator=g).to(dev, torch.bfloat16)
        res = []
        for m in (plain, wrapped):
            xl = x.clone().requires_grad_(True)
            y = m(xl)
            y.backward(dy)
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for n, p in m.named_parameters()}
            res.append((y.detach(), xl.grad, grads))
        (y0, dx0, g0), (y1, dx1, g1) = res
        rep[tag] = {"out": torch.equal(y0, y1), "dx": torch.equal(dx0, dx1),
                    "grads": {n: torch.equal(g0[n], g1[n]) for n in g0},
                    "sharded": type(wrapped.experts.w13_LGD).__name__}
    return rep


@pytest.fixture(scope="module")
def fsdp_report():
    # NCCL on one GPU (FSDP2's reduce-scatter; gloo, which the shared mode uses, has no pre-scaled sum)
    return spawn_ranks(_fsdp_job, 1, cuda=True, timeout=300, env={"MEGAMOE_TEST_EP_SHARED_GPU": "0"})[0]


@pytest.mark.parametrize("tag", ["single_gpu", "ep_group"])
def test_fsdp2_wrapped_layer_keeps_the_bits(fsdp_report, tag):
    got = fsdp_report[tag]
    assert got["sharded"] == "DTensor", got
    assert got["out"] and got["dx"] and got["grads"] and all(got["grads"].values()), got
