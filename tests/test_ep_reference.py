"""The expert-parallel reference (gloo, CPU processes) equals the single-process reference.

One process per rank; each builds the same global parameters and global batch from a seed, runs the
EP reference on its shard and compares its output rows and every gradient with the single-process
reference on the whole batch (float64, so only summation order can differ).
"""

import pytest
import torch
import torch.distributed as dist

from ep_utils import layout_groups, spawn_ranks
from megamoe import MoE, get_preset
from megamoe import reference as ref
from megamoe.reference_ep import moe_experts_ep


def _cfg():
    return get_preset("tiny").replace(hidden_size=16, moe_intermediate_size=8, dtype=torch.float64)


def _worker(rank, world, tokens_per_rank, routing):
    torch.manual_seed(0)
    cfg = _cfg()
    D, F, E, S, K = 16, 8, cfg.num_experts, cfg.shared_intermediate_size, cfg.top_k
    L = E // world
    T_all = sum(tokens_per_rank)
    x = torch.randn(T_all, D, dtype=torch.float64)
    w13 = torch.randn(E, 2 * F, D, dtype=torch.float64) * D ** -0.5
    w2 = torch.randn(E, D, F, dtype=torch.float64) * F ** -0.5
    sw13 = torch.randn(2 * S, D, dtype=torch.float64) * D ** -0.5
    sw2 = torch.randn(D, S, dtype=torch.float64) * S ** -0.5
    if routing == "uniform":
        ids = (torch.stack([torch.randperm(E)[:K] for _ in range(T_all)]) if T_all
               else torch.zeros(0, K, dtype=torch.long))
    elif routing == "one-rank":  # every token of every rank routed to the last rank's experts
        ids = (E - L) + torch.stack([torch.randperm(L)[:K] for _ in range(T_all)])
    else:  # one hot expert in every token's first slot
        ids = torch.stack([torch.cat([torch.tensor([3]), torch.randperm(E - 1)[:K - 1] + 4]) % E for _ in range(T_all)])
    wts = torch.rand(T_all, K, dtype=torch.float64)
    dy = torch.randn(T_all, D, dtype=torch.float64)

    # single-process reference on the global batch
    g = [t.clone().requires_grad_(True) for t in (x, wts, w13, w2, sw13, sw2)]
    out_ref = ref.moe_experts(g[0], ids, g[1], g[2], g[3], g[4], g[5])
    (out_ref * dy).sum().backward()

    lo = sum(tokens_per_rank[:rank])
    hi = lo + tokens_per_rank[rank]
    mine = slice(rank * L, (rank + 1) * L)
    p = [x[lo:hi].clone(), wts[lo:hi].clone(), w13[mine].clone(), w2[mine].clone(), sw13.clone(), sw2.clone()]
    for t in p:
        t.requires_grad_(True)
    out = moe_experts_ep(p[0], ids[lo:hi], p[1], p[2], p[3], p[4], p[5], group=None)
    (out * dy[lo:hi]).sum().backward()

    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, out_ref[lo:hi].detach(), **tol)
    torch.testing.assert_close(p[0].grad, g[0].grad[lo:hi], **tol)
    torch.testing.assert_close(p[1].grad, g[1].grad[lo:hi], **tol)
    torch.testing.assert_close(p[2].grad, g[2].grad[mine], **tol)
    torch.testing.assert_close(p[3].grad, g[3].grad[mine], **tol)
    for mine_g, ref_g in ((p[4].grad, g[4].grad), (p[5].grad, g[5].grad)):  # replicated: sum of partials
        total = mine_g.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref_g, **tol)

    # the layer: same seed -> same global weights at any EP size; EP output == single-process output
    layer_ep = MoE(cfg, backend="reference", group=dist.group.WORLD, seed=7)
    layer_1 = MoE(cfg, backend="reference", seed=7)
    torch.testing.assert_close(layer_ep.w13_LGD.detach(), layer_1.w13_LGD[mine].detach(), rtol=0, atol=0)
    xs = x.view(1, T_all, D) if T_all else x.view(1, 0, D)
    y1 = layer_1(xs)
    yep = layer_ep(xs[:, lo:hi])
    torch.testing.assert_close(yep, y1[:, lo:hi], **tol)
    layer_ep.update_expert_bias()
    layer_1.update_expert_bias()
    assert torch.equal(layer_ep.expert_bias_E, layer_1.expert_bias_E) or tokens_per_rank[rank] != T_all


