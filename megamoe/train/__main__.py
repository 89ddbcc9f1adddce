"""``python -m megamoe.train``: train a small MoE language model end to end with megamoe layers.

With no arguments it picks the best it can run on:
  * CPU only            -> reference backend, preset "lm-mini" (about 3 minutes on 2 cores);
  * one CUDA GPU        -> fused backend, preset "lm-small", bf16 experts, bf16 autocast elsewhere;
  * ``torchrun --nproc-per-node W`` -> expert parallelism over the W ranks (EP=W, data parallel for
    everything else), NCCL on GPUs (gloo on CPU, reference backend); ``--ep-size N`` splits the W ranks
    into W/N EP groups of N consecutive ranks, data parallel across the groups (DP x EP, as across nodes).

Examples::

    python -m megamoe.train                               # default run, writes runs/<preset>-ep<N>[-dp<R>]/
    python -m megamoe.train --preset lm-tiny --steps 50   # seconds
    python -m megamoe.train --data ~/books/ --out runs/books
    python -m megamoe.train --out runs/lm-mini-ep1 --resume  # continue from the run's checkpoint
    python -m megamoe.train --check                       # fused vs reference, and two runs bitwise equal
    python -m megamoe.train --attention fast              # SDPA's own attention kernel: faster, not repeatable
    python -m megamoe.train --fp8                         # routed experts' GEMMs in block-scaled FP8
    python -m megamoe.train --fp8-vs-bf16 --steps 200     # the same run in bf16 and in FP8, both curves in one plot
    torchrun --nproc-per-node 2 -m megamoe.train --check
    torchrun --nproc-per-node 4 -m megamoe.train --ep-size 2   # 2 replicas of an EP=2 group
    torchrun --nproc-per-node 4 -m megamoe.train --ep-size 2 --fsdp   # ... with FSDP2 sharding the replicas

See docs/train.md for the run folder's contents.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..validation import check_fp8, interpreter_active
from .data import load_corpus
from .loop import Dist, ResumeError, RunConfig, layout, train
from .model import ATTENTION_MODES, MODEL_PRESETS, get_model_preset


def _parser() -> argparse.ArgumentParser:
    presets = ", ".join(f"{k} ({v.note})" for k, v in MODEL_PRESETS.items())
    p = argparse.ArgumentParser(prog="python -m megamoe.train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help=f"model size: {presets}. Default: lm-mini on CPU, lm-small on GPU")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, help="sequences per rank per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="bytes per sequence (default: the preset's)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="init and data seed (default 0)")
    p.add_argument("--backend", choices=("auto", "reference", "fused"), default="auto",
                   help="MoE backend; auto = fused on CUDA, reference on CPU")
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: FSDP2 shards the parameters (experts over their replicas, the rest over "
                   "all ranks) instead of replicating them")
    p.add_argument("--ep-size", type=int,
                   help="under torchrun: ranks per EP group (a divisor of the world size; default: all ranks, "
                   "or on --resume the run's own)")
    p.add_argument("--out", help="run folder (default runs/<preset>-ep<N>, or runs/<preset>-ep<N>-dp<R> with "
                   "--ep-size N < R*N ranks); '' writes nothing")
    p.add_argument("--data", help="text file or folder (default: this Python's standard library sources)")
    p.add_argument("--seq-aux-coef", type=float,
                   help="sequence-wise balance loss coefficient alpha (0 disables; default: the preset's 1e-3)")
    p.add_argument("--eval-every", type=int, help="validation every N steps (default: the preset's)")
    p.add_argument("--log-every", type=int, default=10, help="metrics / progress every N steps (default 10)")
    p.add_argument("--ckpt-every", type=int, default=0, help="extra checkpoints every N steps (0: at the end)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after N steps, as if interrupted")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one plain line per --log-every steps instead")
    p.add_argument("--attention", choices=ATTENTION_MODES, default="deterministic",
                   help="attention kernel: deterministic (default; flash with a deterministic backward on CUDA, "
                   "so runs repeat bit for bit) or fast (SDPA's own choice, non-deterministic backward)")
    p.add_argument("--fp8", action="store_true",
                   help="the routed experts' GEMMs in block-scaled FP8 (DeepSeek-V3 recipe, docs/fp8.md); the "
                        "hidden and expert sizes must be multiples of 128 (lm-mini and larger presets)")
    p.add_argument("--fp8-vs-bf16", action="store_true",
                   help="train the run twice with the same seed, the experts' own dtype then FP8 (OUT/bf16 on a GPU, "
                        "OUT/fp32 on the CPU, then OUT/fp8), plot both loss curves (OUT/fp8_vs_bf16.png) and compare "
                        "the final losses and tokens/s; exit status 1 if the FP8 final loss is more than 1%% off")
    p.add_argument("--check", action="store_true",
                   help="compare backends (and EP=W with EP=1), check that two runs from one seed are bitwise "
                   "equal at EP=1 and EP=2, and exit")
    p.add_argument("--check-atol", type=float, default=2e-2, help="--check absolute slack on losses (nats)")
    p.add_argument("--check-strict", action="store_true",
                   help="--check also requires the whole EP=W and EP=1 loss trajectories to be bitwise equal")
    return p


def _setup_dist(device_arg: str | None, ep_size: int | None = None) -> tuple[Dist, str]:
    """Initialise torch.distributed under torchrun (WORLD_SIZE > 1) and split it into EP groups of
    ``ep_size`` ranks (default: one group of all); returns (Dist, device string)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() if device_arg is None else device_arg.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA GPU is available")
    if ep_size is not None and (ep_size < 1 or world % ep_size):
        hint = " (more ranks need torchrun: torchrun --nproc-per-node W -m megamoe.train ...)" if world == 1 else ""
        raise SystemExit(f"error: --ep-size must be a positive divisor of the {world} ranks, got {ep_size}{hint}")
    if world == 1:
        return Dist(), (device_arg or ("cuda" if cuda else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    return Dist.from_world(ep_size, "cuda" if cuda else "cpu"), (f"cuda:{local}" if cuda else "cpu")


def resolve(args: argparse.Namespace, dctx: Dist, device: str) -> RunConfig:
    """CLI arguments -> RunConfig (device-dependent defaults). Raises SystemExit with a clear message."""
    on_gpu = device.startswith("cuda")
    backend = args.backend if args.backend != "auto" else ("fused" if on_gpu else "reference")
    if backend == "fused" and not on_gpu and not interpreter_active():
        raise SystemExit("error: --backend fused needs a CUDA GPU (use --backend reference on CPU, or set "
                         "TRITON_INTERPRET=1 to run the Triton kernels in the interpreter: slow, for debugging)")
    try:
        cfg = get_model_preset(args.preset or ("lm-small" if on_gpu else "lm-mini"))
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    changes = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size), ("seq_len", args.seq_len),
                                 ("lr", args.lr), ("eval_every", args.eval_every)) if v is not None}
    for k, v in changes.items():
        if (k == "lr" and not v > 0) or (k != "lr" and v <= 0):
            raise SystemExit(f"error: --{k.replace('_', '-')} must be positive, got {v}")
    moe_changes = {"dtype": torch.bfloat16 if on_gpu else torch.float32}
    if args.seq_aux_coef is not None:
        if not args.seq_aux_coef >= 0:
            raise SystemExit(f"error: --seq-aux-coef must be >= 0, got {args.seq_aux_coef}")
        moe_changes["seq_aux_loss_coef"] = args.seq_aux_coef
    cfg = cfg.replace(**changes, moe=cfg.moe.replace(**moe_changes))
    if args.fsdp and dctx.world == 1:
        raise SystemExit("error: --fsdp shards over the ranks of a torchrun job: run it under torchrun "
                         "--nproc-per-node W (W > 1)")
    if cfg.moe.num_experts % dctx.ep_size:
        raise SystemExit(f"error: preset {cfg.name!r} has {cfg.moe.num_experts} experts, not divisible by "
                         f"the EP size {dctx.ep_size}")
    recipe = "-fp8-vs-bf16" if args.fp8_vs_bf16 else "-fp8" if args.fp8 else ""
    out = args.out if args.out is not None else (f"runs/{cfg.name}-ep{dctx.ep_size}"
                                                      + (f"-dp{dctx.replicas}" if dctx.replicas > 1 else "") + recipe)
    if args.fp8 or args.fp8_vs_bf16:
        try:
            check_fp8("--fp8", cfg.moe.hidden_size, cfg.moe.moe_intermediate_size, cfg.moe.dtype, device)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"error: {e} (preset {cfg.name!r})") from None
    if (args.fp8 or args.fp8_vs_bf16) and (args.check or args.resume):
        raise SystemExit("error: --fp8 / --fp8-vs-bf16 do not combine with --check or --resume (a resumed run keeps "
                         "its own recipe)")
    if (args.fp8 or args.fp8_vs_bf16) and dctx.ep_size > 1 and backend != "fused":
        raise SystemExit(f"error: --fp8 with expert parallelism needs the fused backend (got backend {backend}, "
                         f"EP={dctx.ep_size})")
    return RunConfig(model=cfg, backend=backend, device=device, seed=args.seed, data=args.data, fsdp=args.fsdp,
                     fp8=args.fp8 and not args.fp8_vs_bf16, out_dir=out or None, log_every=max(1, args.log_every),
                     ckpt_every=args.ckpt_every,
                     stop_after=args.stop_after, progress=not args.no_progress and dctx.main,
                     catch_interrupt=True, attention=args.attention)


