"""Triton kernels of the expert-parallel dispatch / combine protocol (``@triton.jit`` code only).

Legend: W EP world size, E global experts, L = E / W local experts, T tokens of the owner, K top-k,
D hidden, N = T*K (token, slot) rows, C receive capacity (rows per round), R rows received by a rank,
q = l*W + s a receive segment (local expert l, source rank s), BM/BD/BT block sizes.

Peer memory is reached through ``ptrs_ptr``, an int64 [W] table of every rank's pool base address as
mapped in this process; region byte offsets come from ``megamoe.distributed``. The flags region sits at
byte 0 of the pool: word 0 = epoch, word 1 = status, ``READY + s`` and ``READY + W + d`` the per-peer
flags. Producer side: data stores, then (in a later kernel or after ``tl.debug_barrier``) one
``atomic_xchg(flag, epoch, sem="release", scope="sys")``. Consumer side: a bounded spin of
``atomic_add(flag, 0, sem="acquire", scope="sys")`` (lowered to ``ld.global.sys.acquire``). A wait that
expires writes ``stage << 24 | peer << 16 | epoch & 0xffff`` into the status word (first error wins, by
compare-and-swap) and later waits return at once, so a dead peer never hangs the stream (the spin and
status-word helpers live in megamoe.kernels.flags).

Schedule table (int32, local), offsets in :data:`SCHED_*`: ``[0]`` R, ``[1]`` epoch, ``TOK + s`` global
token offset of rank s (``TOK + W`` = global T), and per segment q: ``SEG_CNT`` rows, ``SEG_START``
first receive row, ``SEG_SRC`` first index in the source's expert-sorted row list; ``EXP_OFF + l``
(l = 0..L) the receive offsets of the local experts; ``RND + r`` (r = 0..rounds, ``RND = EXP_OFF + L + 1``)
the first receive row of round r (the last entry is R when every row fits the launched rounds). Receive
rows are ordered by (local expert, source rank, source token, slot) = (expert, global token, slot).

Rounds are cut at expert boundaries (:func:`_round_end`): round r holds rows ``[RND + r, RND + r + 1)``, at
most C, and only an expert with more than C rows is cut inside (into C-row pieces), so every other expert's
rows sit in one round, in the same order as in one big round: its GEMMs and weight gradient are those of
one round, bit for bit. Two consecutive rounds (the first not the last) together hold more than C rows, so
``2 * ceil(R / C)`` rounds always suffice (``megamoe.distributed.max_rounds`` gives the exact bound).
"""

import triton
import triton.language as tl

from .flags import fence_proxy_async_global, status_code, wait_at_least

SCHED_TOK = 8
SCHED_SEG = 80  # SEG_CNT = 80, SEG_START = 80 + E, SEG_SRC = 80 + 2E, EXP_OFF = 80 + 3E, RND = 80 + 3E + L + 1


@triton.jit
def _peer_i32(base, byte_off):
    return (base + byte_off).to(tl.pointer_type(tl.int32))


@triton.jit
def _flag_bad_ids(bad, flags_ptr, rank):
    """If ``bad`` ids were seen, write the bad-id status (stage 3, the epoch this exchange will have; the
    first error wins by compare-and-swap)."""
    if bad > 0:
        epoch = tl.load(flags_ptr) + 1
        tl.atomic_cas(flags_ptr + 1, 0, status_code(3, rank, epoch), sem="relaxed", scope="gpu")


