"""The training loop: model and optimizer setup, steps, evaluation, metrics, checkpoints, routing trace.

Legend: B sequences per rank, S sequence length, V vocabulary, E experts, K top-k, L_ MoE layers
(``n_layer``), W ranks of the job (each with its own batch), N EP size (ranks in a row form an EP group),
R = W / N replicas of the experts (data parallelism over the EP groups), C virtual ranks of an EP=1 run
emulating EP=C.

One optimizer step: batch(step, rank) -> forward (bf16 autocast on CUDA; MoE layers in their own dtype)
-> loss = cross-entropy + the MoE layers' sequence-wise balance losses -> backward -> with W > 1, the
replicated (dense, router, shared-expert) gradients are summed over the W ranks with ``all_reduce``, the
rank's own expert gradients (each already sums its EP group's tokens) over its R replicas, and both are
divided by W -> AdamW -> aux-loss-free expert-bias update of every MoE layer from the counts of this step
(all-reduced over the EP group and the replicas inside the layer, so over all W ranks). Nothing in a step
reads a value back to the host; logging does, every ``log_every`` steps, in one transfer.

Determinism: batches depend only on (seed, step, rank); parameter init only on the seed; nothing is
timed or autotuned; on CUDA PyTorch's deterministic algorithms are on (``warn_only``) and the attention
backward is deterministic too (``RunConfig.attention``, megamoe/train/model.py), so two runs from one seed
give the same losses and parameters bit for bit (``--check`` runs each layout twice and compares). A
checkpoint holds model, optimizer, step and RNG states, so resuming gives the same trajectory as an
uninterrupted run (tested on CPU).
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F_

from ..config import MoEConfig
from .data import Corpus, load_corpus, train_batch, val_batches
from .model import GPT, ModelConfig, strict_determinism
from .timing import StepTimer

__all__ = ["RunConfig", "RunResult", "Dist", "ResumeError", "layout", "train", "build_model"]


@dataclass
class Dist:
    """This process's place in the job.

    ``rank`` / ``world`` (W) and ``group``: the whole job (every rank has its own batch; the dense,
    router and shared-expert parameters are replicated on all W). ``ep_size`` (N): ranks
    [i*N, (i+1)*N) form EP group i (``ep_group``, the routed experts sharded over it; None when N = 1);
    ``expert_dp_group``: the R = W / N ranks with this rank's EP rank, which hold the same experts
    (None when R = 1). Built by :meth:`from_world`.
    """

    rank: int = 0
    world: int = 1
    group: object = None  # the whole job's process group when world > 1
    ep_size: int = 1
    ep_group: object = None
    expert_dp_group: object = None
    mesh: object = None  # the (R, N) DeviceMesh, dims ("dp", "ep"), when N < W

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """R = W / N: the data-parallel replicas of each expert."""
        return self.world // self.ep_size

    @classmethod
    def from_world(cls, ep_size: int | None = None, device_type: str = "cpu") -> Dist:
        """The initialised default process group split into EP groups of ``ep_size`` consecutive ranks
        (default: all of them) through a :class:`torch.distributed.device_mesh.DeviceMesh` of shape
        (R, N), dims ("dp", "ep"). Collective: call on every rank. Raises ValueError if N does not divide W."""
        W = dist.get_world_size()
        N = W if ep_size is None else ep_size
        if N < 1 or W % N:
            raise ValueError(f"EP size {N} must be a positive divisor of the {W} ranks")
        if N == W:  # no subgroups needed
            return cls(rank=dist.get_rank(), world=W, group=dist.group.WORLD, ep_size=N,
                       ep_group=dist.group.WORLD if N > 1 else None)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, (W // N, N), mesh_dim_names=("dp", "ep"))
        return cls(rank=dist.get_rank(), world=W, group=dist.group.WORLD, ep_size=N,
                   ep_group=mesh["ep"].get_group() if N > 1 else None,
                   expert_dp_group=mesh["dp"].get_group(), mesh=mesh)


class ResumeError(ValueError):
    """A checkpoint that this job cannot resume (missing, or written by another rank count or EP size)."""


def layout(dctx: Dist) -> str:
    """``"EP=N"``, or ``"EP=N x DP=R"`` with replicas (reports, run-folder names)."""
    return f"EP={dctx.ep_size}" + (f" x DP={dctx.replicas}" if dctx.replicas > 1 else "")


@dataclass
class RunConfig:
    """Everything a training run depends on (the CLI resolves it; checkpoints store it)."""

    model: ModelConfig
    backend: str
    device: str
    seed: int = 0
    data: str | None = None
    out_dir: str | None = None
    log_every: int = 10
    ckpt_every: int = 0          # 0: checkpoint only at the end
    stop_after: int | None = None  # stop (with a checkpoint) after this many steps, as if interrupted
    virtual_ranks: int = 1       # C > 1: an EP=1 run computing what an EP=C run computes (see GPT.forward)
    fsdp: bool = False           # under torchrun: FSDP2 shards the parameters (megamoe/train/fsdp.py)
    init_dtype: torch.dtype | None = None  # init experts in this dtype, then cast (same start, other dtype)
    attention: str = "deterministic"  # or "fast": SDPA's own choice, non-deterministic backward (model.py)
    fp8: bool = False            # the routed experts' GEMMs in block-scaled FP8 (MoE(..., fp8=True), docs/fp8.md)
    progress: bool = True
    catch_interrupt: bool = False  # Ctrl-C ends the step, checkpoints and stops also without a progress bar (CLI)
    save_trace: bool = True
    save_plot: bool = True


@dataclass
class RunResult:
    """Per-step global train losses (fp32 values as Python floats), validation losses, speed numbers."""

    losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    loads: list[list[list[int]]] = field(default_factory=list)   # [step][layer][expert] global counts
    tokens_per_s: list[float] = field(default_factory=list)      # one per log interval
    moe_share: list[float] = field(default_factory=list)
    first_step: int = 0
    seconds: float = 0.0
    run_dir: Path | None = None
    stopped_at: int = 0          # completed steps when the run ended
    model: object = None         # the trained GPT (for summaries)


def build_model(rc: RunConfig, dctx: Dist, device: torch.device) -> GPT:
    """The model with MoE layers on ``rc.backend``, EP over ``dctx.ep_group`` and the bias counts also
    over ``dctx.expert_dp_group``; same init bits on every rank."""
    from .. import MoE  # the layer imports triton lazily for the fused backend only

    cfg = rc.model
    group, dp_group = dctx.ep_group, dctx.expert_dp_group

    def moe_factory(i: int):
        return MoE(cfg.moe, backend=rc.backend, group=group, dp_group=dp_group, device="cpu",
                   seed=rc.seed * 1000 + i, fp8=rc.fp8)

    model = GPT(cfg, moe_factory, seed=rc.seed, attention=rc.attention)
    if rc.init_dtype is not None and rc.init_dtype != cfg.moe.dtype:
        # Same initial values as a run with init_dtype experts (random draws depend on the dtype).
        init_cfg = cfg.replace(moe=cfg.moe.replace(dtype=rc.init_dtype))
        init = GPT(init_cfg, lambda i: MoE(init_cfg.moe, backend=rc.backend, group=group, dp_group=dp_group,
                                           device="cpu", seed=rc.seed * 1000 + i, fp8=rc.fp8), seed=rc.seed)
        model.load_state_dict(init.state_dict())  # copy_ casts to each parameter's own dtype
    model = model.to(device)
    if rc.fsdp and dctx.world > 1:
        from .fsdp import shard_model
        shard_model(model, dctx, device.type)
    return model


def _expert_params(model: GPT) -> list[torch.nn.Parameter]:
    return [p for m in model.moe_layers() for p in m.experts.parameters()]


def _make_optimizer(model: GPT, lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def lr_at(step: int, cfg: ModelConfig) -> float:
    """Linear warmup over ``cfg.warmup`` steps, then cosine decay to 10% at ``cfg.steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac))))


