"""A/B of the experiment megamoe.autograd_fp8.DUAL_DOUT on one GPU: the FP8 layer's forward + backward with the dout
rows quantized 1x128 (for the dgrad) and 128x1 (for w2's weight gradient) by two kernels that each read the rows
("separate", main's code) or by one kernel from one read ("dual": 4 warps, the branch's choice; "dual_8warps").

Usage: python scripts/ab_fp8_dual.py [CASE ...]   (CASE = preset:tokens; default qwen3-30b-a3b:16384 deepseek-v3:8192)

Per case (the benchmark's
problem, uniform routing, bf16, no shared expert as in megamoe.bench's FP8 rows): first every arm's output and
gradients compared bit for bit with "separate", then ROUNDS rounds of the arms in turn, ITERS timed steps each
(megamoe.bench.timing: CUDA events, L2 flushed), and per arm the median over all its steps and the ratio to "separate".
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
from megamoe.ops import fp8_quant

ROUNDS, ITERS = (4, 10) if torch.cuda.is_available() else (1, 1)  # the CPU run is a smoke run
ARMS = {"separate": (False, 4), "dual": (True, 4), "dual_8warps": (True, 8)}


def _step(p):
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]
    out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
    return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]


def _arm(name: str) -> None:
    autograd_fp8.DUAL_DOUT, fp8_quant._DUAL_WARPS = ARMS[name]


def _fingerprint(t: torch.Tensor) -> int:
    """An exact fingerprint of t's bytes computed on the GPU (integer sums: no rounding, any order): sum over its
    32-bit words w_i of w_i * (2 i + 1), mod 2^64, in chunks. Equal bytes give equal fingerprints; a difference
    goes unseen only if it cancels exactly. The results are compared this way so that a second set of gradients
    need not be held (deepseek-v3's are 22.5 GB in bf16: two sets and the weights do not fit an 80 GB GPU)."""
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


def _case(spec: str, arms: list[str]) -> str:
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = make_problem(spec, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device=dev,
                     dtype=None if dev.type == "cuda" else torch.float32)
    p.shared_w13_HD = p.shared_w2_DS = None
    _arm("separate")
    base_out = [_fingerprint(t) for t in _step(p)]
    same = {}
    for name in arms:
        _arm(name)
        same[name] = [_fingerprint(t) for t in _step(p)] == base_out
    timer = Timer(dev)
    ms = {name: [] for name in arms}
    for r in range(ROUNDS):
        for name in arms[r % len(arms):] + arms[:r % len(arms)]:  # each round starts at the next arm
            _arm(name)
            _step(p)  # warm
            ms[name] += timer.time(lambda _: _step(p), ITERS)
    base = statistics.median(ms["separate"])
    cols = "  ".join(f"{n} {statistics.median(v):.3f} ({statistics.median(v) / base:.3f}x)" for n, v in ms.items())
    return f"{spec}: bits equal to separate {same}\n  fwd+bwd ms: {cols}"


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        print(_case(spec, list(ARMS)), flush=True)
