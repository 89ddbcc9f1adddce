"""Weight gradients of an exchange processed in several rounds (``@triton.jit`` only; launchers in
megamoe.ops.wgrad_rounds).

Legend: L local experts, C capacity rows per round, M / N the weight gradient's sizes, S split slots.

Expert e's received rows are ``[off[e], off[e+1])`` of the whole receive order (all rounds, ``full_off``);
round r holds rows ``[rs[r], rs[r+1])`` of it (at most C; the round table of kernels/ep_comm.py), with
round-local offsets ``roff``. Rounds are cut at expert boundaries, so only an expert with more than C rows is
*split* across rounds (``off[e+1] - off[e] > C``): at most ``R // (C + 1)`` and at most L of them, and split
expert number j (in expert order) owns fp32 slot j.
Round 0's weight gradient is the ordinary one-round GEMM (any kernel of the table) into the bf16 output;
:func:`k_grouped_round_kernel` then, in round 0, starts the split experts' fp32 partial sums, and in
rounds r >= 1 stores the experts wholly in round r straight into the output (the rows from the expert's
first row in BLOCK_K chunks, as every k-grouped kernel: the same bits as one round) and continues the
split experts' partial sums; :func:`split_finalize_kernel` casts the split slots into the output. Experts
without rows in a round are not touched, so a round the routing did not need costs a launch whose
programs exit at once. :func:`fp8_k_grouped_round_kernel` does the same on block-scaled FP8 operands (128-row
blocks from each expert's first row of the round; C a multiple of 128, so a split expert's pieces start on its
own blocks).
"""

import triton
import triton.language as tl

from .fp8_gemm import wgrad_block
from .grouped_gemm import k_step


@triton.jit
def _split_of(full_off_ptr, L, C, L_PAD: tl.constexpr):
    """(idx, split, lo) over the L experts: whether expert idx has more rows than a round holds (then the round
    table cuts it into pieces of C rows), and its first row in the whole receive order."""
    idx = tl.arange(0, L_PAD)
    valid = idx < L
    lo = tl.load(full_off_ptr + idx, mask=valid, other=0)
    hi = tl.load(full_off_ptr + idx + 1, mask=valid, other=0)
    return idx, valid & (hi - lo > C), lo


@triton.jit
def _pick(idx, vec, i):
    """vec[i] of an L_PAD vector (a masked sum: one value per program, no gather)."""
    return tl.sum(tl.where(idx == i, vec, 0), axis=0)


