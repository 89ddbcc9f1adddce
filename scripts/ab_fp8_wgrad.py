"""A/B of the FP8 weight gradient's tile and K loop on one Hopper GPU (the Gluon kernel
megamoe.kernels.fp8_gemm_gluon.fp8_k_grouped_ws_kernel), switches in megamoe.ops.fp8_gemm_gluon:

  * "n64" (main's code): 128 x 64 tiles, each warpgroup promoting with its next block's wgmma in flight (chunk from
    fp8_wgrad_gluon_unroll). Bound by L2 reads: (128 + 64) x 128 bytes per 128 x 64 x 128 product is 85 FLOP/B,
    so ~750 TFLOP/s at the measured 8.5-9.0 TB/s L2 -> SM rate;
  * "n128": 128 x 128 tiles (128 FLOP/B), no wgmma in flight during a promotion (chunk 1: the in-flight version
    spills there), both warpgroups issue when a block lands;
  * "n128_ordered": 128 x 128 tiles, the warpgroups take turns to issue (WGRAD_ORDERED), so one promotes while the
    other's wgmma runs;
  * "n64_ordered": 128 x 64 tiles, turns instead of the in-flight wgmma.

Usage: python scripts/ab_fp8_wgrad.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384 deepseek-v3:8192)

Per case, uniform routing:
  1. the two weight gradients alone (dW13: P = dgu (R, 2F), Q = x rows gathered from the tokens; dW2: P = dout rows,
     Q = hw; random bf16 rows quantized 128x1 as the layer does, bf16 out): every arm compared bit for bit with
     "n64", then ROUNDS rounds of the arms in turn, ITERS timed calls each (megamoe.bench.timing: CUDA events, L2
     flushed); median ms and TFLOP/s per arm;
  2. the FP8 layer's forward + backward (the benchmark's problem, no shared expert as in megamoe.bench's FP8 rows):
     every arm's output and gradients compared bit for bit with "n64", then the arms interleaved the same way.
"""

from __future__ import annotations

import statistics
import sys

import torch

from megamoe import get_preset
from megamoe.bench.problem import make_problem
from megamoe.bench.routing_models import make_routing
from megamoe.bench.timing import Timer
from megamoe.functional import moe_experts
from megamoe.ops import build_routing_plan, fp8_gemm_gluon, fp8_quant
from megamoe.ops.fp8_gemm import table_for

ROUNDS, ITERS = 4, 10
ARMS = {"n64": (64, None, False), "n128": (128, 1, False), "n128_ordered": (128, None, True),
        "n64_ordered": (64, None, True)}


def _arm(name: str) -> None:
    fp8_gemm_gluon.WGRAD_BLOCK_N, fp8_gemm_gluon.WGRAD_UNROLL, fp8_gemm_gluon.WGRAD_ORDERED = ARMS[name]


def _interleaved(timer: Timer, fn) -> dict[str, float]:
    ms = {name: [] for name in ARMS}
    names = list(ARMS)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each round starts at the next arm
            _arm(name)
            fn()  # warm (and compile)
            ms[name] += timer.time(lambda _: fn(), ITERS)
    _arm("n64")
    return {name: statistics.median(v) for name, v in ms.items()}


def _gemm(spec: str, label: str, timer: Timer, args: tuple, flop: float) -> None:
    """Bits and interleaved timing of one weight gradient on quantized operands ``args``."""

    def fn():
        return fp8_gemm_gluon.fp8_k_grouped_mm_gluon(*args[:5], block_offsets_E1=args[5], out_dtype=torch.bfloat16)

    _arm("n64")
    base = fn()
    same = {}
    for name in ARMS:  # one arm's result at a time beside the base (deepseek-v3's dW13 is 15 GB)
        _arm(name)
        got = fn()
        same[name] = torch.equal(got.view(torch.int16), base.view(torch.int16))
        del got
    del base
    ms = _interleaved(timer, fn)
    cols = "  ".join(f"{n} {v:.3f} ms {flop / 1e9 / v:.0f} TFLOP/s ({v / ms['n64']:.3f}x)" for n, v in ms.items())
    print(f"{spec} {label}: bits equal to n64 {same}\n  {cols}", flush=True)


def _gemms(spec: str, timer: Timer) -> None:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    T, D, F, E, k = int(tokens), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    plan = build_routing_plan(torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices, E)
    off, R = plan.offsets_E1, T * k
    blocks = table_for(off, 128, None)
    for label, M, N, q_rows, q_idx in (("dW13", 2 * F, D, T, plan.row_token_N), ("dW2", D, F, R, None)):
        p = torch.randn(R, M, device="cuda", generator=g, dtype=torch.bfloat16)
        q = torch.randn(q_rows, N, device="cuda", generator=g, dtype=torch.bfloat16)
        args = (*fp8_quant.quantize_128x1_grouped(p, off, None, blocks, kmajor=True),
                *fp8_quant.quantize_128x1_grouped(q, off, q_idx, blocks, kmajor=True), off, blocks)
        del p, q
        _gemm(spec, f"{label} (M {M}, N {N}, {R} rows)", timer, args, 2 * R * M * N)


def _fingerprint(t: torch.Tensor) -> int:
    """An exact fingerprint of t's bytes computed on the GPU (integer sums: no rounding, any order): sum over its
    32-bit words w_i of w_i * (2 i + 1), mod 2^64, in chunks. Equal bytes give equal fingerprints; a difference
    goes unseen only if it cancels exactly. The layer's results are compared this way so that a second set of
    gradients need not be held (deepseek-v3's are 22.5 GB in bf16)."""
    words = t.detach().contiguous().view(-1).view(torch.uint8)
    if words.numel() % 4:  # a copy only for such (small) tensors
        words = torch.nn.functional.pad(words, (0, -words.numel() % 4))
    words = words.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), 1 << 26):
        chunk = words[start:start + (1 << 26)].to(torch.int64)
        idx = torch.arange(start, start + chunk.numel(), device=t.device, dtype=torch.int64)
        total += (chunk * (2 * idx + 1)).sum()
    return int(total)


def _layer(spec: str, timer: Timer) -> None:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    p = make_problem(spec, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device="cuda")
    p.shared_w13_HD = p.shared_w2_DS = None
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]

    def step():
        out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
        return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]

    _arm("n64")
    base = [_fingerprint(t) for t in step()]
    same = {}
    for name in ARMS:
        _arm(name)
        same[name] = [_fingerprint(t) for t in step()] == base
    ms = _interleaved(timer, step)
    cols = "  ".join(f"{n} {v:.3f} ({v / ms['n64']:.3f}x)" for n, v in ms.items())
    print(f"{spec} layer: bits equal to n64 {same}\n  fwd+bwd ms: {cols}", flush=True)


if __name__ == "__main__":
    if not (torch.cuda.is_available() and fp8_gemm_gluon.fp8_gluon_runs_on(torch.device("cuda"))):
        raise SystemExit("needs a Hopper GPU (the Gluon FP8 kernels)")
    timer = Timer(torch.device("cuda"))
    for spec in sys.argv[1:] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        _gemms(spec, timer)
        try:
            _layer(spec, timer)
        except torch.OutOfMemoryError as e:  # deepseek-v3:8192 needs ~70 GB: at the edge of an 80 GB H100
            print(f"{spec} layer: out of memory on this GPU ({str(e).splitlines()[0]})", flush=True)
        torch.cuda.empty_cache()
