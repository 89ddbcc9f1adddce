"""The router's top-k selection from its fp32 scores, fused (``@triton.jit`` only; launchers in
megamoe.ops.topk_select). One program per BLOCK_T tokens, all E experts of a token in its registers.

Legend: T tokens, E experts (E_POW2 the next power of two), K top-k, N groups (n_group), GS experts per group.

``topk_select_fwd_kernel``: per token, megamoe.router.route's selection after the scores: sel = scores + bias
(NaN -> -inf); with N > 1 groups only the TOPK_GROUP best groups keep their experts (a group's score: the sum of
its two largest sel when GROUP_TOP2, else its largest; ties to the lower group), the others' experts at -inf; the
K largest sel in descending order, ties to the lower id (route's stable sort); the weights: the unbiased scores
of those ids, divided by their sum (slot order 0..K-1) + 1e-20 when NORM (IEEE division), times ``scale`` when
SCALED; with CHECK_LOGITS a token with a non-finite logit gets NaN weights. Writes ids (int64) and weights
(fp32), and the sum the weights were divided by (for the backward).
``topk_select_bwd_kernel``: the scores' gradient of those weights, ``ds[id_k] = c * (dw_k - sum_j dw_j w_j / c) / n``
(c the scaling, n the divisor; with FLAGGED, tokens whose weights are NaN by the logit check, whose n is NaN, get
zeros), zeros elsewhere.
"""

import triton
import triton.language as tl


@triton.jit
def _best_of(vals, avail, idx, NONE: tl.constexpr):
    """(per row: the largest available value's lowest index, the one-hot of it) over the last axis."""
    cand = tl.where(avail, vals, float("-inf"))
    top = tl.max(cand, axis=1)
    pick = tl.min(tl.where(avail & (cand == top[:, None]), idx[None, :], NONE), axis=1)
    return pick, idx[None, :] == pick[:, None]


