"""torch.compile over megamoe: the layer (``megamoe.MoE``), the functional entries and the transformers
experts implementation inside a compiled model.

Legend: T tokens, D hidden, F expert FFN, E experts, K top-k, S shared FFN.

Proves: ``torch.compile(..., fullgraph=True)`` traces them with no graph break (megamoe's experts, reference
experts and router logits are custom ops, megamoe.custom_ops); a training step (output, the input's and every
parameter's gradient, ``last_stats``, the bias counters) is bitwise the eager step's; a second call whose
routing differs (same shapes, new expert bias) does not recompile (``error_on_recompile``); the ops pass
``torch.library.opcheck`` (schema, fake shapes, autograd registration); bad ids and NaN logits still fail
clearly when compiled. A transformers Qwen3-MoE decoder layer with ``experts_implementation="megamoe"``, and a
whole Qwen3-MoE training step with its blocks swapped (``swap_moe_blocks``), compile fullgraph to eager's bits
too. Expert parallelism runs eagerly inside a compiled function (a graph break that fullgraph=True names).

CPU: ``backend="aot_eager"`` (torch's graph capture, eager kernels: a bitwise comparison); the fused backend under
the Triton interpreter. GPU (marked gpu): inductor with ``mode="reduce-overhead"`` (CUDA graphs) for the
functional entries and the experts module of transformers (bitwise eager), the layer with the ``cudagraphs``
backend (bitwise eager) and with inductor (which compiles the plain-PyTorch router math around megamoe's ops
into its own kernels: the same routing, outputs and gradients within two bf16 rounding steps).

Run: python -m pytest -q tests/test_compile.py
"""

import pytest
import torch

