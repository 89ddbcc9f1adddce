"""SHA-256 digests of the fused layer's outputs and every gradient on the benchmark cases (one GPU).

Usage: python scripts/bits_digest.py [--out FILE] [CASE ...]   (CASE = preset:tokens, default the README's cases)

For each case: the single-GPU path (``megamoe.functional.moe_experts``) and the EP path on a one-rank group
(``megamoe.functional_ep.moe_experts_ep``, W = 1), forward then backward with the benchmark's seeded problem
(megamoe.bench.problem: uniform routing, seed 0). One line per tensor: case, path, name, sha256 of the bytes.
Two checkouts give the same file exactly when every output and gradient is bitwise the same; run it at both
commits (e.g. ``PYTHONPATH=<other checkout>``) and ``diff`` the files.
"""

from __future__ import annotations

import argparse
import hashlib
import os

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


def digests(case: str, path: str, device: torch.device) -> list[str]:
    preset, tokens = case.split(":")
    cfg = get_preset(preset)
    prob = make_problem(case, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device=device)
    if path == "fused":
        out = moe_experts(*prob.args(), backend="fused")
    else:
        out = moe_experts_ep(*prob.args(), group=one_rank_group(device))
    grads = torch.autograd.grad(out, prob.grad_inputs(), prob.grad_out_TD)
    names = ["x", "topk_weights", "w13", "w2", "shared_w13", "shared_w2"]
    return [f"{case} {path} out {_sha(out)}"] + [f"{case} {path} d{n} {_sha(g)}" for n, g in zip(names, grads)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    p.add_argument("--out", help="write the digests here too")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
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
