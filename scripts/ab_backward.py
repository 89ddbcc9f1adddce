"""A/B of the EP backward's choice to keep or recompute the routed pre-activations, bitwise-checked.

Variants: ``save_preact`` True / False of megamoe.functional_ep.moe_experts_ep (keep round 0's gate/up
pre-activations from forward to backward, or recompute them from the pulled x). Each variant's output and
gradients must be bitwise those of the first; times are forward+backward medians of the slowest rank with
megamoe.bench's Timer (L2 flush, barrier), interleaved over rounds. Under scripts/gpu_all.sh this is the
``ab`` stage (log ``ab2.log``). With one GPU (W = 1) it times the fused
single-GPU layer once (it always keeps its pre-activations), as a reference point.

Usage (EP = 2):  torchrun --nproc-per-node 2 scripts/ab_backward.py OUT_DIR deepseek-v3:4096 mok-bench:2048
Needs CUDA GPUs; installs nothing. Writes OUT_DIR/ab_backward_w{W}.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from megamoe.bench.timing import Timer
from megamoe.config import get_preset


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    out_dir, cases = sys.argv[1], sys.argv[2:]
    W = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
    group = None
    if W > 1:
        dist.init_process_group("nccl", device_id=dev)
        group = dist.group.WORLD
    timer = Timer(dev, group=group, world_size=W)
    rows = []
    for case in cases:
        name, T = case.split(":")
        T = int(T)
        cfg = get_preset(name)
        D, F, E, K, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k, cfg.shared_intermediate_size
        L = E // W
        g = torch.Generator(device=dev).manual_seed(100 + rank)
        x = torch.randn(T, D, generator=g, device=dev).bfloat16().requires_grad_()
        ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
        w = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1).requires_grad_()
        gw = torch.Generator(device=dev).manual_seed(7 + rank)
        w13 = (torch.randn(L, 2 * F, D, generator=gw, device=dev) / D ** 0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(L, D, F, generator=gw, device=dev) / F ** 0.5).bfloat16().requires_grad_()
        s13 = (torch.randn(2 * S, D, generator=gw, device=dev) / D ** 0.5).bfloat16().requires_grad_() if S else None
        s2 = (torch.randn(D, S, generator=gw, device=dev) / S ** 0.5).bfloat16().requires_grad_() if S else None
        params = [p for p in (x, w, w13, w2, s13, s2) if p is not None]
        dout = torch.randn(T, D, generator=g, device=dev).bfloat16()
        variants = [True, False] if W > 1 else [None]

        def run(variant):
            if W > 1:
                from megamoe.functional_ep import moe_experts_ep
                out = moe_experts_ep(x, ids, w, w13, w2, s13, s2, group=group, save_preact=variant)
            else:
                from megamoe.functional import moe_experts
                out = moe_experts(x, ids, w, w13, w2, s13, s2, backend="fused")
            return [out.detach()] + list(torch.autograd.grad(out, params, dout))

        base = [t.clone() for t in run(variants[0])]
        same = {}
        for v in variants[1:]:
            got = run(v)
            same[v] = all(torch.equal(a, b) for a, b in zip(base, got))
        samples = {v: [] for v in variants}
        for _ in range(4):  # interleaved rounds
            for v in variants:
                samples[v] += timer.time(lambda _s, v=v: run(v), iters=3)
        for v in variants:
            ms = statistics.median(samples[v])
            r = dict(case=f"{name} T={T} W={W}", save_preact=v, ms=ms, bitwise_equal_to_first=same.get(v, True))
            rows.append(r)
            if rank == 0:
                print(f"{r['case']:28s} save_preact={v!s:5s} fwd+bwd {ms:7.2f} ms  "
                      f"bitwise {'==' if r['bitwise_equal_to_first'] else 'DIFFERENT'}", flush=True)
        del x, w, w13, w2, s13, s2, params
        torch.cuda.empty_cache()
    if rank == 0:
        json.dump(rows, open(f"{out_dir}/ab_backward_w{W}.json", "w"), indent=1)
    if W > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