@triton.jit
def ep_plan_scan_kernel(ids_ptr, plan_ptr, sorted_ptr, flags_ptr, N, T, E, rank, BLOCK: tl.constexpr):
    """Owner's routing plan for small T*K*E, one program per global expert e: ``plan[4 + e]`` = rows with
    id e and the stable counting sort ``sorted[off_e + j]`` = j-th flat row ``t*K + k`` with id e
    (ascending). No atomics, so positions are deterministic. Program 0 writes ``plan[0] = T`` and flags
    bad ids. Every program scans all N ids twice (O(E*N)): larger plans take the device sort and
    :func:`ep_plan_kernel`, which give the same list."""
    e = tl.program_id(0)
    lt = 0
    bad = 0
    start = 0
    while start < N:
        offs = start + tl.arange(0, BLOCK)
        m = offs < N
        ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
        lt += tl.sum((m & (ids < e) & (ids >= 0)).to(tl.int32), axis=0)
        bad += tl.sum((m & ((ids < 0) | (ids >= E))).to(tl.int32), axis=0)
        start += BLOCK
    run = 0
    start = 0
    while start < N:
        offs = start + tl.arange(0, BLOCK)
        m = offs < N
        ids = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
        hit = (m & (ids == e)).to(tl.int32)
        pos = run + tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_ptr + lt + pos, offs, mask=hit != 0)
        run += tl.sum(hit, axis=0)
        start += BLOCK
    tl.store(plan_ptr + 4 + e, run)  # rows with id e
    if e == 0:
        tl.store(plan_ptr, T)
        _flag_bad_ids(bad, flags_ptr, rank)


@triton.jit
def ep_plan_kernel(ids_ptr, offsets_ptr, plan_ptr, flags_ptr, N, T, E, rank, BLOCK: tl.constexpr,
                   E_PAD: tl.constexpr):
    """Owner's routing-plan header and id check for large T*K*E, one program per BLOCK ids (the
    expert-sorted row list itself comes from a stable device sort, megamoe.ops.routing.expert_sort). Program 0 writes
    ``plan[0] = T`` and ``plan[4 + e]`` = rows with id e (from the sort's offsets ``offsets[0..E]``);
    a program that finds an id outside [0, E) writes the bad-id status (first error wins)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    ids = tl.load(ids_ptr + offs, mask=m, other=0)
    bad = tl.sum((m & ((ids < 0) | (ids >= E))).to(tl.int32), axis=0)
    if pid == 0:
        ei = tl.arange(0, E_PAD)
        lo = tl.load(offsets_ptr + ei, mask=ei < E, other=0)
        hi = tl.load(offsets_ptr + 1 + ei, mask=ei < E, other=0)
        tl.store(plan_ptr + 4 + ei, hi - lo, mask=ei < E)
        tl.store(plan_ptr, T)
    _flag_bad_ids(bad, flags_ptr, rank)


@triton.jit
def ep_signal_kernel(ptrs_ptr, flags_ptr, rank, WORD0: tl.constexpr, W: tl.constexpr, BUMP: tl.constexpr):
    """One program. ``BUMP``: advance the local epoch first (start of an exchange). Then publish the
    epoch into word ``WORD0 + rank`` of every rank's flags (release, system scope): with
    ``WORD0 = READY`` "my plan and rows are staged", with ``WORD0 = READY + W`` "my pushes are done"."""
    epoch = tl.load(flags_ptr)
    if BUMP:
        epoch += 1
        tl.store(flags_ptr, epoch)
    tl.debug_barrier()
    for s in tl.static_range(W):
        base = tl.load(ptrs_ptr + s)
        tl.atomic_xchg(_peer_i32(base, 0) + WORD0 + rank, epoch, sem="release", scope="sys")


@triton.jit
def _round_table(sched_ptr, L, E: tl.constexpr):
    """Pointer to the schedule's round table, ``RND = EXP_OFF + L + 1`` (module docstring)."""
    return sched_ptr + 80 + 3 * E + L + 1


@triton.jit
def _round_end(cand, cand_ok, start, total, C):
    """End row of the round that starts at row ``start``: R if the rest fits in C rows; else the last expert
    start in (start, start + C] (``cand``: the experts' first rows, ``cand_ok`` masking the padding); else,
    when one expert covers all of those rows (more than C of its own), ``start + C``."""
    hi = start + C
    best = tl.max(tl.where(cand_ok & (cand > start) & (cand <= hi), cand, -1), axis=0)
    return tl.where(hi >= total, total, tl.where(best > start, best, hi))


