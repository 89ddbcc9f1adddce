"""The plain m-grouped GEMMs through ``torch._grouped_mm`` (PyTorch's CUTLASS grouped GEMM), where the tile
table picks it and the operands allow it.

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``offsets_E1[e]:offsets_E1[e+1]``), E
experts, A (R, K), B stored (E, N, K) ("nt") or (E, K, N) ("nn"), C (R, N).

Why: on one H200 (2026-12-01, seventh session, ``scripts/grouped_mm_vs_torch.py``, docs/perf.md)
``torch._grouped_mm`` gave **bitwise the same** rows as megamoe's Triton m-grouped kernel for the down
projection and the dgrad dx GEMM (and the same rows whether or not the rest of each group was present:
batch invariant), and at hidden size 2048 (qwen3-30b-a3b, 256-1024 rows per expert) it was 16-44% faster;
at hidden size 7168 (deepseek-v3) it was 2-10% slower, so the table (megamoe.ops.tile_config) takes it only
for N <= 2048. The same K order (wgmma, fp32 accumulation over K in order, one cast, no split-K) is why the
bits agree; the GPU tests check it on every shape they run (tests/test_torch_grouped_mm_gpu.py and the
layer's bit-invariance test), and any operand it cannot take runs the Triton kernel instead.

Conditions (a pure host-side function, :func:`torch_grouped_mm_eligible`): a CUDA device of compute
capability 9.x (where the equality was measured), bf16 A, B and C, A's rows not gathered and not scaled, a
fresh output (``torch._grouped_mm`` has no ``out=``), A and B contiguous and 16-byte aligned, N and K
multiples of 8, and ``MEGAMOE_TORCH_MM`` not set to 0. Sync: none (device offsets, no host read);
CUDA-graph capturable. Rows past the last expert are not written (as with the Triton kernel on a fresh
buffer).
"""

from __future__ import annotations

import os

import torch

__all__ = ["torch_grouped_mm_enabled", "operands_fit", "torch_grouped_mm_eligible", "torch_grouped_mm"]


def torch_grouped_mm_enabled() -> bool:
    """False when ``MEGAMOE_TORCH_MM=0`` (every plain m-grouped GEMM then runs megamoe's own kernels)."""
    return os.environ.get("MEGAMOE_TORCH_MM", "1") != "0" and hasattr(torch, "_grouped_mm")


def operands_fit(a: torch.Tensor, b: torch.Tensor, b_nk: bool, out_dtype: torch.dtype) -> bool:
    """The operand conditions alone (a pure function of dtypes, shapes, strides and alignment; CPU-testable):
    bf16 A, B and C, A non-empty, contiguous, 16-byte aligned, of K columns, B contiguous and 16-byte aligned,
    N and K multiples of 8 (so every row starts 16-byte aligned)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or out_dtype != torch.bfloat16:
        return False
    if a.dim() != 2 or b.dim() != 3 or a.shape[0] == 0 or not a.is_contiguous() or a.data_ptr() % 16:
        return False
    E, r, cols = b.shape
    n, k = (r, cols) if b_nk else (cols, r)
    return b.is_contiguous() and b.data_ptr() % 16 == 0 and n % 8 == 0 and k % 8 == 0 and a.shape[1] == k


def torch_grouped_mm_eligible(a: torch.Tensor, b: torch.Tensor, b_nk: bool, out_dtype: torch.dtype, *,
                              gathered: bool, scaled: bool, has_out: bool) -> bool:
    """True when ``torch._grouped_mm`` can compute this GEMM with the bits of the Triton kernel: not turned off,
    rows not gathered or scaled, no preallocated output, a CUDA device of compute capability 9.x, and
    :func:`operands_fit`."""
    if gathered or scaled or has_out or not torch_grouped_mm_enabled():
        return False
    if not (a.is_cuda and b.is_cuda) or torch.cuda.get_device_capability(a.device)[0] != 9:
        return False
    return operands_fit(a, b, b_nk, out_dtype)


def torch_grouped_mm(a: torch.Tensor, b: torch.Tensor, b_nk: bool, offsets_E1: torch.Tensor) -> torch.Tensor:
    """``C[r] = A[r] @ B[e(r)]`` (B[e].T for "nt") as a new (R, N) bf16 tensor; rows past the last expert are
    left unwritten. Preconditions: :func:`torch_grouped_mm_eligible`; offsets_E1 (E+1,) int32 on a's device."""
    return torch._grouped_mm(a, b.transpose(-2, -1) if b_nk else b, offs=offsets_E1[1:])
