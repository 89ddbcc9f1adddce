"""Expert-parallel benchmark providers (W > 1, launched by torchrun).

Legend: T tokens on this rank, D hidden, F expert FFN, G = 2F, W EP world size, L = E / W local experts
(rank r owns global experts [r*L, (r+1)*L)), K top-k, N = T*K (token, slot) rows of this rank, R rows
received by this rank.

* ``nccl``: the widely used NCCL + PyTorch recipe (torchtitan / Megatron "alltoall" dispatcher style):
  per-expert counts exchanged with ``all_to_all_single`` and copied to the host to size buffers (one host
  sync per call), ``all_to_all_single`` dispatch with autograd, local permute to expert-major order,
  ``torch._grouped_mm`` gate/up and down with SwiGLU, inverse permute, ``all_to_all_single`` combine,
  fp32 weighted sum over slots. Autograd runs through all of it.
* ``symm-vdev``: PyTorch symmetric memory ``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset``
  (NVSHMEM backend, no host sync) + ``torch._grouped_mm``; its kernels cap local experts at 16.
* ``deepep``: DeepEP when importable; this harness has no adapter for it yet, so it is reported as such.
* ``megamoe`` / ``reference`` under EP: :func:`megamoe.functional_ep.moe_experts_ep` (fused path) and
  :func:`megamoe.reference_ep.moe_experts_ep` (the plain-PyTorch EP spec).
* ``megamoe-ep`` (one GPU, no torchrun): the same EP path on a one-rank NCCL group that this process creates
  (pull dispatch from its own pool, push combine, receive buffers, rounds): what the exchange machinery costs
  at W = 1 against ``megamoe``'s direct path, and the EP path's GEMMs measurable on a one-GPU machine (at
  W = 1 with M tokens a local expert gets M*K/E rows, as at EP = W with M / W tokens per rank). The run
  keeps the EP workspace (symmetric memory, allocated once per layer shape) until it ends; whether the
  peak-memory column counts that pool depends on symmetric memory's allocator (not checked).
"""

from __future__ import annotations

import importlib
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from .. import reference as ref
from .providers import Context, Provider, swiglu_grouped, weighted_sum

# torch >= 2.12 marks the autograd-aware all_to_all_single deprecated; it is still the recipe's call.
warnings.filterwarnings("ignore", message=".*nn.functional.all_to_all_single is deprecated.*")

__all__ = ["EP_PROVIDERS", "nccl_moe_experts_ep", "build_megamoe_ep", "build_reference_ep", "one_rank_group",
           "close_one_rank_group"]


def _inverse(order_N: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order_N).scatter_(0, order_N, torch.arange(order_N.numel(), device=order_N.device))


def nccl_moe_experts_ep(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD=None,
                        shared_w2_DS=None, *, group=None) -> torch.Tensor:
    """The NCCL + PyTorch EP recipe: [T, D] -> [T, D] in x's dtype. One host sync (the split sizes).

    Deterministic given the routing on NCCL's all_to_all (pure data movement) except for the autograd
    accumulation of dx over slots (PyTorch's index backward), as in the recipe it reproduces.
    """
    W = dist.get_world_size(group)
    T, K = topk_ids_TK.shape
    L, D = w13_LGD.shape[0], x_TD.shape[1]
    N = T * K
    flat_ids_N = topk_ids_TK.reshape(-1)
    # Sorted by global expert id = by (dest rank, local expert, token, slot).
    order_N = torch.sort(flat_ids_N, stable=True).indices
    counts_E = torch.bincount(flat_ids_N, minlength=W * L)
    recv_counts_WL = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts_WL, counts_E, group=group)
    send_W, recv_W = counts_E.view(W, L).sum(1), recv_counts_WL.view(W, L).sum(1)
    splits = torch.cat([send_W, recv_W]).tolist()  # the recipe's device->host copy
    send_splits, recv_splits = splits[:W], splits[W:]
    R = sum(recv_splits)

    recv_x_RD = dist_fn.all_to_all_single(x_TD.new_empty(R, D), x_TD[order_N // K], recv_splits, send_splits,
                                          group=group)
    # Received rows are (source rank, local expert, ...); permute to (local expert, source rank, ...).
    local_e_R = torch.repeat_interleave(torch.arange(L, device=x_TD.device).repeat(W), recv_counts_WL,
                                        output_size=R)
    perm_R = torch.sort(local_e_R, stable=True).indices
    offs_L = torch.cumsum(recv_counts_WL.view(W, L).sum(0), 0).to(torch.int32)
    y_perm_RD = swiglu_grouped(recv_x_RD[perm_R], w13_LGD, w2_LDF, offs_L)
    y_RD = y_perm_RD[_inverse(perm_R)]
    back_ND = dist_fn.all_to_all_single(x_TD.new_empty(N, D), y_RD, send_splits, recv_splits, group=group)
    y_TKD = back_ND[_inverse(order_N)].view(T, K, D)
    return weighted_sum(y_TKD, topk_weights_TK, ref.shared_expert(x_TD, shared_w13_HD, shared_w2_DS), x_TD.dtype)


def _ep_only(ctx: Context, prob) -> str | None:
    return None if ctx.world_size > 1 else "EP provider (launch with torchrun --nproc-per-node W, W >= 2)"


def _build_nccl(prob, ctx: Context):
    def fn(*args):
        return nccl_moe_experts_ep(*args, group=ctx.group)
    return fn


def build_megamoe_ep(prob, ctx: Context, fp8: bool = False):
    fused = importlib.import_module("megamoe.functional_ep").moe_experts_ep
    kw = {"fp8": True} if fp8 else {}

    def fn(*args):
        return fused(*args, group=ctx.group, options=ctx.ep_options, kernel_config=ctx.kernel_config, **kw)
    return fn


_OWN_GROUP: list = []  # the one-rank default group one_rank_group created (closed by close_one_rank_group)


def one_rank_group(device: torch.device):
    """The default process group of this single process: NCCL, one rank, over an in-process store, created on
    first use. Raises RuntimeError if a default group of more than one rank already exists."""
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
        _OWN_GROUP.append(dist.group.WORLD)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"megamoe-ep provider: a default process group of {dist.get_world_size()} ranks "
                           "exists; under torchrun use the megamoe provider")
    return dist.group.WORLD


