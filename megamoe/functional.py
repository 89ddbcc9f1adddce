"""Functional entries of megamoe: validate inputs, then run the chosen backend.

Legend: T tokens, D hidden size, F expert FFN size, G = 2F ([gate | up]), E experts, K top-k,
S shared-expert FFN size, H = 2S.

* :func:`moe_experts`: routed + shared SwiGLU experts and the combine, for precomputed top-k ids and
  weights (backends "fused": megamoe's Triton kernels, megamoe.autograd.MoEExpertsFunction;
  "reference": megamoe.reference.moe_experts); ``fp8=True``: the routed experts in block-scaled FP8
  (megamoe.autograd_fp8; reference: megamoe.reference.moe_experts_fp8).
* :func:`router_logits`: router logits (fp32, or the model dtype on tensor cores) through megamoe's own
  batch-invariant Triton GEMM.

While torch.compile traces them, both call megamoe's custom ops (megamoe.custom_ops: the same stage loop, one
opaque node each, so no graph break and no recompilation when only the routing changes); eager calls go
straight to the autograd Functions of megamoe.autograd.
"""

from __future__ import annotations

import torch

from . import custom_ops
from .config import ROUTER_DTYPES, KernelConfig, MoEConfig
from .validation import check_expert_inputs, check_fp8, interpreter_active

__all__ = ["moe_experts", "router_logits"]

FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def moe_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                w13_EGD: torch.Tensor, w2_EDF: torch.Tensor, shared_w13_HD: torch.Tensor | None = None,
                shared_w2_DS: torch.Tensor | None = None, *, backend: str = "fused",
                kernel_config: KernelConfig | None = None, fp8: bool = False, check_ids: bool = True) -> torch.Tensor:
    """Routed + shared SwiGLU experts and combine for precomputed routing: (T, D) -> (T, D).

    out[t] = cast(sum_{k=0..K-1} w[t,k] * y[t,k] + shared(x[t])),  y[t,k] = FFN_{ids[t,k]}(x[t]),
    FFN_e(x) = w2[e] @ (silu(w13[e, :F] @ x) * (w13[e, F:] @ x)), with h and y rounded to x's dtype and
    the combine in fp32, slot order, shared expert last (megamoe.reference numerics).

    Args:
        x_TD: (T, D) activations; bf16 / fp16 / fp32 for "fused" (fp64 only with "reference"). Any strides.
        topk_ids_TK: (T, K) int32/int64 expert ids in [0, E) (duplicates allowed).
        topk_weights_TK: (T, K) float routing weights (used in fp32); its gradient has its dtype.
        w13_EGD: (E, 2F, D), x's dtype: rows [0, F) gate, [F, 2F) up.
        w2_EDF: (E, D, F), x's dtype.
        shared_w13_HD: optional (2S, D); shared_w2_DS: optional (D, S); both or neither.
        backend: "fused" (Triton; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or "reference".
        kernel_config: "fused" only: tile overrides (:class:`megamoe.config.KernelConfig`; None: the
            checked-in table). Never changes results unless an entry changes BLOCK_K.
        fp8: run the routed experts' GEMMs (forward, input gradient, weight gradients) in block-scaled FP8, the
            DeepSeek-V3 recipe (docs/fp8.md): e4m3 operands with fp32 power-of-two scales per 1x128 (activations,
            output gradients), 128x128 (weights) and 128x1 (weight-gradient operands) blocks, fp32 accumulation.
            The shared expert, the combine and every output and gradient stay in x's dtype. Needs x in bf16, fp16
            or fp32, D and F multiples of 128 and (on CUDA) a GPU with FP8 tensor cores. "reference":
            megamoe.reference.moe_experts_fp8, the same numerics in plain PyTorch. Weight blocks are cached per
            weight version (megamoe.ops.fp8_weights).
        check_ids: check that every id is in [0, E) (below; on CUDA five small kernels). False: the caller
            guarantees it (ids from :func:`megamoe.router.route`, indices of a sort over the E experts, as
            megamoe.integrations.transformers passes them) and nothing is checked; an id out of range then makes
            the kernels read and write out of bounds. Under torch.compile the custom op checks them anyway.

    Returns:
        out_TD: (T, D) in x's dtype. Differentiable w.r.t. x, topk_weights, w13, w2 and the shared weights.

    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, dtypes, devices or backend;
        ids out of range raise ValueError on CPU and a device-side assert on CUDA (no sync; with check_ids).

    Determinism ("fused"): bitwise identical run to run; every token's output and input gradient is
        independent of the other tokens in the batch; weight gradients reduce each expert's rows in
        (token, slot) order; no float atomics. Sync ("fused"): none; CUDA-graph capturable. Under
        torch.compile: the same bits, through the custom ops of megamoe.custom_ops (ids then checked when
        the op runs).
    """
    if backend not in ("fused", "reference"):
        raise ValueError(f"moe_experts: backend must be 'fused' or 'reference', got {backend!r}")
    if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
        raise TypeError(f"moe_experts: kernel_config must be a megamoe.config.KernelConfig or None, got "
                        f"{type(kernel_config).__name__}")
    if not isinstance(fp8, bool):
        raise TypeError(f"moe_experts: fp8 must be a bool, got {fp8!r}")
    if not isinstance(check_ids, bool):
        raise TypeError(f"moe_experts: check_ids must be a bool, got {check_ids!r}")
    check_expert_inputs(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
                        check_ids=check_ids)
    compiling = torch.compiler.is_compiling()
    if fp8:  # the GPU's FP8 support is checked by the op itself while compiling
        check_fp8("moe_experts", x_TD.shape[1], w2_EDF.shape[2], x_TD.dtype,
                  x_TD.device if backend == "fused" and not compiling else None)
    recipe = "fp8" if fp8 else "native"
    if backend == "reference" and compiling:  # one opaque op for torch.compile (the specification syncs)
        return custom_ops.reference_moe_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD,
                                                shared_w2_DS, recipe=recipe)
    if backend == "reference":
        from . import reference  # the plain-PyTorch specification, imported only when asked for

        ref = reference.moe_experts_fp8 if fp8 else reference.moe_experts
        return ref(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS)
    if x_TD.dtype not in FUSED_DTYPES:
        raise TypeError(f"moe_experts: the fused backend supports bf16, fp16 and fp32, got x_TD dtype {x_TD.dtype}")
    if x_TD.device.type != "cuda" and not interpreter_active():
        raise ValueError(f"moe_experts: the fused backend runs on CUDA tensors (or CPU tensors under "
                         f"TRITON_INTERPRET=1), got x_TD on {x_TD.device}; backend='reference' runs on any device")
    c = torch.Tensor.contiguous
    shared = (None, None) if shared_w13_HD is None else (c(shared_w13_HD), c(shared_w2_DS))
    args = (c(x_TD), c(topk_ids_TK), c(topk_weights_TK), c(w13_EGD), c(w2_EDF), *shared)
    if compiling:  # the same stage loop, as one custom op (megamoe.custom_ops)
        return custom_ops.moe_experts(*args, kernel_config=kernel_config, recipe=recipe)
    from .autograd import MoEExpertsFunction  # lazy: importing megamoe.functional does not import triton
    from .ops.dispatch import LocalDispatcher

    fp8_experts = None
    if fp8:
        from .autograd_fp8 import Fp8Experts

        fp8_experts = Fp8Experts()
    dispatcher = LocalDispatcher(w13_EGD.shape[0], kernel_config or KernelConfig(), fp8=fp8)
    return MoEExpertsFunction.apply(*args, dispatcher, fp8_experts)


