"""Helpers shared by the host launchers: device / interpreter checks and the persistent grid size."""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

# Persistent m-grouped kernels launch at most this many programs under the interpreter (the loop over
# tiles is then exercised on tiny shapes).
INTERPRET_PROGRAMS = 3


def is_interpreted(kernel) -> bool:
    """True if ``kernel`` was created under TRITON_INTERPRET=1 (it then runs on CPU tensors)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel, where: str, **tensors) -> torch.device:
    """All non-None tensors on one device: CUDA, or CPU when the kernels run in the interpreter."""
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    uniq = set(devs.values())
    if len(uniq) > 1:
        raise ValueError(f"{where}: tensors on different devices: {devs}")
    dev = uniq.pop()
    if dev.type == "cpu" and not is_interpreted(kernel):
        raise ValueError(f"{where}: CPU tensors need TRITON_INTERPRET=1 (set before triton is imported); "
                         f"the fused path otherwise runs on CUDA devices")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{where}: unsupported device {dev}")
    return dev


def check_row_count(where: str, valid_rows_1) -> None:
    """``valid_rows_1``: None, or a (1,) int32 device count of the rows a launcher computes (a receive round's rows,
    known only to the device)."""
    if valid_rows_1 is not None and (not isinstance(valid_rows_1, torch.Tensor) or valid_rows_1.dtype != torch.int32
                                     or valid_rows_1.numel() != 1):
        raise ValueError(f"{where}: valid_rows_1 must be a (1,) int32 tensor, got "
                         f"{getattr(valid_rows_1, 'shape', valid_rows_1)!r}")


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_RESERVED = threading.local()  # per thread: the autograd engine runs the backward on its own thread


@contextlib.contextmanager
def reserve_sms(n: int):
    """Within the block, persistent kernels launched from this thread size their grids for all SMs but ``n``
    (at least one), leaving those SMs to work on another stream (megamoe.ops.ep_dispatch: the exchange beside
    the shared expert). Grids never change bits (tile_config), so neither does this. Nests: the largest
    reservation holds. Only megamoe's persistent launchers follow it: a GEMM inside the block that goes to
    torch / cuBLAS (``torch._grouped_mm``) or a non-persistent grid does not."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"reserve_sms: n must be an int >= 0, got {n!r}")
    old = getattr(_RESERVED, "n", 0)
    _RESERVED.n = max(old, n)
    try:
        yield
    finally:
        _RESERVED.n = old


def sm_budget(device: torch.device) -> int:
    """SMs a persistent kernel may fill on ``device``: all of them minus the current :func:`reserve_sms`."""
    return max(1, sm_count(device.index or 0) - getattr(_RESERVED, "n", 0))


def persistent_programs(device: torch.device, kernel, bound: int, per_sm: int = 1) -> int:
    """Grid of a persistent kernel: per_sm programs per SM of :func:`sm_budget` (interpreter:
    INTERPRET_PROGRAMS), at most ``bound``."""
    cap = INTERPRET_PROGRAMS if is_interpreted(kernel) else per_sm * sm_budget(device)
    return max(1, min(cap, bound))


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 2))
