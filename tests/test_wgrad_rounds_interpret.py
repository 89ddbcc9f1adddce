"""Weight gradients of an exchange in several rounds (megamoe.ops.wgrad_rounds) on CPU, TRITON_INTERPRET=1.

Proves, against the one-round k-grouped GEMM over all rows (megamoe.ops.k_grouped_mm) and float64, with the
rounds cut as the protocol cuts them (at expert boundaries, an expert cut only when it has more than C rows;
the model in tests/ep_utils.py): experts wholly inside one round (round 0 or a later one, exactly C rows, or
without rows) are bitwise the one-round result; experts of more than C rows, split over two or more rounds,
are within 2x PyTorch's own fp32 error; the split slots need no zero fill (NaN-poisoned); rows past a
round's end are never read (NaN-poisoned); a round without rows, or a round-0 launch for a routing with no
split expert, writes nothing; the number of slots is min(R // (C + 1), L); rows overflowing the launched
rounds write nothing past the slots; bad arguments raise ValueError. In block-scaled FP8
(fp8_k_grouped_round, C a multiple of 128): every expert, split or whole, is bitwise the one-round FP8 weight
gradient over all rows, and a C that is not a multiple of 128 is refused.

Legend: L local experts, C capacity rows per round, R rows in all rounds, M / N the gradient's sizes,
S split slots.

Run: python -m pytest tests/test_wgrad_rounds_interpret.py -q (each case runs in a process with
TRITON_INTERPRET=1: tests/interpreter.py).
"""

import pytest
import torch

from ep_utils import model_rounds, offsets_of
from interpreter import interpreted
from megamoe.ops import k_grouped_mm, tile_offsets_for
from megamoe.ops.fp8_gemm import fp8_k_grouped_mm
from megamoe.ops.fp8_quant import quantize_128x1_grouped
from megamoe.ops.wgrad_rounds import finalize_split, fp8_k_grouped_round, k_grouped_round, split_slots

M, N = 20, 36  # not multiples of the interpreter's 16 x 16 tiles


def _rounds_wgrad(P, Q, counts, C, rounds):
    """Production order: round 0's one-round GEMM, then k_grouped_round per round, then finalize."""
    L, R = len(counts), P.shape[0]
    full = torch.tensor(offsets_of(counts), dtype=torch.int32)
    starts = model_rounds(counts, C, rounds)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    scratch = torch.full((split_slots(R, C, L), M, N), float("nan"))  # no zero fill needed
    out = None
    for r in range(rounds):
        lo, n = starts[r], starts[r + 1] - starts[r]
        Pr, Qr = torch.full((C, M), float("nan")), torch.full((C, N), float("nan"))  # past the rows: poison
        Pr[:n], Qr[:n] = P[lo:lo + n], Q[lo:lo + n]
        roff = (full - lo).clamp(0, n).to(torch.int32)
        if r == 0:
            out = k_grouped_mm(Pr, Qr, roff)
        k_grouped_round(Pr, Qr, roff, full, starts_t, out, scratch, round_idx=r, capacity_rows=C)
    finalize_split(scratch, full, out, capacity_rows=C)
    return out


@pytest.mark.parametrize("counts,C,extra_rounds", [
    ([0, 5, 9, 3, 0, 12, 1], 8, 1),  # two experts above C split, the others whole in later rounds; unused round
    ([2, 40, 1], 8, 0),              # one expert across six rounds
    ([8, 8, 3], 8, 1),               # experts of exactly C rows: none split
    ([5, 9, 9, 2], 9, 0),            # whole experts of C rows in later rounds
    ([3, 0, 4], 16, 2),              # everything in round 0, two unused rounds (the W >= 4 default case)
    ([0, 0, 0], 8, 2),               # no rows at all: exact zeros
    ([7] * 9, 16, 0),                # many experts over several rounds, none split
])
@interpreted
def test_rounds_match_one_round(counts, C, extra_rounds):
    off = offsets_of(counts)
    R = off[-1]
    table = model_rounds(counts, C, R + 1)
    rounds = max(1, sum(1 for a, b in zip(table, table[1:]) if b > a)) + extra_rounds
    g = torch.Generator().manual_seed(len(counts) * 100 + C)
    P, Q = torch.randn(R, M, generator=g), torch.randn(R, N, generator=g)
    full = torch.tensor(off, dtype=torch.int32)
    one = k_grouped_mm(P, Q, full)
    got = _rounds_wgrad(P, Q, counts, C, rounds)
    assert not got.isnan().any()
    split = [c > C for c in counts]
    assert sum(split) <= split_slots(R, C, len(counts))
    for e, (lo, hi) in enumerate(zip(off[:-1], off[1:])):
        if not split[e]:
            assert torch.equal(got[e], one[e]), f"expert {e} (rows {lo}:{hi}) differs from one round"
            continue
        ref64 = P[lo:hi].double().T @ Q[lo:hi].double()
        torch_err = (P[lo:hi].T @ Q[lo:hi] - ref64).abs().max().item()
        err = (got[e].double() - ref64).abs().max().item()
        assert err <= 2 * torch_err + 1e-6, (e, err, torch_err)


