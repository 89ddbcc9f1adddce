"""The executable specification of a DeepSeek-V3-style MoE layer, in plain PyTorch.

Every megamoe kernel is tested against these functions; read them as the spec. Tests and benchmarks import
this module; the package's fused paths do not. The router (routing, counts, balance losses, bias update) is
plain PyTorch in production too: it lives in megamoe.router and is re-exported here, so its code is its spec.

Legend: T tokens, D hidden size, F routed-expert FFN size, G = 2F (gate rows then up rows),
E routed experts, K top-k, S shared-expert FFN size, H = 2S, N groups (n_group), B sequences.

Numerics (what every backend must match up to GEMM accumulation order):
  * Router (megamoe.router): logits as ``MoEConfig.router_dtype`` says: "fp32", ``x.float() @
    router_w_ED.float().T``; "model", ``F.linear(x, router_w_ED.to(x.dtype))`` in x's dtype. Scores sigmoid or
    softmax in fp32 (fp64 throughout for fp64 inputs, so that gradchecks are meaningful).
  * Expert e on rows X: ``h = silu(X @ W13[e, :F].T) * (X @ W13[e, F:].T)`` rounded to the
    activation dtype; ``y = h @ W2[e].T`` rounded to the activation dtype (one row per (token, slot)).
  * Combine: ``out[t] = cast(sum_{k=0..K-1} w[t,k] * float(y[t,k]) + float(shared[t]))`` with fp32
    accumulation in slot order k = 0, 1, ..., K-1, the shared expert added last, one cast.

Sources of the router: megamoe.router. The FP8 recipe (quantizers, the FP8 routed experts) is specified in
megamoe.reference_fp8 and re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from .config import MoEConfig
from .reference_fp8 import (
    E4M3,
    E4M3_MAX,
    block_offsets_for,
    check_fp8_sizes,
    dequantize_1x128,
    dequantize_128x1_grouped,
    dequantize_128x128,
    moe_experts_fp8,
    moe_experts_fp8_backward,
    pad_128x1_blocks,
    pow2_exponent,
    quantize_1x128,
    quantize_128x1_grouped,
    quantize_128x128,
)
from .router import (
    RouterOutput,
    load_balance_loss,
    route,
    router_logits,
    seq_balance_loss,
    tokens_per_expert,
    update_expert_bias_,
)

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "RouterOutput",
    "block_offsets_for",
    "check_fp8_sizes",
    "combine",
    "dequantize_128x1_grouped",
    "dequantize_128x128",
    "dequantize_1x128",
    "expert_ffn",
    "load_balance_loss",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_fp8_backward",
    "moe_layer",
    "pad_128x1_blocks",
    "pow2_exponent",
    "quantize_128x1_grouped",
    "quantize_128x128",
    "quantize_1x128",
    "route",
    "routed_experts",
    "router_logits",
    "seq_balance_loss",
    "shared_expert",
    "swiglu",
    "tokens_per_expert",
    "update_expert_bias_",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 accumulation, except fp64 stays fp64 (so float64 gradchecks are meaningful)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 (fp64 for fp64 inputs), returned in the input dtype.

    SwiGLU: Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202.
    """
    acc = _acc_dtype(gate.dtype)
    return (F_.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def expert_ffn(x_MD: torch.Tensor, w13_GD: torch.Tensor, w2_DF: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert on M rows: [M, D] -> [M, D] in the input dtype. w13 rows: [gate; up]."""
    Fdim = w2_DF.shape[1]
    gu_MG = x_MD @ w13_GD.t()
    h_MF = swiglu(gu_MG[:, :Fdim], gu_MG[:, Fdim:])
    return h_MF @ w2_DF.t()


def routed_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, w13_EGD: torch.Tensor,
                   w2_EDF: torch.Tensor) -> torch.Tensor:
    """Expert outputs for every (token, slot): [T, K, D] in the activation dtype.

    Expert e processes its rows in (token, slot) order. Host-syncing (it loops over experts); the
    fused backend computes the same function without any sync.
    """
    T, K = topk_ids_TK.shape
    D = x_TD.shape[1]
    # The empty-slice sums are exactly 0; they keep every weight in the autograd graph, so weights get a
    # zero gradient (not None) even when no expert receives a token.
    y_ND = x_TD.new_zeros(T * K, D) + (x_TD[:0].sum() + w13_EGD[:0].sum() + w2_EDF[:0].sum())
    flat_ids = topk_ids_TK.reshape(-1)
    for e in range(w13_EGD.shape[0]):
        rows = (flat_ids == e).nonzero().squeeze(1)  # (t, k) order, since flat index = t*K + k
        if rows.numel():
            y_ND = y_ND.index_copy(0, rows, expert_ffn(x_TD[rows // K], w13_EGD[e], w2_EDF[e]))
    return y_ND.view(T, K, D)


def shared_expert(x_TD: torch.Tensor, shared_w13_HD: torch.Tensor | None,
                  shared_w2_DS: torch.Tensor | None) -> torch.Tensor | None:
    """The shared SwiGLU expert(s), fused into one of width S; None when there is none."""
    if shared_w13_HD is None:
        return None
    return expert_ffn(x_TD, shared_w13_HD, shared_w2_DS)


def combine(y_TKD: torch.Tensor, topk_weights_TK: torch.Tensor, shared_TD: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """Deterministic combine: fp32 sum over slots in order k=0..K-1, plus the shared output, one cast."""
    acc_TD = torch.zeros(y_TKD.shape[0], y_TKD.shape[2], dtype=_acc_dtype(y_TKD.dtype), device=y_TKD.device)
    for k in range(y_TKD.shape[1]):
        acc_TD = acc_TD + topk_weights_TK[:, k:k + 1].to(acc_TD.dtype) * y_TKD[:, k].to(acc_TD.dtype)
    if shared_TD is not None:
        acc_TD = acc_TD + shared_TD.to(acc_TD.dtype)
    return acc_TD.to(out_dtype)


def moe_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD=None, shared_w2_DS=None):
    """Routed + shared experts and combine for precomputed routing: [T, D] -> [T, D] (x's dtype)."""
    y_TKD = routed_experts(x_TD, topk_ids_TK, w13_EGD, w2_EDF)
    return combine(y_TKD, topk_weights_TK, shared_expert(x_TD, shared_w13_HD, shared_w2_DS), x_TD.dtype)


def moe_layer(x_TD, router_w_ED, expert_bias_E, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
              cfg: MoEConfig) -> tuple[torch.Tensor, RouterOutput]:
    """The whole layer on one device: router, routed experts, shared expert, combine."""
    r = route(x_TD, router_w_ED, expert_bias_E, cfg)
    out_TD = moe_experts(x_TD, r.topk_ids_TK, r.topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS)
    return out_TD, r
