"""Per-GEMM tile-config sweep of the fused MoE kernels on one GPU (the measurements behind ops/tile_config.py).

For each preset / token count and each GEMM of the layer (gate/up + SwiGLU, down, dgrad + SwiGLU backward,
dgrad dx, weight gradients dW13 and dW2) this times the checked-in config and the candidates below, and
checks that every candidate gives bitwise the same result as the checked-in one (a config may change speed,
never bits: batch invariance and EP=1 == EP=W rely on it). Uniform random top-k routing, and for
deepseek-v3 also "balanced" routing (every expert exactly T*K/E rows) to separate the cost of partial
m-tiles from the rest. The table goes to stdout; OUT_DIR/gemm_sweep.json holds every row (rewritten after
each case).

Usage: python scripts/gemm_sweep.py OUT_DIR [preset[+balanced][+nolayer]:T ...] [--only=GEMM ...]
(needs a CUDA GPU; installs nothing; GEMM names: gate_up down dgrad_swiglu dgrad wgrad13 wgrad2)
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from megamoe.config import GemmConfig, KernelConfig, get_preset
from megamoe.ops import build_routing_plan, down_proj, gate_up_swiglu, grouped_mm_nn, k_grouped_mm, swiglu_dgrad

dev = torch.device("cuda")


def timeit(fn, iters=8, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def routing(T, E, K, balanced, g):
    if not balanced:
        return torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    # every expert gets exactly T*K/E rows: token t's slots are K distinct experts
    base = torch.arange(T, device=dev)[:, None] * K + torch.arange(K, device=dev)[None, :]
    return (base % E).int()


def _plain_candidates():
    """down / dgrad: the table's 128x256 entry (twice, to see the drift within one sweep), more stages, and
    128x128 tiles."""
    G = GemmConfig
    return [G(128, 256, 64, 8, 3, tma_b=True, tma_a=True), G(128, 256, 64, 8, 4, tma_b=True, tma_a=True),
            G(128, 128, 64, 8, 4, tma_b=True, tma_a=True), G(128, 256, 64, 8, 3, tma_b=True, tma_a=True)]


def candidates(kind):
    G = GemmConfig
    c = {
        "gate_up": [G(128, 128, 64, 8, 3), G(128, 128, 64, 8, 4, tma_b=True)],
        "down": _plain_candidates(),
        # 256-column tiles (two 128-column row-dot partials per tile: the same bits)
        "dgrad_swiglu": [G(128, 256, 64, 8, 3, tma_b=True), G(128, 256, 64, 8, 4, tma_b=True),
                         G(128, 256, 64, 8, 3), G(128, 128, 64, 8, 4, tma_b=True)],
        "dgrad": _plain_candidates(),
        # per-tile kernel (stages, wider tiles), then the resident kernel with 1-4 chunks of P rows on chip
        "wgrad": [G(128, 128, 64, 8, 2), G(128, 128, 64, 8, 4), G(128, 256, 64, 8, 2), G(256, 128, 64, 8, 2),
                  G(128, 128, 64, 8, 3, resident_chunks=3), G(128, 128, 64, 8, 4, resident_chunks=2),
                  G(128, 128, 64, 8, 4, resident_chunks=1), G(128, 64, 64, 8, 4, resident_chunks=4),
                  # the persistent Gluon kernel (P streamed, or on chip for experts of <= 3-5 chunks)
                  G(128, 256, 64, 8, 3, gluon=True), G(128, 128, 64, 8, 4, resident_chunks=3, gluon=True),
                  G(128, 128, 64, 8, 4, resident_chunks=5, gluon=True),
                  G(128, 128, 64, 8, 5, resident_chunks=5, gluon=True),
                  G(128, 256, 64, 8, 3, resident_chunks=4, gluon=True)],
    }
    return c[kind]


def sweep(name, T, balanced, log, only=None):
    cfg = get_preset(name)
    D, F, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, generator=g, device=dev).bfloat16()
    ids = routing(T, E, K, balanced, g)
    w = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1)
    w13 = (torch.randn(E, 2 * F, D, generator=g, device=dev) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g, device=dev) / F ** 0.5).bfloat16()
    N = T * K
    plan = build_routing_plan(ids, E)
    off, tok = plan.offsets_E1, plan.row_token_N
    h, gu = gate_up_swiglu(x, w13, off, gather_idx_R=tok)
    dy = torch.randn_like(x)
    scale = w.reshape(-1).index_select(0, plan.row_src_N).float()
    dgu, hw, _ = swiglu_dgrad(dy, w2, off, gu, gather_idx_R=tok, row_scale_R=scale)
    # each GEMM as fn(kernel_config): the config under test comes as a KernelConfig entry for its (kind, a, b)
    gemms = {
        "gate_up": (lambda kc: gate_up_swiglu(x, w13, off, gather_idx_R=tok, kernel_config=kc), ("gate_up", F, D),
                    4 * N * D * F, 2 * E * F * D * 2),
        "down": (lambda kc: (down_proj(h, w2, off, kernel_config=kc),), ("down", D, F), 2 * N * D * F, E * D * F * 2),
        "dgrad_swiglu": (lambda kc: swiglu_dgrad(dy, w2, off, gu, gather_idx_R=tok, row_scale_R=scale,
                                                 kernel_config=kc), ("dgrad_swiglu", F, D), 2 * N * D * F,
                         E * D * F * 2),
        "dgrad": (lambda kc: (grouped_mm_nn(dgu, w13, off, kernel_config=kc),), ("dgrad", D, 2 * F), 4 * N * D * F,
                  2 * E * F * D * 2),
        "wgrad13": (lambda kc: (k_grouped_mm(dgu, x, off, q_idx_R=tok, kernel_config=kc),), ("wgrad", 2 * F, D),
                    4 * N * D * F, 2 * E * F * D * 2),
        "wgrad2": (lambda kc: (k_grouped_mm(dy, hw, off, p_idx_R=tok, kernel_config=kc),), ("wgrad", D, F),
                   2 * N * D * F, E * D * F * 2),
    }
    rows = []
    tag = f"{name} T={T}{' balanced' if balanced else ''}"
    for label, (fn, key, flop, wbytes) in gemms.items():
        if only and not any(label.startswith(o) for o in only):
            continue
        ref = None
        for cand in [None] + candidates(key[0]):
            kc = KernelConfig({key: cand} if cand is not None else {})
            shown = str(cand) if cand is not None else "table default"
            try:
                out = [t.clone() for t in fn(kc) if t is not None]
                if ref is None:
                    ref, same = out, True
                else:
                    same = all(torch.equal(a, b) for a, b in zip(ref, out))
                ms = timeit(lambda fn=fn, kc=kc: fn(kc))
                r = dict(case=tag, gemm=label, config=shown, ms=ms, tflops=flop / ms / 1e9,
                         weight_gbs=wbytes / ms / 1e6, bitwise_equal=same)
                rows.append(r)
                log(f"  {tag:28s} {label:13s} {shown:88s} {ms:7.3f} ms {flop / ms / 1e9:5.0f} TF/s "
                    f"{wbytes / ms / 1e6:5.0f} GB/s weights  bitwise {'==' if same else 'DIFFERENT'}")
            except Exception as exc:  # noqa: BLE001 - record and go on
                log(f"  {tag:28s} {label:13s} {shown} FAILED {type(exc).__name__}: {str(exc)[:300]}")
    return rows


def layer(name, T, rows, log):
    """Layer forward+backward with the table defaults, then with the fastest bitwise-equal candidate per GEMM."""
    from megamoe.functional import moe_experts

    cfg = get_preset(name)
    D, F, E, K, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k, cfg.shared_intermediate_size
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(T, D, generator=g, device=dev).bfloat16().requires_grad_()
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1).requires_grad_()
    w13 = (torch.randn(E, 2 * F, D, generator=g, device=dev) / D ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, D, F, generator=g, device=dev) / F ** 0.5).bfloat16().requires_grad_()
    s13 = (torch.randn(2 * S, D, generator=g, device=dev) / D ** 0.5).bfloat16().requires_grad_() if S else None
    s2 = (torch.randn(D, S, generator=g, device=dev) / S ** 0.5).bfloat16().requires_grad_() if S else None
    params = [p for p in (x, w, w13, w2, s13, s2) if p is not None]
    dout = torch.randn_like(x)
    def fb(kc=None):
        return [t.clone() for t in torch.autograd.grad(
            moe_experts(x, ids, w, w13, w2, s13, s2, backend="fused", kernel_config=kc), params, dout)]
    keys = {"gate_up": ("gate_up", F, D), "down": ("down", D, F), "dgrad_swiglu": ("dgrad_swiglu", F, D),
            "dgrad": ("dgrad", D, 2 * F), "wgrad13": ("wgrad", 2 * F, D), "wgrad2": ("wgrad", D, F)}
    base_out = fb()
    t0 = timeit(fb, iters=6)
    best = {}
    for label in keys:
        ok = [r for r in rows if r["case"] == f"{name} T={T}" and r.get("gemm") == label and r["bitwise_equal"]]
        if ok:
            best[label] = min(ok, key=lambda r: r["ms"])["config"]
    kc = KernelConfig({keys[label]: eval(shown, {"GemmConfig": GemmConfig})
                       for label, shown in best.items() if shown != "table default"})
    out = fb(kc)
    same = all(torch.equal(a, b) for a, b in zip(base_out, out))
    t1 = timeit(lambda: fb(kc), iters=6)
    log(f"LAYER {name} T={T} fwd+bwd: table {t0:.2f} ms, best-per-GEMM {t1:.2f} ms ({t0 / t1:.2f}x), "
        f"gradients bitwise {'==' if same else 'DIFFERENT'}; best: {best}")
    return dict(case=f"{name} T={T}", table_ms=t0, best_ms=t1, bitwise_equal=same, best=best)


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    out_dir = sys.argv[1]
    only = [a[len("--only="):] for a in sys.argv[2:] if a.startswith("--only=")]
    cases = [a for a in sys.argv[2:] if not a.startswith("--only=")] or ["deepseek-v3:4096", "qwen3-30b-a3b:16384"]
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows = []
    for case in cases:
        name, T = case.split(":")
        balanced, nolayer = "+balanced" in name, "+nolayer" in name
        name = name.replace("+balanced", "").replace("+nolayer", "")
        rows += sweep(name, int(T), balanced, log, only)
        torch.cuda.empty_cache()
        if not (balanced or nolayer):
            rows.append(layer(name, int(T), rows, log))
            torch.cuda.empty_cache()
        with open(f"{out_dir}/gemm_sweep.json", "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
