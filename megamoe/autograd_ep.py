"""The autograd Function of the fused expert-parallel path (what is saved, what is recomputed).

Legend: T tokens of this rank, D hidden, F expert FFN, G = 2F, L local experts, K top-k, S shared FFN,
H = 2S, W EP world size, C receive capacity rows.

Saved for backward: only the inputs (x, ids, weights and the parameters). The backward runs a second
exchange (megamoe.ops.ep_experts.ep_moe_backward) that pulls x and the output gradient again and
recomputes the gate/up pre-activations on the expert's rank, so no routed activation outlives a call:
memory per call is bounded by the capacity C, whatever the routing.

Gradients: x, topk_weights, the local experts (w13, w2: the full gradient of this rank's experts over
the global batch) and the shared expert (a per-rank partial gradient; summing it over ranks is data
parallelism's job, as for the router). Determinism: bitwise reproducible, no float atomics. Sync: none.
"""

from __future__ import annotations

import torch

from .ops.ep_experts import ep_moe_backward, ep_moe_forward

__all__ = ["MoEExpertsEPFunction"]


class MoEExpertsEPFunction(torch.autograd.Function):
    """Inputs validated and contiguous (megamoe.functional_ep does that). ``ws`` is the EP workspace."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS, ws,
                capacity_rows, rounds, timeout_s):
        ctx.ws, ctx.capacity_rows, ctx.rounds, ctx.timeout_s = ws, capacity_rows, rounds, timeout_s
        ctx.save_for_backward(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS)
        return ep_moe_forward(ws, x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS,
                              capacity_rows=capacity_rows, rounds=rounds, timeout_s=timeout_s)

    @staticmethod
    def backward(ctx, dout_TD):
        x_TD, ids_TK, w_TK, w13_LGD, w2_LDF, sw13_HD, sw2_DS = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout_TD = dout_TD.contiguous()
        if dout_TD.dtype != x_TD.dtype:
            dout_TD = dout_TD.to(x_TD.dtype)
        dx, dw, dw13, dw2, ds13, ds2 = ep_moe_backward(
            ctx.ws, dout_TD, x_TD, ids_TK, w_TK, w13_LGD, w2_LDF, sw13_HD, sw2_DS, capacity_rows=ctx.capacity_rows,
            rounds=ctx.rounds, timeout_s=ctx.timeout_s, need_w=need[2], need_w13=need[3], need_w2=need[4],
            need_shared=need[5] or need[6])
        return (dx if need[0] else None, None, dw if need[2] else None, dw13, dw2, ds13 if need[5] else None,
                ds2 if need[6] else None, None, None, None, None)
