"""The expert-parallel pieces of the m-grouped GEMM (megamoe.kernels.grouped_gemm), ``@triton.jit`` code only.

Legend: R rows of the GEMM's expert-grouped row buffer, BLOCK_M rows of an m-tile, N output columns, W EP ranks.

Prologue, a GEMM beside the pull of its own rows (``WAIT_PULL``; host side megamoe.ops.ep_tiles.RowPull):
the tiles come from an int32 counter ``pull_ptr[0]`` in increasing order (programs that start late, their SM
being the pull's, take fewer tiles instead of holding up the end; which program computes a tile never changes
it), each tile first waits (bounded, GPU scope) for the ready flags ``pull_ptr[1 + b]`` of the PULL_BM-row
blocks b its rows lie in, and at its end the grid waits for the pull's grid (programmatic dependent launch), so
the stream's next kernel sees every pulled row. A flag that never comes writes STAGE_PULL into the EP
workspace's status word (megamoe.kernels.flags).

Epilogue, result rows into the owners' slots (``PUSH``; host side megamoe.ops.ep_tiles.RowPush): row r of
the GEMM is stored at row ``token * push_k + slot`` of the buffer ``push_deltas[src]`` elements from C, with
(src, token, slot) the columns r of the row table ``push_tab`` [3, push_c] (src < 0: not stored).
"""

import triton
import triton.language as tl

from .flags import STAGE_PULL, fence_proxy_async_global, wait_flag_gpu


@triton.jit
def first_tile(pull_ptr, WAIT_PULL: tl.constexpr):
    """This program's first tile: the next one from the counter (WAIT_PULL), else the program id."""
    if WAIT_PULL:
        tile = tl.atomic_add(pull_ptr, 1, sem="relaxed", scope="gpu")
    else:
        tile = tl.program_id(0)
    return tile


@triton.jit
def next_tile(tile, pull_ptr, WAIT_PULL: tl.constexpr):
    """This program's tile after ``tile``: the next one from the counter (WAIT_PULL), else one grid further."""
    if WAIT_PULL:
        tile = tl.atomic_add(pull_ptr, 1, sem="relaxed", scope="gpu")
    else:
        tile += tl.num_programs(0)
    return tile


@triton.jit
def wait_for_rows(pull_ptr, pull_flags_ptr, pull_rank, pull_max_iters, pull_timeout_ns, row_start, row_end,
                  BLOCK_M: tl.constexpr, PULL_BM: tl.constexpr, PULL_TIMER: tl.constexpr, TMA_A: tl.constexpr):
    """Wait until the blocks of A rows a tile stores, ``[row_start, min(row_end, row_start + BLOCK_M))``, and
    their row scales have landed; with TMA_A, then a proxy fence (the rows were written through the generic
    proxy, TMA reads them through the async one)."""
    blk = row_start // PULL_BM
    while blk * PULL_BM < tl.minimum(row_end, row_start + BLOCK_M):
        wait_flag_gpu(pull_ptr + 1 + blk, 1, pull_flags_ptr, pull_rank, STAGE_PULL, pull_max_iters,
                      pull_timeout_ns, PULL_TIMER)
        blk += 1
    if TMA_A:
        fence_proxy_async_global()


@triton.jit
def end_after_pull(PULL_GDC: tl.constexpr):
    """With a programmatic dependent launch (PULL_GDC), this grid ends after the pull's: what the stream runs
    next sees every row the pull wrote, also those of blocks no tile waited for."""
    if PULL_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def push_rows(push_tab_ptr, push_deltas_ptr, rows, mask_m, push_c, push_k, N):
    """(element offset of each row's destination from C, rows stored): row r goes to row (token * push_k +
    slot) of its source rank's buffer (N columns). Called before the K loop, so that the dependent loads (row
    table, then the rank's offset) overlap it."""
    src = tl.load(push_tab_ptr + rows, mask=mask_m, other=-1)
    push_mask = mask_m & (src >= 0)
    tok = tl.load(push_tab_ptr + push_c + rows, mask=push_mask, other=0).to(tl.int64)
    slot = tl.load(push_tab_ptr + 2 * push_c + rows, mask=push_mask, other=0).to(tl.int64)
    # multiples of 16 elements (RowPush's contract): keeps the stores 16-byte vectors
    delta = tl.multiple_of(tl.load(push_deltas_ptr + tl.maximum(src, 0), mask=push_mask, other=0), 16)
    return delta + (tok * push_k + slot) * N, push_mask
