"""Benchmark providers: named, importable implementations of the same routed + shared expert function.

Legend: T tokens (per rank), D hidden, F expert FFN, G = 2F, E routed experts, L local experts, K top-k,
N = T*K (token, slot) rows, S shared FFN, H = 2S, W EP world size.

Every provider is a :class:`Provider`; ``build(problem)`` returns ``fn(x_TD, topk_ids_TK, topk_weights_TK,
w13, w2, shared_w13_HD, shared_w2_DS) -> out_TD`` computing :func:`megamoe.reference.moe_experts` (W = 1)
or :func:`megamoe.reference_ep.moe_experts_ep` (W > 1), differentiable w.r.t. x, the topk weights and all
weights. ``unavailable(ctx)`` returns None or the reason it cannot run here (printed as a note).

Single-device providers (this module): ``reference``, ``torch``, ``megamoe``, and the FP8 ones ``megamoe-fp8``
(also under EP; it quantizes each weight once per version, megamoe.ops.fp8_weights), ``megamoe-fp8-uncached``
(the weights quantized at every call), ``megamoe-compiled`` and ``megamoe-fp8-compiled`` (under torch.compile)
and ``torch-fp8`` (:mod:`megamoe.bench.torch_fp8`), checked with an FP8 tolerance
(:mod:`megamoe.bench.check_fp8`). Expert-parallel providers (``nccl``, ``symm-vdev``, ``deepep``, and
``megamoe``/``reference`` under EP) are in :mod:`megamoe.bench.providers_ep`. :func:`get_providers` is the registry
over both.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import reference as ref
from ..validation import interpreter_active

__all__ = ["Provider", "Context", "get_providers", "provider_names", "grouped_mm", "torch_moe_experts",
           "DEFAULT_PROVIDERS"]


@dataclass
class Context:
    """Where providers run: device, world size W, this rank, and the process group (None when W = 1); the
    megamoe providers' kernel choices and EP options (``--tiles``, ``--ep-*``; None: the defaults)."""

    device: torch.device
    world_size: int = 1
    rank: int = 0
    group: object = None
    kernel_config: object = None
    ep_options: object = None


@dataclass
class Provider:
    """A named implementation. ``ep_only``: it needs expert parallelism (W > 1, torchrun). ``fp8``: its routed
    experts compute in FP8 (checked with an FP8 tolerance, its % of peak against the dense FP8 rate)."""

    name: str
    ep_only: bool
    description: str
    unavailable: Callable[[Context, object], str | None]
    build: Callable[[object, Context], Callable]
    fp8: bool = False


# ---------------------------------------------------------------------------------------------------
# grouped GEMM: torch._grouped_mm, with a per-expert loop only off CUDA where _grouped_mm is missing
# ---------------------------------------------------------------------------------------------------
@functools.cache
def _cpu_grouped_mm_works() -> bool:
    """torch 2.13 CPU builds run ``torch._grouped_mm`` (fwd and bwd); older ones may not."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(4, 8, requires_grad=True)
        b = torch.randn(2, 8, 4, requires_grad=True)
        y = torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32))
        y.backward(torch.ones_like(y))
        return torch.allclose(y[1:], a[1:] @ b[1], atol=1e-5)
    except Exception:  # noqa: BLE001 - any failure means "use the loop"
        return False


def grouped_mm(a_NK: torch.Tensor, b_EKM: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Row-grouped matmul: rows [offs[e-1], offs[e]) of a times b[e] -> [N, M] (autograd-aware).

    ``offs_E`` int32 inclusive prefix sums of the group sizes (empty groups allowed). On CUDA this is
    ``torch._grouped_mm`` (bf16 fast path on sm90); off CUDA, ``torch._grouped_mm`` when the build runs it,
    else a per-group loop (host sync; CPU CI only).
    """
    if a_NK.is_cuda or _cpu_grouped_mm_works():
        return torch._grouped_mm(a_NK, b_EKM, offs=offs_E)
    ends = offs_E.tolist()
    outs, lo = [], 0
    for e, hi in enumerate(ends):
        outs.append(a_NK[lo:hi] @ b_EKM[e])
        lo = hi
    return torch.cat(outs, 0) if outs else a_NK.new_zeros(0, b_EKM.shape[-1])


