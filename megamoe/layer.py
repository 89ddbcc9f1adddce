"""``megamoe.MoE``: the DeepSeek-V3-style MoE layer as an ``nn.Module``.

Legend: T tokens, D hidden, F expert FFN, G = 2F (gate rows then up rows), E routed experts, L = E / W
local experts of this EP rank, W EP world size, K top-k, S shared FFN, H = 2S.

The module only owns parameters and chooses a backend; the math lives in ``router`` (routing, counts, balance
loss, bias update: plain PyTorch on every backend), ``functional`` (fused single-GPU Triton path),
``functional_ep`` (fused expert parallelism) and, for ``backend="reference"`` only, ``reference`` /
``reference_ep`` (the plain-PyTorch specification, imported when that backend runs).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import custom_ops
from .config import EPOptions, KernelConfig, MoEConfig
from .functional import FUSED_DTYPES, topk_select
from .router import route, router_logits, seq_balance_loss, tokens_per_expert, update_expert_bias_
from .validation import check_fp8, check_same_across_ranks, interpreter_active

__all__ = ["MoE", "RoutedExperts", "Router", "RouterStats", "SharedExpert"]

BACKENDS = ("reference", "fused")


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread. An activation-checkpoint recompute
    (``torch.utils.checkpoint``, reentrant or not, selective or not) runs the module's forward there, and so
    does nothing else in a training step; FSDP2 tells its own recompute forwards apart the same way
    (``torch.distributed.fsdp._fully_shard._fsdp_common.is_bw``). ``torch._C._current_graph_task_id`` is
    private (present in every torch this package supports, tested in tests/test_training_loop.py); without it a
    recompute cannot be told apart, which :meth:`MoE.forward` warns about once.

    False while torch.compile traces: a checkpoint inside the compiled region is recomputed by the compiled
    backward, which runs no Python (its statistics are not set again); a compiled module checkpointed from
    outside counts its recompute like a forward (docs/hf.md, torch.compile)."""
    if torch.compiler.is_compiling():
        return False
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    if graph_task_id is None:
        warnings.warn("megamoe.MoE: this torch has no torch._C._current_graph_task_id, so an activation-checkpoint "
                      "recompute cannot be told from a forward: under checkpointing the expert counts of "
                      "update_expert_bias() count twice", RuntimeWarning, stacklevel=3)
        return False
    return graph_task_id() != -1


