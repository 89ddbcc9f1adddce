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
``offsets_E1[E]`` are neither read for work nor written), T token rows gathered through ``gather_idx_R``,
E experts, D hidden size, F expert FFN size (G = 2F), B = D / 128 or F / 128 scale blocks, P = F / 128
row-dot partials; M / N / K generic GEMM sizes, all multiples of 128.

GEMMs: every K-block of 128 is one dot from zero on the tensor cores, promoted into the fp32 accumulator as
``acc += p * (sa * sb)``, K-blocks in a fixed order: bitwise reproducible, batch invariant (a row's result depends
only on its own row), no atomics, no split-K. Tile configs (:func:`fp8_config`) never change bits: the
reduction order is fixed by the 128-wide K-blocks.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ..kernels.fp8_gemm import fp8_k_grouped_kernel, fp8_m_grouped_kernel, swiglu_bwd_rows_kernel, swiglu_rows_kernel
from ._common import check_device, check_row_count, is_interpreted, persistent_programs, pow2
from .routing import cached_tile_offsets

__all__ = ["fp8_gate_up_swiglu", "fp8_grouped_mm_nt", "fp8_grouped_mm_nn", "fp8_swiglu_dgrad", "fp8_swiglu",
           "fp8_swiglu_bwd", "fp8_k_grouped_mm", "fp8_config", "Fp8GemmConfig", "FP8_KINDS", "QB"]

QB = 128  # the scale group
_ROWS, _ROWS_INTERPRET = 32, 16  # rows per program of the SwiGLU passes on a plain GEMM's output
_PLAIN, _SWIGLU, _SWIGLU_BWD = 0, 1, 2
_E4M3 = torch.float8_e4m3fn
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)



@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """One FP8 GEMM launch config (BLOCK_K is always the scale group, 128, so no config changes bits).

    block_m / block_n: the output tile (m-grouped: block_n a multiple of 128, at most 256 with a SwiGLU
    epilogue); num_warps / num_stages: Triton's; programs_per_sm: the persistent m-grouped grid."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n):
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig: block sizes must be powers of two >= 16, got {self}")


# First table, from sm_90a compiles on the CPU (Triton 3.6's ptxas; not yet timed): the promotion needs the fresh dot
# tile and the accumulator in registers at once, and Triton waits for each wgmma before promoting it, so the tensor
# cores idle during a CTA's promotion unless another CTA on the SM has a dot in flight. 64 x 128 tiles with one
# warpgroup (4 warps) use 208 registers and ~97 KiB of shared memory (4 stages): two CTAs per SM
# (programs_per_sm=2; 239 registers with the one-FMA promotion of 128-column tiles), no spills; 128 x 128 with 8
# warps uses ~222 registers (one CTA per SM); 128 x 256 spills.
# gate/up (two accumulators) and dgrad + SwiGLU backward (its epilogue): 64 x 128 with 8 warps (each warpgroup
# 64 x 64) does not spill, 128 x 128 spills (416 / 132 bytes), as do 4 warps. To be measured:
# scripts/fp8_gemm_bench.py --sweep.
_INTERPRET = Fp8GemmConfig(16, 128, 4, 1)
_TABLE = {
    "gate_up": Fp8GemmConfig(64, 128, 8, 3),
    "down": Fp8GemmConfig(64, 128, 4, 4, programs_per_sm=2),
    "dgrad_swiglu": Fp8GemmConfig(64, 128, 4, 4, programs_per_sm=2),
    "dgrad": Fp8GemmConfig(64, 128, 4, 3, programs_per_sm=2),
    "wgrad": Fp8GemmConfig(64, 128, 4, 3),
}
FP8_KINDS = tuple(_TABLE)


def fp8_config(kind: str, *, interpret: bool, config: Fp8GemmConfig | None = None) -> Fp8GemmConfig:
    """The tile config of an FP8 GEMM of ``kind`` (pure function); ``config`` (sweeps, A/B runs) wins."""
    if kind not in _TABLE:
        raise ValueError(f"fp8_config: unknown kind {kind!r}; valid: {FP8_KINDS}")
    if interpret and config is None:
        return _INTERPRET
    cfg = config or _TABLE[kind]
    if not isinstance(cfg, Fp8GemmConfig):
        raise TypeError(f"fp8_config: config must be an Fp8GemmConfig, got {type(cfg).__name__}")
    if kind != "wgrad" and (cfg.block_n % QB or (kind in ("gate_up", "dgrad_swiglu") and cfg.block_n > 2 * QB)):
        raise ValueError(f"fp8_config: {kind} needs block_n a multiple of 128 (<= 256 with a SwiGLU epilogue), "
                         f"got {cfg}")
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


def _check_rows(where: str, xq, xs, K: int, gather_idx_R, name: str = "a") -> int:
    """A's bytes (., K) and 1x128 scales (., K / 128); returns R (A's rows, or gather_idx_R's length)."""
    _check_q(where, f"{name}q", xq, 2)
    _check_q(where, f"{name}s", xs, 2, torch.float32)
    if xq.shape[1] != K or tuple(xs.shape) != (xq.shape[0], K // QB):
        raise ValueError(f"{where}: {name}q must be (., {K}) with scales (., {K // QB}), got {tuple(xq.shape)} and "
                         f"{tuple(xs.shape)}")
    if gather_idx_R is None:
        return xq.shape[0]
    if gather_idx_R.dim() != 1 or gather_idx_R.dtype != torch.int32:
        raise TypeError(f"{where}: gather_idx_R must be a 1-D int32 tensor, got {gather_idx_R.dtype} "
                        f"{tuple(gather_idx_R.shape)}")
    return gather_idx_R.shape[0]


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


def _check_row_scale(where: str, row_scale_R, R: int) -> None:
    if row_scale_R is not None and (tuple(row_scale_R.shape) != (R,) or row_scale_R.dtype != torch.float32):
        raise ValueError(f"{where}: row_scale_R must be fp32 of shape ({R},)")


def _check_out_dtype(where: str, dtype: torch.dtype) -> None:
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"{where}: out_dtype {dtype} not supported (bf16, fp16, fp32)")


