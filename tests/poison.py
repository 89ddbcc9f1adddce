"""Poisoned allocations for the tests: outputs a kernel should write and does not show up.

* :func:`poisoned_empty` wraps ``torch.empty``: floating-point results are filled with NaN, e4m3 and integer ones
  with 0x7F bytes (e4m3 NaN).
* :func:`poisoned_allocations`: a context in which ``torch.empty`` is that wrapper (for code that allocates its own
  outputs; pytest's ``monkeypatch.setattr(torch, "empty", poisoned_empty(torch.empty))`` does the same in a test).
"""

import contextlib

import torch

_E4M3 = torch.float8_e4m3fn


def poisoned_empty(real):
    """torch.empty whose result is filled with NaN (floating point) or 0x7F bytes (e4m3, integers)."""
    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.dtype == _E4M3 or not t.is_floating_point():
            t.view(torch.uint8).fill_(0x7F)
        else:
            t.fill_(float("nan"))
        return t
    return empty


@contextlib.contextmanager
def poisoned_allocations():
    """Within: ``torch.empty`` is :func:`poisoned_empty`'s."""
    real = torch.empty
    torch.empty = poisoned_empty(real)
    try:
        yield
    finally:
        torch.empty = real
