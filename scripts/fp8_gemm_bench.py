"""Microbenchmark of the block-scaled FP8 grouped GEMMs of the routed experts (megamoe.ops.fp8_gemm) on one GPU.

For each case (preset:T, uniform-ish random top-k routing) and each GEMM of the layer (gate/up + SwiGLU, down,
dgrad + SwiGLU backward, dgrad dx, weight gradients dW13 and dW2) it first checks the FP8 result against
plain PyTorch on the dequantized operands (fp32: "rel err" = max |error| / max |reference|; bf16 outputs put it
near 2e-3, a wrong kernel far above 2e-2, flagged), then prints ms and TFLOP/s of megamoe's FP8 kernel beside
megamoe's bf16 kernel (megamoe.ops.grouped_gemm) and ``torch._scaled_grouped_mm`` with rowwise scales (on
rows sorted by expert, its own operand layouts; "n/a" where this torch rejects the call). The operands are
quantized once before the timings (torch code here, the formats of megamoe.ops.fp8_gemm), so only the GEMMs
are timed. ``--sweep`` also times every tile config of a small grid (BLOCK_M 64/128, BLOCK_N 128/256, 4/8
warps, 3/4 stages, two programs per SM) and checks that each gives the table config's bits.

Usage: python scripts/fp8_gemm_bench.py [preset:T ...] [--only=GEMM ...] [--sweep] [--out=DIR]
Default cases: qwen3-30b-a3b:16384 deepseek-v3:8192; a case may also be E<e>K<k>D<d>F<f>:T.
GEMM names: gate_up down dgrad_swiglu dgrad wgrad13 wgrad2 and
dgrad_swiglu_kmaj dgrad_kmaj (K-major weight copies) wgrad13_kpad wgrad2_kpad (block-padded K-major operands).
Needs a CUDA GPU with FP8 tensor cores; installs nothing. With --out the log goes to DIR/fp8_gemm_bench.log too.
One case per command keeps each run to a few minutes; a sweep of one case's GEMMs takes ~20 compiles per GEMM
(pick GEMMs with --only).

What to expect (design, not yet measured): every K-block of 128 is one fresh FP8 dot whose result Triton waits for
before the promotion FMAs, so within one CTA the tensor cores idle during the promotion; the table's 64 x 128
one-warpgroup tiles fit two CTAs per SM so that one's promotion runs beside the other's dot (the promotion is one FMA
per element with 128-column tiles; the next K-block's scales load during the current one). The dgrad GEMMs read
the forward's weight bytes N-major, which FP8 wgmma cannot take from shared memory (Triton loads them through
registers): the *_kmaj rows show what a K-major weight copy gains; likewise *_kpad for the weight gradients.
"""

from __future__ import annotations

import itertools
import os
import re
import statistics
import sys
import time

import torch

from megamoe import reference as ref
from megamoe.config import get_preset
from megamoe.ops import build_routing_plan, down_proj, gate_up_swiglu, grouped_mm_nn, k_grouped_mm, swiglu_dgrad
from megamoe.ops import fp8_gemm as F8
from megamoe.ops import fp8_quant as Q

# without a GPU (a dry run of this script: TRITON_INTERPRET=1, tiny cases such as E4K2D256F256:64) on CPU
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3 = torch.float8_e4m3fn


def timeit(fn, iters=10, warm=3):
    if dev.type == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
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


# ---- operands: megamoe.reference's quantizers (setup only, not timed) ----
def _chunked(fn, w, step=8):
    """fn over slices of w's experts (bounded fp32 temporaries), results concatenated."""
    parts = [fn(w[i:i + step]) for i in range(0, w.shape[0], step)]
    return tuple(torch.cat(t) for t in zip(*parts))


def quant_128x128(w):
    return _chunked(ref.quantize_128x128, w)


