"""The EP path's result-row store, four ways, on one GPU: the plain m-grouped GEMM (rows into a round buffer)
followed by nothing, the same GEMM storing through a RowPush (rows straight to their (token, slot) rows of a
destination buffer, as the EP path does into the owners' slots), with the destinations in token order
(identity: what locality costs nothing) and scattered (the EP schedule's order: rows of one expert go to
tokens all over the buffer); plus the plain GEMM followed by a row copy to the scattered destinations (what
the separate push kernel did). Every variant's destination rows are checked bitwise against the plain output.

Legend: R received rows (expert-major), T tokens, K top-k, D hidden, F FFN, E local experts.
Usage: python scripts/push_epilogue_bench.py [preset:M ...]   (M tokens on one rank; default: the session's
cases deepseek-v3:8192 mok-bench:4096 qwen3-30b-a3b:16384). Prints per GEMM (down projection, dx dgrad) the
median ms of interleaved rounds on a CUDA GPU. Without one, under TRITON_INTERPRET=1 on a small preset (e.g.
``tiny:24``), it only checks the bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from megamoe.config import get_preset
from megamoe.ops import RowPush, build_routing_plan, down_proj, grouped_mm_nn, row_push_deltas

ROUNDS, REPS = 5, 5


def _time(fn) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(REPS):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / REPS


def case(preset: str, M: int) -> None:
    cfg = get_preset(preset)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1, bits only
    g = torch.Generator(device=dev).manual_seed(0)
    scores = torch.rand(M, E, device=dev, generator=g)
    ids = scores.topk(K, dim=1).indices.to(torch.int32)
    plan = build_routing_plan(ids, E)
    R = M * K
    tok = plan.row_token_N.to(torch.int32)
    slot = plan.row_slot_N.to(torch.int32)
    src = torch.zeros(R, dtype=torch.int32, device=dev)
    scattered = torch.stack([src, tok, slot]).contiguous()
    r = torch.arange(R, dtype=torch.int32, device=dev)
    identity = torch.stack([src, r // K, r % K]).contiguous()
    h = torch.randn(R, F, device=dev, dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16, generator=g) * F ** -0.5
    dgu = torch.randn(R, 2 * F, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(E, 2 * F, D, device=dev, dtype=torch.bfloat16, generator=g) * (2 * F) ** -0.5
    dest = torch.empty(R, D, device=dev, dtype=torch.bfloat16)
    deltas = row_push_deltas(dest, [dest.data_ptr()])
    out = torch.empty(R, D, device=dev, dtype=torch.bfloat16)
    flat = (tok.long() * K + slot.long())
    for name, fn in (("down", lambda **kw: down_proj(h, w2, plan.offsets_E1, **kw)),
                     ("dgrad dx", lambda **kw: grouped_mm_nn(dgu, w13, plan.offsets_E1, **kw))):
        ref = fn()
        variants = {
            "plain (round buffer)": lambda: fn(out=out),
            "plain + row copy": lambda: (fn(out=out), dest.index_copy_(0, flat, out)),
            "push, token order": lambda: fn(push=RowPush(dest, deltas, identity, K)),
            "push, scattered": lambda: fn(push=RowPush(dest, deltas, scattered, K)),
        }
        # bits first
        fn(push=RowPush(dest, deltas, scattered, K))
        assert torch.equal(dest[flat], ref), f"{name}: scattered push differs"
        fn(push=RowPush(dest, deltas, identity, K))
        assert torch.equal(dest, ref), f"{name}: token-order push differs"
        if dev.type != "cuda":
            print(f"{preset} M={M} {name}: bits checked (no CUDA device: not timed)")
            continue
        times = {k: [] for k in variants}
        for v in variants.values():
            v()
        torch.cuda.synchronize()
        for _ in range(ROUNDS):
            for k, v in variants.items():
                times[k].append(_time(v))
        print(f"{preset} M={M} {name} (R={R}, {R / E:.0f} rows per expert): " + "; ".join(
            f"{k} {statistics.median(t):.3f} ms" for k, t in times.items()))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/push_epilogue_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", default=["deepseek-v3:8192", "mok-bench:4096", "qwen3-30b-a3b:16384"],
                    help="preset:M (M tokens on one rank)")
    args = ap.parse_args(argv)
    for c in args.cases:
        p, sep, m = c.partition(":")
        if not sep or not m.isdigit():
            ap.error(f"a case is preset:M with M a token count, got {c!r}")
        case(p, int(m))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
