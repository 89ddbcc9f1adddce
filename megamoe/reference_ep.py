"""Expert-parallel reference over ``torch.distributed`` (plain PyTorch, gloo on CPU or NCCL on GPU).

Legend: T tokens on this rank, D hidden, F expert FFN, G = 2F, K top-k, W EP world size, L local
experts (rank r owns global experts [r*L, (r+1)*L)), N = T*K (token, slot) pairs of this rank,
R rows received by this rank.

Global token numbering: rank r's local token t has global index ``sum_{q<r} T_q + t``, i.e. the global
batch is the concatenation of the ranks' batches in rank order. The output of :func:`moe_experts_ep`
is this rank's tokens, in the order of ``x_TD``.

Protocol (the textbook NCCL recipe, host-synchronous by design: it is the oracle, not the fast path):
  1. each (token, slot) pair goes to rank ``id // L``; pairs are sent sorted by (dest rank, token, slot);
  2. send counts are exchanged with ``all_to_all_single`` and copied to the host to size buffers;
  3. token rows are dispatched with ``all_to_all_rows`` (``all_to_all_single`` with an autograd backward);
  4. the destination groups received rows by local expert with a stable sort, so every expert sees its rows
     in (global token, slot) order, runs its SwiGLU, and sends the rows back (second all_to_all);
  5. the owner puts each row back in its (token, slot) place and runs the reference ``combine``.
Gradients flow through both all-to-alls; routed-expert weight gradients land on the owning rank, while
the gradients of replicated parameters (shared expert, router) are per-rank partials whose sum over the
group equals the single-process gradient (summing them is data parallelism's job).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import combine, expert_ffn, shared_expert
from .validation import check_same_across_ranks

__all__ = ["moe_experts_ep", "all_to_all_rows"]


class _AllToAllRows(torch.autograd.Function):
    """Row all-to-all with autograd: the backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x_ND.new_empty(sum(out_splits), *x_ND.shape[1:])
        dist.all_to_all_single(out, x_ND.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        out_splits, in_splits = ctx.splits
        grad_in = grad_out.new_empty(sum(in_splits), *grad_out.shape[1:])
        dist.all_to_all_single(grad_in, grad_out.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over rows: sends ``in_splits[r]`` rows to rank r."""
    return _AllToAllRows.apply(x_ND, list(out_splits), list(in_splits), group)


def moe_experts_ep(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD=None, shared_w2_DS=None,
                   *, group=None) -> torch.Tensor:
    """Routed + shared experts and combine with experts sharded over ``group``: [T, D] -> [T, D].

    Args:
        x_TD: this rank's tokens, any float dtype, any T >= 0 (ranks may differ).
        topk_ids_TK: int64 global expert ids in [0, W*L). topk_weights_TK: fp32 combine weights.
        w13_LGD, w2_LDF: this rank's L experts. shared_*: replicated shared expert or None.
    Returns this rank's output rows in x's dtype. Deterministic; host-synchronous (reference only).
    """
    W = dist.get_world_size(group)
    T, K = topk_ids_TK.shape
    D = x_TD.shape[1]
    L = w13_LGD.shape[0]
    check_same_across_ranks(group, "reference EP", {"hidden": D, "top_k": K, "local_experts": L,
                                                    "ffn": w2_LDF.shape[2], "dtype": x_TD.dtype,
                                                    "shared": 0 if shared_w2_DS is None else shared_w2_DS.shape[1]},
                            x_TD.device)
    N = T * K
    dev = x_TD.device
    flat_ids_N = topk_ids_TK.reshape(-1).long()
    dest_N = flat_ids_N // L
    # Pairs sorted by (dest rank, token, slot): flat index n = t*K + k already orders (token, slot).
    send_order_N = torch.sort(dest_N * max(N, 1) + torch.arange(N, device=dev)).indices
    send_counts_W = torch.bincount(dest_N, minlength=W)
    recv_counts_W = torch.empty_like(send_counts_W)
    dist.all_to_all_single(recv_counts_W, send_counts_W, group=group)
    send_splits, recv_splits = send_counts_W.tolist(), recv_counts_W.tolist()
    R = sum(recv_splits)

    send_x_ND = x_TD[send_order_N // K]
    recv_x_RD = all_to_all_rows(send_x_ND, recv_splits, send_splits, group)
    send_e_N = (flat_ids_N % L)[send_order_N]
    recv_e_R = send_e_N.new_empty(R)
    dist.all_to_all_single(recv_e_R, send_e_N, recv_splits, send_splits, group=group)

    # Received rows arrive in (source rank, token, slot) = (global token, slot) order; a stable sort by
    # local expert keeps that order inside each expert.
    # Every rank must run both all-to-all backwards, also one that received no rows: the empty-slice
    # sum (exactly 0) keeps y_RD connected to recv_x_RD in the autograd graph.
    y_RD = recv_x_RD.new_zeros(R, D) + (recv_x_RD[:0].sum() + w13_LGD[:0].sum() + w2_LDF[:0].sum())
    by_expert_R = torch.sort(recv_e_R, stable=True).indices
    for e in range(L):
        rows = by_expert_R[recv_e_R[by_expert_R] == e]
        if rows.numel():
            y_RD = y_RD.index_copy(0, rows, expert_ffn(recv_x_RD[rows], w13_LGD[e], w2_LDF[e]))

    back_ND = all_to_all_rows(y_RD, send_splits, recv_splits, group)
    y_ND = x_TD.new_zeros(N, D).index_copy(0, send_order_N, back_ND)
    shared_TD = shared_expert(x_TD, shared_w13_HD, shared_w2_DS)
    return combine(y_ND.view(T, K, D), topk_weights_TK, shared_TD, x_TD.dtype)
