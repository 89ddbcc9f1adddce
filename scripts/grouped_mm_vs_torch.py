"""The layer's plain grouped GEMMs against ``torch._grouped_mm`` (PyTorch's CUTLASS grouped GEMM) on one GPU.

Usage: python scripts/grouped_mm_vs_torch.py OUT_DIR [PRESET:T ...]   (default qwen3-30b-a3b:16384 deepseek-v3:4096)

For each case (uniform top-k routing, bf16, rows grouped by expert): the down projection (R x F @ W2[e]^T),
the dgrad dx GEMM (R x 2F @ W13[e]) and the down projection's weight gradient (dW2[e] = dY_e^T @ H_e) with
megamoe's kernels (the tile table's choice) and with ``torch._grouped_mm`` on the same operands; ms as the
median of 10 CUDA-event timings taken alternately, each after an L2 flush (the session-7 numbers in
docs/perf.md were taken without the flush); whether the outputs are bitwise equal; and, for torch,
whether a row's result depends on the rest of the batch (the same experts' rows computed with every group
cut to its first half: batch invariance, which the layer promises for the same bits at every EP size).
Nothing here changes the layer; it answers whether PyTorch's kernel could serve these GEMMs. Caution
(docs/perf.md, seventh session): the standalone times, on normally distributed operands, did not carry over
to the layer: at qwen3 T=16384 this script had torch's kernels 0.6 ms ahead, inside the layer they were level.

Writes OUT_DIR/grouped_mm_vs_torch.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megamoe.bench.timing import Timer, summarize
from megamoe.config import get_preset
from megamoe.ops import grouped_mm_nn, grouped_mm_nt, k_grouped_mm

dev = torch.device("cuda")


def _time_pair(fa, fb, reps=10):
    """Medians (ms) of fa and fb timed alternately, one call at a time (megamoe.bench.timing.Timer, L2 flushed)."""
    timer = Timer(dev)
    ta, tb = [], []
    for _ in range(reps):
        ta += timer.time(lambda _: fa(), 1)
        tb += timer.time(lambda _: fb(), 1)
    return summarize(ta).median, summarize(tb).median


def case(name: str, T: int) -> list[dict]:
    cfg = get_preset(name)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    off = torch.cat([ends.new_zeros(1), ends])
    R = T * K
    bf = torch.bfloat16
    # drawn in bf16 directly: no fp32 temporaries (mok-bench's W13 alone is 63 GiB in fp32)
    h = torch.randn(R, F, generator=g, device=dev, dtype=bf)
    dgu = torch.randn(R, 2 * F, generator=g, device=dev, dtype=bf)
    dy = torch.randn(R, D, generator=g, device=dev, dtype=bf)
    w2 = torch.randn(E, D, F, generator=g, device=dev, dtype=bf).mul_(F ** -0.5)
    w13 = torch.randn(E, 2 * F, D, generator=g, device=dev, dtype=bf).mul_(D ** -0.5)
    # half of every group: a row's output must not change when the rest of its group is gone
    keep = torch.cat([torch.arange(int(off[e]), int(off[e]) + int(counts[e]) // 2, device=dev) for e in range(E)])
    half_ends = torch.cumsum(counts // 2, 0).to(torch.int32)
    gemms = {
        "down": (lambda: grouped_mm_nt(h, w2, off), lambda: torch._grouped_mm(h, w2.transpose(-2, -1), offs=ends),
                 lambda: torch._grouped_mm(h[keep], w2.transpose(-2, -1), offs=half_ends), 2 * R * F * D),
        "dgrad": (lambda: grouped_mm_nn(dgu, w13, off), lambda: torch._grouped_mm(dgu, w13, offs=ends),
                  lambda: torch._grouped_mm(dgu[keep], w13, offs=half_ends), 2 * R * 2 * F * D),
        "wgrad2": (lambda: k_grouped_mm(dy, h, off), lambda: torch._grouped_mm(dy.t(), h, offs=ends),
                   None, 2 * R * F * D),
    }
    rows = []
    for label, (ours, theirs, theirs_half, flop) in gemms.items():
        a, b = ours(), theirs()
        same = torch.equal(a, b)
        max_rel = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30)).max().item()
        invariant = None
        if theirs_half is not None:
            invariant = torch.equal(theirs_half(), b[keep])
        t_ours, t_torch = _time_pair(ours, theirs)
        r = dict(case=f"{name} T={T}", gemm=label, megamoe_ms=t_ours, torch_ms=t_torch,
                 megamoe_tflops=flop / t_ours / 1e9, torch_tflops=flop / t_torch / 1e9, bitwise_equal=same,
                 max_rel_diff=max_rel, torch_batch_invariant=invariant)
        print(f"{r['case']:24s} {label:7s} megamoe {t_ours:6.3f} ms ({r['megamoe_tflops']:4.0f} TF/s)  "
              f"torch._grouped_mm {t_torch:6.3f} ms ({r['torch_tflops']:4.0f} TF/s)  bitwise {'==' if same else '!='} "
              f"(max rel diff {max_rel:.2e})  torch rows batch-invariant: {invariant}", flush=True)
        rows.append(r)
    return rows


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    cases = sys.argv[2:] or ["qwen3-30b-a3b:16384", "deepseek-v3:4096"]
    rows = []
    for c in cases:
        name, T = c.split(":")
        rows += case(name, int(T))
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "grouped_mm_vs_torch.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
