"""megamoe's operations as PyTorch custom ops (``torch.library``), so that ``torch.compile`` sees each one as a
single opaque node: no graph break, no recompilation when only the routing changes, the same kernels (and bits)
as eager.

Legend: T tokens, D hidden size, F expert FFN size, G = 2F ([gate | up]), E experts, K top-k, N = T*K
(token, slot) rows, S shared-expert FFN size, H = 2S.

The functional entries (megamoe.functional) call these wrappers while ``torch.compile`` traces them and the
autograd Functions of megamoe.autograd otherwise; both run the one stage loop of megamoe.autograd
(``experts_forward`` / ``experts_backward``, ``router_logits_forward`` / ``router_logits_backward``), so a compiled
model computes what the eager one does, kernel for kernel. Ops (namespace ``megamoe``):

* ``moe_experts(x, ids, w, w13, w2, shared_w13?, shared_w2?, kernel_config, recipe)`` -> (out_TD, and what the
  backward reads: gu_NG, gus_TH (empty without a shared expert), the routing plan's offsets_E1, row_token_N,
  row_src_N, row_of_TK, and with recipe "fp8" the weights' 128x128 blocks q13, s13, q2, s2 (empty otherwise));
  ``moe_experts_backward(...)`` -> the six gradients (an empty tensor where not needed).
  One GPU (the local dispatcher); expert parallelism (megamoe.functional_ep) is not a custom op.
* ``moe_experts_reference(..., recipe)`` / ``moe_experts_reference_backward``: the plain-PyTorch specification
  (megamoe.reference.moe_experts, host-synchronous: it loops over the experts present), run eagerly inside the
  op; its backward is that function's vector-Jacobian product (``torch.func.vjp``), the gradients eager
  autograd computes. Recipe "fp8": megamoe.reference.moe_experts_fp8, and as backward its hand-written one
  (megamoe.reference.moe_experts_fp8_backward, the forward rerun for what it reads).
* ``router_logits(x, router_w, router_dtype)`` / ``router_logits_backward``: the router GEMM, ``router_dtype``
  "fp32" (fp32 logits) or "model" (x's dtype on tensor cores; the fake output then has x's dtype).
* ``topk_select(scores, bias?, logits?, top_k, n_group, topk_group, group_top2, norm, scale)`` -> (ids, weights,
  divisors) / ``topk_select_backward``: the router's fused top-k selection from its fp32 scores.

Arguments beyond tensors: ``kernel_config`` is the text of a :class:`megamoe.config.KernelConfig`
(:func:`kernel_config_text`; "" for the checked-in table); ``recipe`` names the number format of the routed
experts' GEMMs (:data:`RECIPES`): "native" (x's dtype) or "fp8" (block-scaled FP8, docs/fp8.md; the reference ops:
megamoe.reference.moe_experts_fp8 and its hand-written backward). FP8 keeps gu in x's dtype; the fused forward op's
four last outputs are the weights' 128x128 blocks with recipe "fp8" (e4m3 bytes, fp32 scales) and four empty
tensors with "native", and its fake implementation says so per recipe.

FP8 in the fused ops: each op builds its own megamoe.autograd_fp8.Fp8Experts with a weight cache of that call
only, so an op keeps no tensor beyond its outputs (CUDA-graph trees refuse allocations in their pool that live on
and are not outputs): compiled, the forward op quantizes the weights at every call and returns their blocks as
outputs, saved for the backward op, which takes them (``Fp8Experts.adopt_blocks``) instead of quantizing again;
the backward makes their K-major copies. The eager path's cross-call cache (one quantization per weight version)
does not apply under compile.

Shapes come from shapes only (fake implementations): every routing-dependent size stays inside the ops.
Sync: none on CUDA (ids are checked with a device-side assertion); CUDA-graph capturable
(``torch.compile(..., mode="reduce-overhead")``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from .config import ROUTER_DTYPES, GemmConfig, KernelConfig
from .validation import check_expert_ids, check_fp8

__all__ = ["RECIPES", "kernel_config_from_text", "kernel_config_text", "moe_experts", "reference_moe_experts",
           "router_logits", "topk_select"]

RECIPES = ("native", "fp8")
_GEMM_FIELDS = tuple(f.name for f in dataclasses.fields(GemmConfig))
_BOOL_FIELDS = frozenset(f.name for f in dataclasses.fields(GemmConfig) if f.type in (bool, "bool"))


# ---------------------------------------------------------------------------------------------------
# the kernel config as text (a custom op takes tensors, numbers and strings)
# ---------------------------------------------------------------------------------------------------
def kernel_config_text(kernel_config: KernelConfig | None) -> str:
    """A :class:`KernelConfig` as the text the ops take: "" for None or no overrides, else one
    ``key:field=value,...`` entry per tile override, ``;``-separated (key ``kind`` or ``kind/a/b``)."""
    if kernel_config is None:
        return ""
    entries = []
    for key, cfg in kernel_config.tiles:
        name = key if isinstance(key, str) else f"{key[0]}/{key[1]}/{key[2]}"
        entries.append(name + ":" + ",".join(f"{n}={int(getattr(cfg, n))}" for n in _GEMM_FIELDS))
    return ";".join(entries)


@functools.lru_cache(maxsize=64)
def kernel_config_from_text(text: str) -> KernelConfig:
    """The :class:`KernelConfig` of :func:`kernel_config_text`'s text (one object per text)."""
    tiles = []
    for entry in filter(None, text.split(";")):
        name, _, spec = entry.partition(":")
        parts = name.split("/")
        key = parts[0] if len(parts) == 1 else (parts[0], int(parts[1]), int(parts[2]))
        fields = {}
        for item in spec.split(","):
            field, _, value = item.partition("=")
            fields[field] = bool(int(value)) if field in _BOOL_FIELDS else int(value)
        tiles.append((key, GemmConfig(**fields)))
    return KernelConfig(tuple(tiles))


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"megamoe: recipe must be one of {RECIPES}, got {recipe!r}")


