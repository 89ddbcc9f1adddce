"""megamoe in Hugging Face transformers (>= 5): an experts implementation and a whole-block swap.

Legend: T tokens, D hidden size, F routed-expert FFN size, G = 2F (gate rows then up rows), E routed
experts, K top-k, S shared-expert FFN size, H = 2S.

Both run on the model's own parameters (the same tensor objects, so ``state_dict()`` keys, checkpoints,
optimizers built before or after, and ``save_pretrained`` are unchanged):

1. The experts implementation ``"megamoe"``. Importing this module registers it in transformers'
   ``ExpertsInterface`` (:func:`register` does the same, idempotently, for code that wants the step
   written out); then pick it like any other: ``from_pretrained(..., experts_implementation="megamoe")``,
   ``Model(config)`` after ``config._experts_implementation = "megamoe"``, or
   ``model.set_experts_implementation("megamoe")``. The model's router still picks the experts; megamoe
   runs the routed experts and their weighted sum (:func:`megamoe.functional.moe_experts`): the fused
   Triton kernels for CUDA tensors in bf16 / fp16 / fp32, megamoe's plain-PyTorch reference
   (:func:`megamoe.reference.moe_experts`) on any other device (CPU) or dtype (fp64). It serves experts
   modules that are SwiGLU with concatenated [gate; up] rows (gate first) and no biases, e.g. Qwen3-MoE,
   DeepSeek-V3, GLM-4.5 (Glm4Moe), Mixtral; others (GPT-OSS: biases, interleaved rows, clamped gate)
   raise :class:`UnsupportedModelError` naming each reason at their first forward.
2. :func:`swap_moe_blocks` replaces each MoE block whose router megamoe implements exactly (Qwen3-MoE and
   Mixtral: softmax top-k, renormalised; DeepSeek-V3 and GLM-4.5: sigmoid, group-limited top-k with the
   ``e_score_correction_bias`` selection bias and ``routed_scaling_factor``) by a :class:`MegaMoEBlock`:
   router logits in megamoe's batch-invariant GEMM, in the dtype the family's router computes them
   (``MoEConfig.router_dtype``: the model dtype on tensor cores for Qwen3-MoE and Mixtral, fp32 for
   DeepSeek-V3 and GLM-4.5), megamoe's routing (scores in fp32), and the routed plus shared experts in one
   fused call. It keeps the block's ``gate``, ``experts`` and ``shared_experts`` submodules, so parameter names
   and tensors are the model's.

Numerics: megamoe rounds where :mod:`megamoe.reference` says (SwiGLU in fp32 rounded once, weighted sum
over the K experts in fp32, one cast), where transformers' ``eager`` rounds each product and sum to the
model dtype: the results agree within bf16 rounding, not bit for bit. The swapped router computes its logits
in the family's dtype: on the reference path (CPU) with transformers' own ``F.linear``, so the logits are
eager's bits; on the fused kernels megamoe's GEMM accumulates in another order than cuBLAS, so a logit may
differ by one rounding step and a token whose top-k scores tie that closely may pick another expert. Exact
ties go to the lower expert id in megamoe (``torch.topk`` leaves their order unspecified).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import router as routing  # routing math (megamoe.router)
from ..config import MoEConfig
from ..functional import FUSED_DTYPES, moe_experts, router_logits, topk_select
from ..layer import RouterStats, in_backward, shaped_like

try:
    from transformers.integrations.moe import ExpertsInterface
except ImportError as exc:  # transformers missing, or older than the experts interface (5.0)
    raise ImportError("megamoe.integrations.transformers needs transformers >= 5 with its experts interface "
                      "(transformers.integrations.moe.ExpertsInterface): pip install 'megamoe[hf]'") from exc

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "MegaMoEBlock",
    "UnsupportedModelError",
    "experts_forward",
    "moe_config_of",
    "register",
    "swap_moe_blocks",
]

EXPERTS_IMPLEMENTATION = "megamoe"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class UnsupportedModelError(ValueError):
    """A transformers module megamoe cannot run exactly; the message names the module and every reason."""


def _backend_for(x: torch.Tensor) -> str:
    """"fused" for CUDA tensors in a fused dtype, "reference" otherwise (CPU, fp64)."""
    return "fused" if x.is_cuda and x.dtype in FUSED_DTYPES else "reference"


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


# ---------------------------------------------------------------------------------------------------
# 1. the "megamoe" experts implementation
# ---------------------------------------------------------------------------------------------------
def _experts_problems(experts: nn.Module) -> list[str]:
    """Why megamoe cannot run this experts module exactly (empty: it can). Host metadata only."""
    why = []
    if not getattr(experts, "has_gate", True):
        why.append("its experts are not gated (an up projection and an activation, no gate)")
    if getattr(experts, "has_bias", False):
        why.append("its experts have biases (megamoe's experts are bias-free)")
    if not getattr(experts, "is_concatenated", True):
        why.append("its gate and up rows are interleaved (megamoe needs [gate; up], gate rows first)")
    if getattr(experts, "is_transposed", False):
        why.append("its expert weights are stored transposed ([E, D, 2F]; megamoe would copy them every step)")
    if getattr(experts, "has_post_expert_norm", False):
        why.append("its experts apply a norm after the down projection")
    if getattr(experts, "_is_expert_parallel", False):
        why.append("it runs transformers' expert parallelism (megamoe.MoE has its own)")
    gate_fn = getattr(type(experts), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        why.append(f"it has its own gating function ({type(experts).__name__}._apply_gate, e.g. a clamped SwiGLU)")
    act = getattr(experts, "act_fn", None)
    if act is not None and not _is_silu(act):
        why.append(f"its activation is {type(act).__name__}, not SiLU (megamoe's experts are SwiGLU)")
    w13, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
        why.append("it has no gate_up_proj / down_proj expert tensors")
    elif getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        pass  # shapes follow the layout already named above
    elif w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] != 2 * w2.shape[2] \
            or w13.shape[2] != w2.shape[1]:
        why.append(f"its expert weights are gate_up_proj {tuple(w13.shape)} / down_proj {tuple(w2.shape)}, "
                   "not [E, 2F, D] / [E, D, F]")
    elif w13.dtype not in _FLOAT_DTYPES or w2.dtype != w13.dtype:
        why.append(f"its expert weights are {w13.dtype} / {w2.dtype} (quantized or mixed-dtype experts)")
    return why


def _refuse(name: str, what: str, why: list[str]) -> None:
    if why:
        raise UnsupportedModelError(f"megamoe cannot run {name} as {what}: " + "; ".join(why))


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"megamoe"`` experts implementation: ``self`` is the model's experts module.

    Args:
        hidden_states: [T, D] (any leading shape) tokens; cast to the experts' dtype if different (as
            transformers' ``grouped_mm`` does under autocast), the result cast back.
        top_k_index: [T, K] expert ids from the model's router.
        top_k_weights: [T, K] routing weights from the model's router (any float dtype; megamoe applies
            them in fp32 inside the weighted sum, as transformers' experts apply them inside too).

    Returns [T, D] = sum_k w[t, k] * FFN_{ids[t, k]}(x[t]) in hidden_states' dtype, with FFN_e(x) =
    down_proj[e] @ (silu(gate_up_proj[e, :F] @ x) * (gate_up_proj[e, F:] @ x)) on the module's own
    parameters (no copies). Fused kernels for CUDA bf16 / fp16 / fp32, megamoe.reference otherwise.
    Raises UnsupportedModelError naming every reason for experts megamoe cannot run exactly.
    """
    _refuse(type(self).__name__, "experts", _experts_problems(self))
    w13_EGD, w2_EDF = self.gate_up_proj, self.down_proj
    x_TD = hidden_states.reshape(-1, hidden_states.shape[-1])
    if x_TD.dtype != w13_EGD.dtype:
        x_TD = x_TD.to(w13_EGD.dtype)
    T = x_TD.shape[0]
    out_TD = moe_experts(x_TD, top_k_index.reshape(T, -1), top_k_weights.reshape(T, -1), w13_EGD, w2_EDF,
                         backend=_backend_for(x_TD))
    return shaped_like(out_TD.to(hidden_states.dtype), hidden_states)


