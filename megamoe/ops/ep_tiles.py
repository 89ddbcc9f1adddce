"""Host side of the expert-parallel m-grouped GEMMs (megamoe.kernels.ep_tiles): where a GEMM stores its result rows
(:class:`RowPush`, the owners' slots across ranks) and the rows of A still arriving while it runs (:class:`RowPull`,
the pull beside the GEMM), and the kernel and kernel arguments each becomes (:func:`push_launch`,
:func:`pull_launch`; megamoe.ops.grouped_gemm launches them).

Legend: R rows of the GEMM's expert-grouped row buffer, C >= R columns of the row table, W EP ranks, B blocks of
``block_rows`` rows. Nothing here launches a kernel or reads device values on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ..kernels.ep_tiles import m_grouped_pull_kernel, m_grouped_push_kernel

__all__ = ["RowPush", "RowPull", "row_push_deltas", "push_launch", "pull_launch"]


@dataclass(frozen=True)
class RowPush:
    """Where a plain-epilogue m-grouped GEMM stores its rows instead of an (R, N) output (expert parallelism:
    result rows go straight into their owners' slot buffers, megamoe.ops.ep_comm.push_target).

    dest: this rank's (rows, N) contiguous destination buffer (gives the dtype and the base); deltas_W:
    (W,) int64 device tensor, the element offset of rank s's buffer from ``dest`` (0 for this rank; a
    peer's mapping elsewhere in the address space), each a multiple of 16. The kernel relies on that for
    16-byte stores and the table is not read on the host, so build it with :func:`row_push_deltas` (or
    ``EPWorkspace.slot_deltas_W``), which check it: a misaligned entry faults on the GPU. rowtab_3C:
    (3, C) int32 device tensor, C >= R, columns r = (source rank, token, slot) of row r, source < 0 for a
    row that is not stored; top_k: slots per token. Row r is written to row ``token * top_k + slot`` of
    rank ``source``'s buffer. The caller guarantees those rows exist and that no two rows share one (the
    EP schedule gives each slot one row).
    """

    dest: torch.Tensor
    deltas_W: torch.Tensor
    rowtab_3C: torch.Tensor
    top_k: int

    def check(self, where: str, num_rows: int, N: int, dtype: torch.dtype, dev) -> None:
        d = self.dest
        if d.dim() != 2 or d.shape[1] != N or d.dtype != dtype or not d.is_contiguous():
            raise ValueError(f"{where}: push.dest must be a contiguous {dtype} (rows, {N}) tensor, got {d.dtype} "
                             f"{tuple(d.shape)}")
        if self.deltas_W.dtype != torch.int64 or self.deltas_W.dim() != 1:
            raise TypeError(f"{where}: push.deltas_W must be a 1-D int64 tensor, got {self.deltas_W.dtype} "
                            f"{tuple(self.deltas_W.shape)}")
        t = self.rowtab_3C
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != 3 or t.shape[1] < num_rows or not t.is_contiguous():
            raise ValueError(f"{where}: push.rowtab_3C must be a contiguous int32 (3, C >= {num_rows}) tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
        if self.top_k < 1:
            raise ValueError(f"{where}: push needs top_k >= 1, got {self.top_k}")
        if any(x.device != dev for x in (d, self.deltas_W, t)):
            raise ValueError(f"{where}: push tensors must be on {dev}")


@dataclass(frozen=True)
class RowPull:
    """The rows of A still arriving while an m-grouped GEMM runs (expert parallelism: the pull of a round's rows
    beside the GEMM that consumes them, megamoe.ops.ep_comm.pull_beside).

    ready_B1: int32 (1 + B,) device tensor (B blocks of ``block_rows`` rows), zero before ``launch`` runs: ``[0]``
    the GEMM's tile counter, ``[1 + b]`` set to 1 by the pull (release, GPU scope) once rows
    ``[b * block_rows, (b + 1) * block_rows)`` of A (and of the row scales) are written. launch: enqueues the pull
    kernel; the GEMM launcher calls it right after its own small kernels (the m-tile table), so that the GEMM is
    the next kernel of the stream, launched as its programmatic dependent (``pdl``) on the GPU: it starts once
    every program of the pull is resident, takes tiles from the counter in increasing order and spins (bounded,
    ``max_iters`` / ``timeout_ns``, ``use_timer``) on the flags covering a tile's rows before it loads them; a spin
    that expires writes stage 5 with ``rank`` into the EP workspace's status word ``flags`` (``EPWorkspace.check``
    raises). At its end the GEMM waits for the pull's grid (``griddepcontrol.wait``), so the stream's next kernel
    sees all its rows. No bits change: the same tiles see the same rows.
    """

    ready_B1: torch.Tensor
    block_rows: int
    flags: torch.Tensor
    rank: int
    max_iters: int
    timeout_ns: int
    use_timer: bool
    pdl: bool
    launch: Callable[[], None]

    def check(self, where: str, num_rows: int, dev) -> None:
        r = self.ready_B1
        need = 1 + triton.cdiv(num_rows, self.block_rows)
        if r.dtype != torch.int32 or r.dim() != 1 or r.shape[0] < need or r.device != dev:
            raise ValueError(f"{where}: pull.ready_B1 must be an int32 (>= {need},) tensor on {dev}, got {r.dtype} "
                             f"{tuple(r.shape)} on {r.device}")
        if self.flags.dtype != torch.int32 or self.flags.device != dev:
            raise ValueError(f"{where}: pull.flags must be the EP workspace's int32 flags on {dev}")


def row_push_deltas(dest: torch.Tensor, addresses: list[int]) -> torch.Tensor:
    """The ``RowPush.deltas_W`` table for destination buffers at the given host-known byte ``addresses``
    (``addresses[s]``: rank s's buffer as mapped in this process; one of them is ``dest``'s own). Raises
    ValueError when an offset is not a multiple of 16 elements. A host-to-device copy: build it once, outside
    captured regions (``EPWorkspace`` builds its own ``slot_deltas_W`` the same way, as ``megamoe.distributed``
    may not import ops)."""
    es = dest.element_size()
    out = []
    for a in addresses:
        d = a - dest.data_ptr()
        if d % (16 * es):
            raise ValueError(f"row_push_deltas: buffer at {a:#x} is {d} bytes from dest, not a multiple of "
                             f"16 elements ({16 * es} bytes)")
        out.append(d // es)
    return torch.tensor(out, dtype=torch.int64, device=dest.device)


def push_launch(push: RowPush) -> tuple:
    """(kernel, its expert-parallel arguments) of a plain m-grouped GEMM that stores through ``push``."""
    return m_grouped_push_kernel, dict(push_deltas_ptr=push.deltas_W, push_tab_ptr=push.rowtab_3C,
                                       push_c=push.rowtab_3C.shape[1], push_k=push.top_k)


def pull_launch(pull: RowPull) -> tuple:
    """(kernel, its expert-parallel arguments and launch options) of an m-grouped GEMM beside ``pull``: a
    programmatic dependent launch (``launch_pdl``) where the pull asks for it."""
    args = dict(pull_ptr=pull.ready_B1, pull_flags_ptr=pull.flags, pull_rank=pull.rank, pull_max_iters=pull.max_iters,
                pull_timeout_ns=pull.timeout_ns, PULL_BM=pull.block_rows, PULL_TIMER=pull.use_timer,
                PULL_GDC=pull.pdl)
    if pull.pdl:
        args["launch_pdl"] = True
    return m_grouped_pull_kernel, args
