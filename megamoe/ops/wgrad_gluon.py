"""Host launcher of the persistent Gluon weight-gradient kernel (megamoe/kernels/wgrad_gluon.py).

Legend: R rows of an expert-grouped row buffer, E experts, C[e] = P[rows_e]^T @ Q[rows_e] of shape (M, N).

Used by ``ops.grouped_gemm.k_grouped_mm`` when the tile table asks for it (``GemmConfig.gluon``) and
:func:`gluon_wgrad_eligible` holds; otherwise the Triton kernels run with the same tiles and chunk order.
Gluon is Triton's experimental lower-level language, whose builtins are renamed between releases
(megamoe.kernels.gluon_compat resolves them): if it is missing, fails to import or lacks a builtin the kernels call
(another Triton version), every weight gradient takes the Triton kernels (the same bits). Nothing here reads device
values on the host (no sync, CUDA-graph capturable); the grid is sized from E, M and N alone.
"""

from __future__ import annotations

import functools

import torch
import triton

from ._common import sm_count

try:  # Gluon is experimental: keep the library importable without it
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.gluon_compat import MISSING as _GLUON_MISSING
    from ..kernels.wgrad_gluon import k_grouped_wgrad_kernel
    from ..kernels.wgrad_ws_gluon import k_grouped_wgrad_ws_kernel

    if _GLUON_MISSING:  # this Triton lacks a builtin the kernels call: they would fail to compile at run time
        k_grouped_wgrad_kernel = k_grouped_wgrad_ws_kernel = None
except Exception:  # noqa: BLE001 - any import problem means: no Gluon path
    k_grouped_wgrad_kernel = k_grouped_wgrad_ws_kernel = None

__all__ = ["gluon_wgrad_eligible", "operands_fit", "launch_gluon_wgrad", "ws_operands_fit", "launch_gluon_wgrad_ws",
           "GLUON_AVAILABLE"]

GLUON_AVAILABLE = k_grouped_wgrad_kernel is not None and k_grouped_wgrad_ws_kernel is not None
_HALF = (torch.bfloat16, torch.float16)
_BLOCK_M = 128


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def gluon_device_ok(t: torch.Tensor) -> bool:
    """The condition every Gluon kernel of megamoe shares: ``t`` on a Hopper (sm_90) CUDA device."""
    return t.device.type == "cuda" and _is_hopper(t.device.index or 0)


def _aligned_rows(t: torch.Tensor) -> bool:
    # row stride a multiple of 16 elements: Triton specializes such integers as divisible by 16, which is
    # what lets the compiler prove that every 8-element (16-byte) cp.async is aligned
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def operands_fit(cfg, p: torch.Tensor, q: torch.Tensor, c: torch.Tensor, min_units: int) -> bool:
    """Host-side shape / layout conditions of the Gluon kernel (a pure function; CPU-testable):

    * P and Q of one 16-bit dtype, C 16-bit or fp32 and contiguous; fp32 C only with 128-wide tiles (the
      128x256 tile's fp32 epilogue spills registers);
    * rows with contiguous columns, a row stride that is a multiple of 16 elements and 16-byte aligned base
      pointers, M and N multiples of 16 (cp.async moves 16 bytes, and the column masks must be provably
      constant over each 8-element vector);
    * at least ``min_units`` (expert, m-tile) units (the launcher asks for one per SM when the table chose
      the kernel): it runs one program per unit at most, so a single large group (a shared expert's weight
      gradient) would leave most SMs idle where the Triton per-tile kernel fills them."""
    if p.dtype not in _HALF or q.dtype != p.dtype or c.dtype not in _HALF + (torch.float32,):
        return False
    if c.dtype == torch.float32 and cfg.block_n != _BLOCK_M:
        return False
    E, M, N = c.shape
    if M % 16 or N % 16 or p.shape[1] != M or q.shape[1] != N or not c.is_contiguous():
        return False
    return _aligned_rows(p) and _aligned_rows(q) and E * triton.cdiv(M, _BLOCK_M) >= min_units


def _tma_rows(t: torch.Tensor) -> bool:
    # a TMA descriptor over (rows, cols): contiguous columns, 16-byte aligned base and row stride
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def ws_operands_fit(cfg, p: torch.Tensor, q: torch.Tensor, c: torch.Tensor, gathered: bool) -> bool:
    """Host-side conditions of the warp-specialized kernel (a pure function; CPU-testable): a config with
    ``gluon`` and ``warp_specialized`` and 128x128x64 tiles; P and Q rows not gathered (its TMA loads read
    contiguous rows), of one 16-bit dtype, TMA-compatible (contiguous columns, 16-byte aligned base and row
    stride); C 16-bit and contiguous (the epilogue casts to C's dtype: an fp32 tile's layout change would not
    fit beside the ring)."""
    if not (cfg.gluon and cfg.warp_specialized) or (cfg.block_m, cfg.block_n, cfg.block_k) != (128, 128, 64):
        return False
    if gathered or p.dtype not in _HALF or q.dtype != p.dtype or c.dtype not in _HALF or not c.is_contiguous():
        return False
    E, M, N = c.shape
    return p.shape[1] == M and q.shape[1] == N and p.shape[0] == q.shape[0] and _tma_rows(p) and _tma_rows(q)


