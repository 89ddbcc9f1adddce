"""The autograd Functions of the fused single-GPU path: what is saved, what is recomputed.

Legend: T tokens, D hidden size, F expert FFN size, G = 2F ([gate | up]), E experts, K top-k,
N = T*K (token, slot) rows in expert-grouped order, S shared-expert FFN size, H = 2S, P row-dot partials.

``MoEExpertsFunction`` (routed + shared SwiGLU experts and the combine, for precomputed top-k):

  forward   plan  = build_routing_plan(topk_ids)                     (sort by (expert, token, slot))
            h, gu = gate_up_swiglu(x[row_token], w13)                (rows gathered straight from x)
            y     = down_proj(h, w2)                                 (one row per (token, slot))
            hs, gus = gate_up_swiglu(x, shared_w13); ys = down_proj(hs, shared_w2)   (one group)
            out   = combine_fwd(y, w, ys)                            (fp32, slot order, shared last, one cast)
  backward  dgu, hw, part = swiglu_dgrad(dout[row_token], w2, gu, scale=w)   (dh, SwiGLU bwd, row dots)
            dw2  = k_grouped_mm(dout[row_token], hw)                 (sum over the expert's rows, fixed order)
            dw13 = k_grouped_mm(dgu, x[row_token])
            (where the table sends a weight gradient to torch._grouped_mm, which takes contiguous rows
            only: dout[row_token] and / or x[row_token] are first copied into row order, see below)
            dx_rows = grouped_mm_nn(dgu, w13)
            (shared expert: the same four launchers with one group)
            dx, dw = slot_sum_bwd(dx_rows, dx_shared, part)          (fp32, slot order, one cast)

Saved for backward (activation memory per token, besides the layer input x which the caller keeps
anyway): the routed pre-activations gu (K * 2F elements of x's dtype), the shared pre-activations gus
(2S elements), and the plan (3 int32 per (token, slot): row_token, row_src, row_of, plus E + 1 offsets).
In bf16 that is 4KF + 4S + 12K bytes per token: qwen3-30b-a3b (F 768, K 8, S 0) 24.7 KB,
deepseek-v3 (F 2048, K 8, S 2048) 73.8 KB. h (K*F) and y (K*D) are not kept: h is recomputed bitwise
from gu in the dgrad epilogue; y is only needed through <dout, y>, which the dgrad epilogue gets as
<dout @ w2, h>. Transient peak in backward: dgu (N x 2F), hw (N x F), dx_rows (N x D) in x's dtype, and
with torch's weight-gradient kernel the row-order copies of dout and x (N x D each, below).

Numerics: h and y are rounded to x's dtype exactly where megamoe.reference rounds them; the combine and
the slot sums are fp32 in slot order. dh is computed as cast(w * (dout @ w2)) (reference:
cast(cast(w * dout) @ w2)) and the w2 gradient as dout^T @ cast(w * h) (reference: cast(w * dout)^T @ h):
the same function, one rounding placed differently, within the tested bf16 error bound.

Weight gradients through ``torch._grouped_mm`` (megamoe.ops.torch_grouped_mm; the tile table's ``torch_mm``
for bf16 experts of more than ~154 expected rows, on Hopper, or a ``torch_mm`` "wgrad" entry of the KernelConfig):
its kernel takes contiguous rows only, so the backward copies dout's rows (``dy = dout[row_token]``, then
also read by swiglu_dgrad without a gather) and x's rows (``x[row_token]``) into row order first: N x D more
transient memory each (qwen3-30b-a3b T=16384: 0.54 GB each), bitwise the same gradients (the same rows in
the same order; tests/test_torch_wgrad_gpu.py). Measured -0.68 ms of 8.59 at qwen3-30b-a3b T=16384
(docs/perf.md).

Kernel choices: ``kernel_config`` (a :class:`megamoe.config.KernelConfig`, the last argument of ``apply``;
default: the tile table) goes to every GEMM launcher of both passes. It never changes bits.

Determinism: no atomics, no split-K, configs a pure function of shape: bitwise reproducible.
Sync: none (no .item(), no shapes from routing); CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from .config import KernelConfig
from .ops import (
    build_routing_plan,
    combine_fwd,
    down_proj,
    gate_up_swiglu,
    grouped_mm_nn,
    grouped_mm_nt,
    k_grouped_mm,
    k_grouped_wants_rows_in_order,
    single_group_offsets,
    slot_sum_bwd,
    swiglu_dgrad,
)

__all__ = ["MoEExpertsFunction", "RouterLogitsFunction"]


class MoEExpertsFunction(torch.autograd.Function):
    """Routed + shared experts and combine. Inputs must already be validated and contiguous
    (megamoe.functional.moe_experts does that); gradients flow to x, topk_weights and all weights."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
                kernel_config: KernelConfig):
        T = x_TD.shape[0]
        kc = kernel_config
        plan = build_routing_plan(topk_ids_TK, w13_EGD.shape[0])
        # the m-tile offsets of each group-offset table, computed once and shared by the GEMMs of both passes
        # (the backward's offsets are the same saved tensors)
        tiles = {}
        h_NF, gu_NG = gate_up_swiglu(x_TD, w13_EGD, plan.offsets_E1, gather_idx_R=plan.row_token_N, tile_cache=tiles,
                                     kernel_config=kc)
        y_ND = down_proj(h_NF, w2_EDF, plan.offsets_E1, tile_cache=tiles, kernel_config=kc)
        del h_NF
        shared_TD = gus_TH = one_2 = None
        if shared_w13_HD is not None:
            one_2 = single_group_offsets(T, x_TD.device)
            hs_TS, gus_TH = gate_up_swiglu(x_TD, shared_w13_HD.unsqueeze(0), one_2, tile_cache=tiles, kernel_config=kc)
            shared_TD = down_proj(hs_TS, shared_w2_DS.unsqueeze(0), one_2, tile_cache=tiles, kernel_config=kc)
            del hs_TS
        ctx.tiles, ctx.one_2, ctx.kernel_config = tiles, one_2, kc
        out_TD = combine_fwd(y_ND, plan.row_of_TK, topk_weights_TK, shared_TD, out_dtype=x_TD.dtype)
        ctx.save_for_backward(x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, gu_NG, gus_TH,
                              plan.offsets_E1, plan.row_token_N, plan.row_src_N, plan.row_of_TK)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        (x_TD, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, gu_NG, gus_TH,
         offsets_E1, row_token_N, row_src_N, row_of_TK) = ctx.saved_tensors
        need_x, _, need_w, need_w13, need_w2, need_s13, need_s2 = ctx.needs_input_grad[:7]
        kc = ctx.kernel_config
        T, D = x_TD.shape
        dout_TD = dout_TD.contiguous()
        if dout_TD.dtype != x_TD.dtype:
            dout_TD = dout_TD.to(x_TD.dtype)
        scale_N = topk_weights_TK.reshape(-1).index_select(0, row_src_N).float()
        G, F, N = gu_NG.shape[1], w2_EDF.shape[2], row_token_N.shape[0]
        rows_est = N / max(w13_EGD.shape[0], 1)  # k_grouped_mm's own estimate: its kernel choice
        copy_dy = need_w2 and k_grouped_wants_rows_in_order(D, F, w2_EDF.dtype, x_TD.device, rows_est, kc)
        copy_x = need_w13 and k_grouped_wants_rows_in_order(G, D, w13_EGD.dtype, x_TD.device, rows_est, kc)
        if copy_dy:  # (module docstring)
            dy_ND, dy_idx_N = dout_TD.index_select(0, row_token_N), None
        else:
            dy_ND, dy_idx_N = dout_TD, row_token_N
        tiles = ctx.tiles
        dgu_NG, hw_NF, part_NP = swiglu_dgrad(dy_ND, w2_EDF, offsets_E1, gu_NG, gather_idx_R=dy_idx_N,
                                              row_scale_R=scale_N, row_dot=need_w, tile_cache=tiles, kernel_config=kc)
        dw2 = (k_grouped_mm(dy_ND, hw_NF, offsets_E1, p_idx_R=dy_idx_N, out_dtype=w2_EDF.dtype, kernel_config=kc)
               if need_w2 else None)
        del hw_NF, dy_ND
        dw13 = None
        if copy_x:
            dw13 = k_grouped_mm(dgu_NG, x_TD.index_select(0, row_token_N), offsets_E1, out_dtype=w13_EGD.dtype,
                                kernel_config=kc)
        elif need_w13:
            dw13 = k_grouped_mm(dgu_NG, x_TD, offsets_E1, q_idx_R=row_token_N, out_dtype=w13_EGD.dtype,
                                kernel_config=kc)
        dx_ND = grouped_mm_nn(dgu_NG, w13_EGD, offsets_E1, tile_cache=tiles, kernel_config=kc) if need_x else None
        del dgu_NG
        ds13 = ds2 = dxs_TD = None
        if shared_w13_HD is not None and (need_x or need_s13 or need_s2):
            one_2 = ctx.one_2
            dgus_TH, hs_TS, _ = swiglu_dgrad(dout_TD, shared_w2_DS.unsqueeze(0), one_2, gus_TH, row_dot=False,
                                             tile_cache=tiles, kernel_config=kc)
            if need_s2:
                ds2 = k_grouped_mm(dout_TD, hs_TS, one_2, out_dtype=shared_w2_DS.dtype, kernel_config=kc)[0]
            if need_s13:
                ds13 = k_grouped_mm(dgus_TH, x_TD, one_2, out_dtype=shared_w13_HD.dtype, kernel_config=kc)[0]
            if need_x:
                dxs_TD = grouped_mm_nn(dgus_TH, shared_w13_HD.unsqueeze(0), one_2, tile_cache=tiles, kernel_config=kc)
        dx_TD, dw_TK = slot_sum_bwd(dx_ND, row_of_TK, dxs_TD, part_NP if need_w else None, num_cols=D,
                                    dx_dtype=x_TD.dtype, dw_dtype=topk_weights_TK.dtype)
        return dx_TD, None, dw_TK, dw13, dw2, ds13, ds2, None


