"""The ``torch-fp8`` benchmark provider: the routed experts on torch's FP8 grouped GEMM for sm90,
``torch._scaled_grouped_mm`` with rowwise scales (the recipe of torchao's FP8 rowwise MoE training), forward and
backward, in the style of the eager ``torch`` provider.

Legend: T tokens, D hidden, F expert FFN, G = 2F, E experts, K top-k, N = T*K (token, slot) rows, P padded rows
(N + 15 E, rounded up to 16), S shared FFN.

Rows are sorted by expert (stable: (expert, token, slot) order) and each expert's group is padded with zero rows
to a multiple of 16 (the grouped kernels' alignment; no host sync: the padded layout has the static size P).
Scales are dynamic, computed with torch ops (amax / 448, fp32, not rounded): per row of activations and output
gradients, per (expert, output column) of the weights, and for the weight gradients (grouped along the tokens)
per (expert, row of the left operand) and (expert, column of the right one) over the expert's rows. Every GEMM
takes e4m3 operands and writes bf16 (``torch._scaled_grouped_mm`` writes bf16 only); SwiGLU in fp32 as
megamoe.reference; combine as the ``torch`` provider (fp32 slot sums, the bf16 shared expert last, one cast).
"""

from __future__ import annotations

import torch

from .. import reference as ref

__all__ = ["torch_fp8_moe_experts", "torch_fp8_unavailable"]

_E4M3 = torch.float8_e4m3fn
_MAX = 448.0
_ALIGN = 16


def torch_fp8_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the provider cannot run here, or None: CUDA sm90 (torch's rowwise FP8 grouped GEMM), bf16."""
    if device.type != "cuda":
        return "torch._scaled_grouped_mm runs on CUDA (sm90) only"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "torch._scaled_grouped_mm's rowwise FP8 path is for sm90 (Hopper)"
    if dtype != torch.bfloat16:
        return f"torch._scaled_grouped_mm writes bf16 only (problem dtype {dtype})"
    return None


def _quant(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x.float() / s).clamp(-_MAX, _MAX).to(_E4M3)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=1e-12) / _MAX


def _rowwise(x_PC: torch.Tensor):
    """(q_PC e4m3, s_P fp32): one scale per row."""
    s = _scale(x_PC.abs().amax(dim=1))
    return _quant(x_PC, s[:, None]), s


def _weight_cols(w_ENK: torch.Tensor):
    """B operand of ``A @ B[e]`` with B[e] = w[e]^T (K, N) column-major: (q (E, K, N) view, s_EN fp32)."""
    s = _scale(w_ENK.abs().amax(dim=2))
    return _quant(w_ENK, s[:, :, None]).transpose(1, 2), s


def _grouped_cols(x_PC: torch.Tensor, lengths_L: torch.Tensor, gid_P: torch.Tensor, E: int):
    """(q_PC e4m3, s (E * C,) fp32): per (expert, column) scales over the expert's rows (a K-grouped operand)."""
    amax = torch.segment_reduce(x_PC.abs(), "max", lengths=lengths_L, axis=0, unsafe=True, initial=0.0)
    s = _scale(amax)  # (E + 1, C): the last segment is the unused tail
    return _quant(x_PC, s[gid_P]), s[:E].reshape(-1).contiguous()


def _mm(aq, bq, sa, sb, offs):
    return torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16)


def _wgrad(p_PM, q_PN, lengths_L, gid_P, offs_E, E):
    """(E, M, N) = per expert p_e^T @ q_e, FP8 grouped along the tokens."""
    pq, ps = _grouped_cols(p_PM, lengths_L, gid_P, E)
    qq, qs = _grouped_cols(q_PN, lengths_L, gid_P, E)
    return _mm(pq.t().contiguous(), qq.t().contiguous().t(), ps, qs, offs_E)


