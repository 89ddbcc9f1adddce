"""Routing models for the benchmark: which experts each token uses, identical for every provider.

Legend: T tokens per rank, W EP world size, M = W*T tokens of the global batch, K top-k, E routed experts,
T0 / K0 / E0 the shape of a saved routing trace.

The router is not timed: a routing model draws ``topk_ids_MK`` (int64, distinct experts per token, in
"descending score" slot order) and ``topk_weights_MK`` (fp32, positive, normalised to sum 1 per token and
multiplied by ``routed_scaling_factor`` when ``norm_topk_prob`` is set, as :func:`megamoe.reference.route`
does) for the whole global batch from one seed, on the CPU, so every rank and every provider sees the same
routing; rank r takes rows ``[r*T, (r+1)*T)``.

Models (``--routing`` spec strings):
  * ``uniform``: each token picks K distinct experts uniformly at random (balanced on average).
  * ``zipf[:s]`` (default s = 1.2): expert popularity p_e proportional to 1 / rank(e)^s over a random
    permutation of the experts; K distinct experts per token drawn without replacement in proportion to
    p (Gumbel-top-k, Vieira 2014 / Kool et al. arXiv 1903.06059). Real routers are skewed like this early
    in training and per batch.
  * ``trace:PATH``: a routing trace saved by the training demo, ``torch.save({"topk_ids_TK": int64 [T0,
    K0], "num_experts": E0, "top_k": K0, "preset": name}, PATH)``. It is fitted to the benchmark by
    :func:`fit_trace` (rows tiled, experts stretched, slots cut or filled; see there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import MoEConfig

__all__ = ["Routing", "parse_routing", "make_routing", "fit_trace", "load_stats"]


@dataclass
class Routing:
    """A routing of the global batch. ``name`` is the spec string; ``note`` says how it was made."""

    name: str
    topk_ids_MK: torch.Tensor
    topk_weights_MK: torch.Tensor
    note: str = ""

    def rank_slice(self, rank: int, tokens_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids_TK, topk_weights_TK) of one rank, CPU tensors."""
        lo, hi = rank * tokens_per_rank, (rank + 1) * tokens_per_rank
        return self.topk_ids_MK[lo:hi], self.topk_weights_MK[lo:hi]


def parse_routing(spec: str) -> tuple[str, str | float | None]:
    """Split a ``--routing`` spec into (kind, argument); raises ValueError naming the spec."""
    kind, _, arg = spec.partition(":")
    if kind == "uniform" and not arg:
        return kind, None
    if kind == "zipf":
        try:
            s = float(arg) if arg else 1.2
        except ValueError:
            raise ValueError(f"--routing {spec!r}: zipf exponent must be a number") from None
        if not s >= 0:
            raise ValueError(f"--routing {spec!r}: zipf exponent must be >= 0")
        return kind, s
    if kind == "trace" and arg:
        return kind, arg
    raise ValueError(f"--routing {spec!r}: expected 'uniform', 'zipf[:s]' or 'trace:PATH'")


def _combine_weights(gen: torch.Generator, M: int, K: int, cfg: MoEConfig) -> torch.Tensor:
    # Positive scores in [0.05, 1) like sigmoid outputs, then the reference's normalise-and-scale.
    w_MK = torch.rand(M, K, generator=gen) * 0.95 + 0.05
    if cfg.norm_topk_prob:
        w_MK = w_MK / w_MK.sum(-1, keepdim=True)
    return (w_MK * cfg.routed_scaling_factor).float()


