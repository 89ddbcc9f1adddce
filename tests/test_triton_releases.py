"""What keeps the kernels the same across the supported Triton releases (pyproject.toml's range).

The Gluon builtins megamoe's Hopper kernels call resolve under every supported release, and a release that lacks
one turns the Gluon path off (the Triton kernels run, the same bits) instead of failing at run time. Every kernel
launch asks for floating-point contraction (FMA) explicitly: it is what the bits were recorded with, and Triton
3.9 warns that its default turns to off in 3.10.
"""

import ast
import importlib
from pathlib import Path

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
    import megamoe.ops.wgrad_gluon as wgrad

    assert wgrad.GLUON_AVAILABLE
    monkeypatch.setattr(gluon_compat, "MISSING", ("cta_barrier",))
    try:
        assert not importlib.reload(wgrad).GLUON_AVAILABLE
    finally:
        monkeypatch.undo()
        importlib.reload(wgrad)
    assert wgrad.GLUON_AVAILABLE


def test_every_launch_asks_for_fp_fusion():
    """Each ``kernel[grid](...)`` launch in megamoe.ops passes ``enable_fp_fusion=True`` (fails on one that
    does not, e.g. a new launcher)."""
    ops = Path(__file__).resolve().parents[1] / "megamoe" / "ops"
    launches, missing = 0, []
    for path in sorted(ops.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                launches += 1
                fusion = [k.value for k in node.keywords if k.arg == "enable_fp_fusion"]
                if not (fusion and isinstance(fusion[0], ast.Constant) and fusion[0].value is True):
                    missing.append(f"{path.name}:{node.lineno}")
    assert launches >= 15 and not missing, missing
