"""A/B of what the EP path keeps from forward to backward, bitwise-checked.

Variants: (``save_preact``, ``save_dispatched``) of megamoe.functional_ep.moe_experts_ep: keep round 0's
gate/up pre-activations (or recompute them in the backward) and round 0's received x rows (or pull them
again): (True, True) the default, (True, False), (False, False) keep nothing routed; with ``AB_TILES`` set,
also the default under ``MEGAMOE_TILES=$AB_TILES`` (a tile A/B on the EP path; the other variants keep the
caller's ``MEGAMOE_TILES``); with ``AB_PULL`` set (space-separated integers), also the default under
``MEGAMOE_EP_PULL_OVERLAP=n`` for each n (round 0's pull beside its first GEMM; the other variants keep the
caller's value); ``AB_SAVES=0`` leaves out the two save variants; ``AB_ROUNDS`` interleaved rounds (default 4,
3 timed steps each). Each variant's output and gradients must be bitwise those of the first; times are
forward+backward medians of the slowest rank with megamoe.bench's Timer (L2 flush, barrier), interleaved over
rounds; per variant also the GPU time per step of the dispatch kernel and of the m-grouped GEMMs
(torch.profiler, two steps) and the step's peak memory. Under scripts/gpu_all.sh this is the ``ab`` stage (log
``ab{W}.log``). With one GPU (W = 1) the EP path runs on a one-rank group (the benchmark's ``megamoe-ep``):
its pulls are local copies there, so what a variant saves over NVLink at W > 1 shows only as the dispatch
kernel's share.

Usage:  torchrun --nproc-per-node 2 scripts/ab_backward.py OUT_DIR deepseek-v3:4096 mok-bench:2048
        python scripts/ab_backward.py OUT_DIR deepseek-v3:8192          (W = 1)
Needs CUDA GPUs; installs nothing. Writes OUT_DIR/ab_backward_w{W}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megamoe.bench.timing import Timer, summarize
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
    if W > 1:
        dist.init_process_group("nccl", device_id=dev)
        group = dist.group.WORLD
    else:
        from megamoe.bench.providers_ep import one_rank_group
        group = one_rank_group(dev)
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
        bf = dict(generator=gw, device=dev, dtype=torch.bfloat16)  # drawn in bf16: mok-bench's fp32 weights fill the GPU
        w13 = torch.randn(L, 2 * F, D, **bf).mul_(D ** -0.5).requires_grad_()
        w2 = torch.randn(L, D, F, **bf).mul_(F ** -0.5).requires_grad_()
        s13 = torch.randn(2 * S, D, **bf).mul_(D ** -0.5).requires_grad_() if S else None
        s2 = torch.randn(D, S, **bf).mul_(S ** -0.5).requires_grad_() if S else None
        params = [p for p in (x, w, w13, w2, s13, s2) if p is not None]
        dout = torch.randn(T, D, generator=g, device=dev).bfloat16()
        tiles = os.environ.get("MEGAMOE_TILES", "")  # the caller's, for every variant but AB_TILES's
        pull = os.environ.get("MEGAMOE_EP_PULL_OVERLAP", "")  # the caller's, for every variant but AB_PULL's
        variants = [(True, True, tiles, pull)]
        if os.environ.get("AB_SAVES", "1") != "0":
            variants += [(True, False, tiles, pull), (False, False, tiles, pull)]
        if os.environ.get("AB_TILES"):
            variants.append((True, True, os.environ["AB_TILES"], pull))
        variants += [(True, True, tiles, n) for n in os.environ.get("AB_PULL", "").split()]

        def run(variant, held=None):
            from megamoe.functional_ep import moe_experts_ep
            os.environ["MEGAMOE_TILES"] = variant[2]  # read at every launch (ops.tile_config.override_for)
            os.environ["MEGAMOE_EP_PULL_OVERLAP"] = variant[3]  # read at every call (ops.ep_comm)
            out = moe_experts_ep(x, ids, w, w13, w2, s13, s2, group=group, save_preact=variant[0],
                                 save_dispatched=variant[1])
            if held is not None:  # bytes allocated between the passes (the output and what autograd keeps)
                held.append(torch.cuda.memory_allocated(dev))
            res = [out.detach()] + list(torch.autograd.grad(out, params, dout))
            os.environ["MEGAMOE_TILES"] = tiles
            os.environ["MEGAMOE_EP_PULL_OVERLAP"] = pull
            return res

        base = [t.cpu() for t in run(variants[0])]  # on the host: mok-bench's weight gradients are 50 GB
        same = {}
        for v in variants[1:]:
            got = run(v)
            same[v] = all(torch.equal(a, b.cpu()) for a, b in zip(base, got))
            del got
        samples = {v: [] for v in variants}
        for _ in range(int(os.environ.get("AB_ROUNDS", "4"))):  # interleaved rounds
            for v in variants:
                samples[v] += timer.time(lambda _s, v=v: run(v), iters=3)
        for v in variants:
            st = summarize(samples[v])
            ms = st.median
            kernel_ms, peak_gib, held_gib = _kernel_ms_and_memory(lambda held=None, v=v: run(v, held), dev)
            dispatch_ms, gemm_ms = kernel_ms["ep_dispatch"], kernel_ms["_m_grouped_gemm"]
            r = dict(case=f"{name} T={T} W={W}", save_preact=v[0], save_dispatched=v[1], tiles=v[2], pull_overlap=v[3],
                     ms=ms,
                     p20=st.p20, p80=st.p80, dispatch_ms_per_step=dispatch_ms,
                     m_grouped_ms_per_step=gemm_ms,
                     peak_gib=peak_gib, held_gib=held_gib, bitwise_equal_to_first=same.get(v, True))
            rows.append(r)
            if rank == 0:
                print(f"{r['case']:28s} save_preact={v[0]!s:5s} save_dispatched={v[1]!s:5s}"
                      f"{' tiles=' + v[2] if v[2] != tiles else ''}"
                      f"{' pull_overlap=' + v[3] if v[3] != pull else ''} fwd+bwd {ms:7.2f} ms "
                      f"(p20-p80 {r['p20']:.2f}-{r['p80']:.2f})  dispatch kernel {dispatch_ms:5.2f} ms/step  "
                      f"m-grouped GEMMs {gemm_ms:6.2f} ms/step  "
                      f"peak {peak_gib:5.2f} GiB, held fwd->bwd {held_gib:5.2f} GiB  "
                      f"bitwise {'==' if r['bitwise_equal_to_first'] else 'DIFFERENT'}", flush=True)
        del x, w, w13, w2, s13, s2, params, base, run
        torch.cuda.empty_cache()
    if rank == 0:
        json.dump(rows, open(f"{out_dir}/ab_backward_w{W}.json", "w"), indent=1)
    if W > 1:
        dist.destroy_process_group()
    else:
        from megamoe.bench.providers_ep import close_one_rank_group
        close_one_rank_group()


def _kernel_ms_and_memory(step, dev, steps=2):
    """GPU ms per step of the EP dispatch (pull) kernel and of the m-grouped GEMMs over ``steps`` profiled
    steps; one step's peak memory and the memory held from its forward to its backward, in GiB above what
    was allocated before the step."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    held = []
    step(held)
    torch.cuda.synchronize(dev)
    peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(dev)
    ms = {k: sum(e.device_time_total for e in prof.key_averages() if k in e.key) / 1e3 / steps
          for k in ("ep_dispatch", "_m_grouped_gemm")}
    return ms, peak, (held[0] - base) / 2**30


if __name__ == "__main__":
    main()