class RouterLogitsFunction(torch.autograd.Function):
    """fp32 router logits ``x.float() @ router_w.float().T`` in megamoe's Triton GEMM (IEEE fp32 dots).

    Saved: x and router_w (no activation memory beyond the inputs). Backward: dx = cast(dlogits @ W),
    dW = dlogits^T @ x (fp32, rows reduced in token order). Deterministic, no sync.
    """

    @staticmethod
    def forward(ctx, x_TD, router_w_ED):
        T = x_TD.shape[0]
        w_1ED = router_w_ED.float().unsqueeze(0)
        one_2 = single_group_offsets(T, x_TD.device)
        logits_TE = grouped_mm_nt(x_TD, w_1ED, one_2, out_dtype=torch.float32)
        ctx.save_for_backward(x_TD, router_w_ED)
        return logits_TE

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TD, router_w_ED = ctx.saved_tensors
        dlogits_TE = dlogits_TE.float().contiguous()
        one_2 = single_group_offsets(x_TD.shape[0], x_TD.device)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm_nn(dlogits_TE, router_w_ED.float().unsqueeze(0), one_2, out_dtype=x_TD.dtype)
        if ctx.needs_input_grad[1]:
            dw = k_grouped_mm(dlogits_TE, x_TD, one_2, out_dtype=torch.float32)[0].to(router_w_ED.dtype)
        return dx, dw
