"""CPU tests of the benchmark harness (``python -m megamoe.bench``), so it never rots.

Runs every CPU-capable provider once at the tiny preset, single process and EP=2 over gloo (spawned
processes), and checks the written CSV/JSON/PNG; checks the correctness gate rejects a wrong provider;
checks the routing models. Run: ``python3 -m pytest -q tests/test_bench_cpu.py``.
"""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from ep_utils import free_port, spawn_ranks
from interpreter import interpreted
from megamoe.bench.__main__ import build_parser, main
from megamoe.bench.check import check_provider
from megamoe.bench.problem import make_problem
from megamoe.bench.providers import torch_moe_experts
from megamoe.bench.routing_models import fit_trace, load_stats, make_routing
from megamoe.config import get_preset

FAST = ["--device", "cpu", "--iters", "2", "--round-iters", "1", "--warmup", "1", "--quiet"]


def _read(out_dir):
    for ext in ("csv", "json", "png", "txt"):
        assert os.path.getsize(os.path.join(out_dir, f"results.{ext}")) > 0, ext
    with open(os.path.join(out_dir, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    with open(os.path.join(out_dir, "results.json")) as f:
        js = json.load(f)
    return rows, js


def _trace(path, E0=8, K0=2, T0=23):
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E0, generator=g)[:K0] for _ in range(T0)])
    torch.save({"topk_ids_TK": ids, "num_experts": E0, "top_k": K0, "preset": "tiny"}, path)
    return ids


def test_single_process_all_cpu_providers(tmp_path):
    trace = tmp_path / "routing.pt"
    _trace(trace)
    out = tmp_path / "out"
    assert main(FAST + ["--cases", "tiny:37", "--routing", "uniform", "zipf:1.5", f"trace:{trace}",
                        "--providers", "reference", "torch", "megamoe", "nccl", "megamoe-ep", "megamoe-fp8",
                        "megamoe-fp8-uncached", "torch-fp8", "megamoe-compiled", "megamoe-fp8-compiled",
                        "--out", str(out)]) == 0
    rows, js = _read(out)
    assert len(rows) == 3 * 10
    by = {(r["routing"], r["provider"]): r for r in rows}
    for routing in ("uniform", "zipf:1.5", f"trace:{trace}"):
        for p in ("reference", "torch"):
            r = by[(routing, p)]
            assert r["status"] == "ok", r
            assert float(r["fwdbwd_ms"]) > 0 and float(r["tflops"]) > 0 and r["check_worst"]
        assert by[(routing, "nccl")]["status"] == "skip"  # EP-only provider at W = 1
        ep1 = by[(routing, "megamoe-ep")]  # the EP path on a one-rank group needs CUDA
        assert ep1["status"] == "skip" and "CUDA" in ep1["note"], ep1
        for p in ("megamoe-fp8", "megamoe-fp8-uncached", "megamoe-fp8-compiled"):
            fp8 = by[(routing, p)]  # the tiny preset's D = 64 has no FP8 form
            assert fp8["status"] == "skip" and ("multiples of 128" in fp8["note"] or "CUDA" in fp8["note"]), fp8
        assert by[(routing, "torch-fp8")]["status"] == "skip"  # CUDA sm90 only
        for p in ("megamoe", "megamoe-compiled"):  # the fused path: CUDA, or the Triton interpreter on CPU
            fused = by[(routing, p)]
            if os.environ.get("TRITON_INTERPRET") == "1":
                assert fused["status"] == "ok", fused
            else:
                assert fused["status"] == "skip" and "needs CUDA" in fused["note"], fused
    assert float(by[("uniform", "reference")]["speedup_vs_torch"]) > 0
    head, _, *lines = (out / "results.txt").read_text().splitlines()
    col = slice(head.index("provider"), head.index("  fwd ms"))  # the provider column, as wide as the longest name
    assert [line[col].strip() for line in lines] == [r["provider"] for r in rows]
    meta = js["meta"]
    for k in ("gpu", "driver", "cuda", "torch", "triton", "commit", "world_size"):
        assert k in meta
    assert meta["world_size"] == 1 and js["ceilings"]["matmul_tflops"] > 0
    assert rows[0]["routed_flops_fwd"] == str(6 * 37 * 2 * 64 * 32)


def _ep_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    rc = main(FAST + ["--cases", "tiny:16", "--routing", "zipf", "--providers", "reference", "nccl", "megamoe",
                      "symm-vdev", "torch", "megamoe-ep", "megamoe-compiled", "--no-ceilings", "--out", out_dir])
    assert rc == 0  # the process group the harness made is torn down by spawn_ranks, after the report


