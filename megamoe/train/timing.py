"""Step and MoE-layer timers for the progress bar: what share of a training step the MoE layers take.

On CUDA the timers record ``torch.cuda.Event`` s on the current stream (no host sync when recording);
they are read only after the training loop has synchronised anyway (when it logs). On CPU, where
every op runs synchronously on the calling thread, ``time.perf_counter`` is used.

An MoE layer's time is its forward (from the first op of the call to the last) plus its backward,
measured by two identity autograd functions around the layer: the one on the output runs first in
the backward pass (start) and the one on the input runs once the layer's input gradient exists (end).
Other autograd branches the engine interleaves in that window are counted too, so the share is an
upper-bound estimate of the MoE layers' cost, not a profiler trace.
"""

from __future__ import annotations

import time

import torch

__all__ = ["StepTimer"]


class _Clock:
    """A point in time: a recorded CUDA event, or a host perf_counter stamp on CPU."""

    def __init__(self, cuda: bool):
        if cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.t = None
        else:
            self.event, self.t = None, time.perf_counter()

    def ms_until(self, later: _Clock) -> float:
        if self.event is not None:
            return self.event.elapsed_time(later.event)
        return (later.t - self.t) * 1e3


class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``callback()`` before passing the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class StepTimer:
    """Times whole training steps and the MoE layers inside them.

    Usage: ``timer.attach(moe_layers)`` once; per step ``timer.step_begin()`` ... ``timer.step_end()``;
    after a host sync ``timer.collect() -> (step_ms, moe_ms)`` summed over the steps since the last
    collect (records are dropped when read). ``detach()`` removes the hooks.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._hooks = []
        self._steps: list[tuple[_Clock, _Clock]] = []
        self._moe: list[tuple[_Clock, _Clock]] = []
        self._begin: _Clock | None = None

    def _now(self) -> _Clock:
        return _Clock(self.cuda)

    def attach(self, layers) -> None:
        for layer in layers:
            state: dict = {}

            def pre(module, args, state=state):
                state["fwd0"] = self._now()
                if not torch.is_grad_enabled() or not args[0].requires_grad:
                    return None
                return (_Mark.apply(args[0], lambda: self._moe.append((state.pop("bwd0"), self._now()))),
                        *args[1:])

            def post(module, args, out, state=state):
                self._moe.append((state.pop("fwd0"), self._now()))
                if not torch.is_grad_enabled() or not out.requires_grad:
                    return None
                return _Mark.apply(out, lambda: state.__setitem__("bwd0", self._now()))

            self._hooks += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def step_begin(self) -> None:
        self._begin = self._now()

    def step_end(self) -> None:
        self._steps.append((self._begin, self._now()))

    def checkpoint(self) -> int:
        """A marker for :meth:`discard_since` (the number of MoE records so far)."""
        return len(self._moe)

    def discard_since(self, marker: int) -> None:
        """Forget the MoE records made after ``marker`` (e.g. by evaluation forwards)."""
        del self._moe[marker:]

    def collect(self) -> tuple[float, float]:
        """(total step ms, total MoE ms) since the last collect. Call after a host sync on CUDA."""
        step_ms = sum(a.ms_until(b) for a, b in self._steps)
        moe_ms = sum(a.ms_until(b) for a, b in self._moe)
        self._steps.clear()
        self._moe.clear()
        return step_ms, moe_ms
