"""Helpers shared by the host launchers: device / interpreter checks and the persistent grid size."""

from __future__ import annotations

import functools

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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, kernel, bound: int, per_sm: int = 1) -> int:
    """Grid of a persistent kernel: per_sm programs per SM (interpreter: INTERPRET_PROGRAMS), at most ``bound``."""
    cap = INTERPRET_PROGRAMS if is_interpreted(kernel) else per_sm * _sm_count(device.index or 0)
    return max(1, min(cap, bound))


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 2))
