"""The router of a DeepSeek-V3-style MoE layer, in plain PyTorch: top-k routing, expert counts, balance
losses and the aux-loss-free bias update.

The layer (megamoe.layer), the transformers integration and the specification (megamoe.reference, which
re-exports these names) all use this module: its code is both the production router and its spec. On the fused
backend two steps run as kernels: the logits GEMM (megamoe.functional.router_logits, which matches
:func:`router_logits` here) and everything after the scores (``route(..., select=megamoe.functional.topk_select)``:
the same ids as the code below on the same scores, ties included; the weights up to the order of their K-term
sum).

Legend: T tokens, D hidden size, E routed experts, K top-k, N groups (n_group), B sequences, S sequence length
(in :func:`seq_balance_loss`).

Numerics: logits as ``MoEConfig.router_dtype`` says: "fp32", ``x.float() @ router_w_ED.float().T``; "model",
``F.linear(x, router_w_ED.to(x.dtype))`` in x's dtype (fp32 accumulation, one rounding to x's dtype). Scores
sigmoid or softmax in fp32 either way (fp64 throughout for fp64 inputs, so that gradchecks are meaningful). No
host sync on CUDA.

Sources: DeepSeek-V3 technical report (arXiv 2412.19437) §2.1.2 (sigmoid gating, normalised top-k,
aux-loss-free bias that affects selection only, bias update rule, sequence-wise balance loss eq. 17-20);
the group-limited routing and the 1e-20 in the normaliser follow the public DeepSeek-V3 modelling code
(``MoEGate`` in the Hugging Face ``deepseek-ai/DeepSeek-V3`` repository): a group is scored by the sum of
its top-2 biased scores (sigmoid) or its max score (softmax, DeepSeek-V2). The global load-balance loss
is the Switch/GShard form ``E * sum_i f_i P_i`` (Fedus et al., arXiv 2101.03961, eq. 4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F_

from .config import ROUTER_DTYPES, MoEConfig

__all__ = [
    "RouterOutput",
    "load_balance_loss",
    "route",
    "router_logits",
    "seq_balance_loss",
    "tokens_per_expert",
    "update_expert_bias_",
]


@dataclass
class RouterOutput:
    """Result of :func:`route`.

    topk_ids_TK: int64 [T, K], selected expert ids, in descending order of biased score (ties: lower id).
    topk_weights_TK: fp32 [T, K], combine weights (unbiased scores, normalised, scaled once).
    scores_TE: fp32 [T, E], unbiased sigmoid/softmax scores (input of the balance losses).
    """

    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    scores_TE: torch.Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, except fp64 stays fp64 (so float64 gradchecks are meaningful)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _stable_topk(v: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim; equal values go to the lower index."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices[..., :k]


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(t)`` in two elementwise ops, |x| < inf (False for +-inf and NaN), where torch.isfinite
    launches four (x == x, |x|, != inf, and); no autograd record."""
    return t.detach().abs().lt(float("inf"))


def _check_finite(logits_TE: torch.Tensor) -> None:
    msg = "megamoe: router logits contain NaN/Inf (MoEConfig.nan_policy='raise')"
    if logits_TE.is_cuda or torch.compiler.is_compiling():  # a graph holds the assertion, not a branch
        torch._assert_async(_finite(logits_TE).all(), msg)  # no host sync
    elif not bool(_finite(logits_TE).all()):
        raise FloatingPointError(msg)