def register() -> str:
    """Register :func:`experts_forward` as transformers' ``"megamoe"`` experts implementation (for every
    model; idempotent; importing this module already did it). Returns the name."""
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    return EXPERTS_IMPLEMENTATION


register()


# ---------------------------------------------------------------------------------------------------
# 2. the whole-block swap
# ---------------------------------------------------------------------------------------------------
#: MoE block classes whose router megamoe implements exactly: block class -> (router class, score function,
#: router logits dtype as :class:`megamoe.MoEConfig`'s ``router_dtype``: "model" where the router computes
#: ``F.linear(x, weight)`` in the model dtype, "fp32" where it casts both to fp32 first)
BLOCKS = {
    "Qwen3MoeSparseMoeBlock": ("Qwen3MoeTopKRouter", "softmax", "model"),
    "MixtralSparseMoeBlock": ("MixtralTopKRouter", "softmax", "model"),
    "DeepseekV3MoE": ("DeepseekV3TopkRouter", "sigmoid", "fp32"),
    "Glm4MoeMoE": ("Glm4MoeTopkRouter", "sigmoid", "fp32"),
}


_CHILDREN = ("gate", "experts", "shared_experts")


def _shared_problems(shared: nn.Module) -> list[str]:
    why = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(shared, name, None)
        if type(lin) is not nn.Linear:  # a subclass (e.g. an adapter or a quantized layer) computes differently
            why.append(f"its shared expert's {name} is {type(lin).__name__}, not a plain torch.nn.Linear")
        elif lin.bias is not None:
            why.append(f"its shared expert's {name} has a bias")
    if not _is_silu(getattr(shared, "act_fn", None)):
        why.append("its shared expert's activation is not SiLU")
    return why


