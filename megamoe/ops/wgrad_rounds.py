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
result. In FP8 (:func:`fp8_k_grouped_round`) a split expert is bitwise the one-round result too: C is a
multiple of the 128-row blocks, every FP8 weight-gradient kernel reduces an expert's blocks one after the other
into one fp32 sum, and the slot carries that sum from round to round. No atomics, no host sync, CUDA-graph
capturable.
"""

from __future__ import annotations

import torch
import triton

from ..kernels.wgrad_rounds import fp8_k_grouped_round_kernel, k_grouped_round_kernel, split_finalize_kernel
from ._common import check_device, is_interpreted, persistent_programs, pow2
from .fp8_gemm import QB, fp8_config
from .tile_config import DEFAULT_KERNELS, KernelConfig, k_grouped_config

__all__ = ["split_slots", "k_grouped_round", "fp8_k_grouped_round", "finalize_split"]

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


def _check_round_starts(round_starts: torch.Tensor, round_idx: int, where: str) -> None:
    if round_starts.dtype != torch.int32 or round_starts.dim() != 1 or round_starts.numel() < round_idx + 2:
        raise ValueError(f"{where}: round_starts must be a 1-D int32 tensor of more than round_idx + 1 = "
                         f"{round_idx + 1} entries, got {tuple(round_starts.shape)} {round_starts.dtype}")


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
    _check_round_starts(round_starts, round_idx, where)
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


def fp8_k_grouped_round(pq: torch.Tensor, ps: torch.Tensor, qq: torch.Tensor, qs: torch.Tensor, roff_L1: torch.Tensor,
                        block_offsets_L1: torch.Tensor, full_off_L1: torch.Tensor, round_starts: torch.Tensor,
                        out: torch.Tensor, scratch: torch.Tensor, *, round_idx: int, capacity_rows: int) -> None:
    """:func:`k_grouped_round` on block-scaled FP8 operands (``megamoe.ops.fp8_gemm.fp8_k_grouped_mm``'s padded
    layout): round ``round_idx``'s part of ``out[e] = cast(sum over e's 128-row blocks of (deq P_b)^T deq Q_b)``.

    Args:
        pq, ps: (NB * 128, M) e4m3, block b = rows [128b, 128b + 128) (any strides; ``quantize_128x1_grouped(...,
            kmajor=True)`` of the round's rows), and (NB, M) fp32 scales; qq, qs: (NB * 128, N) and (NB, N).
        roff_L1: (L+1,) int32 round-local expert offsets; block_offsets_L1: (L+1,) int32, their 128-row block
            table (``megamoe.ops.tile_offsets_for(roff_L1, 128)``); full_off_L1, round_starts, out, scratch: as
            :func:`k_grouped_round`.
        capacity_rows: C, a multiple of 128: a split expert is cut every C rows from its first row, so its
            pieces start on its own 128-row blocks and the partial sums continue the one-round chain exactly.
    Determinism: every expert, split or whole, gets the bits of the one-round FP8 weight gradient (the same
    blocks reduced in the same order in fp32, one cast). Raises ValueError on shapes, dtypes, devices or a C
    that is not a multiple of 128. Sync: none.
    """
    where = "fp8_k_grouped_round"
    if not isinstance(capacity_rows, int) or capacity_rows <= 0 or capacity_rows % QB:
        raise ValueError(f"{where}: capacity_rows must be a positive multiple of {QB} (the weight-gradient blocks), "
                         f"got {capacity_rows!r}")
    if not isinstance(round_idx, int) or round_idx < 0:
        raise ValueError(f"{where}: round_idx must be an int >= 0, got {round_idx!r}")
    e4m3 = torch.float8_e4m3fn
    for name, t, dt in (("pq", pq, e4m3), ("ps", ps, torch.float32), ("qq", qq, e4m3), ("qs", qs, torch.float32)):
        if t.dim() != 2 or t.dtype != dt:
            raise ValueError(f"{where}: {name} must be a 2-D {dt} tensor, got {tuple(t.shape)} {t.dtype}")
    NB = ps.shape[0]
    M, N = pq.shape[1], qq.shape[1]
    if pq.shape[0] != QB * NB or qq.shape[0] != QB * NB or qs.shape[0] != NB or ps.shape[1] != M or qs.shape[1] != N:
        raise ValueError(f"{where}: need pq (128 * NB, M), qq (128 * NB, N), ps (NB, M), qs (NB, N); got pq "
                         f"{tuple(pq.shape)}, qq {tuple(qq.shape)}, ps {tuple(ps.shape)}, qs {tuple(qs.shape)}")
    if ps.stride(1) != 1 or qs.stride(1) != 1:
        raise ValueError(f"{where}: ps and qs need contiguous rows")
    L = _check_out(out, scratch, M, N, where)
    for name, t in (("roff_L1", roff_L1), ("block_offsets_L1", block_offsets_L1), ("full_off_L1", full_off_L1)):
        _check_offsets(name, t, L, where)
    _check_round_starts(round_starts, round_idx, where)
    check_device(fp8_k_grouped_round_kernel, where, pq=pq, ps=ps, qq=qq, qs=qs, roff_L1=roff_L1,
                 block_offsets_L1=block_offsets_L1, full_off_L1=full_off_L1, round_starts=round_starts, out=out,
                 scratch=scratch)
    if out.numel() == 0:
        return
    interpret = is_interpreted(fp8_k_grouped_round_kernel)
    cfg = fp8_config("wgrad", interpret=interpret)
    grid = (persistent_programs(pq.device, fp8_k_grouped_round_kernel, L * triton.cdiv(M, cfg.block_m)
                                * triton.cdiv(N, cfg.block_n), per_sm=_PROGRAMS_PER_SM),)
    fp8_k_grouped_round_kernel[grid](
        pq, ps, qq, qs, roff_L1, block_offsets_L1, full_off_L1, round_starts, out, scratch, M, N, L, capacity_rows,
        round_idx, scratch.shape[0], pq.stride(0), pq.stride(1), ps.stride(0), qq.stride(0), qq.stride(1),
        qs.stride(0), out.stride(0), out.stride(1), scratch.stride(0), scratch.stride(1),
        FP32_DOT=interpret, INTERPRET=interpret, EVEN_M=M % cfg.block_m == 0, EVEN_N=N % cfg.block_n == 0,
        L_PAD=pow2(L), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=True,
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
