"""Host launcher of the exact three-piece bf16 split of an fp32 matrix (megamoe.kernels.bf16_split).

Legend: R rows, C columns, S slots. ``split_bf16x3(x_RC, pieces, along)``: the pieces named in ``pieces`` (a
sequence of "hi", "mid", "lo"; ``x = hi + mid + lo`` exactly) stacked as row blocks (``along="rows"``: (S R, C))
or column blocks (``along="cols"``: (R, S C)). One launch, no sync; bitwise deterministic.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.bf16_split import bf16_split_kernel
from ._common import check_device, is_interpreted

__all__ = ["split_bf16x3"]

_PIECES = {"hi": 0, "mid": 1, "lo": 2}


def split_bf16x3(x_RC: torch.Tensor, pieces: tuple[str, ...], *, along: str) -> torch.Tensor:
    """x_RC (R, C) fp32, last dim contiguous -> its bf16 pieces in ``pieces`` order, stacked ``along`` "rows"
    (S R, C) or "cols" (R, S C)."""
    where = "split_bf16x3"
    if x_RC.dim() != 2 or x_RC.dtype != torch.float32 or (x_RC.numel() and x_RC.stride(1) != 1):
        raise ValueError(f"{where}: x_RC must be a 2-D fp32 tensor with a contiguous last dim, got {x_RC.dtype} "
                         f"{tuple(x_RC.shape)} strides {x_RC.stride()}")
    if along not in ("rows", "cols"):
        raise ValueError(f"{where}: along must be 'rows' or 'cols', got {along!r}")
    if not pieces or any(p not in _PIECES for p in pieces) or len(pieces) > 16:
        raise ValueError(f"{where}: pieces must be 1..16 names among {tuple(_PIECES)}, got {pieces!r}")
    R, C = x_RC.shape
    S = len(pieces)
    dev = check_device(bf16_split_kernel, where, x_RC=x_RC)
    shape = (S * R, C) if along == "rows" else (R, S * C)
    if S * R * C >= 2 ** 31 or (R and (R - 1) * x_RC.stride(0) + C >= 2 ** 31):
        raise ValueError(f"{where}: {S} pieces of a {R} x {C} matrix exceed the kernel's int32 slot offsets")
    out = torch.empty(shape, dtype=torch.bfloat16, device=dev)
    if x_RC.numel() == 0:
        return out
    stride_or, stride_os = (C, R * C) if along == "rows" else (S * C, C)
    pattern = sum(_PIECES[p] << (2 * s) for s, p in enumerate(pieces))
    block_r, block_c = (16, 32) if is_interpreted(bf16_split_kernel) else (32, 128)
    grid = (triton.cdiv(R, block_r), triton.cdiv(C, block_c))
    bf16_split_kernel[grid](x_RC, out, R, C, x_RC.stride(0) if R else C, stride_or, stride_os, PATTERN=pattern,
                            SLOTS=S, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4, enable_fp_fusion=True)
    return out