def _block_problems(block: nn.Module) -> list[str]:
    name, gate = type(block).__name__, getattr(block, "gate", None)
    if name not in BLOCKS:
        why = [f"megamoe implements the routers of {', '.join(sorted(BLOCKS))} exactly, not this block's"]
    elif type(gate).__name__ != BLOCKS[name][0]:
        why = [f"its router is {type(gate).__name__}, not {BLOCKS[name][0]}"]
    else:
        why = []
    why += _experts_problems(block.experts)
    if getattr(block, "jitter_noise", 0) > 0:
        why.append(f"its router multiplies the input by random jitter in training (router_jitter_noise="
                   f"{block.jitter_noise})")
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        why += _shared_problems(shared)
    extra = [n for n, _ in block.named_children() if n not in _CHILDREN]
    extra += [n for n, _ in (*block.named_parameters(recurse=False), *block.named_buffers(recurse=False))]
    if extra:
        why.append(f"it has state megamoe's block would not run ({', '.join(extra)})")
    for mod in (block, *block.modules()):
        if hasattr(mod, "_hf_hook"):  # accelerate's offloading / device-map hooks move weights in forward
            why.append(f"{type(mod).__name__} is dispatched by accelerate (device_map offloading)")
            break
    return why


def moe_config_of(block: nn.Module, *, nan_policy: str = "propagate", bias_update_rate: float = 1e-3) -> MoEConfig:
    """The :class:`megamoe.MoEConfig` of a transformers MoE block megamoe can swap (see :data:`BLOCKS`).

    Read from the block's modules (router top-k, groups, normalisation, scaling, correction bias; expert
    and shared-expert widths; the experts' dtype); ``router_dtype`` is the family's (:data:`BLOCKS`). Raises
    UnsupportedModelError naming every reason otherwise.
    """
    _refuse(type(block).__name__, "a megamoe block", _block_problems(block))
    gate, experts = block.gate, block.experts
    E, G, D = experts.gate_up_proj.shape
    shared = getattr(block, "shared_experts", None)
    S = shared.gate_proj.weight.shape[0] if shared is not None else 0
    bias = getattr(gate, "e_score_correction_bias", None)
    _, score_func, router_dtype = BLOCKS[type(block).__name__]
    return MoEConfig(
        hidden_size=D, moe_intermediate_size=G // 2, num_experts=E, top_k=gate.top_k,
        score_func=score_func, n_group=getattr(gate, "num_group", 1),
        topk_group=getattr(gate, "topk_group", 1), norm_topk_prob=bool(getattr(gate, "norm_topk_prob", True)),
        routed_scaling_factor=float(getattr(gate, "routed_scaling_factor", 1.0)),
        n_shared_experts=1 if S else 0, shared_intermediate_size=S, use_expert_bias=bias is not None,
        bias_update_rate=bias_update_rate, nan_policy=nan_policy, dtype=experts.gate_up_proj.dtype,
        router_dtype=router_dtype)


