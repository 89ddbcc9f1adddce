"""The expert-parallel m-grouped GEMM kernels: the local kernel's tile body (megamoe.kernels.grouped_gemm) with an
EP prologue or epilogue around it, and those pieces; ``@triton.jit`` code only.

Legend: R rows of the GEMM's expert-grouped row buffer, BLOCK_M rows of an m-tile, N output columns, W EP ranks.

``m_grouped_pull_kernel``, a GEMM beside the pull of its own rows (host side megamoe.ops.ep_tiles.RowPull): the
tiles come from an int32 counter ``pull_ptr[0]`` in increasing order (:func:`take_tile`; programs that start
late, their SM being the pull's, take fewer tiles instead of holding up the end; which program computes a tile
never changes it), each tile first waits (bounded, GPU scope) for the ready flags ``pull_ptr[1 + b]`` of the
PULL_BM-row blocks b its rows lie in (:func:`wait_for_rows`), and at its end the grid waits for the pull's grid
(programmatic dependent launch, :func:`end_after_pull`), so the stream's next kernel sees every pulled row. A
flag that never comes writes STAGE_PULL into the EP workspace's status word (megamoe.kernels.flags).

``m_grouped_push_kernel``, a plain-epilogue GEMM storing its result rows into the owners' slots (host side
megamoe.ops.ep_tiles.RowPush): row r of the GEMM is stored at row ``token * push_k + slot`` of the buffer
``push_deltas[src]`` elements from C, with (src, token, slot) the columns r of the row table ``push_tab``
[3, push_c] (src < 0: not stored; :func:`push_rows`), so the result rows go straight into their owners' slots,
local or a peer's (NVLink). The offsets are multiples of 16 elements, so the stores stay 16-byte vectors
(without that promise the compile held one address per element and spilled ~9 KB per thread).

Between prologue and epilogue both run the local kernel's helpers (m_tile_rows, m_tile_product, m_tile_store /
row_scaled), so a tile's arithmetic, and its bits, are the local kernel's.
"""

import triton
import triton.language as tl

from .flags import STAGE_PULL, fence_proxy_async_global, wait_flag_gpu
from .grouped_gemm import PLAIN, m_tile_product, m_tile_rows, m_tile_store, row_scaled


@triton.jit
def take_tile(pull_ptr):
    """The next tile from the counter ``pull_ptr[0]`` (tiles in increasing order over the grid)."""
    return tl.atomic_add(pull_ptr, 1, sem="relaxed", scope="gpu")


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


@triton.jit
def m_grouped_pull_kernel(
    # inputs (A's rows not gathered: they are the pull's receive buffer)
    a_ptr, a_desc, b_ptr, b_desc, row_offsets_ptr, tile_offsets_ptr, scale_ptr, gu_ptr,
    # outputs
    c_ptr, aux_ptr, dot_ptr,
    # the pull: int32 [1 + blocks] tile counter then one ready flag per PULL_BM rows of A; the EP workspace's
    # flags (epoch, status) for a timeout; this rank; spin bounds
    pull_ptr, pull_flags_ptr, pull_rank, pull_max_iters, pull_timeout_ns,
    # shapes, strides (as megamoe.kernels.grouped_gemm.m_grouped_gemm_kernel)
    num_rows, N, num_experts, K: tl.constexpr,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_gm, stride_xm,
    # variant (as m_grouped_gemm_kernel's), then the pull's block rows, GPU-timer spins, programmatic launch
    EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, SAVE_AUX: tl.constexpr, HAS_DOT: tl.constexpr,
    FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, E_POW2: tl.constexpr, TMA_A: tl.constexpr,
    TMA_B: tl.constexpr, B_ROWS: tl.constexpr, PULL_BM: tl.constexpr, PULL_TIMER: tl.constexpr,
    PULL_GDC: tl.constexpr,
    # tile config
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_N: tl.constexpr,
):
    """The m-grouped GEMM beside the pull of its rows: tiles from the counter, each first waiting for its rows
    (:func:`wait_for_rows`), then the local kernel's tile body; the grid ends after the pull's."""
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    tile = take_tile(pull_ptr)
    while tile < num_tiles:
        expert, n_tile, row_start, row_end, offs_m, mask_m = m_tile_rows(tile, num_n_tiles, tile_offsets_ptr,
                                                                         row_offsets_ptr, num_experts, E_POW2,
                                                                         BLOCK_M)
        wait_for_rows(pull_ptr, pull_flags_ptr, pull_rank, pull_max_iters, pull_timeout_ns, row_start, row_end,
                      BLOCK_M, PULL_BM, PULL_TIMER, TMA_A)
        rows = tl.minimum(offs_m, num_rows - 1).to(tl.int64)  # clamped rows: computed, never stored
        acc, acc_up, offs_n, mask_n = m_tile_product(
            a_ptr, a_desc, a_ptr, b_ptr, b_desc, expert, row_start, n_tile, rows, mask_m, N, stride_am, stride_ak,
            stride_be, stride_bn, stride_bk, K, EPILOGUE, False, FP32_DOT, EVEN_K, EVEN_N, TMA_A, TMA_B, B_ROWS,
            BLOCK_M, BLOCK_N, BLOCK_K)
        m_tile_store(acc, acc_up, n_tile, rows, offs_m, mask_m, offs_n, mask_n, scale_ptr, gu_ptr, c_ptr, aux_ptr,
                     dot_ptr, N, stride_cm, stride_gm, stride_xm, EPILOGUE, HAS_SCALE, SAVE_AUX, HAS_DOT, BLOCK_M,
                     BLOCK_N, DOT_N)
        tile = take_tile(pull_ptr)
    end_after_pull(PULL_GDC)