def _topk_without_replacement(log_p_E: torch.Tensor, M: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """K distinct experts per row, drawn in proportion to exp(log_p) (Gumbel-top-k), chunked over rows."""
    E = log_p_E.numel()
    out_MK = torch.empty(M, K, dtype=torch.int64)
    chunk = max(1, (1 << 22) // max(E, 1))
    for lo in range(0, M, chunk):
        hi = min(M, lo + chunk)
        u = torch.rand(hi - lo, E, generator=gen, dtype=torch.float64).clamp_min_(1e-300)
        keys = log_p_E.unsqueeze(0) - torch.log(-torch.log(u))
        out_MK[lo:hi] = torch.topk(keys, K, dim=-1).indices
    return out_MK


def fit_trace(trace_ids_NK: torch.Tensor, E0: int, M: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """Fit a trace [T0, K0] over E0 experts to [M, K] over E experts.

    * Rows: tiled cyclically (row m is trace row m mod T0).
    * Experts: e = floor((e0 + u) * E / E0) with u ~ U[0, 1) per (row, slot): with E = E0 this is the
      identity; with E > E0 each trace expert's load is spread evenly over its E/E0 images; with E < E0
      neighbouring experts merge. Either way the shape of the load histogram is kept.
    * Slots: the first K slots when K0 >= K (traces are in descending score order); when K0 < K the
      missing slots are filled with uniform random experts.
    * Duplicates inside a row (from merging or filling) move to the next free expert id (mod E), so every
      row has K distinct experts.
    """
    T0, K0 = trace_ids_NK.shape
    if T0 == 0:
        raise ValueError("routing trace has no tokens")
    if int(trace_ids_NK.min()) < 0 or int(trace_ids_NK.max()) >= E0:
        raise ValueError(f"routing trace has expert ids outside [0, {E0})")
    rows_MK0 = trace_ids_NK[torch.arange(M) % T0].long()
    if E != E0:
        u = torch.rand(rows_MK0.shape, generator=gen, dtype=torch.float64)
        rows_MK0 = ((rows_MK0.double() + u) * E / E0).floor().long().clamp_(0, E - 1)
    if K0 >= K:
        ids_MK = rows_MK0[:, :K].clone()
    else:
        extra = torch.randint(0, E, (M, K - K0), generator=gen)
        ids_MK = torch.cat([rows_MK0, extra], dim=1)
    # Resolve duplicates slot by slot (vectorised over rows).
    for k in range(1, K):
        for _ in range(E):
            dup_M = (ids_MK[:, :k] == ids_MK[:, k:k + 1]).any(1)
            if not bool(dup_M.any()):
                break
            ids_MK[dup_M, k] = (ids_MK[dup_M, k] + 1) % E
    return ids_MK


def make_routing(spec: str, cfg: MoEConfig, tokens_per_rank: int, world_size: int, seed: int) -> Routing:
    """The routing of the global batch (W*T tokens) for ``spec``; pure function of its arguments."""
    kind, arg = parse_routing(spec)
    M, K, E = tokens_per_rank * world_size, cfg.top_k, cfg.num_experts
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    note = ""
    if kind == "uniform":
        ids_MK = _topk_without_replacement(torch.zeros(E, dtype=torch.float64), M, K, gen)
    elif kind == "zipf":
        s = float(arg)
        ranks_E = torch.randperm(E, generator=gen).double() + 1.0
        ids_MK = _topk_without_replacement(-s * torch.log(ranks_E), M, K, gen)
    else:
        try:
            trace = torch.load(arg, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"--routing {spec!r}: no such file") from None
        if not isinstance(trace, dict) or "topk_ids_TK" not in trace or "num_experts" not in trace:
            raise ValueError(f"--routing {spec!r}: expected a dict with 'topk_ids_TK' and 'num_experts'")
        tr_ids = trace["topk_ids_TK"]
        E0 = int(trace["num_experts"])
        ids_MK = fit_trace(tr_ids, E0, M, K, E, gen)
        note = (f"trace {arg} (preset {trace.get('preset', '?')}, T0={tr_ids.shape[0]} K0={tr_ids.shape[1]} "
                f"E0={E0}) fitted to M={M} K={K} E={E}")
    return Routing(spec, ids_MK, _combine_weights(gen, M, K, cfg), note)


def load_stats(topk_ids_MK: torch.Tensor, num_experts: int, world_size: int = 1) -> dict[str, float]:
    """Load imbalance of a routing: max/mean (token, slot) rows per expert and per EP rank."""
    counts_E = torch.bincount(topk_ids_MK.reshape(-1), minlength=num_experts).double()
    mean = counts_E.mean().item() if num_experts else 0.0
    per_rank_W = counts_E.view(world_size, -1).sum(1) if num_experts % world_size == 0 else counts_E.sum(0, True)
    return {
        "expert_max_over_mean": (counts_E.max().item() / mean) if mean > 0 else math.nan,
        "experts_empty": int((counts_E == 0).sum().item()),
        "rank_max_over_mean": (per_rank_W.max().item() / per_rank_W.mean().item()) if mean > 0 else math.nan,
    }
