"""megamoe.MoE inside a training loop (reference backend, CPU): activation checkpointing, gradient accumulation,
module dtype casts, FSDP2 mixed precision, the aux loss's gradient path and warnings.

Proves, against the same steps without checkpointing: with torch.utils.checkpoint reentrant or not, of the layer
alone, of a whole block (the layer's input computed inside the checkpoint) or selectively (saved matmuls), and
with checkpointed and plain micro-batches mixed in one step, the expert counts, ``last_stats`` (never replaced by a
recompute), the bias update, the losses and every gradient are bitwise equal, over two steps (the second routes
with the updated bias). The aux loss keeps its gradient path under non-reentrant checkpointing; a forward that
cannot carry it (reentrant checkpointing's first forward, ``torch.no_grad()`` in training mode) raises instead of
training without it. Casting a model (``.to(dtype)``, ``.bfloat16()``, ``.half()``, ``.float()``, ``.double()``)
keeps the router weight and the bias fp32 and the counters int64, so a 1e-3 bias update still moves a bias at
0.75; a cast the backend cannot run is refused before anything changes.

The same checkpointing comparison on the fused backend: ``test_checkpointing_fused_gpu`` (``gpu`` mark; on CPU
under TRITON_INTERPRET=1 it takes about a minute, too long for this file).
"""

import copy
import warnings
import weakref
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megamoe import MoE, get_preset

D, B, S = 64, 2, 8  # hidden, sequences per micro-batch, tokens per sequence (the tiny preset's D)


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class Net(nn.Module):
    """x + moe(pre(x)): ``pre`` makes the layer's input inside a whole-block checkpoint."""

    def __init__(self, cfg, backend="reference", device="cpu"):
        super().__init__()
        self.pre = nn.Linear(D, D, device=device, dtype=cfg.dtype)
        with torch.no_grad():
            self.pre.weight.copy_(torch.randn(D, D, generator=torch.Generator().manual_seed(5)) * D ** -0.5)
        self.moe = MoE(cfg, backend=backend, device=device, seed=3)

    def block(self, x):
        return x + self.moe(self.pre(x))

    def forward(self, x, mode):
        if mode == "plain":
            return self.block(x)
        if mode.startswith("layer-"):
            return x + checkpoint(self.moe, self.pre(x), use_reentrant=mode == "layer-reentrant")
        if mode == "block-nonreentrant-nostop":  # the recompute runs the whole forward, not only what backward needs
            return checkpoint(self.block, x, use_reentrant=False, early_stop=False)
        if mode.startswith("block-"):
            return checkpoint(self.block, x, use_reentrant=mode == "block-reentrant")
        assert mode == "selective"  # non-reentrant, saves the matmuls, recomputes the rest
        return checkpoint(self.block, x, use_reentrant=False,
                          context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


def _train(net, modes, xs, steps=2, one_backward=False):
    """``steps`` steps of gradient accumulation over micro-batches xs[i] run as modes[i] (a backward per
    micro-batch, or ``one_backward`` of their summed losses); per step: the losses, each micro-batch's last_stats
    right after its forward and after the whole step, the counts before the bias update, the bias after it,
    every gradient. A backward (and the recomputes in it) leaves ``last_stats`` the very object it was."""
    out = []
    for _ in range(steps):
        for p in net.parameters():
            p.grad = None
        rec = {"loss": [], "stats": [], "stats_after_step": None}
        xs_g = [x.clone().requires_grad_(True) for x in xs]
        losses = []
        for mode, x in zip(modes, xs_g):
            y = net(x, mode)
            st = net.moe.last_stats
            rec["stats"].append((st.tokens_per_expert_E.clone(), st.aux_loss.detach().clone(), st.topk_ids_TK.clone()))
            losses.append((y.float().square().mean() + st.aux_loss) / len(xs))
            if not one_backward:
                losses[-1].backward()
                assert net.moe.last_stats is st
            rec["loss"].append(losses[-1].detach())
        if one_backward:
            torch.stack(losses).sum().backward()
            assert net.moe.last_stats is st
        st = net.moe.last_stats
        rec["stats_after_step"] = (st.tokens_per_expert_E.clone(), st.aux_loss.detach().clone(), st.topk_ids_TK.clone())
        rec["counts"] = net.moe.counts_since_update_E.clone()
        net.moe.update_expert_bias()
        rec["bias"] = net.moe.expert_bias_E.clone()
        rec["grads"] = {n: p.grad.clone() for n, p in net.named_parameters()} | {f"x{i}": x.grad for i, x in
                                                                                 enumerate(xs_g)}
        out.append(rec)
    return out


def _assert_same(got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g["counts"], w["counts"]), (step, g["counts"], w["counts"])
        assert torch.equal(g["bias"], w["bias"]), step
        for i, (a, b) in enumerate(zip(g["stats"], w["stats"])):
            assert all(torch.equal(u, v) for u, v in zip(a, b)), (step, i)
        assert all(torch.equal(u, v) for u, v in zip(g["stats_after_step"], w["stats_after_step"])), step
        assert all(torch.equal(a, b) for a, b in zip(g["loss"], w["loss"])), (step, g["loss"], w["loss"])
        for n in w["grads"]:
            assert torch.equal(g["grads"][n], w["grads"][n]), (step, n)


def _setup(coef):
    cfg = get_preset("tiny", seq_aux_loss_coef=coef).replace(dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, S, D, generator=gen) for _ in range(3)]
    return Net(cfg), xs


