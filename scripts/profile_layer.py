"""Where one fused-layer forward+backward spends its GPU time, kernel by kernel (torch.profiler).

Runs ``moe_experts(..., backend="fused")`` forward + backward on the benchmark's problems (same inputs as
``python -m megamoe.bench``: uniform routing, routed + shared experts, bf16) and prints, per case, the
CUDA kernels grouped by name with calls, total and per-step ms and share of the step, plus the sum and the
step's wall time from CUDA events; then where the GPU idles between kernels when steps run back to back
(as the benchmark runs them: no sync between steps), the host time to enqueue one step, and the step
replayed as a CUDA graph (no host launches at all). Writes OUT_DIR/profile_layer.json.

Usage: python scripts/profile_layer.py OUT_DIR [preset:T ...] [--fp8 [--uncached]] [--ep1] [--host]
       [--steps-only N]  (a CUDA GPU; installs nothing)
With --fp8 the routed experts run in block-scaled FP8 (``moe_experts(..., fp8=True)``); add --uncached to quantize
the weights at every step (``megamoe.ops.fp8_weights.uncached()``: what FSDP2 and one micro-batch per optimizer
step pay; the CUDA-graph replay always does).
With --ep1 it profiles the EP path instead (``functional_ep.moe_experts_ep`` on a one-rank group, the benchmark's
``megamoe-ep`` provider): the exchange kernels next to the GEMMs, on one GPU.
With --host it also runs the host-enqueue loop under cProfile and prints the 30 functions with the most own time
(where the host's per-step cost goes when a shape is host-bound).
With --steps-only N it only runs N steps per case and exits (for Nsight Compute, `scripts/gpu.sh ncu`: no
torch.profiler, no graph capture).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.bench.problem import make_problem
from megamoe.bench.routing_models import make_routing
from megamoe.bench.runner import parse_cases
from megamoe.config import get_preset
from megamoe.functional import moe_experts

STEPS = 5


@dataclass(frozen=True)
class Options:
    """What the command line asks for (the module doc)."""

    fp8: bool = False  # the routed experts in block-scaled FP8 (moe_experts(..., fp8=True))
    uncached: bool = False  # FP8: the weights quantized at every step (fp8_weights.uncached())
    ep1: bool = False  # the EP path on a one-rank group
    host: bool = False  # cProfile of the host-enqueue loop
    steps_only: int = 0  # > 0: run that many steps per case, nothing else


def _layer(opts: Options, *args):
    if opts.uncached:
        from megamoe.ops.fp8_weights import uncached
        with uncached():
            return _layer_call(opts, *args)
    return _layer_call(opts, *args)


def _layer_call(opts: Options, *args):
    if opts.ep1:
        from megamoe.bench.providers_ep import one_rank_group
        from megamoe.functional_ep import moe_experts_ep
        return moe_experts_ep(*args, group=one_rank_group(args[0].device), fp8=opts.fp8)
    return moe_experts(*args, backend="fused", fp8=opts.fp8)


def _step(prob, opts: Options):
    leaves = [t for t in (prob.x_TD, prob.topk_weights_TK, prob.w13, prob.w2, prob.shared_w13_HD,
                          prob.shared_w2_DS) if t is not None]
    out = _layer(opts, prob.x_TD, prob.topk_ids_TK, prob.topk_weights_TK, prob.w13, prob.w2, prob.shared_w13_HD,
                 prob.shared_w2_DS)
    return torch.autograd.grad(out, leaves, prob.grad_out_TD)


def profile_case(name: str, T: int, opts: Options) -> dict:
    cfg = get_preset(name)
    prob = make_problem(name, cfg, T, make_routing("uniform", cfg, T, 1, 0), world_size=1, rank=0, seed=0,
                        dtype=torch.bfloat16, device=torch.device("cuda"))
    if opts.steps_only:
        for _ in range(opts.steps_only):
            _step(prob, opts)
        torch.cuda.synchronize()
        return dict(case=f"{name}:{T}", steps_only=opts.steps_only)
    for _ in range(3):
        _step(prob, opts)
    torch.cuda.synchronize()
    times = []
    for _ in range(STEPS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        _step(prob, opts)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):  # back to back, no sync in between (as the benchmark's W=1 timing)
            _step(prob, opts)
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    kernels = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            key = ev.name[:90]
            per[key][0] += 1
            per[key][1] += ev.device_time_total / 1e3
            kernels.append((ev.time_range.start, ev.time_range.end, key))
    kernels.sort()
    # idle time between consecutive kernels (us), after the first step's start
    gaps = defaultdict(lambda: [0, 0.0])
    idle = 0.0
    for (s0, e0, k0), (s1, _e1, k1) in zip(kernels, kernels[1:]):
        g = s1 - max(e0, s0)
        if g > 0:
            idle += g
            if g > 8:
                gaps[(k0[:45], k1[:45])][0] += 1
                gaps[(k0[:45], k1[:45])][1] += g
    span_ms = (kernels[-1][1] - kernels[0][0]) / 1e3 / STEPS if kernels else 0.0
    wall = statistics.median(times)
    rows = sorted(((k, c / STEPS, ms / STEPS) for k, (c, ms) in per.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    # host time to enqueue one step: from an empty queue, with no sync until the end (the host runs ahead of
    # the GPU, so this is the host's own cost unless something in a step waits for the device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        _step(prob, opts)
    host_ms = (time.perf_counter() - t0) * 1e3 / STEPS
    torch.cuda.synchronize()
    if opts.host:
        _host_profile(prob, f"{name} T={T}", opts)
    graph_ms = _graph_ms(prob, opts)
    path = " (EP path, one-rank group)" if opts.ep1 else ""
    print(f"\n== {name} T={T}{path}: step {wall:.2f} ms (CUDA events, synced steps, median of {STEPS}); kernels sum "
          f"{total:.2f} ms per step; back to back: {span_ms:.2f} ms per step, GPU idle {idle / 1e3 / STEPS:.2f} "
          f"ms per step; host enqueue {host_ms:.2f} ms per step; CUDA graph replay "
          f"{'not measured (out of memory)' if graph_ms is None else f'{graph_ms:.2f} ms'}")
    for k, c, ms in rows:
        print(f"  {ms:7.3f} ms {100 * ms / wall:5.1f}%  x{c:<4g} {k}")
    print("  idle gaps > 8 us between kernels (per step: count, us), largest first:")
    for (k0, k1), (c, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"    {us / STEPS:8.1f} us x{c / STEPS:<4g} {k0} -> {k1}")
    return dict(case=f"{name}:{T}", step_ms=wall, kernel_sum_ms=total, back_to_back_ms=span_ms,
                idle_ms=idle / 1e3 / STEPS, host_ms=host_ms, graph_ms=graph_ms,
                kernels=[dict(name=k, calls=c, ms=ms) for k, c, ms in rows])


def _host_profile(prob, case: str, opts: Options) -> None:
    """cProfile of STEPS enqueued steps (synced only at the end): the 30 largest own times, totals over the
    STEPS steps (printed before the case's summary line, so it names its case)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(STEPS):
        _step(prob, opts)
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    print(f"  host profile of {case}, totals over {STEPS} steps (cProfile, own time first):")
    print("\n".join("    " + line for line in buf.getvalue().splitlines()[4:45]))


def _graph_ms(prob, opts: Options) -> float | None:
    """Median ms of the step captured once into a CUDA graph and replayed (GPU time without host launches); None
    when the capture runs out of memory (the graph's private pool holds a second step's tensors beside the eager
    steps' cached blocks, which are released first: deepseek-v3:8192 in FP8 on an 80 GB GPU)."""
    torch.cuda.empty_cache()
    try:
        return _graph_replay_ms(prob, opts)
    except torch.OutOfMemoryError:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return None


def _graph_replay_ms(prob, opts: Options) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            _step(prob, opts)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(prob, opts)
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(STEPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del graph
    return statistics.median(ts)


def parse_args(argv: list[str] | None = None) -> tuple[str, list[tuple[str, int]], Options]:
    """(output folder, cases as (preset, T), options) from the command line; SystemExit with a message on bad
    input (the cases checked by the benchmark's own parser)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("cases", nargs="*", default=["qwen3-30b-a3b:16384", "deepseek-v3:4096"], help="preset:T")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--uncached", action="store_true")
    p.add_argument("--ep1", action="store_true")
    p.add_argument("--host", action="store_true")
    p.add_argument("--steps-only", type=int, default=0, metavar="N")
    a = p.parse_intermixed_args(argv)  # flags before, between or after the cases
    if a.uncached and not a.fp8:
        p.error("--uncached is for the FP8 layer's weight blocks: give --fp8 with it")
    if a.steps_only < 0:
        p.error(f"--steps-only must be >= 0, got {a.steps_only}")
    if a.host and a.steps_only:
        p.error("--host profiles the host loop of a full profile: not with --steps-only")
    try:
        cases = parse_cases(a.cases, None, None)  # an unknown preset or a bad T fails here, before any run
    except (KeyError, ValueError) as exc:
        p.error(str(exc).strip('"'))
    return a.out_dir, cases, Options(fp8=a.fp8, uncached=a.uncached, ep1=a.ep1, host=a.host,
                                       steps_only=a.steps_only)


def main(argv: list[str] | None = None):
    out_dir, cases, opts = parse_args(argv)
    os.makedirs(out_dir, exist_ok=True)  # before the first case: a bad path fails at once, not after the runs
    res = []
    for name, T in cases:
        res.append(profile_case(name, T, opts) | {"path": "ep1" if opts.ep1 else "direct"})
        torch.cuda.empty_cache()
    if opts.ep1:
        from megamoe.bench.providers_ep import close_one_rank_group
        close_one_rank_group()
    tag = f"{'_ep1' if opts.ep1 else ''}{'_fp8' if opts.fp8 else ''}{'_uncached' if opts.uncached else ''}"
    with open(f"{out_dir}/profile_layer{tag}.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