@triton.jit
def _keep_best_groups(sel, BLOCK_T: tl.constexpr, E_POW2: tl.constexpr, N_GROUP: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr):
    """sel with the experts of all but the TOPK_GROUP best groups at -inf."""
    GS: tl.constexpr = E_POW2 // N_GROUP
    sel3 = tl.reshape(sel, (BLOCK_T, N_GROUP, GS))
    first = tl.max(sel3, axis=2)
    if GROUP_TOP2:  # the two largest (a repeated maximum counts twice), as torch.topk(2).values.sum()
        gcol = tl.arange(0, GS)
        first_at = tl.min(tl.where(sel3 == first[:, :, None], gcol[None, None, :], GS), axis=2)
        second = tl.max(tl.where(gcol[None, None, :] == first_at[:, :, None], float("-inf"), sel3), axis=2)
        gscore = first + second
    else:
        gscore = first
    gscore = tl.where(gscore != gscore, float("-inf"), gscore)
    gidx = tl.arange(0, N_GROUP)
    gavail = tl.full((BLOCK_T, N_GROUP), 1, tl.int1)
    keep = tl.full((BLOCK_T, N_GROUP), 0, tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        _, hit = _best_of(gscore, gavail, gidx, N_GROUP)
        keep = keep | hit
        gavail = gavail & (hit == 0)
    sel3 = tl.where(keep[:, :, None], sel3, float("-inf"))
    return tl.reshape(sel3, (BLOCK_T, E_POW2))


@triton.jit
def topk_select_fwd_kernel(scores_ptr, bias_ptr, logits_ptr, ids_ptr, w_ptr, norm_ptr, T, E, stride_s, stride_l, scale,
                           K: tl.constexpr, K_POW2: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                           GROUP_TOP2: tl.constexpr, HAS_BIAS: tl.constexpr, CHECK_LOGITS: tl.constexpr,
                           NORM: tl.constexpr, SCALED: tl.constexpr, E_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    rmask = rows < T
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    s = tl.load(scores_ptr + rows[:, None] * stride_s + cols[None, :], mask=m2, other=0.0)
    sel = s
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    sel = tl.where(sel != sel, float("-inf"), sel)  # NaN never wins
    if N_GROUP > 1:
        sel = _keep_best_groups(sel, BLOCK_T, E_POW2, N_GROUP, TOPK_GROUP, GROUP_TOP2)
    avail = m2 | (cmask[None, :] & (rows[:, None] >= T))  # padded rows select too (never stored)
    kcol = tl.arange(0, K_POW2)
    w = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in tl.static_range(K):
        pick, hit = _best_of(sel, avail, cols, E_POW2)
        wk = tl.sum(tl.where(hit, s, 0.0), axis=1)  # exact: one term and zeros
        avail = avail & (hit == 0)
        tl.store(ids_ptr + rows * K + k, pick.to(tl.int64), mask=rmask)
        w = tl.where(kcol[None, :] == k, wk[:, None], w)
        total = total + wk
    norm = tl.full((BLOCK_T,), 1.0, tl.float32)
    if NORM:
        norm = total + 1e-20
        w = tl.div_rn(w, norm[:, None])
    if SCALED:
        w = w * scale
    if CHECK_LOGITS:  # |x| < inf: False for +-inf and NaN; the divisor carries the flag to the backward as NaN
        lg = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        bad = tl.max(((tl.abs(lg) < float("inf")) == 0).to(tl.int32), axis=1) > 0
        w = tl.where(bad[:, None], float("nan"), w)
        norm = tl.where(bad, float("nan"), norm)
    out = rows[:, None] * K + kcol[None, :]
    tl.store(w_ptr + out, w, mask=rmask[:, None] & (kcol[None, :] < K))
    tl.store(norm_ptr + rows, norm, mask=rmask)


@triton.jit
def topk_select_bwd_kernel(dw_ptr, w_ptr, ids_ptr, norm_ptr, ds_ptr, T, E, scale, K: tl.constexpr,
                           K_POW2: tl.constexpr, NORM: tl.constexpr, SCALED: tl.constexpr, FLAGGED: tl.constexpr,
                           E_POW2: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    kcol = tl.arange(0, K_POW2)
    km = rmask[:, None] & (kcol[None, :] < K)
    dw = tl.load(dw_ptr + rows[:, None] * K + kcol[None, :], mask=km, other=0.0)
    n = tl.load(norm_ptr + rows, mask=rmask, other=1.0)  # NaN: a token the logit check gave NaN weights
    if SCALED:
        dw = dw * scale  # d(w * c) = c dw
    if NORM:  # w = u / n, n = sum(u) + eps: du_k = (dw_k - sum_j dw_j u_j / n) / n, u_j / n = w_j / c
        w = tl.load(w_ptr + rows[:, None] * K + kcol[None, :], mask=km, other=0.0)
        if SCALED:
            w = tl.div_rn(w, scale)
        dot = tl.sum(tl.where(km, dw * w, 0.0), axis=1)
        dw = tl.div_rn(dw - dot[:, None], n[:, None])
    if FLAGGED:
        dw = tl.where((n != n)[:, None], 0.0, dw)  # no gradient through the NaN weights, as torch.where's
    ids = tl.load(ids_ptr + rows[:, None] * K + kcol[None, :], mask=km, other=0)
    cols = tl.arange(0, E_POW2)
    ds = tl.zeros((BLOCK_T, E_POW2), dtype=tl.float32)
    for k in tl.static_range(K):
        idk = tl.sum(tl.where(kcol[None, :] == k, ids, 0), axis=1)
        dk = tl.sum(tl.where(kcol[None, :] == k, dw, 0.0), axis=1)
        ds = tl.where(cols[None, :] == idk[:, None], dk[:, None], ds)
    tl.store(ds_ptr + rows[:, None] * E + cols[None, :], ds, mask=rmask[:, None] & (cols[None, :] < E))
