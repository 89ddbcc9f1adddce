"""Run one weight-gradient GEMM (dW13 = dGU^T @ x[rows]) of a preset a few times, for a profiler.

Usage: python scripts/profile_wgrad.py PRESET T CONFIG [CONFIG ...]
  CONFIG: "table", "torch" (torch._grouped_mm; contiguous rows) or
  BLOCK_MxBLOCK_NxBLOCK_K/WARPS/STAGES[/rR][/gluon|/ws] (R = resident chunks, 0 = per-tile kernel; /gluon: the
  persistent Gluon kernel, R = chunks of P kept on chip; /ws: the warp-specialized Gluon kernel, contiguous rows)
  A config ending in "/contig" (or "torch", "/ws") reads x's rows copied into expert order (as the EP receive
  buffers hold them) instead of gathering them.
Example (Nsight Compute, one launch per config after a warm-up):
  ncu --clock-control none --kernel-name regex:k_grouped --launch-skip 1 --launch-count 1 \\
      --section SpeedOfLight python scripts/profile_wgrad.py deepseek-v3 8192 128x128x64/8/2
  (scripts/ncu_wgrad.sh runs the session-5 set: the Gluon kernel and the Triton ones, stall reasons)
Uniform random top-k routing; prints the median time of each config (CUDA events). Needs a CUDA GPU.
"""

from __future__ import annotations

import sys

import torch
from gemm_sweep import timeit  # scripts/ is on sys.path when this file is run as a script

from megamoe.config import get_preset
from megamoe.ops import GemmConfig, build_routing_plan, k_grouped_mm, tile_config
from megamoe.ops.torch_grouped_mm import torch_wgrad


def parse(spec: str) -> GemmConfig | str | None:
    if spec in ("table", "torch"):
        return None if spec == "table" else "torch"
    parts = [p for p in spec.split("/") if p != "contig"]
    ws = parts[-1] == "ws"
    gluon = parts[-1] in ("gluon", "ws")
    parts = parts[:-1] if gluon else parts
    m, n, k = (int(v) for v in parts[0].split("x"))
    chunks = int(parts[3][1:]) if len(parts) > 3 else 0
    return GemmConfig(m, n, k, int(parts[1]), int(parts[2]), resident_chunks=chunks, gluon=gluon,
                      warp_specialized=ws)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    cfg = get_preset(sys.argv[1])
    T = int(sys.argv[2])
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, generator=g, device=dev).bfloat16()
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    plan = build_routing_plan(ids, E)
    dgu = torch.randn(T * K, 2 * F, generator=g, device=dev).bfloat16()
    out = torch.empty(E, 2 * F, D, device=dev, dtype=torch.bfloat16)
    key = ("wgrad", 2 * F, D)
    x_rows = x.index_select(0, plan.row_token_N.long())  # x in expert order, as an EP receive buffer
    for spec in sys.argv[3:]:
        c = parse(spec)
        contig = c == "torch" or spec.endswith("/contig") or (isinstance(c, GemmConfig) and c.warp_specialized)
        if isinstance(c, GemmConfig):
            tile_config._OVERRIDES[key] = c
        if c == "torch":
            fn = lambda: torch_wgrad(dgu, x_rows, plan.offsets_E1)  # noqa: E731
        elif contig:
            fn = lambda: k_grouped_mm(dgu, x_rows, plan.offsets_E1, out=out)  # noqa: E731
        else:
            fn = lambda: k_grouped_mm(dgu, x, plan.offsets_E1, q_idx_R=plan.row_token_N, out=out)  # noqa: E731
        ms = timeit(fn, iters=5, warm=1)
        tile_config._OVERRIDES.pop(key, None)
        flop = 2 * T * K * 2 * F * D
        print(f"{sys.argv[1]} T={T} dW13 {spec:24s} {ms:7.3f} ms {flop / ms / 1e9:5.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
