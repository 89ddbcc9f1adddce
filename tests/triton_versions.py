"""What each supported Triton release (pyproject.toml's range) is expected to give in the sm_90a compile tests.

The compile tests run the same kernels through each release's own compiler and ptxas; register allocation
differs between releases, so spill bytes are recorded per release (a change that spills more than recorded
is seen before it is timed). Speed is measured on the GPU machines' release (docs/perf.md).
"""

import pytest
import triton

SUPPORTED = ((3, 6), (3, 7), (3, 8), (3, 9))


def triton_release() -> tuple[int, int]:
    """(major, minor) of the installed Triton; fails the test for a release outside the supported range."""
    release = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if release not in SUPPORTED:
        pytest.fail(f"Triton {triton.__version__} is outside the supported range {SUPPORTED} (pyproject.toml): "
                    "record what it gives in tests/triton_versions.py and the compile tests first")
    return release


def expected(per_release: dict):
    """The entry of ``per_release`` for the installed Triton; releases not listed expect its ``"default"``."""
    return per_release.get(triton_release(), per_release.get("default"))
