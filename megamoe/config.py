"""MoE layer configuration and named presets.

Legend (used across megamoe): T tokens, D hidden size, F routed-expert FFN size, E routed experts,
K top-k, S shared-expert FFN size (all shared experts fused into one SwiGLU of width S), W EP world
size, L = E // W local experts per EP rank.

The public model presets copy the MoE-layer numbers from each model's published ``config.json`` on the
Hugging Face hub (``hidden_size``, ``moe_intermediate_size``, ``n_routed_experts``/``num_experts``,
``num_experts_per_tok``, ``n_group``, ``topk_group``, ``scoring_func``, ``norm_topk_prob``,
``routed_scaling_factor``, ``n_shared_experts``); the source is named next to each preset.

Execution choices that never change results live here too, as frozen dataclasses passed down as arguments
(no environment switches): :class:`KernelConfig` (tile overrides of the fused GEMMs, :class:`GemmConfig`)
and :class:`EPOptions` (variants of the NVLink expert-parallel exchange, all off by default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["MoEConfig", "PRESETS", "get_preset", "GemmConfig", "KernelConfig", "EPOptions", "GEMM_KINDS",
           "ROUTER_DTYPES"]

ScoreFunc = Literal["sigmoid", "softmax"]
NanPolicy = Literal["raise", "propagate"]
RouterDtype = Literal["fp32", "model"]
ROUTER_DTYPES = ("fp32", "model")


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
        dtype: parameter / activation dtype of the experts.
        router_dtype: the router logits GEMM ``x @ router_w.T``. ``"fp32"`` (default): x and the weight in fp32,
            fp32 logits (as transformers' DeepSeek-V3 and GLM-4.5 routers; on the fused backend, for bf16 x, bf16
            tensor-core GEMMs of exact three-piece bf16 splits of the fp32 operands (a bf16 weight as itself), every
            product exact and fp32 accumulation, otherwise IEEE fp32 dots).
            ``"model"``: x and the weight in ``dtype`` (the weight cast to it), tensor cores with fp32
            accumulation, the logits rounded once to ``dtype``, and the gradients of that product in ``dtype``
            (as transformers' Qwen3-MoE and Mixtral routers, ``F.linear`` in the model dtype). Either way the
            scores and everything after them are computed in fp32 (fp64 for fp64 inputs), and the fused
            backend's logits are batch invariant.
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
    router_dtype: RouterDtype = "fp32"

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
        if self.router_dtype not in ROUTER_DTYPES:
            bad(f"router_dtype must be 'fp32' (fp32 logits) or 'model' (logits in dtype, tensor cores), got "
                f"{self.router_dtype!r}")

    def replace(self, **changes) -> MoEConfig:
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


@dataclass(frozen=True)
class GemmConfig:
    """One Triton GEMM launch config. block_k is the reduction chunk (rows of an expert for k-grouped).

    m-grouped only (bf16/fp16 on CUDA): ``tma_b`` loads the weight operand B through a TMA tensor
    descriptor instead of pointer loads; ``tma_a`` (with tma_b) also A, when A's rows are not gathered
    (gathered rows always use pointer loads); ``programs_per_sm`` sizes the persistent grid.

    k-grouped only: ``resident_chunks`` > 0 runs the weight gradient with one program per (expert,
    m-tile) that keeps an expert's P rows on chip while it walks the n-tiles, for experts of at most
    resident_chunks * block_k rows (larger experts fall back to the per-tile reduction inside the same
    program); 0 runs one program per (expert, m-tile, n-tile). ``gluon`` runs the persistent Gluon kernel
    instead (megamoe/kernels/wgrad_gluon.py: one program per SM walking (expert, m-tile) units, P kept on
    chip for experts of at most resident_chunks * block_k rows (0..6; 0: always streamed), the load ring
    running across n-tiles with num_stages slots, TMA stores of the output tiles) where the device and
    operands allow it (Hopper, bf16/fp16, aligned rows; ops.wgrad_gluon.gluon_wgrad_eligible), else the
    Triton kernels with this config's tiles.

    k-grouped only: ``warp_specialized`` (with gluon; contiguous rows only, 128x128x64, 8 warps = two MMA
    warpgroups, plus a TMA load warp) runs megamoe/kernels/wgrad_ws_gluon.py, ping-pong: the two warpgroups take
    a program's tiles in turn, with the P chunks of an expert of at most resident_chunks chunks kept on chip
    (ops.wgrad_gluon.ws_operands_fit); the table takes it (megamoe.ops.tile_config.ws_wgrad_config) in place of a
    ``torch_mm`` choice for contiguous rows of at most ~384 per expert.

    k-grouped only: ``torch_mm`` runs ``torch._grouped_mm`` (megamoe.ops.torch_grouped_mm; bitwise the Triton
    kernels' result) where the operands allow it (contiguous bf16 rows on Hopper), else the table's own entry
    for the shape (``k_grouped_config(..., allow_torch=False)``); its tiles are then not used.

    Bits: only block_k (the K order) can change results. block_m, block_n, the stage count, the load path
    and the grid were verified to give bitwise the same outputs and gradients on H200
    (tests/test_fused_gpu.py::test_bits_do_not_depend_on_tile_shape), as expected from wgmma: every
    64-row x N slab accumulates the same K sequence whatever the tile around it.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma_b: bool = False
    tma_a: bool = False
    programs_per_sm: int = 1
    resident_chunks: int = 0
    gluon: bool = False
    warp_specialized: bool = False
    torch_mm: bool = False

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n, self.block_k):
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig: block sizes must be powers of two >= 16, got {self}")
        if self.torch_mm and (self.gluon or self.resident_chunks or self.tma_a or self.tma_b):
            raise ValueError(f"GemmConfig: torch_mm (weight gradients through torch._grouped_mm) takes no Gluon, "
                             f"resident or TMA fields, got {self}")
        if self.resident_chunks not in range(0, 7 if self.gluon else 5):
            raise ValueError(f"GemmConfig: resident_chunks must be 0..4 (0..6 with gluon), got {self}")
        if self.warp_specialized:
            # the ring (P slots: max(resident chunks, stages) for the weight gradient) plus one layout-change
            # scratch per MMA warpgroup (64 x block_n bytes, compiler-placed)
            p_slots = max(self.resident_chunks, self.num_stages)
            smem = (2 * self.block_k * (p_slots * self.block_m + self.num_stages * self.block_n)
                    + 2 * 64 * self.block_n + 256)
            if (not self.gluon or (self.block_m, self.block_k, self.num_warps) != (128, 64, 8)
                    or self.block_n != 128 or self.num_stages < 2 or smem > 227 * 1024):
                raise ValueError(f"GemmConfig: the warp-specialized Gluon kernel runs gluon=True, 128x128x64 "
                                 f"tiles (ping-pong; resident chunks 0..6), num_warps 8 (two MMA warpgroups), 2 or "
                                 f"more stages within 227 KiB ({smem // 1024} KiB asked), got {self}")
        elif self.gluon:
            smem = 2 * self.block_k * (max(self.resident_chunks, self.num_stages) * self.block_m
                                       + self.num_stages * self.block_n) + 2 * self.block_m * self.block_n
            if (self.num_stages < 3 or self.block_m != 128 or self.block_n not in (128, 256) or self.block_k != 64
                    or self.num_warps != 8 or smem > 227 * 1024):
                raise ValueError(f"GemmConfig: the Gluon kernels run 128x128 or 128x256 tiles, "
                                 f"BLOCK_K 64, 8 warps, num_stages >= 3, within 227 KiB of shared memory "
                                 f"({smem // 1024} KiB asked), got {self}")