@interpreted
def test_a_round_without_rows_writes_nothing():
    """What makes an unused round cheap: no program of a round without rows (or of round 0 when no
    expert is split) stores anything."""
    L, C = 5, 8
    full = torch.tensor([0, 3, 3, 7, 8, 8], dtype=torch.int32)  # 8 rows: round 0 only, no split
    starts = torch.tensor([0, 8, 8, 8], dtype=torch.int32)
    P, Q = torch.randn(C, M), torch.randn(C, N)
    sentinel = torch.full((L, M, N), 7.0)
    scratch = torch.full((2, M, N), 5.0)
    for r, roff in ((0, full), (1, torch.full((L + 1,), 0, dtype=torch.int32)),
                    (2, torch.full((L + 1,), 0, dtype=torch.int32))):
        out = sentinel.clone()
        k_grouped_round(P, Q, roff, full, starts, out, scratch, round_idx=r, capacity_rows=C)
        assert torch.equal(out, sentinel) and bool((scratch == 5.0).all()), f"round {r} wrote"
    finalize_split(scratch, full, out, capacity_rows=C)
    assert torch.equal(out, sentinel), "finalize wrote without a split expert"


@interpreted
def test_overflowing_rows_write_nothing_past_the_slots():
    """Rows beyond what the workspace was sized for (an overflow the schedule reports as an error) can make
    more split experts than slots; the kernel skips those, so the memory after the S slots stays untouched."""
    L, C, rounds = 3, 4, 3
    counts = [6, 6, 6]  # 18 rows, every expert above C; sized for 8 rows: one slot
    full = torch.tensor(offsets_of(counts), dtype=torch.int32)
    starts = model_rounds(counts, C, rounds)
    S = split_slots(8, C, L)
    assert S == 1 and starts[-1] < 18
    big = torch.full((S + 1, M, N), 3.0)  # one guard slot past the scratch
    out = torch.zeros(L, M, N)
    for r in range(rounds):
        P, Q = torch.randn(C, M), torch.randn(C, N)
        roff = (full - starts[r]).clamp(0, starts[r + 1] - starts[r]).to(torch.int32)
        k_grouped_round(P, Q, roff, full, torch.tensor(starts, dtype=torch.int32), out, big[:S], round_idx=r,
                        capacity_rows=C)
    finalize_split(big[:S], full, out, capacity_rows=C)
    assert bool((big[S] == 3.0).all()), "a split expert past the slots was written"


@interpreted
def test_split_slots():
    assert split_slots(8, 8, 16) == 0 and split_slots(100, 8, 16) == 11 and split_slots(1000, 8, 16) == 16
    with pytest.raises(ValueError, match="capacity_rows"):
        split_slots(8, 0, 16)


@interpreted
def test_bad_arguments_raise():
    L, C = 3, 8
    full = torch.zeros(L + 1, dtype=torch.int32)
    starts = torch.zeros(2, dtype=torch.int32)
    P, Q = torch.randn(C, M), torch.randn(C, N)
    out, scratch = torch.zeros(L, M, N), torch.zeros(2, M, N)
    with pytest.raises(ValueError, match="scratch"):
        k_grouped_round(P, Q, full, full, starts, out, scratch.double(), round_idx=0, capacity_rows=C)
    with pytest.raises(ValueError, match="roff_L1"):
        k_grouped_round(P, Q, full[:-1], full, starts, out, scratch, round_idx=0, capacity_rows=C)
    with pytest.raises(ValueError, match="same R"):
        k_grouped_round(P, Q[:-1], full, full, starts, out, scratch, round_idx=0, capacity_rows=C)
    with pytest.raises(ValueError, match="capacity_rows"):
        k_grouped_round(P, Q, full, full, starts, out, scratch, round_idx=0, capacity_rows=0)
    with pytest.raises(ValueError, match="round_starts"):
        k_grouped_round(P, Q, full, full, starts, out, scratch, round_idx=1, capacity_rows=C)
    with pytest.raises(ValueError, match="out"):
        finalize_split(scratch, full, out[:, :, :4].transpose(1, 2), capacity_rows=C)


