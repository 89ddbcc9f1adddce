"""Host launchers for the weight gradients of an exchange in several rounds (kernels/wgrad_rounds.py).

Legend: R rows of one round's buffer (C capacity rows), L local experts, M / N the weight gradient's
sizes, S = :func:`split_slots` fp32 slots.

Why: an EP exchange launches enough rounds for the worst routing (``megamoe.distributed.max_rounds``:
3 at W = 4 and 7 at W = 8 with the default capacity and K = 8), and the host cannot know how many the
routing used.
Accumulating every round's full [L, M, N] gradient in fp32 (zero fill, one full-size GEMM output and one
add per round, one cast) moved ~100 GB per backward at deepseek-v3 shapes with W = 8 even when round 0
held every row. Here round 0 is the ordinary one-round weight gradient into the bf16 output; later
rounds touch only experts that have rows in them. Rounds are cut at expert boundaries (kernels/ep_comm.py),
so only an expert with more rows than a round holds (more than C: never at the default C when each token's
ids are distinct and W <= 2K) is split across rounds and accumulates in fp32.

Determinism: an expert wholly inside one round is reduced from its first row in BLOCK_K chunks, in row
order, fp32, one cast: bitwise what one round (and the single-GPU fused path) gives. A split expert sums
its rounds' fp32 partials in round order: the same every run, within fp32 rounding of the one-round
result. No atomics, no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.wgrad_rounds import k_grouped_round_kernel, split_finalize_kernel
from ._common import check_device, is_interpreted, persistent_programs, pow2
from .tile_config import DEFAULT_KERNELS, KernelConfig, k_grouped_config

__all__ = ["split_slots", "k_grouped_round", "finalize_split"]

_PROGRAMS_PER_SM = 2  # the per-tile weight-gradient kernels' occupancy at these tiles
_FIN_BLOCK = 4096
_FIN_BLOCK_INTERPRET = 256


def split_slots(max_rows: int, capacity_rows: int, num_local_experts: int) -> int:
    """fp32 slots the split experts need: only experts of more than C = ``capacity_rows`` rows are split, so at
    most ``max_rows // (C + 1)`` of ``max_rows`` received rows (``megamoe.distributed.max_received_rows``)."""
    if capacity_rows <= 0:
        raise ValueError(f"split_slots: capacity_rows must be > 0, got {capacity_rows!r}")
    return max(0, min(max_rows // (capacity_rows + 1), num_local_experts))


def _check_offsets(name: str, t: torch.Tensor, L: int, where: str) -> None:
    if t.dtype != torch.int32 or t.dim() != 1 or t.numel() != L + 1:
        raise ValueError(f"{where}: {name} must be a 1-D int32 tensor of L+1 = {L + 1} entries, got "
                         f"{tuple(t.shape)} {t.dtype}")


def _check_out(out: torch.Tensor, scratch: torch.Tensor, M: int, N: int, where: str) -> int:
    if out.dim() != 3 or out.shape[1:] != (M, N) or not out.is_contiguous():
        raise ValueError(f"{where}: out must be a contiguous (L, {M}, {N}) tensor, got {tuple(out.shape)}")
    if (scratch.dim() != 3 or scratch.shape[1:] != (M, N) or scratch.dtype != torch.float32
            or not scratch.is_contiguous()):
        raise ValueError(f"{where}: scratch must be a contiguous fp32 (S, {M}, {N}) tensor, got "
                         f"{tuple(scratch.shape)} {scratch.dtype}")
    return out.shape[0]


def k_grouped_round(p: torch.Tensor, q: torch.Tensor, roff_L1: torch.Tensor, full_off_L1: torch.Tensor,
                    round_starts: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, *, round_idx: int,
                    capacity_rows: int, kernel_config: KernelConfig = DEFAULT_KERNELS) -> None:
    """Round ``round_idx``'s part of ``out[e] = cast(sum over e's rows of P^T Q)``, in place.

    Args:
        p: (R, M), q: (R, N): this round's rows (R >= the round's rows), 16-bit or fp32, rows contiguous.
        roff_L1: (L+1,) int32, the round-local expert offsets; full_off_L1: (L+1,) int32, the expert offsets
            of the whole receive order (all rounds). round_starts: (rounds+1,) int32, round r holds rows
            ``[round_starts[r], round_starts[r+1])`` of it (``megamoe.ops.ep_comm.round_starts``: cut at expert
            boundaries, at most C rows).
        out: (L, M, N) contiguous: after round 0, the one-round GEMM of round 0's rows; experts wholly in
            round r >= 1 are stored here (bitwise the one-round result); other experts are not touched.
        scratch: (S, M, N) fp32 contiguous, S >= :func:`split_slots`: the split experts' partial sums
            (written in an expert's first round, so it needs no zero fill; at most L slots, as large as a
            full fp32 gradient when the capacity is small enough to give that many rounds). If the rows
            overflow the launched rounds (the schedule reports that as an error) split experts past S slots
            are skipped, so nothing is written outside ``scratch``.
        capacity_rows: C, the most rows of a round.
        kernel_config: tile overrides (a Triton "wgrad" entry; Gluon and torch entries do not apply here).
    Raises ValueError on shapes, dtypes or devices. Sync: none.
    """
    where = "k_grouped_round"
    if p.dim() != 2 or q.dim() != 2 or p.shape[0] != q.shape[0]:
        raise ValueError(f"{where}: p (R, M) and q (R, N) with the same R, got {tuple(p.shape)}, {tuple(q.shape)}")
    if p.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError(f"{where}: p and q need contiguous rows")
    M, N = p.shape[1], q.shape[1]
    L = _check_out(out, scratch, M, N, where)
    _check_offsets("roff_L1", roff_L1, L, where)
    _check_offsets("full_off_L1", full_off_L1, L, where)
    if not isinstance(capacity_rows, int) or capacity_rows <= 0 or not isinstance(round_idx, int) or round_idx < 0:
        raise ValueError(f"{where}: capacity_rows > 0 and round_idx >= 0 ints, got {capacity_rows!r}, {round_idx!r}")
    if round_starts.dtype != torch.int32 or round_starts.dim() != 1 or round_starts.numel() < round_idx + 2:
        raise ValueError(f"{where}: round_starts must be a 1-D int32 tensor of more than round_idx + 1 = "
                         f"{round_idx + 1} entries, got {tuple(round_starts.shape)} {round_starts.dtype}")
    check_device(k_grouped_round_kernel, where, p=p, q=q, roff_L1=roff_L1, full_off_L1=full_off_L1,
                 round_starts=round_starts, out=out, scratch=scratch)
    if out.numel() == 0:
        return
    interpret = is_interpreted(k_grouped_round_kernel)
    dtype = torch.float32 if torch.float32 in (p.dtype, q.dtype) else p.dtype
    cfg = k_grouped_config(M, N, dtype, interpret=interpret, allow_gluon=False, allow_torch=False,
                           kernel_config=kernel_config)
    grid = (persistent_programs(p.device, k_grouped_round_kernel, L * triton.cdiv(M, cfg.block_m)
                                * triton.cdiv(N, cfg.block_n), per_sm=_PROGRAMS_PER_SM),)
    k_grouped_round_kernel[grid](
        p, q, roff_L1, full_off_L1, round_starts, out, scratch, M, N, L, capacity_rows, round_idx, scratch.shape[0],
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        scratch.stride(0), scratch.stride(1),
        FP32_DOT=interpret or dtype == torch.float32, INTERPRET=interpret,
        EVEN_M=M % cfg.block_m == 0, EVEN_N=N % cfg.block_n == 0, L_PAD=pow2(L),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, enable_fp_fusion=True, num_stages=cfg.num_stages,
    )


def finalize_split(scratch: torch.Tensor, full_off_L1: torch.Tensor, out: torch.Tensor, *,
                   capacity_rows: int) -> None:
    """After the last round: ``out[e] = cast(scratch[j])`` for the j-th split expert e (in place; programs of
    an unused slot exit). Raises ValueError on shapes / dtypes. Sync: none."""
    where = "finalize_split"
    M, N = out.shape[1:] if out.dim() == 3 else (-1, -1)
    L = _check_out(out, scratch, M, N, where)
    _check_offsets("full_off_L1", full_off_L1, L, where)
    check_device(split_finalize_kernel, where, scratch=scratch, full_off_L1=full_off_L1, out=out)
    S = scratch.shape[0]
    if S == 0 or out.numel() == 0:
        return
    block = _FIN_BLOCK_INTERPRET if is_interpreted(split_finalize_kernel) else _FIN_BLOCK
    split_finalize_kernel[(triton.cdiv(M * N, block), S)](scratch, full_off_L1, out, M * N, L, capacity_rows,
                                                           L_PAD=pow2(L), BLOCK=block, num_warps=4,
                                                           enable_fp_fusion=True)
