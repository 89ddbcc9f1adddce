"""megamoe inside Hugging Face transformers on one GPU: experts implementations, the block swap, a training step.

Usage: python scripts/bench_hf.py [--json OUT.json] [--profile DIR] [--no-train-step]   (one H200: 2-3 minutes)
       python scripts/bench_hf.py --tiny                  (small shapes, any device: a smoke run of this script)

Three parts, every timing the median of CUDA-event samples (megamoe.bench.timing, L2 flushed before each), the
implementations interleaved round by round; each implementation's results checked before it is timed:

1. Experts, forward + backward (gradients of x, the routing weights and both expert weights), on the router
   outputs of transformers' own block, for Qwen3-MoE at the Qwen3-30B-A3B layer shape (D 2048, F 768,
   E 128, K 8, T 16384, bf16) and a DeepSeek-V3 block (D 7168, F 2048, E 256, K 8, 8 groups keep 4, one
   shared expert, T 4096): transformers' ``eager``, ``grouped_mm`` and ``megamoe`` experts implementations
   and megamoe's own call (megamoe.functional.moe_experts) on the same tensors. Checks: ``megamoe`` gives
   bitwise the functional call's output and gradients; ``grouped_mm`` and ``eager`` agree with it to bf16
   rounding (relative rms error printed, summed in fp32 blocks: no full-size fp64 copies). DeepSeek-V3's
   ``eager`` is checked but not timed (its backward writes a zero gradient of all 256 experts per expert: seconds
   a call; the checked call's time is printed). Target: the experts implementation adds < 3% to the functional
   call.
2. The whole block (router + experts [+ shared expert]), forward + backward (gradients of x and every
   parameter): transformers' block with ``grouped_mm`` and with ``megamoe`` experts, and megamoe's block
   swap (megamoe.integrations.transformers.MegaMoEBlock, on the same parameters). Check: on the tokens
   whose top-k experts both routers pick alike, the swap's output matches transformers' block to bf16
   rounding (the fraction of such tokens is printed: both compute the logits in the family's dtype, bf16 for
   Qwen3-MoE and fp32 for DeepSeek-V3, in GEMMs of other accumulation orders, and break exact ties of the K-th
   score their own ways). Target: the swap beats the block with the ``megamoe`` experts implementation.
3. A training step (forward, backward, AdamW) of a 2-layer Qwen3-MoE model at the Qwen3-30B-A3B layer
   widths (vocab 32768, 4 sequences of 4096 tokens), in tokens/s, for ``grouped_mm``, ``megamoe`` and the
   swap (``eager`` too: slow). Check: the first step's loss agrees across them.

With ``--profile DIR``, for each block after part 2, where the swap's time differs from the block with the
``megamoe`` experts implementation (the experts' call is the same in both; the routers differ):
2b. the routers alone, fwd + bwd: transformers' router, the swap's router (megamoe's logits GEMM in the family's
    dtype, then megamoe's routing) and its two halves, and cuBLAS's fp32 and bf16 linear at the same shape;
2c. the swap router's three GEMMs (logits, dx, dW; for DeepSeek-V3's fp32 router bf16 GEMMs of exact bf16 pieces
    of the fp32 operands, with the IEEE fp32 FMA GEMMs they replaced and cuBLAS's errors beside them; bf16 tensor
    cores for Qwen3-MoE) with the table's tile and other tiles of the same BLOCK_K, each checked bitwise against
    the table's (a faster one can go into ``megamoe.ops.tile_config.router_kernel_config`` as is);
2d. torch.profiler's CUDA kernels of both blocks' fwd + bwd, grouped by name, with the difference per kernel
    (DIR/<block>_kernels.txt and .json).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import time

import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import megamoe.integrations.transformers as mt
from megamoe import reference as ref
from megamoe.bench.timing import Timer, summarize
from megamoe.functional import moe_experts

BF16 = torch.bfloat16


def rel_rms(got: torch.Tensor, want: torch.Tensor, chunk: int = 1 << 24) -> float:
    """||got - want|| / ||want|| over every element, in fp32 blocks of ``chunk`` elements whose sums of squares
    add up in fp64 scalars on the device: no full-size fp32 or fp64 copy (DeepSeek-V3's gate/up gradient alone is
    15 GB in bf16, 60 GB in fp64)."""
    g, w = got.reshape(-1), want.reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=w.device)
    den = torch.zeros((), dtype=torch.float64, device=w.device)
    for i in range(0, w.numel(), chunk):
        w_c = w[i:i + chunk].float()
        num += (g[i:i + chunk].float() - w_c).square().sum().double()
        den += w_c.square().sum().double()
    return (num.sqrt() / den.sqrt().clamp_min(1e-30)).item()


def fwd_bwd(fn, inputs, dout):
    """Run fn() and return (out, grads of inputs), the unit of work every timing below measures."""
    out = fn()
    return out, torch.autograd.grad(out, inputs, dout)


def time_interleaved(timer: Timer, works: dict, iters: dict, rounds: int) -> dict:
    """Median ms per work: ``rounds`` rounds, each runs every work ``iters[name]`` times, order rotated."""
    samples = {name: [] for name in works}
    names = list(works)
    for name in names:  # warm-up (compilation, allocator)
        works[name]()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name] += timer.time(lambda _, f=works[name]: f(), iters[name])
    return {name: summarize(s) for name, s in samples.items()}


def build(cls, cfg, device, seed: int):
    """``cls(cfg)`` with bf16 parameters created on ``device`` (no fp32 copies of DeepSeek-V3's 22 GB of experts;
    parameters transformers pins to fp32 stay fp32), matrices of realistic scale: std (fan-in)^-1/2, a small
    random correction bias."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(BF16)
    try:
        with torch.device(device):
            module = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:  # (norm weights keep their ones)
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        for name, b in list(module.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # fp32, as transformers keeps it when loading
                owner = module.get_submodule(name.rpartition(".")[0])
                owner.e_score_correction_bias = torch.randn(b.shape, generator=g, device=b.device) * 1e-2
    return module


def experts_part(label: str, block, x, timer: Timer, iters: dict, rounds: int, untimed: tuple = ()) -> dict:
    """Part 1 on one block: the experts implementations and the functional call, on the block's routing.
    ``untimed``: implementations checked (one call, its wall time printed) but left out of the timing."""
    experts, cfg = block.experts, block.experts.config
    with torch.no_grad():
        _, w_TK, ids_TK = block.gate(x)
    w_TK = w_TK.detach().requires_grad_()
    inputs = [x, w_TK, experts.gate_up_proj, experts.down_proj]
    dout = torch.randn(x.shape, generator=torch.Generator(device=x.device).manual_seed(1), device=x.device).to(x.dtype)
    backend = "fused" if x.is_cuda else "reference"

    def impl(name):
        def run():
            cfg._experts_implementation = name
            return fwd_bwd(lambda: experts(x, ids_TK, w_TK), inputs, dout)
        return run

    def functional():
        return fwd_bwd(lambda: moe_experts(x, ids_TK, w_TK, *inputs[2:], backend=backend), inputs, dout)

    works = {"eager": impl("eager"), "grouped_mm": impl("grouped_mm"), "megamoe": impl("megamoe"),
             "functional": functional}
    want = functional()
    errs, check_s = {}, {}
    for name in ("megamoe", "grouped_mm", "eager"):  # one result at a time: DeepSeek-V3's gradients are 22 GB
        timer.sync()
        t0 = time.perf_counter()
        res = works[name]()
        timer.sync()
        check_s[name] = time.perf_counter() - t0
        if name == "megamoe":
            assert all(torch.equal(a, b) for a, b in zip((res[0], *res[1]), (want[0], *want[1]))), \
                f"{label}: the megamoe experts implementation differs from megamoe.functional.moe_experts"
        else:
            errs[name] = max(rel_rms(a, b) for a, b in zip((res[0], *res[1]), (want[0], *want[1])))
            assert errs[name] < 2e-2, f"{label}: {name} vs megamoe relative rms error {errs[name]:.3g}"
        del res
    del want  # nothing but the parameters and the inputs is held while timing
    stats = time_interleaved(timer, {k: v for k, v in works.items() if k not in untimed}, iters, rounds)
    overhead = stats["megamoe"].median / stats["functional"].median - 1
    print(f"\n{label} experts, fwd+bwd, ms (median [p20, p80] of n)")
    for name, s in stats.items():
        note = f"  (rel rms vs megamoe {errs[name]:.2e})" if name in errs else ""
        print(f"  {name:<11} {s.median:9.2f}  [{s.p20:.2f}, {s.p80:.2f}] n={s.n}{note}")
    for name in untimed:
        print(f"  {name:<11} not timed: one checked call took {check_s[name]:.1f} s (rel rms vs megamoe "
              f"{errs[name]:.2e})")
    ratios = "; ".join(f"{name} / megamoe {stats[name].median / stats['megamoe'].median:.2f}x"
                       for name in ("grouped_mm", "eager") if name in stats)
    print(f"  megamoe vs functional: {100 * overhead:+.1f}% (target < 3%: {'met' if overhead < 0.03 else 'MISSED'}); "
          + ratios)
    return {name: s.median for name, s in stats.items()} | {"overhead_vs_functional": overhead}


class CublasLogitsSwap(mt.MegaMoEBlock):
    """A what-if, not a megamoe option: the swap with the router logits from transformers' own GEMM (cuBLAS
    ``F.linear``: in the model dtype for Qwen3-MoE, in fp32 for DeepSeek-V3, as their routers compute them and as
    the swap's ``moe_config.router_dtype`` says), then megamoe's routing and fused experts as in the swap. Not
    batch invariant, and other bits than the swap; it measures what the swap's logits GEMM (megamoe's kernel and
    its two backward GEMMs) costs."""

    def route(self, x_TD):
        w_ED = self.gate.weight
        fp32 = self.moe_config.router_dtype == "fp32"  # (DeepSeek-V3's router computes fp32 logits)
        logits_TE = F.linear(x_TD.float(), w_ED.float()) if fp32 else F.linear(x_TD, w_ED.to(x_TD.dtype))
        r = ref.route(x_TD, w_ED, getattr(self.gate, "e_score_correction_bias", None), self.moe_config,
                         logits_TE=logits_TE)
        r.topk_ids_TK = r.topk_ids_TK.contiguous()
        return logits_TE, r


def block_part(label: str, block, x, timer: Timer, iters: dict, rounds: int, whatif: bool = False) -> dict:
    """Part 2 on one block: transformers' block (grouped_mm, megamoe experts) vs the swapped block (and with
    ``whatif`` the swap with cuBLAS logits, :class:`CublasLogitsSwap`)."""
    cfg = block.experts.config
    swapped = mt.MegaMoEBlock(block)  # the same submodules and parameters
    inputs = [x, *block.parameters()]
    dout = torch.randn(x.shape, generator=torch.Generator(device=x.device).manual_seed(2), device=x.device).to(x.dtype)

    def hf(name):
        def run():
            cfg._experts_implementation = name
            return fwd_bwd(lambda: block(x), inputs, dout)
        return run

    works = {"grouped_mm": hf("grouped_mm"), "megamoe": hf("megamoe"), "swap": lambda: fwd_bwd(lambda: swapped(x),
                                                                                                inputs, dout)}
    if whatif:
        cublas = CublasLogitsSwap(block)
        works["swap, cuBLAS logits (what-if)"] = lambda: fwd_bwd(lambda: cublas(x), inputs, dout)
        iters = iters | {"swap, cuBLAS logits (what-if)": iters["swap"]}
    with torch.no_grad():  # the check: tokens both routers send to the same experts
        cfg._experts_implementation = "megamoe"
        want = block(x).view(-1, x.shape[-1])
        got = swapped(x).view(-1, x.shape[-1])
        hf_ids = block.gate(x.view(-1, x.shape[-1]))[2].sort(-1).values
        same = (swapped.last_stats.topk_ids_TK.sort(-1).values == hf_ids).all(-1)
    err = rel_rms(got[same], want[same])
    assert same.float().mean() > 0.9 and err < 2e-2, f"{label}: swap vs transformers' block: {err:.3g} on {same.sum()}"
    del want, got
    stats = time_interleaved(timer, works, iters, rounds)
    print(f"\n{label} whole block (router + experts{' + shared' if hasattr(block, 'shared_experts') else ''}), "
          f"fwd+bwd, ms; same top-k on {100 * same.float().mean():.2f}% of tokens, there rel rms {err:.2e}")
    for name, s in stats.items():
        print(f"  {name:<30} {s.median:9.2f}  [{s.p20:.2f}, {s.p80:.2f}] n={s.n}")
    gain = stats["megamoe"].median / stats["swap"].median
    print(f"  swap vs megamoe experts implementation: {gain:.2f}x (target > 1: {'met' if gain > 1 else 'MISSED'})")
    if whatif:
        print(f"  what-if (cuBLAS logits) vs megamoe experts implementation: "
              f"{stats['megamoe'].median / stats['swap, cuBLAS logits (what-if)'].median:.2f}x")
    return {name: s.median for name, s in stats.items()}


def _dout_like(out: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator(device=out.device).manual_seed(seed)
    return torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)


def _grad_of(fn, inputs, seed: int = 7):
    """fwd + bwd of ``fn()`` with a fixed random output gradient (made once, on the first call)."""
    dout = []

    def run():
        out = fn()
        if not dout:
            dout.append(_dout_like(out, seed))
        return out, torch.autograd.grad(out, inputs, dout[0])
    return run


def router_part(label: str, block, x, timer: Timer, rounds: int) -> dict:
    """Part 2b: the routers alone, fwd + bwd (gradients of x and the router weight), to split the block
    difference: transformers' router (``block.gate``; its top-k weights get the gradient), the swap's router
    (:meth:`MegaMoEBlock.route`: megamoe's logits GEMM in the family's dtype, then megamoe's routing) and its two
    halves, the same
    routing on transformers' own logits GEMM (:class:`CublasLogitsSwap`), and cuBLAS's fp32 and bf16 ``F.linear``
    at the same shape (what an IEEE fp32 and a bf16 GEMM cost there)."""
    swapped, cublas = mt.MegaMoEBlock(block), CublasLogitsSwap(block)
    x_TD = x.detach().view(-1, x.shape[-1]).requires_grad_()
    w_ED = block.gate.weight
    logits_TE = swapped.route(x_TD)[0].detach().requires_grad_()
    works = {
        "transformers router": _grad_of(lambda: block.gate(x_TD)[1], [x_TD, w_ED]),
        "swap router": _grad_of(lambda: swapped.route(x_TD)[1].topk_weights_TK, [x_TD, w_ED]),
        "  logits GEMM": _grad_of(lambda: swapped.route(x_TD)[0], [x_TD, w_ED]),  # (routing's fwd runs too)
        "  cuBLAS logits + routing": _grad_of(lambda: cublas.route(x_TD)[1].topk_weights_TK,
                                              [x_TD, w_ED]),
        "  routing": _grad_of(lambda: ref.route(x_TD, w_ED, getattr(block.gate, "e_score_correction_bias", None),
                                                   swapped.moe_config, logits_TE=logits_TE).topk_weights_TK,
                              [logits_TE]),
        "cuBLAS fp32 linear": _grad_of(lambda: F.linear(x_TD.float(), w_ED.float()), [x_TD, w_ED]),
        "cuBLAS bf16 linear": _grad_of(lambda: F.linear(x_TD, w_ED.to(x_TD.dtype)), [x_TD, w_ED]),
    }
    stats = time_interleaved(timer, works, dict.fromkeys(works, 5), rounds)
    T, D, E = x_TD.shape[0], x_TD.shape[1], w_ED.shape[0]
    print(f"\n{label} routers alone, fwd+bwd, ms (T {T}, D {D}, E {E}: {6 * T * D * E / 1e9:.1f} GFLOP of GEMMs)")
    for name, s in stats.items():
        print(f"  {name:<26} {s.median:8.3f}  [{s.p20:.3f}, {s.p80:.3f}] n={s.n}")
    return {name.strip(): s.median for name, s in stats.items()}


_ROUTER_TILES = {  # the table's own tile first (None), then others; BLOCK_K stays the table's (the K order)
    # fp32: the bf16-piece GEMMs (megamoe.autograd: logits N = 3E, dx K = 7E, dW M = 3E); "ieee" is the IEEE fp32
    # FMA GEMMs' path they replaced (other bits, by design)
    "fp32": {"m": [None, "ieee", (128, 128, 64, 8, 4), (128, 256, 64, 8, 3, 1, True), (64, 128, 64, 4, 3, 2, True),
                   (128, 128, 64, 8, 3, 1, True)],
             "k": [None, "ieee", (64, 128, 64, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3)]},
    "model": {"m": [None, (128, 128, 64, 8, 3, 1, True), (128, 256, 64, 8, 3, 1, True), (64, 128, 64, 4, 3, 2, True),
                    (128, 64, 64, 4, 4, 2, True), (128, 128, 64, 8, 4)],
              "k": [None, (64, 128, 64, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 2)]},
}


def _tile_config(tile):
    """GemmConfig of a sweep entry (BM, BN, BK, warps, stages[, programs per SM[, TMA for A and B]])."""
    from megamoe.ops import GemmConfig

    tma = len(tile) > 6 and tile[6]
    return GemmConfig(*tile[:5], programs_per_sm=tile[5] if len(tile) > 5 else 1, tma_a=tma, tma_b=tma)


def _router_gemms(mode: str, x_TD, w_ED, dlogits_TE):
    """{name: (kind, its tile keys, fn(kernel_config) -> result)} of the router's three GEMMs as
    megamoe.autograd launches them, and for fp32 the IEEE FMA GEMMs ("ieee") they replaced."""
    import megamoe.autograd as ag
    import megamoe.ops.grouped_gemm as gg
    from megamoe.ops import single_group_offsets

    T, D = x_TD.shape
    E = w_ED.shape[0]
    one_2 = single_group_offsets(T, x_TD.device)
    if mode == "model":
        w_1ED = w_ED.to(x_TD.dtype).unsqueeze(0)
        dl = dlogits_TE.to(x_TD.dtype)
        return {"logits x @ W.T": ("m", [("down", E, D)], lambda kc: gg.grouped_mm_nt(
                    x_TD, w_1ED, one_2, out_dtype=x_TD.dtype, kernel_config=kc)),
                "dx dlogits @ W": ("m", [("dgrad", D, E)], lambda kc: gg.grouped_mm_nn(
                    dl, w_1ED, one_2, out_dtype=x_TD.dtype, kernel_config=kc)),
                "dW dlogits.T @ x": ("k", [("wgrad", E, D)], lambda kc: ag.router_wgrad(dl, x_TD, kernel_config=kc))}
    w32, dl32 = w_ED.float().contiguous(), dlogits_TE.float().contiguous()
    pieces = 1 if w_ED.dtype == torch.bfloat16 else 3  # the weight's bf16 pieces (megamoe.autograd)

    def logits(kc):
        if kc == "ieee":
            return gg.grouped_mm_nt(x_TD, w32.unsqueeze(0), one_2, out_dtype=torch.float32)
        return ag.router_logits_forward(x_TD, w_ED, "fp32", kernel_config=kc)

    def grads(kc, need_x):
        if kc == "ieee" and need_x:
            return gg.grouped_mm_nn(dl32, w32.unsqueeze(0), one_2, out_dtype=x_TD.dtype)
        if kc == "ieee":
            return gg.k_grouped_mm(dl32, x_TD, one_2, out_dtype=torch.float32)[0]
        dx, dw = ag.router_logits_backward(dl32, x_TD, w_ED, need_x, not need_x, "fp32", kernel_config=kc)
        return dx if need_x else dw
    return {"logits x @ W.T": ("m", [("down", pieces * E, D)], logits),
            "dx dlogits @ W": ("m", [("dgrad", D, 6 * E // pieces)], lambda kc: grads(kc, True)),
            "dW dlogits.T @ x": ("k", [("wgrad", 3 * E, D)], lambda kc: grads(kc, False))}


def router_tile_sweep(label: str, block, x, timer: Timer, rounds: int) -> dict:
    """Part 2c: the three GEMMs of the swap's router (logits ``x @ W.T``; backward ``dlogits @ W`` and
    ``dlogits.T @ x``) in its router dtype (``moe_config.router_dtype``: "fp32", bf16 GEMMs of exact three-piece
    splits of the fp32 operands, their piece sums included; "model", bf16 on tensor cores; dW over the token
    chunks of megamoe.autograd.router_wgrad and the chunk sum), as megamoe.autograd launches them, with the table's
    tile (first) and other tiles of the same BLOCK_K; each result compared bitwise with the table's. For fp32 also
    the IEEE fp32 FMA GEMMs they replaced (other bits, by design), each result's max error against fp64, and
    cuBLAS's IEEE fp32 and TF32 errors. Prints ms per tile."""
    from megamoe.config import KernelConfig
    from megamoe.ops import router_kernel_config

    mode = mt.moe_config_of(block).router_dtype
    x_TD = x.detach().view(-1, x.shape[-1])
    T, D = x_TD.shape
    w_ED = block.gate.weight.detach()
    E = w_ED.shape[0]
    dlogits_TE = torch.randn(T, E, generator=torch.Generator(x.device).manual_seed(8), device=x.device)
    table = router_kernel_config(E, D)
    if mode == "fp32":  # the piece GEMMs' shapes too (3E rows / columns), as megamoe.autograd looks them up
        table = KernelConfig({**dict(table.tiles), **dict(router_kernel_config(3 * E, D).tiles)})
    exact = _router_fp64(x_TD, w_ED.float(), dlogits_TE) if mode == "fp32" else None
    out = {}
    print(f"\n{label} router {mode} GEMMs by tile (BM, BN, BK, warps, stages[, programs per SM[, TMA]]), ms; "
          "bits vs the table's tile" + ("; max |error| vs fp64" if exact else ""))
    for gemm, (kind, keys, fn) in _router_gemms(mode, x_TD, w_ED, dlogits_TE).items():
        base, row = None, []
        for tile in _ROUTER_TILES[mode][kind]:
            kc = table if tile is None else "ieee" if tile == "ieee" else KernelConfig(
                {**dict(table.tiles), **{key: _tile_config(tile) for key in keys}})
            res = fn(kc)
            same = True if base is None else torch.equal(res, base)
            base = res if base is None else base
            ms = time_interleaved(timer, {"g": lambda _f=fn, _k=kc: _f(_k)}, {"g": 10}, rounds)["g"].median
            err = (res.double() - exact[gemm]).abs().max().item() if exact else None
            row.append({"tile": tile or "table", "ms": ms, "same_bits": same, "max_err": err})
        best = min((r for r in row if r["same_bits"]), key=lambda r: r["ms"])
        print(f"  {gemm:<17} " + "  ".join(
            f"{r['tile']}: {r['ms']:.3f}{'' if r['same_bits'] else ' (other bits)'}"
            + (f" err {r['max_err']:.2e}" if r["max_err"] is not None else "") for r in row)
            + f"\n  {'':<17} fastest with the same bits: {best['tile']} ({row[0]['ms'] - best['ms']:+.3f} ms vs the "
            "table's)")
        out[gemm] = row
    if exact:
        out["cublas"] = _cublas_fp32_errors(x_TD, w_ED.float(), dlogits_TE, exact)
    return out


def _router_fp64(x_TD, w_ED, dlogits_TE) -> dict:
    x64, w64, d64 = x_TD.double(), w_ED.double(), dlogits_TE.double()
    return {"logits x @ W.T": x64 @ w64.T, "dx dlogits @ W": d64 @ w64, "dW dlogits.T @ x": d64.T @ x64}


def _cublas_fp32_errors(x_TD, w_ED, dlogits_TE, exact: dict) -> dict:
    """Max |error| vs fp64 of cuBLAS's fp32 GEMMs at the router's shapes, IEEE and TF32 (torch's matmul setting)."""
    old, errs = torch.backends.cuda.matmul.allow_tf32, {}
    x32 = x_TD.float()
    try:
        for name, tf32 in (("cuBLAS IEEE fp32", False), ("cuBLAS TF32", True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            got = {"logits x @ W.T": x32 @ w_ED.T, "dx dlogits @ W": dlogits_TE @ w_ED,
                   "dW dlogits.T @ x": dlogits_TE.T @ x32}
            errs[name] = {k: (v.double() - exact[k]).abs().max().item() for k, v in got.items()}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    for name, e in errs.items():
        print(f"  {name:<17} max |error| vs fp64: " + "  ".join(f"{k.split()[0]} {v:.2e}" for k, v in e.items()))
    return errs


def profile_part(label: str, block, x, out_dir: str, steps: int = 3) -> dict:
    """Part 2d: where the block's GPU time goes (torch.profiler, CUDA kernels grouped by name, per step), for
    transformers' block with the ``megamoe`` experts implementation and for the swap, with the difference,
    largest first. The experts' kernels are the same in both, so the difference is the routers' and the
    glue's. Writes OUT_DIR/<label>_kernels.txt (the table) and .json."""
    from torch.profiler import ProfilerActivity, profile

    cuda = x.is_cuda  # (on the CPU, a smoke run: the top-level CPU ops instead of kernels)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    cfg = block.experts.config
    swapped = mt.MegaMoEBlock(block)
    inputs = [x, *block.parameters()]

    def hf():
        cfg._experts_implementation = "megamoe"
        return block(x)
    paths = {"megamoe": _grad_of(hf, inputs, 2), "swap": _grad_of(lambda: swapped(x), inputs, 2)}
    per, host, wall = {}, {}, {}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for name, fn in paths.items():
        fn()
        sync()
        t0 = time.perf_counter()  # back to back, no sync between steps: the host's enqueue time vs the wall time
        for _ in range(steps):
            fn()
        host[name] = (time.perf_counter() - t0) * 1e3 / steps
        sync()
        wall[name] = (time.perf_counter() - t0) * 1e3 / steps
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU], acc_events=True) as prof:
            for _ in range(steps):
                fn()
            sync()
        per[name] = collections.defaultdict(lambda: [0.0, 0.0])
        for ev in prof.events():
            if ev.device_type == kind and (cuda or ev.cpu_parent is None):
                per[name][ev.name[:110]][0] += 1 / steps
                per[name][ev.name[:110]][1] += (ev.device_time_total if cuda else ev.cpu_time_total) / 1e3 / steps
    names = set(per["megamoe"]) | set(per["swap"])
    rows = sorted(((per["swap"][n][1] - per["megamoe"][n][1], n) for n in names), key=lambda r: -abs(r[0]))
    totals = {k: sum(v[1] for v in per[k].values()) for k in per}
    head = (f"{label}: {'CUDA kernel' if cuda else 'CPU op'} time per fwd+bwd step, ms (mean of {steps} profiled "
            f"steps): megamoe experts implementation in transformers' block {totals['megamoe']:.3f}, "
            f"swap {totals['swap']:.3f}, "
            f"difference {totals['swap'] - totals['megamoe']:+.3f}; back to back, wall / host enqueue ms per step: "
            + ", ".join(f"{k} {wall[k]:.3f} / {host[k]:.3f}" for k in paths))
    lines = [head, f"{'swap - megamoe':>15} {'megamoe':>9} {'swap':>9} {'calls':>11}  {'kernel' if cuda else 'op'}"]
    for d, n in rows:
        a, b = per["megamoe"][n], per["swap"][n]
        lines.append(f"{d:+15.3f} {a[1]:9.3f} {b[1]:9.3f} {a[0]:5.0f}/{b[0]:<5.0f}  {n}")
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, label.split(" ")[0] + "_kernels")
    with open(stem + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({k: {n: {"calls": c, "ms": ms} for n, (c, ms) in v.items()} for k, v in per.items()}, f, indent=1)
    print("\n" + "\n".join(lines[:22]) + f"\n  (all rows: {stem}.txt)")
    return {k: {"kernels_ms": totals[k], "wall_ms": wall[k], "host_ms": host[k]} for k in paths}


def model_part(tokens: tuple[int, int], widths: dict, timer: Timer, device, iters: dict, rounds: int) -> dict:
    """Part 3: a training step of a small Qwen3-MoE causal LM, tokens/s per experts choice."""
    cfg = transformers.Qwen3MoeConfig(**widths)
    model = build(transformers.Qwen3MoeForCausalLM, cfg, device, seed=3)
    swapped = copy.deepcopy(model)
    swapped.set_experts_implementation("eager")
    mt.swap_moe_blocks(swapped)
    B, L = tokens
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(4)).to(device)
    losses = {}
    with torch.no_grad():  # the check, before any optimizer step: the same loss whichever runs the experts
        for name in ("grouped_mm", "megamoe", "eager"):
            model.set_experts_implementation(name)
            losses[name] = model(input_ids=ids, labels=ids).loss.item()
        losses["swap"] = swapped(input_ids=ids, labels=ids).loss.item()
    assert all(abs(v - losses["grouped_mm"]) < 1e-2 * abs(losses["grouped_mm"]) for v in losses.values()), losses

    def step(m, opt, name=None):
        def run():
            if name is not None:
                m.set_experts_implementation(name)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    opt, opt_swapped = (torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True) for m in (model, swapped))
    works = {name: step(model, opt, name) for name in ("eager", "grouped_mm", "megamoe")}
    works["swap"] = step(swapped, opt_swapped)
    stats = time_interleaved(timer, works, iters, rounds)
    print(f"\ntraining step (fwd, bwd, AdamW) of a {cfg.num_hidden_layers}-layer Qwen3-MoE (D {cfg.hidden_size}, "
          f"E {cfg.num_experts}, K {cfg.num_experts_per_tok}, F {cfg.moe_intermediate_size}, vocab {cfg.vocab_size}), "
          f"{B} x {L} tokens; first losses " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))
    out = {}
    for name, s in stats.items():
        out[name] = B * L / (s.median / 1e3)
        print(f"  {name:<11} {s.median:9.2f} ms  {out[name]:12,.0f} tokens/s  n={s.n}")
    return out


_QWEN = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}
SHAPES = {  # full: the shapes; tiny: a smoke run on any device
    "full": {"qwen": _QWEN, "qwen_T": 16384,
             "dsv3": {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                      "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
                      "routed_scaling_factor": 2.5},
             "dsv3_T": 4096,
             "model": {**_QWEN, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
                       "head_dim": 128, "vocab_size": 32768, "intermediate_size": 6144},
             "model_tokens": (4, 4096)},
    "tiny": {"qwen": {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2},
             "qwen_T": 256,
             "dsv3": {"hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                      "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5},
             "dsv3_T": 128,
             "model": {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "vocab_size": 256, "intermediate_size": 64},
             "model_tokens": (2, 64)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes (a smoke run; CPU works)")
    ap.add_argument("--json", help="write the medians here")
    ap.add_argument("--profile", metavar="DIR", help="also time the routers alone and the router's GEMMs by "
                    "tile, and profile the whole block's kernels (megamoe experts implementation vs the swap; CUDA "
                    "only), writing the kernel tables under DIR")
    ap.add_argument("--no-train-step", action="store_true", help="leave out part 3 (the training step)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SHAPES["tiny" if args.tiny else "full"]
    timer = Timer(device)
    slow, fast = 2, 5  # iterations per round: eager takes ~230 ms a step at the Qwen3 shape
    iters = {"eager": slow, "grouped_mm": fast, "megamoe": fast, "functional": fast, "swap": fast}
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {where}")
    results = {}
    for label, cls, cfg_cls, kw, T in (
            ("qwen3-30b-a3b", Qwen3MoeSparseMoeBlock, transformers.Qwen3MoeConfig, shapes["qwen"], shapes["qwen_T"]),
            ("deepseek-v3", DeepseekV3MoE, transformers.DeepseekV3Config, shapes["dsv3"], shapes["dsv3_T"])):
        cfg = cfg_cls(**kw, norm_topk_prob=True)
        block = build(cls, cfg, device, seed=0)
        x = torch.randn(T, cfg.hidden_size, generator=torch.Generator(device).manual_seed(5), device=device, dtype=BF16)
        x.requires_grad_()
        # eager's DeepSeek-V3 backward writes a zero gradient of all 256 experts' weights per expert (seconds a
        # call): checked, not timed
        untimed = ("eager",) if label == "deepseek-v3" and not args.tiny else ()
        name = f"{label} (T={T})"
        results[label] = {"experts": experts_part(name, block, x, timer, iters, 3, untimed),
                          "block": block_part(name, block, x.view(1, T, -1), timer, iters, 3, bool(args.profile))}
        if args.profile:
            results[label]["router"] = router_part(name, block, x.view(1, T, -1), timer, 3)
            if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
                results[label]["router_tiles"] = router_tile_sweep(name, block, x, timer, 2)
            results[label]["profile_ms"] = profile_part(name, block, x.view(1, T, -1), args.profile)
        del block, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_train_step:
        results["train_step_tokens_per_s"] = model_part(shapes["model_tokens"], shapes["model"], timer, device,
                                                        iters, 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