CASES = [  # (aux-loss coefficient, micro-batch modes); reentrant checkpointing only without an aux loss
    (1e-3, ["layer-nonreentrant"] * 3), (1e-3, ["block-nonreentrant"] * 3), (1e-3, ["selective"] * 3),
    (0.0, ["layer-reentrant"] * 3), (0.0, ["block-reentrant"] * 3), (0.0, ["layer-nonreentrant"] * 3),
    (1e-3, ["plain", "block-nonreentrant", "layer-nonreentrant"]),
    (0.0, ["block-reentrant", "plain", "layer-nonreentrant"]),
    (1e-3, ["block-nonreentrant-nostop", "plain", "block-nonreentrant-nostop"]),
]


RUNS = [(c, m, False) for c, m in CASES] + [(c, m, True) for c, m in CASES[3:4] + CASES[6:]]  # one backward:
# the recomputes run in reverse order, after every forward of the step


@pytest.mark.parametrize("coef,modes,one_backward", RUNS,
                         ids=[f"aux{c:g}-{'+'.join(m)}{'-one-backward' if o else ''}" for c, m, o in RUNS])
def test_checkpointing_matches_plain_steps(coef, modes, one_backward):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU BLAS may split work differently between calls when multi-threaded
    try:
        net, xs = _setup(coef)
        plain = copy.deepcopy(net)
        want = _train(plain, ["plain"] * len(xs), xs, one_backward=one_backward)
        got = _train(net, modes, xs, one_backward=one_backward)
    finally:
        torch.set_num_threads(threads)
    assert int(want[0]["counts"].sum()) == len(xs) * B * S * net.moe.config.top_k  # each forward counted once
    assert not torch.equal(want[1]["bias"], torch.zeros_like(want[1]["bias"]))
    _assert_same(got, want)


def test_aux_loss_keeps_its_gradient_path_under_nonreentrant_checkpointing():
    net, xs = _setup(1e-3)
    x = xs[0].clone().requires_grad_(True)
    net(x, "layer-nonreentrant")
    aux = net.moe.last_stats.aux_loss
    assert aux.requires_grad
    (g_ckpt,) = torch.autograd.grad(aux, net.moe.router.w_ED)
    net(x, "plain")
    (g_plain,) = torch.autograd.grad(net.moe.last_stats.aux_loss, net.moe.router.w_ED)
    assert torch.equal(g_ckpt, g_plain) and g_plain.abs().sum() > 0


