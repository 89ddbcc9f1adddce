"""megamoe inside Hugging Face transformers, against transformers itself: the "megamoe" experts
implementation and the whole-block swap (megamoe.integrations.transformers), on tiny randomly initialised
models of each family built from its config class (no downloads).

Proves: logits and every parameter gradient of a training step (cross-entropy on the model's own
labels) with "megamoe", and with the block swap, are within 2x transformers' own bf16 error of an fp64
eager run of the same model on the same inputs (the error of eager bf16 vs eager fp64, + a tiny absolute
term), for Qwen3-MoE, DeepSeek-V3, GLM-4.5 (Glm4Moe) and Mixtral: on CPU through megamoe's reference
path, on a GPU (tests marked gpu) through the fused kernels; eval / generate without gradients; the
model's own parameter tensors reach megamoe (no copies); state_dict keys and tensors unchanged by the
swap, and save_pretrained / from_pretrained round trips; the swap's router logits are eager's (in the family's
dtype: bf16 for Qwen3-MoE and Mixtral, fp32 for DeepSeek-V3 and GLM-4.5; bitwise on CPU) and every token gets
eager's top-k experts but for exact ties; router hooks (transformers' router_logits and load-balancing loss) still
fed, with eager's bits on CPU; the aux-loss-free bias update, counted once under gradient
checkpointing; families and modules megamoe cannot run exactly (GPT-OSS, other activations, non-gated
experts, post-expert norms, transformers' expert parallelism, quantized experts, router jitter, adapters
on the shared expert) refused with an error naming the reason. GPU (fused kernels): bitwise
reproducible steps, generation, the experts implementation giving the functional call's bits, and the swap's
router logits within one rounding step of eager's, routing alike but for near-ties.

Run: python -m pytest -q tests/test_hf_integration.py   (skipped without transformers >= 5)
"""

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")

import megamoe.integrations.transformers as mt  # noqa: E402 - after the skip: it needs transformers
from interpreter import interpreted  # noqa: E402
from megamoe import reference as ref  # noqa: E402

