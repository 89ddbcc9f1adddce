"""The multi-process launchers (the EP tests' ``ep_utils.spawn_ranks``, the package's ``megamoe.distributed.run_ranks``)
report every way a rank can fail.

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


def _allreduce_then_abort_in_teardown(rank, world):
    import torch
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group = lambda *a, **kw: os.abort()  # a crash in the teardown after the report
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
        assert spawn_ranks(_allreduce_then_abort_in_teardown, 2, backend="gloo", timeout=100) == [3.0, 3.0]


def _pid_and_planted_state(rank, world, plant):
    import megamoe
    seen = (os.environ.get("MEGAMOE_TEST_PLANTED"), getattr(megamoe, "_test_planted", None))
    if plant:  # what a rank changes (environment, module state) must die with it
        os.environ["MEGAMOE_TEST_PLANTED"] = "1"
        megamoe._test_planted = rank
    return os.getpid(), seen


def test_every_call_gets_fresh_rank_processes():
    first = spawn_ranks(_pid_and_planted_state, 2, True, timeout=100)
    second = spawn_ranks(_pid_and_planted_state, 2, False, timeout=100)
    assert all(seen == (None, None) for _, seen in first + second), (first, second)
    assert len({pid for pid, _ in first + second}) == 4 and os.getpid() not in {pid for pid, _ in first}


def _hang_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_rank_that_hangs_is_named_after_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\]: no report within 3"):
        spawn_ranks(_hang_on_rank_1, 2, timeout=3)
    assert time.monotonic() - t0 < 30


def _rank_and_port(rank, world, port, fail_rank):
    if rank == fail_rank:
        raise RuntimeError("planted failure")
    return rank, world, port


def test_run_ranks_returns_in_rank_order_and_names_a_failing_rank():
    """megamoe.distributed.run_ranks (the package's spawned ranks: the training check, bits_digest)."""
    from megamoe.distributed import run_ranks

    got = run_ranks(_rank_and_port, 2, -1, timeout_s=100, what="ok-case")
    assert [g[:2] for g in got] == [(0, 2), (1, 2)] and got[0][2] == got[1][2] > 0
    with pytest.raises(RuntimeError, match=r"(?s)bad-case: rank 1 of 2 failed:.*planted failure"):
        run_ranks(_rank_and_port, 2, 1, timeout_s=100, what="bad-case")