def _fused_recipe(recipe: str, blocks: tuple | None = None, dtype: torch.dtype | None = None):
    """The stage loop's recipe object: None for "native", a fresh megamoe.autograd_fp8.Fp8Experts for "fp8" (given
    the forward op's weight blocks (q13, s13, q2, s2) and the weights' dtype, both or neither: holding them, for a
    backward op)."""
    if (blocks is None) != (dtype is None):
        raise ValueError("megamoe: the forward's weight blocks come with the weights' dtype")
    _check_recipe(recipe)
    if recipe == "native":
        return None
    from .autograd_fp8 import Fp8Experts
    from .ops.fp8_weights import Fp8WeightCache

    # a cache of this call only: an op keeps no tensor beyond its outputs (CUDA-graph trees refuse live
    # allocations in their pool that are not outputs), so compiled FP8 quantizes the weights at every call
    fp8 = Fp8Experts(cache=Fp8WeightCache())
    if blocks is not None:
        fp8.adopt_blocks(blocks[:2], blocks[2:], dtype)
    return fp8


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None or t.numel() == 0 else t


# ---------------------------------------------------------------------------------------------------
# routed + shared experts, fused
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("megamoe::moe_experts", mutates_args=())
def _moe_experts_op(x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, w13_EGD: Tensor, w2_EDF: Tensor,
                    shared_w13_HD: Tensor | None, shared_w2_DS: Tensor | None, kernel_config: str,
                    recipe: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                          Tensor, Tensor]:
    from .autograd import experts_forward  # lazy: the Triton launchers load when the op first runs
    from .ops.dispatch import LocalDispatcher

    fp8 = _fused_recipe(recipe)
    if fp8 is not None:
        check_fp8("megamoe::moe_experts", x_TD.shape[1], w2_EDF.shape[2], x_TD.dtype, x_TD.device)
    check_expert_ids(topk_ids_TK, w13_EGD.shape[0])
    d = LocalDispatcher(w13_EGD.shape[0], kernel_config_from_text(kernel_config), fp8=fp8 is not None)
    out_TD, gu_NG, gus_TH, saved = experts_forward(d, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF,
                                                   shared_w13_HD, shared_w2_DS, True, fp8)
    gu_NG = _empty(x_TD) if gu_NG is None else gu_NG
    gus_TH = _empty(x_TD) if gus_TH is None else gus_TH
    blocks = (*fp8.w13, *fp8.w2) if fp8 is not None else _no_blocks(x_TD)  # saved for the backward op
    return (out_TD, gu_NG, gus_TH, *saved, *blocks)


