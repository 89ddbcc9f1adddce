"""The two dispatchers of the routed experts (megamoe.ops.dispatch) implement the one interface the stage loop
(megamoe.autograd.MoEExpertsFunction) calls: every member of the Dispatcher protocol, methods with the
protocol's parameters (names up to their shape suffix). (Their bits: tests/test_kernels_interpret.py for the local one,
tests/test_ep_layer_interpret.py for the NVLink one against the local one.)

Run: python -m pytest tests/test_dispatch.py -q
"""

import inspect
import re

import pytest

from megamoe.ops.dispatch import Dispatcher, LocalDispatcher
from megamoe.ops.ep_dispatch import NVLinkDispatcher, wgrad_rows_estimate


def _names(fn):
    """Parameter names without their shape suffix (``y_RD`` and ``y_CD`` name the same argument)."""
    return [re.sub(r"_[A-Z0-9]+$", "", p) for p in inspect.signature(fn).parameters]


MEMBERS = [n for n in vars(Dispatcher) if not n.startswith("_")] + list(Dispatcher.__annotations__)


@pytest.mark.parametrize("cls", [LocalDispatcher, NVLinkDispatcher])
def test_dispatcher_implements_the_protocol(cls):
    for name in MEMBERS:
        if name in Dispatcher.__annotations__:  # attributes: class level, or set in __init__
            src = inspect.getsource(cls)
            assert hasattr(cls, name) or f"self.{name}" in src, f"{cls.__name__} has no {name}"
            continue
        want = _names(getattr(Dispatcher, name))
        got = _names(getattr(cls, name))
        assert got == want, f"{cls.__name__}.{name}{got} differs from the protocol's {want}"


def test_the_stage_loop_calls_only_protocol_members():
    import megamoe.autograd as autograd
    called = set(re.findall(r"\bd\.([a-z_]+)", inspect.getsource(autograd)))
    assert called and called <= set(MEMBERS), sorted(called - set(MEMBERS))


def test_a_rank_without_tokens_estimates_rows_from_the_capacity():
    """The weight gradients' kernel choice of a rank with T = 0 assumes the workspace's token capacity (it
    receives the other ranks' rows), not zero rows; ranks with tokens keep min(T * K, C) / L."""
    K, C, L, cap = 8, 65536, 128, 4096
    assert wgrad_rows_estimate(2048, K, C, L, cap) == 2048 * K / L
    assert wgrad_rows_estimate(0, K, C, L, cap) == wgrad_rows_estimate(cap, K, C, L, cap) == cap * K / L
    assert wgrad_rows_estimate(10**6, K, C, L, cap) == C / L