def gluon_wgrad_eligible(cfg, p: torch.Tensor, q: torch.Tensor, c: torch.Tensor, *, fill_sms: bool = True) -> bool:
    """True when the Gluon kernel can compute ``c = P^T Q`` per group with config ``cfg``: Gluon importable;
    a Hopper (sm_90) CUDA device; and :func:`operands_fit`, with at least one unit per SM when ``fill_sms``
    (an explicitly requested config, e.g. in tests and sweeps, may run on fewer). Otherwise the caller runs the
    Triton kernels (the same bits)."""
    if not GLUON_AVAILABLE or not gluon_device_ok(p):
        return False
    return operands_fit(cfg, p, q, c, sm_count(p.device.index or 0) if fill_sms else 1)


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def launch_gluon_wgrad(cfg, p: torch.Tensor, p_idx_R: torch.Tensor | None, q: torch.Tensor,
                       q_idx_R: torch.Tensor | None, offsets_E1: torch.Tensor, c: torch.Tensor) -> None:
    """Launch the persistent kernel writing every element of ``c`` (E, M, N) (experts with no rows: zeros).

    Preconditions (checked by the caller): :func:`gluon_wgrad_eligible`, R > 0, c.numel() > 0. The output
    goes through TMA stores when a 128-row tile never crosses an expert (M % 128 == 0) and C has 16-bit
    elements (the staging buffer fits beside the load ring), through masked stores otherwise.
    """
    E, M, N = c.shape
    bm, bn = _BLOCK_M, cfg.block_n
    num_units = E * triton.cdiv(M, bm)  # (expert, m-tile) units, each with all its n-tiles
    sms = sm_count(c.device.index or 0)
    tma_c = M % bm == 0 and c.dtype in _HALF and c.data_ptr() % 16 == 0 and (N * c.element_size()) % 16 == 0
    if tma_c:
        layout = gl.NVMMASharedLayout.get_default_for([bm, bn], _gl_dtype(c.dtype))
        c_desc = TensorDescriptor(c.view(E * M, N), [E * M, N], [N, 1], [bm, bn], layout)
    else:
        c_desc = None
    k_grouped_wgrad_kernel[(min(sms, num_units),)](
        p, p_idx_R if p_idx_R is not None else offsets_E1, q, q_idx_R if q_idx_R is not None else offsets_E1,
        offsets_E1, c, c_desc, E, M, N, p.stride(0), q.stride(0), c.stride(0), c.stride(1),
        P_GATHER=p_idx_R is not None, Q_GATHER=q_idx_R is not None, TMA_C=tma_c,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages, RES=cfg.resident_chunks,
        num_warps=cfg.num_warps, enable_fp_fusion=True,
    )


def launch_gluon_wgrad_ws(cfg, p: torch.Tensor, q: torch.Tensor, offsets_E1: torch.Tensor, c: torch.Tensor) -> None:
    """Launch the warp-specialized kernel (megamoe/kernels/wgrad_ws_gluon.py) writing every element of ``c``
    (E, M, N) (experts with no rows: zeros): one program per SM at most, each a TMA load warp and two MMA
    warpgroups taking its 128x128 tiles in turn; ``cfg.num_stages`` ring slots.

    Preconditions (checked by the caller): Gluon available on a Hopper device, :func:`ws_operands_fit`,
    R > 0, c.numel() > 0. The sums and so the bits are the Triton kernels'.
    """
    E, M, N = c.shape
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    gdt = _gl_dtype(p.dtype)
    p_desc = TensorDescriptor(p, list(p.shape), [p.stride(0), 1], [bk, bm],
                              gl.NVMMASharedLayout.get_default_for([bk, bm], gdt))
    q_desc = TensorDescriptor(q, list(q.shape), [q.stride(0), 1], [bk, bn],
                              gl.NVMMASharedLayout.get_default_for([bk, bn], gdt))
    num_units = E * triton.cdiv(M, bm)
    # TMA stores from one staging buffer per MMA warpgroup where a 128-row tile never crosses an expert and
    # the buffers fit beside the ring (else masked stores through a layout change)
    ring = 2 * bk * (max(cfg.resident_chunks, cfg.num_stages) * bm + cfg.num_stages * bn)
    tma_c = (M % bm == 0 and c.data_ptr() % 16 == 0 and (N * c.element_size()) % 16 == 0
             and ring + 2 * bm * bn * c.element_size() + 1024 <= 227 * 1024)
    c_desc = (TensorDescriptor(c.view(E * M, N), [E * M, N], [N, 1], [bm, bn],
                               gl.NVMMASharedLayout.get_default_for([bm, bn], _gl_dtype(c.dtype))) if tma_c else None)
    k_grouped_wgrad_ws_kernel[(min(sm_count(c.device.index or 0), num_units),)](
        p_desc, q_desc, offsets_E1, c, c_desc, E, M, N, c.stride(0), c.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg.num_stages, RES=cfg.resident_chunks, TMA_C=tma_c, num_warps=4,
        enable_fp_fusion=True,
    )
