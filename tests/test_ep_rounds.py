"""The receive-round bound of the EP exchange (megamoe.distributed.max_rounds) against the round table's rule
(modelled in tests/ep_utils.py, the model the interpreter protocol tests hold the schedule kernel to).

Proves, for any per-expert row counts a rank can receive (hypothesis; repeated ids in a token allowed, so one
expert may take every row): ``max_rounds`` rounds always hold every row, no round holds more than C, and only
experts of more than C rows are cut, every C rows from their first row; the bound is reached by adversarial
routings with an even and an odd number of rounds (so it cannot be lowered), and one round is launched exactly when
the worst case fits.
Also the default capacity's round counts at the presets' shapes, which docs/ep.md states.

Legend: W EP ranks, T_cap token capacity, K top-k, E experts, L = E / W, C capacity rows, R rows received.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_utils import check_round_table, model_rounds
from megamoe.distributed import WorkspaceSpec, default_capacity_rows, max_received_rows, max_rounds


def _spec(W, T, K, E):
    return WorkspaceSpec(W, T, 64, K, E, torch.bfloat16)


@st.composite
def _receive(draw):
    """(spec, C, counts): a workspace, a capacity and per-local-expert row counts within its worst case."""
    W = draw(st.sampled_from([1, 2, 4, 8]))
    L = draw(st.integers(1, 12))
    K = draw(st.integers(1, min(16, W * L)))
    T = draw(st.integers(1, 40))
    spec = _spec(W, T, K, W * L)
    R_max = max_received_rows(spec)
    C = draw(st.integers(1, R_max + 5))
    # repeated ids in a token are allowed, so an expert can receive up to every row one rank can receive
    counts = draw(st.lists(st.integers(0, R_max), min_size=L, max_size=L))
    while sum(counts) > R_max:  # trim to what one rank can receive
        i = max(range(L), key=lambda j: counts[j])
        counts[i] -= min(counts[i], sum(counts) - R_max)
    return spec, C, counts


@settings(max_examples=400, deadline=None)
@given(_receive())
def test_max_rounds_always_hold_every_row(case):
    spec, C, counts = case
    check_round_table(model_rounds(counts, C, max_rounds(spec, C)), counts, C)


def test_the_bound_is_reached():
    """Alternating 1-row and C-row experts (ending on a 1-row one or not): every round holds one expert; for R
    rows that is max_rounds, for an even and an odd number of rounds."""
    C = 8
    for n in range(2, 11):
        counts = [1 if i % 2 == 0 else C for i in range(n)]
        R = sum(counts)
        # a workspace whose worst case is exactly R rows: W = 1, T_cap = R, K = 1 (R_bound = R)
        spec = _spec(1, R, 1, n)
        assert max_received_rows(spec) == R
        starts = model_rounds(counts, C, max_rounds(spec, C))
        used = sum(1 for a, b in zip(starts, starts[1:]) if b > a)
        assert used == max_rounds(spec, C) == n, (used, max_rounds(spec, C), counts)


def test_one_round_exactly_when_the_worst_case_fits():
    spec = _spec(2, 100, 4, 16)
    R = max_received_rows(spec)
    assert max_rounds(spec, R) == 1 and max_rounds(spec, R + 1) == 1 and max_rounds(spec, R - 1) == 2


def test_default_capacity_rounds_at_preset_shapes():
    """deepseek-v3 routing (E = 256, K = 8), T_cap = 4096: one round up to W = 2, 3 at W = 4, 7 at W = 8."""
    got = {W: max_rounds(_spec(W, 4096, 8, 256), default_capacity_rows(_spec(W, 4096, 8, 256)))
           for W in (1, 2, 4, 8)}
    assert got == {1: 1, 2: 1, 4: 3, 8: 7}, got
