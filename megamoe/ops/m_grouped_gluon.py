"""Host launcher of the persistent Gluon m-grouped GEMMs (megamoe/kernels/grouped_gemm_gluon.py): the
one-partition kernel, or with ``GemmConfig.warp_specialized`` the warp-specialized one (128x128 tiles:
ping-pong; 128x256: cooperative).

Legend: R rows of an expert-grouped row buffer, E experts, A (R, K), B (E, N, K) "nt" or (E, K, N) "nn",
C (R, N).

Used by ``ops.grouped_gemm`` for the plain-epilogue GEMMs (down projection, dgrad dx) when the tile table
asks for it (``GemmConfig.gluon``) and :func:`gluon_m_grouped_eligible` holds; otherwise the Triton kernel
runs with the same tiles and K order (the same bits). Gluon is Triton's experimental lower-level language:
if it fails to import, or ``MEGAMOE_GLUON=0`` is set, every GEMM takes the Triton kernel. Nothing here
reads device values on the host (no sync, CUDA-graph capturable); the grid is sized from static bounds.
"""

from __future__ import annotations

import torch
import triton

from ._common import pow2, sm_budget
from .wgrad_gluon import _gl_dtype, gluon_device_ok

try:  # Gluon is experimental: keep the library importable without it
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.gluon_compat import MISSING as _GLUON_MISSING
    from ..kernels.grouped_gemm_gluon import _m_grouped_plain_kernel, _m_grouped_ws_kernel

    if _GLUON_MISSING:  # this Triton lacks a builtin the kernels call: they would fail to compile at run time
        _m_grouped_plain_kernel = _m_grouped_ws_kernel = None
except Exception:  # noqa: BLE001 - any import problem means: no Gluon path
    _m_grouped_plain_kernel = _m_grouped_ws_kernel = None

__all__ = ["gluon_m_grouped_eligible", "m_grouped_operands_fit", "launch_gluon_m_grouped"]

_HALF = (torch.bfloat16, torch.float16)
WS_MAXNREG = 168  # registers per thread at launch of the warp-specialized kernel (12 warps)


def _tma_rows(t: torch.Tensor) -> bool:
    # a TMA view needs contiguous columns, a 16-byte aligned base and a row pitch that is a multiple of 16 bytes
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(-2) * t.element_size()) % 16 == 0


def m_grouped_operands_fit(cfg, a: torch.Tensor, b: torch.Tensor, stride_b, K: int, c: torch.Tensor,
                           gathered: bool) -> bool:
    """Host-side conditions of the Gluon kernel (a pure function; CPU-testable): A, B and C of one 16-bit
    dtype; A's rows not gathered; A, B and C rows with contiguous columns and TMA-compatible pitch and
    alignment; B contiguous per expert, either (N, K) ("nt", stride_b[2] == 1) or (K, N) ("nn", then BLOCK_K
    must divide K so a tile never reads the next expert's rows into the reduction)."""
    if gathered or a.dtype not in _HALF or b.dtype != a.dtype or c.dtype != a.dtype:
        return False
    if not (_tma_rows(a) and _tma_rows(c) and b.is_contiguous() and b.data_ptr() % 16 == 0):
        return False
    E, r, cols = b.shape
    if (cols * b.element_size()) % 16:
        return False
    if stride_b[2] == 1:
        return True
    return stride_b[1] == 1 and K % cfg.block_k == 0


def gluon_m_grouped_eligible(cfg, a, b, stride_b, K, c, gathered: bool) -> bool:
    """True when the Gluon kernel can run this GEMM with ``cfg``: Gluon importable and not disabled by
    ``MEGAMOE_GLUON=0``, a Hopper (sm_90) CUDA device, and :func:`m_grouped_operands_fit`."""
    if _m_grouped_plain_kernel is None or not gluon_device_ok(a):
        return False
    return m_grouped_operands_fit(cfg, a, b, stride_b, K, c, gathered)


def launch_gluon_m_grouped(cfg, a: torch.Tensor, b: torch.Tensor, stride_b, K: int, N: int, num_rows: int,
                           offsets_E1: torch.Tensor, tile_offsets_E1: torch.Tensor, c: torch.Tensor,
                           scale: torch.Tensor | None) -> None:
    """Launch ``c[r] = cast(a[r] @ B[e(r)] [* scale[r]])`` for every row r of an expert (rows past the last
    expert are not written). Preconditions (checked by the caller): :func:`gluon_m_grouped_eligible`,
    num_rows > 0, N > 0; ``tile_offsets_E1`` for ``cfg.block_m``."""
    E, r, cols = b.shape
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    gdt = _gl_dtype(a.dtype)
    a_desc = TensorDescriptor(a, [a.shape[0], K], [a.stride(0), 1], [bm, bk],
                              gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    b_nk = stride_b[2] == 1
    block_b = [bn, bk] if b_nk else [bk, bn]
    b_desc = TensorDescriptor(b, [E * r, cols], [cols, 1], block_b, gl.NVMMASharedLayout.get_default_for(block_b, gdt))
    bound = (triton.cdiv(num_rows, bm) + E) * triton.cdiv(N, bn)
    grid = (max(1, min(sm_budget(c.device), bound)),)
    if cfg.warp_specialized:
        # num_warps 4 is the default partition (MMA warpgroup 0); the second MMA warpgroup and the load warp are
        # the kernel's worker partitions (12 warps in all). maxnreg 168 = 64K registers / 384 threads; the
        # partitions then trade registers (setmaxnreg: 232 for each MMA warpgroup, 40 for the load warp).
        # 128x128 tiles: ping-pong (the warpgroups take tiles in turn); 128x256: cooperative (64 rows each).
        _m_grouped_ws_kernel[grid](
            a_desc, b_desc, scale if scale is not None else c, offsets_E1, tile_offsets_E1, c,
            num_rows, N, E, r, c.stride(0), K,
            B_NK=b_nk, HAS_SCALE=scale is not None, E_POW2=pow2(E), COOP=bn == 256,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg.num_stages, num_warps=4, maxnreg=WS_MAXNREG,
            enable_fp_fusion=True,
        )
        return
    _m_grouped_plain_kernel[grid](
        a_desc, b_desc, scale if scale is not None else c, offsets_E1, tile_offsets_E1, c,
        num_rows, N, E, r, c.stride(0), K,
        B_NK=b_nk, HAS_SCALE=scale is not None, E_POW2=pow2(E),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=cfg.num_stages, num_warps=cfg.num_warps, enable_fp_fusion=True,
    )
