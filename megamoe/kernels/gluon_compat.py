"""Gluon builtins whose names differ across the supported Triton versions, resolved once at import.

Triton 3.7 renamed ``gl.thread_barrier`` to ``gl.barrier``; 3.8 added ``tma.async_load`` / ``tma.async_store``
and ``async_copy.async_load`` beside ``async_copy_global_to_shared`` / ``async_copy_shared_to_global``, and 3.9
removed the older names. Each alias below is the version's own builtin for the same operation (the same IR
op: a CTA barrier, a TMA load or store, a ``cp.async`` copy), so the kernels compile to the same code under
every supported version. ``@gluon.jit`` functions call them like the builtins they are. The shared-memory view's
``reinterpret`` is a method (3.6 names it ``_reinterpret``), so :func:`smem_reinterpret` is a small
``@gluon.jit`` function that picks the name at compile time.

:data:`MISSING` names the operations this Triton lacks; the host launchers (megamoe.ops.wgrad_gluon) then
take the Triton kernels, never a kernel that would fail to compile at run time.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

__all__ = ["cta_barrier", "tma_load", "tma_store", "cp_async_load", "smem_reinterpret", "MISSING"]


def _first(module, *names):
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    return None


# newest name first: 3.9 keeps the old names only as stubs that raise
cta_barrier = _first(gl, "barrier", "thread_barrier")
tma_load = _first(tma, "async_load", "async_copy_global_to_shared")
tma_store = _first(tma, "async_store", "async_copy_shared_to_global")
cp_async_load = _first(async_copy, "async_load", "async_copy_global_to_shared")

MISSING = tuple(name for name, fn in (("cta_barrier", cta_barrier), ("tma_load", tma_load),
                                      ("tma_store", tma_store), ("cp_async_load", cp_async_load)) if fn is None)

# Triton 3.7 made the shared-memory view's ``_reinterpret`` public as ``reinterpret``; 3.6 has only the former
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def smem_reinterpret(mem, dtype: gl.constexpr, n: gl.constexpr, layout: gl.constexpr):
    """``mem`` viewed as ``n`` elements of ``dtype`` in the 1-D ``layout`` (the same bytes), under every supported
    Triton."""
    if _PUBLIC_REINTERPRET:
        return mem.reinterpret(dtype, [n], layout)
    else:
        return mem._reinterpret(dtype, [n], layout)