class _Fp8Experts(torch.autograd.Function):
    """SwiGLU experts on padded expert-major rows in rowwise FP8: (P, D) -> (P, D)."""

    @staticmethod
    def forward(ctx, x_PD, w13_EGD, w2_EDF, offs_E, lengths_L, gid_P):
        F_ = w2_EDF.shape[2]
        xq, xs = _rowwise(x_PD)
        bq, bs = _weight_cols(w13_EGD)
        gu_PG = _mm(xq, bq, xs, bs, offs_E)
        h_PF = ref.swiglu(gu_PG[:, :F_], gu_PG[:, F_:])
        hq, hs = _rowwise(h_PF)
        bq, bs = _weight_cols(w2_EDF)
        y_PD = _mm(hq, bq, hs, bs, offs_E)
        ctx.save_for_backward(x_PD, w13_EGD, w2_EDF, offs_E, lengths_L, gid_P, gu_PG)
        return y_PD

    @staticmethod
    def backward(ctx, dy_PD):
        x_PD, w13_EGD, w2_EDF, offs_E, lengths_L, gid_P, gu_PG = ctx.saved_tensors
        E, D, F_ = w2_EDF.shape
        dy_PD = dy_PD.contiguous()
        dyq, dys = _rowwise(dy_PD)
        bq, bs = _weight_cols(w2_EDF.transpose(1, 2).contiguous())  # B[e] = w2[e] (D, F)
        dh_PF = _mm(dyq, bq, dys, bs, offs_E).float()
        g, u = gu_PG[:, :F_].float(), gu_PG[:, F_:].float()
        sig = torch.sigmoid(g)
        dgu_PG = torch.cat([(dh_PF * u * sig * (1 + g * (1 - sig))).to(gu_PG.dtype),
                            (dh_PF * g * sig).to(gu_PG.dtype)], dim=1)
        dx_PD = None
        if ctx.needs_input_grad[0]:
            dq, ds = _rowwise(dgu_PG)
            bq, bs = _weight_cols(w13_EGD.transpose(1, 2).contiguous())  # B[e] = w13[e] (2F, D)
            dx_PD = _mm(dq, bq, ds, bs, offs_E)
        dw13 = _wgrad(dgu_PG, x_PD, lengths_L, gid_P, offs_E, E) if ctx.needs_input_grad[1] else None
        h_PF = ref.swiglu(gu_PG[:, :F_], gu_PG[:, F_:])
        dw2 = _wgrad(dy_PD, h_PF, lengths_L, gid_P, offs_E, E) if ctx.needs_input_grad[2] else None
        return dx_PD, dw13, dw2, None, None, None


def _padded_layout(topk_ids_TK: torch.Tensor, E: int):
    """(order_N, dest_N, offs_E, lengths_L, gid_P, P): rows sorted by expert, the padded row of each sorted row,
    the padded groups' int32 ends, their lengths (+ the tail), and the group of every padded row (E: the tail)."""
    flat = topk_ids_TK.reshape(-1)
    N = flat.numel()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + _ALIGN - 1) // _ALIGN * _ALIGN
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts
    e_sorted = flat[order]
    dest = starts[e_sorted] + torch.arange(N, device=flat.device) - first[e_sorted]
    P = (N + (_ALIGN - 1) * E + _ALIGN - 1) // _ALIGN * _ALIGN
    lengths = torch.cat([padded, (P - ends[-1:])]) if E else torch.tensor([P], device=flat.device)
    gid = torch.searchsorted(ends, torch.arange(P, device=flat.device), right=True)
    return order, dest, ends.to(torch.int32), lengths, gid, P


def torch_fp8_moe_experts(x_TD, topk_ids_TK, topk_weights_TK, w13_EGD, w2_EDF, shared_w13_HD=None,
                          shared_w2_DS=None):
    """Routed experts in rowwise FP8 (``torch._scaled_grouped_mm``) + the bf16 shared expert + fp32 combine:
    (T, D) -> (T, D), differentiable w.r.t. x, the routing weights and all weights. No host sync."""
    T, K = topk_ids_TK.shape
    D = x_TD.shape[1]
    order, dest, offs, lengths, gid, P = _padded_layout(topk_ids_TK, w13_EGD.shape[0])
    x_PD = x_TD.new_zeros(P, D).index_copy(0, dest, x_TD[order // K])
    y_PD = _Fp8Experts.apply(x_PD, w13_EGD, w2_EDF, offs, lengths, gid)
    y_sorted = y_PD[dest]
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y_TKD = y_sorted[inverse].view(T, K, D)
    acc = (y_TKD.float() * topk_weights_TK.float().unsqueeze(-1)).sum(1)
    shared = ref.shared_expert(x_TD, shared_w13_HD, shared_w2_DS)
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(x_TD.dtype)
