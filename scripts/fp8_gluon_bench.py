"""Speed of the warp-specialized Gluon FP8 GEMMs against the Triton kernels, one Hopper GPU: the m-grouped GEMM
(plain epilogue, K-major "nt" operands) and the k-grouped weight-gradient GEMM (block-padded K-major operands).

Usage: python scripts/fp8_gluon_bench.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384; one
H200: well under a minute)

Per case, with uniform random routing (top-k distinct experts per token, rows grouped by expert):
  * down: the down projection (A = h (T*k, F), B = w2 (E, D, F): K = F, N = D);
  * dx: the dgrad dx GEMM on the K-major weight copy (A = dgu (T*k, 2F), B = w13^T (E, D, 2F): K = 2F, N = D);
  * dW13: the gate/up weight gradient (P = dgu (T*k, 2F), Q = x gathered from the T token rows (T*k, D): per expert
    (M = 2F, N = D), K = its rows);
  * dW2: the down weight gradient (P = dout rows (T*k, D), Q = hw (T*k, F): per expert (M = D, N = F)).
The m-grouped operands are random e4m3 bytes with random scales; the weight-gradient operands are random bf16 rows
quantized 128x1 into the block-padded K-major layout (megamoe.ops.fp8_quant.quantize_128x1_grouped(...,
kmajor=True), as the FP8 layer does; not timed), bf16 weight gradients (the layer's weight dtype). Each pair is
first checked bit for bit (Gluon against megamoe.ops.fp8_gemm.fp8_grouped_mm_nt / fp8_k_grouped_mm(...,
padded=True)), then timed (megamoe.bench.timing: CUDA events, L2 flushed, median of 30); the table gives ms and
TFLOP/s (2 * M * N * K over the routed rows) of both kernels and the speedup.
"""

from __future__ import annotations

import sys

import torch

from megamoe import get_preset
from megamoe.bench.timing import Timer, summarize
from megamoe.ops import build_routing_plan, fp8_quant
from megamoe.ops.fp8_gemm import fp8_grouped_mm_nt, fp8_k_grouped_mm, table_for
from megamoe.ops.fp8_gemm_gluon import fp8_grouped_mm_nt_gluon, fp8_k_grouped_mm_gluon

E4M3 = torch.float8_e4m3fn


def _m_grouped(R, E, N, K, off, g):
    """(Triton fn, Gluon fn, args, M, N, K) of an m-grouped "nt" GEMM on random e4m3 operands."""
    aq = torch.randn(R, K, device="cuda", generator=g).to(E4M3)
    as_ = torch.rand(R, K // 128, device="cuda", generator=g) + 0.5
    bq = torch.randn(E, N, K, device="cuda", generator=g).to(E4M3)
    bs = torch.rand(E, N // 128, K // 128, device="cuda", generator=g) * 0.01
    return fp8_grouped_mm_nt, fp8_grouped_mm_nt_gluon, (aq, as_, bq, bs, off), int(off[-1]), N, K


def _wgrad_triton(pq, ps, qq, qs, off, blocks, tile_cache=None):
    return fp8_k_grouped_mm(pq, ps, qq, qs, off, block_offsets_E1=blocks, padded=True, out_dtype=torch.bfloat16,
                            tile_cache=tile_cache)


def _wgrad_gluon(pq, ps, qq, qs, off, blocks, tile_cache=None):
    return fp8_k_grouped_mm_gluon(pq, ps, qq, qs, off, block_offsets_E1=blocks, out_dtype=torch.bfloat16,
                                  tile_cache=tile_cache)


def _k_grouped(R, M, N, off, q_idx, T, g):
    """(Triton fn, Gluon fn, args, M, N, K) of a weight gradient on bf16 rows quantized as the FP8 layer does:
    P (R, M), Q (R, N) or gathered through q_idx from T token rows."""
    p = torch.randn(R, M, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(T if q_idx is not None else R, N, device="cuda", generator=g, dtype=torch.bfloat16)
    blocks = table_for(off, 128, None)
    pq, ps = fp8_quant.quantize_128x1_grouped(p, off, None, blocks, kmajor=True)
    qq, qs = fp8_quant.quantize_128x1_grouped(q, off, q_idx, blocks, kmajor=True)
    return _wgrad_triton, _wgrad_gluon, (pq, ps, qq, qs, off, blocks), M, N, int(off[-1])


def _case(name: str):
    """[(label, thunk making (Triton fn, Gluon fn, args, M, N, K))] of one preset:tokens case."""
    preset, tokens = name.split(":")
    cfg = get_preset(preset)
    T, D, F, E, k = int(tokens), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    plan = build_routing_plan(torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices, E)
    off, R = plan.offsets_E1, T * k
    return [("down", lambda: _m_grouped(R, E, D, F, off, g)), ("dx", lambda: _m_grouped(R, E, D, 2 * F, off, g)),
            ("dW13", lambda: _k_grouped(R, 2 * F, D, off, plan.row_token_N, T, g)),
            ("dW2", lambda: _k_grouped(R, D, F, off, None, T, g))]


def _ms(timer, fn, args, cache) -> float:
    return summarize(timer.time(lambda _: fn(*args, tile_cache=cache), 30)).median


def main(cases: list[str]) -> None:
    timer = Timer(torch.device("cuda"))
    print(f"{'case':24s} {'gemm':9s} {'M':>6s} {'N':>5s} {'K':>6s} {'triton ms':>9s} {'TFLOP/s':>8s} "
          f"{'gluon ms':>9s} {'TFLOP/s':>8s} {'speedup':>7s}  bit-exact")
    for name in cases:
        for label, make in _case(name):
            tri_fn, glu_fn, args, M, N, K = make()
            cache = {}
            want = tri_fn(*args, tile_cache=cache)
            got = glu_fn(*args, tile_cache=cache)
            if label in ("down", "dx"):  # rows past the routed ones are not written
                want, got = want[:M], got[:M]
            ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
            diff = 0 if ok else (got.view(torch.int16) != want.view(torch.int16)).sum().item()
            del want, got
            tri = _ms(timer, tri_fn, args, cache)
            glu = _ms(timer, glu_fn, args, cache)
            flop = 2 * M * N * K
            print(f"{name:24s} {label:9s} {M:6d} {N:5d} {K:6d} {tri:9.3f} {flop / tri / 1e9:8.0f} {glu:9.3f} "
                  f"{flop / glu / 1e9:8.0f} {tri / glu:7.2f}  {ok}")
            if not ok:
                raise SystemExit(f"{name} {label}: Gluon differs from the Triton kernel in {diff} elements")
            del args


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b:16384"])
