"""One benchmark problem: inputs, weights and output gradient, each a pure function of (seed, index).

Legend: T tokens per rank, D hidden, F expert FFN, G = 2F (gate rows then up rows), E routed experts,
L = E / W local experts, K top-k, S shared FFN, H = 2S, W EP world size.

Every tensor is drawn from its own seeded generator on the run's device, so any rank can rebuild any
expert's weights or any rank's tokens without communication; the correctness check relies on this to
compute reference gradients at the benchmarked shape without gathering weights. Scales keep activations
O(1): x ~ N(0, 1), w13 ~ N(0, 1/D), w2 ~ N(0, 1/F), shared likewise, grad_out ~ N(0, 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import MoEConfig
from .routing_models import Routing

__all__ = ["Problem", "make_problem"]

# Stream ids keep the generators of different tensors apart.
_X, _GRAD, _W13, _W2, _SW13, _SW2 = range(6)


def _randn(shape, seed: int, stream: int, index: int, scale: float, dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed((seed * 7919 + stream) * 1_000_003 + index)
    return (torch.randn(shape, generator=gen, dtype=torch.float32, device=device) * scale).to(dtype)


@dataclass
class Problem:
    """Inputs of one (preset, T, routing) case on one rank. ``args()`` is what every provider takes.

    Leaves (``requires_grad``): x_TD, topk_weights_TK, w13, w2, shared_w13_HD, shared_w2_DS.
    ``w13``/``w2`` hold this rank's L = E / W experts (all E when W = 1).
    """

    name: str
    cfg: MoEConfig
    tokens_per_rank: int
    world_size: int
    rank: int
    seed: int
    dtype: torch.dtype
    device: torch.device
    routing: Routing
    x_TD: torch.Tensor
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    shared_w13_HD: torch.Tensor | None
    shared_w2_DS: torch.Tensor | None
    grad_out_TD: torch.Tensor
    extra: dict = field(default_factory=dict)

    @property
    def local_experts(self) -> int:
        return self.cfg.num_experts // self.world_size

    def args(self) -> tuple:
        return (self.x_TD, self.topk_ids_TK, self.topk_weights_TK, self.w13, self.w2,
                self.shared_w13_HD, self.shared_w2_DS)

    def grad_inputs(self) -> list[torch.Tensor]:
        """The tensors gradients are taken for (x, topk weights, all weights), in a fixed order."""
        out = [self.x_TD, self.topk_weights_TK, self.w13, self.w2]
        if self.shared_w13_HD is not None:
            out += [self.shared_w13_HD, self.shared_w2_DS]
        return out

    # Rebuilders used by the correctness check (pure functions of the seed).
    def expert_weights(self, e: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13_GD, w2_DF) of global expert e, rebuilt on this device (values of ``self.dtype``, cast)."""
        c, dt = self.cfg, dtype or self.dtype
        D, F_ = c.hidden_size, c.moe_intermediate_size
        return (_randn((2 * F_, D), self.seed, _W13, e, D ** -0.5, self.dtype, self.device).to(dt),
                _randn((D, F_), self.seed, _W2, e, F_ ** -0.5, self.dtype, self.device).to(dt))

    def rank_tokens(self, r: int, dtype=None) -> tuple[torch.Tensor, ...]:
        """(x_TD, topk_ids_TK, topk_weights_TK, grad_out_TD) of rank r, rebuilt on this device."""
        T, D = self.tokens_per_rank, self.cfg.hidden_size
        ids, w = self.routing.rank_slice(r, T)
        dt = dtype or self.dtype
        return (_randn((T, D), self.seed, _X, r, 1.0, self.dtype, self.device).to(dt),
                ids.to(self.device), w.to(self.device),
                _randn((T, D), self.seed, _GRAD, r, 1.0, self.dtype, self.device).to(dt))


def make_problem(name: str, cfg: MoEConfig, tokens_per_rank: int, routing: Routing, *, world_size: int = 1,
                 rank: int = 0, seed: int = 0, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> Problem:
    """Build rank ``rank``'s share of the problem. Raises ValueError if E is not divisible by W."""
    device = torch.device(device)
    dtype = dtype or cfg.dtype
    L = cfg.local_experts(world_size)
    D, F_, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    w13 = torch.empty(L, 2 * F_, D, dtype=dtype, device=device)
    w2 = torch.empty(L, D, F_, dtype=dtype, device=device)
    for j in range(L):
        e = rank * L + j
        w13[j] = _randn((2 * F_, D), seed, _W13, e, D ** -0.5, dtype, device)
        w2[j] = _randn((D, F_), seed, _W2, e, F_ ** -0.5, dtype, device)
    sw13 = sw2 = None
    if S:
        sw13 = _randn((2 * S, D), seed, _SW13, 0, D ** -0.5, dtype, device).requires_grad_()
        sw2 = _randn((D, S), seed, _SW2, 0, S ** -0.5, dtype, device).requires_grad_()
    T = tokens_per_rank
    ids, w = routing.rank_slice(rank, T)
    prob = Problem(name, cfg, T, world_size, rank, seed, dtype, device, routing,
                   _randn((T, D), seed, _X, rank, 1.0, dtype, device).requires_grad_(),
                   ids.to(device).contiguous(), w.to(device).contiguous().requires_grad_(),
                   w13.requires_grad_(), w2.requires_grad_(), sw13, sw2,
                   _randn((T, D), seed, _GRAD, rank, 1.0, dtype, device))
    return prob