BF16, F64 = torch.bfloat16, torch.float64
_COMMON = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1,
           "eos_token_id": 2}
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# family: (config class, model class, tiny sizes). One MoE layer, after a dense layer where the family has one
# (Mixtral: one layer): so the router sees the same bf16 input in every bf16 run, and a token whose top-k
# scores tie within bf16 rounding (~1% of token-layers) is routed alike by eager and by megamoe's experts
# implementation; behind a first MoE layer, its rounding differences could send such a token to another
# expert in one run only, an O(1) difference no tolerance should absorb.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"intermediate_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                   "num_experts_per_tok": 2, "norm_topk_prob": True, "head_dim": 16, "mlp_only_layers": [0]}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                     "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16,
                     "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "rope_parameters": _ROPE,
                     "num_key_value_heads": 4}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"intermediate_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8,
                  "num_experts_per_tok": 2, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                  "first_k_dense_replace": 1, "head_dim": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 16,
                 "num_hidden_layers": 1}),
}


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """Tiny shapes: one CPU thread is ~10x faster than a contended pool (and keeps CPU results reproducible)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(family: str, *, seed: int = 0, **overrides):
    """A tiny fp32 causal LM of ``family`` with random weights; the router's correction bias (if any) random
    too, so that the selection bias is exercised."""
    cfg_name, model_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float()
    with torch.no_grad():
        for mod in model.modules():
            if getattr(mod, "e_score_correction_bias", None) is not None:
                mod.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model


def variant(model, dtype, how: str):
    """A copy of ``model`` in ``dtype`` running its experts with ``how``: an experts implementation
    ("eager", "megamoe") or "swap" (eager experts, MoE blocks swapped for megamoe's)."""
    m = copy.deepcopy(model).to(dtype)
    m.set_experts_implementation("eager" if how == "swap" else how)
    if how == "swap":
        mt.swap_moe_blocks(m)
    return m


def train_step(model, ids):
    """Logits and every parameter gradient (fp64 copies) of one cross-entropy step on ``ids``."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), grads


def assert_within_torch_error(name, got, ours_pt, ref64):
    """got (megamoe bf16) vs ref64 within 2x eager bf16's own error vs ref64 (max abs and relative rms)."""
    assert got.shape == ref64.shape and torch.isfinite(got).all(), name
    err, err_pt = (got - ref64).abs().max().item(), (ours_pt - ref64).abs().max().item()
    scale = ref64.abs().max().item()
    assert err <= 2 * err_pt + 1e-3 * scale + 1e-6, \
        f"{name}: err {err:.3g} vs eager bf16 {err_pt:.3g} (max {scale:.3g})"
    norm = ref64.norm().clamp_min(1e-30)
    rel, rel_pt = ((got - ref64).norm() / norm).item(), ((ours_pt - ref64).norm() / norm).item()
    assert rel <= 2 * rel_pt + 1e-4, f"{name}: rel rms {rel:.3g} vs eager bf16 {rel_pt:.3g}"


def check_against_eager(model, how, ids, eager=None):
    """``how`` in bf16 vs eager fp64, within 2x eager bf16's error; ``eager``: the two eager steps, if known."""
    (ref_logits, ref_grads), (pt_logits, pt_grads) = eager or eager_steps(model, ids)
    logits, grads = train_step(variant(model, BF16, how), ids)
    assert set(grads) == set(ref_grads), "gradients must reach the same parameters"
    assert_within_torch_error("logits", logits, pt_logits, ref_logits)
    for name in ref_grads:
        assert_within_torch_error(name, grads[name], pt_grads[name], ref_grads[name])


def eager_steps(model, ids):
    """transformers' eager experts: the fp64 reference step and the bf16 step (its own error)."""
    return train_step(variant(model, F64, "eager"), ids), train_step(variant(model, BF16, "eager"), ids)


@functools.cache
def cpu_case(family):
    model = build(family)
    ids = torch.randint(3, _COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    return model, ids, eager_steps(model, ids)


@pytest.mark.parametrize("how", ["megamoe", "swap"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_step_matches_eager(family, how):
    model, ids, eager = cpu_case(family)
    check_against_eager(model, how, ids, eager)


@pytest.mark.parametrize("how", ["megamoe", "swap"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_eval_and_generate_without_gradients(family, how):
    model = build(family)
    ids = torch.randint(3, _COMMON["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(2))
    want = variant(model, torch.float32, "eager").eval().generate(ids, max_new_tokens=4, do_sample=False)
    m = variant(model, torch.float32, how).eval()
    with torch.no_grad():
        assert torch.isfinite(m(ids).logits).all()
    assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False), want)
    with torch.inference_mode():
        m(ids)
    if how == "swap":  # eval forwards do not count towards the bias update
        assert all(int(b.counts_since_update_E.sum()) == 0 for b in m.modules() if isinstance(b, mt.MegaMoEBlock))


def test_register_is_idempotent_and_selectable_at_construction():
    from transformers.integrations.moe import ExpertsInterface
    assert mt.register() == mt.register() == "megamoe"
    assert ExpertsInterface._global_mapping["megamoe"] is mt.experts_forward
    cfg_name, model_name, kw = FAMILIES["qwen3_moe"]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **kw}, experts_implementation="megamoe")
    model = getattr(transformers, model_name)(cfg)
    assert model.config._experts_implementation == "megamoe"


def test_experts_get_the_model_parameters_without_copies(monkeypatch):
    model = variant(build("deepseek_v3"), BF16, "megamoe")
    seen = []

    def spy(x, ids, w, w13, w2, *shared, backend):
        seen.append((w13, w2, backend))
        return ref.moe_experts(x, ids, w, w13, w2, *shared)

    monkeypatch.setattr(mt, "moe_experts", spy)
    model(torch.randint(3, 96, (1, 6)))
    experts = [m for m in model.modules() if type(m).__name__ == "DeepseekV3Experts"]
    assert len(seen) == len(experts) == 1
    for (w13, w2, backend), e in zip(seen, experts):
        assert w13 is e.gate_up_proj and w2 is e.down_proj and backend == "reference"


def test_swap_keeps_state_dict_parameters_and_loads_checkpoints():
    model = build("deepseek_v3")
    before = model.state_dict()
    params = dict(model.named_parameters())
    names = mt.swap_moe_blocks(model)
    assert names == ["model.layers.1.mlp"]
    assert all(isinstance(model.get_submodule(n), mt.MegaMoEBlock) for n in names)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == before[k].data_ptr() for k in before)
    assert dict(model.named_parameters()) == params
    fresh = build("deepseek_v3", seed=5)
    mt.swap_moe_blocks(fresh)
    fresh.load_state_dict(before)  # strict: same keys
    assert all(torch.equal(fresh.state_dict()[k], before[k]) for k in before)
    assert mt.swap_moe_blocks(model) == []  # already swapped: nothing to do
    with pytest.raises(mt.UnsupportedModelError, match="no MoE block"):
        mt.swap_moe_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_swap_save_pretrained_round_trip(family, tmp_path):
    """save_pretrained from a swapped model, from_pretrained into a plain and into a swapped one (Mixtral's
    checkpoints go through transformers' weight conversion)."""
    model = build(family)
    mt.swap_moe_blocks(model)
    model.save_pretrained(tmp_path)
    want = model.state_dict()
    plain = type(model).from_pretrained(tmp_path)
    swapped = type(model).from_pretrained(tmp_path)
    mt.swap_moe_blocks(swapped)
    for loaded in (plain, swapped):
        got = loaded.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def _moe_block(model):
    return next(m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module))


def _megamoe_by_hand(block, x, backend):
    """megamoe's own calls on a transformers block's tensors, written out: the function MegaMoEBlock computes."""
    from megamoe.functional import moe_experts, router_logits, topk_select
    x_TD, w_ED, cfg = x.reshape(-1, x.shape[-1]), block.gate.weight, mt.moe_config_of(block)
    if backend == "fused":
        logits_TE = router_logits(x_TD, w_ED, router_dtype=cfg.router_dtype)
    else:
        logits_TE = ref.router_logits(x_TD, w_ED, cfg.router_dtype)
    r = ref.route(x_TD, w_ED, getattr(block.gate, "e_score_correction_bias", None), cfg, logits_TE=logits_TE,
                  select=topk_select if backend == "fused" else None)  # the fused selection kernel, as the swap
    sh = getattr(block, "shared_experts", None)
    shared = () if sh is None else (torch.cat([sh.gate_proj.weight, sh.up_proj.weight]), sh.down_proj.weight)
    out = moe_experts(x_TD, r.topk_ids_TK, r.topk_weights_TK, block.experts.gate_up_proj, block.experts.down_proj,
                      *shared, backend=backend)
    return out.view(x.shape), r


def check_swap_is_megamoe_bitwise(block, backend, monkeypatch):
    """The swapped block's output and every gradient are bitwise megamoe's own calls written out, its routing
    (ids, weights) bitwise megamoe's, and the experts' call gets the ids contiguous (no copy of its own) and
    unchecked (route's ids are in range; no device work for the check); on a GPU, forward and backward make no
    host sync."""
    swapped = mt.MegaMoEBlock(block, backend=backend)
    dev, D = block.experts.gate_up_proj.device, block.experts.gate_up_proj.shape[2]
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(2, 40, D, generator=g, device=dev).to(BF16).requires_grad_()
    dout = torch.randn(x.shape, generator=g, device=dev).to(BF16)
    inputs = [x, *swapped.parameters()]
    seen, real = [], mt.moe_experts
    monkeypatch.setattr(mt, "moe_experts", lambda *a, **kw: seen.append((a[1].is_contiguous(), kw["check_ids"]))
                        or real(*a, **kw))
    if dev.type == "cuda":  # on the fused kernels the whole step runs without a host sync: any sync raises here
        swapped(x)  # (the first call compiles and loads kernels)
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = swapped(x)
        got_grads = torch.autograd.grad(got, inputs, dout)
    finally:
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.undo()
    seen = seen[-1:]
    want, r = _megamoe_by_hand(block, x, backend)
    want_grads = torch.autograd.grad(want, inputs, dout)
    assert seen == [(True, False)]
    assert torch.equal(got, want)
    names = ["x", *(n for n, _ in swapped.named_parameters())]
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads)), \
        [n for n, a, b in zip(names, got_grads, want_grads) if not torch.equal(a, b)]
    logits_TE, r2 = swapped.route(x.detach().reshape(-1, D))
    assert r2.topk_ids_TK.is_contiguous() and logits_TE.dtype == _router_dtype(block)
    assert torch.equal(r2.topk_ids_TK, r.topk_ids_TK) and torch.equal(r2.topk_weights_TK, r.topk_weights_TK)
    assert torch.equal(swapped.last_stats.topk_ids_TK, r.topk_ids_TK)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_swap_is_megamoe_route_and_experts_bitwise(family, monkeypatch):
    check_swap_is_megamoe_bitwise(_moe_block(build(family)).to(BF16), "reference", monkeypatch)


