"""Host launchers of the warp-specialized Gluon FP8 GEMMs (megamoe/kernels/fp8_gemm_gluon.py): the m-grouped GEMM
with a plain epilogue on K-major ("nt") operands (the down projection and the dgrad dx GEMM on K-major weight
copies), and the k-grouped weight gradient on the block-padded K-major 128x1 operands.

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``offsets_E1[e]:offsets_E1[e+1]``; rows past
``offsets_E1[E]`` are never written), E experts, N output columns, K reduction size, KB = K / 128 scale blocks.

The m-grouped GEMM has the contract and bits of :func:`megamoe.ops.fp8_gemm.fp8_grouped_mm_nt` (the K-blocks of
128 promoted in increasing order, one fused multiply-add each), the weight gradient those of
:func:`megamoe.ops.fp8_gemm.fp8_k_grouped_mm` with ``padded=True``; what differs is the
schedule (a TMA load warp fills the ring; in the m-grouped GEMM the next K-block's wgmma runs during a
promotion, in the weight gradient the other MMA warpgroup's does). Gluon is Triton's
experimental lower-level language: where it is missing, or the device is not a Hopper (sm_90) GPU, the launchers
raise (the Triton kernels of megamoe.ops.fp8_gemm compute the same bits everywhere). No host sync: the grids are sized
from host-known shapes alone; CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton

from ._common import pow2, sm_budget
from .fp8_gemm import table_for

try:  # Gluon is experimental: keep the library importable without it
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.fp8_dgrad_gluon import fp8_dgrad_swiglu_ws_kernel
    from ..kernels.fp8_gemm_gluon import fp8_k_grouped_ws_kernel, fp8_m_grouped_ws_kernel
    from ..kernels.gluon_compat import MISSING as _GLUON_MISSING

    if _GLUON_MISSING:  # this Triton lacks a builtin the kernel calls: it would fail to compile at run time
        fp8_m_grouped_ws_kernel = fp8_k_grouped_ws_kernel = fp8_dgrad_swiglu_ws_kernel = None
except Exception:  # noqa: BLE001 - any import problem means: no Gluon kernel
    fp8_m_grouped_ws_kernel = fp8_k_grouped_ws_kernel = fp8_dgrad_swiglu_ws_kernel = None

__all__ = [
    "fp8_dgrad_swiglu_gluon", "fp8_grouped_mm_nt_gluon", "fp8_k_grouped_mm_gluon", "FP8_GLUON_AVAILABLE",
    "fp8_gluon_runs_on", "fp8_gluon_stages", "fp8_gluon_unroll", "fp8_wgrad_stages",
]

FP8_GLUON_AVAILABLE = fp8_m_grouped_ws_kernel is not None
QB = 128
_BLOCK_M = _BLOCK_N = QB
_E4M3 = torch.float8_e4m3fn
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SMEM = 227 * 1024  # a Hopper block's shared memory
_WS_MAXNREG = 168  # registers per thread at launch (12 warps); the partitions then trade (232 / 40)


def fp8_gluon_runs_on(device: torch.device) -> bool:
    """Whether the Gluon FP8 kernels run on ``device``: Gluon importable with the builtins they call and a Hopper
    (sm_90) CUDA device. Elsewhere (CPU interpreter, Ada, Blackwell) the Triton kernels of megamoe.ops.fp8_gemm
    compute the same bits."""
    device = torch.device(device)
    return FP8_GLUON_AVAILABLE and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _ring_depth(out_dtype: torch.dtype, slot_bytes: int) -> int:
    """The most ring slots of slot_bytes that fit beside the two staging buffers of the output tile (64 x 128 of
    out_dtype each) and the barriers, at most 6."""
    staging = 2 * (_BLOCK_M // 2) * _BLOCK_N * torch.empty((), dtype=out_dtype).element_size()
    return min(6, (_SMEM - staging - 1024) // slot_bytes)


def fp8_gluon_stages(out_dtype: torch.dtype) -> int:
    """Ring depth of the m-grouped kernel's 128 x 128 tiles (pure function): slots of (128 + 128) x 128 bytes
    (the A and B blocks of a step)."""
    return _ring_depth(out_dtype, (_BLOCK_M + _BLOCK_N) * QB)


def fp8_wgrad_stages(out_dtype: torch.dtype) -> int:
    """Ring depth of the weight gradient (pure function): each slot holds the P and Q blocks of a step and their
    two rows of 128 fp32 scales."""
    return _ring_depth(out_dtype, (_BLOCK_M + _BLOCK_N) * QB + 4 * (_BLOCK_M + _BLOCK_N))


def fp8_gluon_unroll(K: int) -> int:
    """K-blocks per unrolled chunk of the K loop (pure function): the largest divisor of K / 128 up to 8 (a
    chunk's last promotion is not overlapped with a wgmma of the same warpgroup; more unrolling lets the
    compiler hoist more address arithmetic into registers)."""
    kb = K // QB
    return max(u for u in range(1, 9) if kb % u == 0)


def _check(where: str, name: str, t, dims: int, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims or t.dtype != dtype:
        raise ValueError(f"{where}: {name} must be a {dims}-D {dtype} tensor, got {t.dtype} {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous (K-major operands), strides {t.stride()}")


def _validate(where, aq, as_, bq, bs, offsets_E1, out_dtype,
              twin: str = "fp8_gemm.fp8_grouped_mm_nt") -> tuple[int, int, int, int]:
    """(R, E, N, K) after checking every argument (clear errors naming it)."""
    _check(where, "aq", aq, 2, _E4M3)
    _check(where, "as_", as_, 2, torch.float32)
    _check(where, "bq", bq, 3, _E4M3)
    _check(where, "bs", bs, 3, torch.float32)
    E, N, K = bq.shape
    R = aq.shape[0]
    if N % QB or K % QB or K == 0:
        raise ValueError(f"{where}: FP8 block scaling needs N and K positive multiples of 128, got bq "
                         f"{tuple(bq.shape)}")
    if tuple(bs.shape) != (E, N // QB, K // QB):
        raise ValueError(f"{where}: bs must be ({E}, {N // QB}, {K // QB}), got {tuple(bs.shape)}")
    if aq.shape[1] != K or tuple(as_.shape) != (R, K // QB):
        raise ValueError(f"{where}: aq must be (., {K}) with as_ (., {K // QB}), got {tuple(aq.shape)} and "
                         f"{tuple(as_.shape)}")
    if not isinstance(offsets_E1, torch.Tensor) or offsets_E1.dtype != torch.int32 or (
            tuple(offsets_E1.shape) != (E + 1,)) or not offsets_E1.is_contiguous():
        raise ValueError(f"{where}: offsets_E1 must be a contiguous int32 tensor of shape ({E + 1},), got "
                         f"{getattr(offsets_E1, 'dtype', type(offsets_E1).__name__)} "
                         f"{tuple(getattr(offsets_E1, 'shape', ()))}")
    _check_launch(where, twin, out_dtype, (aq, as_, bq, bs, offsets_E1), {"aq": aq, "bq": bq})
    return R, E, N, K


def _check_launch(where: str, triton_twin: str, out_dtype, tensors, tma_operands: dict) -> None:
    """The checks the launchers share: the output dtype, one device, Gluon present, a Hopper GPU (else the
    Triton twin in megamoe.ops, named by the error, computes the same bits), 16-byte aligned TMA operands."""
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{where}: out_dtype {out_dtype} not supported (bf16, fp16, fp32)")
    devs = {t.device for t in tensors}
    if len(devs) > 1:
        raise ValueError(f"{where}: tensors on different devices: {sorted(map(str, devs))}")
    dev = devs.pop()
    if not FP8_GLUON_AVAILABLE:
        raise RuntimeError(f"{where}: Gluon (triton.experimental.gluon, Hopper TMA / wgmma builtins) is not "
                           f"available in Triton {triton.__version__}; use megamoe.ops.{triton_twin} "
                           f"(the same bits)")
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0):
        raise RuntimeError(f"{where}: the Gluon FP8 kernel needs a Hopper (sm_90) CUDA device, got {dev}; use "
                           f"megamoe.ops.{triton_twin} (the same bits)")
    for name, t in tma_operands.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{where}: {name} must be 16-byte aligned (TMA), got address {t.data_ptr():#x}")


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def fp8_grouped_mm_nt_gluon(aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor,
                            offsets_E1: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                            tile_cache: dict | None = None) -> torch.Tensor:
    """FP8 m-grouped ``C[r] = cast(deq(A)[r] @ deq(B)[e]^T)`` for every row r of expert e, B[e] stored (N, K)
    (K-major), on Hopper with the warp-specialized Gluon kernel; bitwise
    :func:`megamoe.ops.fp8_gemm.fp8_grouped_mm_nt`.

    Args:
        aq, as_: (R, K) e4m3 + (R, K / 128) fp32, contiguous (1x128 row blocks).
        bq, bs: (E, N, K) e4m3 + (E, N / 128, K / 128) fp32, contiguous (128x128 blocks).
        offsets_E1: (E + 1,) int32 expert row offsets (device).
        out_dtype: C's dtype (bf16, fp16, fp32).
        tile_cache: a dict shared by the GEMMs of one set of offsets (the m-tile table for 128 rows computed once;
            the key of megamoe.ops.fp8_gemm's launchers, so one dict serves both).
    Returns:
        (R, N) out_dtype; rows past offsets_E1[E] are left uninitialized (never written).
    """
    where = "fp8_grouped_mm_nt_gluon"
    R, E, N, K = _validate(where, aq, as_, bq, bs, offsets_E1, out_dtype)
    c = torch.empty((R, N), dtype=out_dtype, device=aq.device)
    if R == 0 or N == 0 or E == 0:
        return c
    tiles = table_for(offsets_E1, _BLOCK_M, tile_cache)
    ab_layout = gl.NVMMASharedLayout.get_default_for([_BLOCK_M, QB], gl.float8e4nv)
    a_desc = TensorDescriptor(aq, [R, K], [K, 1], [_BLOCK_M, QB], ab_layout)
    b_desc = TensorDescriptor(bq.view(E * N, K), [E * N, K], [K, 1], [_BLOCK_N, QB], ab_layout)
    c_block = [_BLOCK_M // 2, _BLOCK_N]  # one MMA warpgroup's rows
    c_desc = TensorDescriptor(c, [R, N], [N, 1], c_block,
                              gl.NVMMASharedLayout.get_default_for(c_block, _gl_dtype(out_dtype)))
    bound = (triton.cdiv(R, _BLOCK_M) + E) * (N // _BLOCK_N)
    grid = (max(1, min(sm_budget(c.device), bound)),)
    # num_warps 4 is the default partition (MMA warpgroup 0); the second MMA warpgroup and the load warp are the
    # worker partitions (12 warps in all, 168 registers each at launch, then 232 per MMA thread, 40 for the loader)
    fp8_m_grouped_ws_kernel[grid](
        a_desc, b_desc, as_, bs, offsets_E1, tiles, c, c_desc,
        R, N, E, as_.stride(0), bs.stride(0), bs.stride(1), c.stride(0), K,
        E_POW2=pow2(E), BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, STAGES=fp8_gluon_stages(out_dtype),
        UNROLL=fp8_gluon_unroll(K), num_warps=4,
        maxnreg=_WS_MAXNREG, enable_fp_fusion=True,
    )
    return c


def _check_swiglu_operands(where: str, aq: torch.Tensor, F: int, gu_RG, row_scale_R) -> None:
    """gu_RG (R, 2F) of a 16-bit or fp32 dtype with contiguous rows, row_scale_R None or (R,) fp32 contiguous, both
    on aq's device (R = aq's rows)."""
    R = aq.shape[0]
    dt = gu_RG.dtype if isinstance(gu_RG, torch.Tensor) else None
    if dt not in _OUT_DTYPES or gu_RG.dim() != 2 or tuple(gu_RG.shape) != (R, 2 * F) or (
            R and gu_RG.stride(1) != 1) or gu_RG.device != aq.device:
        raise ValueError(f"{where}: gu_RG must be a ({R}, {2 * F}) bf16 / fp16 / fp32 tensor with contiguous rows on "
                         f"{aq.device}, got {dt} {tuple(getattr(gu_RG, 'shape', ()))}")
    if row_scale_R is not None and (not isinstance(row_scale_R, torch.Tensor) or tuple(row_scale_R.shape) != (R,)
                                    or row_scale_R.dtype != torch.float32 or not row_scale_R.is_contiguous()
                                    or row_scale_R.device != aq.device):
        raise ValueError(f"{where}: row_scale_R must be a contiguous fp32 tensor of shape ({R},) on {aq.device}")


def fp8_dgrad_swiglu_gluon(aq: torch.Tensor, as_: torch.Tensor, bq: torch.Tensor, bs: torch.Tensor,
                           offsets_E1: torch.Tensor, gu_RG: torch.Tensor, *, row_scale_R: torch.Tensor | None = None,
                           row_dot: bool = True, tile_cache: dict | None = None):
    """The down projection's dgrad with the SwiGLU backward in its epilogue, on Hopper: bitwise
    ``fp8_swiglu_bwd(fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, offsets_E1, torch.float32), gu_RG, ...)``
    (megamoe.ops.fp8_swiglu) over the rows ``offsets_E1[E]`` holds, without the fp32 accumulator's trip through
    memory.

    Args:
        aq, as_: (R, D) e4m3 + (R, D / 128) fp32: dY's 1x128 rows in expert order.
        bq, bs: (E, F, D) e4m3 + (E, F / 128, D / 128) fp32, contiguous: W2's blocks K-major for this GEMM.
        offsets_E1: (E + 1,) int32 expert row offsets (device). gu_RG: (R, 2F) the saved [g | u], rows contiguous
            (bf16 / fp16 / fp32: the dtype of dgu and hw). row_scale_R: optional (R,) fp32 routing weight per row.
        row_dot: also return the row-dot partials. tile_cache: as for :func:`fp8_grouped_mm_nt_gluon`.
    Returns:
        dgu_RG (R, 2F), hw_RF (R, F), row_dot_RP (R, F / 128) fp32 or None, dgq_RG (R, 2F) e4m3, dgs_RB
        (R, 2F / 128) fp32; rows past offsets_E1[E] are left uninitialized. Sync: none; CUDA-graph capturable.
    """
    where = "fp8_dgrad_swiglu_gluon"
    if isinstance(aq, torch.Tensor) and aq.dim() == 2 and isinstance(bq, torch.Tensor) and bq.dim() == 3:
        _check_swiglu_operands(where, aq, bq.shape[1], gu_RG, row_scale_R)  # (the rest is _validate's)
    R, E, F, D = _validate(where, aq, as_, bq, bs, offsets_E1, torch.float32,
                           twin="fp8_gemm.fp8_grouped_mm_nt (fp32 out), then fp8_swiglu.fp8_swiglu_bwd")
    dt = gu_RG.dtype
    dev = aq.device
    dgu = torch.empty((R, 2 * F), dtype=dt, device=dev)
    hw = torch.empty((R, F), dtype=dt, device=dev)
    part = torch.empty((R, F // QB), dtype=torch.float32, device=dev) if row_dot else None
    dgq = torch.empty((R, 2 * F), dtype=_E4M3, device=dev)
    dgs = torch.empty((R, 2 * F // QB), dtype=torch.float32, device=dev)
    if R == 0 or F == 0 or E == 0:
        return dgu, hw, part, dgq, dgs
    tiles = table_for(offsets_E1, _BLOCK_M, tile_cache)
    layout = gl.NVMMASharedLayout.get_default_for([_BLOCK_M, QB], gl.float8e4nv)
    a_desc = TensorDescriptor(aq, [R, D], [D, 1], [_BLOCK_M, QB], layout)
    b_desc = TensorDescriptor(bq.view(E * F, D), [E * F, D], [D, 1], [_BLOCK_N, QB], layout)
    bound = (triton.cdiv(R, _BLOCK_M) + E) * (F // _BLOCK_N)
    fp8_dgrad_swiglu_ws_kernel[(max(1, min(sm_budget(dev), bound)),)](
        a_desc, b_desc, as_, bs, offsets_E1, tiles, row_scale_R if row_scale_R is not None else as_, gu_RG, dgu, hw,
        part if part is not None else as_, dgq.view(torch.uint8), dgs,
        R, F, E, as_.stride(0), bs.stride(0), bs.stride(1), gu_RG.stride(0), dgu.stride(0), hw.stride(0),
        dgq.stride(0), dgs.stride(0), D,
        HAS_SCALE=row_scale_R is not None, HAS_DOT=part is not None, E_POW2=pow2(E),
        STAGES=fp8_gluon_stages(torch.float32), UNROLL=fp8_gluon_unroll(D), num_warps=4, maxnreg=_WS_MAXNREG,
        enable_fp_fusion=True,
    )
    return dgu, hw, part, dgq, dgs


def _validate_wgrad(where, pq, ps, qq, qs, offsets_E1, block_offsets_E1, out_dtype) -> tuple[int, int, int, int]:
    """(R, E, M, N) after checking every argument of :func:`fp8_k_grouped_mm_gluon` (clear errors naming it)."""
    for name, t, dt in (("pq", pq, _E4M3), ("qq", qq, _E4M3)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.dtype != dt:
            raise ValueError(f"{where}: {name} must be a 2-D {dt} tensor, got {t.dtype} {tuple(t.shape)}")
        if not t.t().is_contiguous():
            raise ValueError(f"{where}: {name} must be K-major ({name}.t() contiguous: the block-padded layout of "
                             f"quantize_128x1_grouped(..., kmajor=True)), strides {t.stride()}")
    _check(where, "ps", ps, 2, torch.float32)
    _check(where, "qs", qs, 2, torch.float32)
    (R, M), N = pq.shape, qq.shape[1]
    if M % QB or N % QB or R % QB:
        raise ValueError(f"{where}: need M and N multiples of 128 and 128 * NB rows, got pq {tuple(pq.shape)}, qq "
                         f"{tuple(qq.shape)}")
    if qq.shape[0] != R or tuple(ps.shape) != (R // QB, M) or tuple(qs.shape) != (R // QB, N):
        raise ValueError(f"{where}: need pq (128 NB, M), qq (128 NB, N), ps (NB, M), qs (NB, N); got pq "
                         f"{tuple(pq.shape)}, qq {tuple(qq.shape)}, ps {tuple(ps.shape)}, qs {tuple(qs.shape)}")
    tables = [("offsets_E1", offsets_E1)] + ([] if block_offsets_E1 is None else [("block_offsets_E1",
                                                                                      block_offsets_E1)])
    for name, t in tables:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2 or (
                not t.is_contiguous()) or t.numel() != offsets_E1.numel():
            raise ValueError(f"{where}: {name} must be a contiguous 1-D int32 tensor of E + 1 >= 2 entries (the same "
                             f"E for both tables), got {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}")
    _check_launch(where, "fp8_gemm.fp8_k_grouped_mm", out_dtype, [pq, ps, qq, qs] + [t for _, t in tables],
                  {"pq": pq, "qq": qq, "ps": ps, "qs": qs})
    return R, offsets_E1.numel() - 1, M, N


def fp8_k_grouped_mm_gluon(pq: torch.Tensor, ps: torch.Tensor, qq: torch.Tensor, qs: torch.Tensor,
                           offsets_E1: torch.Tensor, *, block_offsets_E1: torch.Tensor | None = None,
                           out_dtype: torch.dtype = torch.float32, tile_cache: dict | None = None) -> torch.Tensor:
    """FP8 k-grouped weight gradient ``C[e] = cast(sum over expert e's 128-row blocks b of (deq P_b)^T @ deq Q_b)``
    (E, M, N) on Hopper with the warp-specialized Gluon kernel; bitwise :func:`megamoe.ops.fp8_gemm.fp8_k_grouped_mm`
    with ``padded=True`` (blocks in increasing order, fp32 accumulation, one cast; no atomics, no split-K).

    Args:
        pq, ps: (128 NB, M) e4m3 whose ``.t()`` is contiguous + (NB, M) fp32 contiguous: the block-padded K-major
            operand that :func:`megamoe.ops.fp8_quant.quantize_128x1_grouped` writes with ``kmajor=True`` (zeros
            past each expert's rows); all four tensors 16-byte aligned (TMA reads them).
        qq, qs: (128 NB, N) e4m3 (the same layout) + (NB, N) fp32.
        offsets_E1: (E + 1,) int32 expert row offsets.
        block_offsets_E1: (E + 1,) int32 block table (the m-tile table for 128 rows; computed, or taken from
            ``tile_cache``, when None).
        out_dtype: the weight's dtype (bf16, fp16) or fp32.
    Returns:
        (E, M, N) out_dtype; an expert without rows gets exact zeros. Sync: none; CUDA-graph capturable.
    Device values are trusted, as by the Triton kernel: ``block_offsets_E1`` must be the 128-row tile table of
    ``offsets_E1`` (``tile_offsets_for(offsets_E1, 128)``) with ``block_offsets_E1[E] <= NB``.
    """
    where = "fp8_k_grouped_mm_gluon"
    R, E, M, N = _validate_wgrad(where, pq, ps, qq, qs, offsets_E1, block_offsets_E1, out_dtype)
    c = torch.empty((E, M, N), dtype=out_dtype, device=pq.device)
    if c.numel() == 0:
        return c
    if R == 0:
        return c.zero_()
    blocks = table_for(offsets_E1, QB, tile_cache) if block_offsets_E1 is None else block_offsets_E1
    layout = gl.NVMMASharedLayout.get_default_for([_BLOCK_M, QB], gl.float8e4nv)  # 128 x 128 tiles: P and Q alike
    p_desc = TensorDescriptor(pq.t(), [M, R], [R, 1], [_BLOCK_M, QB], layout)
    q_desc = TensorDescriptor(qq.t(), [N, R], [R, 1], [_BLOCK_N, QB], layout)
    c_block = [_BLOCK_M // 2, _BLOCK_N]  # one MMA warpgroup's rows
    c_desc = TensorDescriptor(c.view(E * M, N), [E * M, N], [N, 1], c_block,
                              gl.NVMMASharedLayout.get_default_for(c_block, _gl_dtype(out_dtype)))
    row = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # a block's row of 128 scales
    sp_desc = TensorDescriptor(ps, list(ps.shape), [M, 1], [1, _BLOCK_M], row)
    sq_desc = TensorDescriptor(qs, list(qs.shape), [N, 1], [1, _BLOCK_N], row)
    num_tiles = E * (M // _BLOCK_M) * (N // _BLOCK_N)
    fp8_k_grouped_ws_kernel[(max(1, min(sm_budget(c.device), num_tiles)),)](
        p_desc, q_desc, sp_desc, sq_desc, offsets_E1, blocks, c_desc, M, N, E,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, STAGES=fp8_wgrad_stages(out_dtype), num_warps=4,
        maxnreg=_WS_MAXNREG, enable_fp_fusion=True,
    )
    return c