@interpreted
def test_compiled_provider_checks_and_times_under_the_interpreter(tmp_path, monkeypatch):
    """megamoe-compiled (torch.compile of the custom ops) passes the correctness gate and is timed in two cases of
    different shapes: dynamo reset and a fresh compile per case (graphs counted). fp32: under the interpreter the
    bf16 fused path differs from the reference by more than the gate's multiple of torch's error at this tiny
    shape."""
    from torch._dynamo.utils import counters

    resets = []
    reset = torch.compiler.reset
    monkeypatch.setattr(torch.compiler, "reset", lambda: resets.append(1) or reset())
    graphs = counters["stats"]["unique_graphs"]
    out = tmp_path / "out"
    assert main(FAST + ["--cases", "tiny:37", "tiny:16", "--routing", "uniform", "--dtype", "fp32",
                        "--providers", "torch", "megamoe-compiled", "--out", str(out)]) == 0
    assert len(resets) == 2 and counters["stats"]["unique_graphs"] - graphs >= 2, (resets, counters["stats"])
    rows, _ = _read(out)
    by = {(r["tokens"], r["provider"]): r for r in rows}
    assert len(rows) == 4
    for t in ("37", "16"):
        compiled = by[(t, "megamoe-compiled")]
        assert compiled["status"] == "ok" and compiled["check_worst"], compiled
        assert float(compiled["fwdbwd_ms"]) > 0 and compiled["routed_flops_fwd"] == by[(t, "torch")]["routed_flops_fwd"]


