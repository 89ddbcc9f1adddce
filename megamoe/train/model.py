"""A small byte-level decoder whose FFNs are ``megamoe.MoE`` layers, and its size presets.

Legend: B sequences, S sequence length, D model width, V vocabulary (256 bytes), Hd head dim,
nH heads, C virtual-rank chunks (see ``GPT.forward``).

Architecture (pre-norm, as in Llama / DeepSeek-V3): token embedding -> n_layer x [x += attn(norm(x));
x += moe(norm(x))] -> norm -> untied LM head. RMSNorm (Zhang & Sennrich, arXiv 1910.07467) in fp32;
rotary position embedding (Su et al., arXiv 2104.09864, "rotate half" form); causal attention through
``torch.nn.functional.scaled_dot_product_attention``. Every FFN is a DeepSeek-V3 MoE layer (router with
group-limited sigmoid routing, aux-loss-free bias, shared expert; see ``megamoe.reference``).

Attention and reproducibility (``GPT(attention=...)``, ``--attention``): PyTorch's fused attention kernels
(cuDNN, flash, memory-efficient) use a non-deterministic backward unless deterministic algorithms are on
*without* ``warn_only`` (torch 2.11 and 2.15, aten/src/ATen/native/transformers: with ``warn_only=True``
each of the three only warns "... defaults to a non-deterministic algorithm"; in strict mode SDPA no
longer selects cuDNN, flash runs its deterministic backward and memory-efficient attention one key
split; the math backend is deterministic either way). Strict mode for the whole step is not an option:
it also makes ops without a deterministic version raise (``nll_loss`` on CUDA among them). So:

* ``"deterministic"`` (the default): on CUDA, flash attention whose backward alone runs in strict mode
  (:class:`FlashDeterministic`); where flash cannot take the inputs, the math backend; on CPU, SDPA's own
  choice (CPU kernels are deterministic). Two runs from one seed give the same bits.
* ``"fast"``: SDPA's own choice (cuDNN on an H200 with torch 2.11), non-deterministic backward.

``Attention.path`` names the path the last forward took (the run summary prints it).

Precision: dense parameters are fp32 (bf16 autocast on GPU, set by the training loop); expert weights
live in ``MoEConfig.dtype``. The MoE layer always runs with autocast disabled: it gets the fp32
normalised activations, casts them to its own dtype itself and returns fp32, so its router math stays
fp32 and the reference and fused backends see identical inputs.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F_
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import PRESETS, MoEConfig, get_preset
from .data import VOCAB_SIZE

__all__ = ["ATTENTION_MODES", "GPT", "MODEL_PRESETS", "FlashDeterministic", "ModelConfig", "get_model_preset",
           "strict_determinism"]

ATTENTION_MODES = ("deterministic", "fast")


@dataclass(frozen=True)
class ModelConfig:
    """A model size plus the training defaults that go with it (one ``--preset`` dial).

    n_layer decoder blocks of width D = ``moe.hidden_size`` with n_head heads; every FFN is an MoE with
    config ``moe``. seq_len / batch_size (per rank) / steps / lr / warmup are the training defaults,
    each overridable from the command line.
    """

    name: str
    n_layer: int
    n_head: int
    moe: MoEConfig
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int = 20
    weight_decay: float = 0.1
    eval_every: int = 50
    eval_batches: int = 4
    vocab_size: int = VOCAB_SIZE
    rope_base: float = 10000.0
    note: str = field(default="", compare=False)

    @property
    def d_model(self) -> int:
        return self.moe.hidden_size

    def __post_init__(self) -> None:
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(f"ModelConfig {self.name}: D={self.d_model} must split into {self.n_head} heads "
                             "of even size")

    def replace(self, **changes) -> ModelConfig:
        return replace(self, **changes)


def _moe(D: int, F: int, E: int, K: int, n_group: int, topk_group: int) -> MoEConfig:
    # Router settings follow megamoe's "small" preset (DeepSeek-V3 style: sigmoid, scaling 2.5, one
    # shared expert, aux-loss-free bias gamma 1e-3, sequence-wise balance loss alpha 1e-3).
    return get_preset("small").replace(hidden_size=D, moe_intermediate_size=F, num_experts=E, top_k=K,
                                       n_group=n_group, topk_group=topk_group, dtype=torch.float32)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Test-suite size: a few seconds for a few steps on one CPU thread.
    "lm-tiny": ModelConfig("lm-tiny", n_layer=1, n_head=2, moe=_moe(64, 32, 8, 2, 2, 1), seq_len=32, batch_size=4,
                           steps=30, lr=3e-3, warmup=5, eval_every=10, eval_batches=2,
                           note="tests / CI"),
    # CPU default: about 3 minutes on 2 cores with the reference backend.
    "lm-mini": ModelConfig("lm-mini", n_layer=3, n_head=4, moe=_moe(128, 128, 8, 2, 2, 1), seq_len=256,
                           batch_size=16, steps=400, lr=3e-3, warmup=20, eval_every=100, eval_batches=4,
                           note="CPU default"),
    # One-GPU default (fused backend, bf16 experts).
    "lm-small": ModelConfig("lm-small", n_layer=6, n_head=8, moe=_moe(512, 256, 32, 4, 4, 2), seq_len=512,
                            batch_size=32, steps=600, lr=2e-3, warmup=50, eval_every=100, eval_batches=8,
                            note="GPU default"),
    "lm-medium": ModelConfig("lm-medium", n_layer=8, n_head=8, moe=_moe(1024, 512, 64, 6, 8, 4), seq_len=1024,
                             batch_size=32, steps=1000, lr=1.5e-3, warmup=100, eval_every=200, eval_batches=8,
                             note="GPU, a few minutes"),
    "lm-large": ModelConfig("lm-large", n_layer=8, n_head=16, moe=_moe(2048, 1024, 64, 6, 8, 4), seq_len=1024,
                            batch_size=32, steps=2000, lr=1e-3, warmup=200, eval_every=250, eval_batches=8,
                            note="GPU / EP, tens of minutes"),
}


def get_model_preset(name: str) -> ModelConfig:
    """The named model preset (``lm-*``: the training demo's language models, named apart from the MoE layer
    presets of ``megamoe.get_preset``). Raises ValueError listing the valid names."""
    if name not in MODEL_PRESETS:
        hint = f" ({name!r} is an MoE layer preset of megamoe.get_preset, not a model)" if name in PRESETS else ""
        if f"lm-{name}" in MODEL_PRESETS:
            hint += f" (did you mean 'lm-{name}'?)"
        raise ValueError(f"--preset: unknown model preset {name!r}{hint}; valid: {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang_SH = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    ang_SH = torch.cat([ang_SH, ang_SH], dim=-1)
    return ang_SH.cos().float(), ang_SH.sin().float()


def _rotate(x_BnSH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    half = x_BnSH.shape[-1] // 2
    rot = torch.cat([-x_BnSH[..., half:], x_BnSH[..., :half]], dim=-1)
    return (x_BnSH.float() * cos_SH + rot.float() * sin_SH).to(x_BnSH.dtype)


@contextmanager
def strict_determinism(warn_only: bool = False):
    """``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` inside the block, restored after;
    no NaN fill of new tensors (the flag would turn it on; the kernels below write all of their outputs)."""
    import torch.utils.deterministic as det
    old = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])
        det.fill_uninitialized_memory = old[2]


class FlashDeterministic(torch.autograd.Function):
    """Causal attention through SDPA's flash backend whose backward runs in :func:`strict_determinism`
    (PyTorch's flash backward then reduces dQ in a fixed order instead of with atomics); the forward is
    SDPA's flash forward, unchanged. q, k, v: [B, nH, S, Hd]. The flag is process-wide while the backward
    of this node runs (the caller's thread waits in ``backward()`` meanwhile)."""

    @staticmethod
    def forward(ctx, q, k, v):
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F_.scaled_dot_product_attention(*leaves, is_causal=True)
        ctx.graph = (leaves, o)
        return o.detach()

    @staticmethod
    def backward(ctx, do):
        leaves, o = ctx.graph
        del ctx.graph
        with strict_determinism():
            return torch.autograd.grad(o, leaves, do)


def _flash_fits(q, k, v) -> bool:
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False)
    return torch.backends.cuda.can_use_flash_attention(params)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions, through SDPA (``attention``: see the module
    docstring; ``path`` names what the last forward ran)."""

    def __init__(self, cfg: ModelConfig, attention: str = "deterministic"):
        super().__init__()
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        D = cfg.d_model
        self.n_head = cfg.n_head
        self.attention = attention
        self.path = None
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)

    def _attend(self, q, k, v):
        if self.attention == "fast" or not q.is_cuda:
            self.path = ("SDPA's choice, non-deterministic backward" if q.is_cuda else "SDPA (CPU, deterministic)")
            return F_.scaled_dot_product_attention(q, k, v, is_causal=True)
        if _flash_fits(q, k, v):
            self.path = "flash, deterministic backward"
            if not torch.is_grad_enabled():  # evaluation: the same flash forward, no graph to keep
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F_.scaled_dot_product_attention(q, k, v, is_causal=True)
            return FlashDeterministic.apply(q, k, v)
        self.path = "math (deterministic)"
        with sdpa_kernel(SDPBackend.MATH):
            return F_.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x_BSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos_SH[:S], sin_SH[:S]), _rotate(k, cos_SH[:S], sin_SH[:S])
        o_BnSH = self._attend(q, k, v)
        return self.proj(o_BnSH.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    """Pre-norm block: x += attn(norm(x)); x += moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, moe: nn.Module, attention: str = "deterministic"):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, attention)
        self.moe_norm = RMSNorm(cfg.d_model)
        self.moe = moe


def _chunked(fn, x: torch.Tensor, chunks: int) -> torch.Tensor:
    """fn applied to ``chunks`` equal slices of the batch dim, concatenated (same per-chunk shapes)."""
    if chunks == 1:
        return fn(x)
    return torch.cat([fn(c) for c in x.chunk(chunks, dim=0)], dim=0)


class GPT(nn.Module):
    """Byte-level MoE decoder.

    Args:
        cfg: the model preset. moe_factory(layer_index) -> nn.Module: builds each block's FFN (a
            ``megamoe.MoE``), so the caller decides backend, EP group and init seed.
        seed: init seed of the dense parameters (normal, std 0.02; output projections std
            0.02 / sqrt(2 n_layer) as in GPT-2), drawn from a CPU generator so every device and rank
            starts from the same bits.
        attention: "deterministic" (default) or "fast" (see the module docstring).

    ``forward(idx_BS, chunks=1) -> logits_BSV`` (fp32 or the autocast dtype). With ``chunks = C > 1``
    every dense (non-MoE) computation runs separately on C equal slices of the batch while each MoE
    layer sees the whole batch: an EP=1 process then computes exactly what the C ranks of an EP=C run
    compute on their own slices (same GEMM shapes, hence the same bits), which ``--check`` relies on.
    """

    def __init__(self, cfg: ModelConfig, moe_factory, *, seed: int = 0, attention: str = "deterministic"):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.blocks = nn.ModuleList(Block(cfg, moe_factory(i), attention) for i in range(cfg.n_layer))
        self.norm = RMSNorm(D)
        self.head = nn.Linear(D, cfg.vocab_size, bias=False)
        cos_SH, sin_SH = _rope_tables(cfg.seq_len, D // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos_SH", cos_SH, persistent=False)
        self.register_buffer("rope_sin_SH", sin_SH, persistent=False)
        self._init_dense(seed)

    @torch.no_grad()
    def _init_dense(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.dense_named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = out_std if name.endswith("proj.weight") else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)

    def moe_layers(self) -> list[nn.Module]:
        return [b.moe for b in self.blocks]

    def attention_path(self) -> str | None:
        """What the attention of the last forward ran (``Attention.path``), None before any forward."""
        return self.blocks[0].attn.path if len(self.blocks) else None

    def dense_named_parameters(self):
        """(name, parameter) of everything outside the MoE layers (replicated under EP)."""
        return [(n, p) for n, p in self.named_parameters() if ".moe." not in n]

    def forward(self, idx_BS: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        if idx_BS.shape[1] > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence length {idx_BS.shape[1]} > preset seq_len {self.cfg.seq_len}")
        if idx_BS.shape[0] % chunks:
            raise ValueError(f"GPT: batch {idx_BS.shape[0]} is not divisible into {chunks} chunks")
        cos_SH, sin_SH = self.rope_cos_SH, self.rope_sin_SH
        x_BSD = self.embed(idx_BS).float()
        for blk in self.blocks:
            # the lambda runs inside _chunked, before blk moves on
            x_BSD = x_BSD + _chunked(lambda c: blk.attn(blk.attn_norm(c), cos_SH, sin_SH), x_BSD, chunks)  # noqa: B023
            h_BSD = _chunked(blk.moe_norm, x_BSD, chunks)
            with torch.autocast(device_type=x_BSD.device.type, enabled=False):
                x_BSD = x_BSD + blk.moe(h_BSD).float()
        return _chunked(lambda c: self.head(self.norm(c)), x_BSD, chunks)
