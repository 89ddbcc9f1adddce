"""The Triton grouped GEMMs compiled for sm_90a on the CPU, at the layer's shapes and the table's tiles.

For gate/up + SwiGLU, down, dgrad + SwiGLU backward, dgrad dx and the dW13 / dW2 weight gradients (per-tile
kernel at qwen3's ~1024 rows per expert, resident kernel at deepseek-v3's ~128) at qwen3-30b-a3b and
deepseek-v3 shapes (``megamoe.bench.kernel_inventory``, which mirrors the launchers' arguments and Triton's
specialization):
the matrix products are Hopper wgmma instructions of the tile's width; every operand tile reaches shared
memory asynchronously inside the K loop (TMA or cp.async; none through a synchronous register load, which is
what a lost unit-stride or divisibility specialization turns a gathered load into); shared memory within
the 227 KiB a block can have; and register spills no larger than recorded for the installed Triton release
(tests/triton_versions.py; with 3.6: gate/up 28-40 bytes, dgrad + SwiGLU backward 4 bytes with gathered dY rows
(deepseek-v3), none at qwen3, where the backward reads a row-order copy of dY by TMA; none elsewhere), so that an
epilogue change that spills more is seen here before it is timed. At qwen3 the weight gradients run in
torch._grouped_mm; the kernels compiled for them are the Triton fallback (gathered rows, where torch's kernel
cannot run). Speed itself is measured on the GPU (docs/perf.md).
"""

import dataclasses

import pytest
import torch

from megamoe.bench.kernel_inventory import (
    HOPPER_SMEM,
    compile_m_grouped,
    inventory_row,
    layer_gemms,
    layer_wgrads,
    wgrad_config,
)
from megamoe.ops import m_grouped_config
from triton_versions import expected

# spill bytes per thread that each supported Triton's ptxas gives at the table's configs (the upper end of both
# presets, plain and RowPull-waiting kernels); only gate/up and the dgrad + SwiGLU backward spill at all
_NO_SPILL = {"down": 0, "dgrad": 0, "dW13": 0, "dW2": 0}
SPILL_BUDGETS = {(3, 6): {"gate_up": 40, "dgrad_swiglu": 4, **_NO_SPILL},
                 (3, 7): {"gate_up": 40, "dgrad_swiglu": 0, **_NO_SPILL},
                 (3, 8): {"gate_up": 24, "dgrad_swiglu": 68, **_NO_SPILL},
                 (3, 9): {"gate_up": 72, "dgrad_swiglu": 0, **_NO_SPILL}}
SPILL_BUDGET = expected(SPILL_BUDGETS)
ASYNC_OPERAND_LOADS = {"gate_up": 3, "down": 2, "dgrad_swiglu": 2, "dgrad": 2}  # gate/up reads two B tiles