def _batch(corpus: Corpus, rc: RunConfig, dctx: Dist, step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This process's batch: its C virtual ranks' shards concatenated in rank order, [C*B, S]."""
    C = rc.virtual_ranks
    parts = [train_batch(corpus, step, batch_size=rc.model.batch_size, seq_len=rc.model.seq_len, seed=rc.seed,
                         rank=dctx.rank * C + c, world_size=dctx.world * C) for c in range(C)]
    x_BS, y_BS = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if device.type == "cuda":  # pinned host memory: the copy is asynchronous (a pageable one would sync)
        x_BS, y_BS = x_BS.pin_memory(), y_BS.pin_memory()
    return x_BS.to(device, non_blocking=True), y_BS.to(device, non_blocking=True)


@contextmanager
def deterministic_algorithms(device: torch.device):
    """PyTorch's deterministic kernels for the dense model while training on CUDA, restored afterwards.

    Needed for bit-reproducible runs: PyTorch's flash-attention and embedding backward kernels
    accumulate with atomics unless deterministic algorithms are on. ``warn_only``: ops without a
    deterministic version warn instead of failing; the fill of uninitialised memory is left off (cost).
    """
    if device.type != "cuda":
        yield
        return
    with strict_determinism(warn_only=True):
        yield


def _loss(logits_BSV: torch.Tensor, y_BS: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective, per-chunk losses): the mean over the C chunks of each chunk's mean cross-entropy
    (C = 1: the plain mean), fp32, and the C chunk losses (detached, fp32 [C]) for logging."""
    per_chunk = [F_.cross_entropy(lg.float().flatten(0, 1), yc.flatten())
                 for lg, yc in zip(logits_BSV.chunk(chunks), y_BS.chunk(chunks))]
    objective = per_chunk[0] if chunks == 1 else torch.stack(per_chunk).sum() / chunks
    return objective, torch.stack(per_chunk).detach()


def _autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model: GPT, batches, device, rc: RunConfig, dctx: Dist) -> float:
    """Mean validation loss over the fixed batches (same on every rank); eval mode leaves MoE counters alone."""
    model.eval()
    total = torch.zeros((), device=device)
    for x_BS, y_BS in batches:
        x_BS, y_BS = x_BS.to(device), y_BS.to(device)
        with _autocast(device):
            logits = model(x_BS)
        total += F_.cross_entropy(logits.float().flatten(0, 1), y_BS.flatten())
    model.train()
    return float(total / len(batches))