def router_logits(x_TD: torch.Tensor, router_w_ED: torch.Tensor, *, router_dtype: str = "fp32") -> torch.Tensor:
    """Router logits ``x @ router_w.T`` in megamoe's batch-invariant Triton GEMM: (T, D) x (E, D) -> (T, E).

    router_dtype (:class:`megamoe.MoEConfig`'s field of that name):
        "fp32" (default): ``x.float() @ router_w.float().T``, fp32 logits. For bf16 x on bf16 tensor cores: an fp32
            weight (and in the backward dlogits) as three exact bf16 pieces (``hi + mid + lo``), a bf16 weight as
            itself, so every product is exact in fp32, accumulated in fp32, the partial results added in fp32 (dx of
            an fp32 weight keeps six of the nine piece products: the three left out are below 2^-24 of the largest);
            fp16 / fp32 x: IEEE fp32 dots.
        "model": ``F.linear(x, router_w.to(x.dtype))``, as transformers' Qwen3-MoE and Mixtral routers compute
            them: operands in x's dtype (router_w cast to it, differentiably), tensor cores with fp32
            accumulation, logits rounded once to x's dtype; backward dx = dlogits @ W and dW = dlogits^T @ x in
            x's dtype on tensor cores (fp32 accumulation; dW over S fixed token chunks, S a function of (T, E, D)
            only, each chunk's rows in token order, the fp32 partials summed in chunk order, one cast:
            megamoe.autograd.router_wgrad). The same function as autograd of ``F.linear`` in x's dtype, up to
            the accumulation order. With fp32 x, the same bits as "fp32".

    Either way the tile config depends only on (D, E), so a token's logits do not depend on the rest of the
    batch (bitwise equal for EP=1 and EP=W), and results are bitwise reproducible (on any GPU: nothing depends on
    the device). Differentiable w.r.t. x and
    router_w. CUDA tensors (or CPU under TRITON_INTERPRET=1). No sync.
    Raises TypeError / ValueError naming the argument for wrong types, shapes, devices or router_dtype.
    """
    for name, t in (("x_TD", x_TD), ("router_w_ED", router_w_ED)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"router_logits: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"router_logits: {name} must be a 2-D floating tensor, got {t.dtype} {tuple(t.shape)}")
    if x_TD.shape[1] != router_w_ED.shape[1]:
        raise ValueError(f"router_logits: x_TD has D={x_TD.shape[1]} but router_w_ED is {tuple(router_w_ED.shape)}")
    if x_TD.device != router_w_ED.device:
        raise ValueError(f"router_logits: x_TD on {x_TD.device} but router_w_ED on {router_w_ED.device}")
    if x_TD.dtype not in FUSED_DTYPES:
        raise TypeError(f"router_logits: x_TD dtype {x_TD.dtype} not supported (bf16, fp16, fp32)")
    if router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"router_logits: router_dtype must be one of {ROUTER_DTYPES}, got {router_dtype!r}")
    if router_dtype == "model":
        router_w_ED = router_w_ED.to(x_TD.dtype)  # (its backward hands dW, made in x's dtype, to the weight's)
    if torch.compiler.is_compiling():
        return custom_ops.router_logits(x_TD.contiguous(), router_w_ED.contiguous(), router_dtype=router_dtype)
    from .autograd import RouterLogitsFunction

    return RouterLogitsFunction.apply(x_TD.contiguous(), router_w_ED.contiguous(), router_dtype)


def topk_select(scores_TE: torch.Tensor, expert_bias_E: torch.Tensor | None, logits_TE: torch.Tensor | None,
                cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """megamoe.router.route's selection after the scores in one kernel (forward and backward), or None where the
    kernel does not take the router (``megamoe.ops.topk_select.topk_select_supported``) or the tensors are not on
    a CUDA device (CPU: under TRITON_INTERPRET=1): for ``route(..., select=topk_select)``.

    scores_TE: (T, E) fp32 (or fp64: None, the PyTorch selection keeps fp64); expert_bias_E: the selection bias or
    None; logits_TE: given when ``cfg.nan_policy == "propagate"`` (tokens with a non-finite logit get NaN weights);
    cfg: the :class:`megamoe.MoEConfig`. Returns (ids_TK int64, weights_TK fp32): the same ids as route's PyTorch
    selection on the same scores (ties to the lower id), the weights equal up to the order of the K-term sum
    (slot order here). Differentiable w.r.t. scores_TE. No sync."""
    from .ops.topk_select import topk_select_supported

    E = scores_TE.shape[1]
    if (scores_TE.dtype != torch.float32 or not topk_select_supported(E, cfg.top_k, cfg.n_group)
            or (scores_TE.device.type != "cuda" and not interpreter_active())):
        return None
    bias = None if expert_bias_E is None else expert_bias_E.detach().to(torch.float32).contiguous()
    logits = None if logits_TE is None else logits_TE.detach().contiguous()
    spec = (cfg.top_k, cfg.n_group, cfg.topk_group, cfg.score_func == "sigmoid", bool(cfg.norm_topk_prob),
            float(cfg.routed_scaling_factor))
    if torch.compiler.is_compiling():
        return custom_ops.topk_select(scores_TE.contiguous(), bias, logits, spec)
    from .autograd import TopkSelectFunction

    return TopkSelectFunction.apply(scores_TE.contiguous(), bias, logits, spec)
