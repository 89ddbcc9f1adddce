"""HBM write, read and copy rates on one GPU (the ceilings behind the weight gradients' gradient writes).

write: ``x.fill_(1)`` of N GiB (bytes = N GiB written); read: ``x.sum(dtype=float32)`` (bytes read);
copy: ``y.copy_(x)`` (bytes = read + written, as megamoe.bench.ceilings counts it). Median of 10 after a
warm-up, CUDA events. Usage: python scripts/write_bandwidth.py [GiB] (default 4; needs a CUDA GPU).
"""

from __future__ import annotations

import sys

import torch
from gemm_sweep import timeit  # scripts/ is on sys.path when this file is run as a script


def rate(fn, nbytes: int) -> float:
    """GB/s of ``fn`` moving ``nbytes`` (median of 10 CUDA-event timings after 2 warm-ups)."""
    return nbytes / (timeit(fn, iters=10, warm=2) * 1e-3) / 1e9


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    n = int(gib * (1 << 30)) // 2
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    x.normal_()
    nbytes = n * 2
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}, {gib:g} GiB buffers")
    print(f"write (fill_)       {rate(lambda: x.fill_(1.0), nbytes):7.0f} GB/s written")
    print(f"write (zero_)       {rate(lambda: y.zero_(), nbytes):7.0f} GB/s written")
    print(f"read  (sum)         {rate(lambda: x.sum(dtype=torch.float32), nbytes):7.0f} GB/s read")
    print(f"copy  (copy_)       {rate(lambda: y.copy_(x), 2 * nbytes):7.0f} GB/s read + written")


if __name__ == "__main__":
    main()
