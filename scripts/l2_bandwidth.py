"""L2 -> SM read bandwidth of one GPU, next to the operand-tile traffic of the layer's grouped GEMMs.

Usage: python scripts/l2_bandwidth.py OUT_DIR

Why: every m-grouped GEMM of qwen3-30b-a3b T=16384 runs at 450-570 TFLOP/s whatever the kernel (Triton,
persistent Gluon, warp-specialized Gluon; docs/perf.md), while at 128x256 tiles their A and B
tiles amount to 5.5-6.7 TB/s of reads from L2 (each tile reads BLOCK_M x K of A and BLOCK_N x K of B). This
script measures the ceiling that figure is to be compared with: a Triton kernel in which 2, 4 or 8 programs
per SM read, over and over, windows of a buffer that fits in L2 (32 MiB of the H200's 60 MB) with 16-byte
vector loads and keep one sum per program (written out, so nothing is optimized away). The buffer is read
once before timing, so after the first pass every read is an L2 hit; the result is bytes read / time, the
median of 10 CUDA-event timings (megamoe.bench.timing.Timer, without its L2 flush). The DRAM copy rate of
megamoe.bench.ceilings is printed alongside, and the operand traffic of the two qwen3 GEMMs computed from
their shapes (no GEMM is run here).

Writes OUT_DIR/l2_bandwidth.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from megamoe.bench.ceilings import _copy_gbs
from megamoe.bench.timing import Timer, summarize


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, n_words, passes, WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    """Program p reads ``passes`` windows of WINDOW int32 words, starting at window p of the buffer and
    stepping by the number of programs (wrapping), in BLOCK-word vector loads; stores the wrapped sum."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n_windows = n_words // WINDOW
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    i = 0
    while i < passes:
        base = ((pid + i * G) % n_windows).to(tl.int64) * WINDOW
        for j in range(0, WINDOW, BLOCK):
            acc += tl.load(x_ptr + base + j + tl.arange(0, BLOCK))
        i += 1
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def l2_read_gbs(buf_mib: int = 32, programs_per_sm: int = 4, passes: int = 64, reps: int = 10) -> float:
    dev = torch.device("cuda")
    n_words = (buf_mib << 20) // 4
    x = torch.randint(0, 1 << 20, (n_words,), dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    grid = (sms * programs_per_sm,)
    window, block = 16384, 2048
    out = torch.empty(grid[0], dtype=torch.int32, device=dev)
    run = lambda: _l2_read_kernel[grid](x, out, n_words, passes, WINDOW=window, BLOCK=block, num_warps=8)  # noqa: E731
    run()
    timer = Timer(dev, flush_mib=0)  # no L2 flush: the point is to read from L2
    ms = summarize(timer.time(lambda _: run(), reps)).median
    nbytes = grid[0] * passes * window * 4
    return nbytes / (ms * 1e-3) / 1e9


def gemm_tile_traffic(rows: int, n: int, k: int, block_m: int, block_n: int) -> float:
    """Bytes of A and B tiles an m-grouped GEMM reads (bf16), ignoring partial m-tiles per expert."""
    tiles = (rows // block_m) * (n // block_n)
    return tiles * (block_m + block_n) * k * 2


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    res = {"gpu": torch.cuda.get_device_name(), "l2_read_gbs": {},
           "dram_copy_gbs": _copy_gbs(Timer(torch.device("cuda")), 10)}
    for ppsm in (2, 4, 8):
        res["l2_read_gbs"][ppsm] = l2_read_gbs(programs_per_sm=ppsm)
    R = 16384 * 8  # qwen3-30b-a3b T=16384, top-8: rows of the grouped buffer
    res["qwen3_tile_bytes"] = {
        "down 128x256 (K=768, N=2048)": gemm_tile_traffic(R, 2048, 768, 128, 256),
        "dgrad 128x256 (K=1536, N=2048)": gemm_tile_traffic(R, 2048, 1536, 128, 256),
        "down 128x128": gemm_tile_traffic(R, 2048, 768, 128, 128),
    }
    for k, v in res["l2_read_gbs"].items():
        print(f"L2 read, {k} programs per SM: {v:,.0f} GB/s")
    print(f"DRAM copy (read + write): {res['dram_copy_gbs']:,.0f} GB/s")
    for k, v in res["qwen3_tile_bytes"].items():
        print(f"qwen3 {k}: {v / 1e9:.2f} GB of operand tiles")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "l2_bandwidth.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