def table_for(offsets_E1: torch.Tensor, block_m: int, tile_cache: dict | None) -> torch.Tensor:
    """The m-tile table of ``offsets_E1`` for ``block_m``, through ``tile_cache`` (the bf16 launchers' key, so
    one dict can serve both; valid while the offsets' values do not change)."""
    return cached_tile_offsets(offsets_E1, block_m, tile_cache)


def _launch_m(*, kind, epilogue, a, sa, a_idx, b, sb, nt, R, N, K, offsets_E1, c=None, aux=None, dot=None, q=None,
              qs=None, scale=None, gu=None, save_aux=None, tile_cache=None, config=None) -> None:
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
    dummy = next(t for t in (c, aux, q) if t is not None)
    kernel[grid](
        a, sa, a_idx if a_idx is not None else offsets_E1, b, sb, offsets_E1, tiles,
        scale if scale is not None else dummy, gu if gu is not None else dummy,
        c if c is not None else dummy, aux if aux is not None else dummy, dot if dot is not None else dummy,
        q.view(torch.uint8) if q is not None else dummy, qs if qs is not None else dummy,
        R, N, E, K,
        a.stride(0), sa.stride(0), *strides_b, *strides_sb,
        c.stride(0) if c is not None else 0, gu.stride(0) if gu is not None else 0,
        aux.stride(0) if aux is not None else 0, q.stride(0) if q is not None else 0,
        qs.stride(0) if qs is not None else 0,
        EPILOGUE=epilogue, HAS_GATHER=a_idx is not None, HAS_SCALE=scale is not None,
        SAVE_AUX=aux is not None if save_aux is None else save_aux,
        HAS_DOT=dot is not None, FP32_DOT=interpret, HW_CAST=not interpret, EVEN_N=N % cfg.block_n == 0,
        E_POW2=pow2(E), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True,
    )


