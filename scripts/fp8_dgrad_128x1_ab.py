"""A/B on one Hopper GPU: the FP8 layer with dgu's and hw's 128x1 weight-gradient blocks made in the dgrad +
SwiGLU-backward epilogue (``Fp8Experts.fuse_128x1 = True``) against the separate K-major 128x1 quantizers on the
16-bit dgu and hw (``False``).

Usage: python scripts/fp8_dgrad_128x1_ab.py [CASE ...] [--rounds N] [--iters N] [--warmup N]
  (CASE = preset:tokens; default qwen3-30b-a3b:16384 deepseek-v3:8192; one H200: a few minutes)

Per case (megamoe.bench's seeded problem: uniform routing, the preset's dtype, ``moe_experts(..., fp8=True)``):
  1. bits: the output and every gradient (x, routing weights, w13, w2, shared weights) of one forward + backward
     with each arm, compared bit for bit; the script stops (exit status 1) at the first difference;
  2. speed: forward + backward timed in interleaved rounds (each round times both arms, the first arm alternating,
     ``iters`` samples each after a warm-up; megamoe.bench.timing.Timer: CUDA events, L2 flushed before each
     sample). One line per arm: the median of all its samples, each round's median, the peak memory, and the
     fused arm's difference from the separate one.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton

from megamoe.autograd_fp8 import Fp8Experts
from megamoe.bench.problem import make_problem
from megamoe.bench.routing_models import make_routing
from megamoe.bench.timing import Timer
from megamoe.config import get_preset
from megamoe.functional import moe_experts
from megamoe.ops.fp8_weights import WEIGHT_CACHE

ARMS = {"fused": True, "separate": False}  # label -> Fp8Experts.fuse_128x1
NAMES = ("out", "dx", "dtopk_weights", "dw13", "dw2", "dshared_w13", "dshared_w2")


def _step(prob, fuse: bool):
    Fp8Experts.fuse_128x1 = fuse
    out = moe_experts(*prob.args(), backend="fused", fp8=True)
    return [out] + list(torch.autograd.grad(out, prob.grad_inputs(), prob.grad_out_TD))


def _bits_equal(case: str, prob) -> bool:
    """One forward + backward per arm, every result compared bit for bit (the first arm's kept on the GPU)."""
    first = [t.detach() for t in _step(prob, True)]
    second = _step(prob, False)
    bad = [n for n, a, b in zip(NAMES, first, second) if a.dtype != b.dtype or not torch.equal(a, b)]
    print(f"{case}: bits {'equal' if not bad else 'DIFFER in ' + ', '.join(bad)} "
          f"({len(first)} tensors: output and every gradient)", flush=True)
    del first, second
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return not bad


def _time(case: str, prob, timer: Timer, args) -> None:
    def work(_):
        _step(prob, Fp8Experts.fuse_128x1)

    rounds = {arm: [] for arm in ARMS}
    peak = dict.fromkeys(ARMS, 0.0)
    for fuse in ARMS.values():  # warm-up (compiles, caches)
        Fp8Experts.fuse_128x1 = fuse
        timer.time(work, args.warmup)
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        for arm in order:
            Fp8Experts.fuse_128x1 = ARMS[arm]
            if timer.cuda:
                torch.cuda.reset_peak_memory_stats()
            rounds[arm].append(timer.time(work, args.iters))
            if timer.cuda:
                peak[arm] = max(peak[arm], torch.cuda.max_memory_allocated() / 2 ** 30)
    med = {arm: statistics.median([t for rnd in rounds[arm] for t in rnd]) for arm in ARMS}
    base = med["separate"]
    for arm in ARMS:
        per_round = " ".join(f"{statistics.median(rnd):.3f}" for rnd in rounds[arm])
        diff = "" if arm == "separate" else f"  {med[arm] - base:+.3f} ms ({med[arm] / base - 1:+.1%})"
        print(f"{case:28s} {arm:9s} f+b median {med[arm]:8.3f} ms  rounds [{per_round}]  peak {peak[arm]:.1f} GiB"
              f"{diff}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", default=["qwen3-30b-a3b:16384", "deepseek-v3:8192"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--iters", type=int, default=5, help="samples per arm and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1 (small presets)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    timer = Timer(device)
    where = torch.cuda.get_device_name(device) if timer.cuda else "the Triton interpreter"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {where}", flush=True)
    try:
        for case in args.cases:
            preset, tokens = case.split(":")
            cfg = get_preset(preset)
            T = int(tokens)
            prob = make_problem(case, cfg, T, make_routing("uniform", cfg, T, 1, 0), device=device)
            WEIGHT_CACHE.clear()
            if not _bits_equal(case, prob):
                return 1
            _time(case, prob, timer, args)
            del prob
            WEIGHT_CACHE.clear()
            if timer.cuda:
                torch.cuda.empty_cache()
    finally:
        Fp8Experts.fuse_128x1 = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