@triton.jit
def ep_schedule_kernel(ptrs_ptr, flags_ptr, sched_ptr, rank, L, C, rounds, max_iters, timeout_ns,
                       PLAN_OFF, READY: tl.constexpr, W: tl.constexpr, E: tl.constexpr,
                       W_PAD: tl.constexpr, E_PAD: tl.constexpr, L_PAD: tl.constexpr,
                       USE_TIMER: tl.constexpr, FILL: tl.constexpr = 64):
    """One program on the destination: wait for every source's plan, read the sources' per-expert
    counts from their memory and build the schedule table (module docstring), round table included: the
    ``rounds`` rounds of at most C rows each cut by :func:`_round_end`; rows left over after them (impossible
    while every plan is within the workspace's T_cap * K rows, megamoe.distributed.max_rounds) set the
    overflow status (stage 4) instead of being dropped silently."""
    epoch = tl.load(flags_ptr)
    status_ptr = flags_ptr + 1
    for s in tl.static_range(W):
        wait_at_least(flags_ptr + READY + s, epoch, status_ptr, status_code(1, s, epoch), max_iters,
                       timeout_ns, USE_TIMER)
    lw = tl.arange(0, L_PAD)
    ws = tl.arange(0, W_PAD)
    ei = tl.arange(0, E_PAD)
    cnt = tl.zeros([L_PAD, W_PAD], dtype=tl.int32)
    src0 = tl.zeros([L_PAD, W_PAD], dtype=tl.int32)
    tok = tl.zeros([W_PAD], dtype=tl.int32)
    for s in tl.static_range(W):
        plan = _peer_i32(tl.load(ptrs_ptr + s), PLAN_OFF)
        all_e = tl.load(plan + 4 + ei, mask=ei < E, other=0)
        below = tl.sum(tl.where(ei < rank * L, all_e, 0), axis=0)  # rows of experts before ours
        mine = tl.load(plan + 4 + rank * L + lw, mask=lw < L, other=0)
        start = below + tl.cumsum(mine, axis=0) - mine
        col = (ws == s)[None, :]
        cnt = tl.where(col, mine[:, None], cnt)
        src0 = tl.where(col, start[:, None], src0)
        tok = tl.where(ws == s, tl.load(plan), tok)
    exp_tot = tl.sum(cnt, axis=1)
    exp_off = tl.cumsum(exp_tot, axis=0) - exp_tot
    seg_start = exp_off[:, None] + tl.cumsum(cnt, axis=1) - cnt
    total = tl.sum(exp_tot, axis=0)
    q = lw[:, None] * W + ws[None, :]
    m2 = (lw[:, None] < L) & (ws[None, :] < W)
    tl.store(sched_ptr + 80 + q, cnt, mask=m2)
    tl.store(sched_ptr + 80 + E + q, seg_start, mask=m2)
    tl.store(sched_ptr + 80 + 2 * E + q, src0, mask=m2)
    tl.store(sched_ptr + 80 + 3 * E + lw, exp_off, mask=lw < L)
    tl.store(sched_ptr + 80 + 3 * E + L, total)
    tl.store(sched_ptr + 8 + ws, tl.cumsum(tok, axis=0) - tok, mask=ws < W)
    tl.store(sched_ptr + 8 + W, tl.sum(tok, axis=0))
    tl.store(sched_ptr, total)
    tl.store(sched_ptr + 1, epoch)
    # round table: greedy cuts at expert starts (the candidates exp_off[0..L-1] and R at index L)
    rnd_ptr = _round_table(sched_ptr, L, E)
    cand = tl.where(lw < L, exp_off, total)
    tl.store(rnd_ptr, 0)
    row = total * 0
    r = 0
    while (r < rounds) & (row < total):
        row = _round_end(cand, lw <= L, row, total, C)
        r += 1
        tl.store(rnd_ptr + r, row)
    fill = r + 1 + tl.arange(0, FILL)  # the unused rounds' entries: empty rounds at R
    while tl.min(fill, axis=0) <= rounds:
        tl.store(rnd_ptr + fill, total, mask=fill <= rounds)
        fill += FILL
    if row < total:
        tl.atomic_cas(status_ptr, 0, status_code(4, rank, epoch), sem="relaxed", scope="gpu")