def test_forward_that_cannot_carry_the_aux_loss_raises():
    net, xs = _setup(1e-3)
    x = xs[0].clone().requires_grad_(True)
    for mode in ("layer-reentrant", "block-reentrant"):
        with pytest.raises(RuntimeError, match="use_reentrant=False"):
            net(x, mode)
    with pytest.raises(RuntimeError, match=r"moe.eval\(\)"), torch.no_grad():
        net.moe(xs[0])
    assert int(net.moe.counts_since_update_E.sum()) == 0
    with torch.no_grad():
        net.moe.eval()(xs[0])  # eval mode: no gradient wanted, no error
        net.moe.train()(xs[0][:, :0])  # no tokens: nothing to train
        MoE(net.moe.config.replace(seq_aux_loss_coef=0.0), seed=0)(xs[0])  # no aux loss


def test_aux_loss_is_a_zero_tensor_when_off_or_without_tokens():
    cfg = get_preset("tiny").replace(dtype=torch.float32)
    for coef, T in ((0.0, 6), (1e-3, 0)):
        m = MoE(cfg.replace(seq_aux_loss_coef=coef), seed=0)
        x = torch.randn(T, D, requires_grad=True)
        y = m(x)
        aux = m.last_stats.aux_loss
        assert aux.shape == () and aux.dtype == torch.float32 and aux.device == x.device and aux.item() == 0.0
        (y.square().sum() + aux).backward()  # the README's `loss + moe.last_stats.aux_loss`, as written
    m = MoE(cfg.replace(seq_aux_loss_coef=1e-3), seed=0)
    m(torch.randn(6, D))
    assert m.last_stats.aux_loss.requires_grad and m.last_stats.aux_loss.item() > 0



def test_a_forward_releases_the_previous_statistics_before_routing():
    """The previous step's aux loss holds that step's autograd graph (the router weight's gradient accumulator
    included): a forward drops it before the router runs, so this forward builds fresh nodes (a CUDA-graph
    capture after eager steps needs that; see tests/test_cuda_graph_gpu.py)."""
    m = MoE(get_preset("tiny").replace(dtype=torch.float32, seq_aux_loss_coef=1e-3), seed=0)
    (m(torch.randn(6, D)).square().sum() + m.last_stats.aux_loss).backward()
    previous_aux = weakref.ref(m.last_stats.aux_loss)
    seen = []
    m.router.register_forward_pre_hook(lambda mod, args: seen.append(previous_aux() is None))
    m(torch.randn(6, D))
    assert seen == [True]


