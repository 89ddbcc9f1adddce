"""Row gathers into row order for the weight gradients, inline or on a side stream.

Legend: T tokens, D hidden size, N (token, slot) rows in expert-grouped order.

Where the table sends a weight gradient to ``torch._grouped_mm`` (megamoe.ops.torch_grouped_mm), whose
kernel takes contiguous rows only, the single-GPU backward first gathers x's and the output gradient's rows
into row order (``src[idx]``: N x D each). Those copies are memory-bound (qwen3-30b-a3b T=16384: 0.53 ms for
the two, ninth session) and the GEMMs next to them are not, so they can run on a side stream while the
main stream computes dgrad + SwiGLU: the experiment switch ``MEGAMOE_SIDE_COPY`` ("" or "0": inline, the
default; "x": x's rows on the side stream; "xy": the output gradient's too, dgrad + SwiGLU then reading
its rows gathered). The copied rows are the same bits either way: only the time the copies take is
exposed or hidden. The side stream forks from and joins back into the current stream through events (no
host sync; CUDA-graph capture records the fork and join); the side copy's buffer lives from the fork to
its last use, so a side copy adds N x D to the backward's transient peak while it overlaps.
"""

from __future__ import annotations

import os

import torch

__all__ = ["side_copy_mode", "PendingRows", "gather_rows"]

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_copy_mode() -> str:
    """``MEGAMOE_SIDE_COPY`` as "off" (unset, "" or "0"), "x" or "xy"; ValueError for any other value."""
    value = os.environ.get("MEGAMOE_SIDE_COPY", "")
    if value not in ("", "0", "x", "xy"):
        raise ValueError(f"MEGAMOE_SIDE_COPY must be unset, 0, x or xy, got {value!r}")
    return "off" if value in ("", "0") else value


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


class PendingRows:
    """Rows ``src[idx]`` being gathered; :meth:`wait` returns them, ordered after the copy on the
    current stream (a device-side event wait, no host sync)."""

    def __init__(self, rows: torch.Tensor, event: torch.cuda.Event | None):
        self._rows, self._event = rows, event

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            torch.cuda.current_stream(self._rows.device).wait_event(self._event)
            self._event = None
        return self._rows


def gather_rows(src_TD: torch.Tensor, idx_N: torch.Tensor, *, side: bool = False) -> PendingRows:
    """``src_TD[idx_N]`` as an (N, D) tensor of src's dtype: copied now on the current stream, or with
    ``side`` (CUDA only) on a side stream that starts after the work queued so far. Bits: the rows as
    they are. Sync: none."""
    if not side or not src_TD.is_cuda:
        return PendingRows(src_TD.index_select(0, idx_N), None)
    rows_ND = torch.empty((idx_N.numel(), src_TD.shape[1]), dtype=src_TD.dtype, device=src_TD.device)
    main = torch.cuda.current_stream(src_TD.device)
    side_s = _side_stream(src_TD.device)
    side_s.wait_stream(main)
    with torch.cuda.stream(side_s):
        torch.index_select(src_TD, 0, idx_N, out=rows_ND)
        event = torch.cuda.Event()
        event.record(side_s)
    for t in (src_TD, idx_N, rows_ND):  # the allocator must not hand these blocks out before the copy ends
        t.record_stream(side_s)
    return PendingRows(rows_ND, event)
