"""Speed of the warp-specialized Gluon FP8 m-grouped GEMM against the Triton kernel (plain epilogue, K-major "nt"
operands), one Hopper GPU.

Usage: python scripts/fp8_gluon_bench.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384; one
H200: well under a minute)

Per case, with uniform random routing (top-k distinct experts per token, rows grouped by expert): the down
projection (A = h (T*k, F), B = w2 (E, D, F): K = F, N = D) and the dgrad dx GEMM on the K-major weight copy
(A = dgu (T*k, 2F), B = w13^T (E, D, 2F): K = 2F, N = D). Each pair is first checked bit for bit (Gluon against
megamoe.ops.fp8_gemm.fp8_grouped_mm_nt), then timed (megamoe.bench.timing: CUDA events, L2 flushed, median of 30);
the table gives ms and TFLOP/s (2 * rows * N * K) of both kernels and the speedup.
"""

from __future__ import annotations

import sys

import torch

from megamoe import get_preset
from megamoe.bench.timing import Timer, summarize
from megamoe.ops import build_routing_plan
from megamoe.ops.fp8_gemm import fp8_grouped_mm_nt
from megamoe.ops.fp8_gemm_gluon import fp8_grouped_mm_nt_gluon

E4M3 = torch.float8_e4m3fn


def _operands(R, E, N, K, g):
    aq = torch.randn(R, K, device="cuda", generator=g).to(E4M3)
    as_ = torch.rand(R, K // 128, device="cuda", generator=g) + 0.5
    bq = torch.randn(E, N, K, device="cuda", generator=g).to(E4M3)
    bs = torch.rand(E, N // 128, K // 128, device="cuda", generator=g) * 0.01
    return aq, as_, bq, bs


def _case(name: str):
    preset, tokens = name.split(":")
    cfg = get_preset(preset)
    T, D, F, E, k = int(tokens), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    off = build_routing_plan(torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices, E).offsets_E1
    return [("down", T * k, E, D, F, off), ("dx", T * k, E, D, 2 * F, off)], g


def _ms(timer, fn, args, cache) -> float:
    return summarize(timer.time(lambda _: fn(*args, tile_cache=cache), 30)).median


def main(cases: list[str]) -> None:
    timer = Timer(torch.device("cuda"))
    print(f"{'case':24s} {'gemm':5s} {'K':>5s} {'N':>5s} {'triton ms':>9s} {'TFLOP/s':>8s} {'gluon ms':>9s} "
          f"{'TFLOP/s':>8s} {'speedup':>7s}  bit-exact")
    for name in cases:
        gemms, g = _case(name)
        for label, R, E, N, K, off in gemms:
            aq, as_, bq, bs = _operands(R, E, N, K, g)
            cache = {}
            want = fp8_grouped_mm_nt(aq, as_, bq, bs, off, tile_cache=cache)
            got = fp8_grouped_mm_nt_gluon(aq, as_, bq, bs, off, tile_cache=cache)
            n = int(off[-1])
            ok = torch.equal(got[:n].view(torch.int16), want[:n].view(torch.int16))
            args = (aq, as_, bq, bs, off)
            tri = _ms(timer, fp8_grouped_mm_nt, args, cache)
            glu = _ms(timer, fp8_grouped_mm_nt_gluon, args, cache)
            flop = 2 * n * N * K
            print(f"{name:24s} {label:5s} {K:5d} {N:5d} {tri:9.3f} {flop / tri / 1e9:8.0f} {glu:9.3f} "
                  f"{flop / glu / 1e9:8.0f} {tri / glu:7.2f}  {ok}")
            if not ok:
                diff = (got[:n].view(torch.int16) != want[:n].view(torch.int16)).sum().item()
                raise SystemExit(f"{name} {label}: Gluon differs from the Triton kernel in {diff} elements")


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b:16384"])
