"""A/B of the experiment megamoe.autograd_fp8.SPLIT_DGRAD on one Hopper GPU: the FP8 layer's forward + backward with
the dgrad + SwiGLU backward as the Triton GEMM with the row gather and the SwiGLU epilogue (A) and as dout's rows
quantized into expert order, a plain warp-specialized Gluon GEMM into fp32 and a SwiGLU-backward pass (B).

Usage: python scripts/ab_fp8_split_dgrad.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384
deepseek-v3:8192; one H200: about a minute)

Per case (the benchmark's problem, uniform routing, bf16, no shared expert as in megamoe.bench's FP8 rows): first
the output and every gradient of A and B compared bit for bit, then ROUNDS rounds of A then B, each ITERS timed
steps (megamoe.bench.timing: CUDA events, L2 flushed), and the median over all steps of each arm. Without a GPU it
runs on the CPU under TRITON_INTERPRET=1 (a smoke run of the script: use a small case such as small:16).
"""

from __future__ import annotations

import statistics
import sys

import torch

from megamoe import autograd_fp8, get_preset
from megamoe.bench.problem import make_problem
from megamoe.bench.routing_models import make_routing
from megamoe.bench.timing import Timer
from megamoe.functional import moe_experts

ROUNDS, ITERS = 4, 10


def _step(p):
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]
    out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
    return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]


def _case(spec: str) -> str:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    routing = make_routing("uniform", cfg, int(tokens), 1, 0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = make_problem(spec, cfg, int(tokens), routing, device=dev, dtype=None if dev.type == "cuda" else torch.float32)
    p.shared_w13_HD = p.shared_w2_DS = None
    got = {}
    for arm in (False, True):
        autograd_fp8.SPLIT_DGRAD = arm
        got[arm] = _step(p)
    same = all(torch.equal(a, b) for a, b in zip(got[False], got[True]))
    timer = Timer(dev)
    ms = {False: [], True: []}
    for _ in range(ROUNDS):
        for arm in (False, True):
            autograd_fp8.SPLIT_DGRAD = arm
            _step(p)  # warm
            ms[arm] += timer.time(lambda _: _step(p), ITERS)
    a, b = statistics.median(ms[False]), statistics.median(ms[True])
    return f"{spec}: bits equal {same}; fwd+bwd ms A (fused) {a:.3f}  B (split) {b:.3f}  B/A {b / a:.3f}"


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        print(_case(spec), flush=True)