@triton.jit
def _round_rows(sched_ptr, round_idx, L, C, E: tl.constexpr):
    """(first receive row, rows) of round ``round_idx`` from the schedule's round table (rows clamped to
    [0, C], so that a corrupt table can never index past the round buffers)."""
    rnd_ptr = _round_table(sched_ptr, L, E)
    start = tl.load(rnd_ptr + round_idx)
    n = tl.minimum(tl.maximum(tl.load(rnd_ptr + round_idx + 1) - start, 0), C)
    return start, n


@triton.jit
def _write_round_offsets(sched_ptr, roff_ptr, round_start, n, L, E: tl.constexpr, L_PAD: tl.constexpr):
    """``roff[0..L]``: the local experts' offsets clamped to the round's rows ``[round_start, round_start + n)``."""
    lo = tl.arange(0, L_PAD)
    eo = tl.load(sched_ptr + 80 + 3 * E + lo, mask=lo <= L, other=0)
    eo = tl.minimum(tl.maximum(eo - round_start, 0), n)
    tl.store(roff_ptr + lo, eo, mask=lo <= L)


@triton.jit
def ep_round_offsets_kernel(sched_ptr, roff_ptr, round_idx, C, L, E: tl.constexpr, L_PAD: tl.constexpr):
    """One program: round ``round_idx``'s local expert offsets ``roff[0..L]`` (what :func:`ep_dispatch_kernel`'s
    program 0 writes), for a GEMM whose m-tile table must exist before the pull runs beside it."""
    round_start, n = _round_rows(sched_ptr, round_idx, L, C, E)
    _write_round_offsets(sched_ptr, roff_ptr, round_start, n, L, E, L_PAD)


@triton.jit
def _block_sources(ptrs_ptr, sched_ptr, rowtab_ptr, i, qi, round_start, n, C, K, SORTED_OFF, W: tl.constexpr,
                   E: tl.constexpr):
    """Receive rows ``i`` of a round of n rows: segment q (binary search by comparison), source s = q % W,
    the flat source row read from the source's sorted list, token = row // K, slot = row % K; writes the row table
    ``rowtab[0/1/2, i]`` = (source, token, slot) (-1 source for unused rows). Returns (used rows, source pool
    base, flat source row, token)."""
    g = round_start + i
    valid = i < n
    starts = tl.load(sched_ptr + 80 + E + qi, mask=qi < E, other=2147483647)
    cnts = tl.load(sched_ptr + 80 + qi, mask=qi < E, other=0)
    hit = (starts[None, :] <= g[:, None]) & (cnts[None, :] > 0)
    q = tl.max(tl.where(hit, qi[None, :], -1), axis=1)
    q = tl.where(valid, q, 0)
    j = g - tl.load(sched_ptr + 80 + E + q)
    s = q % W
    base = tl.load(ptrs_ptr + s)
    srow = tl.load(_peer_i32(base, SORTED_OFF) + tl.load(sched_ptr + 80 + 2 * E + q) + j, mask=valid, other=0)
    tok = srow // K
    slot = srow % K
    tl.store(rowtab_ptr + i, tl.where(valid, s, -1), mask=i < C)
    tl.store(rowtab_ptr + C + i, tok, mask=i < C)
    tl.store(rowtab_ptr + 2 * C + i, slot, mask=i < C)
    return valid, base, srow, tok


