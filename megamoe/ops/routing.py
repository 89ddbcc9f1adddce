"""Device-side routing plan: per-expert counts and offsets, expert-grouped row order, inverse map.

Legend: T tokens, K slots (top-k), E experts, N = T*K (token, slot) rows, E1 = E + 1 (offsets),
H = 4 + E words of an EP owner's plan header.

One builder, :func:`build_routing_plan`, for both paths: the single-GPU path takes the whole
:class:`RoutingPlan`; an expert-parallel owner passes ``pool`` (:class:`PoolPlan`, views of its symmetric
pool) and gets the same expert-sorted row list and per-expert counts written there for its peers.

The plan is built with a handful of PyTorch device ops (a stable sort, a binary search, a scatter); no
value is ever read back to the host, so it is CUDA-graph capturable and clean under
``torch.cuda.set_sync_debug_mode("error")``. All outputs are fixed-size (N rows, E + 1 offsets) and
exact (integers), bitwise equal to the plain-PyTorch construction in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton

from ..kernels import ep_comm as ep_kernels
from ..kernels.grouped_gemm import tile_offsets_kernel
from ._common import is_interpreted, pow2

__all__ = ["RoutingPlan", "PoolPlan", "build_routing_plan", "expert_sort", "tile_offsets_for", "single_group_offsets",
           "chunk_offsets", "cached_tile_offsets", "SCAN_MAX"]

# EP owner plans with N * E up to this take the per-expert scan kernel, larger ones the device sort (the same
# list either way); module-level so tests can force the sort. Inside the exchange the sort path took 0.18 ms
# (mok-bench, N = 24576, E = 384, EP=2 on two H200s, 2026-11-30, where this bound
# was 8M) against 0.08 ms for the scan at the same size in earlier runs, so the bound sits where the scan
# reaches ~0.2 ms (16M; chosen from those numbers, not re-measured at 16M).
SCAN_MAX = 16 << 20


@dataclass(frozen=True)
class RoutingPlan:
    """Expert-grouped order of the N = T*K (token, slot) rows, sorted by (expert, token, slot).

    Fields (int32 device tensors unless noted):
        counts_E: (E,) ``counts_E[e]`` is the number of rows routed to expert e.
        offsets_E1: (E+1,) exclusive prefix sum of counts: expert e owns rows
            ``offsets_E1[e]:offsets_E1[e+1]``; ``offsets_E1[E] == N``.
        row_src_N: (N,) ``row_src_N[r] = t*K + k``: the flat (token, slot) index of row r (local t).
        row_token_N: (N,) token index of row r, ``t + token_offset``.
        row_slot_N: (N,) slot k of row r.
        row_of_TK: (T, K) inverse map: the row of (t, k); ``row_src_N[row_of_TK[t, k]] == t*K + k``.
        num_experts: E.  top_k: K.
    """

    counts_E: torch.Tensor
    offsets_E1: torch.Tensor
    row_src_N: torch.Tensor
    row_token_N: torch.Tensor
    row_slot_N: torch.Tensor
    row_of_TK: torch.Tensor
    num_experts: int
    top_k: int
    _tiles: dict = field(default_factory=dict, compare=False, repr=False)

    def tile_offsets(self, block_m: int) -> torch.Tensor:
        """(E+1,) int32 exclusive prefix sum of ``ceil(counts_E / block_m)`` (cached per block_m)."""
        if block_m not in self._tiles:
            self._tiles[block_m] = tile_offsets_for(self.offsets_E1, block_m)
        return self._tiles[block_m]


@dataclass(frozen=True)
class PoolPlan:
    """Where an expert-parallel owner's plan goes: views of its symmetric pool (megamoe.distributed), which the
    peers read to build their receive schedules.

    Fields:
        header_H: int32 (4 + E,) ``[0]`` = T, ``[4 + e]`` = rows routed to expert e.
        sorted_rows: int32 (>= N,) ``sorted_rows[:N]`` = the flat rows ``t*K + k`` in (expert, token, slot)
            order (the single-GPU plan's ``row_src_N``).
        flags: int32 flag words of the workspace: an id outside [0, E) writes the bad-id status (stage 3)
            into ``flags[1]``, which ``EPWorkspace.check`` raises.
        rank: this rank, named in that status.
    """

    header_H: torch.Tensor
    sorted_rows: torch.Tensor
    flags: torch.Tensor
    rank: int


def tile_offsets_for(offsets_E1: torch.Tensor, block_m: int) -> torch.Tensor:
    """(E+1,) int32: ``tile_offsets[e]`` is the first m-tile of group e for BLOCK_M = block_m (no sync).

    offsets_E1: (E+1,) non-decreasing group offsets (counts >= 0). On CUDA (and under TRITON_INTERPRET=1) one
    small Triton kernel computes it (five PyTorch ops cost ~0.13 ms of host time per call, and the
    fused layer calls this up to nine times a step); plain CPU tensors
    (and int64 or non-contiguous offsets) take the PyTorch ops. The same integers either way for valid
    offsets; the kernel launches on the current CUDA device, like the GEMMs that use it."""
    E = offsets_E1.shape[0] - 1
    if offsets_E1.dtype == torch.int32 and offsets_E1.is_contiguous() and (
            offsets_E1.is_cuda or is_interpreted(tile_offsets_kernel)):
        tiles_E1 = torch.empty_like(offsets_E1)
        tile_offsets_kernel[(1,)](offsets_E1, tiles_E1, E, BLOCK_M=block_m, E_POW2=pow2(E), num_warps=4,
                                   enable_fp_fusion=True)
        return tiles_E1
    counts_E = offsets_E1[1:] - offsets_E1[:-1]
    tiles_E1 = torch.zeros_like(offsets_E1)
    torch.cumsum(torch.div(counts_E + (block_m - 1), block_m, rounding_mode="floor"), 0, out=tiles_E1[1:])
    return tiles_E1


_ONE_GROUP = "one group of rows"  # tile-cache key of offsets whose one group's row count the host knows


def single_group_offsets(num_rows: int, device: torch.device, tile_cache: dict | None = None) -> torch.Tensor:
    """(2,) int32 [0, num_rows] built on the device without a host-to-device copy (one arange). With a
    ``tile_cache`` (the m-grouped launchers' dict), the launchers that get this tensor and that dict build its
    m-tile offsets [0, ceil(num_rows / BLOCK_M)] from the host-known row count (one arange, no tile-offsets
    kernel; :func:`cached_tile_offsets`)."""
    offsets_2 = chunk_offsets(num_rows, 1, device)
    if tile_cache is not None:
        tile_cache[(_ONE_GROUP, offsets_2.data_ptr())] = num_rows
    return offsets_2


def cached_tile_offsets(offsets_E1: torch.Tensor, block_m: int, tile_cache: dict | None) -> torch.Tensor:
    """The m-tile offsets of ``offsets_E1`` for ``block_m`` (:func:`tile_offsets_for`'s integers) through
    ``tile_cache`` (keyed by the offsets' data_ptr, length and block_m; valid while the offsets' values do not
    change): cached, else for offsets that :func:`single_group_offsets` recorded there as one group of host-known
    rows one arange, else :func:`tile_offsets_for`; stored in the cache."""
    if tile_cache is None:
        return tile_offsets_for(offsets_E1, block_m)
    key = (offsets_E1.data_ptr(), offsets_E1.shape[0], block_m)
    tiles_E1 = tile_cache.get(key)
    if tiles_E1 is None:
        rows = tile_cache.get((_ONE_GROUP, offsets_E1.data_ptr())) if offsets_E1.shape[0] == 2 else None
        tiles_E1 = (tile_offsets_for(offsets_E1, block_m) if rows is None
                    else chunk_offsets(-(-rows // block_m), 1, offsets_E1.device))
        tile_cache[key] = tiles_E1
    return tiles_E1


def chunk_offsets(num_rows: int, chunks: int, device: torch.device) -> torch.Tensor:
    """(chunks + 1,) int32 group offsets of ``num_rows`` rows cut into ``chunks`` fixed chunks in row order:
    ``min(c * ceil(num_rows / chunks), num_rows)`` (the last chunks shorter, or empty when num_rows < chunks).
    Built on the device from host integers (one or two small launches, no copy, no sync)."""
    if chunks < 1:
        raise ValueError(f"chunk_offsets: chunks must be >= 1, got {chunks!r}")
    step = max(1, -(-num_rows // chunks))
    offsets = torch.arange(0, chunks * step + 1, step, dtype=torch.int32, device=device)
    return offsets if chunks * step == num_rows else offsets.clamp_max_(num_rows)


def expert_sort(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of the flat (token, slot) rows by expert id, on the device, without a host sync.

    Returns (offsets_E1, order_N): (E+1,) int32 with ``offsets_E1[e]`` = the number of rows with an id
    below e (ids in [0, E) assumed; callers validate), and (N,) int64 flat rows ``t*K + k`` ordered by
    (expert, token, slot): the stable sort keeps the flat order, which already orders (token, slot).
    A device radix sort (one pass per key byte, so the keys are narrowed to int16 / int32 first); exact
    integers, so independent of run and device. Shared by the single-GPU routing plan and the EP owner's
    plan for large T*K*E (megamoe.ops.ep_comm.routing_plan).
    """
    keys_N = topk_ids_TK.reshape(-1)
    # narrow keys: the device radix sort makes one pass per key byte (H200, N = 32768: 92 us with int16
    # keys, 130 us with int64); ids outside [0, E) may wrap here, they are rejected by the callers' checks
    keys_N = keys_N.to(torch.int16 if num_experts < 2**15 - 1 else torch.int32)
    sorted_ids_N, order_N = torch.sort(keys_N, stable=True)
    bounds = torch.arange(num_experts + 1, device=topk_ids_TK.device, dtype=sorted_ids_N.dtype)
    return torch.searchsorted(sorted_ids_N, bounds, out_int32=True), order_N


def build_routing_plan(topk_ids_TK: torch.Tensor, num_experts: int, *, token_offset: int = 0,
                       pool: PoolPlan | None = None) -> RoutingPlan | None:
    """Build the routing plan of ``topk_ids_TK`` on its device, without a host sync.

    Args:
        topk_ids_TK: (T, K) int32 or int64 expert ids, each in [0, E) (not checked here: the functional
            entry checks it with a sync-free device assert; with ``pool`` the device also flags bad ids).
        num_experts: E.
        token_offset: added to the token index in ``row_token_N`` (a global token index for EP callers).
        pool: an EP owner's pool views (:class:`PoolPlan`): write the plan's counts and expert-sorted rows
            there instead of returning a plan. Up to ``SCAN_MAX`` of N*E (N = T*K, host-known, so ranks with
            different T may take different ways; the lists are exact either way) one program per expert scans
            every id (no sort); above it, the device sort of the single-GPU plan plus a header kernel. H200,
            one GPU, each step alone (2026-11-30; scan vs sort): N = 16384, E = 256: 48 vs 83 us; N = 32768,
            E = 256: 97 vs 92 us; N = 131072, E = 512: 357 vs 86 us; N = 524288, E = 256: 1253 vs 113 us (the
            two lists compared equal in each case). Inside an exchange the sort path measured 0.18-0.26 ms,
            hence the bound.

    Returns:
        RoutingPlan (None with ``pool``). Rows are ordered by (expert, token, slot): a stable sort of the flat
        ids, whose flat index t*K + k already orders (token, slot).

    Determinism: exact integer outputs, independent of run and device.
    """
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"build_routing_plan: topk_ids_TK must be 2-D (T, K), got shape {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"build_routing_plan: topk_ids_TK must be int32/int64, got {topk_ids_TK.dtype}")
    if pool is not None:
        _write_pool_plan(topk_ids_TK, num_experts, pool)
        return None
    T, K = topk_ids_TK.shape
    N = T * K
    dev = topk_ids_TK.device
    offsets_E1, order_N = expert_sort(topk_ids_TK, num_experts)
    counts_E = offsets_E1[1:] - offsets_E1[:-1]
    row_src_N = order_N.to(torch.int32)
    row_token_N = torch.div(row_src_N, K, rounding_mode="floor") if K > 1 else row_src_N.clone()
    if token_offset:
        row_token_N = row_token_N + token_offset
    row_slot_N = row_src_N - torch.div(row_src_N, K, rounding_mode="floor") * K
    row_of_N = torch.empty(N, dtype=torch.int32, device=dev)
    row_of_N.scatter_(0, order_N, torch.arange(N, dtype=torch.int32, device=dev))
    return RoutingPlan(counts_E, offsets_E1, row_src_N, row_token_N.to(torch.int32), row_slot_N,
                       row_of_N.view(T, K), num_experts, K)


def _write_pool_plan(topk_ids_TK: torch.Tensor, num_experts: int, pool: PoolPlan) -> None:
    """:func:`build_routing_plan` into an EP owner's pool: the scan kernel, or the sort plus the header kernel."""
    T, K = topk_ids_TK.shape
    N = T * K
    ids_N = topk_ids_TK.reshape(-1)
    block = 1024 if not is_interpreted(ep_kernels.ep_plan_scan_kernel) else 64
    if N * num_experts <= SCAN_MAX:
        ep_kernels.ep_plan_scan_kernel[(num_experts,)](ids_N, pool.header_H, pool.sorted_rows, pool.flags, N, T,
                                                       num_experts, pool.rank, BLOCK=block, enable_fp_fusion=True)
        return
    offsets_E1, order_N = expert_sort(topk_ids_TK, num_experts)
    pool.sorted_rows[:N].copy_(order_N)
    ep_kernels.ep_plan_kernel[(max(1, triton.cdiv(N, block)),)](ids_N, offsets_E1, pool.header_H, pool.flags, N, T,
                                                                num_experts, pool.rank, BLOCK=block,
                                                                E_PAD=pow2(num_experts), enable_fp_fusion=True)
