"""Correctness check of a provider at the benchmarked shape, before it is timed.

Legend: T tokens per rank, C checked tokens per rank, D hidden, F expert FFN, K top-k, L local experts,
W EP world size, S shared FFN.

Method. The provider runs forward on the full problem and backward with an output gradient that is zero
except on C checked tokens per rank (all T when T <= ``check_tokens``), so every gradient it returns
(x, topk weights, all expert and shared weights) depends on the checked tokens only. The same quantities
are then computed from :mod:`megamoe.reference`'s building blocks (``expert_ffn``, ``combine``,
``shared_expert``) one expert at a time, twice: in float64 (the truth) and in the activation dtype
("torch", what plain PyTorch gets at that precision). Weights and other ranks' tokens are rebuilt from the
seed (:class:`~megamoe.bench.problem.Problem`), so no weights are gathered and memory stays small.

Criterion (per quantity, flash-attention style): ``max|provider - fp64| <= 2 * max|torch - fp64| + atol``
with ``atol = 1e-5 * max|fp64|``. Quantities: out, dx, d topk_weights, dw13, dw2, d shared_w13,
d shared_w2. On CUDA, freed memory is first filled with NaN so that unwritten outputs show up. FP8 providers: the
"torch" error is the FP8 recipe's own error against the same truth (megamoe.bench.check_fp8).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import reference as ref
from .check_fp8 import Fp8Reference
from .problem import Problem

__all__ = ["check_provider", "check_token_index"]


def check_token_index(T: int, check_tokens: int) -> torch.Tensor:
    """The checked tokens of every rank: all of them, or ``check_tokens`` spread evenly (first and last in)."""
    if T <= check_tokens:
        return torch.arange(T)
    return torch.linspace(0, T - 1, check_tokens).round().long().unique()


def _poison_free_memory(device: torch.device, nbytes: int = 1 << 30) -> None:
    if device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(device)[0]
    n = max(0, min(nbytes, free // 2)) // 2
    if n:
        torch.empty(n, dtype=torch.bfloat16, device=device).fill_(float("nan"))  # freed at once, stays cached


class _Reference:
    """fp64 truth and activation-dtype ("torch") versions of every checked quantity on this rank."""

    def __init__(self, prob: Problem, idx_C: torch.Tensor, dtype: torch.dtype):
        self.p, self.idx_C, self.dt = prob, idx_C.to(prob.device), dtype
        self.tokens = []  # per rank: (x_CD, ids_CK, w_CK, g_CD)
        for r in range(prob.world_size):
            x, ids, w, g = prob.rank_tokens(r)
            sel = self.idx_C
            self.tokens.append((x[sel].to(dtype), ids[sel], w[sel].double() if dtype == torch.float64 else w[sel],
                                g[sel].to(dtype)))

    def _dy(self, w_R: torch.Tensor, g_RD: torch.Tensor) -> torch.Tensor:
        # d out / d y[t, k] through the fp32 combine: w[t, k] * g[t], cast back to y's dtype.
        acc = torch.float64 if self.dt == torch.float64 else torch.float32
        return (w_R.to(acc).unsqueeze(1) * g_RD.to(acc)).to(self.dt)

    def own(self) -> dict[str, torch.Tensor]:
        """out, dx, d topk_weights (this rank's checked tokens) and the shared-weight grads."""
        p, dt = self.p, self.dt
        x_CD, ids_CK, w_CK, g_CD = self.tokens[p.rank]
        C, K = ids_CK.shape
        D = x_CD.shape[1]
        y_CKD = x_CD.new_zeros(C, K, D)
        dx_CD = x_CD.new_zeros(C, D)
        flat_ids = ids_CK.reshape(-1)
        for e in torch.unique(flat_ids).tolist():
            rows = (flat_ids == e).nonzero().squeeze(1)
            t_rows = rows // K
            w13, w2 = p.expert_weights(e, dt)
            x_rows = x_CD[t_rows].detach().requires_grad_()
            y_rows = ref.expert_ffn(x_rows, w13, w2)
            (dx_rows,) = torch.autograd.grad(y_rows, [x_rows], self._dy(w_CK.reshape(-1)[rows], g_CD[t_rows]))
            y_CKD.view(C * K, D)[rows] = y_rows.detach()
            dx_CD.index_add_(0, t_rows, dx_rows)
        out = {}
        shared = None
        if p.shared_w13_HD is not None:
            sw13 = p.shared_w13_HD.detach().to(dt).requires_grad_()
            sw2 = p.shared_w2_DS.detach().to(dt).requires_grad_()
            xs = x_CD.detach().requires_grad_()
            shared = ref.shared_expert(xs, sw13, sw2)
            dxs, out["d_shared_w13"], out["d_shared_w2"] = torch.autograd.grad(shared, [xs, sw13, sw2], g_CD)
            dx_CD = dx_CD + dxs
            shared = shared.detach()
        wl = w_CK.detach().requires_grad_()
        y_leaf = y_CKD.requires_grad_()
        out["out"] = ref.combine(y_leaf, wl, shared, dt)
        (out["d_topk_weights"],) = torch.autograd.grad(out["out"], [wl], g_CD)
        out["out"] = out["out"].detach()
        out["dx"] = dx_CD
        return out

    def local_expert_grads(self, e_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(dw13_GD, dw2_DF) of local expert e_local from every rank's checked tokens."""
        p, dt = self.p, self.dt
        e = p.rank * p.local_experts + e_local
        w13, w2 = p.expert_weights(e, dt)
        w13.requires_grad_()
        w2.requires_grad_()
        xs, dys = [], []
        for x_CD, ids_CK, w_CK, g_CD in self.tokens:  # rank order, then (token, slot) order
            K = ids_CK.shape[1]
            rows = (ids_CK.reshape(-1) == e).nonzero().squeeze(1)
            xs.append(x_CD[rows // K])
            dys.append(self._dy(w_CK.reshape(-1)[rows], g_CD[rows // K]))
        x_RD, dy_RD = torch.cat(xs), torch.cat(dys)
        if x_RD.shape[0] == 0:
            return torch.zeros_like(w13), torch.zeros_like(w2)
        return torch.autograd.grad(ref.expert_ffn(x_RD, w13, w2), [w13, w2], dy_RD)


def _maxabs(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def check_provider(fn, prob: Problem, *, check_tokens: int = 1024, group=None, fp8: bool = False) -> dict:
    """Run ``fn`` on ``prob`` and compare it with the reference (see module docstring). ``fp8``: the provider's
    routed experts compute in FP8; the comparison's "torch" error is then the FP8 recipe's own
    (:class:`megamoe.bench.check_fp8.Fp8Reference`).

    Returns ``{"ok": bool, "worst": (quantity, ratio), "errors": {q: {"err": e_p, "torch_err": e_t,
    "atol": a, "ratio": e_p / e_t}}}``. Under EP the verdict and worst ratio are reduced
    over ranks (all ranks agree). Host-syncing; never timed.
    """
    idx_C = check_token_index(prob.tokens_per_rank, check_tokens).to(prob.device)
    g_TD = torch.zeros_like(prob.grad_out_TD)
    g_TD[idx_C] = prob.grad_out_TD[idx_C]
    _poison_free_memory(prob.device)
    inputs = prob.grad_inputs()
    out_TD = fn(*prob.args())
    grads = torch.autograd.grad(out_TD, inputs, g_TD, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    got = {"out": out_TD.detach()[idx_C], "dx": grads[0][idx_C], "d_topk_weights": grads[1][idx_C]}
    if prob.shared_w13_HD is not None:
        got["d_shared_w13"], got["d_shared_w2"] = grads[4], grads[5]
    dw13_got, dw2_got = grads[2], grads[3]
    del out_TD, grads

    truth = _Reference(prob, idx_C, torch.float64)
    eager = Fp8Reference(prob, idx_C) if fp8 else _Reference(prob, idx_C, prob.dtype)
    key = ("reference-fp8" if fp8 else "reference", check_tokens)
    if key not in prob.extra:  # small ([C, D]); the per-expert weight grads are recomputed (too big to keep)
        prob.extra[key] = (truth.own(), eager.own())
    t_own, e_own = prob.extra[key]
    errors = {}
    for q in got:
        t64 = t_own[q]
        e_p = _maxabs(got[q].double() - t64)
        e_t = _maxabs(e_own[q].double() - t64)
        errors[q] = {"err": e_p, "torch_err": e_t, "atol": 1e-5 * _maxabs(t64)}
    acc = {"dw13": [0.0, 0.0, 0.0], "dw2": [0.0, 0.0, 0.0]}
    for j in range(prob.local_experts):
        (t13, t2), (e13, e2) = truth.local_expert_grads(j), eager.local_expert_grads(j)
        for q, g_, t_, e_ in (("dw13", dw13_got[j], t13, e13), ("dw2", dw2_got[j], t2, e2)):
            a = acc[q]
            a[0] = max(a[0], _maxabs(g_.double() - t_))
            a[1] = max(a[1], _maxabs(e_.double() - t_))
            a[2] = max(a[2], _maxabs(t_))
    for q, (e_p, e_t, m) in acc.items():
        errors[q] = {"err": e_p, "torch_err": e_t, "atol": 1e-5 * m}

    worst_q, worst, ok = "", 0.0, True
    for q, v in errors.items():
        bad = not (v["err"] <= 2 * v["torch_err"] + v["atol"])  # NaN fails
        ratio = v["err"] / v["torch_err"] if v["torch_err"] > 0 else (0.0 if v["err"] == 0 else math.inf)
        if math.isnan(v["err"]):
            ratio = math.inf
        v["ratio"] = ratio
        ok &= not bad
        if ratio > worst or not worst_q:
            worst_q, worst = q, ratio
    if prob.world_size > 1:
        t = torch.tensor([0.0 if ok else 1.0, worst], dtype=torch.float64, device=prob.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        ok, worst = t[0].item() == 0.0, t[1].item()
    return {"ok": ok, "worst": (worst_q, worst), "errors": errors}