from interpreter import interpreted
from megamoe import MoE, MoEConfig
from megamoe import functional as mf
from megamoe.config import GemmConfig, KernelConfig
from megamoe.custom_ops import kernel_config_from_text, kernel_config_text


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """Tiny shapes: one CPU thread is faster than a contended pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


D = 32


def _config(dtype, hidden=D, ffn=16, shared=1):
    """Sigmoid, group-limited routing with the expert bias, a shared expert, the balance loss: every path."""
    return MoEConfig(hidden, ffn, 4, 2, "sigmoid", n_group=2, topk_group=1, n_shared_experts=shared,
                     seq_aux_loss_coef=1e-2, dtype=dtype)


def _layer_step(module, moe, x, **to):
    """Output, the input's and every parameter's gradient, last_stats and the counts added by one training step
    of ``module`` (``moe`` itself or a compiled one)."""
    x = x.clone().requires_grad_(True)
    moe.zero_grad(set_to_none=True)
    before = moe.counts_since_update_E.clone()
    if x.is_cuda:
        torch.compiler.cudagraph_mark_step_begin()  # a new training step for CUDA-graph trees
    out = module(x)
    go = torch.randn(x.shape, generator=torch.Generator(device=x.device).manual_seed(7), device=x.device)
    ((out.float() * go).sum() + moe.last_stats.aux_loss).backward()  # the output's gradient: go, in any run
    s = moe.last_stats
    got = {"out": out, "dx": x.grad, **{n: p.grad for n, p in moe.named_parameters()},
           "tokens_per_expert": s.tokens_per_expert_E, "aux_loss": s.aux_loss, "topk_ids": s.topk_ids_TK,
           "counted": moe.counts_since_update_E - before}
    return {name: t.detach().clone() for name, t in got.items()}  # CUDA-graph outputs are overwritten later


def _assert_bitwise(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g is not None and w is not None, name
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), name


def check_layer_compiles_to_eager_bits(backend: str, dtype: torch.dtype, device="cpu", compile_backend="aot_eager",
                                       hidden=D, ffn=16, fp8=False, shared=1):
    """Two training steps of a compiled MoE, each bitwise the eager step's; the second with other tokens and a
    new expert bias (other routing, same shapes) and no recompilation."""
    moe = MoE(_config(dtype, hidden, ffn, shared), backend=backend, seed=0, device=device, fp8=fp8)
    compiled = torch.compile(moe, fullgraph=True, backend=compile_backend)
    g = torch.Generator(device=device).manual_seed(1)
    x1, x2 = (torch.randn(2, 8, hidden, generator=g, device=device).to(dtype) for _ in range(2))
    _assert_bitwise(_layer_step(compiled, moe, x1), want := _layer_step(moe, moe, x1))
    moe.update_expert_bias()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _layer_step(compiled, moe, x2)
    _assert_bitwise(got, _layer_step(moe, moe, x2))
    assert not torch.equal(got["topk_ids"], want["topk_ids"])


# ---------------------------------------------------------------------------------------------------
# CPU: the reference backend and the op registrations
# ---------------------------------------------------------------------------------------------------
def test_layer_reference_compiles_fullgraph_to_eager_bits():
    check_layer_compiles_to_eager_bits("reference", torch.bfloat16)


def test_activation_checkpoint_inside_the_compiled_region_counts_once():
    """torch.utils.checkpoint around the layer inside the compiled region (the layer's statistics are set by
    the forward, not again by the compiled backward's recompute): eager's bits and counts."""
    from torch.utils.checkpoint import checkpoint

    moe = MoE(_config(torch.float32), seed=0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return checkpoint(self.moe, x, use_reentrant=False)

    block = Block()
    x = torch.randn(2, 8, D)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        got = _layer_step(torch.compile(block, fullgraph=True, backend="aot_eager"), moe, x)
    want = _layer_step(block, moe, x)
    _assert_bitwise(got, want)
    assert int(got["counted"].sum()) == x.shape[0] * x.shape[1] * moe.config.top_k


def test_kernel_config_text_round_trip():
    kc = KernelConfig({"gate_up": GemmConfig(64, 128, 64, 4, 3, tma_b=True),
                       ("wgrad", 768, 2048): GemmConfig(128, 128, 64, 8, 4, gluon=True, resident_chunks=2),
                       "wgrad": GemmConfig(64, 64, 32, 4, 2, torch_mm=True)})
    text = kernel_config_text(kc)
    assert kernel_config_from_text(text) == kc and kernel_config_from_text(text) is kernel_config_from_text(text)
    assert kernel_config_text(None) == kernel_config_text(KernelConfig()) == ""
    assert kernel_config_from_text("") == KernelConfig()


def _experts_case(T=7, D=D, F=16, E=4, K=2, S=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    w13 = (torch.randn(E, 2 * F, D, generator=g) / 8).to(dtype)
    w2 = (torch.randn(E, D, F, generator=g) / 8).to(dtype)
    s13 = (torch.randn(2 * S, D, generator=g) / 8).to(dtype)
    s2 = (torch.randn(D, S, generator=g) / 8).to(dtype)
    return [t.requires_grad_(t.is_floating_point()) for t in (x, ids, w, w13, w2, s13, s2)]


def test_reference_op_passes_opcheck():
    x, ids, w, w13, w2, s13, s2 = _experts_case()
    op = torch.ops.megamoe.moe_experts_reference
    torch.library.opcheck(op, (x, ids, w, w13, w2, s13, s2, "native"))
    torch.library.opcheck(op, (x, ids, w, w13.detach(), w2, None, None, "native"), test_utils=("test_faketensor",))
    x, ids, w, w13, w2, s13, s2 = _experts_case(T=5, D=128, F=128, S=128, dtype=torch.bfloat16)
    torch.library.opcheck(op, (x, ids, w, w13, w2, s13, s2, "fp8"),
                          test_utils=("test_faketensor", "test_autograd_registration"))
    with pytest.raises(ValueError, match="recipe must be one of"):
        op(x, ids, w, w13, w2, s13, s2, "fp16")


def test_layer_reference_fp8_compiles_fullgraph_to_eager_bits():
    """The FP8 specification (megamoe.reference.moe_experts_fp8) as the reference op with recipe "fp8"."""
    check_layer_compiles_to_eager_bits("reference", torch.bfloat16, hidden=128, ffn=128, fp8=True)


def test_compiled_functional_reference_still_refuses_bad_ids_and_nan_logits():
    x, ids, w, w13, w2, s13, s2 = _experts_case()
    f = torch.compile(lambda *a: mf.moe_experts(*a, backend="reference"), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="out of range"):
        f(x, ids + 4, w, w13, w2, s13, s2)
    moe = MoE(_config(torch.float32), seed=0)  # nan_policy "raise"
    with torch.no_grad():
        moe.router_w_ED[3, 0] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        torch.compile(moe, fullgraph=True, backend="aot_eager")(torch.randn(8, D))


# ---------------------------------------------------------------------------------------------------
# CPU: the fused backend under the Triton interpreter
# ---------------------------------------------------------------------------------------------------
@interpreted
def test_layer_fused_compiles_fullgraph_to_eager_bits():
    check_layer_compiles_to_eager_bits("fused", torch.float32)


@interpreted
def test_fused_ops_pass_opcheck_and_take_a_kernel_config():
    x, ids, w, w13, w2, s13, s2 = _experts_case()
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.megamoe.moe_experts, (x, ids, w, w13, w2, s13, s2, "", "native"),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.megamoe.router_logits, (x, w13[0].detach().requires_grad_()), test_utils=utils)
    xb, wb = (t.detach().bfloat16().requires_grad_() for t in (x, w13[0]))
    torch.library.opcheck(torch.ops.megamoe.router_logits, (xb, wb, "model"), test_utils=utils)
    scores = torch.rand(13, 16, generator=torch.Generator().manual_seed(9)).requires_grad_()
    for extra in ((None, None, 4, 1, 1, False, True, 1.0), (torch.rand(16), scores.detach() * 3, 2, 4, 2, True,
                                                            True, 2.5)):
        torch.library.opcheck(torch.ops.megamoe.topk_select, (scores, *extra), test_utils=utils)
    kc = KernelConfig({"gate_up": GemmConfig(32, 32, 32, 4, 2), ("wgrad", 64, 64): GemmConfig(32, 32, 32, 4, 2)})
    f = torch.compile(lambda *a: mf.moe_experts(*a, kernel_config=kc), fullgraph=True, backend="aot_eager")
    args = (x.detach(), ids, w.detach(), w13.detach(), w2.detach())
    assert torch.equal(f(*args), mf.moe_experts(*args, kernel_config=kc))


@interpreted
def test_model_dtype_router_logits_compile_fullgraph_to_eager_bits():
    """functional.router_logits with router_dtype="model" (bf16 x, an fp32 and a bf16 weight): one custom op whose
    fake output is bf16, no graph break, logits and both gradients bitwise eager's, a new token count without a
    graph break either."""
    g = torch.Generator().manual_seed(4)
    f = torch.compile(lambda x, w: mf.router_logits(x, w, router_dtype="model"), fullgraph=True,
                      backend="aot_eager")
    for T, w_dtype in ((13, torch.float32), (13, torch.bfloat16), (6, torch.float32)):
        x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(5, D, generator=g) * D ** -0.5).to(w_dtype).requires_grad_()
        dl = torch.randn(T, 5, generator=g).bfloat16()
        results = []
        for fn in (f, lambda x, w: mf.router_logits(x, w, router_dtype="model")):
            out = fn(x, w)
            results.append([out, *torch.autograd.grad(out, [x, w], dl)])
        assert results[0][0].dtype == torch.bfloat16 and results[0][2].dtype == w_dtype
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.slow  # ~25 s on 2 CPU cores; the FP8 ops' compile-vs-eager bits are also checked by the next test
@interpreted
def test_layer_fused_fp8_compiles_fullgraph_to_eager_bits():
    """MoE(..., fp8=True): the fused ops with recipe "fp8" (D = F = 128, the smallest FP8 sizes; no shared expert,
    whose 16-bit path the test above covers, to keep the interpreter's time short)."""
    check_layer_compiles_to_eager_bits("fused", torch.bfloat16, hidden=128, ffn=128, fp8=True, shared=0)


@interpreted
def test_fused_fp8_ops_quantize_the_weights_themselves_and_give_eager_bits(monkeypatch):
    """The ops keep no tensor beyond their outputs: the forward op quantizes the weights itself (the process-wide
    cache is neither read nor written) and returns their blocks, which the backward op takes instead of quantizing
    again (one quantization per weight per step); eager's output and gradients bit for bit."""
    from megamoe.ops import fp8_quant
    from megamoe.ops.fp8_weights import WEIGHT_CACHE

    x, ids, w, w13, w2 = leaves = _experts_case(T=4, D=128, F=128, dtype=torch.bfloat16)[:5]
    # the fake implementation's fp8 outputs (gu in x's dtype, the four weight blocks), their schema (no output
    # aliases an input) and the autograd registration (the blocks non-differentiable)
    torch.library.opcheck(torch.ops.megamoe.moe_experts, (*leaves, None, None, "", "fp8"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    f = torch.compile(lambda *a: mf.moe_experts(*a, fp8=True), fullgraph=True, backend="aot_eager")
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.dtype)
    wanted = [t for t in leaves if t.requires_grad]
    out = mf.moe_experts(*leaves, fp8=True)
    want = [out, *torch.autograd.grad(out, wanted, dout)]
    WEIGHT_CACHE.clear()
    lookups = WEIGHT_CACHE.hits + WEIGHT_CACHE.misses
    f(*leaves)  # compiled (traced with the fake implementations) before the counted step
    quantized = []
    real = fp8_quant.quantize_128x128
    monkeypatch.setattr(fp8_quant, "quantize_128x128", lambda w, **kw: quantized.append(w.shape) or real(w, **kw))
    out = f(*leaves)
    got = [out, *torch.autograd.grad(out, wanted, dout)]
    assert WEIGHT_CACHE.hits + WEIGHT_CACHE.misses == lookups and len(WEIGHT_CACHE) == 0
    assert quantized == [w13.shape, w2.shape], quantized  # the forward op's only
    for g, wt in zip(got, want):
        assert g.dtype == wt.dtype and torch.equal(g, wt)


# ---------------------------------------------------------------------------------------------------
# CPU: transformers' Qwen3-MoE decoder layer with megamoe's experts implementation, and with the block swap
# ---------------------------------------------------------------------------------------------------
def _qwen3(device="cpu", dtype=torch.float32, swap=False, layers=1):
    """A tiny Qwen3-MoE causal LM with the "megamoe" experts implementation (or its MoE blocks swapped)."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    import megamoe.integrations.transformers as mt

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, experts_implementation="megamoe",
        attn_implementation="eager")  # deterministic attention backward on the GPU too
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(device=device, dtype=dtype)
    if swap:
        mt.swap_moe_blocks(model)
    return model


def _decoder_step(fn, layer, rotary, x):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    pos = torch.arange(x.shape[1], device=x.device)[None]
    out = fn(x, position_embeddings=rotary(x, pos), attention_mask=None, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().sum().backward()
    got = {"out": out, "dx": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return {name: t.detach().clone() for name, t in got.items()}


def _model_step(fn, model, ids):
    model.zero_grad(set_to_none=True)
    out = fn(input_ids=ids, labels=ids)
    out.loss.backward()
    got = {"loss": out.loss, "logits": out.logits, **{n: p.grad for n, p in model.named_parameters()}}
    return {name: t.detach().clone() for name, t in got.items()}


def test_transformers_decoder_layer_compiles_fullgraph_to_eager_bits():
    """A Qwen3-MoE decoder layer with experts_implementation="megamoe" (its experts on megamoe's reference op)."""
    model = _qwen3()
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    _assert_bitwise(_decoder_step(compiled, layer, rotary, x1), _decoder_step(layer, layer, rotary, x1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _decoder_step(compiled, layer, rotary, x2)
    _assert_bitwise(got, _decoder_step(layer, layer, rotary, x2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_model_with_swapped_blocks_compiles_fullgraph_to_eager_bits(dtype):
    """A whole 2-layer Qwen3-MoE training step (loss, logits, every parameter gradient) with its MoE blocks
    swapped for megamoe's (in bf16, the router's logits in bf16, Qwen3-MoE's router_dtype "model"). (transformers'
    own output capturing, ``output_router_logits=True``, breaks the graph whatever the experts implementation, so
    it is off here.)"""
    model = _qwen3(dtype=dtype, swap=True, layers=2)
    assert all(type(layer.mlp).__name__ == "MegaMoEBlock" for layer in model.model.layers)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    ids1, ids2 = torch.randint(3, 96, (2, 12), generator=g), torch.randint(3, 96, (2, 12), generator=g)
    _assert_bitwise(_model_step(compiled, model, ids1), _model_step(model, model, ids1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _model_step(compiled, model, ids2)
    _assert_bitwise(got, _model_step(model, model, ids2))


# ---------------------------------------------------------------------------------------------------
# GPU: inductor and CUDA graphs
# ---------------------------------------------------------------------------------------------------
def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_functional_reduce_overhead_gives_eager_bits_gpu(fp8):
    """moe_experts (routed + shared; 16-bit and FP8) and router_logits (fp32 and model dtype) under inductor with
    CUDA graphs: forward and every gradient bitwise eager's, three routings (random, half the experts empty, all on
    one expert) without a recompilation."""
    T, D, F, E, K, S = 256, 256, 128, 16, 4, 128
    bf16, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=1.0, dtype=bf16):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype).requires_grad_()

    x, w13, w2 = rand(T, D), rand(E, 2 * F, D, scale=D ** -0.5), rand(E, D, F, scale=F ** -0.5)
    s13, s2, router_w = rand(2 * S, D, scale=D ** -0.5), rand(D, S, scale=S ** -0.5), rand(E, D, dtype=torch.float32)
    # x once per call (three leaves of the same values): with one x its three bf16 gradients would be summed, in
    # bf16 after each add by eager autograd and in fp32 with one rounding by inductor's fused add, which is
    # inductor's rounding, not megamoe's
    x_l, x_r, x_m = x, x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    leaves = (x_l, x_r, x_m, w13, w2, s13, s2, router_w)

    def f(x_l, x_r, x_m, ids, w, w13, w2, s13, s2, router_w):
        return (mf.moe_experts(x_l, ids, w, w13, w2, s13, s2, fp8=fp8), mf.router_logits(x_r, router_w),
                mf.router_logits(x_m, router_w, router_dtype="model"))

    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    routings = [torch.randint(0, E, (T, K), generator=g, device=dev),
                torch.randint(0, E // 2, (T, K), generator=g, device=dev),
                torch.full((T, K), 3, device=dev)]
    for i, ids in enumerate(routings):
        w = torch.rand(T, K, generator=g, device=dev).requires_grad_()
        go, gl = torch.randn(T, D, generator=g, device=dev).to(bf16), torch.randn(T, E, generator=g, device=dev)
        results = []
        for fn in (compiled, f):
            torch.compiler.cudagraph_mark_step_begin()
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out, logits, logits_bf16 = fn(*leaves[:3], ids, w, *leaves[3:])
            grads = torch.autograd.grad((out, logits, logits_bf16), (*leaves, w), (go, gl, gl.to(bf16)))
            results.append([out.clone(), logits.clone(), logits_bf16.clone(), *(gr.clone() for gr in grads)])
        names = ["out", "logits", "logits_bf16", "dx_l", "dx_r", "dx_m", "dw13", "dw2", "ds13", "ds2", "drouter_w",
                 "dw"]
        assert len(names) == len(results[0])
        assert all(torch.equal(a, b) for a, b in zip(*results)), \
            (i, [n for n, a, b in zip(names, *results) if not torch.equal(a, b)])
    assert _cudagraph_skips() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_layer_cuda_graphs_give_eager_bits_gpu(fp8):
    """The fused MoE layer compiled with the cudagraphs backend (graph capture of eager kernels, forward and
    backward replayed from CUDA graphs): two training steps bitwise eager's, no recompilation."""
    hidden, ffn = (128, 128) if fp8 else (64, 32)  # FP8: multiples of 128
    check_layer_compiles_to_eager_bits("fused", torch.bfloat16, device="cuda", compile_backend="cudagraphs",
                                       hidden=hidden, ffn=ffn, fp8=fp8)
    assert _cudagraph_skips() == 0


def check_layer_under_inductor(backend: str, device: str, hidden: int, ffn: int, **compile_kw):
    """A bf16 MoE under inductor: inductor compiles the router's plain-PyTorch math into its own kernels (their
    fp32 rounding may differ from eager's by an ulp), megamoe's ops run as they are. Three training steps with
    new tokens and expert bias, no recompilation; each with eager's routing and counts, and outputs and gradients
    within two bf16 rounding steps of the largest entry (a routing weight an fp32 ulp off moves a bf16 result by
    at most one rounding step; the output's gradient is the same fixed tensor in both runs)."""
    moe = MoE(_config(torch.bfloat16, hidden, ffn), backend=backend, seed=0, device=device)
    compiled = torch.compile(moe, fullgraph=True, **compile_kw)
    g = torch.Generator(device=device).manual_seed(1)
    for i in range(3):
        x = torch.randn(2, 8, hidden, generator=g, device=device).to(torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _layer_step(compiled, moe, x)
        want = _layer_step(moe, moe, x)
        for name in ("topk_ids", "tokens_per_expert", "counted"):
            assert torch.equal(got[name], want[name]), name
        for name, w in want.items():
            tol = 2 * 2 ** -8 * w.float().abs().max().item() + 1e-6
            assert (got[name].float() - w.float()).abs().max().item() <= tol, name
        moe.update_expert_bias()


@pytest.mark.slow
def test_layer_reference_under_inductor_on_cpu():
    """Inductor's CPU code generation around megamoe's reference op (about half a minute of C++ compilation)."""
    check_layer_under_inductor("reference", "cpu", D, 16)


@pytest.mark.gpu
def test_layer_inductor_reduce_overhead_gpu():
    """The fused layer under inductor with CUDA graphs (check_layer_under_inductor), nothing left uncaptured."""
    check_layer_under_inductor("fused", "cuda", 64, 32, mode="reduce-overhead")
    assert _cudagraph_skips() == 0


@pytest.mark.gpu
def test_transformers_experts_reduce_overhead_gives_eager_bits_gpu():
    """transformers' Qwen3-MoE experts module with the "megamoe" implementation (fused kernels) under inductor with
    CUDA graphs, bitwise eager's; the whole decoder layer with the cudagraphs backend, bitwise eager's."""
    model = _qwen3(device="cuda", dtype=torch.bfloat16)
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    experts = layer.mlp.experts
    T, K, E = 64, 2, 8
    g = torch.Generator(device="cuda").manual_seed(3)
    compiled = torch.compile(experts, fullgraph=True, mode="reduce-overhead")
    for i in range(2):
        x = torch.randn(T, 64, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
        ids = torch.randint(0, E, (T, K), generator=g, device="cuda")
        w = torch.rand(T, K, generator=g, device="cuda").requires_grad_()
        go = torch.randn(T, 64, generator=g, device="cuda").to(torch.bfloat16)
        results = []
        for fn in (compiled, experts):
            torch.compiler.cudagraph_mark_step_begin()
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = fn(x, ids, w)
            grads = torch.autograd.grad(out, (x, w, experts.gate_up_proj, experts.down_proj), go)
            results.append([out.clone(), *(gr.clone() for gr in grads)])
        for got, want in zip(*results):
            assert torch.equal(got, want)
    assert _cudagraph_skips() == 0
    torch._dynamo.reset()
    compiled_layer = torch.compile(layer, fullgraph=True, backend="cudagraphs")
    x = torch.randn(2, 16, 64, generator=g, device="cuda").to(torch.bfloat16)
    torch.compiler.cudagraph_mark_step_begin()
    _assert_bitwise(_decoder_step(compiled_layer, layer, rotary, x), _decoder_step(layer, layer, rotary, x))


# ---------------------------------------------------------------------------------------------------
# CPU: expert parallelism runs eagerly inside a compiled function (a graph break)
# ---------------------------------------------------------------------------------------------------
def _ep_worker(rank, W, buffers, spec_args, T, K, E, F):
    from megamoe.distributed import EPWorkspace, WorkspaceSpec
    from megamoe.functional_ep import moe_experts_ep_workspace

    spec = WorkspaceSpec(*spec_args)
    ws = EPWorkspace.from_shared_buffers(spec, rank, buffers)
    g = torch.Generator().manual_seed(rank)
    L = E // W
    leaves = [torch.randn(T, spec.hidden, generator=g), torch.rand(T, K, generator=g),
              torch.randn(L, 2 * F, spec.hidden, generator=g) / 8, torch.randn(L, spec.hidden, F, generator=g) / 8]
    ids = torch.randint(0, E, (T, K), generator=g)

    def f(x, w, w13, w2):
        return moe_experts_ep_workspace(x * 2, ids, w, w13, w2, workspace=ws, timeout_s=60) + 1

    with pytest.raises(torch._dynamo.exc.Unsupported, match="expert parallelism"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    return torch.equal(torch.compile(f, backend="aot_eager")(*leaves), f(*leaves))


def test_expert_parallelism_runs_eagerly_inside_a_compiled_function():
    """moe_experts_ep inside torch.compile: a graph break around it, eager's bits on each of 2 simulated ranks
    (Triton interpreter, shared-memory workspace; forward only: the backward of a graph break is eager
    autograd); fullgraph=True names the reason."""
    from ep_utils import spawn_ranks
    from megamoe.distributed import EPWorkspace, WorkspaceSpec

    W, T, K, E, F = 2, 4, 2, 4, 16
    spec = WorkspaceSpec(W, T, D, K, E, torch.float32)
    assert spawn_ranks(_ep_worker, W, EPWorkspace.allocate_shared(spec), (W, T, D, K, E, torch.float32), T, K, E, F,
                       env={"TRITON_INTERPRET": "1"}) == [True, True]
