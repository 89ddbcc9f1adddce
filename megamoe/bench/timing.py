"""Timing protocol: CUDA events per iteration, L2 flush, EP barrier, slowest rank, median with p20/p80.

Per timed iteration (``Timer.time``):
  1. an untimed ``setup()`` (e.g. the forward whose backward is timed);
  2. L2 flush: a 256 MiB buffer is zeroed (H200 L2 is 60 MB), so no provider reads weights from a warm L2;
  3. under EP: ``torch.cuda.synchronize()`` + ``dist.barrier()``, so all ranks start together;
  4. CUDA events around ``work()`` on the current stream (host ``perf_counter`` on CPU).
Events are read after the batch of iterations (one sync per batch, not per iteration). Under EP the
per-iteration times are all-reduced with MAX: each sample is the slowest rank's time. The caller
interleaves providers (rounds of a few iterations each, provider order rotated every round) so clock and
thermal drift hit every provider alike; :func:`summarize` gives median, p20, p80 over all samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Timer", "Stats", "summarize"]


@dataclass
class Stats:
    """Milliseconds: median, 20th and 80th percentile over ``n`` samples."""

    median: float
    p20: float
    p80: float
    n: int

    @staticmethod
    def empty() -> Stats:
        return Stats(math.nan, math.nan, math.nan, 0)


def _quantile(sorted_x: list[float], q: float) -> float:
    pos = q * (len(sorted_x) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_x) - 1)
    return sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo)


def summarize(samples_ms: list[float]) -> Stats:
    if not samples_ms:
        return Stats.empty()
    s = sorted(samples_ms)
    return Stats(_quantile(s, 0.5), _quantile(s, 0.2), _quantile(s, 0.8), len(s))


class Timer:
    """Times callables on ``device``; under EP pass the process group (every rank must call in step)."""

    def __init__(self, device: torch.device, *, group=None, world_size: int = 1, flush_mib: int = 256):
        self.device, self.group, self.world_size = device, group, world_size
        self.cuda = device.type == "cuda"
        self._flush_buf = (torch.empty(flush_mib << 20, dtype=torch.uint8, device=device)
                           if self.cuda and flush_mib > 0 else None)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.world_size > 1:
            self.sync()
            dist.barrier(group=self.group)

    def time(self, work: Callable[[object], None], iters: int,
             setup: Callable[[], object] | None = None) -> list[float]:
        """``iters`` samples in ms of ``work(setup())``; slowest rank's under EP."""
        times: list[float] = []
        if self.cuda:
            events = []
            for _ in range(iters):
                state = setup() if setup else None
                if self._flush_buf is not None:
                    self._flush_buf.zero_()
                self.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                work(state)
                end.record()
                events.append((start, end))
                del state
            self.sync()
            times = [s.elapsed_time(e) for s, e in events]
        else:
            for _ in range(iters):
                state = setup() if setup else None
                self.barrier()
                t0 = time.perf_counter()
                work(state)
                times.append((time.perf_counter() - t0) * 1e3)
                del state
        if self.world_size > 1 and times:
            t = torch.tensor(times, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            times = t.tolist()
        return times

    def reduce_max(self, value: float) -> float:
        """Max of a scalar over ranks (e.g. peak memory)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.item()
