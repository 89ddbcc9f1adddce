"""Hardware ceilings measured in the same run as the benchmark (leads, not datasheet numbers).

* dense matmul TFLOP/s: ``a @ b`` with a, b of [n, n] in the benchmark dtype; FLOPs = 2 n^3
  (n = 8192 on CUDA, 512 on CPU). The % of peak column divides a provider's TFLOP/s by this.
* dense FP8 matmul TFLOP/s: ``torch._scaled_mm`` of e4m3 [n, n] operands (tensorwise fp32 scales, bf16 out,
  n = 8192), on a GPU with FP8 tensor cores (capability 8.9+); NaN elsewhere. The FP8 providers' % of peak.
* device copy GB/s: ``y.copy_(x)`` of 1 GiB (64 MiB on CPU); bytes = 2 x size (read + write).
* peer copy GB/s: ``x_peer.copy_(x)`` of 1 GiB from this GPU to the next visible one (under EP every
  rank copies to rank+1 at once, slowest rank reported); bytes = size. NaN with one GPU.
Each is the median of several timed repetitions after a warm-up.
"""

from __future__ import annotations

import math
import time

import torch

from .timing import Timer, summarize

__all__ = ["measure_ceilings"]


def _matmul_tflops(timer: Timer, dtype: torch.dtype, reps: int) -> float:
    n = 8192 if timer.cuda else 512
    dt = dtype if timer.cuda else torch.float32
    a = torch.randn(n, n, device=timer.device, dtype=dt)
    b = torch.randn(n, n, device=timer.device, dtype=dt)
    for _ in range(3):
        a @ b
    ms = summarize(timer.time(lambda _: a @ b, reps)).median
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _fp8_matmul_tflops(timer: Timer, reps: int) -> float:
    if not timer.cuda or not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(timer.device) < (8, 9):
        return math.nan
    n = 8192
    a = torch.randn(n, n, device=timer.device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=timer.device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
    one = torch.ones((), device=timer.device)

    def mm(_):
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    for _ in range(3):
        mm(None)
    ms = summarize(timer.time(mm, reps)).median
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _copy_gbs(timer: Timer, reps: int) -> float:
    nbytes = (1 << 30) if timer.cuda else (64 << 20)
    x = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).random_()
    y = torch.empty_like(x)
    y.copy_(x)
    ms = summarize(timer.time(lambda _: y.copy_(x), reps)).median
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _peer_copy_gbs(timer: Timer, rank: int, reps: int) -> float:
    if not timer.cuda or torch.cuda.device_count() < 2:
        return math.nan
    src_dev = timer.device
    dst_dev = torch.device("cuda", (src_dev.index + 1) % torch.cuda.device_count())
    nbytes = 1 << 30
    x = torch.empty(nbytes, dtype=torch.uint8, device=src_dev).random_()
    y = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    y.copy_(x)
    samples = []
    for _ in range(reps):
        timer.barrier()
        torch.cuda.synchronize(dst_dev)
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        samples.append(timer.reduce_max((time.perf_counter() - t0) * 1e3))
    ms = summarize(samples).median
    del x, y
    return nbytes / (ms * 1e-3) / 1e9


def measure_ceilings(timer: Timer, dtype: torch.dtype, rank: int = 0, reps: int = 10) -> dict[str, float]:
    """{'matmul_tflops', 'fp8_matmul_tflops', 'copy_gbs', 'peer_copy_gbs'} measured now on this device (min over
    ranks for the matmul and copy rates under EP, since the slowest rank bounds the layer)."""
    out = {
        "matmul_tflops": _matmul_tflops(timer, dtype, reps),
        "fp8_matmul_tflops": _fp8_matmul_tflops(timer, reps),
        "copy_gbs": _copy_gbs(timer, reps),
        "peer_copy_gbs": _peer_copy_gbs(timer, rank, reps),
    }
    for k in ("matmul_tflops", "fp8_matmul_tflops", "copy_gbs"):
        out[k] = -timer.reduce_max(-out[k])
    if timer.cuda:
        torch.cuda.empty_cache()
    return out
