"""A side CUDA stream for launches that may overlap the main stream (weight gradients in the backward).

Usage (host side, no sync)::

    side = fork(device)              # side waits for everything already queued on the current stream
    with on(side):
        dw = k_grouped_mm(...)       # queued on the side stream (inline when side is None)
    ...                              # more launches on the current stream, running concurrently
    join(side)                       # the current stream waits for the side stream

Safety rules the callers follow: every tensor read on the side stream stays referenced by the caller
until ``join`` (so the caching allocator cannot hand its memory to a later launch on the current
stream while the side stream still reads it); tensors allocated on the side stream are only used after
``join``, and every ``fork`` orders the side stream after all work queued before it, so a side-stream
block freed and reused later is never written while an earlier reader is pending.

Determinism: unaffected (the overlapped launches write disjoint outputs; no atomics). CUDA graphs: the
fork / join pair is captured as a branch of the graph. ``OVERLAP = False`` runs everything on the current
stream (the benchmarks' A/B switch). CPU tensors (interpreter) always run inline.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["OVERLAP", "fork", "join", "on"]

OVERLAP = True


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=index)


def fork(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of ``device``, made to wait for the current stream; None on CPU or when disabled."""
    if not OVERLAP or device.type != "cuda":
        return None
    side = _side_stream(device.index if device.index is not None else torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def on(side: torch.cuda.Stream | None):
    """Context that queues launches on ``side`` (a no-op for None)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for everything queued on ``side`` so far (no host sync)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