def _ckpt_path(run_dir: Path, dctx: Dist) -> Path:
    return run_dir / ("checkpoint.pt" if dctx.world == 1 else f"checkpoint_rank{dctx.rank}.pt")


def save_checkpoint(run_dir: Path, dctx: Dist, model: GPT, opt, step: int, device: torch.device,
                    fsdp: bool = False) -> Path:
    """model + optimizer + completed steps + RNG states (data position = step), one file per rank; under
    FSDP2 (``fsdp``) the rank's local shards (megamoe/train/fsdp.py)."""
    if fsdp:
        from .fsdp import local_state_dicts
        model_sd, opt_sd = local_state_dicts(model, opt)
    else:
        model_sd, opt_sd = model.state_dict(), opt.state_dict()
    state = {"model": model_sd, "optimizer": opt_sd, "step": step,
             "rng_cpu": torch.get_rng_state(),
             "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
             "world": dctx.world, "rank": dctx.rank, "ep_size": dctx.ep_size, "fsdp": fsdp}
    path = _ckpt_path(run_dir, dctx)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: an interrupted save never leaves a torn checkpoint
    return path


def load_checkpoint(run_dir: Path, dctx: Dist, model: GPT, opt, device: torch.device, fsdp: bool = False) -> int:
    """Restore a checkpoint written by :func:`save_checkpoint`; returns the completed step count."""
    path = _ckpt_path(run_dir, dctx)
    if not path.is_file():
        found = sorted(q.name for q in run_dir.glob("checkpoint*.pt")) if run_dir.is_dir() else []
        raise ResumeError(f"--resume: no checkpoint {str(path)!r} for rank {dctx.rank} of {dctx.world}; the run "
                          f"folder has {', '.join(found) if found else 'no checkpoint'} (resume with the same "
                          "number of ranks as the run: checkpoint.pt for one process, checkpoint_rank<r>.pt "
                          "under torchrun)")
    # Load to CPU: load_state_dict moves tensors to each parameter's device, and the optimizer keeps its
    # step counters on the host as a fresh AdamW does (a CUDA step counter would force a sync per step).
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["world"] != dctx.world:
        raise ResumeError(f"--resume: checkpoint was written by {state['world']} ranks, this job has {dctx.world}")
    saved_ep = state.get("ep_size", state["world"])  # checkpoints before --ep-size: EP = all ranks
    if saved_ep != dctx.ep_size:
        raise ResumeError(f"--resume: checkpoint was written at EP size {saved_ep}, this job has {dctx.ep_size} "
                          "(each rank's file holds its own experts)")
    if state.get("fsdp", False) != fsdp:
        raise ResumeError(f"--resume: checkpoint was written {'with' if state.get('fsdp') else 'without'} --fsdp, "
                          f"this job runs {'with' if fsdp else 'without'} it")
    if fsdp:
        from .fsdp import load_local_state_dicts
        load_local_state_dicts(model, opt, state["model"], state["optimizer"])
    else:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng_cuda"], device)
    return int(state["step"])