def expert_major_order(flat_ids_N: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, offs_E): a stable sort of rows by expert (so (expert, token, slot) order) and the int32
    inclusive group ends for :func:`grouped_mm`. No host sync."""
    order_N = torch.sort(flat_ids_N, stable=True).indices
    counts_E = torch.bincount(flat_ids_N, minlength=num_experts)
    return order_N, torch.cumsum(counts_E, 0).to(torch.int32)


def swiglu_grouped(x_ND: torch.Tensor, w13_EGD: torch.Tensor, w2_EDF: torch.Tensor,
                   offs_E: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on expert-major rows: grouped gate/up GEMM, fp32 silu*up rounded once, grouped down."""
    F_ = w2_EDF.shape[2]
    gu_NG = grouped_mm(x_ND, w13_EGD.transpose(-2, -1), offs_E)
    h_NF = ref.swiglu(gu_NG[:, :F_], gu_NG[:, F_:])
    return grouped_mm(h_NF, w2_EDF.transpose(-2, -1), offs_E)


def weighted_sum(y_TKD: torch.Tensor, topk_weights_TK: torch.Tensor, shared_TD: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """fp32 weighted sum over the K slots plus the shared output, one cast (the reference's combine)."""
    acc_TD = (y_TKD.float() * topk_weights_TK.float().unsqueeze(-1)).sum(1)
    if shared_TD is not None:
        acc_TD = acc_TD + shared_TD.float()
    return acc_TD.to(out_dtype)


def torch_moe_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD=None,
                      shared_w2_DS=None):
    """The common eager single-GPU path: sort (token, slot) rows by expert, ``torch._grouped_mm`` for
    gate/up and down with SwiGLU between, un-sort, fp32 weighted sum over slots (+ shared expert).

    Deterministic (sorts and gathers only; no atomics). No host sync on CUDA.
    """
    T, K = topk_ids_TK.shape
    order_N, offs_E = expert_major_order(topk_ids_TK.reshape(-1), w13_EGD.shape[0])
    y_sorted_ND = swiglu_grouped(x_TD[order_N // K], w13_EGD, w2_EDF, offs_E)
    inverse_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))
    y_TKD = y_sorted_ND[inverse_N].view(T, K, -1)
    return weighted_sum(y_TKD, topk_weights_TK, ref.shared_expert(x_TD, shared_w13_HD, shared_w2_DS), x_TD.dtype)


# ---------------------------------------------------------------------------------------------------
# single-device providers
# ---------------------------------------------------------------------------------------------------
def _single_only(ctx: Context, prob) -> str | None:
    return "single-device provider (run without torchrun for W = 1)" if ctx.world_size > 1 else None


def _torch_unavailable(ctx: Context, prob) -> str | None:
    if ctx.world_size > 1:
        return _single_only(ctx, prob)
    if ctx.device.type == "cuda" and not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    return None


def _megamoe_fn(kernel_config=None, fp8: bool = False):
    """The fused single-device entry, imported lazily (it may not exist yet)."""
    mod = importlib.import_module("megamoe.functional")
    fused = mod.moe_experts
    kw = {"fp8": True} if fp8 else {}

    def fn(x_TD, ids_TK, w_TK, w13, w2, sw13, sw2):
        return fused(x_TD, ids_TK, w_TK, w13, w2, sw13, sw2, backend="fused", kernel_config=kernel_config, **kw)
    return fn


def _megamoe_unavailable(ctx: Context, prob) -> str | None:
    if ctx.device.type != "cuda" and not interpreter_active():
        return "the fused Triton path needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    try:
        if ctx.world_size > 1:
            importlib.import_module("megamoe.functional_ep").moe_experts_ep  # noqa: B018
        else:
            importlib.import_module("megamoe.functional").moe_experts  # noqa: B018
    except Exception as exc:  # noqa: BLE001 - report why, skip the provider
        return f"megamoe fused path not importable: {type(exc).__name__}: {exc}"
    return None


def _build_megamoe(prob, ctx: Context):
    if ctx.world_size > 1:
        from .providers_ep import build_megamoe_ep
        return build_megamoe_ep(prob, ctx)
    return _megamoe_fn(ctx.kernel_config)


def _megamoe_fp8_unavailable(ctx: Context, prob, name: str = "megamoe-fp8") -> str | None:
    reason = _megamoe_unavailable(ctx, prob)
    if reason:
        return reason
    from ..validation import check_fp8
    try:
        check_fp8(name, prob.cfg.hidden_size, prob.cfg.moe_intermediate_size, prob.dtype, ctx.device)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _build_megamoe_fp8(prob, ctx: Context):
    if ctx.world_size > 1:
        from .providers_ep import build_megamoe_ep
        return build_megamoe_ep(prob, ctx, fp8=True)
    return _megamoe_fn(ctx.kernel_config, fp8=True)