CASES = [(p, t, g) for p, t in (("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096)) for g in layer_gemms(p, t)]


@pytest.mark.parametrize("preset, tokens, gemm", CASES, ids=[f"{p}-{g.kind}" for p, _, g in CASES])
def test_table_configs_compile_pipelined(preset, tokens, gemm):
    cfg = m_grouped_config(gemm.kind, gemm.N, gemm.K, torch.bfloat16, interpret=False, gathered=gemm.gathered)
    r = inventory_row(gemm, cfg)
    assert r["wgmma"] == [f"m64n{cfg.block_n}k16"], r
    assert r["sync_tile_loads"] == 0, f"an operand tile is loaded through registers in the K loop: {r}"
    assert r["tma_loads"] + r["cp_async_loads"] == ASYNC_OPERAND_LOADS[gemm.kind], r
    assert r["shared_bytes"] <= HOPPER_SMEM, r
    assert 0 <= r["spill_bytes"] <= SPILL_BUDGET[gemm.kind], r


PUSH_CASES = [(p, t, g) for p, t in (("qwen3-30b-a3b", 4096), ("deepseek-v3", 4096)) for g in layer_gemms(p, t)
              if g.kind in ("down", "dgrad")]


@pytest.mark.parametrize("preset, tokens, gemm", PUSH_CASES, ids=[f"{p}-{g.kind}" for p, _, g in PUSH_CASES])
def test_push_epilogue_compiles_like_the_plain_one(preset, tokens, gemm):
    """The EP path's down projection and dx GEMM store through a RowPush (rows to the owners' slots): the same
    wgmma, operand paths and shared memory as the plain store, no spills."""
    cfg = m_grouped_config(gemm.kind, gemm.N, gemm.K, torch.bfloat16, interpret=False, gathered=gemm.gathered)
    plain, push = inventory_row(gemm, cfg), inventory_row(gemm, cfg, push=True)
    for key in ("wgmma", "tma_loads", "cp_async_loads", "sync_tile_loads", "shared_bytes"):
        assert push[key] == plain[key], (key, plain, push)
    assert push["spill_bytes"] == 0, push


WCASES = [(p, t, g) for p, t in (("qwen3-30b-a3b", 16384), ("deepseek-v3", 4096)) for g in layer_wgrads(p, t)]


@pytest.mark.parametrize("preset, tokens, wgrad", WCASES, ids=[f"{p}-{g.kind}" for p, _, g in WCASES])
def test_weight_gradient_configs_compile_pipelined(preset, tokens, wgrad):
    cfg = wgrad_config(wgrad)
    assert cfg.resident_chunks == (3 if preset == "deepseek-v3" else 0)  # ~128 vs ~1024 rows per expert
    r = inventory_row(wgrad, cfg)
    assert r["wgmma"] == [f"m64n{cfg.block_n}k16"], r
    assert r["sync_tile_loads"] == 0, f"an operand tile is loaded through registers in the MMA loop: {r}"
    # the per-tile kernel streams both operands; the resident one streams Q past P^T chunks kept on chip
    assert r["cp_async_loads"] + r["tma_loads"] >= (1 if cfg.resident_chunks else 2), r
    assert r["shared_bytes"] <= HOPPER_SMEM and r["blocks_per_sm"] >= 1, r
    assert 0 <= r["spill_bytes"] <= SPILL_BUDGET[wgrad.kind], r


# the EP path's first GEMMs of round 0 (rows contiguous in the receive buffer) at an EP = 2 rank's shapes
PULL_CASES = [(p, t, dataclasses.replace(g, gathered=False, E=g.E // 2))
              for p, t in (("qwen3-30b-a3b", 8192), ("deepseek-v3", 4096)) for g in layer_gemms(p, 2 * t)
              if g.kind in ("gate_up", "dgrad_swiglu")]


@pytest.mark.parametrize("preset, tokens, gemm", PULL_CASES, ids=[f"{p}-{g.kind}" for p, _, g in PULL_CASES])
def test_pull_wait_compiles_like_the_plain_one(preset, tokens, gemm):
    """Waiting on a RowPull (EPOptions.pull_programs: the tile counter, the bounded acquire spins on the blocks'
    flags, the end-of-grid ``griddepcontrol.wait``; with TMA for A a proxy fence after the waits) keeps the plain
    kernel's wgmma, operand paths and shared memory; spills within the budget."""
    cfg = m_grouped_config(gemm.kind, gemm.N, gemm.K, torch.bfloat16, interpret=False, gathered=False)
    plain = inventory_row(gemm, cfg)
    pull = inventory_row(gemm, cfg, pull=True)
    for key in ("wgmma", "tma_loads", "cp_async_loads", "sync_tile_loads", "shared_bytes"):
        assert pull[key] == plain[key], (key, plain, pull)
    assert 0 <= pull["spill_bytes"] <= SPILL_BUDGET[gemm.kind], pull
    ptx = compile_m_grouped(gemm, cfg, pull=True).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol" not in compile_m_grouped(gemm, cfg).asm["ptx"]
    assert "ld.global.gpu.acquire" in ptx, "the flag waits must be acquire loads (GPU scope)"
    assert "atom.global.gpu.relaxed.add" in ptx, "the tiles must come from the counter"
    assert ("fence.proxy.async.global" in ptx) == bool(cfg.tma_a), "TMA reads of pulled rows need the proxy fence"
    assert any(cfg.tma_a for _, _, g in PULL_CASES
               for cfg in [m_grouped_config(g.kind, g.N, g.K, torch.bfloat16, interpret=False, gathered=False)])


# the router's GEMMs in the model dtype (MoEConfig.router_dtype="model"): one group of all T rows, the tiles of
# ops.tile_config.router_kernel_config: logits x @ W.T ("down", N = E, K = D), dx = dlogits @ W ("dgrad", N = D,
# K = E), dW = dlogits^T @ x (the per-tile weight-gradient kernel, M = E, N = D)
ROUTER_SHAPES = {"qwen3-30b-a3b": (128, 2048), "mixtral-8x7b": (8, 4096)}


@pytest.mark.parametrize("model", sorted(ROUTER_SHAPES))
def test_router_model_dtype_gemms_compile_to_wgmma(model):
    """On tensor cores (wgmma of the tile's width), within shared memory, without spills; at Qwen3-MoE's shape
    (E = 128) every operand tile arrives asynchronously (TMA or cp.async). Mixtral's E = 8 is narrower than
    BLOCK_K: its dx GEMM runs one masked K step, its dW reads the 8-column dlogits rows synchronously."""
    from megamoe.bench.kernel_inventory import GemmShape, WgradShape
    from megamoe.ops import k_grouped_config, router_kernel_config

    E, D = ROUTER_SHAPES[model]
    T = 16384
    kc = router_kernel_config(E, D)
    rows = []
    for g in (GemmShape("down", E, D, T, 1, False), GemmShape("dgrad", D, E, T, 1, False)):
        cfg = m_grouped_config(g.kind, g.N, g.K, torch.bfloat16, interpret=False, kernel_config=kc)
        rows.append(inventory_row(g, cfg))
    w = WgradShape("router dW", E, D, T, 1, False, False)
    cfg = k_grouped_config(E, D, torch.bfloat16, interpret=False, rows_per_group=T, kernel_config=kc)
    assert not (cfg.torch_mm or cfg.gluon or cfg.resident_chunks), cfg  # megamoe's per-tile kernel, any T
    rows.append(inventory_row(w, cfg))
    for r in rows:
        assert r["wgmma"] == [f"m64n{r['config'].block_n}k16"], r
        assert r["shared_bytes"] <= HOPPER_SMEM and r["spill_bytes"] == 0, r
        if E >= 64:
            assert r["sync_tile_loads"] == 0 and r["tma_loads"] + r["cp_async_loads"] == 2, r


@pytest.mark.parametrize("pieces", [("hi",), ("hi", "mid", "lo"), ("hi", "mid", "lo", "hi", "hi", "mid")])
def test_router_bf16_split_compiles_for_hopper(pieces):
    """The fp32 router's exact bf16 split (megamoe.ops.split_bf16x3) compiles for sm_90 with one slot and with the
    router's several (the slot loop is unrolled at compile time; the interpreter runs it without compiling), at
    the launcher's tile, without spills."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megamoe.bench.kernel_inventory import ptxas_report
    from megamoe.kernels.bf16_split import bf16_split_kernel

    pattern = sum({"hi": 0, "mid": 1, "lo": 2}[p] << (2 * s) for s, p in enumerate(pieces))
    sig = dict(x_ptr="*fp32", out_ptr="*bf16", n_rows="i32", n_cols="i32", stride_xr="i32", stride_or="i32",
               stride_os="i32")
    const = dict(PATTERN=pattern, SLOTS=len(pieces), BLOCK_R=32, BLOCK_C=128)
    k = triton.compile(ASTSource(bf16_split_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=True))
    assert k.asm["ptx"].count("st.global") >= len(pieces)
    spills = re.search(r"(\d+) bytes spill stores", ptxas_report(k.asm["ptx"]))
    assert spills is None or int(spills.group(1)) == 0, spills.group(0)