# The GEMM kinds of the fused path: the m-grouped "gate_up" (SwiGLU forward, N = F, K = D), "down" (N = D,
# K = F), "dgrad_swiglu" (dY @ W2 with the SwiGLU backward, N = F, K = D), "dgrad" (dGU @ W13, N = D, K = 2F),
# and the k-grouped "wgrad" (weight gradients, an [E, M, N] output).
GEMM_KINDS = ("gate_up", "down", "dgrad_swiglu", "dgrad", "wgrad")
TileKey = str | tuple[str, int, int]


@dataclass(frozen=True)
class KernelConfig:
    """Kernel choices of the fused path, passed down as an argument (``MoE(..., kernel_config=)``, the
    functional entries, the autograd functions, the GEMM launchers). The default (no overrides) is the
    checked-in tile table, a pure function of shape (megamoe.ops.tile_config). For A/B runs, sweeps and
    tests.

    tiles: ``{key: GemmConfig}``; key a GEMM kind of :data:`GEMM_KINDS` (every shape of that kind), or
        ``(kind, a, b)`` for one shape (m-grouped: (N, K); "wgrad": the (M, N) of its [E, M, N] output), which
        wins over the kind's entry. Only 16-bit GEMMs on the GPU follow them (fp32 GEMMs and the interpreter
        keep their fixed configs). A "wgrad" entry with ``torch_mm`` runs ``torch._grouped_mm`` wherever the
        operands allow (a W = 1 backward then copies its rows into row order for it); any other "wgrad" entry
        runs megamoe's own kernels with its tiles (Gluon ones where the device and operands allow, else
        Triton). Stored as a tuple of (key, config) pairs, so the object stays hashable.

    Bits: only BLOCK_K (the reduction order) can change results; an entry whose BLOCK_K differs from the
    table's changes them (``megamoe.ops.tile_config.parse_tiles``, the text form the benchmark takes,
    refuses that). Everything else here was verified on H200 not to change bits.
    """

    tiles: Mapping[TileKey, GemmConfig] | tuple[tuple[TileKey, GemmConfig], ...] = ()

    def __post_init__(self) -> None:
        items = tuple(self.tiles.items()) if isinstance(self.tiles, Mapping) else tuple(self.tiles)
        seen = set()
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"KernelConfig: tiles must map a kind or (kind, a, b) to a GemmConfig, got {item!r}")
            key, cfg = item
            kind = key[0] if isinstance(key, tuple) else key
            shape_ok = not isinstance(key, tuple) or (
                len(key) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in key[1:]))
            if kind not in GEMM_KINDS or not shape_ok:
                raise ValueError(f"KernelConfig: tile key {key!r} must be a kind of {GEMM_KINDS} or (kind, a, b) "
                                 f"with positive ints a, b")
            if not isinstance(cfg, GemmConfig):
                raise TypeError(f"KernelConfig: tiles[{key!r}] must be a GemmConfig, got {type(cfg).__name__}")
            if kind != "wgrad" and (cfg.torch_mm or cfg.gluon or cfg.warp_specialized or cfg.resident_chunks):
                raise ValueError(f"KernelConfig: tiles[{key!r}]: torch_mm, gluon, warp_specialized and "
                                 f"resident_chunks are weight-gradient (wgrad) fields, got {cfg}")
            if key in seen:
                raise ValueError(f"KernelConfig: tile key {key!r} is given twice")
            seen.add(key)
        object.__setattr__(self, "tiles", items)

    def tile(self, kind: str, a: int, b: int) -> GemmConfig | None:
        """The entry for (kind, a, b), else the kind's entry, else None (the table decides)."""
        found = None
        for key, cfg in self.tiles:
            if key == (kind, a, b):
                return cfg
            if key == kind:
                found = cfg
        return found


