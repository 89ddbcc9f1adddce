"""The benchmark driver behind ``python -m megamoe.bench``: cases x providers, check, interleaved timing.

Legend: T tokens per rank, W EP world size.

Flow: init (torchrun env -> process group: NCCL on GPU, gloo on CPU) -> ceilings -> for every case
(preset, T, routing model): build the problem (same inputs for all providers), check every available
provider against the reference at that shape, warm up, then time in interleaved rounds -> table on
stdout, CSV/JSON/PNG/TXT in ``--out``. Under EP every rank runs the same sequence of collectives; a
provider that fails on any rank is marked failed on all (the verdict is all-reduced).
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import EPOptions, KernelConfig, get_preset
from .ceilings import measure_ceilings
from .check import check_provider
from .problem import make_problem
from .providers import DEFAULT_PROVIDERS, Context, get_providers
from .report import Row, dispatch_bytes, finalize, flops, format_table, run_metadata, write_outputs
from .routing_models import load_stats, make_routing
from .timing import Timer, summarize

__all__ = ["run", "parse_cases", "init_distributed", "kernel_choices"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_cases(cases: list[str] | None, presets: list[str] | None, tokens: list[int] | None) -> list[tuple[str, int]]:
    """``--cases name:T ...`` plus the cross product ``--presets`` x ``--tokens``; ValueError on bad input."""
    out = []
    for c in cases or []:
        name, _, t = c.partition(":")
        if not t.isdigit():
            raise ValueError(f"--cases {c!r}: expected PRESET:TOKENS, e.g. deepseek-v3:4096")
        out.append((name, int(t)))
    for name in presets or []:
        for t in tokens or [4096]:
            out.append((name, t))
    for name, t in out:
        get_preset(name)  # KeyError lists the valid names
        if t <= 0:
            raise ValueError(f"tokens per rank must be > 0, got {t} for {name}")
    return out


def kernel_choices(args) -> tuple[KernelConfig | None, EPOptions | None]:
    """The megamoe providers' KernelConfig (``--tiles``) and EPOptions (``--ep-pull-programs``,
    ``--ep-comm-sms``, ``--ep-push-kernel``) from parsed CLI ``args``; None where all are the defaults.
    ValueError on a bad value."""
    from ..ops.tile_config import parse_tiles

    tiles = getattr(args, "tiles", None)
    kernels = KernelConfig(parse_tiles(tiles)) if tiles else None
    ep = EPOptions(pull_programs=getattr(args, "ep_pull_programs", 0) or 0,
                   comm_sms=getattr(args, "ep_comm_sms", 0) or 0,
                   push_kernel=bool(getattr(args, "ep_push_kernel", False)))
    return kernels, (ep if ep != EPOptions() else None)


def init_distributed(device_arg: str, timeout_s: int) -> Context:
    """Context from torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK) or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    device = torch.device("cuda", local % max(1, torch.cuda.device_count())) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    group = None
    if world > 1:
        if not dist.is_initialized():
            kw = {"device_id": device} if use_cuda else {}
            dist.init_process_group("nccl" if use_cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s), **kw)
        group = dist.group.WORLD
    return Context(device, world, rank, group)