def _keeping_dtype(fn):
    """``fn`` (a ``Module._apply`` conversion) with every tensor's dtype kept: device and layout changes
    apply, a dtype change is dropped (the tensor moves in its own dtype, from its original values)."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out if out.dtype == t.dtype else t.to(device=out.device)
    return apply


def _fp8_weights_guard(fp8: bool, *modules: nn.Module):
    """The FP8 weight cache's guard for a call of ``modules``: off (:func:`megamoe.ops.fp8_weights.uncached`) when
    one of them is wrapped by FSDP2, whose all-gathers rewrite the unsharded parameters without bumping their
    version counters; a no-op otherwise."""
    if fp8:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover - torch without FSDP2
            FSDPModule = ()
        if any(isinstance(m, FSDPModule) for m in modules):
            from .ops.fp8_weights import uncached
            return uncached()
    return contextlib.nullcontext()


def _collective_device(group) -> torch.device:
    """A device for a small collective over ``group``: the current CUDA device for an NCCL-only group, else
    the CPU (gloo, or a group with both backends)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shaped_like(out_TD: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The (T, D) result in x's shape without making it a view of another tensor (``aten._unsafe_view``, what
    ``torch.matmul`` returns when it folds batch dimensions): FSDP2 warns when a module returns a view, because an
    in-place op on one (``out += y``) drops the pre-backward hook that all-gathers the parameters."""
    if out_TD.shape == x.shape:
        return out_TD
    return torch.ops.aten._unsafe_view(out_TD, x.shape)


class Router(nn.Module):
    """The router of :class:`MoE` (``moe.router``): weight ``w_ED`` (fp32 [E, D]).

    forward(x_TD) -> logits [T, E] as ``router_dtype`` (``MoEConfig.router_dtype``) says: fp32 logits for "fp32";
    for "model", logits in x's dtype from the weight cast to it (tensor cores; the fp32 weight is the master copy,
    its gradient the cast's). megamoe's batch-invariant Triton GEMM on the fused backend
    (:func:`megamoe.functional.router_logits`), :func:`megamoe.router.router_logits` otherwise. A submodule of its
    own because its weight is fp32 while the rest of the layer is in the config's dtype, and FSDP2 wants
    one dtype per wrapped module (``fully_shard(moe.router, mesh=...)``; see :class:`MoE`).
    """

    def __init__(self, num_experts: int, hidden: int, *, device, backend: str, router_dtype: str = "fp32"):
        super().__init__()
        self.backend, self.router_dtype = backend, router_dtype
        self.w_ED = nn.Parameter(torch.empty(num_experts, hidden, device=device, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # the weight (and its gradient) stays fp32 under module dtype casts (.to(dtype), .bfloat16(), .half(),
        # .double(), a whole model's cast): routing is fp32 math; device moves apply as usual
        return super()._apply(_keeping_dtype(fn), recurse)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.backend == "fused":
            from .functional import router_logits as fused_router_logits
            return fused_router_logits(x_TD, self.w_ED, router_dtype=self.router_dtype)
        return router_logits(x_TD, self.w_ED, self.router_dtype)


class SharedExpert(nn.Module):
    """The shared expert's weights (``moe.shared_expert``): ``w13_HD`` [2S, D] (gate rows, then up rows) and
    ``w2_DS`` [D, S], in the config's dtype. No forward of its own: the routed experts' call computes it in
    the same kernel sequence (:class:`RoutedExperts`), inside :meth:`MoE.forward`, so a wrapper that
    gathers parameters around a forward (FSDP2) manages it as part of the enclosing MoE module."""

    def __init__(self, hidden: int, ffn: int, *, device, dtype: torch.dtype):
        super().__init__()
        self.w13_HD = nn.Parameter(torch.empty(2 * ffn, hidden, device=device, dtype=dtype))
        self.w2_DS = nn.Parameter(torch.empty(hidden, ffn, device=device, dtype=dtype))


class RoutedExperts(nn.Module):
    """This EP rank's routed SwiGLU experts, the experts' part of :class:`MoE` (``moe.experts``).

    Parameters: ``w13_LGD`` [L, 2F, D] (gate rows, then up rows) and ``w2_LDF`` [L, D, F], in the
    config's dtype. A submodule of its own so that a data-parallel wrapper can treat the experts apart
    from the replicated parameters: in a DP x EP job the experts are replicated over ``dp_group`` only,
    the router and the shared expert over every rank. E.g. FSDP2 shards them over the replicas with
    ``fully_shard(moe.experts, mesh=dp_mesh)`` (the split torchtitan makes for its ``GroupedExperts``
    with its ``dp_mod_ep`` mesh) and gathers them around this module's forward, which
    :meth:`MoE.forward` calls once per call.

    forward(x_TD, topk_ids_TK, topk_weights_TK, shared_w13_HD, shared_w2_DS) -> out_TD [T, D] in x's
    dtype: routed experts (over the EP group if any) + shared expert + the fp32 combine in slot order, on
    the MoE's backend (see :class:`MoE`); inputs as :func:`megamoe.functional.moe_experts` takes them.
    """

    def __init__(self, num_local_experts: int, hidden: int, ffn: int, *, device, dtype: torch.dtype, backend: str,
                 group, ep_save_preact: bool, ep_save_dispatched: bool, kernel_config: KernelConfig | None = None,
                 ep_options: EPOptions | None = None, fp8: bool = False):
        super().__init__()
        L, D, F = num_local_experts, hidden, ffn
        self.backend, self.group, self.ep_save_preact, self.fp8 = backend, group, ep_save_preact, fp8
        self.ep_save_dispatched = ep_save_dispatched
        self.kernel_config, self.ep_options = kernel_config, ep_options
        self.w13_LGD = nn.Parameter(torch.empty(L, 2 * F, D, device=device, dtype=dtype))
        self.w2_LDF = nn.Parameter(torch.empty(L, D, F, device=device, dtype=dtype))

    def forward(self, x_TD, topk_ids_TK, topk_weights_TK, shared_w13_HD=None, shared_w2_DS=None):
        with _fp8_weights_guard(self.fp8, self):
            return self._forward(x_TD, topk_ids_TK, topk_weights_TK, shared_w13_HD, shared_w2_DS)

    def _forward(self, x_TD, topk_ids_TK, topk_weights_TK, shared_w13_HD, shared_w2_DS):
        args = (x_TD, topk_ids_TK, topk_weights_TK, self.w13_LGD, self.w2_LDF, shared_w13_HD, shared_w2_DS)
        fp8 = {"fp8": True} if self.fp8 else {}  # the 16-bit calls as they were
        if self.group is not None and self.backend == "reference":
            from .reference_ep import moe_experts_ep
            return moe_experts_ep(*args, group=self.group)
        if self.group is not None:
            from .functional_ep import moe_experts_ep
            return moe_experts_ep(*args, group=self.group, save_preact=self.ep_save_preact,
                                  save_dispatched=self.ep_save_dispatched, options=self.ep_options,
                                  kernel_config=self.kernel_config, **fp8)
        if self.backend == "reference" and torch.compiler.is_compiling():  # one opaque op (the spec syncs)
            return custom_ops.reference_moe_experts(*args, recipe="fp8" if self.fp8 else "native")
        if self.backend == "reference":
            from . import reference
            return (reference.moe_experts_fp8 if self.fp8 else reference.moe_experts)(*args)
        from .functional import moe_experts
        return moe_experts(*args, backend="fused", kernel_config=self.kernel_config, **fp8)


_MOVED_KEYS = {"router_w_ED": "router.w_ED", "w13_LGD": "experts.w13_LGD", "w2_LDF": "experts.w2_LDF",
               "shared_w13_HD": "shared_expert.w13_HD", "shared_w2_DS": "shared_expert.w2_DS"}


def _old_keys_moved(module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: state dicts written before the parameters moved into submodules (top-level
    keys ``router_w_ED``, ``w13_LGD``, ... under ``prefix``) load into them. The parameter order is the
    same as before, so optimizer state dicts keep matching too."""
    for old, new in _MOVED_KEYS.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)