CASTS = {
    "to(bf16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "to(cpu, fp16)": (lambda m: m.to("cpu", torch.float16), torch.float16),
    "bfloat16()": (lambda m: m.bfloat16(), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
    "float()": (lambda m: m.float(), torch.float32),
    "double()": (lambda m: m.double(), torch.float64),
}


def _check_moe_dtypes(moe, want):
    assert moe.router.w_ED.dtype == torch.float32 and moe.expert_bias_E.dtype == torch.float32
    assert moe.counts_since_update_E.dtype == torch.int64
    assert moe.config.dtype == want
    for p in (moe.w13_LGD, moe.w2_LDF, moe.shared_w13_HD, moe.shared_w2_DS):
        assert p.dtype == want


def _check_bias_still_moves(moe):
    moe.expert_bias_E.fill_(0.75)
    moe.counts_since_update_E.copy_(torch.tensor([10, 2, 2, 2, 0, 0, 0, 0]))  # mean 2
    moe.update_expert_bias()
    want = torch.tensor([0.75 - 1e-3] + [0.75] * 3 + [0.75 + 1e-3] * 4, dtype=torch.float32)
    assert torch.equal(moe.expert_bias_E, want), moe.expert_bias_E


@pytest.mark.parametrize("cast", list(CASTS))
def test_model_casts_keep_router_bias_and_counter_dtypes(cast):
    fn, want = CASTS[cast]
    cfg = get_preset("tiny").replace(dtype=torch.float32)
    net = Net(cfg)
    x = torch.randn(B, S, D)
    net(x, "plain").sum().backward()  # gradients exist when the cast comes
    assert fn(net) is net
    assert net.pre.weight.dtype == want
    _check_moe_dtypes(net.moe, want)
    assert net.moe.router.w_ED.grad.dtype == torch.float32
    y = net(x.to(want), "plain")
    assert y.dtype == want
    y.float().square().mean().backward()
    _check_bias_still_moves(net.moe)

    from megamoe.train.model import GPT, get_model_preset  # the training demo's model, cast whole
    mcfg = get_model_preset("lm-tiny")
    gpt = fn(GPT(mcfg, lambda i: MoE(mcfg.moe, seed=i)))
    assert gpt.head.weight.dtype == want
    for moe in gpt.moe_layers():
        _check_moe_dtypes(moe, want)
        _check_bias_still_moves(moe)


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_casts_the_backend_cannot_run_are_refused_before_anything_changes():
    cfg = get_preset("tiny").replace(dtype=torch.bfloat16)
    m = MoE(cfg, backend="fused", seed=0)
    with pytest.raises(ValueError, match="fused backend supports"):
        m.double()
    with pytest.raises(ValueError, match="cannot cast the layer to torch.complex64"):
        MoE(cfg, seed=0).to(torch.complex64)
    _check_moe_dtypes(m, torch.bfloat16)
    assert m.float().config.dtype == torch.float32  # a dtype it runs is fine


# the layer returns no view (megamoe.layer.shaped_like): FSDP2 (torch >= 2.15) warns of one, since an in-place op on
# it would drop the parameters' pre-backward all-gather
@pytest.mark.filterwarnings("error:FSDP2-wrapped module:UserWarning")
def test_fsdp2_mixed_precision_keeps_router_bias_and_counter_dtypes():
    """FSDP2 (one gloo rank, in process) with a bf16 MixedPrecisionPolicy on the experts and the layer and the
    router wrapped on its own without one (docs/design.md, "Training loop"): the router computes from its fp32
    weight, its sharded weight and gradient stay fp32, FSDP2 leaves the buffers alone (bias fp32, counters
    int64) and a small bias update moves the bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = MoE(get_preset("tiny"), seed=0)  # bf16 experts, fp32 router
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(layer.router, mesh=mesh)
        fully_shard(layer.experts, mesh=mesh, mp_policy=bf16)
        fully_shard(layer, mesh=mesh, mp_policy=bf16)
        seen = []
        hook = layer.router.register_forward_pre_hook(lambda m, args: seen.append(m.w_ED.dtype))
        y = layer(torch.randn(B, S, D))
        hook.remove()
        (y.float().square().mean() + layer.last_stats.aux_loss).backward()
        assert seen == [torch.float32]
        assert layer.router.w_ED.dtype == torch.float32 and layer.router.w_ED.grad.dtype == torch.float32
        assert layer.expert_bias_E.dtype == torch.float32 and layer.counts_since_update_E.dtype == torch.int64
        assert int(layer.counts_since_update_E.sum()) == B * S * layer.config.top_k
        _check_bias_still_moves(layer)
    finally:
        dist.destroy_process_group()


def test_top1_with_normalised_weights_warns_once_at_construction():
    cfg = get_preset("tiny", top_k=1, n_group=1, topk_group=1)
    with pytest.warns(UserWarning, match="no gradient from the main loss") as record:
        MoE(cfg, seed=0)
    assert len(record) == 1
    for ok in (cfg.replace(norm_topk_prob=False), get_preset("tiny"), cfg.replace(top_k=2)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            MoE(ok, seed=0)


GPU_CASES = [CASES[i] for i in (1, 2, 4, 7, 8)]  # block and selective with the aux loss, reentrant, both mixes


@pytest.mark.gpu
@pytest.mark.parametrize("coef,modes", GPU_CASES, ids=[f"aux{c:g}-{'+'.join(m)}" for c, m in GPU_CASES])
def test_checkpointing_fused_gpu(coef, modes):
    """The checkpointing comparison on the fused backend (bf16, CUDA): bitwise equal to the plain steps."""
    cfg = get_preset("tiny", seq_aux_loss_coef=coef)
    torch.manual_seed(0)
    xs = [torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    net = Net(cfg, backend="fused", device="cuda")
    plain = copy.deepcopy(net)
    _assert_same(_train(net, modes, xs), _train(plain, ["plain"] * len(xs), xs))