def _build_megamoe_fp8_uncached(prob, ctx: Context):
    from ..ops.fp8_weights import uncached

    fn = _build_megamoe_fp8(prob, ctx)

    def run(*args):
        with uncached():  # the forward quantizes the weights; the backward makes fresh K-major copies of them
            return fn(*args)
    return run


def _compiled_unavailable(ctx: Context, prob, fp8: bool = False) -> str | None:
    if ctx.world_size > 1:
        return _single_only(ctx, prob)
    return _megamoe_fp8_unavailable(ctx, prob, "megamoe-fp8-compiled") if fp8 else _megamoe_unavailable(ctx, prob)


def _build_compiled(prob, ctx: Context, fp8: bool = False):
    """The fused entry under ``torch.compile(fullgraph=True, dynamic=False)`` (megamoe's custom ops; inductor and
    its compile caches). Dynamo's caches are reset first: the providers' functions share one code object, and each
    case, shape and grad mode would otherwise add entries towards its recompile limit (a hard error under
    fullgraph). The reset also drops the other compiled provider's graphs in the same case: it compiles them again
    in its warm-up (``--warmup`` > 0, the default)."""
    torch.compiler.reset()
    return torch.compile(_megamoe_fn(ctx.kernel_config, fp8=fp8), fullgraph=True, dynamic=False)


def _torch_fp8_unavailable(ctx: Context, prob) -> str | None:
    if ctx.world_size > 1:
        return _single_only(ctx, prob)
    from .torch_fp8 import torch_fp8_unavailable
    return torch_fp8_unavailable(ctx.device, prob.dtype)


def _build_torch_fp8(prob, ctx: Context):
    from .torch_fp8 import torch_fp8_moe_experts
    return torch_fp8_moe_experts


def _build_reference(prob, ctx: Context):
    if ctx.world_size > 1:
        from .providers_ep import build_reference_ep
        return build_reference_ep(prob, ctx)
    return ref.moe_experts


_SINGLE = [
    Provider("megamoe", False, "megamoe fused path (functional.moe_experts backend='fused'; "
             "functional_ep.moe_experts_ep under EP)", _megamoe_unavailable, _build_megamoe),
    Provider("torch", False, "eager PyTorch: sort by expert, torch._grouped_mm gate/up + down, SwiGLU, "
             "un-sort, fp32 weighted sum", _torch_unavailable, lambda prob, ctx: torch_moe_experts),
    Provider("reference", False, "megamoe.reference (per-expert loop, host-syncing; the spec)",
             lambda ctx, prob: None, _build_reference),
    Provider("megamoe-fp8", False, "megamoe fused path with the routed experts in block-scaled FP8 "
             "(moe_experts(..., fp8=True); moe_experts_ep under EP)", _megamoe_fp8_unavailable, _build_megamoe_fp8,
             fp8=True),
    Provider("megamoe-fp8-uncached", False, "megamoe-fp8 with the weights quantized at every call "
             "(megamoe.ops.fp8_weights.uncached(): what FSDP2, CUDA-graph replays and one micro-batch per optimizer "
             "step pay)", functools.partial(_megamoe_fp8_unavailable, name="megamoe-fp8-uncached"),
             _build_megamoe_fp8_uncached, fp8=True),
    Provider("megamoe-compiled", False, "megamoe under torch.compile(fullgraph=True) (the custom ops of "
             "megamoe.custom_ops)", _compiled_unavailable, _build_compiled),
    Provider("megamoe-fp8-compiled", False, "megamoe-fp8 under torch.compile(fullgraph=True): the forward op "
             "quantizes the weights at every call, the backward op takes its blocks",
             functools.partial(_compiled_unavailable, fp8=True), functools.partial(_build_compiled, fp8=True),
             fp8=True),
    Provider("torch-fp8", False, "eager PyTorch FP8: sort by expert (groups padded to 16), "
             "torch._scaled_grouped_mm with rowwise scales for every expert GEMM, SwiGLU, fp32 weighted sum (sm90)",
             _torch_fp8_unavailable, _build_torch_fp8, fp8=True),
]

#: providers run when --providers is not given, per setting
DEFAULT_PROVIDERS = {
    ("cpu", False): ["reference", "torch", "megamoe"],
    ("cuda", False): ["megamoe", "torch"],
    ("cpu", True): ["reference", "nccl", "megamoe"],
    ("cuda", True): ["megamoe", "nccl", "symm-vdev", "deepep"],
}


def get_providers() -> dict[str, Provider]:
    """All registered providers by name (single-device and EP)."""
    from .providers_ep import EP_PROVIDERS
    out = {p.name: p for p in _SINGLE}
    for p in EP_PROVIDERS:
        out[p.name] = p
    return out


def provider_names() -> list[str]:
    return list(get_providers())
