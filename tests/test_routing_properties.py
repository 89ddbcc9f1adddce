"""Property tests (hypothesis) of the device routing plan, against a plain-Python statement of it.

For any routing the brief allows (T = 0..300 tokens, top-k 1..16, E up to 512 experts; ids anywhere in
[0, E), with ties, empty and hot experts, duplicated ids within a token as a user's own router may give),
``build_routing_plan`` (a stable device sort, a binary search, a scatter; run here on the CPU) must give
exactly: rows ordered by (expert, token, slot), per-expert counts and offsets, token / slot / source of
each row (with the token offset of an EP caller), the inverse map; and ``tile_offsets_for`` the first
m-tile of each expert for any BLOCK_M. Integers, so compared bit-exactly.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megamoe.ops import build_routing_plan
from megamoe.ops.routing import tile_offsets_for


@st.composite
def routings(draw):
    E = draw(st.sampled_from([1, 2, 3, 8, 64, 256, 512]))
    K = draw(st.integers(1, min(16, max(E, 1))))
    T = draw(st.integers(0, 300 if E * K <= 4096 else 40))
    style = draw(st.sampled_from(["uniform", "hot", "one_expert", "few"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if style == "uniform":
        ids = torch.randint(0, E, (T, K), generator=g)
    elif style == "hot":  # expert E-1 in every token's first slot, the rest anywhere
        ids = torch.randint(0, E, (T, K), generator=g)
        ids[:, :1] = E - 1
    elif style == "one_expert":
        ids = torch.full((T, K), draw(st.integers(0, E - 1)), dtype=torch.int64)
    else:  # two experts only: long ties in the sort key, all others empty
        ids = torch.randint(0, min(2, E), (T, K), generator=g)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    offset = draw(st.sampled_from([0, 1, 4096]))
    return ids.to(dtype), E, offset


@settings(max_examples=150, deadline=None)
@given(routings())
def test_plan_equals_plain_python(case):
    ids, E, offset = case
    T, K = ids.shape
    flat = ids.reshape(-1).tolist()
    order = sorted(range(T * K), key=lambda i: (flat[i], i // K, i % K))  # (expert, token, slot)
    counts = [flat.count(e) for e in range(E)]
    offsets = [sum(counts[:e]) for e in range(E + 1)]
    row_of = [0] * (T * K)
    for r, i in enumerate(order):
        row_of[i] = r

    plan = build_routing_plan(ids, E, token_offset=offset)
    want = dict(counts_E=counts, offsets_E1=offsets, row_src_N=order, row_token_N=[i // K + offset for i in order],
                row_slot_N=[i % K for i in order], row_of_TK=row_of)
    for name, values in want.items():
        got = getattr(plan, name)
        assert got.dtype == torch.int32, name
        assert got.reshape(-1).tolist() == values, name
    assert plan.row_of_TK.shape == (T, K) and plan.num_experts == E and plan.top_k == K

    for block_m in (16, 64, 128):
        tiles = [0]
        for c in counts:
            tiles.append(tiles[-1] + -(-c // block_m))
        assert tile_offsets_for(plan.offsets_E1, block_m).tolist() == tiles
        assert plan.tile_offsets(block_m).tolist() == tiles
