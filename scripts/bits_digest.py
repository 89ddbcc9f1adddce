"""SHA-256 digests of the fused layer's outputs and every gradient on the benchmark cases (one GPU).

Usage: python scripts/bits_digest.py [--out FILE] [--world W] [CASE ...]
  (CASE = preset:tokens, default the README's cases)

For each case: the single-GPU path (``megamoe.functional.moe_experts``) and the EP path on a one-rank group
(``megamoe.functional_ep.moe_experts_ep``, W = 1), forward then backward with the benchmark's seeded problem
(megamoe.bench.problem: uniform routing, seed 0). One line per tensor: case, path, name, sha256 of the bytes.
Two checkouts give the same file exactly when every output and gradient is bitwise the same; run it at both
commits (e.g. ``PYTHONPATH=<other checkout>``) and ``diff`` the files.

``--world W`` (W > 1) runs the EP path at W ranks instead, all on the one visible GPU (spawned processes over
gloo with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, as the shared-GPU EP tests run): the global batch
of ``tokens`` is split over the ranks, and each rank's output and gradients are digested (path ``epW.rR``);
the ranks are started by ``megamoe.distributed.run_ranks`` (for a checkout without it, run that checkout's own
copy of this script).
"""

from __future__ import annotations

import argparse
import hashlib
import os
from datetime import timedelta

import torch

from megamoe.bench.problem import make_problem
from megamoe.bench.providers_ep import close_one_rank_group, one_rank_group
from megamoe.bench.routing_models import make_routing
from megamoe.config import get_preset
from megamoe.functional import moe_experts
from megamoe.functional_ep import moe_experts_ep

DEFAULT_CASES = ("qwen3-30b-a3b:16384", "deepseek-v3:4096", "deepseek-v3:8192", "mok-bench:2048")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:32]


def digests(case: str, path: str, device: torch.device, *, world: int = 1, rank: int = 0, group=None) -> list[str]:
    preset, tokens = case.split(":")
    cfg = get_preset(preset)
    T = int(tokens) // world
    prob = make_problem(case, cfg, T, make_routing("uniform", cfg, T, world, 0), world_size=world, rank=rank,
                        device=device)
    if path == "fused":
        out = moe_experts(*prob.args(), backend="fused")
    else:
        out = moe_experts_ep(*prob.args(), group=group if group is not None else one_rank_group(device))
    grads = torch.autograd.grad(out, prob.grad_inputs(), prob.grad_out_TD)
    names = ["x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2"]
    return [f"{case} {path} out {_sha(out)}"] + [f"{case} {path} d{n} {_sha(g)}" for n, g in zip(names, grads)]


def _rank(rank: int, world: int, port: int, cases: list[str]) -> list[str]:
    import torch.distributed as dist

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        lines = []
        for case in cases:
            lines += digests(case, f"ep{world}.r{rank}", device, world=world, rank=rank, group=dist.group.WORLD)
            torch.cuda.empty_cache()
        dist.barrier()
        return lines
    finally:
        dist.destroy_process_group()


def shared_gpu_digests(cases: list[str], world: int) -> list[str]:
    """Digests of the EP path at ``world`` ranks sharing the visible GPU (see the module doc)."""
    from megamoe.distributed import run_ranks  # here: the one-GPU digests also run on checkouts without it

    per_rank = run_ranks(_rank, world, cases, what=f"bits_digest --world {world}")
    return [ln for lines in per_rank for ln in lines]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    p.add_argument("--out", help="write the digests here too")
    p.add_argument("--world", type=int, default=1, help="W > 1: the EP path at W ranks sharing the GPU")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.world > 1:
        lines = shared_gpu_digests(list(args.cases), args.world)
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        lines = []
        for case in args.cases:
            for path in ("fused", "ep1"):
                lines += digests(case, path, device)
                torch.cuda.empty_cache()
        close_one_rank_group()
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