@pytest.mark.parametrize("world, tokens, routing", [
    (2, [5, 7], "uniform"),
    (2, [6, 0], "uniform"),       # a rank with zero tokens
    (2, [4, 9], "one-rank"),      # worst case: everything to one rank
    (4, [3, 0, 7, 1], "uniform"),
    (4, [2, 5, 0, 4], "hot-expert"),
    (4, [0, 0, 0, 0], "uniform"),  # nobody has tokens
])
def test_ep_reference_matches_single_process(world, tokens, routing):
    spawn_ranks(_worker, world, tokens, routing, backend="gloo", timeout=120)


def _mismatch_worker(rank, world):
    D = 16 if rank == 0 else 32  # rank 1 was built with another hidden size
    x = torch.randn(3, D)
    ids = torch.zeros(3, 2, dtype=torch.long)
    w = torch.ones(3, 2)
    with pytest.raises(ValueError, match="disagree on hidden: rank 0=16, rank 1=32"):
        moe_experts_ep(x, ids, w, torch.randn(2, 16, D), torch.randn(2, D, 8), group=None)
    from megamoe.validation import check_same_across_ranks
    check_same_across_ranks(None, "same", {"hidden": 16, "dtype": torch.bfloat16})  # agreeing ranks pass
    with pytest.raises(ValueError, match=r"dtype: rank 0=bfloat16, rank 1=float32"):
        check_same_across_ranks(None, "dtypes", {"dtype": torch.bfloat16 if rank == 0 else torch.float32})


def test_mismatched_configs_across_ranks_raise_clear_errors():
    spawn_ranks(_mismatch_worker, 2, backend="gloo", timeout=120)


def _check_against_single_process(layer, rank, tokens_per_rank, ep_rank, ep, summed_grad):
    """Forward + backward of ``layer`` on this rank's tokens and of the single-process layer (same seed) on
    all of them: the output rows, every parameter's gradient summed over the ranks that share it
    (``summed_grad(name, param)``, this rank's experts only) and the bias update must equal the single
    process's (fp64 parameters to summation order, 1e-12; the fp32 router's to torch's default fp32
    tolerance)."""
    cfg = layer.config
    torch.manual_seed(0)
    x = torch.randn(1, sum(tokens_per_rank), cfg.hidden_size, dtype=torch.float64)
    dy = torch.randn(1, sum(tokens_per_rank), cfg.hidden_size, dtype=torch.float64)
    layer_1 = MoE(cfg, backend="reference", seed=7)
    lo = sum(tokens_per_rank[:rank])
    mine = slice(lo, lo + tokens_per_rank[rank])
    y = layer(x[:, mine])
    y1 = layer_1(x)
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y1[:, mine], **tol)
    (y * dy[:, mine]).sum().backward()
    (y1 * dy).sum().backward()
    L = cfg.num_experts // ep
    for name, p in layer.named_parameters():
        g = summed_grad(name, p)
        ref_grad = layer_1.get_parameter(name).grad
        if name.startswith("experts."):
            ref_grad = ref_grad[ep_rank * L:(ep_rank + 1) * L]
        torch.testing.assert_close(g, ref_grad, **(tol if g.dtype == torch.float64 else {}), msg=name)
    layer.update_expert_bias()
    layer_1.update_expert_bias()
    assert torch.equal(layer.expert_bias_E, layer_1.expert_bias_E)
    assert layer_1.expert_bias_E.abs().max() > 0  # the update did move the bias


def _dp_ep_worker(rank, world, ep, tokens_per_rank):
    """DP x EP: the layer with ``group`` = this rank's EP group and ``dp_group`` = the ranks holding the same
    experts, EP groups of consecutive then of strided ranks (one spawn for both). Each EP group computes its
    own tokens; after the data-parallel gradient sums (replicated parameters over all ranks, experts over
    their replicas) every gradient, and the bias update, equal the single-process layer's."""
    for ep_inner in (True, False):
        eps, dps = layout_groups(world, ep, ep_inner)
        groups = {tuple(g): dist.new_group(g) for g in eps + dps}  # every rank creates every group, same order
        my_ep = next(g for g in eps if rank in g)
        my_dp = groups[tuple(next(g for g in dps if rank in g))]

        def summed_grad(name, p):
            g = p.grad.clone()
            # the experts' gradients sum their EP group's tokens, the replicas add the rest; the replicated
            # parameters' are per-rank partials
            dist.all_reduce(g, group=my_dp if name.startswith("experts.") else None)  # noqa: B023 - used at once
            return g

        layer = MoE(_cfg(), backend="reference", group=groups[tuple(my_ep)], dp_group=my_dp, seed=7)
        _check_against_single_process(layer, rank, tokens_per_rank, my_ep.index(rank), ep, summed_grad)
        dist.barrier()
        for g in groups.values():  # one layout's groups gone before the next (and before the teardown)
            dist.destroy_process_group(g)