def close_one_rank_group() -> None:
    """Destroy the group :func:`one_rank_group` created, after dropping its EP workspaces; a no-op otherwise."""
    if not _OWN_GROUP:
        return
    from ..distributed import release_workspaces
    group = _OWN_GROUP.pop()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    release_workspaces(group)
    dist.destroy_process_group()


def _one_rank_unavailable(ctx: Context, prob) -> str | None:
    if ctx.world_size > 1:
        return "one-GPU provider (under torchrun the megamoe provider runs the EP path)"
    if ctx.device.type != "cuda":
        return "the EP path needs CUDA (symmetric memory)"
    return None


def _build_megamoe_one_rank(prob, ctx: Context, fp8: bool = False):
    group = one_rank_group(ctx.device)
    fused = importlib.import_module("megamoe.functional_ep").moe_experts_ep
    kw = {"fp8": True} if fp8 else {}

    def fn(*args):
        return fused(*args, group=group, options=ctx.ep_options, kernel_config=ctx.kernel_config, **kw)
    return fn


def _one_rank_fp8_unavailable(ctx: Context, prob) -> str | None:
    reason = _one_rank_unavailable(ctx, prob)
    if reason:
        return reason
    from ..validation import check_fp8
    try:
        check_fp8("megamoe-ep-fp8", prob.cfg.hidden_size, prob.cfg.moe_intermediate_size, prob.dtype, ctx.device)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def build_reference_ep(prob, ctx: Context):
    from .. import reference_ep

    def fn(*args):
        return reference_ep.moe_experts_ep(*args, group=ctx.group)
    return fn


def _deepep_unavailable(ctx: Context, prob) -> str | None:
    if ctx.world_size < 2:
        return _ep_only(ctx, prob)
    try:
        importlib.import_module("deep_ep")
    except Exception as exc:  # noqa: BLE001
        return f"deep_ep not importable ({type(exc).__name__})"
    return "deep_ep is importable but this harness has no DeepEP adapter yet"


def _symm_unavailable(ctx: Context, prob) -> str | None:
    if ctx.world_size < 2:
        return _ep_only(ctx, prob)
    if ctx.device.type != "cuda":
        return "needs CUDA + NVSHMEM"
    from .symm_vdev import symm_vdev_unavailable
    return symm_vdev_unavailable(ctx, prob)


def _build_symm(prob, ctx: Context):
    from .symm_vdev import build_symm_vdev
    return build_symm_vdev(prob, ctx)


EP_PROVIDERS = [
    Provider("nccl", True, "NCCL + PyTorch recipe: counts to host, all_to_all_single dispatch/combine with "
             "autograd, local permute, torch._grouped_mm", _ep_only, _build_nccl),
    Provider("symm-vdev", True, "symmetric memory all_to_all_vdev_2d / _2d_offset (NVSHMEM) + "
             "torch._grouped_mm (local experts <= 16)", _symm_unavailable, _build_symm),
    Provider("megamoe-ep", False, "megamoe's EP path (functional_ep.moe_experts_ep) on a one-rank group: "
             "the exchange machinery at W = 1 (one GPU, no torchrun)", _one_rank_unavailable,
             _build_megamoe_one_rank),
    Provider("megamoe-ep-fp8", False, "megamoe-ep with the routed experts in block-scaled FP8 "
             "(moe_experts_ep(..., fp8=True))", _one_rank_fp8_unavailable,
             lambda prob, ctx: _build_megamoe_one_rank(prob, ctx, fp8=True), fp8=True),
    Provider("deepep", True, "DeepEP (external; skipped when not importable)", _deepep_unavailable,
             lambda prob, ctx: None),
]
