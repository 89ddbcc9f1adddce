"""MoE layer configuration and named presets.

Legend (used across megamoe): T tokens, D hidden size, F routed-expert FFN size, E routed experts,
K top-k, S shared-expert FFN size (all shared experts fused into one SwiGLU of width S), W EP world
size, L = E // W local experts per EP rank.

The public model presets copy the MoE-layer numbers from each model's published ``config.json`` on the
Hugging Face hub (``hidden_size``, ``moe_intermediate_size``, ``n_routed_experts``/``num_experts``,
``num_experts_per_tok``, ``n_group``, ``topk_group``, ``scoring_func``, ``norm_topk_prob``,
``routed_scaling_factor``, ``n_shared_experts``); the source is named next to each preset.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["MoEConfig", "PRESETS", "get_preset"]

ScoreFunc = Literal["sigmoid", "softmax"]
NanPolicy = Literal["raise", "propagate"]


@dataclass(frozen=True)
class MoEConfig:
    """Frozen, validated description of one DeepSeek-V3-style MoE layer.

    Attributes:
        hidden_size: D, the model width (any positive int; the fused backend is tested on GPUs with
            multiples of 64: 64, 256, 2048, 7168).
        moe_intermediate_size: F, the FFN width of one routed SwiGLU expert.
        num_experts: E, routed experts (1..512).
        top_k: K, experts selected per token (1..min(16, E)).
        score_func: ``"sigmoid"`` (DeepSeek-V3, Kimi K2, GLM-4.5) or ``"softmax"`` (Qwen3).
        n_group: expert groups for group-limited routing (1 disables it). E % n_group == 0.
        topk_group: groups kept per token (1..n_group); top_k must fit in the kept groups.
        norm_topk_prob: divide the K selected scores by their sum.
        routed_scaling_factor: multiplies the (normalised) routing weights, applied exactly once.
        n_shared_experts: number of shared experts; they are fused into one SwiGLU of width
            ``shared_intermediate_size`` (default ``n_shared_experts * moe_intermediate_size``).
        shared_intermediate_size: S; 0 when there is no shared expert.
        use_expert_bias: keep the aux-loss-free correction bias (affects selection only).
        bias_update_rate: gamma of the aux-loss-free bias update (DeepSeek-V3 §2.1.2).
        seq_aux_loss_coef: alpha of the sequence-wise balance loss (0 disables it).
        nan_policy: ``"raise"``: non-finite router logits are an error (FloatingPointError from the
            host check on CPU, a sync-free device assert on CUDA). ``"propagate"``: ids stay in range (a NaN score ranks
            last, ties to the lower index) and a token with any non-finite logit gets NaN combine
            weights, so its output is NaN: visible, never a silent reroute.
        dtype: parameter / activation dtype of the experts (router math is always fp32).
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    score_func: ScoreFunc = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    use_expert_bias: bool = True
    bias_update_rate: float = 1e-3
    seq_aux_loss_coef: float = 0.0
    nan_policy: NanPolicy = "raise"
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"MoEConfig: {msg}")

        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f"{name} must be a positive int, got {v!r}")
        if self.num_experts > 512:
            bad(f"num_experts={self.num_experts} > 512 is not supported")
        if self.top_k > self.num_experts:
            bad(f"top_k={self.top_k} > num_experts={self.num_experts}")
        if self.top_k > 16:
            bad(f"top_k={self.top_k} > 16 is not supported")
        if self.score_func not in ("sigmoid", "softmax"):
            bad(f"score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")
        if self.num_experts % self.n_group:
            bad(f"num_experts={self.num_experts} is not divisible by n_group={self.n_group}")
        if self.topk_group > self.n_group:
            bad(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            bad(f"top_k={self.top_k} experts do not fit in topk_group={self.topk_group} groups of "
                f"{self.num_experts // self.n_group}")
        if self.n_group > 1 and self.score_func == "sigmoid" and self.num_experts // self.n_group < 2:
            bad("sigmoid group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
        if self.n_shared_experts < 0:
            bad(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.shared_intermediate_size is None:
            object.__setattr__(self, "shared_intermediate_size", self.n_shared_experts * self.moe_intermediate_size)
        if self.shared_intermediate_size < 0 or (self.n_shared_experts == 0) != (self.shared_intermediate_size == 0):
            bad("shared_intermediate_size must be > 0 exactly when n_shared_experts > 0")
        if not (isinstance(self.routed_scaling_factor, (int, float)) and 0 < self.routed_scaling_factor < float("inf")):
            bad(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")
        for name in ("bias_update_rate", "seq_aux_loss_coef"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):  # rejects NaN too
                bad(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("norm_topk_prob", "use_expert_bias"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.nan_policy not in ("raise", "propagate"):
            bad(f"nan_policy must be 'raise' or 'propagate', got {self.nan_policy!r}")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            bad(f"dtype {self.dtype} is not supported")

    def replace(self, **changes) -> "MoEConfig":
        """A copy with some fields changed (validated again)."""
        if "moe_intermediate_size" in changes and "shared_intermediate_size" not in changes and self.n_shared_experts:
            changes["shared_intermediate_size"] = None
        return dataclasses.replace(self, **changes)

    def local_experts(self, ep_size: int) -> int:
        """L = E // W; raises ValueError if E is not divisible by the EP size W."""
        if ep_size <= 0 or self.num_experts % ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the EP size {ep_size}")
        return self.num_experts // ep_size

    def routed_flops_fwd(self, num_tokens: int) -> int:
        """Forward routed-expert GEMM FLOPs, 6·T·K·D·F (DeepGEMM MegaMoE / MoK convention)."""
        return 6 * num_tokens * self.top_k * self.hidden_size * self.moe_intermediate_size


PRESETS: dict[str, MoEConfig] = {
    # deepseek-ai/DeepSeek-V3 config.json: hidden 7168, moe_intermediate 2048, 256 routed + 1 shared,
    # top-8, n_group 8, topk_group 4, sigmoid, norm_topk_prob, routed_scaling_factor 2.5.
    "deepseek-v3": MoEConfig(7168, 2048, 256, 8, "sigmoid", n_group=8, topk_group=4,
                             routed_scaling_factor=2.5, n_shared_experts=1),
    # moonshotai/Kimi-K2-Instruct config.json: DeepSeek-V3 architecture, 384 routed + 1 shared, top-8,
    # n_group 1, topk_group 1, routed_scaling_factor 2.827.
    "kimi-k2": MoEConfig(7168, 2048, 384, 8, "sigmoid", routed_scaling_factor=2.827, n_shared_experts=1),
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, moe_intermediate 768, 128 experts, top-8, softmax,
    # norm_topk_prob true, no shared expert.
    "qwen3-30b-a3b": MoEConfig(2048, 768, 128, 8, "softmax", use_expert_bias=False, n_shared_experts=0),
    # zai-org/GLM-4.5 config.json: hidden 5120, moe_intermediate 1536, 160 routed + 1 shared, top-8,
    # sigmoid with correction bias, n_group 1, routed_scaling_factor 2.5.
    "glm-4.5": MoEConfig(5120, 1536, 160, 8, "sigmoid", routed_scaling_factor=2.5, n_shared_experts=1),
    # Mixture-of-Kittens benchmark shape (benchmarks/bench_mok.py defaults): H 7168, I 3072, 384 experts,
    # top-6, one shared expert of the same width. Router settings are not part of that benchmark.
    "mok-bench": MoEConfig(7168, 3072, 384, 6, "sigmoid", n_shared_experts=1),
    # Small shapes for CPU tests, CI and the demo.
    "tiny": MoEConfig(64, 32, 8, 2, "sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
                      n_shared_experts=1, seq_aux_loss_coef=1e-3),
    "small": MoEConfig(256, 128, 16, 4, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       n_shared_experts=1, seq_aux_loss_coef=1e-3),
}


def get_preset(name: str, **overrides) -> MoEConfig:
    """The named preset, optionally with fields overridden. Raises KeyError listing valid names, TypeError
    listing valid fields for an unknown override."""
    if name not in PRESETS:
        hint = ""
        if name.startswith("lm-"):
            hint = (f" ({name!r} names a language model of the training demo: `python -m megamoe.train --preset "
                    f"{name}`, megamoe.train.model.get_model_preset)")
        raise KeyError(f"unknown MoE layer preset {name!r}{hint}; valid presets: {', '.join(sorted(PRESETS))}")
    cfg = PRESETS[name]
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"get_preset: unknown MoEConfig field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
    return cfg.replace(**overrides) if overrides else cfg
