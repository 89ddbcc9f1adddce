"""The autograd Function of the fused expert-parallel path (what is saved, what is recomputed).

Legend: T tokens of this rank, D hidden, F expert FFN, G = 2F, L local experts, K top-k, S shared FFN,
H = 2S, W EP world size, C receive capacity rows.

Saved for backward: the inputs (x, ids, weights and the parameters); when ``save_preact``, the gate/up
pre-activations of round 0's received rows (all rows unless the routing overflowed the capacity), gu_CG: C x
2F elements of x's dtype, e.g. 537 MB (512 MiB) for deepseek-v3 with the default C = 65536 rows (W >= 2, 4096
tokens per rank); when ``save_dispatched``, round 0's received x rows, xr_CD: C x D elements (940 MB = 0.875
GiB there); and this rank's routing plan (T*K + 4 + E int32), which the backward restores into the pool
instead of rebuilding it from the same ids. The backward runs a second exchange
(megamoe.ops.ep_experts.ep_moe_backward) that pulls the output gradient rows, pulls x rows again where it kept
none, and recomputes the pre-activations it does not have on the expert's rank. Either way memory per call is
bounded by the capacity C, whatever the routing, and the results are bitwise the same (the kept rows are those
the same schedule pulls again; gu is produced by the same kernel on the same rows in the same order).

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
                capacity_rows, rounds, timeout_s, save_preact, save_dispatched, options, kernel_config):
        ctx.ws, ctx.capacity_rows, ctx.rounds, ctx.timeout_s = ws, capacity_rows, rounds, timeout_s
        ctx.options, ctx.kernel_config = options, kernel_config
        grad = any(ctx.needs_input_grad)
        out_TD, gu_CG, xr_CD, plan = ep_moe_forward(ws, x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF,
                                                    shared_w13_HD, shared_w2_DS, capacity_rows=capacity_rows,
                                                    rounds=rounds, timeout_s=timeout_s, save_preact=save_preact,
                                                    save_dispatched=save_dispatched, save_plan=grad, options=options,
                                                    kernel_config=kernel_config)
        plan_E, plan_N = plan if plan is not None else (None, None)
        ctx.save_for_backward(x_TD, topk_ids_TK, topk_weights_TK, w13_LGD, w2_LDF, shared_w13_HD, shared_w2_DS,
                              gu_CG, xr_CD, plan_E, plan_N)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        x_TD, ids_TK, w_TK, w13_LGD, w2_LDF, sw13_HD, sw2_DS, gu_CG, xr_CD, plan_E, plan_N = ctx.saved_tensors
        need = ctx.needs_input_grad
        dout_TD = dout_TD.contiguous()
        if dout_TD.dtype != x_TD.dtype:
            dout_TD = dout_TD.to(x_TD.dtype)
        dx, dw, dw13, dw2, ds13, ds2 = ep_moe_backward(
            ctx.ws, dout_TD, x_TD, ids_TK, w_TK, w13_LGD, w2_LDF, sw13_HD, sw2_DS, capacity_rows=ctx.capacity_rows,
            rounds=ctx.rounds, timeout_s=ctx.timeout_s, need_w=need[2], need_w13=need[3], need_w2=need[4],
            need_shared=need[5] or need[6], saved_gu_CG=gu_CG, saved_xr_CD=xr_CD,
            saved_plan=(plan_E, plan_N) if plan_E is not None else None, options=ctx.options,
            kernel_config=ctx.kernel_config)
        return (dx if need[0] else None, None, dw if need[2] else None, dw13, dw2, ds13 if need[5] else None,
                ds2 if need[6] else None, None, None, None, None, None, None, None, None)