@dataclass
class RouterStats:
    """Statistics of the last forward (an activation-checkpoint recompute leaves them alone).

    tokens_per_expert_E: int64 [E] device tensor, (token, slot) pairs of this rank's tokens per global expert.
    aux_loss: scalar sequence-wise balance loss (DeepSeek-V3 eq. 17-20), with its gradient path to the router
        weight and the input, ready for ``loss + moe.last_stats.aux_loss``. Always a tensor: a zero fp32 scalar
        on the input's device (no gradient) when the coefficient is 0 or the forward had no tokens.
    topk_ids_TK: int64 [T, K] routing of the last forward (detached), e.g. to save a routing trace.
    """

    tokens_per_expert_E: torch.Tensor
    aux_loss: torch.Tensor
    topk_ids_TK: torch.Tensor


class MoE(nn.Module):
    """Router + routed SwiGLU experts (sharded over an EP group) + shared expert, combined in fp32.

    Args:
        config: the layer's :class:`MoEConfig`.
        backend: ``"reference"`` (plain PyTorch, any device, host-synchronous) or ``"fused"`` (Triton,
            CUDA, no host sync, bitwise deterministic and batch-invariant).
        group: expert-parallel process group (None: all experts on this device). Rank r of the group
            owns global experts [r*L, (r+1)*L). Router, bias and shared expert are replicated.
        dp_group: data-parallel process group of this layer's experts, or None: the ranks that hold the
            same experts as this one (the same EP rank in the other replicas of the EP group; with no
            EP group, every data-parallel rank). Only the aux-loss-free bias update uses it: routing counts
            are summed over ``group`` and then ``dp_group``, i.e. over every rank that routes tokens
            through the layer, so every replica applies the same update (Megatron-core's
            ``finalize_model_grads._update_router_expert_bias`` all-reduces tokens per expert over its
            TP x CP x DP ranks for the same reason). Without it, the replicas of a DP x EP job would
            update their biases from their own tokens only and drift apart. Gradients are the caller's
            to reduce (megamoe.train shows one way).
        device: where parameters are created. seed: parameter init seed; the same seed on every rank
            gives the same global weights at every EP size (None: torch's global RNG, which differs
            between processes unless each seeds it alike).
        ep_save_preact: fused backend with a group only: keep the routed gate/up pre-activations of
            the received rows from forward to backward (C x 2F elements per call, e.g. 537 MB for
            deepseek-v3 at W >= 2 and the default C = 65536 for 4096 tokens per rank) instead of recomputing
            them in the backward; same bits either way (megamoe.functional_ep.moe_experts_ep,
            ``save_preact``).
        ep_save_dispatched: fused backend with a group only: keep the x rows this rank's experts received
            in the forward's round-0 dispatch (C x D elements per call, e.g. 940 MB = 0.875 GiB for
            deepseek-v3 there) so that the backward's round 0 pulls only the output-gradient rows and
            weights; same bits either way (``save_dispatched``). Both are held per layer call until its
            backward, so they add up across a model's layers: when memory is short, turn this one off
            first (it saves far less time than ep_save_preact).
        kernel_config: fused backend only: tile overrides of the expert GEMMs (:class:`megamoe.config.KernelConfig`,
            for A/B runs and sweeps; None: the checked-in table).
        ep_options: fused backend with a group only: variants of the NVLink exchange
            (:class:`megamoe.config.EPOptions`, all off by default; to measure over NVLink). Same bits either way.
        fp8: the routed experts' GEMMs (forward, input and weight gradients) in block-scaled FP8, the
            DeepSeek-V3 recipe (docs/fp8.md; ``backend="reference"``: megamoe.reference.moe_experts_fp8, one
            device). Parameters and their gradients stay in ``config.dtype`` (the master copy), the router and
            the shared expert in their 16-bit path. Needs ``config.dtype`` bf16, fp16 or fp32, hidden and expert
            FFN sizes multiples of 128 and, on CUDA, a GPU with FP8 tensor cores (checked here, ValueError /
            TypeError naming the constraint); never a silent fallback. A layer option, not a config field: the
            config describes the model, and the same checkpoint trains in either mode.

    Parameters (names carry shapes), in three submodules: ``router.w_ED`` fp32 (:class:`Router`),
    ``experts.w13_LGD`` / ``experts.w2_LDF`` (:class:`RoutedExperts`) and ``shared_expert.w13_HD`` /
    ``shared_expert.w2_DS`` (:class:`SharedExpert`, None without a shared expert), in ``config.dtype``;
    also readable as ``moe.router_w_ED``, ``moe.w13_LGD``, ``moe.w2_LDF``, ``moe.shared_w13_HD``,
    ``moe.shared_w2_DS`` (state dicts with those earlier top-level keys still load); buffer
    ``expert_bias_E`` (fp32, selection only). With FSDP2 in a DP x EP job: ``fully_shard(moe.router,
    mesh=all_ranks)``, ``fully_shard(moe.experts, mesh=dp_mesh)``, then ``fully_shard(moe, mesh=all_ranks)``
    (the shared expert), with gradient divide factors chosen by the caller (docs/ep.md).

    Forward: ``x [..., D]`` of any float dtype -> same shape and dtype. ``x`` is cast to ``config.dtype`` for
    the experts and the router (logits as ``config.router_dtype`` says; scores in fp32). Sequences for the
    balance loss are the second-to-last dimension of ``x`` (all tokens form one sequence for 2-D input). A
    training-mode forward adds its routing counts to ``counts_since_update_E`` for :meth:`update_expert_bias`
    and sets ``last_stats``; an activation-checkpoint recompute (a forward run inside the backward) does
    neither, so checkpointed and plain forwards count alike (docs/design.md, "Training loop").

    Dtype casts of the module or of a model holding it (``.to(dtype)``, ``.bfloat16()``, ``.half()``,
    ``.float()``, ``.double()``): the experts and the shared expert follow the cast and ``config`` follows
    them (``config.dtype``); ``router.w_ED`` and ``expert_bias_E`` stay fp32 and the counters int64 (device
    moves apply to all). A cast the backend cannot run (float64 on the fused backend, a non-float dtype) raises
    ValueError before anything changes.

    Raises ValueError for a bad backend, an E not divisible by the group size, ``dp_group`` the same
    group of several ranks as ``group`` or a ``dp_group`` whose ranks hold different experts (EP rank, EP
    size) or disagree on the config (checked at construction with one all-gather over ``dp_group``, a
    collective: every rank of it constructs the layer), or a wrong input shape or device; RuntimeError for a
    training-mode forward with an aux loss (``seq_aux_loss_coef > 0``) under ``torch.no_grad()``, which
    includes reentrant activation checkpointing's first forward: its aux loss could not train the router
    (use ``use_reentrant=False``, or ``moe.eval()`` for forwards without gradients); TypeError for a
    group that is not a ProcessGroup, a non-floating input, a non-bool ep_save_preact / ep_save_dispatched or a
    kernel_config / ep_options of another type; FloatingPointError for non-finite router logits on CPU under
    ``nan_policy="raise"`` (on CUDA a device-side assert, no sync).
    """

    def __init__(self, config: MoEConfig, *, backend: str = "reference", group=None, dp_group=None,
                 device=None, seed: int | None = None, ep_save_preact: bool = True,
                 ep_save_dispatched: bool = True, kernel_config: KernelConfig | None = None,
                 ep_options: EPOptions | None = None, fp8: bool = False):
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"megamoe.MoE: config must be a MoEConfig, got {type(config).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"megamoe.MoE: backend must be one of {BACKENDS}, got {backend!r}")
        for name, g in (("group", group), ("dp_group", dp_group)):
            if g is not None and not isinstance(g, dist.ProcessGroup):
                raise TypeError(f"megamoe.MoE: {name} must be a torch.distributed.ProcessGroup or None, got "
                                f"{type(g).__name__}")
        if group is not None and group is dp_group and dist.get_world_size(group) > 1:  # (one rank: harmless)
            raise ValueError("megamoe.MoE: dp_group must be the ranks holding the same experts (one per EP "
                             "group), not the EP group itself")
        if backend == "fused" and config.dtype not in FUSED_DTYPES:
            raise ValueError(f"megamoe.MoE: backend='fused' supports dtypes {FUSED_DTYPES}, config has {config.dtype}; "
                             "use backend='reference' for float64")
        for name, flag in (("ep_save_preact", ep_save_preact), ("ep_save_dispatched", ep_save_dispatched)):
            if not isinstance(flag, bool):
                raise TypeError(f"megamoe.MoE: {name} must be a bool, got {flag!r}")
        for name, value, cls in (("kernel_config", kernel_config, KernelConfig), ("ep_options", ep_options, EPOptions)):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"megamoe.MoE: {name} must be a megamoe.config.{cls.__name__} or None, got "
                                f"{type(value).__name__}")
        self._check_fp8(fp8, config, backend, group, device)
        if config.top_k == 1 and config.norm_topk_prob:
            warnings.warn("megamoe.MoE: top_k=1 with norm_topk_prob=True makes every routing weight s/s = 1 "
                          "(times routed_scaling_factor), so the router gets no gradient from the main loss, only "
                          "from the balance loss if any; set norm_topk_prob=False to train it through the gate "
                          "value (Switch Transformer style)", UserWarning, stacklevel=2)
        self.config = config
        self.backend = backend
        self.fp8 = fp8
        self.ep_save_preact = ep_save_preact
        self.ep_save_dispatched = ep_save_dispatched
        self.group = group
        self.dp_group = dp_group
        self.ep_size = dist.get_world_size(group) if group is not None else 1
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        c = config
        L = c.local_experts(self.ep_size)
        self.num_local_experts = L
        self.expert_offset = self.ep_rank * L
        D, F, S, E = c.hidden_size, c.moe_intermediate_size, c.shared_intermediate_size, c.num_experts
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            # the replicas must hold the same experts of the same layer, or their summed counts (and their
            # biases) would mix different experts: one all-gather of a few ints, once, at construction
            check_same_across_ranks(dp_group, "MoE dp_group", {
                "EP rank (experts held)": self.ep_rank, "EP size": self.ep_size, "num_experts": E, "hidden": D,
                "moe_intermediate_size": F, "top_k": c.top_k, "dtype": c.dtype}, _collective_device(dp_group),
                group_name="dp_group (the ranks holding the same experts)",
                hint=" (ranks numbered within dp_group). Pass one rank per EP group, each with this rank's EP "
                     "rank, e.g. mesh['dp'].get_group() of a DeviceMesh with dims ('dp', 'ep'); docs/ep.md, DP x EP")
        # registered in this order, so parameters() keeps the order of the earlier flat layout
        self.router = Router(E, D, device=device, backend=backend, router_dtype=c.router_dtype)
        self.experts = RoutedExperts(L, D, F, device=device, dtype=c.dtype, backend=backend, group=group,
                                     ep_save_preact=ep_save_preact, ep_save_dispatched=ep_save_dispatched,
                                     kernel_config=kernel_config, ep_options=ep_options, fp8=fp8)
        self.shared_expert = SharedExpert(D, S, device=device, dtype=c.dtype) if S else None
        self.register_buffer("expert_bias_E", torch.zeros(E, device=device) if c.use_expert_bias else None)
        self.register_buffer("counts_since_update_E", torch.zeros(E, dtype=torch.int64, device=device),
                             persistent=False)
        self.last_stats: RouterStats | None = None
        self.register_load_state_dict_pre_hook(_old_keys_moved)
        self.reset_parameters(seed)

    @property
    def router_w_ED(self) -> nn.Parameter:
        """``router.w_ED``: the router weight [E, D], fp32."""
        return self.router.w_ED

    @property
    def w13_LGD(self) -> nn.Parameter:
        """``experts.w13_LGD``: this rank's routed gate/up weights [L, 2F, D]."""
        return self.experts.w13_LGD

    @property
    def w2_LDF(self) -> nn.Parameter:
        """``experts.w2_LDF``: this rank's routed down weights [L, D, F]."""
        return self.experts.w2_LDF

    @property
    def shared_w13_HD(self) -> nn.Parameter | None:
        """``shared_expert.w13_HD`` [2S, D], or None without a shared expert."""
        return self.shared_expert.w13_HD if self.shared_expert is not None else None

    @property
    def shared_w2_DS(self) -> nn.Parameter | None:
        """``shared_expert.w2_DS`` [D, S], or None without a shared expert."""
        return self.shared_expert.w2_DS if self.shared_expert is not None else None

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Normal init, std D^-1/2 for router / w13 / shared w13 and F^-1/2 (S^-1/2) for w2.

        With a seed, global expert e is drawn from its own generator seeded by (seed, e), so the same
        seed gives the same global weights at every EP size.
        """
        c = self.config
        D, F, S = c.hidden_size, c.moe_intermediate_size, c.shared_intermediate_size
        dev = self.w13_LGD.device

        def gen(stream: int) -> torch.Generator | None:
            if seed is None:
                return None
            g = torch.Generator(device=dev)
            g.manual_seed((seed * 1_000_003 + stream) % (2**63))
            return g

        self.router_w_ED.normal_(0.0, D ** -0.5, generator=gen(10**6))
        for i in range(self.num_local_experts):
            e = self.expert_offset + i
            self.w13_LGD[i].normal_(0.0, D ** -0.5, generator=gen(2 * e))
            self.w2_LDF[i].normal_(0.0, F ** -0.5, generator=gen(2 * e + 1))
        if S:
            self.shared_w13_HD.normal_(0.0, D ** -0.5, generator=gen(10**6 + 1))
            self.shared_w2_DS.normal_(0.0, S ** -0.5, generator=gen(10**6 + 2))
        if self.expert_bias_E is not None:
            self.expert_bias_E.zero_()

    def extra_repr(self) -> str:
        c = self.config
        return (f"D={c.hidden_size}, F={c.moe_intermediate_size}, E={c.num_experts}, K={c.top_k}, "
                f"local_experts={self.num_local_experts} (EP rank {self.ep_rank}/{self.ep_size}), "
                f"shared_S={c.shared_intermediate_size}, score={c.score_func}, groups={c.n_group}/{c.topk_group}, "
                f"scale={c.routed_scaling_factor}, dtype={c.dtype}, router_dtype={c.router_dtype}, "
                f"backend={self.backend}" + (", fp8=True" if self.fp8 else ""))

    @staticmethod
    def _check_fp8(fp8, config: MoEConfig, backend: str, group, device) -> None:
        if not isinstance(fp8, bool):
            raise TypeError(f"megamoe.MoE: fp8 must be a bool, got {fp8!r}")
        if not fp8:
            return
        if backend == "reference" and group is not None:
            raise ValueError("megamoe.MoE: fp8 with backend='reference' runs on one device (group=None); under "
                             "expert parallelism use backend='fused'")
        dev = torch.device(device) if device is not None else None
        check_fp8("megamoe.MoE", config.hidden_size, config.moe_intermediate_size, config.dtype,
                  dev if backend == "fused" else None)

    def _shared(self):
        return self.shared_w13_HD, self.shared_w2_DS

    def _config_after(self, fn) -> MoEConfig:
        """The config once the conversion ``fn`` has reached the experts (config.dtype follows them), checked
        before anything changes: ``fn`` applied to an empty tensor in the experts' dtype tells its dtype."""
        c = self.config
        to = fn(torch.empty(0, dtype=c.dtype, device=self.w13_LGD.device)).dtype
        if to == c.dtype:
            return c
        if self.fp8:
            try:
                check_fp8("megamoe.MoE", c.hidden_size, c.moe_intermediate_size, to, None)
            except TypeError as e:
                raise ValueError(f"megamoe.MoE: cannot cast an fp8 layer to {to}: {e}") from None
        if self.backend == "fused" and to not in FUSED_DTYPES:
            raise ValueError(f"megamoe.MoE: cannot cast a backend='fused' layer to {to}: the fused backend supports "
                             f"{FUSED_DTYPES} (backend='reference' runs float64)")
        try:
            return c.replace(dtype=to)
        except ValueError as e:
            raise ValueError(f"megamoe.MoE: cannot cast the layer to {to}: {e}") from None

    def _apply(self, fn, recurse=True):
        # Module dtype casts (.to(dtype), .half(), a whole model's .bfloat16(), ...) reach the experts and the
        # shared expert, and config.dtype follows them; the router (Router._apply) and the fp32 bias / int64
        # counters keep their dtypes (a bias near 0.75 in bf16 could not move by bias_update_rate = 1e-3).
        config = self._config_after(fn) if recurse else self.config
        if recurse:
            for module in self.children():
                module._apply(fn)
        super()._apply(_keeping_dtype(fn), recurse=False)
        self.config = config
        return self

    def _check_aux_loss_can_train(self, x: torch.Tensor) -> None:
        if (self.config.seq_aux_loss_coef > 0 and x.numel() and not torch.is_grad_enabled()
                and (self.router.w_ED.requires_grad or x.requires_grad)):
            raise RuntimeError(
                "megamoe.MoE: a training-mode forward with an aux loss (seq_aux_loss_coef="
                f"{self.config.seq_aux_loss_coef}) ran without gradients (torch.no_grad(), or the first forward of "
                "reentrant activation checkpointing), so last_stats.aux_loss would have no gradient path and the "
                "balance loss would silently not train the router. Checkpoint with "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), call moe.eval() for forwards without "
                "gradients, or set seq_aux_loss_coef=0")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"megamoe.MoE: input must be a floating-point tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() < 1 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"megamoe.MoE: input last dim must be D={c.hidden_size}, got shape {tuple(x.shape)}")
        if x.device != self.w13_LGD.device:
            raise ValueError(f"megamoe.MoE: input on {x.device}, parameters on {self.w13_LGD.device}")
        if self.backend == "fused" and not x.is_cuda and not interpreter_active():
            raise ValueError(f"megamoe.MoE: backend='fused' runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), "
                             f"got an input on {x.device}; use backend='reference' on CPU")
        # A forward inside the backward is an activation-checkpoint recompute: it computes what the original
        # forward did (a non-reentrant checkpoint recomputes the aux loss's saved tensors too) but neither
        # counts again nor replaces the original forward's statistics.
        recompute = in_backward()
        if not recompute:
            # Drop the previous forward's statistics first: their aux loss holds that forward's autograd graph,
            # whose nodes (the router weight's gradient accumulator among them) would otherwise be reused by
            # this forward, stream and all, which breaks a CUDA-graph capture that follows eager steps.
            self.last_stats = None
        if self.training and not recompute:
            self._check_aux_loss_can_train(x)
        in_dtype = x.dtype
        x_TD = x.reshape(-1, c.hidden_size).to(c.dtype).contiguous()  # strided input: one copy, same math
        seq_len = x.shape[-2] if x.dim() >= 3 else x_TD.shape[0]

        logits_TE = self.router(x_TD)
        r = route(x_TD, self.router_w_ED, self.expert_bias_E, c, logits_TE=logits_TE,
                  select=topk_select if self.backend == "fused" else None)
        with _fp8_weights_guard(self.fp8, self):  # the layer sharded as a whole (its experts: RoutedExperts)
            out_TD = self.experts(x_TD, r.topk_ids_TK, r.topk_weights_TK, *self._shared())

        if c.seq_aux_loss_coef > 0 and x_TD.shape[0] > 0:
            aux = seq_balance_loss(r.scores_TE, r.topk_ids_TK, seq_len, c.top_k, c.seq_aux_loss_coef)
        else:  # a tensor all the same, so that `loss + moe.last_stats.aux_loss` works as written
            aux = torch.zeros((), dtype=torch.float32, device=x.device)
        if not recompute:
            counts_E = tokens_per_expert(r.topk_ids_TK, c.num_experts)
            if self.training:  # eval forwards do not steer the aux-loss-free bias
                with torch.no_grad():
                    self.counts_since_update_E += counts_E
            self.last_stats = RouterStats(counts_E, aux, r.topk_ids_TK.detach())
        return shaped_like(out_TD.to(in_dtype), x)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Aux-loss-free bias update from the counts of training-mode forwards since the last call.

        Counts (int64) are summed over ``group`` and then ``dp_group`` with all-reduces (stream-ordered,
        no host sync; integers, so exact in any order), so every rank of the job applies the same update.
        Call on every rank of both groups. No-op when the config has no expert bias.
        """
        counts_E = self.counts_since_update_E
        if self.expert_bias_E is not None:
            groups = [g for g in (self.group, self.dp_group) if g is not None]
            if groups:
                counts_E = counts_E.clone()
            for g in groups:
                dist.all_reduce(counts_E, group=g)
            update_expert_bias_(self.expert_bias_E, counts_E, self.config.bias_update_rate)
        self.counts_since_update_E.zero_()
