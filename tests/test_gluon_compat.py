"""The Gluon builtins megamoe's Hopper kernels call resolve under every supported Triton release, and a release
that lacks one turns the Gluon path off (the Triton kernels run, the same bits) instead of failing at run time."""

import importlib

import pytest

pytest.importorskip("triton.experimental.gluon")

from triton_versions import triton_release  # noqa: E402

from megamoe.kernels import gluon_compat  # noqa: E402


def test_builtins_resolve_under_the_installed_release():
    triton_release()  # inside the supported range
    assert gluon_compat.MISSING == ()
    for name in ("cta_barrier", "tma_load", "tma_store", "cp_async_load"):
        fn = getattr(gluon_compat, name)
        assert getattr(fn, "__triton_builtin__", False), f"{name} is not a Gluon builtin: {fn!r}"


def test_a_missing_builtin_turns_the_gluon_path_off(monkeypatch):
    import megamoe.ops.m_grouped_gluon as m_grouped
    import megamoe.ops.wgrad_gluon as wgrad

    assert wgrad.GLUON_AVAILABLE and m_grouped._m_grouped_plain_kernel is not None
    monkeypatch.setattr(gluon_compat, "MISSING", ("cta_barrier",))
    try:
        assert not importlib.reload(wgrad).GLUON_AVAILABLE
        assert importlib.reload(m_grouped)._m_grouped_plain_kernel is None
    finally:
        monkeypatch.undo()
        importlib.reload(wgrad)
        importlib.reload(m_grouped)
    assert wgrad.GLUON_AVAILABLE