def _resume_config(rc: RunConfig) -> RunConfig:
    """On --resume the run's own config.json wins (same trajectory); only stop/progress come from the CLI."""
    path = Path(rc.out_dir or "") / "config.json"
    if not path.is_file():
        raise SystemExit(f"error: --resume: {str(path)!r} not found (give the run folder with --out)")
    saved = json.loads(path.read_text())
    moe = rc.model.moe.replace(**{k: (getattr(torch, v.replace("torch.", "")) if k == "dtype" else v)
                                  for k, v in saved["model"].pop("moe").items()})
    model = get_model_preset(saved["model"]["name"]).replace(**saved["model"], moe=moe)
    keep = {k: saved[k] for k in ("backend", "seed", "data", "log_every", "ckpt_every")}
    keep["fp8"] = saved.get("fp8", False)  # the run's own recipe
    keep["attention"] = saved.get("attention", "deterministic")  # the run's own attention kernel
    keep["fsdp"] = saved.get("fsdp", False)  # the run's own sharding (its checkpoints hold local shards)
    return dataclasses.replace(rc, model=model, **keep)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # cuBLAS needs a fixed workspace for deterministic results (set before CUDA starts; see
    # loop.deterministic_algorithms). An application-level setting, made only by this entry point.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.threads:
        torch.set_num_threads(args.threads)
    ep_size = args.ep_size
    if args.resume and ep_size is None and args.out:  # the run's own EP size (config.json records it)
        saved = Path(args.out) / "config.json"
        if saved.is_file():
            ep_size = json.loads(saved.read_text()).get("ep_size")
            if ep_size is not None and int(os.environ.get("WORLD_SIZE", "1")) % ep_size:
                ep_size = None  # another rank count: load_checkpoint names the mismatch
    dctx, device = _setup_dist(args.device, ep_size)
    say = print if dctx.main else (lambda *a, **k: None)
    try:
        rc = resolve(args, dctx, device)
        if args.resume:
            rc = _resume_config(rc)
        try:
            corpus = load_corpus(rc.data)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
        say(f"data: {corpus.describe()}")
        if args.check:
            from .check import run_check
            steps = args.steps or 20
            rc = dataclasses.replace(rc, model=rc.model.replace(steps=steps, eval_every=10**9, warmup=min(
                rc.model.warmup, steps)))
            ok = run_check(rc, dctx, corpus, atol=args.check_atol, strict=args.check_strict, say=say)
            return _all_ranks_done(0 if ok else 1)
        if args.fp8_vs_bf16:
            return _all_ranks_done(_fp8_vs_bf16(rc, dctx, corpus, say=say))
        try:
            _train_and_report(rc, dctx, corpus, resume=args.resume, say=say)
            return _all_ranks_done(0)
        except ResumeError as e:
            raise SystemExit(f"error: {e}") from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _all_ranks_done(code: int) -> int:
    """After a run that ended normally on this rank: wait until every rank has, so that no rank tears the process
    group down while another still uses it (a gloo rank could abort at exit otherwise). Not on an error path,
    where the other ranks may never arrive (their own errors, or the process group's timeout, end them)."""
    if dist.is_initialized():
        dist.barrier()
    return code


