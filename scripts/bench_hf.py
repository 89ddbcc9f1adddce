"""megamoe inside Hugging Face transformers on one GPU: experts implementations, the block swap, a training step.

Usage: python scripts/bench_hf.py [--json OUT.json]      (one H200: about 2 minutes)
       python scripts/bench_hf.py --tiny                  (small shapes, any device: a smoke run of this script)

Three parts, every timing the median of CUDA-event samples (megamoe.bench.timing, L2 flushed before each), the
implementations interleaved round by round; each implementation's results checked before it is timed:

1. Experts, forward + backward (gradients of x, the routing weights and both expert weights), on the router
   outputs of transformers' own block, for Qwen3-MoE at the Qwen3-30B-A3B layer shape (D 2048, F 768,
   E 128, K 8, T 16384, bf16) and a DeepSeek-V3 block (D 7168, F 2048, E 256, K 8, 8 groups keep 4, one
   shared expert, T 4096): transformers' ``eager``, ``grouped_mm`` and ``megamoe`` experts implementations
   and megamoe's own call (megamoe.functional.moe_experts) on the same tensors. Checks: ``megamoe`` gives
   bitwise the functional call's output and gradients; ``grouped_mm`` and ``eager`` agree with it to bf16
   rounding (relative rms error printed). Target: the experts implementation adds < 3% to the functional call.
2. The whole block (router + experts [+ shared expert]), forward + backward (gradients of x and every
   parameter): transformers' block with ``grouped_mm`` and with ``megamoe`` experts, and megamoe's block
   swap (megamoe.integrations.transformers.MegaMoEBlock, on the same parameters). Check: on the tokens
   whose top-k experts both routers pick alike, the swap's output matches transformers' block to bf16
   rounding (the fraction of such tokens is printed: Qwen3's router computes logits in bf16, the swap in
   fp32). Target: the swap beats the block with the ``megamoe`` experts implementation.
3. A training step (forward, backward, AdamW) of a 2-layer Qwen3-MoE model at the Qwen3-30B-A3B layer
   widths (vocab 32768, 4 sequences of 4096 tokens), in tokens/s, for ``grouped_mm``, ``megamoe`` and the
   swap (``eager`` too: slow). Check: the first step's loss agrees across them.
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import megamoe.integrations.transformers as mt
from megamoe.bench.timing import Timer, summarize
from megamoe.functional import moe_experts

BF16 = torch.bfloat16


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


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


def experts_part(label: str, block, x, timer: Timer, iters: dict, rounds: int) -> dict:
    """Part 1 on one block: the experts implementations and the functional call, on the block's routing."""
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
    errs = {}
    for name in ("megamoe", "grouped_mm", "eager"):  # (one result at a time: DeepSeek-V3's gradients are 22 GB)
        res = works[name]()
        if name == "megamoe":
            assert all(torch.equal(a, b) for a, b in zip((res[0], *res[1]), (want[0], *want[1]))), \
                f"{label}: the megamoe experts implementation differs from megamoe.functional.moe_experts"
        else:
            errs[name] = max(rel_rms(a, b) for a, b in zip((res[0], *res[1]), (want[0], *want[1])))
            assert errs[name] < 2e-2, f"{label}: {name} vs megamoe relative rms error {errs[name]:.3g}"
        del res
    del want
    stats = time_interleaved(timer, works, iters, rounds)
    overhead = stats["megamoe"].median / stats["functional"].median - 1
    print(f"\n{label} experts, fwd+bwd, ms (median [p20, p80] of n)")
    for name, s in stats.items():
        note = f"  (rel rms vs megamoe {errs[name]:.2e})" if name in errs else ""
        print(f"  {name:<11} {s.median:9.2f}  [{s.p20:.2f}, {s.p80:.2f}] n={s.n}{note}")
    print(f"  megamoe vs functional: {100 * overhead:+.1f}% (target < 3%: {'met' if overhead < 0.03 else 'MISSED'}); "
          f"grouped_mm / megamoe {stats['grouped_mm'].median / stats['megamoe'].median:.2f}x, "
          f"eager / megamoe {stats['eager'].median / stats['megamoe'].median:.1f}x")
    return {name: s.median for name, s in stats.items()} | {"overhead_vs_functional": overhead}


def block_part(label: str, block, x, timer: Timer, iters: dict, rounds: int) -> dict:
    """Part 2 on one block: transformers' block (grouped_mm, megamoe experts) vs the swapped block."""
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
    with torch.no_grad():  # the check: tokens both routers send to the same experts
        cfg._experts_implementation = "megamoe"
        want = block(x).view(-1, x.shape[-1])
        got = swapped(x).view(-1, x.shape[-1])
        hf_ids = block.gate(x.view(-1, x.shape[-1]))[2].sort(-1).values
        same = (swapped.last_stats.topk_ids_TK.sort(-1).values == hf_ids).all(-1)
    err = rel_rms(got[same], want[same])
    assert same.float().mean() > 0.9 and err < 2e-2, f"{label}: swap vs transformers' block: {err:.3g} on {same.sum()}"
    stats = time_interleaved(timer, works, iters, rounds)
    print(f"\n{label} whole block (router + experts{' + shared' if hasattr(block, 'shared_experts') else ''}), "
          f"fwd+bwd, ms; same top-k on {100 * same.float().mean():.2f}% of tokens, there rel rms {err:.2e}")
    for name, s in stats.items():
        print(f"  {name:<11} {s.median:9.2f}  [{s.p20:.2f}, {s.p80:.2f}] n={s.n}")
    gain = stats["megamoe"].median / stats["swap"].median
    print(f"  swap vs megamoe experts implementation: {gain:.2f}x (target > 1: {'met' if gain > 1 else 'MISSED'})")
    return {name: s.median for name, s in stats.items()}


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
        results[label] = {"experts": experts_part(f"{label} (T={T})", block, x, timer, iters, 3),
                          "block": block_part(f"{label} (T={T})", block, x.view(1, T, -1), timer, iters, 3)}
        del block, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["train_step_tokens_per_s"] = model_part(shapes["model_tokens"], shapes["model"], timer, device, iters, 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