class MegaMoEBlock(nn.Module):
    """A transformers MoE block run by megamoe: router, routed experts and shared expert, on the block's
    own parameters (built by :func:`swap_moe_blocks`).

    Submodules are the original block's: ``gate`` (router weight [E, D] in the model's dtype, and for
    DeepSeek-V3 / GLM-4.5 the fp32 ``e_score_correction_bias`` buffer), ``experts`` (``gate_up_proj`` [E, 2F, D],
    ``down_proj`` [E, D, F]) and ``shared_experts`` (``gate_proj`` / ``up_proj`` [S, D], ``down_proj``
    [D, S]) where the block has one, so ``state_dict()`` keys and tensors are the model's.

    forward(hidden_states [..., D]) -> [..., D] in hidden_states' dtype (cast to the experts' dtype for the
    router and the experts): router logits in the family's dtype (``moe_config.router_dtype``: the model dtype,
    on tensor cores, for Qwen3-MoE and Mixtral; fp32 for DeepSeek-V3 and GLM-4.5, as transformers computes them;
    megamoe's batch-invariant Triton GEMM on the fused backend), :func:`megamoe.router.route` (softmax or
    sigmoid scores in fp32, group-limited top-k with the selection bias, normalised, scaled once), then routed +
    shared experts and their fp32 sum in one :func:`megamoe.functional.moe_experts` call. :meth:`route` runs
    the router part alone. The shared expert's gate and up weights stay two parameters; each forward
    concatenates them into megamoe's [gate; up] layout (one copy of 2 * S * D elements, kept for the backward;
    gradients reach both parameters).

    Forward hooks on ``gate`` (transformers records ``router_logits`` through them, e.g. for Qwen3-MoE's
    and Mixtral's load-balancing loss) are called with ``(logits [T, E], weights [T, K] fp32, ids [T, K])``
    as if the router had run, the logits in the dtype transformers' router returns them (the model dtype for
    Qwen3-MoE and Mixtral, fp32 for DeepSeek-V3 and GLM-4.5). ``last_stats``
    (:class:`megamoe.layer.RouterStats`; ``aux_loss`` is a zero tensor: the model computes its own
    load-balancing loss) holds the last forward's expert counts and ids; :meth:`update_expert_bias` applies
    megamoe's aux-loss-free update to ``e_score_correction_bias`` (transformers never changes it; nothing does
    unless called). A forward run again inside a backward (an activation-checkpoint recompute) leaves both
    alone.

    Not a :class:`megamoe.MoE`: that module owns its parameters under its own names (an fp32 ``router.w_ED``,
    one [gate; up] shared weight), which would change the model's parameters and checkpoint keys. This one
    computes the same function (:func:`megamoe.router.route`, :func:`megamoe.functional.moe_experts`) on
    the model's tensors.
    """

    def __init__(self, block: nn.Module, *, backend: str = "auto", nan_policy: str = "propagate",
                 bias_update_rate: float = 1e-3):
        super().__init__()
        if backend not in ("auto", "fused", "reference"):
            raise ValueError(f"MegaMoEBlock: backend must be 'auto', 'fused' or 'reference', got {backend!r}")
        self.moe_config = moe_config_of(block, nan_policy=nan_policy, bias_update_rate=bias_update_rate)
        self.backend = backend
        self.block_class = type(block).__name__
        for name, child in block.named_children():  # the block's order, so state_dict() lists keys as before
            self.add_module(name, child)
        self.register_buffer("counts_since_update_E", torch.zeros(
            self.moe_config.num_experts, dtype=torch.int64, device=block.experts.gate_up_proj.device), persistent=False)
        self.last_stats: RouterStats | None = None

    def extra_repr(self) -> str:
        c = self.moe_config
        return (f"{self.block_class}: D={c.hidden_size}, F={c.moe_intermediate_size}, E={c.num_experts}, "
                f"K={c.top_k}, S={c.shared_intermediate_size}, score={c.score_func}, groups={c.n_group}/"
                f"{c.topk_group}, scale={c.routed_scaling_factor}, router_dtype={c.router_dtype}, "
                f"backend={self.backend}")

    def _shared_weights(self):
        shared = getattr(self, "shared_experts", None)
        if shared is None:
            return None, None
        _refuse(self.block_class, "a megamoe block", _shared_problems(shared))
        return torch.cat([shared.gate_proj.weight, shared.up_proj.weight], 0), shared.down_proj.weight

    def _backend_of(self, x_TD: torch.Tensor) -> str:
        return _backend_for(x_TD) if self.backend == "auto" else self.backend

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, routing.RouterOutput]:
        """The router alone, as :meth:`forward` runs it: ``x_TD`` [T, D] in the experts' dtype -> (logits [T, E]
        in ``moe_config.router_dtype``'s dtype, :class:`megamoe.router.RouterOutput`), the top-k ids made
        contiguous once (the experts' call, the counts and ``last_stats`` all read them; the values are the
        router's)."""
        router_w_ED, router_dtype = self.gate.weight, self.moe_config.router_dtype
        if router_w_ED.shape[0] != self.moe_config.num_experts:  # (the ids then index the experts: checked here)
            raise UnsupportedModelError(f"{self.block_class}: its router weight has {router_w_ED.shape[0]} rows for "
                                        f"{self.moe_config.num_experts} experts")
        fused = self._backend_of(x_TD) == "fused"
        if fused:
            logits_TE = router_logits(x_TD, router_w_ED, router_dtype=router_dtype)
        else:
            logits_TE = routing.router_logits(x_TD, router_w_ED, router_dtype)
        r = routing.route(x_TD, router_w_ED, getattr(self.gate, "e_score_correction_bias", None), self.moe_config,
                          logits_TE=logits_TE, select=topk_select if fused else None)
        r.topk_ids_TK = r.topk_ids_TK.contiguous()
        return logits_TE, r

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        c = self.moe_config
        _refuse(self.block_class, "a megamoe block", _experts_problems(self.experts))
        w13_EGD, w2_EDF = self.experts.gate_up_proj, self.experts.down_proj
        x_TD = hidden_states.reshape(-1, hidden_states.shape[-1]).to(w13_EGD.dtype)
        logits_TE, r = self.route(x_TD)
        out_TD = moe_experts(x_TD, r.topk_ids_TK, r.topk_weights_TK, w13_EGD, w2_EDF, *self._shared_weights(),
                             backend=self._backend_of(x_TD), check_ids=False)  # ids: route()'s, all in [0, E)
        if not in_backward():  # an activation-checkpoint recompute counts nothing twice
            counts_E = routing.tokens_per_expert(r.topk_ids_TK, c.num_experts)
            if self.training:
                with torch.no_grad():
                    self.counts_since_update_E += counts_E
            aux = torch.zeros((), dtype=torch.float32, device=x_TD.device)  # the model computes its own aux loss
            self.last_stats = RouterStats(counts_E, aux, r.topk_ids_TK.detach())
        self._call_gate_hooks(x_TD, (logits_TE, r.topk_weights_TK, r.topk_ids_TK))
        return shaped_like(out_TD.to(hidden_states.dtype), hidden_states)

    def _call_gate_hooks(self, x_TD: torch.Tensor, outputs: tuple) -> None:
        """Run the forward hooks registered on ``gate`` with the router's (logits, weights, ids)."""
        gate = self.gate
        for hook_id, hook in list(gate._forward_hooks.items()):
            if hook_id in gate._forward_hooks_with_kwargs:
                result = hook(gate, (x_TD,), {}, outputs)
            else:
                result = hook(gate, (x_TD,), outputs)
            if result is not None:
                raise UnsupportedModelError(f"a forward hook on {type(gate).__name__} replaced the router's output; "
                                            "megamoe's swapped block cannot honour that")

    @torch.no_grad()
    def update_expert_bias(self, group=None) -> None:
        """megamoe's aux-loss-free update of ``gate.e_score_correction_bias`` from the counts of the training
        forwards since the last call (summed over ``group`` first: pass the data-parallel group so every replica
        applies the same update; a collective then). No-op (counts reset) for routers without the bias."""
        counts_E = self.counts_since_update_E
        bias_E = getattr(self.gate, "e_score_correction_bias", None)
        if bias_E is not None:
            if group is not None:
                counts_E = counts_E.clone()
                dist.all_reduce(counts_E, group=group)
            routing.update_expert_bias_(bias_E, counts_E, self.moe_config.bias_update_rate)
        self.counts_since_update_E.zero_()


