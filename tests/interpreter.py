"""Test cases that run the Triton kernels on CPU, under the Triton interpreter.

A kernel is an interpreted one only when ``TRITON_INTERPRET=1`` is set before it is created (at import), so a
test process that imported megamoe without it cannot run them itself. :func:`interpreted` makes a test
function run in a process that has it: a fresh process forked from a rank host that lives for the whole
session (``ep_utils.spawn_ranks`` with one rank), so each case is its own pytest case (``-k`` selects it), with
its own pass / fail, its traceback and a bounded time, and torch and megamoe are imported once, not per case.
In a process started with ``TRITON_INTERPRET=1`` the test runs in place.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os

import pytest

from ep_utils import spawn_ranks

INTERPRET_ENV = {"TRITON_INTERPRET": "1"}
CASE_TIMEOUT_S = 300.0


def _run_case(rank, world, module, name, kwargs):
    return getattr(importlib.import_module(module), name)(**kwargs)


def interpreted(test):
    """Decorator: ``test`` runs under the Triton interpreter (in a forked process, see the module doc). Its
    arguments are pytest parameters (picklable), and ``monkeypatch``: a fresh ``pytest.MonkeyPatch`` in the
    process that runs the test; no other fixture."""
    wants_monkeypatch = "monkeypatch" in inspect.signature(test).parameters

    @functools.wraps(test)
    def run(**kwargs):
        if os.environ.get("TRITON_INTERPRET") == "1":
            if wants_monkeypatch and "monkeypatch" not in kwargs:
                with pytest.MonkeyPatch.context() as monkeypatch:
                    return test(monkeypatch=monkeypatch, **kwargs)
            return test(**kwargs)
        kwargs.pop("monkeypatch", None)
        spawn_ranks(_run_case, 1, test.__module__, test.__name__, kwargs, env=INTERPRET_ENV,
                    timeout=CASE_TIMEOUT_S)
        return None

    return run