@pytest.mark.timeout(120)
def test_ep2_gloo(tmp_path):
    out = str(tmp_path / "ep2")
    spawn_ranks(_ep_worker, 2, free_port(), out, timeout=110)
    rows, js = _read(out)
    by = {r["provider"]: r for r in rows}
    assert by["reference"]["status"] == "ok" and by["nccl"]["status"] == "ok", rows
    assert by["torch"]["status"] == "skip" and by["symm-vdev"]["status"] == "skip"
    assert by["megamoe-ep"]["status"] == "skip" and "one-GPU" in by["megamoe-ep"]["note"]
    assert by["megamoe-compiled"]["status"] == "skip" and "single-device" in by["megamoe-compiled"]["note"]
    assert float(by["reference"]["speedup_vs_nccl"]) > 0
    assert js["meta"]["world_size"] == 2 and int(by["nccl"]["dispatch_bytes"]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_check_accepts_torch_and_rejects_wrong(dtype):
    cfg = get_preset("tiny")
    prob = make_problem("tiny", cfg, 29, make_routing("uniform", cfg, 29, 1, 1), seed=1, dtype=dtype)
    assert check_provider(torch_moe_experts, prob, check_tokens=8)["ok"]

    def wrong_weights(x, ids, w, *rest):
        return torch_moe_experts(x, ids, w * 1.02, *rest)

    def swapped_slots(x, ids, w, *rest):
        return torch_moe_experts(x, ids.flip(1), w, *rest)

    for bad in (wrong_weights, swapped_slots):
        res = check_provider(bad, prob, check_tokens=8)
        assert not res["ok"], res["worst"]


def test_fp8_check_accepts_the_fp8_reference_and_rejects_wrong():
    """The FP8 providers' check: the FP8 reference itself passes with the FP8 tolerance (and would fail the
    16-bit one: FP8 needs its own), a wrong FP8 provider fails."""
    from megamoe.reference import moe_experts_fp8

    cfg = get_preset("small")  # D = 256, F = 128: multiples of 128
    prob = make_problem("small", cfg, 24, make_routing("uniform", cfg, 24, 1, 1), seed=1, dtype=torch.bfloat16)
    assert check_provider(moe_experts_fp8, prob, check_tokens=12, fp8=True)["ok"]
    assert not check_provider(moe_experts_fp8, prob, check_tokens=12)["ok"]

    def wrong_weights(x, ids, w, *rest):
        return moe_experts_fp8(x, ids, w * 1.1, *rest)

    def swapped_slots(x, ids, w, *rest):
        return moe_experts_fp8(x, ids.flip(1), w, *rest)

    for bad in (wrong_weights, swapped_slots):
        assert not check_provider(bad, prob, check_tokens=12, fp8=True)["ok"]


def test_routing_models_distinct_and_deterministic():
    cfg = get_preset("small")
    for spec in ("uniform", "zipf", "zipf:2"):
        r1 = make_routing(spec, cfg, 50, 2, seed=4)
        r2 = make_routing(spec, cfg, 50, 2, seed=4)
        assert torch.equal(r1.topk_ids_MK, r2.topk_ids_MK)
        ids = r1.topk_ids_MK
        assert ids.shape == (100, cfg.top_k) and ids.min() >= 0 and ids.max() < cfg.num_experts
        assert (ids.sort(1).values.diff(dim=1) > 0).all()  # distinct experts per token
        w = r1.topk_weights_MK
        torch.testing.assert_close(w.sum(1), torch.full((100,), cfg.routed_scaling_factor))
    skew = load_stats(make_routing("zipf:2", cfg, 500, 1, 0).topk_ids_MK, cfg.num_experts)["expert_max_over_mean"]
    flat = load_stats(make_routing("uniform", cfg, 500, 1, 0).topk_ids_MK, cfg.num_experts)["expert_max_over_mean"]
    assert skew > flat


def test_fit_trace(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = _trace(tmp_path / "t.pt", E0=8, K0=2, T0=5)
    assert torch.equal(fit_trace(ids, 8, 12, 2, 8, g), ids[torch.arange(12) % 5])  # identity + tiling
    for K, E in ((1, 8), (4, 8), (2, 32), (3, 4)):
        out = fit_trace(ids, 8, 12, K, E, g)
        assert out.shape == (12, K) and out.min() >= 0 and out.max() < E
        assert (out.sort(1).values.diff(dim=1) > 0).all()
    with pytest.raises(ValueError, match="outside"):
        fit_trace(ids, 4, 12, 2, 8, g)


def test_cli_errors_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    assert "nccl" in capsys.readouterr().out
    assert main(["--device", "cpu", "--cases", "nope:4"]) == 2
    assert main(["--device", "cpu", "--cases", "tiny:4", "--routing", "zipf:x"]) == 2
    assert main(["--device", "cpu", "--cases", "tiny:4", "--providers", "bogus"]) == 2


def test_variant_flags_become_config_objects():
    """``--tiles`` and ``--ep-*`` become the megamoe providers' KernelConfig / EPOptions (None where all are the
    defaults), bad values are a ValueError (main returns 2), and the run's metadata records the variant and the
    ``--commit`` given."""
    from megamoe.bench.report import run_metadata
    from megamoe.bench.runner import kernel_choices
    from megamoe.config import EPOptions, GemmConfig

    parse = lambda *a: build_parser().parse_args(["--cases", "tiny:4", *a])  # noqa: E731
    args = parse("--tiles", "down:128,256,64,8,3", "--ep-comm-sms", "16", "--ep-push-kernel", "--commit", "abc123")
    kc, ep = kernel_choices(args)
    assert kc.tile("down", 64, 32) == GemmConfig(128, 256, 64, 8, 3) and kc.tile("dgrad", 64, 32) is None
    assert ep == EPOptions(comm_sms=16, push_kernel=True)
    assert kernel_choices(parse()) == (None, None)
    meta = run_metadata(torch.device("cpu"), 1, vars(args))
    assert meta["commit"].startswith("abc123")
    assert meta["variant"] == {"tiles": "down:128,256,64,8,3", "ep_comm_sms": 16, "ep_push_kernel": True}
    for bad in (("--tiles", "down:128,128,32,8,3"), ("--ep-pull-programs", "200"), ("--ep-comm-sms", "-1")):
        with pytest.raises(ValueError):
            kernel_choices(parse(*bad))
    assert main(["--device", "cpu", "--cases", "tiny:4", "--tiles", "nope:1"]) == 2


def test_ab_summary_groups_runs_by_recorded_variant(tmp_path):
    from megamoe.bench.ab_summary import load_runs, summarize

    def write(folder, variant, ms, status="ok", key="variant"):
        row = dict(preset="qwen3-30b-a3b", tokens=16384, routing="uniform", provider="megamoe", status=status,
                   fwdbwd_ms=ms)
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "results.json").write_text(json.dumps({"meta": {key: variant}, "results": [row]}))

    write("abtiles_r1_0", {}, 8.40)
    write("abtiles_r1_1", {"tiles": "dgrad_swiglu:128,256,64,8,3,tma_b=1"}, 8.20)
    write("abtiles_r1_2", {"ep_comm_sms": 16}, 9.00, status="fail")
    write("abtiles_r2_0", {"MEGAMOE_TILES": ""}, 8.60, key="env")  # an older run's record of its switches
    write("abtiles_r2_1", {"tiles": "dgrad_swiglu:128,256,64,8,3,tma_b=1"}, 8.30)
    (tmp_path / "abtiles_r1_0.log").write_text("not json")  # what a shell glob also names
    runs = load_runs([str(p) for p in sorted(tmp_path.iterdir())])
    assert [g for g, _ in runs].count("table") == 2
    text = summarize(runs).splitlines()
    table = next(ln for ln in text if " table " in ln)
    assert "8.40 8.60" in table and "8.50" in table  # both repetitions and their median
    cand = next(ln for ln in text if "tiles=dgrad_swiglu" in ln)
    assert "8.20 8.30" in cand and "-0.25 (-2.9%)" in cand
    failed = next(ln for ln in text if "ep_comm_sms=16" in ln)
    assert "(fail)" in failed and "9.00" not in failed  # a failed check is never timed into the table
