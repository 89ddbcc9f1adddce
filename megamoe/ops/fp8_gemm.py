"""Host launchers of the block-scaled FP8 grouped GEMMs of the routed experts (validate, allocate, pick the tile
config and grid, launch; no autograd, no host sync, CUDA-graph capturable).

Formats (DeepSeek-V3 recipe, megamoe's FP8 spec): e4m3 bytes (``torch.float8_e4m3fn``) with fp32 power-of-two
*dequantization* scales, ``deq = q * s``.
  * 1x128 rows (activations, output gradients): q (rows, C) e4m3, s (rows, C / 128) fp32.
  * 128x128 weights: q (E, N, K) e4m3, s (E, N / 128, K / 128) fp32. The forward reads w[e] as (N, K) ("nt");
    the dgrad reads the same bytes as (K, N) with the scale grid transposed ("nn"), no requantization.
  * 128x1 token blocks (weight-gradient operands): q (R, C) e4m3 in the buffer's row order, s (NB, C) fp32 with
    NB >= cdiv(R, 128) + E; expert e's j-th block of 128 rows (from its first row) is scale row
    ``block_offsets[e] + j`` (block_offsets = the m-tile table for BLOCK_M = 128, ``tile_offsets_for``).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``offsets_E1[e]:offsets_E1[e+1]``; rows past
``offsets_E1[E]`` are neither read for work nor written), E experts, M / N / K GEMM sizes, all multiples of 128.

On Hopper the FP8 layer runs the Gluon twins of these GEMMs (megamoe.ops.fp8_gemm_gluon, the same bits); these
Triton kernels run everywhere else (other FP8 GPUs, the CPU interpreter) and are the Gluon kernels' bitwise
oracle. The SwiGLU passes between the GEMMs: megamoe.ops.fp8_swiglu.

GEMMs: every K-block of 128 is one dot from zero on the tensor cores, promoted into the fp32 accumulator as
``acc += p * (sa * sb)``, K-blocks in a fixed order: bitwise reproducible, batch invariant (a row's result depends
only on its own row), no atomics, no split-K. Tile configs (:func:`fp8_config`) never change bits: the
reduction order is fixed by the 128-wide K-blocks.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ..kernels.fp8_gemm import fp8_k_grouped_kernel, fp8_m_grouped_kernel
from ._common import check_device, is_interpreted, persistent_programs, pow2
from .routing import cached_tile_offsets

__all__ = ["fp8_grouped_mm_nt", "fp8_grouped_mm_nn", "fp8_k_grouped_mm", "fp8_config", "Fp8GemmConfig", "FP8_KINDS",
           "QB", "table_for"]

QB = 128  # the scale group
_E4M3 = torch.float8_e4m3fn
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """One FP8 GEMM launch config (BLOCK_K is always the scale group, 128, so no config changes bits).

    block_m / block_n: the output tile (m-grouped: block_n a multiple of 128); num_warps / num_stages: Triton's;
    programs_per_sm: the persistent m-grouped grid."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n):
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig: block sizes must be powers of two >= 16, got {self}")


# The promotion needs the fresh dot tile and the accumulator in registers at once, and Triton waits for each wgmma
# before promoting it, so the tensor cores idle during a CTA's promotion unless another CTA on the SM has a dot in
# flight: 64 x 128 tiles with one warpgroup (4 warps, ~97 KiB of shared memory at 4 stages) fit two CTAs per SM
# (programs_per_sm=2) without spills (sm_90a compiles, tests/test_fp8_gemm_compile.py). Timed on an H200 against
# other tiles for down (nt) and dx (nn) before the Gluon kernels took over Hopper (docs/perf.md).
_INTERPRET = Fp8GemmConfig(16, 128, 4, 1)
_TABLE = {
    "nt": Fp8GemmConfig(64, 128, 4, 4, programs_per_sm=2),
    "nn": Fp8GemmConfig(64, 128, 4, 3, programs_per_sm=2),
    "wgrad": Fp8GemmConfig(64, 128, 4, 3),
}
FP8_KINDS = tuple(_TABLE)