@pytest.mark.parametrize("world, ep, tokens", [
    (4, 2, [5, 0, 9, 3]),   # 2 replicas of an EP=2 group, a rank with zero tokens
    (4, 1, [4, 6, 0, 2]),   # pure data parallelism: every rank holds all experts
])
def test_dp_x_ep_matches_single_process(world, ep, tokens):
    spawn_ranks(_dp_ep_worker, world, ep, tokens, backend="gloo", timeout=120)


def _dp_group_worker(rank, world):
    g = dist.group.WORLD
    with pytest.raises(ValueError, match="dp_group must be the ranks holding the same experts"):
        MoE(_cfg(), group=g, dp_group=g)
    with pytest.raises(TypeError, match="dp_group must be a torch.distributed.ProcessGroup or None"):
        MoE(_cfg(), group=g, dp_group=[0, 1])
    # the EP group's ranks again, as another group object: its ranks hold different experts
    same_ranks = dist.new_group([0, 1])
    with pytest.raises(ValueError, match=r"dp_group \(the ranks holding the same experts\) disagree on EP rank "
                                         r"\(experts held\): rank 0=0, rank 1=1"):
        MoE(_cfg(), group=g, dp_group=same_ranks)
    MoE(_cfg(), dp_group=same_ranks)  # no EP group: every data-parallel rank holds all experts
    cfg = _cfg()
    other = cfg.replace(top_k=cfg.top_k - 1 if rank else cfg.top_k)
    with pytest.raises(ValueError, match=f"top_k: rank 0={cfg.top_k}, rank 1={cfg.top_k - 1}"):
        MoE(other, dp_group=same_ranks)
    dist.destroy_process_group(same_ranks)


def test_dp_group_errors():
    spawn_ranks(_dp_group_worker, 2, backend="gloo", timeout=120)


def _fsdp_worker(rank, world):
    """EP=2 x FSDP2: the experts sharded over their replicas (``fully_shard(moe.experts, mesh=dp)``), router and
    shared expert over all 4 ranks; the sharded gradients, gathered and scaled back to sums, the output rows
    and the bias update equal the single-process layer's, as in ``_dp_ep_worker``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    everyone = init_device_mesh("cpu", (world,), mesh_dim_names=("all",))
    layer = MoE(_cfg(), backend="reference", group=mesh["ep"].get_group(), dp_group=mesh["dp"].get_group(), seed=7)
    fully_shard(layer.router, mesh=everyone)  # fp32: a module of its own (FSDP2 wants one dtype per module)
    fully_shard(layer.experts, mesh=mesh["dp"])
    fully_shard(layer, mesh=everyone)  # the shared expert

    def summed_grad(name, p):  # FSDP2 averages over its mesh (the default: gloo has no pre-scaled sum for
        # another divide factor): x 2 (replicas) or x 4 (all ranks) gives the sums back, exactly in fp64
        return p.grad.full_tensor() * (2 if name.startswith("experts.") else world)

    _check_against_single_process(layer, rank, [5, 0, 9, 3], mesh["ep"].get_local_rank(), 2, summed_grad)


def test_ep_with_fsdp2_over_the_replicas():
    spawn_ranks(_fsdp_worker, 4, backend="gloo", timeout=120)


def _fsdp_mp_worker(rank, world):
    """FSDP2 with a bf16 MixedPrecisionPolicy on the experts and the layer: the router, wrapped on its own with no
    policy or an fp32 one, computes its logits from the fp32 weight; with a bf16 policy of its own (one policy
    passed to every fully_shard call) it gets the bf16-rounded weight. Forward and backward run in every case;
    the router's (sharded fp32) gradient is fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = get_preset("tiny").replace(hidden_size=64, moe_intermediate_size=32, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for router_policy, want in ((None, torch.float32), (MixedPrecisionPolicy(param_dtype=torch.float32), torch.float32),
                                (bf16, torch.bfloat16)):
        layer = MoE(cfg, backend="reference", seed=7)
        fully_shard(layer.router, mesh=mesh, **({"mp_policy": router_policy} if router_policy else {}))
        fully_shard(layer.experts, mesh=mesh, mp_policy=bf16)
        fully_shard(layer, mesh=mesh, mp_policy=bf16)
        seen = []
        hook = layer.router.register_forward_pre_hook(lambda m, args: seen.append(m.w_ED.dtype))  # noqa: B023
        y = layer(x)
        hook.remove()
        assert seen == [want] and y.dtype == torch.bfloat16
        y.float().square().mean().backward()
        assert layer.router.w_ED.grad.dtype == torch.float32
        assert torch.isfinite(layer.router.w_ED.grad.full_tensor()).all()


def test_fsdp2_mixed_precision_router_policy():
    spawn_ranks(_fsdp_mp_worker, 2, backend="gloo", timeout=120)