@_moe_experts_op.register_fake
def _(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, kernel_config, recipe):
    (T, D), K, (E, G, _) = x_TD.shape, topk_ids_TK.shape[1], w13_EGD.shape
    N = T * K
    gus_TH = (x_TD.new_empty(T, shared_w13_HD.shape[0]) if shared_w13_HD is not None and T > 0
              else _empty(x_TD))
    i32 = dict(dtype=torch.int32, device=x_TD.device)
    return (x_TD.new_empty(T, D), x_TD.new_empty(N, G), gus_TH, torch.empty(E + 1, **i32), torch.empty(N, **i32),
            torch.empty(N, **i32), torch.empty(T, K, **i32), *_fake_blocks(x_TD, w13_EGD, w2_EDF, recipe))


def _no_blocks(x_TD) -> tuple:
    """The weight-block outputs of a recipe without them: four distinct empty tensors (a custom op's outputs may not
    alias one another)."""
    return tuple(_empty(x_TD) for _ in range(4))


def _fake_blocks(x_TD, w13_EGD, w2_EDF, recipe):
    """The forward op's weight blocks (q13, s13, q2, s2): e4m3 like each weight, fp32 per 128x128 block; empty
    unless recipe "fp8"."""
    if recipe != "fp8":
        return _no_blocks(x_TD)
    out = []
    for w in (w13_EGD, w2_EDF):
        experts, rows, cols = w.shape
        out += [w.new_empty((experts, rows, cols), dtype=torch.float8_e4m3fn),
                w.new_empty((experts, -(-rows // 128), -(-cols // 128)), dtype=torch.float32)]
    return tuple(out)


@torch.library.custom_op("megamoe::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(dout_TD: Tensor, x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor,
                             w13_EGD: Tensor, w2_EDF: Tensor, shared_w13_HD: Tensor | None,
                             shared_w2_DS: Tensor | None, gu_NG: Tensor, gus_TH: Tensor, offsets_E1: Tensor,
                             row_token_N: Tensor, row_src_N: Tensor, row_of_TK: Tensor, q13: Tensor, s13: Tensor,
                             q2: Tensor, s2: Tensor, need: list[bool], kernel_config: str, recipe: str
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    from .autograd import experts_backward
    from .ops.dispatch import LocalDispatcher, Needs

    fp8 = _fused_recipe(recipe, (q13, s13, q2, s2), w13_EGD.dtype)  # the forward's weight blocks (module doc)
    n = Needs(*need)
    d = LocalDispatcher(w13_EGD.shape[0], kernel_config_from_text(kernel_config), fp8=fp8 is not None)
    grads = experts_backward(d, dout_TD, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD,
                             shared_w2_DS, gu_NG, _or_none(gus_TH), (offsets_E1, row_token_N, row_src_N, row_of_TK), n,
                             fp8)
    # contiguous, as the fake gradients are (torch._grouped_mm may pad an output's rows for alignment)
    return tuple(_empty(x_TD) if g is None else g.contiguous() for g in grads)


def _grad_shapes(x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, need):
    """Fake gradients: like the input where needed, else empty."""
    likes = (x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS)
    return tuple(torch.empty_like(t) if flag and t is not None else _empty(x_TD) for t, flag in zip(likes, need))


@_moe_experts_backward_op.register_fake
def _(dout_TD, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, gu_NG, gus_TH,
      offsets_E1, row_token_N, row_src_N, row_of_TK, q13, s13, q2, s2, need, kernel_config, recipe):
    return _grad_shapes(x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, need)


def _needs(ctx) -> list[bool]:
    """[x, topk_weights, w13, w2, shared_w13, shared_w2] of an experts op's ``ctx.needs_input_grad``."""
    n = ctx.needs_input_grad
    return [bool(n[0]), bool(n[2]), bool(n[3]), bool(n[4]), bool(n[5]), bool(n[6])]


def _take(grads, need) -> tuple:
    """The op's gradients in input order (None for ids, unwanted ones and the string arguments)."""
    dx, dw, dw13, dw2, ds13, ds2 = (g if flag else None for g, flag in zip(grads, need))
    return dx, None, dw, dw13, dw2, ds13, ds2


def _moe_experts_setup(ctx, inputs, output):
    x_TD, ids_TK, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS, kernel_config, recipe = inputs
    _, gu_NG, gus_TH, *plan_and_blocks = output
    ctx.save_for_backward(x_TD, ids_TK, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS, gu_NG, gus_TH, *plan_and_blocks)
    ctx.mark_non_differentiable(*plan_and_blocks)
    ctx.kernel_config, ctx.recipe = kernel_config, recipe


def _moe_experts_backward(ctx, dout_TD, *_unused):
    need = _needs(ctx)
    grads = _moe_experts_backward_op(dout_TD, *ctx.saved_tensors, need, ctx.kernel_config, ctx.recipe)
    return (*_take(grads, need), None, None)


_moe_experts_op.register_autograd(_moe_experts_backward, setup_context=_moe_experts_setup)


def moe_experts(x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, w13_EGD: Tensor, w2_EDF: Tensor,
                shared_w13_HD: Tensor | None = None, shared_w2_DS: Tensor | None = None, *,
                kernel_config: KernelConfig | None = None, recipe: str = "native") -> Tensor:
    """:func:`megamoe.functional.moe_experts` (backend "fused") through the ``megamoe::moe_experts`` custom op.
    Inputs validated and contiguous (the functional entry does both); ids are checked inside the op."""
    _check_recipe(recipe)
    return _moe_experts_op(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
                           kernel_config_text(kernel_config), recipe)[0]


# ---------------------------------------------------------------------------------------------------
# routed + shared experts, the plain-PyTorch specification
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("megamoe::moe_experts_reference", mutates_args=())
def _reference_op(x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, w13_EGD: Tensor, w2_EDF: Tensor,
                  shared_w13_HD: Tensor | None, shared_w2_DS: Tensor | None, recipe: str) -> Tensor:
    from . import reference  # the plain-PyTorch specification, imported only when asked for

    _check_recipe(recipe)
    check_expert_ids(topk_ids_TK, w13_EGD.shape[0])
    spec = reference.moe_experts_fp8 if recipe == "fp8" else reference.moe_experts
    return spec(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS)


@_reference_op.register_fake
def _(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, recipe):
    return torch.empty_like(x_TD)


@torch.library.custom_op("megamoe::moe_experts_reference_backward", mutates_args=())
def _reference_backward_op(dout_TD: Tensor, x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor,
                           w13_EGD: Tensor, w2_EDF: Tensor, shared_w13_HD: Tensor | None,
                           shared_w2_DS: Tensor | None, need: list[bool], recipe: str
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    from . import reference

    _check_recipe(recipe)
    args = [x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS]
    if recipe == "fp8":  # the specification's hand-written backward (an autograd.Function: no torch.func.vjp)
        grads = reference.moe_experts_fp8_backward(dout_TD, *args, need_w13=need[2], need_w2=need[3])
        return tuple(g.contiguous() if flag and g is not None else _empty(x_TD) for g, flag in zip(grads, need))
    slots = [i for i, flag in zip((0, 2, 3, 4, 5, 6), need) if flag]

    def f(*wanted):
        a = list(args)
        for i, t in zip(slots, wanted):
            a[i] = t
        return reference.moe_experts(*a)

    _, vjp = torch.func.vjp(f, *(args[i] for i in slots))
    got = dict(zip(slots, vjp(dout_TD.to(x_TD.dtype))))
    return tuple(got[i] if i in got else _empty(x_TD) for i in (0, 2, 3, 4, 5, 6))


@_reference_backward_op.register_fake
def _(dout_TD, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, need, recipe):
    return _grad_shapes(x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, need)


def _reference_setup(ctx, inputs, output):
    *tensors, ctx.recipe = inputs
    ctx.save_for_backward(*tensors)


def _reference_backward(ctx, dout_TD):
    need = _needs(ctx)
    return (*_take(_reference_backward_op(dout_TD, *ctx.saved_tensors, need, ctx.recipe), need), None)


_reference_op.register_autograd(_reference_backward, setup_context=_reference_setup)


def reference_moe_experts(x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor, w13_EGD: Tensor,
                          w2_EDF: Tensor, shared_w13_HD: Tensor | None = None,
                          shared_w2_DS: Tensor | None = None, *, recipe: str = "native") -> Tensor:
    """:func:`megamoe.reference.moe_experts` (recipe "fp8": :func:`megamoe.reference.moe_experts_fp8`) through the
    ``megamoe::moe_experts_reference`` custom op (the same function and gradients; traceable by torch.compile
    although the specification itself syncs)."""
    _check_recipe(recipe)
    return _reference_op(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, recipe)


# ---------------------------------------------------------------------------------------------------
# router logits
# ---------------------------------------------------------------------------------------------------
def _check_router_dtype(router_dtype: str) -> None:
    if router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"megamoe: router_dtype must be one of {ROUTER_DTYPES}, got {router_dtype!r}")


@torch.library.custom_op("megamoe::router_logits", mutates_args=())
def _router_logits_op(x_TD: Tensor, router_w_ED: Tensor, router_dtype: str = "fp32") -> Tensor:
    from .autograd import router_logits_forward

    _check_router_dtype(router_dtype)
    return router_logits_forward(x_TD, router_w_ED, router_dtype)


@_router_logits_op.register_fake
def _(x_TD, router_w_ED, router_dtype="fp32"):
    _check_router_dtype(router_dtype)
    dtype = torch.float32 if router_dtype == "fp32" else x_TD.dtype
    return x_TD.new_empty(x_TD.shape[0], router_w_ED.shape[0], dtype=dtype)


@torch.library.custom_op("megamoe::router_logits_backward", mutates_args=())
def _router_logits_backward_op(dlogits_TE: Tensor, x_TD: Tensor, router_w_ED: Tensor, need_x: bool,
                               need_w: bool, router_dtype: str = "fp32") -> tuple[Tensor, Tensor]:
    from .autograd import router_logits_backward

    dx, dw = router_logits_backward(dlogits_TE, x_TD, router_w_ED, need_x, need_w, router_dtype)
    return _empty(x_TD) if dx is None else dx.contiguous(), _empty(x_TD) if dw is None else dw.contiguous()


@_router_logits_backward_op.register_fake
def _(dlogits_TE, x_TD, router_w_ED, need_x, need_w, router_dtype="fp32"):
    return (torch.empty_like(x_TD) if need_x else _empty(x_TD),
            torch.empty_like(router_w_ED) if need_w else _empty(x_TD))


def _router_logits_setup(ctx, inputs, output):
    x_TD, router_w_ED, ctx.router_dtype = inputs
    ctx.save_for_backward(x_TD, router_w_ED)


def _router_logits_backward(ctx, dlogits_TE):
    need_x, need_w = (bool(n) for n in ctx.needs_input_grad[:2])
    dx, dw = _router_logits_backward_op(dlogits_TE, *ctx.saved_tensors, need_x, need_w, ctx.router_dtype)
    return dx if need_x else None, dw if need_w else None, None


_router_logits_op.register_autograd(_router_logits_backward, setup_context=_router_logits_setup)


def router_logits(x_TD: Tensor, router_w_ED: Tensor, *, router_dtype: str = "fp32") -> Tensor:
    """:func:`megamoe.functional.router_logits` through the ``megamoe::router_logits`` custom op (inputs validated
    and contiguous; for "model", router_w_ED already in x_TD's dtype; the op checks router_dtype)."""
    return _router_logits_op(x_TD, router_w_ED, router_dtype)


# ---------------------------------------------------------------------------------------------------
# the router's top-k selection from its scores
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("megamoe::topk_select", mutates_args=())
def _topk_select_op(scores_TE: Tensor, bias_E: Tensor | None, logits_TE: Tensor | None, top_k: int, n_group: int,
                    topk_group: int, group_top2: bool, norm: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    from .ops.topk_select import topk_select

    return topk_select(scores_TE, bias_E, logits_TE, top_k=top_k, n_group=n_group, topk_group=topk_group,
                       group_top2=group_top2, norm=norm, scale=scale)


@_topk_select_op.register_fake
def _(scores_TE, bias_E, logits_TE, top_k, n_group, topk_group, group_top2, norm, scale):
    T = scores_TE.shape[0]
    return (scores_TE.new_empty(T, top_k, dtype=torch.int64), scores_TE.new_empty(T, top_k, dtype=torch.float32),
            scores_TE.new_empty(T, dtype=torch.float32))


@torch.library.custom_op("megamoe::topk_select_backward", mutates_args=())
def _topk_select_backward_op(dw_TK: Tensor, w_TK: Tensor, ids_TK: Tensor, divisor_T: Tensor, num_experts: int,
                             norm: bool, scale: float, flagged: bool) -> Tensor:
    from .ops.topk_select import topk_select_backward

    return topk_select_backward(dw_TK, w_TK, ids_TK, divisor_T, num_experts=num_experts, norm=norm, scale=scale,
                                flagged=flagged)


@_topk_select_backward_op.register_fake
def _(dw_TK, w_TK, ids_TK, divisor_T, num_experts, norm, scale, flagged):
    return dw_TK.new_empty(dw_TK.shape[0], num_experts, dtype=torch.float32)


def _topk_select_setup(ctx, inputs, output):
    scores_TE, _, logits_TE, _, _, _, _, ctx.norm, ctx.scale = inputs
    ctx.E, ctx.flagged = scores_TE.shape[1], logits_TE is not None
    ids, w, divisor = output
    ctx.save_for_backward(w, ids, divisor)


def _topk_select_backward(ctx, dids, dw_TK, ddivisor):
    w, ids, divisor = ctx.saved_tensors
    ds = _topk_select_backward_op(dw_TK.float().contiguous(), w, ids, divisor, ctx.E, ctx.norm, ctx.scale,
                                  ctx.flagged)
    return ds, None, None, None, None, None, None, None, None


_topk_select_op.register_autograd(_topk_select_backward, setup_context=_topk_select_setup)


def topk_select(scores_TE: Tensor, bias_E: Tensor | None, logits_TE: Tensor | None, spec: tuple) -> tuple:
    """:func:`megamoe.functional.topk_select`'s kernels through the ``megamoe::topk_select`` custom op: (ids, w) of
    fp32 scores (the same kernels and bits as the eager autograd Function); ``spec`` = (top_k, n_group,
    topk_group, group_top2, norm, scale)."""
    ids, w, _ = _topk_select_op(scores_TE, bias_E, logits_TE, *spec)
    return ids, w
