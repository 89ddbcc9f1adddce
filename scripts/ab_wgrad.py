"""Weight-gradient kernels on contiguous expert rows, side by side on one GPU, every one bitwise checked.

The rows are contiguous, as in the EP receive buffers (and the rows the single-GPU path copies into expert
order for torch's kernel), so every kernel can take them: the Triton per-tile kernel (the reference of the bit
check), the table's default for the shape, ``torch._grouped_mm`` (CUTLASS), the persistent Gluon kernel with P
on chip, and the warp-specialized Gluon kernel (megamoe/kernels/wgrad_ws_gluon.py) at several ring sizes, P
streamed or kept on chip.

Cases (uniform random top-k routing; local experts L, ~rows per expert):
  ep2-deepseek   an EP = 2 rank of deepseek-v3 at 4096 tokens per rank: L = 128 of 256, ~256 rows
  w1-deepseek    deepseek-v3 at T = 4096 on one GPU: L = 256, ~128 rows
  ep2-mok        an EP = 2 rank of mok-bench at 2048 tokens per rank: L = 192 of 384, ~64 rows
  w1-qwen3       qwen3-30b-a3b at T = 16384: L = 128, ~1024 rows
For each case and GEMM (dW13 = dGU^T X: (L, 2F, D); dW2 = dY^T H: (L, D, F)): ms (median of the reps, CUDA
events, interleaved rounds), TFLOP/s and % of the dense bf16 rate measured in the same run, the gradient bytes
written per ms and % of the device copy rate; ``bitwise`` compares against the Triton per-tile kernel.

Usage: python scripts/ab_wgrad.py OUT_DIR [case ...] [--rounds=N] [--ws=STAGES:RES,...]
(--ws: the warp-specialized kernel's ring slots and resident P chunks, default 4:0,5:0,4:5,5:5,6:5,6:6)
(needs a Hopper GPU; installs nothing; writes OUT_DIR/ab_wgrad.json)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from megamoe.bench.ceilings import measure_ceilings
from megamoe.bench.timing import Timer
from megamoe.config import get_preset
from megamoe.ops import GemmConfig, k_grouped_mm, tile_config
from megamoe.ops.torch_grouped_mm import torch_wgrad

dev = torch.device("cuda")
CASES = {  # name: (preset, tokens, EP size)
    "ep2-deepseek": ("deepseek-v3", 4096, 2), "w1-deepseek": ("deepseek-v3", 4096, 1),
    "ep2-mok": ("mok-bench", 2048, 2), "w1-qwen3": ("qwen3-30b-a3b", 16384, 1),
}


def problem(preset: str, T: int, W: int, g: torch.Generator):
    """Counts of one rank's L = E / W local experts from the routing of W * T tokens (uniform top-k), and
    contiguous bf16 rows: dGU (R, 2F), X (R, D), dY (R, D), H (R, F)."""
    cfg = get_preset(preset)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    ids = torch.rand(W * T, E, generator=g, device=dev).topk(K, dim=1).indices
    L = E // W
    counts = torch.bincount(ids.flatten(), minlength=E)[:L]
    offsets = torch.zeros(L + 1, dtype=torch.int32, device=dev)
    offsets[1:] = counts.cumsum(0)
    R = int(counts.sum())
    rnd = lambda n: torch.randn(R, n, generator=g, device=dev).bfloat16()  # noqa: E731
    return dict(D=D, F=F, L=L, R=R, offsets=offsets, dgu=rnd(2 * F), x=rnd(D), dy=rnd(D), h=rnd(F))


def providers(stages):
    """label -> GemmConfig (forced through the table's override), None (the table's default) or "torch"."""
    out = {"triton per-tile": GemmConfig(128, 128, 64, 8, 2), "table": None, "torch._grouped_mm": "torch",
           "gluon persistent (P on chip)": GemmConfig(128, 128, 64, 8, 5, resident_chunks=5, gluon=True)}
    for s, r in stages:
        out[f"gluon ws {s} stages, {r} res"] = GemmConfig(128, 128, 64, 8, s, resident_chunks=r, gluon=True,
                                                          warp_specialized=True)
    return out


def run(prov, p, q, off, out):
    M, N = p.shape[1], q.shape[1]
    if prov == "torch":
        return torch_wgrad(p, q, off)
    key = ("wgrad", M, N)
    saved = tile_config._OVERRIDES.pop(key, None)
    if prov is not None:
        tile_config._OVERRIDES[key] = prov
    try:
        return k_grouped_mm(p, q, off, out=out)
    finally:
        tile_config._OVERRIDES.pop(key, None)
        if saved is not None:
            tile_config._OVERRIDES[key] = saved


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
    rounds = int(opts.get("rounds", 3))
    stages = [tuple(int(v) for v in sr.split(":")) for sr in opts.get("ws", "4:0,5:0,4:5,5:5,6:5,6:6").split(",")]
    out_dir, cases = args[0], args[1:] or list(CASES)
    timer = Timer(dev, flush_mib=0)
    ceil = measure_ceilings(timer, torch.bfloat16)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: dense bf16 {ceil['matmul_tflops']:.0f} "
          f"TFLOP/s, device copy {ceil['copy_gbs']:.0f} GB/s", flush=True)
    rows = []
    for case in cases:
        preset, T, W = CASES[case]
        g = torch.Generator(device=dev).manual_seed(0)
        pb = problem(preset, T, W, g)
        L, R = pb["L"], pb["R"]
        print(f"\n{case}: {preset} T={T} per rank, EP={W}: L={L} local experts, R={R} rows (~{R / L:.0f} per "
              f"expert)", flush=True)
        for gemm, p, q in (("dW13", pb["dgu"], pb["x"]), ("dW2", pb["dy"], pb["h"])):
            M, N = p.shape[1], q.shape[1]
            flop, nbytes = 2 * R * M * N, L * M * N * 2
            out = torch.empty(L, M, N, device=dev, dtype=torch.bfloat16)
            provs = providers(stages)
            ref = run(provs["triton per-tile"], p, q, pb["offsets"], None).clone()
            same, times = {}, {k: [] for k in provs}
            for label, prov in provs.items():
                out.fill_(float("nan"))
                got = run(prov, p, q, pb["offsets"], out)
                same[label] = bool(torch.equal(got, ref))
            for _ in range(rounds):  # interleaved rounds: drift shows as spread, not as a difference
                for label, prov in provs.items():
                    times[label] += timer.time(lambda _: run(prov, p, q, pb["offsets"], out), 5)
            for label in provs:
                ms = statistics.median(times[label])
                tf, gbs = flop / ms / 1e9, nbytes / ms / 1e6
                r = dict(case=case, gemm=gemm, provider=label, ms=ms, p20=sorted(times[label])[len(times[label]) // 5],
                         tflops=tf, pct_dense=100 * tf / ceil["matmul_tflops"], grad_gbs=gbs,
                         pct_copy=100 * gbs / ceil["copy_gbs"], bitwise=same[label], L=L, R=R, M=M, N=N)
                rows.append(r)
                print(f"  {gemm:5s} {label:34s} {ms:7.3f} ms  {tf:5.0f} TFLOP/s ({r['pct_dense']:4.1f}% dense)  "
                      f"{gbs:5.0f} GB/s written ({r['pct_copy']:4.1f}% copy)  "
                      f"bitwise {'==' if same[label] else 'DIFFERENT'}",
                      flush=True)
            out = ref = None  # free the (L, M, N) buffers before the next GEMM
            torch.cuda.empty_cache()
        json.dump(dict(ceilings=ceil, rows=rows), open(f"{out_dir}/ab_wgrad.json", "w"), indent=1)


if __name__ == "__main__":
    main()
