"""Where one fused-layer forward+backward spends its GPU time, kernel by kernel (torch.profiler).

Runs ``moe_experts(..., backend="fused")`` forward + backward on the benchmark's problems (same inputs as
``python -m megamoe.bench``: uniform routing, routed + shared experts, bf16) and prints, per case, the
CUDA kernels grouped by name with calls, total and per-step ms and share of the step, plus the sum and the
step's wall time from CUDA events. Writes OUT_DIR/profile_layer.json.

Usage: python scripts/profile_layer.py OUT_DIR [preset:T ...]   (needs a CUDA GPU; installs nothing)
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.bench.problem import make_problem
from megamoe.bench.routing_models import make_routing
from megamoe.config import get_preset
from megamoe.functional import moe_experts

STEPS = 5


def _step(prob):
    leaves = [t for t in (prob.x_TD, prob.topk_weights_TK, prob.w13, prob.w2, prob.shared_w13_HD,
                          prob.shared_w2_DS) if t is not None]
    out = moe_experts(prob.x_TD, prob.topk_ids_TK, prob.topk_weights_TK, prob.w13, prob.w2, prob.shared_w13_HD,
                      prob.shared_w2_DS, backend="fused")
    return torch.autograd.grad(out, leaves, prob.grad_out_TD)


def profile_case(name: str, T: int) -> dict:
    cfg = get_preset(name)
    prob = make_problem(name, cfg, T, make_routing("uniform", cfg, T, 1, 0), world_size=1, rank=0, seed=0,
                        dtype=torch.bfloat16, device=torch.device("cuda"))
    for _ in range(3):
        _step(prob)
    torch.cuda.synchronize()
    times = []
    for _ in range(STEPS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        _step(prob)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            _step(prob)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            key = ev.name[:90]
            per[key][0] += 1
            per[key][1] += ev.device_time_total / 1e3
    wall = statistics.median(times)
    rows = sorted(((k, c / STEPS, ms / STEPS) for k, (c, ms) in per.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"\n== {name} T={T}: step {wall:.2f} ms (CUDA events, median of {STEPS}); kernels sum {total:.2f} ms "
          f"per step; gaps {wall - total:.2f} ms")
    for k, c, ms in rows:
        print(f"  {ms:7.3f} ms {100 * ms / wall:5.1f}%  x{c:<4g} {k}")
    return dict(case=f"{name}:{T}", step_ms=wall, kernel_sum_ms=total,
                kernels=[dict(name=k, calls=c, ms=ms) for k, c, ms in rows])


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    cases = sys.argv[2:] or ["qwen3-30b-a3b:16384", "deepseek-v3:4096"]
    res = []
    for c in cases:
        name, T = c.split(":")
        res.append(profile_case(name, int(T)))
        torch.cuda.empty_cache()
    json.dump(res, open(f"{sys.argv[1]}/profile_layer.json", "w"), indent=1)


if __name__ == "__main__":
    main()
