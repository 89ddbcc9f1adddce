"""The FP8 comparison of the benchmark's correctness check (:mod:`megamoe.bench.check`, FP8 providers).

Legend: C checked tokens per rank, D hidden, F expert FFN, G = 2F, K top-k, R rows of one expert.

An FP8 provider cannot meet the 16-bit criterion (2x plain PyTorch's error at the activation dtype): e4m3 operands
carry ~2^-4 relative rounding. Its tolerance comes instead from the FP8 recipe's own error: the same quantities
computed one expert at a time with megamoe.reference's FP8 numerics (:func:`megamoe.reference.moe_experts_fp8`: 1x128
activations and output gradients, 128x128 weights, 128x1 weight-gradient operands, fp32 GEMMs on the dequantized
values), measured against the float64 truth of the unquantized layer; a provider passes within 2x that error
(+ the check's atol). The forward, dx and routing-weight quantities are the recipe's exactly up to accumulation
order (their quantization is per row); the weight gradients' 128-row blocks here hold only the checked rows, the
provider's hold every row of the expert (unchecked ones with a zero output gradient), so those agree in size of
error, not bit for bit.
"""

from __future__ import annotations

import torch

from .. import reference as ref
from .problem import Problem

__all__ = ["Fp8Reference"]


def _deq_rows(x: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_1x128(*ref.quantize_1x128(x))


def _deq_weight(w: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_128x128(*ref.quantize_128x128(w.unsqueeze(0)))[0]


def _deq_along_rows(x: torch.Tensor) -> torch.Tensor:
    off = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=x.device)
    return ref.dequantize_128x1_grouped(*ref.quantize_128x1_grouped(x, off), off)


def _swiglu_bwd(dh, g, u, dtype):
    dh, g, u = dh.float(), g.float(), u.float()
    sig = torch.sigmoid(g)
    return torch.cat([(dh * u * sig * (1 + g * (1 - sig))).to(dtype), (dh * g * sig).to(dtype)], dim=1)


class Fp8Reference:
    """The FP8 recipe's version of every checked quantity on this rank (the interface of check's fp64 / eager
    references: ``own()`` and ``local_expert_grads(e_local)``)."""

    def __init__(self, prob: Problem, idx_C: torch.Tensor):
        self.p, self.idx_C, self.dt = prob, idx_C.to(prob.device), prob.dtype
        self.tokens = []
        for r in range(prob.world_size):
            x, ids, w, g = prob.rank_tokens(r)
            sel = self.idx_C
            self.tokens.append((x[sel], ids[sel], w[sel].float(), g[sel]))

    def _rows(self, e: int, x_RD, w_R, g_RD):
        """Expert e on R rows: (y_RD, dx_RD fp32, dot_R, dgu_RG, hw_RF)."""
        dt = self.dt
        w13, w2 = self.p.expert_weights(e, dt)
        w13d, w2d = _deq_weight(w13), _deq_weight(w2)
        F_ = w2.shape[1]
        gu = (_deq_rows(x_RD) @ w13d.t()).to(dt)
        g, u = gu[:, :F_], gu[:, F_:]
        h = ref.swiglu(g, u)
        y = (_deq_rows(h) @ w2d.t()).to(dt)
        a = _deq_rows(g_RD) @ w2d  # the unscaled output gradient's rows @ w2
        dot = (a * h.float()).sum(1)
        dgu = _swiglu_bwd((a * w_R[:, None]).to(dt), g, u, dt)
        hw = (h.float() * w_R[:, None]).to(dt)
        dx = (_deq_rows(dgu) @ w13d).to(dt).float()
        return y, dx, dot, dgu, hw

    def own(self) -> dict[str, torch.Tensor]:
        """out, dx, d topk_weights (this rank's checked tokens) and the shared-weight grads."""
        p, dt = self.p, self.dt
        x_CD, ids_CK, w_CK, g_CD = self.tokens[p.rank]
        C, K = ids_CK.shape
        D = x_CD.shape[1]
        y_CKD = x_CD.new_zeros(C, K, D)
        dx_CKD = torch.zeros(C, K, D, dtype=torch.float32, device=x_CD.device)
        dot_CK = torch.zeros(C, K, dtype=torch.float32, device=x_CD.device)
        flat = ids_CK.reshape(-1)
        for e in torch.unique(flat).tolist():
            rows = (flat == e).nonzero().squeeze(1)
            t = rows // K
            y, dx, dot, _, _ = self._rows(e, x_CD[t], w_CK.reshape(-1)[rows], g_CD[t])
            y_CKD.view(C * K, D)[rows] = y
            dx_CKD.view(C * K, D)[rows] = dx
            dot_CK.view(-1)[rows] = dot
        out = {}
        shared, dxs = None, None
        if p.shared_w13_HD is not None:
            sw13 = p.shared_w13_HD.detach().to(dt).requires_grad_()
            sw2 = p.shared_w2_DS.detach().to(dt).requires_grad_()
            xs = x_CD.detach().requires_grad_()
            shared = ref.shared_expert(xs, sw13, sw2)
            dxs, out["d_shared_w13"], out["d_shared_w2"] = torch.autograd.grad(shared, [xs, sw13, sw2], g_CD)
            shared = shared.detach()
        out["out"] = ref.combine(y_CKD, w_CK, shared, dt)
        acc = torch.zeros(C, D, dtype=torch.float32, device=x_CD.device)
        for k in range(K):  # slot order, the shared expert last, one cast
            acc = acc + dx_CKD[:, k]
        out["dx"] = (acc + dxs.float() if dxs is not None else acc).to(dt)
        out["d_topk_weights"] = dot_CK
        return out

    def local_expert_grads(self, e_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(dw13_GD, dw2_DF) of local expert e_local from every rank's checked tokens, on 128x1 blocks."""
        p = self.p
        e = p.rank * p.local_experts + e_local
        xs, ws, gs = [], [], []
        for x_CD, ids_CK, w_CK, g_CD in self.tokens:  # rank order, then (token, slot) order
            K = ids_CK.shape[1]
            rows = (ids_CK.reshape(-1) == e).nonzero().squeeze(1)
            xs.append(x_CD[rows // K])
            ws.append(w_CK.reshape(-1)[rows])
            gs.append(g_CD[rows // K])
        x_RD, w_R, g_RD = torch.cat(xs), torch.cat(ws), torch.cat(gs)
        w13, w2 = p.expert_weights(e, self.dt)
        if x_RD.shape[0] == 0:
            return torch.zeros_like(w13), torch.zeros_like(w2)
        _, _, _, dgu, hw = self._rows(e, x_RD, w_R, g_RD)
        dw2 = (_deq_along_rows(g_RD).t() @ _deq_along_rows(hw)).to(self.dt)
        dw13 = (_deq_along_rows(dgu).t() @ _deq_along_rows(x_RD)).to(self.dt)
        return dw13, dw2