def fp8_gate_up_swiglu(xq: torch.Tensor, xs: torch.Tensor, w13q: torch.Tensor, w13s: torch.Tensor,
                       offsets_E1: torch.Tensor, *, gather_idx_R: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.bfloat16, save_preact: bool = True,
                       tile_cache: dict | None = None, config: Fp8GemmConfig | None = None):
    """FP8 gate/up projection with SwiGLU and the 1x128 quantization of h fused (m-grouped "nt").

    ``acc = deq(x)[row(r)] @ deq(w13)[e]^T`` (fp32, promoted every 128 of K); ``g, u = cast(acc)`` in out_dtype;
    ``h = cast(silu(g) * u)`` (the bf16 path's bits for the same accumulators); ``hq, hs = quant_1x128(h)``.

    Args:
        xq, xs: (R, D) e4m3 and (R, D / 128) fp32, or (T, ...) token rows with gather_idx_R (R,) int32.
        w13q, w13s: (E, 2F, D) e4m3 and (E, 2F / 128, D / 128) fp32; rows [0, F) gate, [F, 2F) up.
        offsets_E1: (E + 1,) int32 device group offsets into the R rows.
        out_dtype: the dtype of g, u and h (the layer's dtype). save_preact: also return [g | u].
        tile_cache: a dict shared by the GEMMs of one set of offsets (m-tile tables computed once).
        config: tile override (sweeps); the table's otherwise.
    Returns:
        hq_RF (R, F) e4m3, hs_RB (R, F / 128) fp32, gu_RG (R, 2F) out_dtype or None.
    """
    where = "fp8_gate_up_swiglu"
    E, G, D = _check_weight(where, w13q, w13s, "w13")
    R = _check_rows(where, xq, xs, D, gather_idx_R, "x")
    _check_offsets(where, offsets_E1, E)
    _check_out_dtype(where, out_dtype)
    dev = check_device(fp8_m_grouped_kernel, where, xq=xq, xs=xs, w13q=w13q, w13s=w13s, offsets_E1=offsets_E1,
                       gather_idx_R=gather_idx_R)
    F = G // 2
    _check_mult(where, F=F)
    hq = torch.empty((R, F), dtype=_E4M3, device=dev)
    hs = torch.empty((R, F // QB), dtype=torch.float32, device=dev)
    # without save_preact the kernel stores no [g | u]; a 0-row tensor carries the output dtype
    gu = torch.empty((R if save_preact else 0, G), dtype=out_dtype, device=dev)
    _launch_m(kind="gate_up", epilogue=_SWIGLU, a=xq, sa=xs, a_idx=gather_idx_R, b=w13q, sb=w13s, nt=True, R=R, N=F,
              K=D, offsets_E1=offsets_E1, aux=gu, save_aux=save_preact, q=hq, qs=hs, tile_cache=tile_cache,
              config=config)
    return hq, hs, gu if save_preact else None


def fp8_grouped_mm_nt(aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor,
                      offsets_E1: torch.Tensor, *, gather_idx_R: torch.Tensor | None = None,
                      row_scale_R: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                      kind: str = "down", tile_cache: dict | None = None,
                      config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """FP8 m-grouped ``C[r] = cast(deq(A)[row(r)] @ deq(B)[e]^T [* row_scale[r]])``, B[e] stored (N, K) (the down
    projection: A = hq (R, F), B = w2q (E, D, F)).

    aq, as_: (R, K) e4m3 + (R, K / 128) fp32 (or token rows with gather_idx_R (R,) int32). bq, bs: (E, N, K) e4m3 +
    (E, N / 128, K / 128) fp32. row_scale_R: optional (R,) fp32 applied to the fp32 accumulator before the one
    cast. Returns (R, N) in out_dtype.
    """
    where = "fp8_grouped_mm_nt"
    E, N, K = _check_weight(where, bq, bs, "b")
    R = _check_rows(where, aq, as_, K, gather_idx_R)
    _check_offsets(where, offsets_E1, E)
    _check_row_scale(where, row_scale_R, R)
    _check_out_dtype(where, out_dtype)
    dev = check_device(fp8_m_grouped_kernel, where, aq=aq, as_=as_, bq=bq, bs=bs, offsets_E1=offsets_E1,
                       gather_idx_R=gather_idx_R, row_scale_R=row_scale_R)
    c = torch.empty((R, N), dtype=out_dtype, device=dev)
    _launch_m(kind=kind, epilogue=_PLAIN, a=aq, sa=as_, a_idx=gather_idx_R, b=bq, sb=bs, nt=True, R=R, N=N, K=K,
              offsets_E1=offsets_E1, c=c,
              scale=row_scale_R, tile_cache=tile_cache, config=config)
    return c


def fp8_grouped_mm_nn(aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor,
                      offsets_E1: torch.Tensor, *, gather_idx_R: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16, tile_cache: dict | None = None,
                      config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """FP8 m-grouped dgrad ``C[r] = cast(deq(A)[row(r)] @ deq(B)[e])``, B[e] stored (K, N), its 128x128 scale grid
    read transposed (dx rows = dgu @ w13[e]: A = dgq (R, 2F), B = w13q (E, 2F, D), the forward's bytes).

    aq, as_: (R, K) e4m3 + (R, K / 128) fp32. bq, bs: (E, K, N) e4m3 + (E, K / 128, N / 128) fp32, any strides: the
    forward's contiguous (E, K, N) bytes (N-major B tiles), or ``t.transpose(1, 2)`` of a contiguous (E, N, K) copy
    (K-major, the layout the FP8 tensor cores read directly). Returns (R, N).
    """
    where = "fp8_grouped_mm_nn"
    E, K, N = _check_weight(where, bq, bs, "b")
    R = _check_rows(where, aq, as_, K, gather_idx_R)
    _check_offsets(where, offsets_E1, E)
    _check_out_dtype(where, out_dtype)
    dev = check_device(fp8_m_grouped_kernel, where, aq=aq, as_=as_, bq=bq, bs=bs, offsets_E1=offsets_E1,
                       gather_idx_R=gather_idx_R)
    c = torch.empty((R, N), dtype=out_dtype, device=dev)
    _launch_m(kind="dgrad", epilogue=_PLAIN, a=aq, sa=as_, a_idx=gather_idx_R, b=bq, sb=bs, nt=False, R=R, N=N, K=K,
              offsets_E1=offsets_E1, c=c,
              tile_cache=tile_cache, config=config)
    return c


def fp8_swiglu_dgrad(dq: torch.Tensor, ds: torch.Tensor, w2q: torch.Tensor, w2s: torch.Tensor,
                     offsets_E1: torch.Tensor, gu_RG: torch.Tensor, *, gather_idx_R: torch.Tensor | None = None,
                     row_scale_R: torch.Tensor | None = None, row_dot: bool = True, tile_cache: dict | None = None,
                     config: Fp8GemmConfig | None = None):
    """FP8 down-projection dgrad with the SwiGLU backward and the 1x128 quantization of dgu fused (m-grouped "nn":
    w2q (E, D, F) read as (K = D, N = F), scale grid transposed).

    With ``acc = deq(dY)[row(r)] @ deq(w2)[e]`` (fp32) and h recomputed from the saved ``gu_RG`` exactly as the
    forward computed it, s = row_scale_R[r] (1 when None), as the bf16 ``swiglu_dgrad``:
      * ``row_dot_RP[r, p] = sum over columns [128p, 128p + 128) of acc * h`` (fp32);
      * ``dh = cast(acc * s)``, ``dgu_RG = cast([dh * up * silu'(gate) | dh * silu(gate)])``, ``hw_RF = cast(h * s)``;
      * ``dgq_RG, dgs_RB = quant_1x128(dgu_RG)`` (the operand of the dx GEMM), B = 2F / 128.

    Args:
        dq, ds: (R, D) e4m3 + (R, D / 128) fp32, or token rows with gather_idx_R (R,) int32.
        w2q, w2s: (E, D, F) e4m3 + (E, D / 128, F / 128) fp32. gu_RG: (R, 2F) saved [g | u] (the output dtype).
    Returns:
        dgu_RG (R, 2F), hw_RF (R, F) in gu's dtype, row_dot_RP (R, F / 128) fp32 or None, dgq_RG (R, 2F) e4m3,
        dgs_RB (R, 2F / 128) fp32.
    """
    where = "fp8_swiglu_dgrad"
    E, D, F = _check_weight(where, w2q, w2s, "w2")
    R = _check_rows(where, dq, ds, D, gather_idx_R, "d")
    _check_offsets(where, offsets_E1, E)
    _check_row_scale(where, row_scale_R, R)
    if (not isinstance(gu_RG, torch.Tensor) or tuple(gu_RG.shape) != (R, 2 * F) or gu_RG.dtype not in _OUT_DTYPES
            or (R and gu_RG.stride(1) != 1)):
        raise ValueError(f"{where}: gu_RG must be ({R}, {2 * F}) bf16/fp16/fp32 with a contiguous last dimension, got "
                         f"{getattr(gu_RG, 'dtype', type(gu_RG).__name__)} {tuple(getattr(gu_RG, 'shape', ()))}")
    dev = check_device(fp8_m_grouped_kernel, where, dq=dq, ds=ds, w2q=w2q, w2s=w2s, offsets_E1=offsets_E1,
                       gu_RG=gu_RG, gather_idx_R=gather_idx_R, row_scale_R=row_scale_R)
    dgu = torch.empty((R, 2 * F), dtype=gu_RG.dtype, device=dev)
    hw = torch.empty((R, F), dtype=gu_RG.dtype, device=dev)
    part = torch.empty((R, F // QB), dtype=torch.float32, device=dev) if row_dot else None
    dgq = torch.empty((R, 2 * F), dtype=_E4M3, device=dev)
    dgs = torch.empty((R, 2 * F // QB), dtype=torch.float32, device=dev)
    _launch_m(kind="dgrad_swiglu", epilogue=_SWIGLU_BWD, a=dq, sa=ds, a_idx=gather_idx_R, b=w2q, sb=w2s,
              nt=False, R=R, N=F, K=D,
              offsets_E1=offsets_E1, c=dgu, aux=hw, dot=part, q=dgq, qs=dgs, scale=row_scale_R, gu=gu_RG,
              tile_cache=tile_cache, config=config)
    return dgu, hw, part, dgq, dgs


def fp8_swiglu(gu_RG: torch.Tensor, *, valid_rows_1: torch.Tensor | None = None):
    """h = silu(g) * u of [g | u] rows a plain GEMM wrote in the activation dtype, quantized 1x128: the values and
    blocks of :func:`fp8_gate_up_swiglu`'s epilogue on the same g and u, bit for bit.

    Args:
        gu_RG: (R, 2F) bf16 / fp16 / fp32, rows contiguous. valid_rows_1: optional (1,) int32 device count of the
            rows to compute (the others are not written); all R when None.
    Returns:
        hq_RF (R, F) e4m3, hs_RB (R, F / 128) fp32. Sync: none.
    """
    where = "fp8_swiglu"
    if (not isinstance(gu_RG, torch.Tensor) or gu_RG.dim() != 2 or gu_RG.dtype not in _OUT_DTYPES
            or gu_RG.stride(1) != 1):
        raise ValueError(f"{where}: gu_RG must be a 2-D bf16/fp16/fp32 tensor with contiguous rows, got "
                         f"{getattr(gu_RG, 'dtype', type(gu_RG).__name__)} {tuple(getattr(gu_RG, 'shape', ()))}")
    R, G = gu_RG.shape
    F = G // 2
    _check_mult(where, F=F)
    check_row_count(where, valid_rows_1)
    dev = check_device(swiglu_rows_kernel, where, gu_RG=gu_RG, valid_rows_1=valid_rows_1)
    hq = torch.empty((R, F), dtype=_E4M3, device=dev)
    hs = torch.empty((R, F // QB), dtype=torch.float32, device=dev)
    if R == 0 or F == 0:
        return hq, hs
    if valid_rows_1 is None:
        valid_rows_1 = torch.full((1,), R, dtype=torch.int32, device=dev)
    interpret = is_interpreted(swiglu_rows_kernel)
    block_m = _ROWS_INTERPRET if interpret else _ROWS
    swiglu_rows_kernel[(triton.cdiv(R, block_m), F // QB)](
        gu_RG, valid_rows_1, hq.view(torch.uint8), hs, R, F, gu_RG.stride(0), hq.stride(0), hs.stride(0),
        HW_CAST=not interpret, BLOCK_M=block_m, num_warps=4, enable_fp_fusion=True)
    return hq, hs


def fp8_swiglu_bwd(acc_RF: torch.Tensor, gu_RG: torch.Tensor, *, valid_rows_1: torch.Tensor | None = None,
                   row_scale_R: torch.Tensor | None = None, row_dot: bool = True):
    """The SwiGLU backward of :func:`fp8_swiglu_dgrad` on a dgrad accumulator a plain GEMM wrote in fp32
    (``acc_RF = deq(dY) @ deq(w2)[e]`` per row, e.g. ``fp8_grouped_mm_nn(..., out_dtype=torch.float32)``): the
    same values, bit for bit (the same epilogue function on the same fp32 accumulator).

    Args:
        acc_RF: (R, F) fp32, rows contiguous. gu_RG: (R, 2F) the saved [g | u]. valid_rows_1: optional (1,) int32
            device count of the rows to compute (the others are not written); all R when None.
        row_scale_R: optional (R,) fp32 routing weight of each row. row_dot: also return the row-dot partials.
    Returns:
        dgu_RG, hw_RF, row_dot_RP or None, dgq_RG, dgs_RB as :func:`fp8_swiglu_dgrad`. Sync: none.
    """
    where = "fp8_swiglu_bwd"
    if (not isinstance(acc_RF, torch.Tensor) or acc_RF.dim() != 2 or acc_RF.dtype != torch.float32
            or acc_RF.stride(1) != 1):
        raise ValueError(f"{where}: acc_RF must be a 2-D fp32 tensor with contiguous rows, got "
                         f"{getattr(acc_RF, 'dtype', type(acc_RF).__name__)} {tuple(getattr(acc_RF, 'shape', ()))}")
    R, F = acc_RF.shape
    _check_mult(where, F=F)
    _check_row_scale(where, row_scale_R, R)
    if (not isinstance(gu_RG, torch.Tensor) or tuple(gu_RG.shape) != (R, 2 * F) or gu_RG.dtype not in _OUT_DTYPES
            or (R and gu_RG.stride(1) != 1)):
        raise ValueError(f"{where}: gu_RG must be ({R}, {2 * F}) bf16/fp16/fp32 with a contiguous last dimension, got "
                         f"{getattr(gu_RG, 'dtype', type(gu_RG).__name__)} {tuple(getattr(gu_RG, 'shape', ()))}")
    check_row_count(where, valid_rows_1)
    dev = check_device(swiglu_bwd_rows_kernel, where, acc_RF=acc_RF, gu_RG=gu_RG, valid_rows_1=valid_rows_1,
                       row_scale_R=row_scale_R)
    dgu = torch.empty((R, 2 * F), dtype=gu_RG.dtype, device=dev)
    hw = torch.empty((R, F), dtype=gu_RG.dtype, device=dev)
    part = torch.empty((R, F // QB), dtype=torch.float32, device=dev) if row_dot else None
    dgq = torch.empty((R, 2 * F), dtype=_E4M3, device=dev)
    dgs = torch.empty((R, 2 * F // QB), dtype=torch.float32, device=dev)
    if R == 0 or F == 0:
        return dgu, hw, part, dgq, dgs
    if valid_rows_1 is None:
        valid_rows_1 = torch.full((1,), R, dtype=torch.int32, device=dev)
    interpret = is_interpreted(swiglu_bwd_rows_kernel)
    block_m = _ROWS_INTERPRET if interpret else _ROWS
    swiglu_bwd_rows_kernel[(triton.cdiv(R, block_m), F // QB)](
        acc_RF, valid_rows_1, row_scale_R if row_scale_R is not None else acc_RF, gu_RG, dgu, hw,
        part if part is not None else acc_RF, dgq.view(torch.uint8), dgs, R, F,
        acc_RF.stride(0), dgu.stride(0), gu_RG.stride(0), hw.stride(0), dgq.stride(0), dgs.stride(0),
        HAS_SCALE=row_scale_R is not None, HAS_DOT=part is not None, HW_CAST=not interpret, BLOCK_M=block_m,
        num_warps=4, enable_fp_fusion=True)
    return dgu, hw, part, dgq, dgs


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