def _fp8_blocks(P, Q, off):
    """Both operands of the FP8 weight gradient as the FP8 recipe makes them: 128x1 blocks from each expert's
    first row, block-padded and K-major; plus the 128-row block table."""
    blocks = tile_offsets_for(off, 128)
    return (*quantize_128x1_grouped(P, off, None, blocks, kmajor=True),
            *quantize_128x1_grouped(Q, off, None, blocks, kmajor=True), blocks)


@pytest.mark.parametrize("counts,C,extra_rounds", [
    ([0, 300, 5, 129, 128, 0, 40], 128, 1),  # experts of 300 and 129 rows split (3 and 2 pieces); an unused round
    ([2, 700, 1], 256, 0),                   # one expert across three rounds, its last piece not a full block
    ([128, 128, 3], 128, 1),                 # experts of exactly C rows: none split, later rounds whole
])
@interpreted
def test_fp8_rounds_are_bitwise_the_one_round_gradient(counts, C, extra_rounds):
    """The FP8 recipe's order: round 0's one-round GEMM, the round kernel per round, finalize. Poisoned: the
    round buffers past the round's rows (NaN), the slots (NaN: no zero fill needed)."""
    off = offsets_of(counts)
    R = off[-1]
    table = model_rounds(counts, C, R + 1)
    rounds = sum(1 for a, b in zip(table, table[1:]) if b > a) + extra_rounds
    starts = model_rounds(counts, C, rounds)
    assert starts[-1] == R
    g = torch.Generator().manual_seed(R + C)
    P, Q = torch.randn(R, M, generator=g), torch.randn(R, N, generator=g) * 3
    full = torch.tensor(off, dtype=torch.int32)
    pq, ps, qq, qs, blocks = _fp8_blocks(P, Q, full)
    one = fp8_k_grouped_mm(pq, ps, qq, qs, full, block_offsets_E1=blocks, padded=True, out_dtype=torch.float32)
    starts_t = torch.tensor(starts, dtype=torch.int32)
    scratch = torch.full((split_slots(R, C, len(counts)), M, N), float("nan"))
    out = None
    for r in range(rounds):
        lo, n = starts[r], starts[r + 1] - starts[r]
        Pr, Qr = torch.full((C, M), float("nan")), torch.full((C, N), float("nan"))
        Pr[:n], Qr[:n] = P[lo:lo + n], Q[lo:lo + n]
        roff = (full - lo).clamp(0, n).to(torch.int32)
        rq = _fp8_blocks(Pr, Qr, roff)
        if r == 0:
            out = fp8_k_grouped_mm(*rq[:4], roff, block_offsets_E1=rq[4], padded=True, out_dtype=torch.float32)
        fp8_k_grouped_round(*rq[:4], roff, rq[4], full, starts_t, out, scratch, round_idx=r, capacity_rows=C)
    finalize_split(scratch, full, out, capacity_rows=C)
    split = [c > C for c in counts]
    assert any(split) == (max(counts) > C)
    for e in range(len(counts)):
        assert torch.equal(out[e], one[e]), f"expert {e} ({counts[e]} rows, split: {split[e]}) differs from one round"


@interpreted
def test_fp8_round_refuses_a_capacity_off_the_blocks():
    L, C = 2, 192
    full = torch.zeros(L + 1, dtype=torch.int32)
    starts = torch.zeros(2, dtype=torch.int32)
    pq, ps, qq, qs, blocks = _fp8_blocks(torch.randn(C, M), torch.randn(C, N), full)
    out, scratch = torch.zeros(L, M, N), torch.zeros(1, M, N)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_k_grouped_round(pq, ps, qq, qs, full, blocks, full, starts, out, scratch, round_idx=0, capacity_rows=C)
    with pytest.raises(ValueError, match="pq"):
        fp8_k_grouped_round(pq[:-1], ps, qq, qs, full, blocks, full, starts, out, scratch, round_idx=0,
                            capacity_rows=256)
