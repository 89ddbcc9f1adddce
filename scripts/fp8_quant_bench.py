"""Speed of the FP8 quantizers (megamoe.ops.fp8_quant) at the layer's shapes, one GPU, bf16 inputs.

Usage: python scripts/fp8_quant_bench.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384
deepseek-v3:8192; one H200: well under a minute)

Per case, with uniform random routing (K distinct experts per token): quantize_1x128 of x (T, D) and of h
(T*K, F); quantize_128x128 of w13 (E, 2F, D) and w2 (E, D, F); quantize_128x1_grouped of the gathered x rows
(T*K, D, through the rows' token index) and of hw (T*K, F), in the buffer's row order and (" K") block-padded and
transposed, as the weight-gradient GEMM reads them.
Each is checked bit-exact against megamoe.reference first (the weights on their first 4 experts), then timed
(megamoe.bench.timing: CUDA events, L2 flushed, median of 30); the table gives ms, the bytes moved (read +
written, ideal) per second, and the same for a plain ``x.to(torch.float8_e4m3fn)`` of the same input (a
memory-bound cast of the same bytes: the floor).
"""

from __future__ import annotations

import sys

import torch

from megamoe import get_preset, reference
from megamoe.bench.timing import Timer, summarize
from megamoe.ops import build_routing_plan, fp8_quant

E4M3 = torch.float8_e4m3fn


def _case(name: str):
    preset, tokens = name.split(":")
    cfg = get_preset(preset)
    T, D, F, E, K = int(tokens), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    plan = build_routing_plan(torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices, E)
    off, tok = plan.offsets_E1, plan.row_token_N
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, h = torch.randn(T, D, **bf), torch.randn(T * K, F, **bf)
    w13, w2 = torch.randn(E, 2 * F, D, **bf), torch.randn(E, D, F, **bf)
    nb = lambda r: (r // 128 + E)  # noqa: E731  (scale rows, upper bound)
    return [  # (label, run, reference, bytes moved, input for the plain cast)
        ("1x128 x", lambda: fp8_quant.quantize_1x128(x), lambda: reference.quantize_1x128(x),
         3 * x.numel() + 4 * x.numel() // 128, x),
        ("1x128 h", lambda: fp8_quant.quantize_1x128(h), lambda: reference.quantize_1x128(h),
         3 * h.numel() + 4 * h.numel() // 128, h),
        # the weights are checked on their first 4 experts (the reference's fp32 copies of all would not fit)
        ("128x128 w13", lambda: fp8_quant.quantize_128x128(w13), lambda: reference.quantize_128x128(w13[:4]),
         3 * w13.numel(), w13),
        ("128x128 w2", lambda: fp8_quant.quantize_128x128(w2), lambda: reference.quantize_128x128(w2[:4]),
         3 * w2.numel(), w2),
        ("128x1 x rows", lambda: fp8_quant.quantize_128x1_grouped(x, off, tok),
         lambda: reference.quantize_128x1_grouped(x, off, tok), 3 * T * K * D + 4 * nb(T * K) * D, None),
        ("128x1 hw", lambda: fp8_quant.quantize_128x1_grouped(h, off), lambda: reference.quantize_128x1_grouped(h, off),
         3 * h.numel() + 4 * nb(T * K) * F, h),
        # the same, written block-padded and transposed (the layout the weight-gradient GEMM reads)
        ("128x1 x rows K", lambda: fp8_quant.quantize_128x1_grouped(x, off, tok, kmajor=True),
         lambda: _padded(reference.quantize_128x1_grouped(x, off, tok), off), 3 * T * K * D + 4 * nb(T * K) * D, None),
        ("128x1 hw K", lambda: fp8_quant.quantize_128x1_grouped(h, off, kmajor=True),
         lambda: _padded(reference.quantize_128x1_grouped(h, off), off), 3 * h.numel() + 4 * nb(T * K) * F, h),
    ], off


def _padded(qs, off):
    q, s = qs
    return reference.pad_128x1_blocks(q, off, s.shape[0]), s


def _same(got, want, off, grouped):
    (qg, sg), (qw, sw) = got, want
    qg, sg = qg[:qw.shape[0]], sg[:sw.shape[0]]  # the weights: the experts checked
    if grouped:  # the rows in the buffer's order, or (" K") block-padded
        b = int(reference.block_offsets_for(off)[-1])
        n = 128 * b if grouped == "kmajor" else int(off[-1])
        qg, qw, sg, sw = qg[:n], qw[:n], sg[:b], sw[:b]
    return torch.equal(qg.view(torch.uint8), qw.view(torch.uint8)) and torch.equal(sg.view(torch.int32),
                                                                                   sw.view(torch.int32))


def main(cases: list[str]) -> None:
    timer = Timer(torch.device("cuda"))
    print(f"{'case':28s} {'quantizer':14s} {'ms':>8s} {'GB/s':>7s} {'cast ms':>8s} {'cast GB/s':>9s}  bit-exact")
    for name in cases:
        rows, off = _case(name)
        for label, run, ref_fn, nbytes, cast_in in rows:
            ok = _same(run(), ref_fn(), off, label.startswith("128x1") and ("kmajor" if label.endswith(" K") else True))
            ms = summarize(timer.time(lambda _, f=run: f(), 30)).median
            line = f"{name:28s} {label:14s} {ms:8.3f} {nbytes / ms / 1e6:7.0f}"
            if cast_in is not None:
                cms = summarize(timer.time(lambda _, t=cast_in: t.to(E4M3), 30)).median
                line += f" {cms:8.3f} {3 * cast_in.numel() / cms / 1e6:9.0f}"
            else:
                line += f" {'':8s} {'':9s}"
            print(f"{line}  {ok}")
            if not ok:
                raise SystemExit(f"{name} {label}: not bit-exact against megamoe.reference")


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"])
