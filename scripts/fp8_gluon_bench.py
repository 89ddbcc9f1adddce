"""Speed of the FP8 grouped GEMMs of the layer, one Hopper GPU: the warp-specialized Gluon kernels (what the FP8 layer
runs on Hopper) beside the Triton kernels with the same bits and megamoe's bf16 kernels on the same shapes.

Usage: python scripts/fp8_gluon_bench.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384)

Per case, with uniform random routing (top-k distinct experts per token, rows grouped by expert), the six GEMMs of
the FP8 layer (m-grouped ones: A (R, K) rows, B (E, N, K) K-major, R = T * k):
  * gate_up: [g | u] = x rows @ w13^T (N = 2F, K = D), bf16 out (the SwiGLU pass follows);
  * down: y = h @ w2^T (N = D, K = F), bf16 out;
  * dgrad: the down projection's dgrad on the K-major copy of w2 (N = F, K = D), fp32 out (the SwiGLU-backward pass
    follows);
  * dx: dgu @ w13 on the K-major copy (N = D, K = 2F), bf16 out;
  * dW13: the gate/up weight gradient (P = dgu (T*k, 2F), Q = x gathered from the T token rows (T*k, D): per expert
    (M = 2F, N = D), K = its rows);
  * dW2: the down weight gradient (P = dout rows (T*k, D), Q = hw (T*k, F): per expert (M = D, N = F)).
The m-grouped operands are random e4m3 bytes with random scales; the weight-gradient operands are random bf16 rows
quantized 128x1 into the block-padded K-major layout (megamoe.ops.fp8_quant.quantize_128x1_grouped(...,
kmajor=True), as the FP8 layer does; not timed), bf16 weight gradients (the layer's weight dtype). Gluon is first
checked bit for bit against megamoe.ops.fp8_gemm.fp8_grouped_mm_nt / fp8_k_grouped_mm(..., padded=True), then all
are timed (megamoe.bench.timing: CUDA events, L2 flushed, median of 30). The bf16 column is megamoe's plain bf16
kernel on bf16 operands of the same shapes (grouped_mm_nt with bf16 output, also for the dgrad row; k_grouped_mm on
rows in expert order), not the layer's fused gate/up + SwiGLU and dgrad + SwiGLU-backward kernels. The table gives
ms and TFLOP/s (2 * M * N * K over the routed rows) and the Gluon kernel's speedup over Triton and over bf16.
"""

from __future__ import annotations

import sys

import torch

from megamoe import get_preset
from megamoe.bench.timing import Timer, summarize
from megamoe.ops import build_routing_plan, fp8_quant, grouped_mm_nt, k_grouped_mm
from megamoe.ops.fp8_gemm import fp8_grouped_mm_nt, fp8_k_grouped_mm, table_for
from megamoe.ops.fp8_gemm_gluon import fp8_grouped_mm_nt_gluon, fp8_k_grouped_mm_gluon

E4M3 = torch.float8_e4m3fn