def fp8_config(kind: str, *, interpret: bool, config: Fp8GemmConfig | None = None) -> Fp8GemmConfig:
    """The tile config of an FP8 GEMM of ``kind`` ("nt", "nn": the m-grouped GEMMs, "wgrad": the k-grouped
    one; pure function); ``config`` (A/B runs) wins."""
    if kind not in _TABLE:
        raise ValueError(f"fp8_config: unknown kind {kind!r}; valid: {FP8_KINDS}")
    if interpret and config is None:
        return _INTERPRET
    cfg = config or _TABLE[kind]
    if not isinstance(cfg, Fp8GemmConfig):
        raise TypeError(f"fp8_config: config must be an Fp8GemmConfig, got {type(cfg).__name__}")
    if kind != "wgrad" and cfg.block_n % QB:
        raise ValueError(f"fp8_config: {kind} needs block_n a multiple of 128, got {cfg}")
    return cfg


def _check_q(where: str, name: str, q: torch.Tensor, dims: int, dtype=_E4M3, *, any_strides: bool = False) -> None:
    """A dims-D tensor of dtype: contiguous, or with any_strides any (non-negative) strides, e.g. a transposed
    view (the kernels address every element through its strides; a K-major layout is the fast one)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != dims or q.dtype != dtype:
        raise ValueError(f"{where}: {name} must be a {dims}-D {dtype} tensor, got {q.dtype} {tuple(q.shape)}")
    if not (q.is_contiguous() or (any_strides and min(q.stride(), default=0) >= 0)):
        raise ValueError(f"{where}: {name} must be contiguous, strides {q.stride()}")


def _check_mult(where: str, **sizes: int) -> None:
    bad = {k: v for k, v in sizes.items() if v % QB}
    if bad:
        raise ValueError(f"{where}: FP8 block scaling needs multiples of 128, got {bad}")


def _check_rows(where: str, aq, as_, K: int) -> int:
    """A's bytes (R, K) and 1x128 scales (R, K / 128); returns R."""
    _check_q(where, "aq", aq, 2)
    _check_q(where, "as_", as_, 2, torch.float32)
    if aq.shape[1] != K or tuple(as_.shape) != (aq.shape[0], K // QB):
        raise ValueError(f"{where}: aq must be (., {K}) with scales (., {K // QB}), got {tuple(aq.shape)} and "
                         f"{tuple(as_.shape)}")
    return aq.shape[0]


def _check_weight(where: str, wq, ws, name: str) -> tuple[int, int, int]:
    _check_q(where, f"{name}q", wq, 3, any_strides=True)
    _check_q(where, f"{name}s", ws, 3, torch.float32, any_strides=True)
    E, A, B = wq.shape
    _check_mult(where, **{f"{name}q.shape[1]": A, f"{name}q.shape[2]": B})
    if tuple(ws.shape) != (E, A // QB, B // QB):
        raise ValueError(f"{where}: {name}s must be ({E}, {A // QB}, {B // QB}), got {tuple(ws.shape)}")
    return E, A, B


def _check_offsets(where: str, offsets_E1: torch.Tensor, E: int) -> None:
    if offsets_E1.dtype != torch.int32 or tuple(offsets_E1.shape) != (E + 1,):
        raise ValueError(f"{where}: offsets_E1 must be int32 of shape ({E + 1},), got {offsets_E1.dtype} "
                         f"{tuple(offsets_E1.shape)}")


def _check_out_dtype(where: str, dtype: torch.dtype) -> None:
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"{where}: out_dtype {dtype} not supported (bf16, fp16, fp32)")


def table_for(offsets_E1: torch.Tensor, block_m: int, tile_cache: dict | None) -> torch.Tensor:
    """The m-tile table of ``offsets_E1`` for ``block_m``, through ``tile_cache`` (the bf16 launchers' key, so
    one dict can serve both; valid while the offsets' values do not change)."""
    return cached_tile_offsets(offsets_E1, block_m, tile_cache)


def _launch_m(*, kind, a, sa, b, sb, nt, R, N, K, offsets_E1, c, tile_cache=None, config=None) -> None:
    """Launch the persistent FP8 m-grouped kernel. nt: B and its scale grid are (E, N, K) (else (E, K, N)), any
    strides."""
    strides_b = b.stride() if nt else (b.stride(0), b.stride(2), b.stride(1))
    strides_sb = sb.stride() if nt else (sb.stride(0), sb.stride(2), sb.stride(1))
    kernel = fp8_m_grouped_kernel
    interpret = is_interpreted(kernel)
    cfg = fp8_config(kind, interpret=interpret, config=config)
    if R == 0 or N == 0:
        return
    E = b.shape[0]
    tiles = table_for(offsets_E1, cfg.block_m, tile_cache)
    bound = (triton.cdiv(R, cfg.block_m) + E) * triton.cdiv(N, cfg.block_n)
    grid = (persistent_programs(a.device, kernel, bound, cfg.programs_per_sm),)
    kernel[grid](
        a, sa, b, sb, offsets_E1, tiles, c, R, N, E, K, a.stride(0), sa.stride(0), *strides_b, *strides_sb,
        c.stride(0), FP32_DOT=interpret, EVEN_N=N % cfg.block_n == 0, E_POW2=pow2(E), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True,
    )


def _m_grouped(where, aq, as_, bq, bs, offsets_E1, *, nt, out_dtype, tile_cache, config) -> torch.Tensor:
    """Check, allocate and launch an m-grouped GEMM: (R, N) in out_dtype."""
    E, A, B = _check_weight(where, bq, bs, "b")
    N, K = (A, B) if nt else (B, A)
    R = _check_rows(where, aq, as_, K)
    _check_offsets(where, offsets_E1, E)
    _check_out_dtype(where, out_dtype)
    dev = check_device(fp8_m_grouped_kernel, where, aq=aq, as_=as_, bq=bq, bs=bs, offsets_E1=offsets_E1)
    c = torch.empty((R, N), dtype=out_dtype, device=dev)
    _launch_m(kind="nt" if nt else "nn", a=aq, sa=as_, b=bq, sb=bs, nt=nt, R=R, N=N, K=K, offsets_E1=offsets_E1,
              c=c, tile_cache=tile_cache, config=config)
    return c


def fp8_grouped_mm_nt(aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor,
                      offsets_E1: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                      tile_cache: dict | None = None, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """FP8 m-grouped ``C[r] = cast(deq(A)[r] @ deq(B)[e]^T)``, B[e] stored (N, K): the gate/up projection (A = x rows
    (R, D), B = w13q (E, 2F, D)) and the down projection (A = hq (R, F), B = w2q (E, D, F)).

    aq, as_: (R, K) e4m3 + (R, K / 128) fp32. bq, bs: (E, N, K) e4m3 + (E, N / 128, K / 128) fp32, any strides.
    offsets_E1: (E + 1,) int32 device group offsets into the R rows. tile_cache: a dict shared by the GEMMs of one
    set of offsets (m-tile tables computed once). config: tile override (A/B runs). Returns (R, N) in out_dtype
    (bf16, fp16 or fp32; rows past ``offsets_E1[E]`` not written).
    """
    return _m_grouped("fp8_grouped_mm_nt", aq, as_, bq, bs, offsets_E1, nt=True, out_dtype=out_dtype,
                      tile_cache=tile_cache, config=config)


def fp8_grouped_mm_nn(aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor,
                      offsets_E1: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                      tile_cache: dict | None = None, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """FP8 m-grouped dgrad ``C[r] = cast(deq(A)[r] @ deq(B)[e])``, B[e] stored (K, N), its 128x128 scale grid read
    transposed (the dgrad of the down projection: A = dout rows (R, D), B = w2q (E, D, F), fp32 out; dx rows = dgu
    @ w13[e]: A = dgq (R, 2F), B = w13q (E, 2F, D)): the forward's bytes, no requantization.

    aq, as_: (R, K) e4m3 + (R, K / 128) fp32. bq, bs: (E, K, N) e4m3 + (E, K / 128, N / 128) fp32, any strides: the
    forward's contiguous (E, K, N) bytes (N-major B tiles), or ``t.transpose(1, 2)`` of a contiguous (E, N, K) copy
    (K-major, the layout the FP8 tensor cores read directly). Returns (R, N) as :func:`fp8_grouped_mm_nt`.
    """
    return _m_grouped("fp8_grouped_mm_nn", aq, as_, bq, bs, offsets_E1, nt=False, out_dtype=out_dtype,
                      tile_cache=tile_cache, config=config)


def fp8_k_grouped_mm(pq: torch.Tensor, ps: torch.Tensor, qq: torch.Tensor, qs: torch.Tensor,
                     offsets_E1: torch.Tensor, *, block_offsets_E1: torch.Tensor | None = None,
                     padded: bool = False, out_dtype: torch.dtype = torch.float32, tile_cache: dict | None = None,
                     config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """FP8 k-grouped weight gradient on 128x1-quantized operands:
    ``C[e] = cast(sum over expert e's blocks b of (deq P_b)^T @ deq Q_b)`` (E, M, N), fp32 accumulation, one cast.

    Args:
        pq, ps: (R, M) e4m3 in the buffer's row order + (NB, M) fp32 scales, NB >= cdiv(R, 128) + E. pq (and qq)
            may have any strides, e.g. ``t.t()`` of a (M, R) copy (rows contiguous: the K-major layout of this GEMM).
        qq, qs: (R, N) e4m3 + (NB, N) fp32.
        padded: the operands are block-padded instead: block b is rows [128b, 128b + 128) of pq / qq, (NB * 128,
            M) / (NB * 128, N), zeros past each expert's rows (nothing masked; stored transposed, e.g.
            ``buf.t()`` of a (M, NB * 128) buffer, this is the layout the FP8 tensor cores read directly; what
            ``megamoe.ops.fp8_quant.quantize_128x1_grouped(..., kmajor=True)`` writes).
        offsets_E1: (E + 1,) int32 group offsets into the R rows.
        block_offsets_E1: optional (E + 1,) int32 block table (``tile_offsets_for(offsets_E1, 128)``; computed,
            or taken from ``tile_cache``, when None).
        out_dtype: the weight's dtype (bf16, fp16) or fp32.
    Determinism: each output reduces its expert's 128-row blocks in order from the expert's first row; no atomics,
    no split-K; an expert with no rows gets exact zeros. Sync: none.
    """
    where = "fp8_k_grouped_mm"
    for name, t, dt in (("pq", pq, _E4M3), ("ps", ps, torch.float32), ("qq", qq, _E4M3), ("qs", qs, torch.float32)):
        _check_q(where, name, t, 2, dt, any_strides=dt == _E4M3)
    if not isinstance(offsets_E1, torch.Tensor) or offsets_E1.dtype != torch.int32 or offsets_E1.dim() != 1 or (
            offsets_E1.numel() < 2):
        raise ValueError(f"{where}: offsets_E1 must be a 1-D int32 tensor of E+1 >= 2 entries")
    E = offsets_E1.numel() - 1
    R, M = pq.shape
    N = qq.shape[1]
    nb = ps.shape[0] if padded else triton.cdiv(R, QB) + E
    if padded and (R != QB * nb or qs.shape[0] != nb):
        raise ValueError(f"{where}: padded operands need pq, qq of 128 * NB rows and ps, qs of NB rows; got pq "
                         f"{tuple(pq.shape)}, ps {tuple(ps.shape)}, qs {tuple(qs.shape)}")
    if qq.shape[0] != R or ps.shape[1] != M or qs.shape[1] != N or ps.shape[0] < nb or qs.shape[0] < nb:
        raise ValueError(f"{where}: need pq (R, M), qq (R, N), ps (>= {nb}, M), qs (>= {nb}, N); got pq "
                         f"{tuple(pq.shape)}, qq {tuple(qq.shape)}, ps {tuple(ps.shape)}, qs {tuple(qs.shape)}")
    if block_offsets_E1 is not None:
        _check_offsets(where, block_offsets_E1, E)
    _check_out_dtype(where, out_dtype)
    dev = check_device(fp8_k_grouped_kernel, where, pq=pq, ps=ps, qq=qq, qs=qs, offsets_E1=offsets_E1,
                       block_offsets_E1=block_offsets_E1)
    kernel = fp8_k_grouped_kernel
    interpret = is_interpreted(kernel)
    cfg = fp8_config("wgrad", interpret=interpret, config=config)
    c = torch.empty((E, M, N), dtype=out_dtype, device=dev)
    if c.numel() == 0:
        return c
    if R == 0:
        return c.zero_()
    if block_offsets_E1 is None:
        block_offsets_E1 = table_for(offsets_E1, QB, tile_cache)
    grid = (E * triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    kernel[grid](
        pq, ps, qq, qs, offsets_E1, block_offsets_E1, c, M, N,
        pq.stride(0), pq.stride(1), ps.stride(0), qq.stride(0), qq.stride(1), qs.stride(0), c.stride(0), c.stride(1),
        FP32_DOT=interpret, INTERPRET=interpret, PADDED=padded, EVEN_M=M % cfg.block_m == 0,
        EVEN_N=N % cfg.block_n == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=True,
    )
    return c

