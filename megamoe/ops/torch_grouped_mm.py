"""The weight-gradient (k-grouped) GEMMs through ``torch._grouped_mm`` (PyTorch's CUTLASS grouped GEMM): an
experiment switch for layer A/B runs, off by default.

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``offsets_E1[e]:offsets_E1[e+1]``), E
experts, P (R, M) and Q (R, N) row operands, C (E, M, N) = per expert ``P_e^T @ Q_e``.

Why: on one H200 (2026-12-01, seventh session, ``scripts/grouped_mm_vs_torch.py``, docs/perf.md) the w2
weight gradient on contiguous rows took 0.69 ms with ``torch._grouped_mm`` against 0.94 ms with megamoe's
Triton kernel at qwen3-30b-a3b T=16384 (~1024 rows per expert), with **bitwise the same** output: both
reduce an expert's rows from its first row in order with fp32 wgmma accumulation, one cast, no split-K. In
the layer the weight gradients read gathered rows (dY and x by token), which ``torch._grouped_mm`` cannot
take, so the switch also makes the backward copy those rows into row order first (megamoe.autograd).
Whether that pays is what the switch is for (docs/perf.md, ninth session); the seventh session found that
the same kernel's standalone lead on the m-grouped GEMMs did not carry over to the layer.

Switch: ``MEGAMOE_TORCH_WGRAD=1``. Conditions (:func:`torch_wgrad_eligible`, a host-side function of
dtypes, shapes, strides and the device): a CUDA device of compute capability 9.x, bf16 P, Q and C, rows of
P and Q not gathered, no preallocated output, P and Q with unit column stride, row strides and base pointers
16-byte aligned. Anything else runs the Triton kernels. Sync: none (device offsets, no host read);
CUDA-graph capturable. An expert with no rows must get exact zeros; the GPU test checks it against the
Triton kernel (tests/test_torch_wgrad_gpu.py).
"""

from __future__ import annotations

import os

import torch

__all__ = ["torch_wgrad_enabled", "wgrad_operands_fit", "torch_wgrad_eligible", "torch_wgrad"]


def torch_wgrad_enabled() -> bool:
    """True when ``MEGAMOE_TORCH_WGRAD=1`` and this torch has ``torch._grouped_mm``."""
    return os.environ.get("MEGAMOE_TORCH_WGRAD") == "1" and hasattr(torch, "_grouped_mm")


def _rows_fit(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def wgrad_operands_fit(p: torch.Tensor, q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The operand conditions alone (CPU-testable): bf16 P, Q and C, both (R, .) with unit column stride,
    16-byte aligned rows and base pointers, the same number of rows, and M, N multiples of 8."""
    if p.dtype != torch.bfloat16 or q.dtype != torch.bfloat16 or out_dtype != torch.bfloat16:
        return False
    if not (_rows_fit(p) and _rows_fit(q)) or p.shape[0] != q.shape[0]:
        return False
    return p.shape[1] % 8 == 0 and q.shape[1] % 8 == 0


def torch_wgrad_eligible(p: torch.Tensor, q: torch.Tensor, out_dtype: torch.dtype, *, gathered: bool,
                         has_out: bool) -> bool:
    """True when the switch is on and ``torch._grouped_mm`` can take these operands: rows not gathered, no
    preallocated output, a CUDA device of compute capability 9.x, and :func:`wgrad_operands_fit`."""
    if gathered or has_out or not torch_wgrad_enabled():
        return False
    if not (p.is_cuda and q.is_cuda) or torch.cuda.get_device_capability(p.device)[0] != 9:
        return False
    return wgrad_operands_fit(p, q, out_dtype)


def torch_wgrad(p: torch.Tensor, q: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """``C[e] = P_e^T @ Q_e`` as a new (E, M, N) bf16 tensor; rows past ``offsets_E1[E]`` are not read.
    Preconditions: :func:`torch_wgrad_eligible`; offsets_E1 (E+1,) int32 on p's device, offsets_E1[0] = 0."""
    return torch._grouped_mm(p.t(), q, offs=offsets_E1[1:])