def _allreduce_grads(model: GPT, dctx: Dist) -> None:
    """Average gradients over the W ranks: replicated ones summed over all W, the rank's own experts' (each
    already summing its EP group's tokens) over their R replicas, then both divided by W."""
    W = dctx.world
    expert = {id(p) for p in _expert_params(model)}
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in expert:
            dist.all_reduce(p.grad, group=dctx.group)
        elif dctx.expert_dp_group is not None:
            dist.all_reduce(p.grad, group=dctx.expert_dp_group)
        p.grad.div_(W)


class _Interrupt:
    """Ctrl-C finishes the current step, then the run saves a checkpoint and stops (single process)."""

    def __init__(self, enabled: bool):
        self.hit = False
        enabled = enabled and threading.current_thread() is threading.main_thread()
        self._old = signal.signal(signal.SIGINT, self._handler) if enabled else None

    def _handler(self, signum, frame):
        if self.hit:  # second Ctrl-C: give up immediately
            raise KeyboardInterrupt
        self.hit = True

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def run_config_dict(rc: RunConfig) -> dict:
    d = asdict(rc)
    d["model"]["moe"] = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(rc.model.moe).items()}
    return d


def _open_metrics(run_dir: Path | None, writes: bool, resume: bool, start: int) -> Path | None:
    """The run's metrics.jsonl (rank 0 with a run folder), truncated to the records before ``start``."""
    metrics_path = run_dir / "metrics.jsonl" if writes else None
    if metrics_path is not None:
        kept = []
        if resume and metrics_path.exists():  # drop records past the checkpoint: they are replayed exactly
            def before(rec):  # train record "step" = step index; validation "step" = steps completed
                return rec["step"] <= start if "val_loss" in rec else rec["step"] < start
            kept = [ln for ln in metrics_path.read_text().splitlines() if ln and before(json.loads(ln))]
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    return metrics_path


