"""The multi-process launcher of the EP tests (``ep_utils.spawn_ranks``) reports every way a rank can fail.

A rank that dies without a Python exception (``std::terminate`` in a backend, a signal) must be named
with its exit code at once, not after the launcher's timeout; a rank that raises must be named with its
traceback; a crash after a rank's report must not lose the report.
"""

import os
import time

import pytest
import torch.distributed as dist

from ep_utils import spawn_ranks


def _abort_on_rank_1(rank, world):
    if rank == 1:
        os.abort()  # what "terminate called without an active exception" does to a process
    return rank


def _raise_on_rank_0(rank, world):
    if rank == 0:
        raise RuntimeError("planted failure")
    return rank


def _allreduce_then_abort_at_exit(rank, world):
    import atexit

    import torch
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    atexit.register(os.abort)  # a crash in teardown, after the report
    return float(t)


def test_rank_that_dies_without_exception_is_named_with_its_exit_code():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1: exited with code -6 before reporting"):
        spawn_ranks(_abort_on_rank_1, 2, timeout=100)
    assert time.monotonic() - t0 < 60  # seen dead, not waited out


def test_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 0: RuntimeError: planted failure.*Traceback"):
        spawn_ranks(_raise_on_rank_0, 2, timeout=100)


def test_crash_after_the_report_keeps_the_results_and_warns():
    with pytest.warns(UserWarning, match="exited with codes"):
        assert spawn_ranks(_allreduce_then_abort_at_exit, 2, backend="gloo", timeout=100) == [3.0, 3.0]
