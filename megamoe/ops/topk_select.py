"""Host launchers of the router's fused top-k selection (megamoe.kernels.topk_select).

Legend: T tokens, E experts, K top-k. ``topk_select`` (forward: ids, weights and each token's divisor from the
fp32 scores) and ``topk_select_backward`` (the scores' gradient of the weights); ``topk_select_supported`` says
which router shapes the kernel takes (the others keep megamoe.router.route's PyTorch selection). One launch each,
no sync, one program per block of tokens: bitwise deterministic and batch invariant.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.topk_select import topk_select_bwd_kernel, topk_select_fwd_kernel
from ._common import check_device, is_interpreted, pow2

__all__ = ["block_tokens", "topk_select", "topk_select_backward", "topk_select_supported"]

_MAX_EXPERTS = 1024
_REGS_PER_PROGRAM = 1024  # fp32 values of a program's (BLOCK_T, E_POW2) tile: 8 per thread of 4 warps (no spills)


def topk_select_supported(num_experts: int, top_k: int, n_group: int) -> bool:
    """Whether the fused selection takes this router: E up to 1024, K <= E; with groups, E a power of two (the
    groups are reshaped in registers) divisible by n_group."""
    if not (0 < num_experts <= _MAX_EXPERTS and 0 < top_k <= num_experts):
        return False
    return n_group <= 1 or (num_experts == pow2(num_experts) and num_experts % n_group == 0)


def block_tokens(num_experts: int, interpret: bool = False) -> int:
    """BLOCK_T, the tokens of one program: a pure function of E (4 under the interpreter)."""
    return 4 if interpret else max(1, min(32, _REGS_PER_PROGRAM // pow2(num_experts)))


def topk_select(scores_TE: torch.Tensor, bias_E: torch.Tensor | None, logits_TE: torch.Tensor | None, *, top_k: int,
                n_group: int = 1, topk_group: int = 1, group_top2: bool = True, norm: bool = True,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_TK int64, w_TK fp32, divisor_T fp32) of megamoe.router.route's selection from fp32 scores_TE (T, E),
    last dim contiguous: sel = scores + bias_E (fp32 or None), group-limited when n_group > 1 (group score: sum of
    the two largest when ``group_top2``, else the largest), the K largest sel (ties to the lower id), their
    unbiased scores divided by their sum + 1e-20 when ``norm``, times ``scale``; ``logits_TE`` given: tokens with a
    non-finite logit get NaN weights (and a NaN divisor)."""
    where = "topk_select"
    if (scores_TE.dim() != 2 or scores_TE.dtype != torch.float32
            or (scores_TE.shape[1] > 1 and scores_TE.stride(1) != 1)):
        raise ValueError(f"{where}: scores_TE must be 2-D fp32 with a contiguous last dim, got {scores_TE.dtype} "
                         f"{tuple(scores_TE.shape)}")
    T, E = scores_TE.shape
    if not topk_select_supported(E, top_k, n_group) or (n_group > 1 and not 0 < topk_group <= n_group):
        raise ValueError(f"{where}: E={E}, top_k={top_k}, n_group={n_group}, topk_group={topk_group} is not a "
                         "shape the fused selection takes (topk_select_supported)")
    if bias_E is not None and (bias_E.shape != (E,) or bias_E.dtype != torch.float32 or not bias_E.is_contiguous()):
        raise ValueError(f"{where}: bias_E must be a contiguous fp32 tensor of shape ({E},)")
    if logits_TE is not None and (logits_TE.shape != (T, E) or (E > 1 and logits_TE.stride(1) != 1)):
        raise ValueError(f"{where}: logits_TE must have shape ({T}, {E}) and a contiguous last dim")
    dev = check_device(topk_select_fwd_kernel, where, scores_TE=scores_TE, bias_E=bias_E, logits_TE=logits_TE)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=dev)
    w = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    divisor = torch.empty((T,), dtype=torch.float32, device=dev)
    if T == 0:
        return ids, w, divisor
    e_pow2 = pow2(E)
    block_t = block_tokens(E, is_interpreted(topk_select_fwd_kernel))
    topk_select_fwd_kernel[(triton.cdiv(T, block_t),)](
        scores_TE, bias_E if bias_E is not None else scores_TE, logits_TE if logits_TE is not None else scores_TE,
        ids, w, divisor, T, E, scores_TE.stride(0), logits_TE.stride(0) if logits_TE is not None else 0,
        float(scale), K=top_k, K_POW2=pow2(top_k), N_GROUP=max(1, n_group), TOPK_GROUP=topk_group,
        GROUP_TOP2=group_top2, HAS_BIAS=bias_E is not None, CHECK_LOGITS=logits_TE is not None, NORM=norm,
        SCALED=scale != 1.0, E_POW2=e_pow2, BLOCK_T=block_t, num_warps=4, enable_fp_fusion=True)
    return ids, w, divisor


def topk_select_backward(dw_TK: torch.Tensor, w_TK: torch.Tensor, ids_TK: torch.Tensor, divisor_T: torch.Tensor, *,
                         num_experts: int, norm: bool = True, scale: float = 1.0,
                         flagged: bool = False) -> torch.Tensor:
    """ds_TE (T, E) fp32: the gradient of :func:`topk_select`'s weights with respect to the scores (zeros but at
    each token's K ids). ``flagged``: the forward had the logits' check, whose tokens (a NaN divisor) get zeros,
    as torch.where's gradient (without it a NaN divisor propagates)."""
    where = "topk_select_backward"
    T, K = ids_TK.shape
    for name, t, dtype in (("dw_TK", dw_TK, torch.float32), ("w_TK", w_TK, torch.float32),
                           ("ids_TK", ids_TK, torch.int64)):
        if t.shape != (T, K) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be a contiguous {dtype} tensor of shape ({T}, {K}), got "
                             f"{t.dtype} {tuple(t.shape)}")
    dev = check_device(topk_select_bwd_kernel, where, dw_TK=dw_TK, w_TK=w_TK, ids_TK=ids_TK, divisor_T=divisor_T)
    ds = torch.empty((T, num_experts), dtype=torch.float32, device=dev)
    if T == 0:
        return ds
    e_pow2 = pow2(num_experts)
    block_t = block_tokens(num_experts, is_interpreted(topk_select_bwd_kernel))
    topk_select_bwd_kernel[(triton.cdiv(T, block_t),)](
        dw_TK, w_TK, ids_TK, divisor_T, ds, T, num_experts, float(scale), K=K, K_POW2=pow2(K), NORM=norm,
        SCALED=scale != 1.0, FLAGGED=flagged, E_POW2=e_pow2, BLOCK_T=block_t, num_warps=4, enable_fp_fusion=True)
    return ds
