"""The autograd Functions of the fused path: the stage order of the routed experts, what is saved, what is
recomputed.

Legend: T tokens (of this rank), D hidden size, F expert FFN size, G = 2F ([gate | up]), E experts of the GEMMs
(all of them on one GPU, the L local ones under EP), K top-k, N = T*K (token, slot) rows, R rows of one round
(N on one GPU, at most the capacity C under EP), S shared-expert FFN size, H = 2S, P row-dot partials.

``MoEExpertsFunction`` (routed + shared SwiGLU experts and the combine, for precomputed top-k) owns the stage
order of both passes, for one GPU and for expert parallelism alike; a *dispatcher* (megamoe.ops.dispatch:
``LocalDispatcher`` for W = 1, megamoe.ops.ep_dispatch ``NVLinkDispatcher`` for W > 1) says where each round's
rows come from and where the results go::

  forward   open_forward                        (local: routing plan; NVLink: publish rows + plan)
            hs, gus = gate_up_swiglu(x, shared_w13); ys = down_proj(hs, shared_w2)   (one group; NVLink: may
                                                 run on a side stream beside the exchange's start)
            start_exchange, join                (NVLink: schedule, pull round 0)
            per round r: rows = forward_rows(r)
              h, gu = gate_up_swiglu(rows.x, w13)        (local: gathered from x through row_token)
              y = down_proj(h, w2)                       (local: (N, D) rows; NVLink: stored into owner slots)
            out = combine_fwd(y, w, ys)         (fp32, slot order, shared last, one cast)
  backward  open_backward
            shared: gus (kept, or recomputed), dgus, hs = swiglu_dgrad(dout, shared_w2, gus),
                    dxs = grouped_mm_nn(dgus, shared_w13), dW_shared (after the join when on a side stream)
            start_exchange, join
            per round r: rows = backward_rows(r); gu = kept (round 0) or recomputed by gate_up_swiglu
              dgu, hw, part = swiglu_dgrad(rows.dy, w2, gu, scale=w)   (dh, SwiGLU bwd, row dots)
              dw2  = k_grouped_mm(rows.dy, hw)       (sum over the expert's rows, fixed order)
              dw13 = k_grouped_mm(dgu, x rows)
              dx_rows = grouped_mm_nn(dgu, w13)
            dx, dw = slot_sum_bwd(dx_rows, dxs, part)   (fp32, slot order, one cast)

Saved for backward on one GPU (activation memory per token, besides the layer input x which the caller keeps
anyway): the routed pre-activations gu (K * 2F elements of x's dtype), the shared pre-activations gus
(2S elements), and the plan (3 int32 per (token, slot): row_token, row_src, row_of, plus E + 1 offsets).
In bf16 that is 4KF + 4S + 12K bytes per token: qwen3-30b-a3b (F 768, K 8, S 0) 24.7 KB,
deepseek-v3 (F 2048, K 8, S 2048) 73.8 KB. h (K*F) and y (K*D) are not kept: h is recomputed bitwise
from gu in the dgrad epilogue; y is only needed through <dout, y>, which the dgrad epilogue gets as
<dout @ w2, h>. Transient peak in backward: dgu (N x 2F), hw (N x F), dx_rows (N x D) in x's dtype, and
with torch's weight-gradient kernel the row-order copies of dout and x (N x D each, below). Under EP: what
megamoe.ops.ep_dispatch keeps (bounded by the capacity C, whatever the routing).

Numerics: h and y are rounded to x's dtype exactly where megamoe.reference rounds them; the combine and
the slot sums are fp32 in slot order. dh is computed as cast(w * (dout @ w2)) (reference:
cast(cast(w * dout) @ w2)) and the w2 gradient as dout^T @ cast(w * h) (reference: cast(w * dout)^T @ h):
the same function, one rounding placed differently, within the tested bf16 error bound.

Weight gradients through ``torch._grouped_mm`` (megamoe.ops.torch_grouped_mm; the tile table's ``torch_mm``
for bf16 experts of more than ~154 expected rows, on Hopper, or a ``torch_mm`` "wgrad" entry of the KernelConfig):
its kernel takes contiguous rows only, so on one GPU the backward copies dout's rows (``dy = dout[row_token]``,
then also read by swiglu_dgrad without a gather) and x's rows (``x[row_token]``) into row order first: N x D
more transient memory each (qwen3-30b-a3b T=16384: 0.54 GB each), bitwise the same gradients (the same rows in
the same order; tests/test_torch_wgrad_gpu.py). Measured -0.68 ms of 8.59 at qwen3-30b-a3b T=16384
(docs/perf.md).

Kernel choices: the dispatcher's ``kernel_config`` (a :class:`megamoe.config.KernelConfig`; default: the tile
table) goes to every GEMM launcher of both passes. Only a BLOCK_K other than the table's changes bits
(``ops.tile_config.parse_tiles`` refuses one).

FP8 (``fp8=`` a :class:`megamoe.autograd_fp8.Fp8Experts`, ``moe_experts(..., fp8=True)``): the same stages in the
same order; the routed experts' gate/up, down, dgrad, dx and weight-gradient GEMMs are the recipe's block-scaled
FP8 ones (e4m3 operands quantized where they are produced, 128x128 weight blocks kept from the forward for the
backward; docs/fp8.md). The shared expert, the combine and the slot sums are the 16-bit path's.

Determinism: no atomics, no split-K (the router's 16-bit weight gradient sums fixed token chunks in a fixed
order, :func:`router_wgrad`), configs a pure function of shape: bitwise reproducible; the order in which
independent GEMMs (shared and routed experts) are launched does not change any bits.
Sync: none (no .item(), no shapes from routing); CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from .ops import (
    chunk_offsets,
    chunk_sum,
    combine_fwd,
    down_proj,
    gate_up_swiglu,
    grouped_mm_nn,
    grouped_mm_nt,
    k_grouped_mm,
    router_kernel_config,
    router_wgrad_chunks,
    single_group_offsets,
    slot_sum_bwd,
    split_bf16x3,
    swiglu_dgrad,
)
from .ops.dispatch import Needs
from .ops.topk_select import topk_select, topk_select_backward
from .ops.wgrad_rounds import k_grouped_round

__all__ = ["MoEExpertsFunction", "RouterLogitsFunction", "experts_backward", "experts_forward",
           "router_logits_backward", "router_logits_forward", "router_wgrad"]


def _shared_forward(d, x_TD, shared_w13_HD, shared_w2_DS):
    """The shared expert's forward, in the dispatcher's ``beside`` block: (shared_TD, gus_TH or None)."""
    kc = d.kernel_config
    one_2 = d.shared_offsets(x_TD.shape[0], x_TD.device)
    out_TD = d.shared_out(x_TD)
    with d.beside():
        st = d.shared_tiles()
        hs_TS, gus_TH = gate_up_swiglu(x_TD, shared_w13_HD.unsqueeze(0), one_2, save_preact=d.keeps_shared_preact,
                                       tile_cache=st, kernel_config=kc)
        shared_TD = down_proj(hs_TS, shared_w2_DS.unsqueeze(0), one_2, out=out_TD, tile_cache=st, kernel_config=kc)
        del hs_TS
    return shared_TD, gus_TH


def _routed_forward(d, w13_EGD, w2_EDF, fp8=None):
    """Every round's gate/up + SwiGLU and down projection; returns round 0's pre-activations (kept ones).
    ``fp8``: the FP8 recipe (megamoe.autograd_fp8.Fp8Experts) runs the two GEMMs, or None (16-bit)."""
    kc = d.kernel_config
    gu0_RG = None
    for r in range(d.rounds):
        rows = d.forward_rows(r)
        if fp8 is None:
            h_RF, gu_RG = gate_up_swiglu(rows.x_RD, w13_EGD, rows.offsets_E1, gather_idx_R=rows.x_idx_R,
                                         save_preact=rows.keep_preact, out=rows.h_out, preact_out=rows.gu_out,
                                         tile_cache=rows.tiles, pull=rows.pull, kernel_config=kc)
            y_RD = down_proj(h_RF, w2_EDF, rows.offsets_E1, out=rows.y_out, push=rows.push, tile_cache=rows.tiles,
                             kernel_config=kc)
        else:  # h as its 1x128 FP8 blocks
            h_RF, gu_RG = fp8.gate_up(rows)
            y_RD = fp8.down(h_RF, rows)
        del h_RF
        if r == 0:
            gu0_RG = gu_RG
        d.forward_results(r, y_RD)
    return gu0_RG


def _shared_backward(d, x_TD, dout_TD, shared_w13_HD, shared_w2_DS, gus_TH, need: Needs):
    """The shared expert's backward in the dispatcher's ``beside`` block: (dxs_TD, weight-gradient thunk). The
    weight gradients run at once when inline, after the join when on a side stream (the thunk then runs them)."""
    kc = d.kernel_config
    one_2 = d.shared_offsets(x_TD.shape[0], x_TD.device)
    with d.beside():
        st = d.shared_tiles()
        if gus_TH is None:  # not kept by the forward: recomputed
            _, gus_TH = gate_up_swiglu(x_TD, shared_w13_HD.unsqueeze(0), one_2, save_preact=True, tile_cache=st,
                                       kernel_config=kc)
        dgus_TH, hs_TS, _ = swiglu_dgrad(dout_TD, shared_w2_DS.unsqueeze(0), one_2, gus_TH, row_dot=False,
                                         tile_cache=st, kernel_config=kc)
        del gus_TH
        dxs_TD = (grouped_mm_nn(dgus_TH, shared_w13_HD.unsqueeze(0), one_2, tile_cache=st, kernel_config=kc)
                  if need.x else None)
        d.hand_over(dgus_TH, hs_TS, dxs_TD)

    def wgrads():  # on the whole GPU (torch._grouped_mm where the table says so)
        ds13 = (k_grouped_mm(dgus_TH, x_TD, one_2, out_dtype=shared_w13_HD.dtype, kernel_config=kc)[0]
                if need.shared_w13 else None)
        ds2 = (k_grouped_mm(dout_TD, hs_TS, one_2, out_dtype=shared_w2_DS.dtype, kernel_config=kc)[0]
               if need.shared_w2 else None)
        return ds13, ds2

    if d.side is None:  # inline: the weight gradients now
        done = wgrads()
        return dxs_TD, lambda: done
    return dxs_TD, wgrads


def _wgrad(d, r: int, which: str, rows, p, q, out, out_dtype, fp8):
    """Round r's part of the weight gradient ``which`` = sum over each expert's rows of P^T Q (``p`` / ``q``:
    (rows, row index or None)): round 0 makes it (the one-round GEMM), and with several rounds the round kernels
    store the experts of later rounds and carry the experts split across rounds (megamoe.ops.wgrad_rounds)."""
    split = d.round_split(r, which)
    if fp8 is not None:
        return fp8.wgrad(rows, *p, *q, out_dtype, out=out, split=split)
    if r == 0:
        out = k_grouped_mm(p[0], q[0], rows.offsets_E1, p_idx_R=p[1], q_idx_R=q[1], out_dtype=out_dtype,
                           rows_per_group=rows.rows_per_group, kernel_config=d.kernel_config)
    if split is not None:
        if p[1] is not None or q[1] is not None:
            raise ValueError("the weight gradients of several rounds read the receive buffers' rows, not a gather")
        k_grouped_round(p[0], q[0], rows.offsets_E1, split.full_off_L1, split.round_starts_Q1, out, split.scratch_JMN,
                        round_idx=r, capacity_rows=split.capacity_rows, kernel_config=d.kernel_config)
    return out


def _routed_backward(d, w13_EGD, w2_EDF, gu0_RG, need: Needs, fp8=None):
    """Every round's dgrad + SwiGLU backward, weight gradients and dx rows; returns (dw13, dw2). ``fp8``: the
    FP8 recipe runs the GEMMs (as in :func:`_routed_forward`), or None."""
    kc = d.kernel_config
    dw13 = dw2 = None
    for r in range(d.rounds):
        recompute = not (r == 0 and gu0_RG is not None)
        rows = d.backward_rows(r, recompute)
        gu_RG = gu0_RG
        if recompute and fp8 is not None:
            gu_RG = fp8.preact(rows)
        elif recompute:
            _, gu_RG = gate_up_swiglu(rows.x_RD, w13_EGD, rows.offsets_E1, gather_idx_R=rows.x_idx_R, save_preact=True,
                                      out=rows.h_out, preact_out=rows.gu_out, tile_cache=rows.tiles, kernel_config=kc)
        if fp8 is None:
            dgu_RG, hw_RF, part_RP = swiglu_dgrad(rows.dy_RD, w2_EDF, rows.offsets_E1, gu_RG,
                                                  gather_idx_R=rows.dy_idx_R, row_scale_R=rows.scale_R,
                                                  row_dot=rows.row_dot, tile_cache=rows.tiles, pull=rows.pull,
                                                  kernel_config=kc)
        else:
            dgu_RG, hw_RF, part_RP = fp8.dgrad_swiglu(rows, gu_RG, need.w13, need.w2)  # 128x1 blocks of both
        del gu_RG
        if need.w2:
            dw2 = _wgrad(d, r, "w2", rows, (rows.dy_RD, rows.dy_idx_R), (hw_RF, None), dw2, w2_EDF.dtype, fp8)
        del hw_RF
        rows.dy_RD = rows.dy_idx_R = None  # a row-order copy of dout is freed before the one of x is made
        if need.w13:
            q_RD, q_idx_R = d.wgrad_x_rows(rows)
            dw13 = _wgrad(d, r, "w13", rows, (dgu_RG, None), (q_RD, q_idx_R), dw13, w13_EGD.dtype, fp8)
            del q_RD
        if not rows.need_dx:
            dx_RD = None
        elif fp8 is not None:
            dx_RD = fp8.dx(rows)
        else:
            dx_RD = grouped_mm_nn(dgu_RG, w13_EGD, rows.offsets_E1, push=rows.push, tile_cache=rows.tiles,
                                  kernel_config=kc)
        del dgu_RG
        d.backward_results(r, dx_RD, part_RP)
        del dx_RD, part_RP
    return dw13, dw2


def experts_forward(d, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
                    keep: bool, fp8=None):
    """The forward stage loop on a dispatcher ``d``: (out_TD, gu0_RG, gus_TH, saved), where gu0_RG / gus_TH are
    the kept routed / shared pre-activations (or None) and ``saved`` the dispatcher's tensors for the backward
    (``d.saved()``). ``keep``: a backward will follow. ``fp8``: the FP8 recipe of the routed experts
    (megamoe.autograd_fp8.Fp8Experts; it keeps the weight blocks for the backward), or None (16-bit). Shared by
    :class:`MoEExpertsFunction` and the custom ops of megamoe.custom_ops."""
    has_shared = shared_w13_HD is not None and x_TD.shape[0] > 0
    d.open_forward(x_TD, topk_ids_TK, w2_EDF.shape[2], keep, has_shared)
    shared_TD = gus_TH = None
    try:  # the join also on an error, so that nothing the side stream still reads is freed under it
        if has_shared:
            shared_TD, gus_TH = _shared_forward(d, x_TD, shared_w13_HD, shared_w2_DS)
        d.start_exchange()
    finally:
        d.join()
    if fp8 is not None:
        fp8.open_forward(w13_EGD, w2_EDF)
    gu0_RG = _routed_forward(d, w13_EGD, w2_EDF, fp8)
    rows_RD, row_of_TK = d.finish_forward()
    out_TD = combine_fwd(rows_RD, row_of_TK, topk_weights_TK, shared_TD, out_dtype=x_TD.dtype)
    return out_TD, gu0_RG, gus_TH, tuple(d.saved())


def experts_backward(d, dout_TD, x_TD, ids_TK, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS, gu0_RG, gus_TH, saved,
                     need: Needs, fp8=None):
    """The backward stage loop on a dispatcher ``d``: (dx_TD, dw_TK, dw13, dw2, ds13, ds2), None where ``need``
    says not wanted. ``saved``, gu0_RG, gus_TH: what :func:`experts_forward` returned; ``fp8``: the recipe object
    the forward ran with (holding that pass's weight blocks), or None."""
    T, D = x_TD.shape
    dout_TD = dout_TD.contiguous()
    if dout_TD.dtype != x_TD.dtype:
        dout_TD = dout_TD.to(x_TD.dtype)
    has_shared = sw13_HD is not None and T > 0 and (need.x or need.shared_w13 or need.shared_w2)
    d.open_backward(tuple(saved), x_TD, ids_TK, w_TK, dout_TD, w13_EGD, w2_EDF, gu0_RG is not None, need, has_shared)
    dxs_TD = shared_wgrads = None
    try:  # the join also on an error (as in the forward)
        if has_shared:
            dxs_TD, shared_wgrads = _shared_backward(d, x_TD, dout_TD, sw13_HD, sw2_DS, gus_TH, need)
        d.start_exchange()
    finally:
        d.join()
    ds13, ds2 = shared_wgrads() if shared_wgrads is not None else (None, None)
    if sw13_HD is not None and T == 0:  # no rows: exact zeros
        ds13 = torch.zeros_like(sw13_HD) if need.shared_w13 else None
        ds2 = torch.zeros_like(sw2_DS) if need.shared_w2 else None
    if fp8 is not None:
        fp8.open_backward()
    dw13, dw2 = _routed_backward(d, w13_EGD, w2_EDF, gu0_RG, need, fp8)
    if fp8 is not None:
        fp8.end_backward()
    rows_RD, row_of_TK, dots_RP = d.finish_backward(dw13, dw2)
    dx_TD, dw_TK = slot_sum_bwd(rows_RD, row_of_TK, dxs_TD, dots_RP if need.weights else None, num_cols=D,
                                dx_dtype=x_TD.dtype, dw_dtype=w_TK.dtype)
    return dx_TD if need.x else None, dw_TK if need.weights else None, dw13, dw2, ds13, ds2


class MoEExpertsFunction(torch.autograd.Function):
    """Routed + shared experts and combine, in the stage order above. Inputs must already be validated and
    contiguous (megamoe.functional.moe_experts, megamoe.functional_ep); ``dispatcher`` is a fresh
    :class:`megamoe.ops.dispatch.LocalDispatcher` or :class:`megamoe.ops.ep_dispatch.NVLinkDispatcher` per call.
    Gradients flow to x, topk_weights and all weights (under EP: this rank's experts, and a per-rank partial
    gradient of the shared expert)."""

    @staticmethod
    def forward(ctx, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS, dispatcher,
                fp8=None):
        out_TD, gu0_RG, gus_TH, saved = experts_forward(dispatcher, x_TD, topk_ids_TK, topk_weights_TK, w13_EGD,
                                                        w2_EDF, shared_w13_HD, shared_w2_DS,
                                                        any(ctx.needs_input_grad), fp8)
        ctx.dispatcher, ctx.fp8 = dispatcher, fp8
        ctx.save_for_backward(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD, shared_w2_DS,
                              gu0_RG, gus_TH, *saved)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        x_TD, ids_TK, w_TK, w13_EGD, w2_EDF, sw13_HD, sw2_DS, gu0_RG, gus_TH, *saved = ctx.saved_tensors
        n = ctx.needs_input_grad
        need = Needs(x=n[0], weights=n[2], w13=n[3], w2=n[4], shared_w13=n[5], shared_w2=n[6])
        dx_TD, dw_TK, dw13, dw2, ds13, ds2 = experts_backward(ctx.dispatcher, dout_TD, x_TD, ids_TK, w_TK, w13_EGD,
                                                              w2_EDF, sw13_HD, sw2_DS, gu0_RG, gus_TH, saved, need,
                                                              ctx.fp8)
        return dx_TD, None, dw_TK, dw13, dw2, ds13, ds2, None, None


def router_logits_forward(x_TD, router_w_ED, router_dtype: str = "fp32", keep: dict | None = None,
                          kernel_config=None):
    """Router logits (T, E) in megamoe's Triton GEMM, one group of all T rows. router_dtype "fp32": fp32 logits
    ``x.float() @ router_w.float().T``: for bf16 x on bf16 tensor cores, the fp32 weight as three exact bf16 pieces
    (every product exact, fp32 accumulation, the three partial logits added in fp32); for fp16 / fp32 x in IEEE fp32
    dots. "model": ``x @ router_w.T`` with the operands in x's
    dtype (router_w must already have it), tensor cores with fp32 accumulation, logits rounded once to x's dtype,
    the tiles of ``ops.tile_config.router_kernel_config`` (a function of E and D only). ``keep``: a dict that
    takes what :func:`router_logits_backward` can reuse (the group offsets and their m-tile offsets; the fp32
    weight), or None. ``kernel_config``: tiles in place of ``router_kernel_config``'s (sweeps; the fp32 router of
    bf16 x looks its GEMMs up at the piece shapes, N = 3E)."""
    keep = {} if keep is None else keep
    one_2 = _router_offsets(x_TD, keep)
    if router_dtype == "fp32" and x_TD.dtype == torch.bfloat16:
        return _fp32_logits_bf16_pieces(x_TD, router_w_ED, one_2, keep, kernel_config)
    if router_dtype == "fp32":
        keep["w32_1ED"] = router_w_ED.float().unsqueeze(0)
        return grouped_mm_nt(x_TD, keep["w32_1ED"], one_2, out_dtype=torch.float32, tile_cache=keep["tiles"])
    _check_model_dtype(x_TD, router_w_ED)
    E, D = router_w_ED.shape
    return grouped_mm_nt(x_TD, router_w_ED.unsqueeze(0), one_2, out_dtype=x_TD.dtype, tile_cache=keep["tiles"],
                         kernel_config=router_kernel_config(E, D))


# The fp32 router GEMMs of bf16 x on bf16 tensor cores, exactly: an fp32 operand as three bf16 pieces
# (ops.split_bf16x3, v = hi + mid + lo), a bf16 one as itself, so every product is exact in fp32 and accumulated in
# fp32. Slots pair the weight's pieces (rows) with dlogits' (columns) for dx: with an fp32 weight the six products
# hi hi, hi mid, hi lo, mid hi, lo hi, mid mid (the three left out are below 2^-24 of the largest), with a bf16
# weight (whose mid and lo are zero) the three of its one piece with dlogits' three. The logits take the weight's
# pieces (hi, mid, lo) or the bf16 weight itself, the weight gradient dlogits' (hi, mid, lo) against x.
_W_PIECES = ("hi", "mid", "lo", "hi", "hi", "mid")
_DL_PIECES = ("hi", "hi", "hi", "mid", "lo", "mid")
_DL_HI_MID_LO_AT = 2  # the first slot of dlogits' (hi, mid, lo), in that order (0 in _DL_BF16_PIECES)
_W_BF16_PIECES, _DL_BF16_PIECES = ("hi", "hi", "hi"), ("hi", "mid", "lo")


def _router_tiles(kernel_config, experts: int, hidden: int):
    """``kernel_config``, or the router's table at (experts, hidden) when None."""
    return router_kernel_config(experts, hidden) if kernel_config is None else kernel_config


def _fp32_logits_bf16_pieces(x_TD, router_w_ED, one_2, keep: dict, kernel_config=None):
    """fp32 logits of bf16 x. A bf16 weight: one bf16 GEMM with fp32 output. Otherwise x @ [w_hi; w_mid; w_lo].T in
    one bf16 GEMM (fp32 out, (T, 3E)) whose three column blocks are summed in fp32 in piece order (ops.chunk_sum).
    Nothing is kept for the backward (it splits the weight again: one launch over E x D)."""
    E, D = router_w_ED.shape
    T = x_TD.shape[0]
    if router_w_ED.dtype == torch.bfloat16:
        return grouped_mm_nt(x_TD, router_w_ED.unsqueeze(0), one_2, out_dtype=torch.float32,
                             tile_cache=keep["tiles"], kernel_config=_router_tiles(kernel_config, E, D))
    w3 = split_bf16x3(router_w_ED.float().contiguous(), _W_PIECES[:3], along="rows")
    l3_TE = grouped_mm_nt(x_TD, w3.unsqueeze(0), one_2, out_dtype=torch.float32, tile_cache=keep["tiles"],
                          kernel_config=_router_tiles(kernel_config, 3 * E, D))
    return chunk_sum(l3_TE.view(T, 3, E).transpose(0, 1), out_dtype=torch.float32)


def _fp32_backward_bf16_pieces(dlogits_TE, x_TD, router_w_ED, need_x, need_w, one_2, keep: dict, kernel_config=None):
    """(dx, dW) of :func:`_fp32_logits_bf16_pieces`: dlogits' pieces once ((T, 6E), or (T, 3E) for a bf16 weight);
    dx = those @ the weight's pieces in the paired slots (K = 6E or 3E, one cast to x's dtype); dW = dlogits'
    (hi, mid, lo)^T @ x over the token chunks of the 16-bit router's weight gradient, the 3 S fp32 partials summed
    in order, one cast to the weight's dtype."""
    E, D = router_w_ED.shape
    bf16_w = router_w_ED.dtype == torch.bfloat16
    w_pieces, dl_pieces = (_W_BF16_PIECES, _DL_BF16_PIECES) if bf16_w else (_W_PIECES, _DL_PIECES)
    dl_TE = split_bf16x3(dlogits_TE.float().contiguous(), dl_pieces, along="cols")
    kc = _router_tiles(kernel_config, 3 * E, D)
    dx = dw = None
    if need_x:
        w_ED = split_bf16x3(router_w_ED.float().contiguous(), w_pieces, along="rows")
        dx = grouped_mm_nn(dl_TE, w_ED.unsqueeze(0), one_2, out_dtype=x_TD.dtype, tile_cache=keep["tiles"],
                           kernel_config=kc)
    if need_w:
        at = 0 if bf16_w else _DL_HI_MID_LO_AT
        dw = router_wgrad(dl_TE[:, at * E:(at + 3) * E], x_TD, kernel_config=kc, one_2=one_2, pieces=3,
                          out_dtype=router_w_ED.dtype)
    return dx, dw


def _router_offsets(x_TD, keep: dict):
    """The router GEMMs' one group [0, T] (made once per ``keep``, with its m-tile cache ``keep["tiles"]``, in
    which the launchers find the tile offsets from T without a kernel)."""
    if "one_2" not in keep:
        keep["tiles"] = {}
        keep["one_2"] = single_group_offsets(x_TD.shape[0], x_TD.device, tile_cache=keep["tiles"])
    return keep["one_2"]


def _check_model_dtype(x_TD, router_w_ED) -> None:
    if router_w_ED.dtype != x_TD.dtype:
        raise TypeError(f"router_logits (router_dtype 'model'): router_w_ED must have x_TD's dtype {x_TD.dtype} "
                        f"(megamoe.functional.router_logits casts it), got {router_w_ED.dtype}")


def router_logits_backward(dlogits_TE, x_TD, router_w_ED, need_x: bool, need_w: bool, router_dtype: str = "fp32",
                           keep: dict | None = None, kernel_config=None):
    """(dx_TD or None, dW_ED or None) of :func:`router_logits_forward`. "fp32" (and "model" with fp32 x, the same
    computation): dx = cast(dlogits @ W), dW = dlogits^T @ x (fp32, all T rows reduced in token order), both from
    fp32 operands. "model" with 16-bit x: the same products with dlogits, x and W in x's dtype on tensor cores (fp32
    accumulation, one cast to x's dtype), dW by :func:`router_wgrad` (fixed token chunks, partials summed in
    fp32 in chunk order): what autograd of ``F.linear`` in x's dtype computes, up to the accumulation order.
    ``keep``: the forward's dict (its offsets, tile offsets and fp32 weight are reused), or None."""
    keep = {} if keep is None else keep
    one_2, dx, dw = _router_offsets(x_TD, keep), None, None
    if router_dtype == "fp32" and x_TD.dtype == torch.bfloat16:
        return _fp32_backward_bf16_pieces(dlogits_TE, x_TD, router_w_ED, need_x, need_w, one_2, keep, kernel_config)
    if router_dtype != "fp32":
        _check_model_dtype(x_TD, router_w_ED)
    if router_dtype == "fp32" or x_TD.dtype == torch.float32:
        dlogits_TE = dlogits_TE.float().contiguous()
        if need_x:
            w32_1ED = keep["w32_1ED"] if "w32_1ED" in keep else router_w_ED.float().unsqueeze(0)
            dx = grouped_mm_nn(dlogits_TE, w32_1ED, one_2, out_dtype=x_TD.dtype, tile_cache=keep["tiles"])
        if need_w:
            dw = k_grouped_mm(dlogits_TE, x_TD, one_2, out_dtype=torch.float32)[0].to(router_w_ED.dtype)
        return dx, dw
    dlogits_TE = dlogits_TE.to(x_TD.dtype).contiguous()
    kc = router_kernel_config(*router_w_ED.shape)
    if need_x:
        dx = grouped_mm_nn(dlogits_TE, router_w_ED.unsqueeze(0), one_2, out_dtype=x_TD.dtype, tile_cache=keep["tiles"],
                           kernel_config=kc)
    if need_w:
        dw = router_wgrad(dlogits_TE, x_TD, kernel_config=kc, one_2=one_2)
    return dx, dw


def router_wgrad(dlogits_TE, x_TD, *, chunks: int | None = None, kernel_config=None, one_2=None, pieces: int = 1,
                 out_dtype: torch.dtype | None = None):
    """The router's weight gradient ``dW_ED = cast(sum_t dlogits[t]^T x[t])`` in ``out_dtype`` (default x's dtype).
    ``pieces`` > 1: dlogits_TE's columns are that many blocks of E (the fp32 router's bf16 pieces of dlogits), and
    their products are added too (the fp32 partials chunk by chunk, each chunk's blocks in order), so (T, 3E) pieces
    give an (E, D) gradient.

    The T rows are cut into S fixed chunks of ceil(T / S) rows in token order (``ops.chunk_offsets``; S =
    ``chunks``, default ``ops.router_wgrad_chunks(T, E, D)``: a pure function of the shapes, never of the GPU,
    1 for small T). S = 1: megamoe's per-tile k-grouped kernel reduces all T rows in token order, fp32, one cast.
    S > 1: the same kernel with the chunks as its groups writes each chunk's fp32 partial [E, D] (S times the
    programs: at E = 128, D = 2048 the single group has only 64 output tiles for 132 SMs), then
    ``ops.chunk_sum`` adds the partials in chunk order in fp32 and casts once. No split-K atomics: bitwise the
    same every run and on every GPU for given (T, E, D); the chunks change the fp32 summation order (by
    fp32 rounding, far below the final cast's) against one chunk. S * E * D * 4 bytes of transient fp32 partials
    (S = 8 at qwen3-30b-a3b: 8 MiB). T = 0: exact zeros. dlogits_TE: (T, E), x_TD: (T, D), both contiguous in
    x's dtype; ``kernel_config``: the tiles (default ``ops.router_kernel_config(E, D)``); ``one_2``: the
    offsets [0, T] when the caller has them (``ops.single_group_offsets``)."""
    T, D = x_TD.shape
    columns = dlogits_TE.shape[1]
    out_dtype = x_TD.dtype if out_dtype is None else out_dtype
    kc = _router_tiles(kernel_config, columns, D)
    S = router_wgrad_chunks(T, columns, D) if chunks is None else chunks
    if S == 1:
        one_2 = single_group_offsets(T, x_TD.device) if one_2 is None else one_2
        if pieces == 1:
            return k_grouped_mm(dlogits_TE, x_TD, one_2, out_dtype=out_dtype, kernel_config=kc)[0]
    parts_SED = k_grouped_mm(dlogits_TE, x_TD, one_2 if S == 1 else chunk_offsets(T, S, x_TD.device),
                             out_dtype=torch.float32, kernel_config=kc)
    return chunk_sum(parts_SED.view(S * pieces, columns // pieces, D), out_dtype=out_dtype)


class RouterLogitsFunction(torch.autograd.Function):
    """Router logits in megamoe's Triton GEMM (:func:`router_logits_forward`; ``router_dtype`` "fp32": fp32 logits,
    from bf16 x on bf16 tensor cores with exact bf16 pieces of the fp32 operands, else IEEE fp32 dots; "model": x's
    dtype on tensor cores, router_w already in x's dtype).

    Saved: x and router_w (no activation memory beyond the inputs), the group offsets [0, T] with their m-tile
    offsets, and in "fp32" for fp16 / fp32 x the fp32 weight (a copy only for a 16-bit weight). Backward:
    :func:`router_logits_backward` (dx = cast(dlogits @ W), dW = dlogits^T @ x: fp32 of bf16 x on bf16 pieces, dW
    over fixed token chunks; other fp32 all rows in token order; a 16-bit x's dtype over fixed token chunks,
    :func:`router_wgrad`). Deterministic, no sync.
    """

    @staticmethod
    def forward(ctx, x_TD, router_w_ED, router_dtype="fp32"):
        ctx.save_for_backward(x_TD, router_w_ED)
        ctx.router_dtype, ctx.keep = router_dtype, {}
        return router_logits_forward(x_TD, router_w_ED, router_dtype, ctx.keep)

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TD, router_w_ED = ctx.saved_tensors
        dx, dw = router_logits_backward(dlogits_TE, x_TD, router_w_ED, *ctx.needs_input_grad[:2], ctx.router_dtype,
                                        ctx.keep)
        return dx, dw, None


class TopkSelectFunction(torch.autograd.Function):
    """The router's top-k selection from fp32 scores in one kernel (megamoe.ops.topk_select: ids, weights and each
    token's divisor) and its backward in one kernel (the scores' gradient, zeros but at the selected ids).

    ``spec``: (top_k, n_group, topk_group, group_top2, norm, scale). Differentiable w.r.t. the scores only (the
    bias changes which experts win, not the weights; the logits only flag non-finite tokens), once (a second
    derivative raises). Saved: the weights,
    ids and divisors (T * (12 K + 4) bytes). Deterministic, batch invariant, no sync."""

    @staticmethod
    def forward(ctx, scores_TE, bias_E, logits_TE, spec):
        K, n_group, topk_group, group_top2, norm, scale = spec
        ids, w, divisor = topk_select(scores_TE, bias_E, logits_TE, top_k=K, n_group=n_group, topk_group=topk_group,
                                      group_top2=group_top2, norm=norm, scale=scale)
        ctx.save_for_backward(w, ids, divisor)
        ctx.spec, ctx.E, ctx.flagged = spec, scores_TE.shape[1], logits_TE is not None
        ctx.mark_non_differentiable(ids)
        return ids, w

    @staticmethod
    def backward(ctx, dids, dw_TK):
        if torch.is_grad_enabled():  # create_graph: a second derivative would miss this kernel's part, so refuse
            raise RuntimeError("megamoe: the fused top-k selection (megamoe.functional.topk_select) is differentiable "
                               "once; for higher derivatives use the PyTorch selection (megamoe.router.route without "
                               "select=, as MoE(backend='reference') does)")
        w, ids, divisor = ctx.saved_tensors
        _, _, _, _, norm, scale = ctx.spec
        ds = topk_select_backward(dw_TK.float().contiguous(), w, ids, divisor, num_experts=ctx.E, norm=norm,
                                  scale=scale, flagged=ctx.flagged)
        return ds, None, None, None