@interpreted
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_swap_is_megamoe_route_and_experts_bitwise_fused_interpreted(family, monkeypatch):
    """The same on the fused kernels under the Triton interpreter: the router GEMMs, the fused top-k selection
    (megamoe.functional.topk_select, whose backward has bits of its own) and the experts."""
    check_swap_is_megamoe_bitwise(_moe_block(build(family)).to(BF16), "fused", monkeypatch)


def _bench_hf():
    """scripts/bench_hf.py as a module (its helpers are tested here; the script itself needs a GPU for its shapes)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_hf.py"
    spec = importlib.util.spec_from_file_location("bench_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_rel_rms_in_blocks_is_the_fp64_formula():
    """bench_hf's accuracy check sums in fp32 blocks (no full-size fp64 copies of 22 GB of gradients): the same
    relative rms error as the fp64 formula, whatever the block size."""
    bench = _bench_hf()
    g = torch.Generator().manual_seed(3)
    want = torch.randn(37, 129, generator=g).to(BF16)
    got = (want.float() + 1e-2 * torch.randn(want.shape, generator=g)).to(BF16)
    exact = ((got.double() - want.double()).norm() / want.double().norm()).item()
    for chunk in (7, 100, 4773, 1 << 24):
        assert bench.rel_rms(got, want, chunk=chunk) == pytest.approx(exact, rel=1e-5)
    assert bench.rel_rms(want, want, chunk=100) == 0.0


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])  # the router in fp32 / in the model dtype
def test_bench_profile_parts_run_on_cpu(family, tmp_path):
    """bench_hf --profile's block timing with the what-if swap, routers-alone timing and the block's op table, at
    a tiny shape on the CPU; the what-if's logits are the swap's (the same dtype, here the same bits). DeepSeek-V3's
    router weight stays fp32, as transformers creates it and the benchmark builds it."""
    bench = _bench_hf()
    block = _moe_block(build(family)).to(BF16)
    if family == "deepseek_v3":
        block.gate.weight = torch.nn.Parameter(block.gate.weight.detach().float())
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(4)).to(BF16).requires_grad_()
    x_TD = x.detach().view(-1, 64)
    assert torch.equal(bench.CublasLogitsSwap(block).route(x_TD)[0], mt.MegaMoEBlock(block).route(x_TD)[0])
    timer = bench.Timer(torch.device("cpu"))
    times = bench.router_part(family, block, x, timer, rounds=1)
    assert {"transformers router", "swap router", "logits GEMM", "cuBLAS logits + routing", "routing"} <= set(times)
    medians = bench.block_part(family, block, x, timer, dict.fromkeys(("grouped_mm", "megamoe", "swap"), 1), 1, True)
    assert set(medians) == {"grouped_mm", "megamoe", "swap", "swap, cuBLAS logits (what-if)"}
    totals = bench.profile_part(f"{family} tiny", block, x, str(tmp_path), steps=1)
    assert set(totals) == {"megamoe", "swap"} and all(t["wall_ms"] >= t["host_ms"] > 0 for t in totals.values())
    assert (tmp_path / f"{family}_kernels.txt").read_text().startswith(f"{family} tiny:")


@interpreted
@pytest.mark.parametrize("family, mode", [("qwen3_moe", "model"), ("deepseek_v3", "fp32")])
def test_bench_router_tile_sweep_runs_interpreted(monkeypatch, family, mode):
    """bench_hf --profile's sweep of the swap router's three GEMMs in the family's router dtype (Qwen3-MoE: the
    model dtype, bf16; DeepSeek-V3: fp32 as bf16 GEMMs of exact pieces, beside the IEEE fp32 GEMMs) runs every
    tile and compares its bits with the table's (the interpreter keeps its own tile for 16-bit GEMMs, so all agree;
    the IEEE GEMMs may differ), and for fp32 each result's error against fp64, within fp32's. Each timing runs
    its work once here."""
    import types

    bench = _bench_hf()
    monkeypatch.setattr(bench, "time_interleaved", lambda timer, works, iters, rounds: {
        name: types.SimpleNamespace(median=float(bool(fn() is not None))) for name, fn in works.items()})
    block = _moe_block(build(family)).to(BF16)
    assert mt.moe_config_of(block).router_dtype == mode
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).to(BF16)
    rows = bench.router_tile_sweep(family, block, x, bench.Timer(torch.device("cpu")), rounds=1)
    kinds = {"logits x @ W.T": "m", "dx dlogits @ W": "m", "dW dlogits.T @ x": "k"}
    assert set(rows) == set(kinds) | ({"cublas"} if mode == "fp32" else set())
    for gemm, kind in kinds.items():
        row = rows[gemm]
        assert len(row) == len(bench._ROUTER_TILES[mode][kind]), (gemm, row)
        assert all((r["same_bits"] or r["tile"] == "ieee") and r["ms"] == 1.0 for r in row), (gemm, row)
        if mode == "fp32":  # dx and (the gate weight is bf16 here) dW are rounded to bf16 once, the logits are fp32
            assert all(r["max_err"] < (1e-4 if gemm.startswith("logits") else 0.1) for r in row), (gemm, row)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_swap_feeds_router_logits_and_aux_loss(dtype):
    """transformers records the swap's router logits (through the gate's forward hooks) and computes its
    load-balancing loss from them: on CPU eager's bits and dtype (Qwen3-MoE's logits are in the model dtype)."""
    model = build("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.01)
    ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    want = variant(model, dtype, "eager")(input_ids=ids, labels=ids)
    got = variant(model, dtype, "swap")(input_ids=ids, labels=ids)
    assert len(got.router_logits) == len(want.router_logits) == 1
    for a, b in zip(got.router_logits, want.router_logits):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)
    assert torch.equal(got.aux_loss, want.aux_loss)


def _router_dtype(block) -> torch.dtype:
    """The dtype transformers' router of ``block`` computes its logits in: the model's for Qwen3-MoE and Mixtral,
    fp32 for DeepSeek-V3 and GLM-4.5."""
    fp32 = type(block).__name__ in ("DeepseekV3MoE", "Glm4MoeMoE")
    return torch.float32 if fp32 else block.experts.gate_up_proj.dtype


def _gate_outputs(model, ids):
    """(logits [T, E], top-k ids [T, K]) that the MoE block's router hands its forward hooks in a forward of
    ``ids`` without gradients (transformers' router, or the swapped block's)."""
    seen = []
    handle = _moe_block(model).gate.register_forward_hook(lambda m, a, out: seen.append((out[0], out[2])))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    return seen[-1]


def check_swap_routes_like_eager(family, model, ids, exact: bool):
    """The swap's router logits against eager's in the same dtype (the family's: MoEConfig.router_dtype), and its
    top-k experts on every token; returns which tokens got eager's top-k. ``exact`` (CPU, the reference path:
    transformers' own ``F.linear``): the logits are eager's bits, and the top-k sets differ only where eager's K-th
    and (K+1)-th logits tie exactly, where megamoe takes the lower id (softmax routers: the stable top-k of the
    logits; torch.topk leaves the choice unspecified). Otherwise (the fused kernels, another accumulation order
    than cuBLAS): logits within one rounding step of their dtype, top-k sets equal except where the K-th and
    (K+1)-th logits are within two such steps."""
    eager = variant(model, model.dtype, "eager")
    want_logits, want_ids = _gate_outputs(eager, ids)
    got_logits, got_ids = _gate_outputs(variant(model, model.dtype, "swap"), ids)
    assert got_logits.dtype == want_logits.dtype == _router_dtype(_moe_block(eager))
    got, want = got_logits.float(), want_logits.float()
    # one bf16 ulp at the token's largest logit; for fp32 logits, an accumulation-order difference over D terms
    step = 0.0 if exact else (2.0 ** -7 if want_logits.dtype == BF16 else 2.0 ** -14) * want.abs().amax(-1)
    assert ((got - want).abs() <= step[:, None] if not exact else got == want).all()
    K = want_ids.shape[1]
    top = want.sort(-1, descending=True).values
    near_tie = top[:, K - 1] - top[:, K] <= 2 * step
    same = (got_ids.sort(-1).values == want_ids.sort(-1).values).all(-1)
    assert (same | near_tie).all(), f"{family}: {int((~same & ~near_tie).sum())} tokens routed differently"
    if exact and family in ("qwen3_moe", "mixtral"):
        stable = got.sort(dim=-1, descending=True, stable=True).indices[:, :K]
        assert torch.equal(got_ids.sort(-1).values, stable.sort(-1).values)
    return same


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swap_router_logits_are_eagers_and_route_alike(family):
    """bf16, 512 tokens, the reference path (CPU): the swapped block's router logits are eager's bits, in the
    family's dtype (Qwen3-MoE and Mixtral: bf16, as their routers' ``F.linear`` in the model dtype; DeepSeek-V3 and
    GLM-4.5: fp32), and each token gets eager's top-k experts, but for exact ties of the K-th logit."""
    ids = torch.randint(3, 96, (8, 64), generator=torch.Generator().manual_seed(1))
    same = check_swap_routes_like_eager(family, build(family).to(BF16), ids, exact=True)
    assert same.float().mean() > 0.99