@triton.jit
def _round_tiles(roff_ptr, full_off_ptr, rstart_ptr, M, N, L, C, round_idx, S, L_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This round's active tiles: the (expert, m-tile, n-tile) tiles of experts with rows in the round that are
    split (any round) or whole (rounds >= 1), experts slowest. Returns (idx, cum, n_act, total, rs_v, re_v, si,
    slot_v, cont_v): per expert its inclusive tile count prefix, tile count, round rows [rs, re), split flag,
    split slot, and whether it continues a sum of earlier rounds (split, and not the expert's first round)."""
    idx, split_v, lo_v = _split_of(full_off_ptr, L, C, L_PAD)
    valid = idx < L
    round_start = tl.load(rstart_ptr + round_idx)
    rs_v = tl.load(roff_ptr + idx, mask=valid, other=0)
    re_v = tl.load(roff_ptr + idx + 1, mask=valid, other=0)
    tiles_per_expert = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    si = split_v.to(tl.int32)
    slot_v = tl.cumsum(si, axis=0) - si  # slot of each split expert
    # more split experts than slots only when the rows overflow the launched rounds, which the schedule
    # reports as an error (status code); their tiles are skipped so that nothing is written past the S slots
    active = valid & (re_v > rs_v) & (split_v | (round_idx > 0)) & ~(split_v & (slot_v >= S))
    n_act = tl.where(active, tiles_per_expert, 0)
    cum = tl.cumsum(n_act, axis=0)  # inclusive: active tiles of experts <= e
    cont_v = (split_v & (round_start > lo_v)).to(tl.int32)
    return idx, cum, n_act, tl.sum(n_act, axis=0), rs_v, re_v, si, slot_v, cont_v


@triton.jit
def _tile_of(t, idx, cum, n_act, rs_v, re_v, si, slot_v, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Active tile t: (expert, its round rows [row_start, row_end), split flag, split slot, offs_m, offs_n,
    mask_m, mask_n)."""
    expert = tl.sum(tl.where(cum <= t, 1, 0), axis=0)  # the first expert whose tiles reach past t
    local = t - (_pick(idx, cum, expert) - _pick(idx, n_act, expert))
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = (local // num_n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (local % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (expert, _pick(idx, rs_v, expert), _pick(idx, re_v, expert), _pick(idx, si, expert) > 0,
            _pick(idx, slot_v, expert), offs_m, offs_n, offs_m < M, offs_n < N)


@triton.jit
def _slot_tile(s_ptr, slot, offs_m, offs_n, stride_se, stride_sm):
    """Pointers of the tile in split slot ``slot`` (made where used: a 2-D tile of 64-bit pointers kept across the
    reduction would take as many registers as the accumulator)."""
    return s_ptr + slot.to(tl.int64) * stride_se + offs_m.to(tl.int64)[:, None] * stride_sm + offs_n[None, :]


@triton.jit
def _start_acc(s_ptr, slot, offs_m, offs_n, mask, cont, stride_se, stride_sm, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The tile's starting sum: a split expert's slot from its earlier rounds (``cont``), else zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if cont:
        acc = tl.load(_slot_tile(s_ptr, slot, offs_m, offs_n, stride_se, stride_sm), mask=mask, other=0.0)
    return acc


@triton.jit
def _store_tile(acc, split, s_ptr, slot, c_ptr, expert, offs_m, offs_n, mask, stride_se, stride_sm, stride_ce,
                stride_cm):
    """A split expert's fp32 partial into its slot; a whole expert's sum cast into the output."""
    if split:
        tl.store(_slot_tile(s_ptr, slot, offs_m, offs_n, stride_se, stride_sm), acc, mask=mask)
    else:
        c_tile = (c_ptr + expert.to(tl.int64) * stride_ce + offs_m.to(tl.int64)[:, None] * stride_cm
                  + offs_n[None, :])
        tl.store(c_tile, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_grouped_round_kernel(
    # inputs: this round's rows, its local expert offsets [L + 1], the whole receive order's [L + 1], the
    # round table [rounds + 1]
    p_ptr, q_ptr, roff_ptr, full_off_ptr, rstart_ptr,
    # outputs: the weight gradient [L, M, N] and the fp32 split slots [S, M, N], last dimensions contiguous
    c_ptr, s_ptr,
    # shapes, round
    M, N, L, C, round_idx, S,
    # strides, in elements
    stride_pr, stride_pm, stride_qr, stride_qn, stride_ce, stride_cm, stride_se, stride_sm,
    # variant
    FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    L_PAD: tl.constexpr,
    # tile config
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Persistent over this round's active tiles (:func:`_round_tiles`). Every program first derives that tile
    list from the two offset tables (vector loads), so in a round without such experts (an unused round; round 0
    without a split expert) every program exits after those loads."""
    idx, cum, n_act, total, rs_v, re_v, si, slot_v, cont_v = _round_tiles(
        roff_ptr, full_off_ptr, rstart_ptr, M, N, L, C, round_idx, S, L_PAD, BLOCK_M, BLOCK_N)
    t = tl.program_id(0)
    while t < total:
        expert, row_start, row_end, split, slot, offs_m, offs_n, mask_m, mask_n = _tile_of(
            t, idx, cum, n_act, rs_v, re_v, si, slot_v, M, N, BLOCK_M, BLOCK_N)
        mask = mask_m[:, None] & mask_n[None, :]
        acc = _start_acc(s_ptr, slot, offs_m, offs_n, mask, _pick(idx, cont_v, expert) > 0, stride_se, stride_sm,
                         BLOCK_M, BLOCK_N)
        num_iters = tl.cdiv(row_end - row_start, BLOCK_K)
        if INTERPRET:  # the interpreter cannot range() over a loaded bound
            it = 0
            while it < num_iters:
                acc = k_step(acc, it, row_start, row_end, p_ptr, roff_ptr, q_ptr, roff_ptr, offs_m, offs_n,
                              mask_m, mask_n, stride_pr, stride_pm, stride_qr, stride_qn, False, False, FP32_DOT,
                              EVEN_M, EVEN_N, BLOCK_K)
                it += 1
        else:
            for it in range(0, num_iters):
                acc = k_step(acc, it, row_start, row_end, p_ptr, roff_ptr, q_ptr, roff_ptr, offs_m, offs_n,
                              mask_m, mask_n, stride_pr, stride_pm, stride_qr, stride_qn, False, False, FP32_DOT,
                              EVEN_M, EVEN_N, BLOCK_K)
        _store_tile(acc, split, s_ptr, slot, c_ptr, expert, offs_m, offs_n, mask, stride_se, stride_sm, stride_ce,
                    stride_cm)
        t += tl.num_programs(0)


@triton.jit
def fp8_k_grouped_round_kernel(
    # inputs: this round's 128x1 blocks, block-padded (block b = rows [128b, 128b + 128), e4m3, any strides) with
    # their scales [NB, M] / [NB, N]; the round's local expert offsets [L + 1] and their 128-row block table
    # [L + 1]; the whole receive order's offsets [L + 1]; the round table [rounds + 1]
    pq_ptr, ps_ptr, qq_ptr, qs_ptr, roff_ptr, boff_ptr, full_off_ptr, rstart_ptr,
    # outputs: the weight gradient [L, M, N] and the fp32 split slots [S, M, N], last dimensions contiguous
    c_ptr, s_ptr,
    # shapes, round
    M, N, L, C, round_idx, S,
    # strides, in elements (scales' last dimension contiguous)
    stride_pr, stride_pm, stride_psb, stride_qr, stride_qn, stride_qsb, stride_ce, stride_cm, stride_se, stride_sm,
    # variant
    FP32_DOT: tl.constexpr, INTERPRET: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    L_PAD: tl.constexpr,
    # tile config (the reduction walks blocks of 128 rows)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """:func:`k_grouped_round_kernel` on block-scaled FP8 operands: each tile reduces its expert's 128-row blocks
    of the round in order with the promotion of megamoe.kernels.fp8_gemm (``acc + dot * scales``, fp32), from
    zeros or from the split expert's slot. C is a multiple of 128, so a split expert's pieces start on its own
    128-row blocks and the chain of fp32 operations is the one-round kernel's, bit for bit."""
    idx, cum, n_act, total, rs_v, re_v, si, slot_v, cont_v = _round_tiles(
        roff_ptr, full_off_ptr, rstart_ptr, M, N, L, C, round_idx, S, L_PAD, BLOCK_M, BLOCK_N)
    bo_v = tl.load(boff_ptr + idx, mask=idx < L, other=0)
    t = tl.program_id(0)
    while t < total:
        expert, row_start, row_end, split, slot, offs_m, offs_n, mask_m, mask_n = _tile_of(
            t, idx, cum, n_act, rs_v, re_v, si, slot_v, M, N, BLOCK_M, BLOCK_N)
        mask = mask_m[:, None] & mask_n[None, :]
        first_block = _pick(idx, bo_v, expert)
        p_cols = offs_m.to(tl.int64) * stride_pm
        q_cols = offs_n.to(tl.int64) * stride_qn
        acc = _start_acc(s_ptr, slot, offs_m, offs_n, mask, _pick(idx, cont_v, expert) > 0, stride_se, stride_sm,
                         BLOCK_M, BLOCK_N)
        num_blocks = tl.cdiv(row_end - row_start, 128)
        if INTERPRET:  # the interpreter cannot range() over a loaded bound
            j = 0
            while j < num_blocks:
                acc = wgrad_block(acc, j, row_start, row_end, first_block, pq_ptr, ps_ptr, qq_ptr, qs_ptr, offs_m,
                                  offs_n, p_cols, q_cols, mask_m, mask_n, stride_pr, stride_psb, stride_qr,
                                  stride_qsb, FP32_DOT, True, EVEN_M, EVEN_N)
                j += 1
        else:
            for j in range(0, num_blocks):
                acc = wgrad_block(acc, j, row_start, row_end, first_block, pq_ptr, ps_ptr, qq_ptr, qs_ptr, offs_m,
                                  offs_n, p_cols, q_cols, mask_m, mask_n, stride_pr, stride_psb, stride_qr,
                                  stride_qsb, FP32_DOT, True, EVEN_M, EVEN_N)
        _store_tile(acc, split, s_ptr, slot, c_ptr, expert, offs_m, offs_n, mask, stride_se, stride_sm, stride_ce,
                    stride_cm)
        t += tl.num_programs(0)


@triton.jit
def split_finalize_kernel(s_ptr, full_off_ptr, c_ptr, MN, L, C, L_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(M*N, BLOCK), S): cast split slot j into the output of the j-th split expert (if any)."""
    slot = tl.program_id(1)
    idx, split, _ = _split_of(full_off_ptr, L, C, L_PAD)
    si = split.to(tl.int32)
    nth = tl.cumsum(si, axis=0) - si  # slot of each split expert
    expert = tl.max(tl.where(split & (nth == slot), idx, -1), axis=0)
    if expert >= 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < MN
        v = tl.load(s_ptr + slot.to(tl.int64) * MN + offs, mask=m)
        tl.store(c_ptr + expert.to(tl.int64) * MN + offs, v.to(c_ptr.dtype.element_ty), mask=m)