@triton.jit
def _copy_block_rows(base, srow, tok, valid, i, xr_ptr, gr_ptr, wr_ptr, C, D, WEIGHTS_OFF, ROWS_OFF, CH1_ELEMS,
                     BD: tl.constexpr, BWD: tl.constexpr, ALIGNED: tl.constexpr, PULL_X: tl.constexpr):
    """Copy the used rows ``i`` of a round from their sources (token ``tok`` of the pool at ``base``): the x rows
    (PULL_X) into ``xr``, and with BWD the output-gradient rows into ``gr`` and the routing weights (flat row
    ``srow``) into ``wr``; BD columns at a time."""
    DT = xr_ptr.dtype.element_ty
    src_rows = (base + ROWS_OFF).to(tl.pointer_type(DT))
    if ALIGNED:
        src_rows = tl.multiple_of(src_rows, 16)
    src_rows = src_rows + tok.to(tl.int64) * D
    if BWD:
        w = tl.load((base + WEIGHTS_OFF).to(tl.pointer_type(tl.float32)) + srow, mask=valid, other=0.0)
        tl.store(wr_ptr + i, w, mask=i < C)
    i64 = i.to(tl.int64)
    d0 = 0
    while d0 < D:
        dd = d0 + tl.arange(0, BD)
        m = valid[:, None] & (dd < D)[None, :]
        if PULL_X:
            x = tl.load(src_rows[:, None] + dd[None, :], mask=m, other=0.0)
            tl.store(xr_ptr + i64[:, None] * D + dd[None, :], x, mask=m)
        if BWD:
            go = tl.load(src_rows[:, None] + CH1_ELEMS + dd[None, :], mask=m, other=0.0)
            tl.store(gr_ptr + i64[:, None] * D + dd[None, :], go, mask=m)
        d0 += BD


