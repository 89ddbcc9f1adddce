"""A/B of the K-major copy of the FP8 weight blocks (megamoe.ops.fp8_weights._kmajor_blocks), on one Hopper GPU:

  * "torch": torch's transposed copy of the bytes and scales (``t.transpose(-2, -1).contiguous().transpose(-2, -1)``,
    the code before);
  * "kernel": megamoe.ops.fp8_quant.kmajor_128x128 (one tiled Triton copy of a 128x128 block per program).

Per case: the copies alone on the preset's w13 and w2 blocks (bits compared; ms and GB/s moved, read + write),
beside the 128x128 quantizer (quantize_128x128: 2 bytes read, 1 written per element); then the FP8 layer's
forward + backward with the weights quantized at every call (fp8_weights.uncached(), where the backward makes the
K-major copies at every call): bits compared, arms interleaved (ROUNDS rounds, each starting at the next arm, ITERS
timed calls each, CUDA events, L2 flushed; median ms).
Usage: python scripts/ab_fp8_kmajor.py [CASE ...]   (default qwen3-30b-a3b:16384 deepseek-v3:8192)
"""
import statistics
import sys

import torch

import megamoe.ops.fp8_weights as fw
from megamoe import get_preset
from megamoe.bench.problem import make_problem
from megamoe.bench.routing_models import make_routing
from megamoe.bench.timing import Timer
from megamoe.functional import moe_experts
from megamoe.ops import fp8_quant

ROUNDS, ITERS = 4, 10
KERNEL = fw._kmajor_blocks
ARMS = {"torch": lambda q, s: (fw._swap_order(q), fw._swap_order(s)), "kernel": KERNEL}
BASE = "torch"


def _arm(name):
    fw._kmajor_blocks = ARMS[name]


def _median_ms(timer, fn, iters=20):
    fn()
    return statistics.median(timer.time(lambda _: fn(), iters))


def _copies(spec, timer):
    cfg = get_preset(spec.split(":")[0])
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, shape in (("w13", (E, 2 * F, D)), ("w2", (E, D, F))):
        w = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
        n = w.numel()
        tq = _median_ms(timer, lambda: fp8_quant.quantize_128x128(w))
        q, s = fp8_quant.quantize_128x128(w)
        del w
        a, b = ARMS["torch"](q, s), ARMS["kernel"](q, s)
        same = torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
        assert a[0].stride() == b[0].stride() or 1 in q.shape[-2:]
        del a, b
        tt = _median_ms(timer, lambda: ARMS["torch"](q, s))
        tk = _median_ms(timer, lambda: ARMS["kernel"](q, s))
        print(f"{spec} {label} {tuple(q.shape)}: quantize_128x128 {tq:.3f} ms ({3 * n / tq / 1e6:.0f} GB/s); "
              f"K-major copy bits equal {same}: torch {tt:.3f} ms ({2 * n / tt / 1e6:.0f} GB/s), "
              f"kernel {tk:.3f} ms ({2 * n / tk / 1e6:.0f} GB/s, {tk / tt:.3f}x)", flush=True)
        del q, s


def _layer(spec, timer):
    preset, tokens = spec.split(":")
    cfg = get_preset(preset)
    p = make_problem(spec, cfg, int(tokens), make_routing("uniform", cfg, int(tokens), 1, 0), device="cuda")
    p.shared_w13_HD = p.shared_w2_DS = None
    leaves = [p.x_TD, p.topk_weights_TK, p.w13, p.w2]

    def step():
        with fw.uncached():
            out = moe_experts(p.x_TD, p.topk_ids_TK, p.topk_weights_TK, p.w13, p.w2, backend="fused", fp8=True)
        return [out.detach(), *torch.autograd.grad(out, leaves, p.grad_out_TD)]

    _arm(BASE)
    base = [t.view(torch.int16).cpu() for t in step()]
    _arm("kernel")
    same = all(torch.equal(a, b.view(torch.int16).cpu()) for a, b in zip(base, step()))
    del base
    ms = {n: [] for n in ARMS}
    names = list(ARMS)
    for r in range(ROUNDS):
        for name in names[r % 2:] + names[:r % 2]:
            _arm(name)
            step()
            ms[name] += timer.time(lambda _: step(), ITERS)
    _arm("kernel")
    med = {n: statistics.median(v) for n, v in ms.items()}
    cols = "  ".join(f"{n} {v:.3f} ({v / med[BASE]:.3f}x)" for n, v in med.items())
    print(f"{spec} layer, weights quantized every call: bits equal {same}\n  fwd+bwd ms: {cols}", flush=True)
    del p
    torch.cuda.empty_cache()


if __name__ == "__main__":
    timer = Timer(torch.device("cuda"))
    for spec in sys.argv[1:] or ["qwen3-30b-a3b:16384", "deepseek-v3:8192"]:
        _copies(spec, timer)
        torch.cuda.empty_cache()
        _layer(spec, timer)