def _fp8_vs_bf16(rc: RunConfig, dctx: Dist, corpus, *, say) -> int:
    """The run twice with the same seed and data, with the experts' own dtype (RUN/bf16 on a GPU, RUN/fp32 on the
    CPU) then FP8 GEMMs (RUN/fp8); both loss curves in RUN/fp8_vs_bf16.png; 1 when the FP8 run's final loss is more
    than 1% off the other's."""
    from .plots import plot_compare
    from .report import final_loss, steady_rate

    base = Path(rc.out_dir) if rc.out_dir else None
    runs = {}
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(rc.model.moe.dtype, "fp32")  # the experts' own
    for label, fp8 in ((dtype, False), ("fp8", True)):
        sub = dataclasses.replace(rc, fp8=fp8, out_dir=str(base / label) if base else None)
        runs[label] = (sub, _train_and_report(sub, dctx, corpus, resume=False, say=say))
        if runs[label][1].stopped_at < rc.model.steps:  # interrupted (Ctrl-C, --stop-after): nothing to compare
            say(f"the {label} run stopped after {runs[label][1].stopped_at} of {rc.model.steps} steps: no comparison")
            return 1
    (lb, (_, res_b)), (lf, (_, res_f)) = runs.items()
    loss_b, loss_f = final_loss(res_b), final_loss(res_f)
    gap = abs(loss_f - loss_b) / abs(loss_b)
    say(f"{lf} vs {lb}: final train loss {loss_f:.4f} vs {loss_b:.4f} ({100 * gap:.2f}% apart; the bound is 1%), "
        f"tokens/s {steady_rate(res_f):,.0f} vs {steady_rate(res_b):,.0f}")
    if dctx.main and base is not None:
        say(f"plot: {plot_compare({k: Path(v[0].out_dir) for k, v in runs.items()}, base / 'fp8_vs_bf16.png')}")
    return 0 if gap <= 0.01 else 1