def _m_grouped(R, E, N, K, off, g, out_dtype=torch.bfloat16):
    """(Triton fn, Gluon fn, args, bf16 fn, bf16 args, M, N, K) of an m-grouped "nt" GEMM on random e4m3 operands."""
    aq = torch.randn(R, K, device="cuda", generator=g).to(E4M3)
    as_ = torch.rand(R, K // 128, device="cuda", generator=g) + 0.5
    bq = torch.randn(E, N, K, device="cuda", generator=g).to(E4M3)
    bs = torch.rand(E, N // 128, K // 128, device="cuda", generator=g) * 0.01

    def tri(*args, tile_cache=None):
        return fp8_grouped_mm_nt(*args, out_dtype=out_dtype, tile_cache=tile_cache)

    def glu(*args, tile_cache=None):
        return fp8_grouped_mm_nt_gluon(*args, out_dtype=out_dtype, tile_cache=tile_cache)

    def bf16(a, b, off, tile_cache=None):
        return grouped_mm_nt(a, b, off, tile_cache=tile_cache)

    b16 = torch.randn(E, N, K, device="cuda", generator=g, dtype=torch.bfloat16).mul_(0.01)
    bf16_args = (torch.randn(R, K, device="cuda", generator=g, dtype=torch.bfloat16), b16, off)
    return tri, glu, (aq, as_, bq, bs, off), bf16, bf16_args, int(off[-1]), N, K


def _wgrad_triton(pq, ps, qq, qs, off, blocks, tile_cache=None):
    return fp8_k_grouped_mm(pq, ps, qq, qs, off, block_offsets_E1=blocks, padded=True, out_dtype=torch.bfloat16,
                            tile_cache=tile_cache)


def _wgrad_gluon(pq, ps, qq, qs, off, blocks, tile_cache=None):
    return fp8_k_grouped_mm_gluon(pq, ps, qq, qs, off, block_offsets_E1=blocks, out_dtype=torch.bfloat16,
                                  tile_cache=tile_cache)


def _k_grouped(R, M, N, off, q_idx, T, g):
    """(Triton fn, Gluon fn, args, bf16 fn, bf16 args, M, N, K) of a weight gradient on bf16 rows quantized as the
    FP8 layer does: P (R, M), Q (R, N) or gathered through q_idx from T token rows."""
    p = torch.randn(R, M, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(T if q_idx is not None else R, N, device="cuda", generator=g, dtype=torch.bfloat16)
    blocks = table_for(off, 128, None)
    pq, ps = fp8_quant.quantize_128x1_grouped(p, off, None, blocks, kmajor=True)
    qq, qs = fp8_quant.quantize_128x1_grouped(q, off, q_idx, blocks, kmajor=True)

    def bf16(p, q, off, tile_cache=None):
        return k_grouped_mm(p, q, off)

    q_rows = q[q_idx.long()] if q_idx is not None else q  # in expert order, as the bf16 layer's rows
    return _wgrad_triton, _wgrad_gluon, (pq, ps, qq, qs, off, blocks), bf16, (p, q_rows, off), M, N, int(off[-1])


def _case(name: str):
    """[(label, thunk making (Triton fn, Gluon fn, args, bf16 fn, bf16 args, M, N, K))] of one preset:tokens case."""
    preset, tokens = name.split(":")
    cfg = get_preset(preset)
    T, D, F, E, k = int(tokens), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    plan = build_routing_plan(torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices, E)
    off, R = plan.offsets_E1, T * k
    return [("gate_up", lambda: _m_grouped(R, E, 2 * F, D, off, g)), ("down", lambda: _m_grouped(R, E, D, F, off, g)),
            ("dgrad", lambda: _m_grouped(R, E, F, D, off, g, torch.float32)),
            ("dx", lambda: _m_grouped(R, E, D, 2 * F, off, g)),
            ("dW13", lambda: _k_grouped(R, 2 * F, D, off, plan.row_token_N, T, g)),
            ("dW2", lambda: _k_grouped(R, D, F, off, None, T, g))]


def _ms(timer, fn, args, cache) -> float:
    return summarize(timer.time(lambda _: fn(*args, tile_cache=cache), 30)).median


def main(cases: list[str]) -> None:
    timer = Timer(torch.device("cuda"))
    print(f"{'case':24s} {'gemm':8s} {'M':>6s} {'N':>5s} {'K':>6s} {'bf16 ms':>8s} {'TFLOP/s':>8s} {'triton ms':>9s} "
          f"{'TFLOP/s':>8s} {'gluon ms':>9s} {'TFLOP/s':>8s} {'vs tri':>6s} {'vs bf16':>7s}  bit-exact")
    for name in cases:
        for label, make in _case(name):
            tri_fn, glu_fn, args, bf16_fn, bf16_args, M, N, K = make()
            cache = {}
            want = tri_fn(*args, tile_cache=cache)
            got = glu_fn(*args, tile_cache=cache)
            if label in ("gate_up", "down", "dgrad", "dx"):  # rows past the routed ones are not written
                want, got = want[:M], got[:M]
            ok = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            diff = 0 if ok else (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()
            del want, got
            tri = _ms(timer, tri_fn, args, cache)
            glu = _ms(timer, glu_fn, args, cache)
            b16 = _ms(timer, bf16_fn, bf16_args, {})
            gflop = 2 * M * N * K / 1e9
            print(f"{name:24s} {label:8s} {M:6d} {N:5d} {K:6d} {b16:8.3f} {gflop / b16:8.0f} {tri:9.3f} "
                  f"{gflop / tri:8.0f} {glu:9.3f} {gflop / glu:8.0f} {tri / glu:6.2f} {b16 / glu:7.2f}  {ok}")
            if not ok:
                raise SystemExit(f"{name} {label}: Gluon differs from the Triton kernel in {diff} bytes")
            del args, bf16_args


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b:16384"])