def test_swap_stats_and_expert_bias_update():
    model = variant(build("deepseek_v3"), torch.float32, "swap")
    block = model.model.layers[1].mlp
    bias0 = block.gate.e_score_correction_bias.clone()
    ids = torch.randint(3, 96, (2, 8))
    model(ids)
    model(ids)
    counts = block.counts_since_update_E.clone()
    assert int(counts.sum()) == 2 * ids.numel() * block.moe_config.top_k
    assert torch.equal(block.last_stats.tokens_per_expert_E * 2, counts)
    block.update_expert_bias()
    assert torch.equal(block.gate.e_score_correction_bias, ref.update_expert_bias_(bias0, counts, 1e-3))
    assert int(block.counts_since_update_E.sum()) == 0
    # reentrant checkpointing runs the whole block again in the backward (non-reentrant may stop early): counted once
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25 (the older name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model(input_ids=ids, labels=ids).loss.backward()
    assert block.gate.weight.grad is not None
    assert int(block.counts_since_update_E.sum()) == ids.numel() * block.moe_config.top_k


def test_refuses_gpt_oss_naming_each_reason():
    cfg = transformers.GptOssConfig(**{**_COMMON, "num_key_value_heads": 2}, intermediate_size=32, num_local_experts=4,
                                    num_experts_per_tok=2, head_dim=16, layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(cfg)
    model.set_experts_implementation("megamoe")
    with pytest.raises(mt.UnsupportedModelError, match="GptOssExperts") as exc:
        model(torch.randint(3, 96, (1, 4)))
    for reason in ("biases", "interleaved", "transposed", "_apply_gate"):
        assert reason in str(exc.value)
    with pytest.raises(mt.UnsupportedModelError, match="GptOssMLP"):
        mt.swap_moe_blocks(model)


@pytest.mark.parametrize(("flag", "value", "reason"), [
    ("has_gate", False, "not gated"), ("has_post_expert_norm", True, "norm after the down projection"),
    ("_is_expert_parallel", True, "expert parallelism"), ("is_concatenated", False, "interleaved"),
    ("gate_up_proj", "fp8", "quantized")])
def test_refuses_each_experts_flag(flag, value, reason):
    model = build("qwen3_moe")
    model.set_experts_implementation("megamoe")
    experts = model.model.layers[1].mlp.experts
    if value == "fp8":
        value = torch.nn.Parameter(experts.gate_up_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
    setattr(experts, flag, value)
    with pytest.raises(mt.UnsupportedModelError, match=reason):
        model(torch.randint(3, 96, (1, 4)))


def test_refuses_other_activation_jitter_and_adapted_shared_expert():
    model = build("qwen3_moe", hidden_act="gelu")
    model.set_experts_implementation("megamoe")
    with pytest.raises(mt.UnsupportedModelError, match="activation is GELU"):
        model(torch.randint(3, 96, (1, 4)))
    with pytest.raises(mt.UnsupportedModelError, match="router_jitter_noise"):
        mt.swap_moe_blocks(build("mixtral", router_jitter_noise=0.1))

    class LoRALinear(torch.nn.Linear):
        pass

    model = build("deepseek_v3")
    mt.swap_moe_blocks(model)
    shared = model.model.layers[1].mlp.shared_experts
    shared.up_proj = LoRALinear(64, 32, bias=False)  # e.g. an adapter wrapped in after the swap
    with pytest.raises(mt.UnsupportedModelError, match="up_proj is LoRALinear"):
        model(torch.randint(3, 96, (1, 4)))


# ---------------------------------------------------------------------------------------------------
# GPU: the fused kernels
# ---------------------------------------------------------------------------------------------------
def _gpu_model(family, *, all_experts=True):
    """D = 256 on 256 tokens. ``all_experts``: every token picks all E = 8 experts (K = E), so the bf16 and fp64
    runs cannot choose different experts for a token whose top scores tie within bf16 rounding (~1% of
    token-layers at K < E), which would make the comparison with eager meaningless; the routing itself
    (K < E, groups, bias, scaling) is compared with eager on CPU above."""
    kw = {"hidden_size": 256} if family == "deepseek_v3" else {"hidden_size": 256, "head_dim": 64}
    kw["intermediate_size" if family == "mixtral" else "moe_intermediate_size"] = 128
    if all_experts:
        kw["num_experts_per_tok"] = 8
        if family == "deepseek_v3":
            kw["topk_group"] = 4
    return build(family, **kw).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["megamoe", "swap"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpu_training_step_matches_eager(family, how):
    ids = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(4)).cuda()
    check_against_eager(_gpu_model(family), how, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["megamoe", "swap"])
def test_gpu_bitwise_reproducible_and_generates(how):
    model = variant(_gpu_model("deepseek_v3", all_experts=False), BF16, how)
    model.set_attn_implementation("eager")  # (sdpa's backward may use atomics: not bitwise reproducible)
    ids = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(5)).cuda()
    first, grads = train_step(model, ids)
    again, grads2 = train_step(model, ids)
    assert torch.equal(first, again)
    moe = [n for n in grads if ".mlp.experts." in n or ".mlp.gate." in n or ".mlp.shared_experts." in n]
    assert moe and all(torch.equal(grads[n], grads2[n]) for n in moe)
    model.eval()
    out = model.generate(ids[:, :8], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (4, 12)


@pytest.mark.gpu
def test_gpu_backend_is_the_functional_call():
    """The experts implementation adds nothing to megamoe.functional.moe_experts: same bits."""
    from megamoe.functional import moe_experts
    experts = variant(_gpu_model("qwen3_moe", all_experts=False), BF16, "megamoe").model.layers[1].mlp.experts
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(300, 256, device="cuda", generator=g).to(BF16)
    ids = torch.rand(300, 8, device="cuda", generator=g).topk(2, dim=1).indices
    w = torch.rand(300, 2, device="cuda", generator=g).to(BF16)
    got = experts(x, ids, w)
    want = moe_experts(x, ids, w, experts.gate_up_proj, experts.down_proj, backend="fused")
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gpu_swap_is_megamoe_route_and_experts_bitwise(family, monkeypatch):
    """On the fused kernels: megamoe's batch-invariant router GEMM (bf16 for Qwen3-MoE, fp32 for DeepSeek-V3), its
    routing, its fused experts."""
    check_swap_is_megamoe_bitwise(_moe_block(_gpu_model(family, all_experts=False)).to(BF16), "fused", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpu_swap_router_logits_match_eager(family):
    """On the fused kernels (bf16 model, 256 tokens, D = 256): the swapped block's router logits in the family's
    dtype within one rounding step of eager's (cuBLAS), and eager's top-k experts on every token but near-ties."""
    ids = torch.randint(3, 96, (4, 64), generator=torch.Generator().manual_seed(8)).cuda()
    same = check_swap_routes_like_eager(family, _gpu_model(family, all_experts=False).to(BF16), ids, exact=False)
    assert same.float().mean() > 0.98
