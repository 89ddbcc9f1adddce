"""A/B of the experiments megamoe.autograd_fp8.SPLIT_DGRAD, SPLIT_GATE_UP and SPLIT_128X1 on one Hopper GPU: the FP8
layer's forward + backward with the two GEMMs that gather rows and end in a SwiGLU epilogue as they are (Triton), and
split into rows quantized straight into expert order, a plain warp-specialized Gluon GEMM and a SwiGLU pass (with
SPLIT_128X1 the SwiGLU-backward pass also makes dgu's and hw's 128x1 weight-gradient blocks).

Usage: python scripts/ab_fp8_split.py [CASE ...] [--arms A,B,...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384
deepseek-v3:8192; one H200: about two minutes)

Arms: "fused" (neither split), "dgrad" (SPLIT_DGRAD), "gate_up" (SPLIT_GATE_UP), "both", "both_128x1" (both and
SPLIT_128X1). Per case (the benchmark's
problem, uniform routing, bf16, no shared expert as in megamoe.bench's FP8 rows): first every arm's output and
gradients compared bit for bit with "fused", then ROUNDS rounds of the arms in turn, ITERS timed steps each
(megamoe.bench.timing: CUDA events, L2 flushed), and per arm the median over all its steps and the ratio to "fused".
Without a GPU it runs on the CPU under TRITON_INTERPRET=1 (a smoke run of the script: a small case such as small:16,
in float32, one round of one step per arm; a few minutes).
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

ROUNDS, ITERS = (4, 10) if torch.cuda.is_available() else (1, 1)  # the CPU run is a smoke run
ARMS = {"fused": (False, False, False), "dgrad": (True, False, False), "gate_up": (False, True, False),
        "both": (True, True, False), "both_128x1": (True, True, True)}


def _step(p):
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]
    out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
    return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]


def _arm(name: str) -> None:
    autograd_fp8.SPLIT_DGRAD, autograd_fp8.SPLIT_GATE_UP, autograd_fp8.SPLIT_128X1 = ARMS[name]


def _case(spec: str, arms: list[str]) -> str:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = make_problem(spec, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device=dev,
                     dtype=None if dev.type == "cuda" else torch.float32)
    p.shared_w13_HD = p.shared_w2_DS = None
    _arm("fused")
    fused = _step(p)
    same = {}
    for name in arms:  # one arm's results at a time beside the fused arm's (deepseek-v3's dW13 alone is 15 GB)
        _arm(name)
        same[name] = all(torch.equal(a, b) for a, b in zip(fused, _step(p)))
    del fused
    timer = Timer(dev)
    ms = {name: [] for name in arms}
    for _ in range(ROUNDS):
        for name in arms:
            _arm(name)
            _step(p)  # warm
            ms[name] += timer.time(lambda _: _step(p), ITERS)
    base = statistics.median(ms["fused"])
    cols = "  ".join(f"{n} {statistics.median(v):.3f} ({statistics.median(v) / base:.3f}x)" for n, v in ms.items())
    return f"{spec}: bits equal to fused {same}\n  fwd+bwd ms: {cols}"


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = ["fused", *[a for a in args[args.index("--arms") + 1].split(",") if a != "fused"]] if "--arms" in args \
        else list(ARMS)
    specs = [a for i, a in enumerate(args) if a != "--arms" and (i == 0 or args[i - 1] != "--arms")]
    for spec in specs or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        print(_case(spec, chosen), flush=True)