def _train_and_report(rc: RunConfig, dctx: Dist, corpus, *, resume: bool, say):
    from .plots import plot_run
    from .report import ProgressBar, summary

    cfg = rc.model
    device_name = torch.cuda.get_device_name(rc.device) if rc.device.startswith("cuda") else "cpu"
    lay = layout(dctx) + (", FSDP2" if rc.fsdp else "")
    say(f"training preset {cfg.name!r} for {cfg.steps} steps on {device_name} x{dctx.world} "
        f"(backend {rc.backend}, {lay}) -> {rc.out_dir or '(no run folder)'}")
    bar = ProgressBar(total=rc.stop_after and min(rc.stop_after, cfg.steps) or cfg.steps, initial=0,
                      enabled=rc.progress, say=None if rc.progress or not dctx.main else say)
    try:
        res = train(rc, dctx, resume=resume, corpus=corpus, on_log=bar)
    finally:
        bar.close()
    if dctx.main and rc.out_dir and rc.save_plot and (Path(rc.out_dir) / "metrics.jsonl").exists():
        try:
            plot_run(Path(rc.out_dir), title=f"megamoe.train {cfg.name}: {rc.backend} backend, {lay}, "
                                            f"{device_name}")
        except ValueError as e:  # e.g. a resumed run with nothing left to do
            say(f"(no plot: {e})")
    say(summary(rc, res, world=dctx.world, device_name=device_name, layout=lay, ep_size=dctx.ep_size))
    return res


def _exit(code: int | None) -> None:
    """Exit with ``code`` after a normal end. A rank launched by torchrun (its process group already destroyed,
    every rank past the final barrier) leaves through ``os._exit`` once its output is flushed: at interpreter
    finalization gloo's worker threads can still hold work objects, and destroying them then aborts the process
    (``terminate called without an active exception``, SIGABRT) after the run has succeeded. Errors never get
    here: they leave through SystemExit or the exception."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