def swap_moe_blocks(model: nn.Module, *, backend: str = "auto", nan_policy: str = "propagate",
                    bias_update_rate: float = 1e-3) -> list[str]:
    """Replace every MoE block of ``model`` by a :class:`MegaMoEBlock` on the same parameters, in place.

    MoE blocks are the modules with an ``experts`` child. Every one must be a family in
    :data:`BLOCKS` (Qwen3-MoE, Mixtral without router jitter, DeepSeek-V3, GLM-4.5) with SwiGLU experts in
    [gate; up] layout and a bias-free SwiGLU shared expert, or nothing is replaced and
    UnsupportedModelError names each block's reasons. Swap before wrapping the model (FSDP, DDP,
    torch.compile); the parameters themselves do not change, so an optimizer built earlier still holds them.

    Args:
        backend: "auto" (fused for CUDA bf16 / fp16 / fp32, reference otherwise), "fused" or "reference".
        nan_policy: megamoe's router NaN policy (:class:`megamoe.MoEConfig`); "propagate" (default) lets a
            non-finite logit make that token's output NaN, as transformers does; "raise" stops with an error.
        bias_update_rate: gamma of :meth:`MegaMoEBlock.update_expert_bias`.

    Returns the qualified names of the replaced blocks.
    """
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(getattr(mod, "experts", None), nn.Module) and not isinstance(mod, MegaMoEBlock)]
    problems = [f"{name}: {type(mod).__name__}: " + "; ".join(why) for name, mod in found
                if (why := _block_problems(mod))]
    if problems:
        raise UnsupportedModelError("swap_moe_blocks: megamoe cannot swap these blocks:\n  " + "\n  ".join(problems))
    if not found and not any(isinstance(m, MegaMoEBlock) for m in model.modules()):
        raise UnsupportedModelError(f"swap_moe_blocks: {type(model).__name__} has no MoE block (a module with an "
                                    "'experts' child)")
    swapped = []
    for name, block in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MegaMoEBlock(block, backend=backend, nan_policy=nan_policy,
                                            bias_update_rate=bias_update_rate))
        swapped.append(name)
    return swapped