class _Metrics:
    """Per-step values kept on the device until a log flush moves them to the host in one transfer, then
    into ``result`` and metrics.jsonl; validation records; the throughput clock."""

    def __init__(self, rc: RunConfig, dctx: Dist, result: RunResult, metrics_path: Path | None, timer: StepTimer,
                 on_log):
        self.rc, self.dctx, self.result, self.metrics_path, self.timer, self.on_log = (
            rc, dctx, result, metrics_path, timer, on_log)
        self.tokens_per_step = rc.model.batch_size * rc.model.seq_len * dctx.world * rc.virtual_ranks
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.t_log = time.perf_counter()

    def flush(self, step: int) -> None:  # one host transfer for all steps since the last flush
        pending, dctx, C, result, cfg = self.pending, self.dctx, self.rc.virtual_ranks, self.result, self.rc.model
        if not pending:
            return
        # The logged loss of a step is the mean of all W*C rank/chunk losses, summed in fp64 (exact for
        # fp32 inputs of similar size, so any order gives the same bits) and rounded once to fp32: an
        # EP=W run and its EP=1 emulation log bitwise-equal losses whenever their chunk losses are equal.
        loss_P = torch.stack([p[0] for p in pending]).double().sum(1)
        aux_P = torch.stack([p[1] for p in pending]).double()
        load_PLE = torch.stack([p[2] for p in pending])
        if dctx.world > 1:
            packed = torch.cat([loss_P, aux_P])
            dist.all_reduce(packed, group=dctx.group)
            dist.all_reduce(load_PLE, group=dctx.group)
            loss_P, aux_P = packed.chunk(2)
        loss_P = (loss_P / (dctx.world * C)).float()
        aux_P = (aux_P / dctx.world).float()
        losses, auxes, loads = loss_P.tolist(), aux_P.tolist(), load_PLE.tolist()
        now = time.perf_counter()
        step_ms, moe_ms = self.timer.collect()
        tps = self.tokens_per_step * len(pending) / max(now - self.t_log, 1e-9)
        share = moe_ms / step_ms if step_ms > 0 else float("nan")
        first = step + 1 - len(pending)
        result.losses += losses
        result.aux_losses += auxes
        result.loads += loads
        result.tokens_per_s.append(tps)
        result.moe_share.append(share)
        if self.metrics_path is not None:
            with self.metrics_path.open("a") as f:
                for i, (lo, au, ld) in enumerate(zip(losses, auxes, loads)):
                    s = first + i
                    f.write(json.dumps({"step": s, "loss": lo, "aux_loss": au, "lr": lr_at(s, cfg),
                                        "tokens_per_s": tps, "moe_share": share, "expert_counts": ld}) + "\n")
        pending.clear()
        if dctx.main and self.on_log is not None:
            self.on_log(result, step)
        self.t_log = time.perf_counter()

    def log_val(self, step: int, model: GPT, vbatches, device: torch.device) -> None:
        marker = self.timer.checkpoint()
        v = evaluate(model, vbatches, device, self.rc, self.dctx)
        self.timer.discard_since(marker)
        self.result.val.append((step, v))
        if self.metrics_path is not None:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps({"step": step, "val_loss": v}) + "\n")
        self.t_log = time.perf_counter()  # evaluation time does not count as training throughput


