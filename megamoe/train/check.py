"""``python -m megamoe.train --check``: the same training steps on several backends, compared.

Legend: W ranks of the job (torchrun), N EP size (``--ep-size``, default W), R = W / N replicas, P compared
steps. "EP=N" below reads "EP=N x DP=R" when R > 1.

Runs (same seed, data and steps; nothing written to disk):
  candidate  the fused backend (experts in bf16) at EP=N;  on a CPU-only machine the reference backend;
  reference  the plain-PyTorch reference backend, same expert dtype, EP=N;
  exact      the reference backend with fp64 experts (fp32 on GPU, where fp64 GEMMs would crawl),
             initialised from the same values as the other two (cast up from their dtype).
The candidate passes when its largest per-step loss difference to ``exact`` is at most twice the
reference's own difference to ``exact`` plus ``atol`` (the project's tolerance rule: the kernel's
error may be at most 2x PyTorch's own error at the same dtype, plus a small absolute slack).

At W > 1 one more run, on every rank: the candidate at EP=1 on the global batch (all W ranks'
data) with W virtual ranks (``GPT.forward(chunks=W)``: dense layers per rank slice, MoE layers on the
whole batch), and the per-step loss trajectories are compared bit for bit. The first step's loss
depends only on the forward pass and must be bitwise equal (megamoe's batch-invariance contract);
later steps are equal only if every gradient is, and the gradients of replicated parameters (router,
shared expert, dense layers) are summed over ranks in a different order than one EP=1 GEMM sums them,
so the report states the first step where the trajectories part; ``strict`` makes any difference fail.

Reproducibility (megamoe/train/repro.py): the candidate is run twice from the same seed and every logged
loss (train, balance, validation) and every final tensor of the model (parameters, expert bias,
counters) must be bitwise equal, at EP=1 and at EP=2. In a single process the EP=1 pair is the candidate
run and one more; the EP=2 pair runs in two spawned ranks (gloo on CPU; on one GPU both ranks share it,
as the shared-GPU EP tests do; on two GPUs one each over NCCL). Under torchrun the pair runs at the job's
own layout (EP=N, every rank compares its own tensors). Any difference fails the check. On the GPU this
holds with the default deterministic attention (``--attention deterministic``); ``--attention fast``
(SDPA's own kernel, a non-deterministic backward) is expected to fail it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .data import Corpus
from .loop import Dist, RunConfig, layout, train
from .repro import compare, fingerprint, repeat_spawned

__all__ = ["run_check"]


def _variant(rc: RunConfig, *, backend: str, dtype: torch.dtype, init_dtype: torch.dtype,
             virtual_ranks: int = 1) -> RunConfig:
    model = rc.model.replace(moe=rc.model.moe.replace(dtype=dtype))
    return dataclasses.replace(rc, model=model, backend=backend, virtual_ranks=virtual_ranks, out_dir=None,
                               progress=False, save_trace=False, save_plot=False, stop_after=None,
                               init_dtype=init_dtype)


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _first_difference(a: list[float], b: list[float]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:  # Python floats hold the fp32 values exactly: != is a bitwise comparison here
            return i
    return None


def run_check(rc: RunConfig, dctx: Dist, corpus: Corpus, *, atol: float = 2e-2, strict: bool = False,
              say=print) -> bool:
    """Run the comparison described in the module docstring; returns True when it passes.

    ``rc`` gives model, steps and seed; its backend is ignored. ``say`` prints on rank 0 only.
    """
    on_gpu = torch.device(rc.device).type == "cuda"
    cand_backend = "fused" if on_gpu else "reference"
    low = torch.bfloat16 if on_gpu else torch.float32
    high = torch.float32 if on_gpu else torch.float64
    W = dctx.world
    P = rc.model.steps
    lay = layout(dctx)
    say(f"--check: {P} steps of preset {rc.model.name!r}, seed {rc.seed}, {lay}, device {rc.device}")
    runs = {}
    plan = [("candidate", _variant(rc, backend=cand_backend, dtype=low, init_dtype=low)),
            ("reference", _variant(rc, backend="reference", dtype=low, init_dtype=low)),
            ("exact", _variant(rc, backend="reference", dtype=high, init_dtype=low))]
    first_run = None
    for name, v in plan:
        say(f"  running {name:<10} backend={v.backend:<9} experts={str(v.model.moe.dtype).replace('torch.', '')}"
            f" {lay} ...")
        res = train(v, dctx, corpus=corpus)
        runs[name] = res.losses
        if name == "candidate":
            first_run = fingerprint(res)
    if W > 1:
        v = _variant(rc, backend=cand_backend, dtype=low, init_dtype=low, virtual_ranks=W)
        say(f"  running {'EP=1':<10} backend={v.backend:<9} on the global batch ({W} virtual ranks), every rank ...")
        runs["ep1"] = train(v, Dist(), corpus=corpus).losses

    err_cand = _max_diff(runs["candidate"], runs["exact"])
    err_ref = _max_diff(runs["reference"], runs["exact"])
    bound = 2 * err_ref + atol
    ok = err_cand <= bound
    say("")
    say(f"  {'step':>5} {'candidate':>12} {'reference':>12} {'exact':>12}" + (f" {'EP=1':>12}" if W > 1 else ""))
    for i in sorted({0, 1, P // 2, P - 1} & set(range(P))):
        row = f"  {i:>5} {runs['candidate'][i]:>12.6f} {runs['reference'][i]:>12.6f} {runs['exact'][i]:>12.6f}"
        say(row + (f" {runs['ep1'][i]:>12.6f}" if W > 1 else ""))
    say(f"  largest loss difference, candidate ({cand_backend}) vs reference: "
        f"{_max_diff(runs['candidate'], runs['reference']):.3e}")
    say(f"  largest loss difference to exact: candidate {err_cand:.3e}, reference {err_ref:.3e}; "
        f"bound 2 x reference + {atol:g} = {bound:.3e} -> {'PASS' if ok else 'FAIL'}")
    if W > 1:
        first = _first_difference(runs["candidate"], runs["ep1"])
        if first is None:
            say(f"  {lay} vs EP=1: loss trajectories bitwise equal over all {P} steps -> PASS")
        else:
            say(f"  {lay} vs EP=1: bitwise equal for the first {first} step(s), then differ "
                f"(largest difference {_max_diff(runs['candidate'], runs['ep1']):.3e})")
            forward_ok = first > 0
            ok = ok and forward_ok and not strict
            say(f"  first-step loss (forward only) bitwise equal: {'yes -> PASS' if forward_ok else 'no -> FAIL'}"
                + ("; --check-strict requires all steps -> FAIL" if strict else ""))
    repro_ok = _check_repeatable(plan[0][1], dctx, corpus, first_run, say)
    ok = ok and repro_ok
    say(f"--check {'PASSED' if ok else 'FAILED'}")
    return ok


def _check_repeatable(cand: RunConfig, dctx: Dist, corpus: Corpus, first_run: dict, say) -> bool:
    """The candidate once more from the same seed, compared bit for bit with its first run (this layout),
    and in a single process also two runs at EP=2 in spawned ranks (module docstring)."""
    lay = layout(dctx)
    say(f"  running candidate again (same seed) at {lay} ...")
    again = fingerprint(train(cand, dctx, corpus=corpus))
    results = [(lay, compare(first_run, again))]
    if dctx.world > 1:  # every rank compared its own tensors: one verdict for all
        bad = torch.tensor([results[0][1] is not None], dtype=torch.int64)
        if cand.device.startswith("cuda"):
            bad = bad.to(cand.device)
        dist.all_reduce(bad, group=dctx.group)
        if bad.item() and results[0][1] is None:
            results = [(lay, "another rank's run differs")]
    elif cand.model.moe.num_experts % 2 == 0:
        say("  running candidate twice at EP=2 (two spawned ranks) ...")
        pairs = repeat_spawned(cand, world=2)
        diffs = [f"rank {r}: {d}" for r, (a, b) in enumerate(pairs) if (d := compare(a, b)) is not None]
        results.append(("EP=2", "; ".join(diffs) or None))
    ok = True
    for where, diff in results:
        if diff is None:
            say(f"  reproducibility at {where}: two runs from seed {cand.seed} bitwise equal (every logged loss, "
                f"every final parameter and buffer) -> PASS")
        else:
            ok = False
            say(f"  reproducibility at {where}: two runs from seed {cand.seed} differ ({diff}) -> FAIL")
    return ok