@triton.jit
def m_grouped_push_kernel(
    # inputs
    a_ptr, a_desc, a_idx_ptr, b_ptr, b_desc, row_offsets_ptr, tile_offsets_ptr, scale_ptr,
    # output: this rank's destination buffer; the push: element offsets [W] int64 of each rank's buffer from C's,
    # row table [3, push_c] int32, slots per token
    c_ptr, push_deltas_ptr, push_tab_ptr, push_c, push_k,
    # shapes, strides (as megamoe.kernels.grouped_gemm.m_grouped_gemm_kernel)
    num_rows, N, num_experts, K: tl.constexpr,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk,
    # variant (as m_grouped_gemm_kernel's; the epilogue is PLAIN)
    HAS_GATHER: tl.constexpr, HAS_SCALE: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, E_POW2: tl.constexpr, TMA_A: tl.constexpr, TMA_B: tl.constexpr, B_ROWS: tl.constexpr,
    # tile config
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The plain m-grouped GEMM storing its rows into their owners' slots: the local kernel's tile body, each
    row's destination loaded before the K loop (:func:`push_rows`), the scaled accumulator stored there."""
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(tile_offsets_ptr + num_experts) * num_n_tiles
    tile = tl.program_id(0)
    while tile < num_tiles:
        expert, n_tile, row_start, row_end, offs_m, mask_m = m_tile_rows(tile, num_n_tiles, tile_offsets_ptr,
                                                                         row_offsets_ptr, num_experts, E_POW2,
                                                                         BLOCK_M)
        rows = tl.minimum(offs_m, num_rows - 1).to(tl.int64)  # clamped rows: computed, never stored
        push_dest, push_mask = push_rows(push_tab_ptr, push_deltas_ptr, rows, mask_m, push_c, push_k, N)
        acc, _, offs_n, mask_n = m_tile_product(
            a_ptr, a_desc, a_idx_ptr, b_ptr, b_desc, expert, row_start, n_tile, rows, mask_m, N, stride_am,
            stride_ak, stride_be, stride_bn, stride_bk, K, PLAIN, HAS_GATHER, FP32_DOT, EVEN_K, EVEN_N, TMA_A, TMA_B,
            B_ROWS, BLOCK_M, BLOCK_N, BLOCK_K)
        acc = row_scaled(acc, scale_ptr, rows, HAS_SCALE)
        c_ptrs = c_ptr + push_dest[:, None] + offs_n[None, :]
        mask = push_mask[:, None] & mask_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        tile += tl.num_programs(0)
