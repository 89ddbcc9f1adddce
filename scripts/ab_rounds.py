"""Cost of the EP rounds that the routing did not need, on one GPU (a one-rank group, W = 1), bitwise-checked.

An exchange launches enough rounds for the worst routing (megamoe.distributed.max_rounds: 3 at W = 4 and
7 at W = 8 with the default capacity and K = 8), however the routing falls. This script builds that
situation on one GPU: the workspace's token capacity is reserved at ROUNDS x T, and the layer runs with the
receive capacity of the rows it has (T*K: every row in round 0, the other launched rounds unused; 2*ROUNDS - 1
launched), with a capacity for the worst case (one round), and with 1/ROUNDS of the rows per round ("rows in
all": about ROUNDS rounds used, cut at expert boundaries, more rounds launched). To compare two commits, run
a ``git archive`` copy of the other one's ``megamoe`` package with ``PYTHONPATH`` pointing at it
(benchmarks/results/2026-12-01-s13/README.md). Per case it prints the forward+backward medians
(megamoe.bench.Timer, L2 flush, interleaved), whether a variant gives bitwise the one-round output and
gradients, and how many experts' weight gradients are bitwise the one-round ones (all of them unless an
expert has more rows than the capacity; such split ones agree to fp32 rounding).

Default case: deepseek-v3's D, F, K and shared expert with E = 32 experts, the local experts of one rank at
EP = 8, and T = 4096 (1024 rows per expert, as each rank of EP = 8 with 4096 tokens per rank receives).

Usage:  python scripts/ab_rounds.py OUT_DIR [preset:T:E ...]   (ROUNDS env, default 4; PROFILE=1 also prints
        the kernels of one several-round step)
Needs a CUDA GPU; installs nothing. Writes OUT_DIR/ab_rounds.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys

import torch

from megamoe.bench.problem import make_problem
from megamoe.bench.providers_ep import close_one_rank_group, one_rank_group
from megamoe.bench.routing_models import make_routing
from megamoe.bench.timing import Timer
from megamoe.config import get_preset


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    from megamoe.distributed import reserve_workspace
    from megamoe.functional_ep import moe_experts_ep

    out_dir, cases = sys.argv[1], sys.argv[2:] or ["deepseek-v3:4096:32"]
    rounds = int(os.environ.get("ROUNDS", "4"))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    group = one_rank_group(dev)
    timer = Timer(dev)
    rows = []
    for case in cases:
        name, T, E = case.split(":")
        T, E = int(T), int(E)
        cfg = dataclasses.replace(get_preset(name), num_experts=E)
        D, K = cfg.hidden_size, cfg.top_k
        reserve_workspace(group, rounds * T)
        prob = make_problem(name, cfg, T, make_routing("uniform", cfg, T, 1, seed=100), seed=100, device=dev)
        params, dout = prob.grad_inputs(), prob.grad_out_TD
        # worst case in one round / every row in round 0 / the rows spread over about ``rounds`` rounds
        caps = {"1 round": rounds * T * K, "unused rounds": T * K,
                "rows in all": (T * K // rounds + 127) // 128 * 128}

        def run(cap):
            out = moe_experts_ep(*prob.args(), group=group, capacity_rows=cap)
            return [out.detach()] + list(torch.autograd.grad(out, params, dout))

        base = [t.clone() for t in run(caps["1 round"])]
        same, wdiff = {}, {}
        for k in list(caps)[1:]:
            got = run(caps[k])
            same[k] = all(torch.equal(a, b) for a, b in zip(base, got))
            # the expert weight gradients: experts bitwise equal to one round, largest relative difference
            eq = [bool(torch.equal(a[e], b[e])) for a, b in zip(base[3:5], got[3:5]) for e in range(E)]
            rel = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in zip(base[3:5], got[3:5]))
            wdiff[k] = (sum(eq), len(eq), rel)
        del base
        samples = {k: [] for k in caps}
        for _ in range(4):  # interleaved
            for k, cap in caps.items():
                samples[k] += timer.time(lambda _s, cap=cap: run(cap), iters=3)
        peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        if os.environ.get("PROFILE") == "1":  # kernels of one several-round step, largest first
            from torch.profiler import ProfilerActivity, profile
            run(caps["unused rounds"])
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(caps["unused rounds"])
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        from megamoe.distributed import WorkspaceSpec, max_rounds
        spec = WorkspaceSpec(1, rounds * T, D, K, E, torch.bfloat16)
        for k in caps:
            ms = statistics.median(samples[k])
            n_eq, n_all, rel = wdiff.get(k, (2 * E, 2 * E, 0.0))
            r = dict(case=f"{name} T={T} E={E}", variant=k, capacity_rows=caps[k],
                     rounds_launched=max_rounds(spec, caps[k]), ms=ms,
                     bitwise_equal_to_one_round=same.get(k, True), expert_grads_bitwise=n_eq, expert_grads=n_all,
                     expert_grads_max_rel_diff=rel, commit=os.environ.get("MEGAMOE_COMMIT", ""))
            rows.append(r)
            print(f"{r['case']:24s} {k:13s} capacity {caps[k]:6d} ({r['rounds_launched']:2d} rounds launched)  "
                  f"fwd+bwd {ms:7.2f} ms  all bitwise {'==' if r['bitwise_equal_to_one_round'] else 'no'}; "
                  f"expert grads bitwise {n_eq}/{n_all}, max rel diff {rel:.1e}  (peak {peak:.1f} GiB)", flush=True)
        prob = params = dout = None  # free before the next case
        torch.cuda.empty_cache()
    json.dump(rows, open(f"{out_dir}/ab_rounds.json", "w"), indent=1)
    close_one_rank_group()


if __name__ == "__main__":
    main()
