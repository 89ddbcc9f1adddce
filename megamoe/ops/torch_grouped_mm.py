"""The weight-gradient (k-grouped) GEMMs through ``torch._grouped_mm`` (PyTorch's CUTLASS grouped GEMM).

Legend: R rows of an expert-grouped row buffer (expert e owns rows ``offsets_E1[e]:offsets_E1[e+1]``), E
experts, P (R, M) and Q (R, N) row operands, C (E, M, N) = per expert ``P_e^T @ Q_e``.

Why: the tile table (megamoe.ops.tile_config, ``GemmConfig.torch_mm``) sends the bf16 weight gradients of
experts with more rows than the resident Triton kernel keeps on chip (> ~154 expected rows per expert) here.
Measured on one H200 (2026-12-01, ninth session, interleaved layer A/B, fwd+bwd ms, Triton kernels vs
torch's, the backward copying dY's and x's rows into row order for it; docs/perf.md): qwen3-30b-a3b T=4096 /
8192 / 16384 (256 / 512 / 1024 rows per expert) 2.96 vs 2.94, 4.76 vs 4.42, 8.59 vs 7.91; deepseek-v3 T=8192 /
16384 (256 / 512) 48.73 vs 46.81, 88.91 vs 79.58; but deepseek-v3 T=4096 (128 rows, the resident kernel's
range) 30.74 vs 31.58. CUTLASS's kernel shares operand tiles across a cluster (TMA multicast), which Triton 3.6
cannot express, and it reduces an expert's rows in the same order as megamoe's kernels (fp32 wgmma
accumulation from the first row, one cast, no split-K): its results are **bitwise** the Triton kernels'
(tests/test_torch_wgrad_gpu.py: experts of 0 to ~1100 rows, rows past the last expert, the layer's output and
every gradient), so the choice never changes bits, at any EP size. Since the sixteenth session the table
gives contiguous rows of ~154-384 per expert to megamoe's warp-specialized Gluon kernel instead
(``tile_config.ws_wgrad_config``, megamoe/kernels/wgrad_ws_gluon.py; the same bits, faster there); torch's
kernel keeps larger experts and single large groups (a shared expert's).

A :class:`megamoe.config.KernelConfig` "wgrad" entry replaces the table's choice: with ``torch_mm``, torch's
kernel wherever the operands allow; without, megamoe's own kernels. The EP path takes the table's choice on its
contiguous receive buffers, with no copies (its layer at W = 1, deepseek-v3 M=8192, tenth session: 52.59 ->
51.00 ms, table vs torch's kernel off).
Operand conditions (:func:`torch_wgrad_eligible`): a CUDA device of compute capability 9.x, bf16 P, Q and C,
rows of P and Q not gathered, no preallocated output, unit column strides, 16-byte aligned rows and base
pointers, M and N multiples of 8; anything else runs the Triton kernels. Sync: none (device offsets, no host
read); CUDA-graph capturable (GPU test).
"""

from __future__ import annotations

import torch

__all__ = ["torch_wgrad_device", "wgrad_shape_fits", "wgrad_operands_fit", "torch_wgrad_eligible", "torch_wgrad"]


def torch_wgrad_device(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.x (where the bitwise equality was measured)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def wgrad_shape_fits(m: int, n: int, dtype: torch.dtype) -> bool:
    """The shape-level part of :func:`wgrad_operands_fit`: bf16, and M and N multiples of 8 (16-byte rows)."""
    return dtype == torch.bfloat16 and m % 8 == 0 and n % 8 == 0


def _rows_fit(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def wgrad_operands_fit(p: torch.Tensor, q: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The operand conditions alone (CPU-testable): bf16 P, Q and C, both (R, .) with unit column stride,
    16-byte aligned rows and base pointers, the same number of rows, and M, N multiples of 8."""
    if p.dtype != q.dtype or out_dtype != p.dtype or not wgrad_shape_fits(p.shape[-1], q.shape[-1], p.dtype):
        return False
    return _rows_fit(p) and _rows_fit(q) and p.shape[0] == q.shape[0]


def torch_wgrad_eligible(p: torch.Tensor, q: torch.Tensor, out_dtype: torch.dtype, *, gathered: bool,
                         has_out: bool) -> bool:
    """True when ``torch._grouped_mm`` can take these operands: rows not gathered, no preallocated output, a
    device of :func:`torch_wgrad_device`, and :func:`wgrad_operands_fit` (the choice is the caller's)."""
    if gathered or has_out or not hasattr(torch, "_grouped_mm"):
        return False
    if not (p.is_cuda and q.is_cuda) or not torch_wgrad_device(p.device):
        return False
    return wgrad_operands_fit(p, q, out_dtype)


def torch_wgrad(p: torch.Tensor, q: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """``C[e] = P_e^T @ Q_e`` as a new (E, M, N) bf16 tensor; rows past ``offsets_E1[E]`` are not read.
    Preconditions: :func:`torch_wgrad_eligible`; offsets_E1 (E+1,) int32 on p's device, offsets_E1[0] = 0."""
    return torch._grouped_mm(p.t(), q, offs=offsets_E1[1:])