@triton.jit
def ep_dispatch_kernel(ptrs_ptr, sched_ptr, rowtab_ptr, roff_ptr, xr_ptr, gr_ptr, wr_ptr, ready_ptr, round_idx, C, D,
                       K, L, SORTED_OFF, WEIGHTS_OFF, ROWS_OFF, CH1_ELEMS,
                       W: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, L_PAD: tl.constexpr,
                       BM: tl.constexpr, BD: tl.constexpr, BWD: tl.constexpr, ALIGNED: tl.constexpr = False,
                       PULL_X: tl.constexpr = True, READY: tl.constexpr = False, PDL: tl.constexpr = False):
    """Pull round ``round_idx``'s receive rows (``[RND + r, RND + r + 1)`` of the schedule, at most C) into the
    local round buffer, in blocks of BM rows: program p takes blocks p, p + programs, ... (one block each
    with the usual grid of ceil(C / BM) programs).

    Row i: segment q (binary search by comparison), source s = q % W, flat source row read from the source's
    sorted list, token = row // K, slot = row % K. Writes the row table ``rowtab[0/1/2, i]`` = (source, token,
    slot) (-1 source for unused rows), the round's local expert offsets ``roff[0..L]`` (program 0; not with
    ``READY``, whose caller wrote them first, :func:`ep_round_offsets_kernel`), and copies x rows (``BWD``: also
    the owner's output-gradient rows into ``gr`` and the row's routing weight into ``wr`` (fp32)). ``PULL_X``
    False (backward only): no x rows, the destination already holds them (the forward's, kept) or does not
    need them. Blocks of an unused round only mark their rows unused. ``READY``: after a used block's stores,
    ``ready[1 + block] = 1`` (release, GPU scope), for an m-grouped GEMM running beside the pull
    (megamoe.ops.ep_tiles.RowPull; ``ready[0]`` is that GEMM's tile counter). ``PDL``: first let the next
    kernel of the stream launch (programmatic dependent launch: it starts once every program of this grid is
    resident, so its spins can never keep this pull from an SM). ``ALIGNED``: every pool base is 16-byte
    aligned (``EPWorkspace.aligned``; the region offsets are multiples of 256 and D of 16), which lets the row
    loads be 16-byte vectors: the compiler cannot know it of an address loaded from the pointer table, and
    without it reads each row two bytes at a time.
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    round_start, n = _round_rows(sched_ptr, round_idx, L, C, E)
    if not READY:
        if pid == 0:
            _write_round_offsets(sched_ptr, roff_ptr, round_start, n, L, E, L_PAD)
    qi = tl.arange(0, E_PAD)
    blk = pid
    while blk * BM < C:
        i = blk * BM + tl.arange(0, BM)
        if blk * BM >= n:
            tl.store(rowtab_ptr + i, -1, mask=i < C)
        else:
            valid, base, srow, tok = _block_sources(ptrs_ptr, sched_ptr, rowtab_ptr, i, qi, round_start, n, C, K,
                                                    SORTED_OFF, W, E)
            _copy_block_rows(base, srow, tok, valid, i, xr_ptr, gr_ptr, wr_ptr, C, D, WEIGHTS_OFF, ROWS_OFF,
                             CH1_ELEMS, BD, BWD, ALIGNED, PULL_X)
            if READY:  # every thread's stores of the block before the one release store
                if PDL:  # on the GPU: the GEMM may read these rows through TMA (it fences on its side too)
                    fence_proxy_async_global()
                tl.debug_barrier()
                tl.atomic_xchg(ready_ptr + 1 + blk, 1, sem="release", scope="gpu")
        blk += tl.num_programs(0)


@triton.jit
def ep_push_kernel(ptrs_ptr, sched_ptr, rowtab_ptr, y_ptr, dot_ptr, round_idx, C, D, K, L, P, SLOTS_OFF, DOTS_OFF,
                   E: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, HAS_DOT: tl.constexpr,
                   P_POW2: tl.constexpr, HAS_ROWS: tl.constexpr = True, ALIGNED: tl.constexpr = False):
    """Push round row i of ``y`` into slot (token, slot) of its owner's slot buffer (each slot once);
    ``HAS_DOT``: also the row's P fp32 partial dots into the owner's ``dots[(token*K + slot)*P ...]``.
    ``HAS_ROWS`` False: the dots only (the rows were stored by the GEMM's epilogue, ops.ep_comm.push_target).
    ``ALIGNED``: as in :func:`ep_dispatch_kernel` (16-byte row stores)."""
    pid = tl.program_id(0)
    _, n = _round_rows(sched_ptr, round_idx, L, C, E)
    if pid * BM >= n:
        return
    i = pid * BM + tl.arange(0, BM)
    valid = i < n
    s = tl.load(rowtab_ptr + i, mask=valid, other=0)
    valid = valid & (s >= 0)
    s = tl.maximum(s, 0)
    tok = tl.load(rowtab_ptr + C + i, mask=valid, other=0).to(tl.int64)
    slot = tl.load(rowtab_ptr + 2 * C + i, mask=valid, other=0).to(tl.int64)
    DT = y_ptr.dtype.element_ty
    base = tl.load(ptrs_ptr + s)
    dst = (base + SLOTS_OFF).to(tl.pointer_type(DT))
    if ALIGNED:
        dst = tl.multiple_of(dst, 16)
    dst = dst + (tok * K + slot) * D
    i64 = i.to(tl.int64)
    if HAS_DOT:
        pp = tl.arange(0, P_POW2)
        mp = valid[:, None] & (pp < P)[None, :]
        part = tl.load(dot_ptr + i64[:, None] * P + pp[None, :], mask=mp)
        ddst = (base + DOTS_OFF).to(tl.pointer_type(tl.float32)) + (tok * K + slot) * P
        tl.store(ddst[:, None] + pp[None, :], part, mask=mp)
    if HAS_ROWS:
        d0 = 0
        while d0 < D:
            dd = d0 + tl.arange(0, BD)
            m = valid[:, None] & (dd < D)[None, :]
            y = tl.load(y_ptr + i64[:, None] * D + dd[None, :], mask=m)
            tl.store(dst[:, None] + dd[None, :], y, mask=m)
            d0 += BD


@triton.jit
def ep_wait_done_kernel(flags_ptr, max_iters, timeout_ns, DONE: tl.constexpr, W: tl.constexpr,
                        USE_TIMER: tl.constexpr):
    """One program on the owner: wait until every rank has pushed all rows of this exchange."""
    epoch = tl.load(flags_ptr)
    for s in tl.static_range(W):
        wait_at_least(flags_ptr + DONE + s, epoch, flags_ptr + 1, status_code(2, s, epoch), max_iters,
                       timeout_ns, USE_TIMER)