def _nan_to_minus_inf(t: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf, every other value (+-inf included) kept: ``torch.where(t.isnan(), -inf, t)`` in one op."""
    return torch.nan_to_num(t, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))


def router_logits(x_TD: torch.Tensor, router_w_ED: torch.Tensor, router_dtype: str = "fp32") -> torch.Tensor:
    """Router logits ``x @ router_w.T``: (T, D) x (E, D) -> (T, E).

    router_dtype "fp32": in fp32 (fp64 for fp64 inputs). "model": ``F.linear(x, router_w.to(x.dtype))``, in x's
    dtype (the weight cast to it, differentiably), as transformers' Qwen3-MoE and Mixtral routers compute them.
    """
    if router_dtype not in ROUTER_DTYPES:
        raise ValueError(f"router_logits: router_dtype must be one of {ROUTER_DTYPES}, got {router_dtype!r}")
    if router_dtype == "model":
        return F_.linear(x_TD, router_w_ED.to(x_TD.dtype))
    acc = _acc_dtype(x_TD.dtype)
    return x_TD.to(acc) @ router_w_ED.to(acc).t()


def route(x_TD: torch.Tensor, router_w_ED: torch.Tensor, expert_bias_E: torch.Tensor | None,
          cfg: MoEConfig, logits_TE: torch.Tensor | None = None, select: Callable | None = None) -> RouterOutput:
    """Top-k routing (DeepSeek-V3 / Qwen3 style). Differentiable w.r.t. x and router_w.

    The correction bias ``expert_bias_E`` (no gradient) only changes *which* experts are selected; the
    combine weights come from the unbiased scores. Group-limited routing keeps the ``topk_group`` best
    groups (non-kept experts are masked with -inf) before the expert top-k. No host sync on CUDA.
    ``logits_TE`` ([T, E], as ``cfg.router_dtype`` makes them: fp32, or x's dtype for "model") may be passed
    precomputed (e.g. by a batch-invariant kernel); the scores are computed from them in fp32 (fp64 for fp64).
    ``select``: a function ``(scores_TE, expert_bias_E, logits_TE or None, cfg) -> (ids, weights) or None`` that
    computes everything after the scores at once (the fused path's kernel, megamoe.functional.topk_select; given
    the logits when ``cfg.nan_policy == "propagate"``); None from it, or no ``select``, runs the PyTorch code below.
    """
    E, K = cfg.num_experts, cfg.top_k
    if logits_TE is None:
        logits_TE = router_logits(x_TD, router_w_ED, cfg.router_dtype)
    if cfg.nan_policy == "raise":
        _check_finite(logits_TE)
    acc_TE = logits_TE.to(_acc_dtype(logits_TE.dtype))  # model-dtype logits are scored in fp32, as transformers does
    scores_TE = torch.sigmoid(acc_TE) if cfg.score_func == "sigmoid" else torch.softmax(acc_TE, dim=-1)
    picked = None if select is None else select(scores_TE, expert_bias_E, logits_TE if cfg.nan_policy == "propagate"
                                                else None, cfg)
    if picked is not None:
        return RouterOutput(picked[0], picked[1], scores_TE)
    sel_TE = scores_TE.detach()
    if expert_bias_E is not None:
        sel_TE = sel_TE + expert_bias_E.detach().to(sel_TE.dtype)
    sel_TE = _nan_to_minus_inf(sel_TE)  # NaN never wins, ids stay in range
    if cfg.n_group > 1:
        T = sel_TE.shape[0]
        sel_TNx = sel_TE.view(T, cfg.n_group, E // cfg.n_group)
        if cfg.score_func == "sigmoid":
            group_TN = sel_TNx.topk(2, dim=-1).values.sum(-1)
        else:
            group_TN = sel_TNx.amax(dim=-1)
        group_TN = _nan_to_minus_inf(group_TN)
        drop_TN = torch.ones_like(group_TN, dtype=torch.bool)
        drop_TN.scatter_(1, _stable_topk(group_TN, cfg.topk_group), False)
        sel_TE = sel_TNx.masked_fill(drop_TN.unsqueeze(-1), float("-inf")).view(T, E)
    topk_ids_TK = _stable_topk(sel_TE, K)
    w_TK = scores_TE.gather(1, topk_ids_TK)
    if cfg.norm_topk_prob and K > 1:
        w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
    elif cfg.norm_topk_prob:
        w_TK = w_TK / (w_TK + 1e-20)
    if cfg.routed_scaling_factor != 1.0:  # (w * 1.0 is w, bit for bit, and so is its gradient)
        w_TK = w_TK * cfg.routed_scaling_factor
    if cfg.nan_policy == "propagate":  # a token with any non-finite logit must not look healthy
        w_TK = torch.where(_finite(logits_TE).all(-1, keepdim=True), w_TK, float("nan"))
    return RouterOutput(topk_ids_TK, w_TK, scores_TE)


def tokens_per_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E] count of (token, slot) pairs per expert; a device tensor, no host sync, exact."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids_TK.device)
    return counts_E.scatter_add_(0, topk_ids_TK.reshape(-1), torch.ones_like(topk_ids_TK.reshape(-1)))


def _normalised_scores(scores_TE: torch.Tensor) -> torch.Tensor:
    return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)


def seq_balance_loss(scores_TE: torch.Tensor, topk_ids_TK: torch.Tensor, seq_len: int, top_k: int,
                     coef: float) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss (eq. 17-20), averaged over the B = T / seq_len sequences.

    f_i = E / (K * T_s) * #{t : i in topk(t)},  P_i = mean_t s_{i,t} / sum_j s_{j,t},  L = coef * sum_i f_i P_i.
    """
    T, E = scores_TE.shape
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"seq_balance_loss: T={T} is not a multiple of seq_len={seq_len}")
    B = T // seq_len
    hits_BSE = torch.zeros(T, E, device=scores_TE.device).scatter_(1, topk_ids_TK, 1.0).view(B, seq_len, E)
    f_BE = hits_BSE.sum(1) * (E / (top_k * seq_len))
    P_BE = _normalised_scores(scores_TE).view(B, seq_len, E).mean(1)
    return coef * (f_BE * P_BE).sum(-1).mean()


def load_balance_loss(scores_TE: torch.Tensor, topk_ids_TK: torch.Tensor,
                      counts_E: torch.Tensor | None = None) -> torch.Tensor:
    """Global load-balance loss E * sum_i f_i P_i, f_i = counts_i / sum(counts), P_i = mean_t s'_{i,t}.

    Pass ``counts_E`` summed over a data-parallel group (e.g. all-reduced :func:`tokens_per_expert`)
    to balance over the global batch instead of the local micro-batch. Gradient flows through P only.
    """
    E = scores_TE.shape[1]
    if counts_E is None:
        counts_E = tokens_per_expert(topk_ids_TK, E)
    f_E = counts_E.float() / counts_E.sum().clamp_min(1).float()
    P_E = _normalised_scores(scores_TE).mean(0)
    return E * (f_E * P_E).sum()


@torch.no_grad()
def update_expert_bias_(expert_bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free bias update (DeepSeek-V3 §2.1.2), in place, on the device, no host sync.

    b_i += rate * sign(mean(counts) - counts_i): overloaded experts go down, underloaded ones up.
    """
    load_E = counts_E.float()
    expert_bias_E.add_(rate * torch.sign(load_E.mean() - load_E))
    return expert_bias_E