def rowwise(x):
    """torch._scaled_*mm rowwise operands: e4m3 of x / s with s = amax / 448 per row (last dim reduced)."""
    def one(x):
        s = (x.float().abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        return (x.float() / s).to(E4M3), s.squeeze(-1)
    return _chunked(one, x) if x.dim() == 3 else one(x)


# ---- the case ----
def shape_of(name):
    """(D, F, E, K) of a preset, or of a name E<e>K<k>D<d>F<f>."""
    m = re.fullmatch(r"E(\d+)K(\d+)D(\d+)F(\d+)", name)
    if m:
        E, K, D, F = map(int, m.groups())
        return D, F, E, K
    cfg = get_preset(name)
    return cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k


def setup(name, T):
    D, F, E, K = shape_of(name)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, generator=g, device=dev).bfloat16()
    ids = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1)
    w13 = (torch.randn(E, 2 * F, D, generator=g, device=dev) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, F, generator=g, device=dev) / F ** 0.5).bfloat16()
    dy = torch.randn(T, D, generator=g, device=dev).bfloat16()
    plan = build_routing_plan(ids, E)
    off, tok = plan.offsets_E1, plan.row_token_N
    scale = w.reshape(-1).index_select(0, plan.row_src_N).float()
    c = dict(D=D, F=F, E=E, R=T * K, x=x, w13=w13, w2=w2, dy=dy, off=off, tok=tok, scale=scale, cache={})
    c["xq"], c["xs"] = ref.quantize_1x128(x)
    c["dq"], c["ds"] = ref.quantize_1x128(dy)
    c["w13q"], c["w13s"] = quant_128x128(w13)
    c["w2q"], c["w2s"] = quant_128x128(w2)
    c["hq"], c["hs"], c["gu"] = F8.fp8_gate_up_swiglu(c["xq"], c["xs"], c["w13q"], c["w13s"], off, gather_idx_R=tok)
    c["dgu"], c["hw"], _, c["dgq"], c["dgs"] = F8.fp8_swiglu_dgrad(c["dq"], c["ds"], c["w2q"], c["w2s"], off, c["gu"],
                                                                   gather_idx_R=tok, row_scale_R=scale)
    c["p13"], c["p13s"] = ref.quantize_128x1_grouped(c["dgu"], off)
    c["q13"], c["q13s"] = ref.quantize_128x1_grouped(x, off, tok)
    c["p2"], c["p2s"] = ref.quantize_128x1_grouped(dy, off, tok)
    c["q2"], c["q2s"] = ref.quantize_128x1_grouped(c["hw"], off)
    # bf16 operands of megamoe's bf16 kernels
    c["h_bf16"], c["gu_bf16"] = gate_up_swiglu(x, w13, off, gather_idx_R=tok)
    return c