def _agree(ctx: Context, ok: bool) -> bool:
    if ctx.world_size == 1:
        return ok
    t = torch.tensor([0 if ok else 1], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.item() == 0


def _modes(fn, prob):
    """The three timed callables: (setup, work) per mode, with fresh gradients every iteration."""
    args, inputs, g = prob.args(), prob.grad_inputs(), prob.grad_out_TD

    def fwd(_):
        fn(*args)

    def bwd_setup():
        return fn(*args)

    def bwd(out):
        torch.autograd.grad(out, inputs, g)

    def fwdbwd(_):
        torch.autograd.grad(fn(*args), inputs, g)
    return {"fwd": (None, fwd), "bwd": (bwd_setup, bwd), "fwdbwd": (None, fwdbwd)}


def _log(ctx: Context, msg: str) -> None:
    if ctx.rank == 0:
        print(msg, flush=True)


@dataclass(frozen=True)
class _Bench:
    """What every case shares: the parsed CLI ``args``, the process group ``ctx``, the ``timer``, the provider
    ``registry`` with the ``names`` to run and the ``baselines`` to compare against, the measured ``ceilings``,
    the number of timing ``rounds`` and the progress ``bar`` (None without tqdm)."""

    args: Any
    ctx: Context
    timer: Timer
    registry: dict
    names: list[str]
    baselines: list[str]
    ceilings: dict[str, float]
    rounds: int
    bar: Any


def _select_providers(args, ctx: Context) -> tuple[dict, list[str], list[str]]:
    """The provider registry, the provider names to run (``--providers`` or the device's and EP's defaults)
    and the baselines among them; ValueError on an unknown provider."""
    ep = ctx.world_size > 1
    registry = get_providers()
    names = args.providers or DEFAULT_PROVIDERS[(ctx.device.type, ep)]
    for n in names:
        if n not in registry:
            raise ValueError(f"--providers: unknown provider {n!r}; known: {', '.join(registry)}")
    baselines = [b for b in (args.baselines or (["nccl"] if ep else ["torch"])) if b in names]
    return registry, names, baselines


def _ceilings(args, ctx: Context, timer: Timer) -> dict[str, float]:
    """The measured dense matmul and copy rates (nan with ``--no-ceilings``), logged on rank 0."""
    ceilings = measure_ceilings(timer, _DTYPES.get(args.dtype, torch.bfloat16), ctx.rank) if not args.no_ceilings \
        else {"matmul_tflops": math.nan, "fp8_matmul_tflops": math.nan, "copy_gbs": math.nan,
              "peer_copy_gbs": math.nan}
    shown = {k: "n/a" if math.isnan(v) else f"{v:.4g}" for k, v in ceilings.items()}  # nan: not measurable here
    _log(ctx, "ceilings: dense matmul {matmul_tflops} TFLOP/s (FP8 e4m3: {fp8_matmul_tflops}), device copy "
              "{copy_gbs} GB/s, peer copy {peer_copy_gbs} GB/s".format(**shown))
    return ceilings


def _progress_bar(args, ctx: Context, total: int):
    """A tqdm bar over ``total`` steps on stderr (disabled off rank 0 and with ``--quiet``); None without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    return tqdm(total=total, disable=ctx.rank != 0 or tqdm is None or args.quiet, mininterval=2.0,
                file=sys.stderr, desc="bench") if tqdm else None


def _make_case(args, ctx: Context, preset: str, T: int, spec: str):
    """The problem of one case (same inputs for all providers), its description for the JSON output and the
    fields every provider's row shares."""
    ep = ctx.world_size > 1
    cfg = get_preset(preset)
    dtype = _DTYPES[args.dtype] if args.dtype else cfg.dtype
    routing = make_routing(spec, cfg, T, ctx.world_size, args.seed)
    prob = make_problem(preset, cfg, T, routing, world_size=ctx.world_size, rank=ctx.rank,
                        seed=args.seed, dtype=dtype, device=ctx.device)
    L = prob.local_experts
    fl = flops(cfg, T)
    elem = torch.empty(0, dtype=dtype).element_size()
    stats = load_stats(routing.topk_ids_MK, cfg.num_experts, ctx.world_size)
    info = {"preset": preset, "tokens": T, "routing": spec, "note": routing.note, "load": stats,
            "dtype": str(dtype), "cfg": repr(cfg)}
    base = dict(preset=preset, tokens=T, routing=spec, routed_flops_fwd=fl["routed_fwd"],
                shared_flops_fwd=fl["shared_fwd"], weight_bytes=L * 3 * cfg.hidden_size *
                cfg.moe_intermediate_size * elem,
                dispatch_bytes=(dispatch_bytes(prob.topk_ids_TK, ctx.rank, L, cfg.hidden_size, elem)
                                if ep else 0))
    return prob, info, base


def _check_providers(b: _Bench, prob, base: dict) -> tuple[dict[str, dict], dict[str, Row]]:
    """Build and check every provider at this case; returns the timed modes of those that passed (or failed
    the check under ``--time-failed``) and every provider's row. The verdict is agreed across ranks."""
    args, ctx, bar, rounds = b.args, b.ctx, b.bar, b.rounds
    live: dict[str, dict] = {}
    case_rows: dict[str, Row] = {}
    for n in b.names:
        p = b.registry[n]
        row = Row(provider=n, status="ok", fp8=p.fp8, **base)
        case_rows[n] = row
        reason = p.unavailable(ctx, prob)
        if reason:
            row.status, row.note = "skip", reason
            if bar:
                bar.update(rounds + 1)  # its check and timing rounds will not happen
            continue
        fn, err = None, None
        try:
            fn = p.build(prob, ctx)
            if not args.no_check:
                res = check_provider(fn, prob, check_tokens=args.check_tokens, group=ctx.group, fp8=p.fp8)
                q, ratio = res["worst"]
                row.check_worst = f"{q} err {ratio:.2f}x {'the fp8 reference' if p.fp8 else 'torch'}"
                if not res["ok"]:
                    err = f"check failed: {row.check_worst}"
        except Exception as exc:  # noqa: BLE001 - one broken provider must not stop the run
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        ok = _agree(ctx, err is None)
        if not ok:
            row.status = "fail" if err and err.startswith("check") else "error"
            row.note = err or "failed on another rank"
            if not (args.time_failed and row.status == "fail"):
                if bar:
                    bar.update(rounds + 1)
                continue
        live[n] = _modes(fn, prob)
        if bar:
            bar.update(1)
    return live, case_rows


def _time_providers(b: _Bench, live: dict[str, dict], case_rows: dict[str, Row]) -> None:
    """Warm up, then time the ``live`` providers in interleaved rounds (a rotated order each round); the
    medians and the peak memory go into their rows."""
    args, ctx, timer, bar = b.args, b.ctx, b.timer, b.bar
    modes = [m for m in ("fwd", "bwd", "fwdbwd") if m in args.modes]
    for md in live.values():  # warm-up (compiles, caches, allocator)
        for m in modes:
            setup, work = md[m]
            timer.time(work, args.warmup, setup)
    samples = {n: {m: [] for m in modes} for n in live}
    peak = dict.fromkeys(live, 0.0)
    for rnd in range(b.rounds):
        order = list(live)
        order = order[rnd % max(1, len(order)):] + order[:rnd % max(1, len(order))]
        for n in order:
            it = min(args.round_iters, args.iters - rnd * args.round_iters)
            for m in modes:
                setup, work = live[n][m]
                if ctx.device.type == "cuda" and m == "fwdbwd":
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                samples[n][m] += timer.time(work, it, setup)
                if ctx.device.type == "cuda" and m == "fwdbwd":
                    peak[n] = max(peak[n], torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30)
            if bar:
                bar.update(1)
    for n in live:
        row = case_rows[n]
        for m in modes:
            setattr(row, m, summarize(samples[n][m]))
        row.peak_mem_gib = timer.reduce_max(peak[n]) if ctx.device.type == "cuda" else math.nan


def _run_case(b: _Bench, preset: str, T: int, spec: str, rows: list[Row], case_info: list[dict],
              t_start: float) -> None:
    """One case (preset, T, routing model): build, check, time; appends its rows to ``rows`` and its
    description to ``case_info`` and logs its table lines on rank 0."""
    ctx = b.ctx
    prob, info, base = _make_case(b.args, ctx, preset, T, spec)
    stats = info["load"]
    case_info.append(info)
    live, case_rows = _check_providers(b, prob, base)
    _time_providers(b, live, case_rows)
    rows.extend(case_rows.values())
    finalize(list(case_rows.values()), b.ceilings["matmul_tflops"], b.baselines, b.ceilings["fp8_matmul_tflops"])
    _log(ctx, format_table(list(case_rows.values()), b.baselines).split("\n", 2)[-1] +
         f"   [{time.time() - t_start:.0f}s; load max/mean {stats['expert_max_over_mean']:.2f}]")
    del prob, live
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def _write_results(b: _Bench, rows: list[Row], meta: dict, case_info: list[dict]) -> None:
    """The whole table on stdout and CSV/JSON/PNG/TXT in ``--out``, on rank 0."""
    args, ctx, ceilings, baselines = b.args, b.ctx, b.ceilings, b.baselines
    ep = ctx.world_size > 1
    finalize(rows, ceilings["matmul_tflops"], baselines, ceilings["fp8_matmul_tflops"])
    table = format_table(rows, baselines)
    if ctx.rank == 0:
        print("\n" + table)
        print(f"TFLOP/s: routed expert FLOPs only (3 x 6*T*K*D*F per rank over the fwd+bwd median); % peak of "
              f"the measured dense matmul rate {ceilings['matmul_tflops']:.4g} TFLOP/s (FP8 providers: of the dense "
              f"FP8 rate {ceilings['fp8_matmul_tflops']:.4g}); times are medians "
              f"{'(slowest rank) ' if ep else ''}of {args.iters} iterations; speedup = baseline f+b / provider f+b.")
        paths = write_outputs(args.out, rows, meta, ceilings, baselines, case_info, table)
        print("wrote " + ", ".join(paths.values()), flush=True)


def run(args) -> list[Row]:
    """Run the benchmark described by parsed CLI ``args`` (see ``__main__``); returns the rows."""
    cases = parse_cases(args.cases, args.presets, args.tokens)
    if not cases:
        raise ValueError("nothing to run: give --cases PRESET:T ... or --presets NAME ... [--tokens T ...]")
    kernels, ep_options = kernel_choices(args)
    ctx = init_distributed(args.device, args.dist_timeout)
    ctx.kernel_config, ctx.ep_options = kernels, ep_options
    ep = ctx.world_size > 1
    registry, names, baselines = _select_providers(args, ctx)
    timer = Timer(ctx.device, group=ctx.group, world_size=ctx.world_size, flush_mib=args.flush_mib)
    meta = run_metadata(ctx.device, ctx.world_size, dict(vars(args)))
    _log(ctx, f"megamoe.bench: {meta['gpu']} x{ctx.world_size}, torch {meta['torch']}, triton {meta['triton']}, "
              f"CUDA {meta['cuda']}, driver {meta['driver']}, commit {meta['commit']}")
    ceilings = _ceilings(args, ctx, timer)
    rounds = max(1, math.ceil(args.iters / args.round_iters))
    routings = args.routing or ["uniform"]
    bar = _progress_bar(args, ctx, len(cases) * len(routings) * len(names) * (rounds + 1))
    b = _Bench(args, ctx, timer, registry, names, baselines, ceilings, rounds, bar)
    rows: list[Row] = []
    case_info = []
    t_start = time.time()
    for preset, T in cases:
        for spec in routings:
            _run_case(b, preset, T, spec, rows, case_info, t_start)
    if bar:
        bar.close()
    if not ep:
        from .providers_ep import close_one_rank_group
        close_one_rank_group()  # the megamoe-ep provider's one-rank group, if it made one
    _write_results(b, rows, meta, case_info)
    if ep:
        dist.barrier(group=ctx.group)
    return rows