def _train_step(model: GPT, opt, corpus: Corpus, rc: RunConfig, dctx: Dist, step: int, device: torch.device,
                fsdp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step; returns (chunk losses [C], aux loss, expert counts [L_, E]) on the device."""
    cfg, C = rc.model, rc.virtual_ranks
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    x_BS, y_BS = _batch(corpus, rc, dctx, step, device)
    with _autocast(device):
        logits_BSV = model(x_BS, chunks=C)
    loss, chunk_losses_C = _loss(logits_BSV, y_BS, C)
    auxes = [m.last_stats.aux_loss for m in model.moe_layers()]
    aux = torch.stack(auxes).sum() if auxes else torch.zeros((), device=device)
    opt.zero_grad(set_to_none=True)
    (loss + aux).backward()
    if fsdp:  # FSDP2 reduced the gradients in the backward
        from .fsdp import scale_expert_grads
        scale_expert_grads(model, dctx)
    elif dctx.world > 1:
        _allreduce_grads(model, dctx)
    opt.step()
    counts_LE = torch.stack([m.last_stats.tokens_per_expert_E for m in model.moe_layers()])
    for m in model.moe_layers():
        m.update_expert_bias()
    return chunk_losses_C, aux.detach(), counts_LE


def _finish(rc: RunConfig, dctx: Dist, run_dir: Path | None, writes: bool, model: GPT, opt, start: int, stop: int,
            device: torch.device, fsdp: bool, last_ids_TK) -> None:
    """The end-of-run checkpoint and routing trace."""
    if run_dir is not None and stop > start:
        if dctx.main:
            run_dir.mkdir(parents=True, exist_ok=True)
        if dctx.world > 1:
            dist.barrier(group=dctx.group)
        save_checkpoint(run_dir, dctx, model, opt, stop, device, fsdp=fsdp)
        if writes and rc.save_trace and last_ids_TK is not None:
            save_routing_trace(run_dir / "routing_trace.pt", last_ids_TK, rc.model.moe, rc.model.name)


def train(rc: RunConfig, dctx: Dist | None = None, *, resume: bool = False, corpus: Corpus | None = None,
          on_log=None) -> RunResult:
    """Run (or resume) training; writes metrics / checkpoint / trace / plot under ``rc.out_dir`` if set.

    ``on_log(result, step)`` is called on rank 0 after every log flush (the CLI's progress bar).
    Returns the per-step global losses etc. on every rank (host values, gathered at log time).
    """
    dctx = dctx or Dist()
    cfg = rc.model
    device = torch.device(rc.device)
    corpus = corpus if corpus is not None else load_corpus(rc.data)
    run_dir = Path(rc.out_dir) if rc.out_dir else None
    writes = run_dir is not None and dctx.main

    torch.manual_seed(rc.seed)
    fsdp = rc.fsdp and dctx.world > 1
    model = build_model(rc, dctx, device)
    opt = _make_optimizer(model, cfg.lr, cfg.weight_decay)
    start = 0
    if resume:
        if run_dir is None:
            raise ValueError("--resume needs the run folder (--out)")
        start = load_checkpoint(run_dir, dctx, model, opt, device, fsdp=fsdp)
    if writes:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / "config.json", {**run_config_dict(rc), "world": dctx.world, "ep_size": dctx.ep_size})
    metrics_path = _open_metrics(run_dir, writes, resume, start)

    result = RunResult(first_step=start, run_dir=run_dir)
    vbatches = val_batches(corpus, num_batches=cfg.eval_batches, batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    timer = StepTimer(device)
    timer.attach(model.moe_layers())
    interrupt = _Interrupt(enabled=dctx.world == 1 and (rc.progress or rc.catch_interrupt))
    log = _Metrics(rc, dctx, result, metrics_path, timer, on_log)
    t0 = time.perf_counter()
    last_ids_TK = None
    stop = cfg.steps if rc.stop_after is None else min(cfg.steps, rc.stop_after)
    try:
        with deterministic_algorithms(device):
            for step in range(start, stop):
                timer.step_begin()
                log.pending.append(_train_step(model, opt, corpus, rc, dctx, step, device, fsdp))
                timer.step_end()
                if step == stop - 1:
                    last_ids_TK = model.moe_layers()[-1].last_stats.topk_ids_TK
                done = step + 1
                if done % rc.log_every == 0 or done == stop or interrupt.hit:
                    log.flush(step)
                if done % cfg.eval_every == 0 or done == cfg.steps:
                    log.log_val(done, model, vbatches, device)
                if rc.ckpt_every and done % rc.ckpt_every == 0 and run_dir is not None and done != stop:
                    save_checkpoint(run_dir, dctx, model, opt, done, device, fsdp=fsdp)
                if interrupt.hit:
                    stop = done
                    break
    finally:
        interrupt.restore()
        timer.detach()
    log.flush(stop - 1)
    result.seconds = time.perf_counter() - t0
    _finish(rc, dctx, run_dir, writes, model, opt, start, stop, device, fsdp, last_ids_TK)
    result.model = model  # for summaries (parameter counts, expert bias)
    result.stopped_at = stop
    return result


def save_routing_trace(path: Path, topk_ids_TK: torch.Tensor, moe: MoEConfig, preset: str) -> None:
    """The last training batch's routing of the last MoE layer (rank 0's tokens), for megamoe.bench."""
    torch.save({"topk_ids_TK": topk_ids_TK.detach().to("cpu", torch.int64), "num_experts": moe.num_experts,
                "top_k": moe.top_k, "preset": preset}, path)