@dataclass(frozen=True)
class EPOptions:
    """Variants of the NVLink (symmetric-memory) expert-parallel exchange (megamoe.ops.ep_dispatch), passed
    as ``MoE(..., ep_options=)`` or ``moe_experts_ep(..., options=)``. All off by default: measured only at
    W = 1 (docs/perf.md), where there is no NVLink traffic to hide; to measure over NVLink (docs/ep.md).
    None of them changes bits: the same kernels see the same rows.

    pull_programs: n > 0 runs round 0's pull as n persistent programs beside the first expert GEMM that reads
        its rows (forward gate/up; backward dgrad + SwiGLU when the pre-activations are kept), which waits
        (bounded) per 32-row block (megamoe.ops.ep_comm.pull_beside); 0 pulls first. 0..128.
    comm_sms: n > 0 runs the shared expert on a high-priority side stream beside the schedule build and round
        0's pull, its persistent GEMMs leaving n SMs to them (n at or above the GPU's SM count leaves them one
        program: slow, not wrong); 0 runs it inline on the current stream. 0..64.
    push_kernel: store the result rows (forward y, backward dx) into a (C, D) round buffer and copy them to
        the owners' slots with the separate push kernel, instead of storing them from the GEMM epilogue (the
        earlier path; also a test reference). The epilogue path also falls back to it when the workspace has
        no aligned slot-offset table.
    """

    pull_programs: int = 0
    comm_sms: int = 0
    push_kernel: bool = False

    def __post_init__(self) -> None:
        for name, hi in (("pull_programs", 128), ("comm_sms", 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
                raise ValueError(f"EPOptions: {name} must be an integer in [0, {hi}], got {v!r}")
        if not isinstance(self.push_kernel, bool):
            raise TypeError(f"EPOptions: push_kernel must be a bool, got {self.push_kernel!r}")
