"""``python -m megamoe.bench``: MoE layer benchmark, ours against the baselines people use today.

Single GPU:   python -m megamoe.bench --cases deepseek-v3:4096 --out bench_out/1gpu
EP over W:    torchrun --nproc-per-node 2 -m megamoe.bench --cases deepseek-v3:4096 --out bench_out/ep2
CPU smoke:    python -m megamoe.bench --device cpu --cases tiny:64 --iters 2 --round-iters 1 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import sys

# NVLink multicast must stay off on the target machines: set (unless given) in main(), before torch.distributed /
# NVSHMEM are touched
_COMM_ENV_DEFAULTS = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1"))


def build_parser() -> argparse.ArgumentParser:
    from megamoe.config import PRESETS

    p = argparse.ArgumentParser(
        prog="python -m megamoe.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Time the routed+shared MoE expert layer (router not timed) of megamoe against baseline\n"
            "providers on the same inputs, after checking each provider against megamoe.reference at the\n"
            "benchmarked shape. Forward, backward and forward+backward; median (p20-p80) of --iters\n"
            "iterations with CUDA events and an L2 flush, providers interleaved in rounds; under torchrun\n"
            "(EP = world size) a barrier precedes every timed iteration and the slowest rank is reported.\n"
            "Writes results.{csv,json,png,txt} to --out."),
        epilog=(
            "providers: megamoe (fused; W=1 and EP), torch (W=1: sort + torch._grouped_mm), reference (the\n"
            "spec; slow), nccl (EP: all_to_all_single recipe), symm-vdev (EP: NVSHMEM all_to_all_vdev_2d,\n"
            "local experts <= 16), deepep (EP: skipped unless importable), megamoe-ep (one GPU: the EP path\n"
            "on a one-rank group), megamoe-compiled (W=1: under torch.compile(fullgraph=True)); FP8 routed\n"
            "experts: megamoe-fp8 (fused; W=1 and EP), megamoe-fp8-uncached (the weights quantized at every\n"
            "call), megamoe-fp8-compiled (W=1: compiled), megamoe-ep-fp8 (the EP path on a one-rank group), torch-fp8\n"
            "(W=1: sort + torch._scaled_grouped_mm rowwise; sm90).\n"
            f"presets: {', '.join(PRESETS)}\n\n"
            "examples:\n"
            "  python -m megamoe.bench --cases qwen3-30b-a3b:16384 deepseek-v3:4096 mok-bench:2048 --out out/1gpu\n"
            "  torchrun --nproc-per-node 2 -m megamoe.bench --cases deepseek-v3:4096 --routing uniform zipf:1.2\n"
            "  python -m megamoe.bench --presets small --tokens 512 2048 "
            "--routing trace:runs/lm-small-ep1/routing_trace.pt"))
    a = p.add_argument
    a("--cases", nargs="+", metavar="PRESET:T", help="cases as preset:tokens-per-rank, e.g. deepseek-v3:4096")
    a("--presets", nargs="+", metavar="NAME", help="presets, crossed with --tokens (alternative to --cases)")
    a("--tokens", nargs="+", type=int, metavar="T", help="tokens per rank for --presets (default 4096)")
    a("--routing", nargs="+", metavar="MODEL", help="routing models: uniform (default), zipf[:s] (s default 1.2), "
      "trace:PATH (a saved routing trace, tiled/remapped to the case; see benchmarks/README.md)")
    a("--providers", nargs="+", metavar="NAME", help="providers to run (default: megamoe torch on one GPU; "
      "megamoe nccl symm-vdev deepep under EP; reference torch megamoe on CPU)")
    a("--baselines", nargs="+", metavar="NAME", help="speedup columns (default: torch, or nccl under EP)")
    a("--dtype", choices=["bf16", "fp16", "fp32"], help="activation/weight dtype (default: the preset's, bf16)")
    a("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default: cuda when available")
    a("--modes", nargs="+", choices=["fwd", "bwd", "fwdbwd"], default=["fwd", "bwd", "fwdbwd"])
    a("--iters", type=int, default=20, help="timed iterations per provider and mode (default 20)")
    a("--round-iters", type=int, default=5, help="iterations per interleaving round (default 5)")
    a("--warmup", type=int, default=3, help="untimed warm-up iterations per provider and mode (default 3)")
    a("--seed", type=int, default=0, help="seed of inputs, weights and routing (same for every provider)")
    a("--check-tokens", type=int, default=1024,
      help="tokens per rank checked against the reference before timing (default 1024; all if T is smaller)")
    a("--no-check", action="store_true", help="skip the correctness check (rows are then unchecked)")
    a("--time-failed", action="store_true", help="also time providers whose check failed (flagged 'fail')")
    a("--no-ceilings", action="store_true", help="skip the matmul / copy / peer-copy ceiling measurements")
    a("--flush-mib", type=int, default=256, help="L2 flush buffer zeroed before each timed iteration (MiB)")
    a("--dist-timeout", type=int, default=300, help="process-group timeout in seconds (EP)")
    a("--out", default="bench_out", help="output directory for results.{csv,json,png,txt} (default bench_out)")
    a("--commit", help="the commit to record where the tree has no .git (default: git rev-parse HEAD)")
    a("--tiles", metavar="TEXT", help="megamoe tile overrides for A/B runs, 'kind:BM,BN,BK,WARPS,STAGES[,field=value]' "
      "entries separated by ';' (megamoe.ops.tile_config.parse_tiles; BLOCK_K must stay the table's)")
    a("--ep-pull-programs", type=int, default=0, metavar="N", help="EP: round 0's pull as N programs beside "
      "the first expert GEMM (megamoe.config.EPOptions.pull_programs; default 0: off)")
    a("--ep-comm-sms", type=int, default=0, metavar="N", help="EP: the shared expert on a side stream leaving N "
      "SMs to the exchange (EPOptions.comm_sms; default 0: off)")
    a("--ep-push-kernel", action="store_true", help="EP: result rows by the separate push kernel "
      "(EPOptions.push_kernel; default: the GEMM epilogue)")
    a("--quiet", action="store_true", help="no progress bar")
    a("--list-providers", action="store_true", help="print the providers and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    for k, v in _COMM_ENV_DEFAULTS:
        os.environ.setdefault(k, v)
    args = build_parser().parse_args(argv)
    if args.list_providers:
        from megamoe.bench.providers import get_providers
        for prov in get_providers().values():
            print(f"{prov.name:<10} {prov.description}")
        return 0
    for name in ("iters", "round_iters", "check_tokens"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    from megamoe.bench.runner import run
    try:
        run(args)
    except (ValueError, KeyError) as exc:
        print(f"megamoe.bench: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
