"""A/B of when the FP8 weight gradient's MMA warpgroups load a tile's coordinates, on one Hopper GPU (the Gluon
kernel megamoe.kernels.fp8_gemm_gluon.fp8_k_grouped_ws_kernel), switch megamoe.ops.fp8_gemm_gluon.WGRAD_COORDS_AHEAD:

  * "base" (main's code): at each tile's start, before its first wgmma is issued (the expert's row offsets and
    first block: a global-memory round trip with the tensor cores idle, on every tile; deepseek-v3's weight
    gradients run ~3500 tiles per SM);
  * "ahead": the next tile's coordinates are loaded right after this tile's first wgmma is issued, so their
    latency hides behind the tile.

Usage: python scripts/ab_fp8_wgrad_coords.py [CASE ...] [--layer-only]   (CASE = preset:tokens; default
qwen3-30b-a3b:16384 deepseek-v3:8192; --layer-only: the layer A/B alone)

Per case, uniform routing:
  1. the two weight gradients alone (dW13: P = dgu (R, 2F), Q = x rows gathered from the tokens; dW2: P = dout rows,
     Q = hw; random bf16 rows quantized 128x1 as the layer does, bf16 out): every arm compared bit for bit with
     "base", then ROUNDS rounds of the arms in turn, each round starting at the next arm, ITERS timed calls each
     (megamoe.bench.timing: CUDA events, L2 flushed); median ms and TFLOP/s per arm;
  2. the FP8 layer's forward + backward (the benchmark's problem, no shared expert as in megamoe.bench's FP8 rows):
     every arm's output and gradients compared bit for bit with "base", then the arms interleaved the same way.
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
ARMS = {"base": False, "ahead": True}
BASE = "base"


def _arm(name: str) -> None:
    fp8_gemm_gluon.WGRAD_COORDS_AHEAD = ARMS[name]


def _interleaved(timer: Timer, fn) -> dict[str, float]:
    ms = {name: [] for name in ARMS}
    names = list(ARMS)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _arm(name)
            fn()  # warm (and compile)
            ms[name] += timer.time(lambda _: fn(), ITERS)
    _arm(BASE)
    return {name: statistics.median(v) for name, v in ms.items()}


def _gemm(spec: str, label: str, timer: Timer, args: tuple, flop: float) -> None:
    """Bits and interleaved timing of one weight gradient on quantized operands ``args``."""

    def fn():
        return fp8_gemm_gluon.fp8_k_grouped_mm_gluon(*args[:5], block_offsets_E1=args[5], out_dtype=torch.bfloat16)

    _arm(BASE)
    base = fn()
    same = {}
    for name in ARMS:  # one arm's result at a time beside the base (deepseek-v3's dW13 is 15 GB)
        _arm(name)
        got = fn()
        same[name] = torch.equal(got.view(torch.int16), base.view(torch.int16))
        del got
    del base
    ms = _interleaved(timer, fn)
    cols = "  ".join(f"{n} {v:.3f} ms {flop / 1e9 / v:.0f} TFLOP/s ({v / ms[BASE]:.3f}x)" for n, v in ms.items())
    print(f"{spec} {label}: bits equal to base {same}\n  {cols}", flush=True)


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


def _layer(spec: str, timer: Timer) -> None:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    p = make_problem(spec, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device="cuda")
    p.shared_w13_HD = p.shared_w2_DS = None
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]

    def step():
        out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
        return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]

    _arm(BASE)
    base = [t.view(torch.int16).cpu() for t in step()]  # on the host: deepseek-v3's weight gradients are 22.5 GB
    same = {}
    for name in ARMS:
        _arm(name)
        same[name] = all(torch.equal(a, b.view(torch.int16).cpu()) for a, b in zip(base, step()))
    del base
    ms = _interleaved(timer, step)
    cols = "  ".join(f"{n} {v:.3f} ({v / ms[BASE]:.3f}x)" for n, v in ms.items())
    print(f"{spec} layer: bits equal to base {same}\n  fwd+bwd ms: {cols}", flush=True)


if __name__ == "__main__":
    if not (torch.cuda.is_available() and fp8_gemm_gluon.fp8_gluon_runs_on(torch.device("cuda"))):
        raise SystemExit("needs a Hopper GPU (the Gluon FP8 kernels)")
    timer = Timer(torch.device("cuda"))
    layer_only = "--layer-only" in sys.argv
    for spec in [a for a in sys.argv[1:] if a != "--layer-only"] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        if not layer_only:
            _gemms(spec, timer)
        _layer(spec, timer)