def _kmajor(t):
    """The same values with the last two dimensions' memory order swapped (a transposed copy, viewed back)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def fp8_gemms(c):
    """name -> (fn(config) -> outputs, flops). ``*_kmaj``: the dgrad GEMMs on K-major copies of the weights (the
    forward's bytes are N-major for them); ``*_kpad``: the weight gradients on block-padded K-major operands
    (``quantize_128x1_grouped(..., kmajor=True)``, the layer's), to measure what the layouts cost."""
    R, D, F, off, tok, kc = c["R"], c["D"], c["F"], c["off"], c["tok"], c["cache"]
    w2k, w2ks, w13k, w13ks = (_kmajor(c[k]) for k in ("w2q", "w2s", "w13q", "w13s"))
    p13k, q13k, p2k, q2k = (Q.quantize_128x1_grouped(src, off, idx, kmajor=True)[0] for src, idx in (
        (c["dgu"], None), (c["x"], tok), (c["dy"], tok), (c["hw"], None)))
    return {
        "gate_up": (lambda cfg: F8.fp8_gate_up_swiglu(c["xq"], c["xs"], c["w13q"], c["w13s"], off, gather_idx_R=tok,
                                                      tile_cache=kc, config=cfg), 4 * R * D * F),
        "down": (lambda cfg: (F8.fp8_grouped_mm_nt(c["hq"], c["hs"], c["w2q"], c["w2s"], off, tile_cache=kc,
                                                   config=cfg),), 2 * R * D * F),
        "dgrad_swiglu": (lambda cfg: F8.fp8_swiglu_dgrad(c["dq"], c["ds"], c["w2q"], c["w2s"], off, c["gu"],
                                                         gather_idx_R=tok, row_scale_R=c["scale"], tile_cache=kc,
                                                         config=cfg), 2 * R * D * F),
        "dgrad": (lambda cfg: (F8.fp8_grouped_mm_nn(c["dgq"], c["dgs"], c["w13q"], c["w13s"], off, tile_cache=kc,
                                                    config=cfg),), 4 * R * D * F),
        "wgrad13": (lambda cfg: (F8.fp8_k_grouped_mm(c["p13"], c["p13s"], c["q13"], c["q13s"], off, tile_cache=kc,
                                                     out_dtype=torch.bfloat16, config=cfg),), 4 * R * D * F),
        "wgrad2": (lambda cfg: (F8.fp8_k_grouped_mm(c["p2"], c["p2s"], c["q2"], c["q2s"], off, tile_cache=kc,
                                                    out_dtype=torch.bfloat16, config=cfg),), 2 * R * D * F),
        "dgrad_swiglu_kmaj": (lambda cfg: F8.fp8_swiglu_dgrad(c["dq"], c["ds"], w2k, w2ks, off, c["gu"],
                                                              gather_idx_R=tok, row_scale_R=c["scale"],
                                                              tile_cache=kc, config=cfg), 2 * R * D * F),
        "dgrad_kmaj": (lambda cfg: (F8.fp8_grouped_mm_nn(c["dgq"], c["dgs"], w13k, w13ks, off, tile_cache=kc,
                                                         config=cfg),), 4 * R * D * F),
        "wgrad13_kpad": (lambda cfg: (F8.fp8_k_grouped_mm(p13k, c["p13s"], q13k, c["q13s"], off, padded=True,
                                                          tile_cache=kc, out_dtype=torch.bfloat16, config=cfg),),
                         4 * R * D * F),
        "wgrad2_kpad": (lambda cfg: (F8.fp8_k_grouped_mm(p2k, c["p2s"], q2k, c["q2s"], off, padded=True,
                                                         tile_cache=kc, out_dtype=torch.bfloat16, config=cfg),),
                        2 * R * D * F),
    }


def bf16_gemms(c):
    x, w13, w2, dy, off, tok, s = c["x"], c["w13"], c["w2"], c["dy"], c["off"], c["tok"], c["scale"]
    dgu, hw = c["dgu"], c["hw"]
    return {
        "gate_up": lambda: gate_up_swiglu(x, w13, off, gather_idx_R=tok),
        "down": lambda: down_proj(c["h_bf16"], w2, off),
        "dgrad_swiglu": lambda: swiglu_dgrad(dy, w2, off, c["gu_bf16"], gather_idx_R=tok, row_scale_R=s),
        "dgrad": lambda: grouped_mm_nn(dgu, w13, off),
        "wgrad13": lambda: k_grouped_mm(dgu, x, off, q_idx_R=tok),
        "wgrad2": lambda: k_grouped_mm(dy, hw, off, p_idx_R=tok),
    }


def _group_amax_rows(x_rows, off):
    """(E, C) amax over each expert's rows (zeros for an empty expert)."""
    R, C = x_rows.shape
    E = off.numel() - 1
    expert = torch.searchsorted(off[1:].long(), torch.arange(R, device=x_rows.device), right=True)
    return torch.zeros(E, C, device=x_rows.device).scatter_reduce_(0, expert[:, None].expand(R, C),
                                                                    x_rows.float().abs(), "amax"), expert


def torch_fp8_gemms(c):
    """torch._scaled_grouped_mm, rowwise scales, rows sorted by expert (operands prepared untimed)."""
    off, li = c["off"], c["tok"].long()
    ends = off[1:].contiguous()
    mm = torch._scaled_grouped_mm

    def nt(a_rows, w):  # rows (R, K) @ w[e]^T, w (E, N, K)
        aq, sa = rowwise(a_rows)
        wq, sw = rowwise(w)  # per (e, n) over K
        return lambda: mm(aq, wq.transpose(1, 2), sa, sw, offs=ends, out_dtype=torch.bfloat16)

    def nn(a_rows, w):  # rows (R, K) @ w[e], w (E, K, N): column-major B = w^T stored (E, N, K)
        wt = w.transpose(1, 2).contiguous()
        return nt(a_rows, wt)

    def kg(p_rows, q_rows):  # dW[e] = P_e^T @ Q_e: mat_a (M, R) row-major, mat_b (R, N) column-major
        pa, expert = _group_amax_rows(p_rows, off)
        qa, _ = _group_amax_rows(q_rows, off)
        ps, qs = (pa / 448.0).clamp(min=1e-12), (qa / 448.0).clamp(min=1e-12)
        pq = (p_rows.float() / ps[expert]).to(E4M3).t().contiguous()
        qq = (q_rows.float() / qs[expert]).to(E4M3).t().contiguous()
        return lambda: mm(pq, qq.t(), ps.reshape(-1), qs.reshape(-1), offs=ends, out_dtype=torch.bfloat16)

    h = ref.dequantize_1x128(c["hq"], c["hs"]).bfloat16()
    return {
        "gate_up": nt(c["x"][li], c["w13"]), "down": nt(h, c["w2"]), "dgrad_swiglu": nn(c["dy"][li], c["w2"]),
        "dgrad": nn(c["dgu"], c["w13"]),
        # the weight gradients only where every expert's row count is a multiple of 16: torch's 2d-2d grouped GEMM
        # takes nothing else, and asserts on the device (which ends the process) rather than raising
        **({"wgrad13": kg(c["dgu"], c["x"][li]), "wgrad2": kg(c["dy"][li], c["hw"])}
           if bool(((off[1:] - off[:-1]) % 16 == 0).all()) else {}),
    }


# ---- correctness vs plain PyTorch on the dequantized operands (fp32) ----
def _per_expert(off, fn):
    offs = off.tolist()
    return [fn(e, offs[e], offs[e + 1]) for e in range(len(offs) - 1)]


def deq_w(q, s):
    return ref.dequantize_128x128(q, s)


def _rel(out, want):
    return ((out.float() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


def check(c, name, outs):
    """Relative max error of one FP8 GEMM's main output vs fp32 PyTorch on the dequantized operands."""
    off, li, F = c["off"], c["tok"].long(), c["F"]
    if name in ("gate_up", "dgrad_swiglu", "down", "dgrad"):
        a, s, wq, ws, rows, nt = {
            "gate_up": (c["xq"], c["xs"], c["w13q"], c["w13s"], li, True),
            "down": (c["hq"], c["hs"], c["w2q"], c["w2s"], None, True),
            "dgrad_swiglu": (c["dq"], c["ds"], c["w2q"], c["w2s"], li, False),
            "dgrad": (c["dgq"], c["dgs"], c["w13q"], c["w13s"], None, False),
        }[name]
        ad = ref.dequantize_1x128(a, s)
        ad = ad[rows] if rows is not None else ad
        wants = _per_expert(off, lambda e, r0, r1: ad[r0:r1] @ (deq_w(wq[e], ws[e]).t() if nt else deq_w(wq[e], ws[e])))
        want = torch.cat(wants)
        if name == "gate_up":
            return _rel(outs[2], want)  # the saved [g | u]
        if name == "dgrad_swiglu":  # the routing-weight row dots: sum_n acc * h
            gu = c["gu"].float()
            h = (gu[:, :F] * torch.sigmoid(gu[:, :F]) * gu[:, F:]).bfloat16().float()
            return _rel(outs[2].sum(1), (want * h).sum(1))
        return _rel(outs[0], want)
    p, ps, q, qs = (c["p13"], c["p13s"], c["q13"], c["q13s"]) if name == "wgrad13" else (
        c["p2"], c["p2s"], c["q2"], c["q2s"])
    pd, qd = ref.dequantize_128x1_grouped(p, ps, off), ref.dequantize_128x1_grouped(q, qs, off)
    errs = _per_expert(off, lambda e, r0, r1: ((outs[0][e].float() - pd[r0:r1].t() @ qd[r0:r1]).abs().max(),
                                               (pd[r0:r1].t() @ qd[r0:r1]).abs().max()))
    return (max(a for a, _ in errs) / max(b for _, b in errs).clamp(min=1e-30)).item()


def sweep_configs(kind):
    grid = [F8.Fp8GemmConfig(bm, bn, nw, st) for bm, bn, nw, st in itertools.product((64, 128), (128, 256), (4, 8),
                                                                                     (3, 4))]
    if kind != "wgrad":  # two CTAs per SM (one's promotion beside the other's dot)
        grid += [F8.Fp8GemmConfig(64, 128, 4, st, programs_per_sm=2) for st in (3, 4)]
    return grid


def run_case(case, only, sweep, log):
    name, T = case.split(":")
    c = setup(name, int(T))
    tag = f"{name} T={T} (R={c['R']}, E={c['E']}, D={c['D']}, F={c['F']})"
    log(f"== {tag}")
    fp8, bf16 = fp8_gemms(c), bf16_gemms(c)
    try:
        tfp8 = torch_fp8_gemms(c)
    except Exception as exc:  # noqa: BLE001 - report and go on
        log(f"   torch fp8 operands failed: {type(exc).__name__}: {str(exc)[:200]}")
        tfp8 = {}
    log(f"   {'gemm':17s} {'rel err':>9s} {'fp8 ms':>8s} {'TF/s':>6s} {'bf16 ms':>8s} {'TF/s':>6s} "
        f"{'torch-fp8 ms':>12s} {'TF/s':>6s}  fp8 / bf16")
    for gname, (fn, flop) in fp8.items():
        base_name = gname.replace("_kmaj", "").replace("_kpad", "")
        if only and gname not in only:
            continue
        try:
            outs = fn(None)
            err = check(c, base_name, outs)
            t8 = timeit(lambda fn=fn: fn(None))
        except Exception as exc:  # noqa: BLE001 - report and go on
            log(f"   {gname:17s} FAILED {type(exc).__name__}: {str(exc)[:400]}")
            continue
        tb = timeit(bf16[base_name])
        try:
            if base_name not in tfp8:
                raise ValueError("expert row counts not multiples of 16")
            tt = timeit(tfp8[base_name])
            tt = f"{tt:12.3f} {flop / tt / 1e9:6.0f}"
        except Exception as exc:  # noqa: BLE001
            tt = f"{'n/a':>12s} {'':6s} ({type(exc).__name__}: {str(exc)[:60]})"
        flag = "" if err < 2e-2 else "  <-- ERROR above 2e-2: wrong result"
        log(f"   {gname:17s} {err:9.2e} {t8:8.3f} {flop / t8 / 1e9:6.0f} {tb:8.3f} {flop / tb / 1e9:6.0f} {tt}  "
            f"{tb / t8:.2f}x{flag}")
        if sweep:
            base = [t.clone() for t in outs if t is not None]
            kind = "wgrad" if gname.startswith("wgrad") else base_name
            for cfg in sweep_configs(kind):
                try:
                    F8.fp8_config(kind, interpret=False, config=cfg)
                    got = [t for t in fn(cfg) if t is not None]
                    same = all(torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                                           b.view(torch.uint8) if b.dtype == E4M3 else b) for a, b in zip(base, got))
                    ms = timeit(lambda fn=fn, cfg=cfg: fn(cfg), iters=6, warm=2)
                    log(f"      {gname:17s} {cfg.block_m:4d}x{cfg.block_n:<4d} w{cfg.num_warps} s{cfg.num_stages}"
                        f"{' 2/SM' if cfg.programs_per_sm > 1 else '     '} "
                        f"{ms:8.3f} ms {flop / ms / 1e9:6.0f} TF/s  bits {'==' if same else 'DIFFERENT'}")
                except Exception as exc:  # noqa: BLE001
                    log(f"      {gname:17s} {cfg} FAILED {type(exc).__name__}: {str(exc)[:160]}")
    del c
    torch.cuda.empty_cache()


def main():
    args = sys.argv[1:]
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return
    only = [a[len("--only="):] for a in args if a.startswith("--only=")]
    out = next((a[len("--out="):] for a in args if a.startswith("--out=")), None)
    sweep = "--sweep" in args
    cases = [a for a in args if not a.startswith("--")] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "fp8_gemm_bench.log"), "w") as f:
                f.write("\n".join(lines) + "\n")

    import triton
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    log(f"{where} torch {torch.__version__} triton {triton.__version__}")
    for case in cases:
        run_case(case, only, sweep, log)


if __name__ == "__main__":
    main()
