"""A/B of the experiment megamoe.ops.fp8_gemm_gluon.SKIP_IDLE_WARPGROUP on one Hopper GPU: the FP8 layer's forward +
backward with the warp-specialized Gluon m-grouped GEMM (gate/up, down, the dgrad, dx) running both MMA warpgroups
on every tile ("all", main's code), or with a warpgroup whose 64 rows of a tile all lie past the tile's expert only
passing the ring's handshakes ("skip_idle": no wgmma for rows that are never stored; tiles of an expert's last
<= 64 rows: about half the experts' last tiles under uniform routing).

Usage: python scripts/ab_fp8_idle.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384 deepseek-v3:8192)

Per case (the benchmark's problem, uniform routing, bf16, no shared expert as in megamoe.bench's FP8 rows): first
every arm's output and gradients compared bit for bit with "all", then ROUNDS rounds of the arms in turn, ITERS timed
steps each (megamoe.bench.timing: CUDA events, L2 flushed), and per arm the median over all its steps and the ratio
to "all". Needs a Hopper GPU (the Gluon kernel).
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
from megamoe.ops import fp8_gemm_gluon

ROUNDS, ITERS = 4, 10
ARMS = {"all": False, "skip_idle": True}


def _step(p):
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]
    out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
    return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]


def _arm(name: str) -> None:
    fp8_gemm_gluon.SKIP_IDLE_WARPGROUP = ARMS[name]


def _case(spec: str, arms: list[str]) -> str:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = make_problem(spec, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device=dev,
                     dtype=None if dev.type == "cuda" else torch.float32)
    p.shared_w13_HD = p.shared_w2_DS = None
    _arm("all")
    base_out = _step(p)
    same = {}
    for name in arms:  # one arm's results at a time beside the first arm's (deepseek-v3's dW13 alone is 15 GB)
        _arm(name)
        same[name] = all(torch.equal(a, b) for a, b in zip(base_out, _step(p)))
    del base_out
    timer = Timer(dev)
    ms = {name: [] for name in arms}
    for _ in range(ROUNDS):
        for name in arms:
            _arm(name)
            _step(p)  # warm
            ms[name] += timer.time(lambda _: _step(p), ITERS)
    base = statistics.median(ms["all"])
    cols = "  ".join(f"{n} {statistics.median(v):.3f} ({statistics.median(v) / base:.3f}x)" for n, v in ms.items())
    return f"{spec}: bits equal to all {same}\n  fwd+bwd ms: {cols}"


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        print(_case(spec, list(ARMS)), flush=True)
