"""Terminal output of a training run: the progress bar and the one-screen summary at the end.

Legend: L_ MoE layers, E experts.
"""

from __future__ import annotations

import statistics

import torch

from .loop import RunConfig, RunResult

__all__ = ["ProgressBar", "final_loss", "param_counts", "steady_rate", "summary"]


class ProgressBar:
    """tqdm bar over the steps, updated at every log flush with loss, tokens/s and the MoE time share.
    Disabled with ``say`` given (``--no-progress``): the same numbers as one plain line per log flush, for
    logs and pipes."""

    def __init__(self, total: int, initial: int, enabled: bool, say=None):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
        self.done, self.total, self.say = initial, total, say

    def __call__(self, result: RunResult, step: int) -> None:
        if self.bar is None and self.say is None:
            return
        post = {"loss": f"{result.losses[-1]:.3f}", "tok/s": f"{result.tokens_per_s[-1]:,.0f}",
                "moe": f"{100 * result.moe_share[-1]:.0f}%"}
        if result.val:
            post["val"] = f"{result.val[-1][1]:.3f}"
        if self.bar is None:
            self.say(f"step {step + 1}/{self.total}  " + "  ".join(f"{k} {v}" for k, v in post.items()))
            return
        if self.done == 0 and result.first_step:  # resumed run: start the bar at the checkpoint
            self.done = result.first_step
            self.bar.update(self.done)
        self.bar.set_postfix(post, refresh=False)  # before update(), which redraws: no one-interval lag
        self.bar.update(step + 1 - self.done)
        self.done = step + 1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def param_counts(model) -> tuple[int, int]:
    """(total parameters of this rank's model as if EP=1, parameters active per token)."""
    total = active = 0
    for name, p in model.named_parameters():
        if ".moe.experts." in name:
            continue
        total += p.numel()
        active += p.numel()
    for m in model.moe_layers():
        c = m.config
        per_expert = 3 * c.hidden_size * c.moe_intermediate_size
        total += c.num_experts * per_expert
        active += c.top_k * per_expert
    return total, active


def _balance(loads_LE: list[list[int]]) -> float:
    """Mean over layers of max load / mean load (1.0 = perfectly balanced)."""
    vals = []
    for counts in loads_LE:
        mean = sum(counts) / len(counts)
        vals.append(max(counts) / mean if mean else float("nan"))
    return sum(vals) / len(vals)


def final_loss(res: RunResult) -> float:
    """The run's final train loss: the mean of its last k logged steps, k = min(10, steps / 5) (as in the
    summary)."""
    n = len(res.losses)
    if not n:
        raise ValueError("final_loss: the run has no logged steps")
    k = max(1, min(10, n // 5))
    return statistics.fmean(res.losses[-k:])


def steady_rate(res: RunResult) -> float:
    """The run's tokens/s: the median over log intervals after the first (the first includes compilation and
    warm-up), or the only interval's; NaN without any."""
    steady = res.tokens_per_s[1:] or res.tokens_per_s
    return statistics.median(steady) if steady else float("nan")


def summary(rc: RunConfig, res: RunResult, *, world: int, device_name: str, layout: str | None = None,
            ep_size: int | None = None) -> str:
    """The one-screen end-of-run report (plain text); ``layout`` e.g. "EP=2 x DP=2" (default "EP=<world>");
    ``ep_size`` (default ``world``) goes into the resume command of a stopped torchrun job."""
    cfg, moe = rc.model, rc.model.moe
    total, active = param_counts(res.model)
    n = len(res.losses)
    lines = ["", "=" * 78,
             f"megamoe.train  preset={cfg.name}  backend={rc.backend}  device={device_name}  {layout or f'EP={world}'}",
             f"model: {cfg.n_layer} layers, D={cfg.d_model}, {cfg.n_head} heads; MoE E={moe.num_experts} "
             f"K={moe.top_k} F={moe.moe_intermediate_size} shared S={moe.shared_intermediate_size} "
             f"groups {moe.topk_group}/{moe.n_group}, experts in {str(moe.dtype).replace('torch.', '')}"
             + (" (GEMMs in block-scaled FP8)" if rc.fp8 else ""),
             f"params: {total / 1e6:.2f} M total, {active / 1e6:.2f} M active per token",
             f"data: {cfg.batch_size} x {cfg.seq_len} bytes per rank per step, "
             f"{cfg.batch_size * cfg.seq_len * world * rc.virtual_ranks:,} tokens per step"]
    if n and res.first_step:
        lines.append(f"resumed at step {res.first_step}: the numbers below cover steps {res.first_step + 1}-"
                     f"{res.first_step + n} (earlier steps are in metrics.jsonl)")
    if n:
        k = max(1, min(10, n // 5))
        first = statistics.fmean(res.losses[:k])
        last = final_loss(res)
        lines.append(f"train loss: {first:.3f} -> {last:.3f} (mean of first / last {k} logged steps; "
                     f"uniform bytes = {torch.log(torch.tensor(256.0)).item():.3f})")
    if res.val:
        lines.append("val loss:   " + "  ".join(f"{v:.3f}@{s}" for s, v in res.val[-6:]))
    if res.tokens_per_s:
        shares = [s for s in res.moe_share[1:] or res.moe_share if s == s]
        basis = ("median over log intervals after the first" if len(res.tokens_per_s) > 1 else
                 "the only log interval, start-up included: run more steps for a steady rate")
        moe_pct = 100 * statistics.median(shares) if shares else float("nan")
        lines.append(f"speed: {steady_rate(res):,.0f} tokens/s ({basis}); MoE layers {moe_pct:.0f}% "
                     f"of step time; training loop {res.seconds:.1f} s (setup and data loading not included)")
    path = res.model.attention_path() if res.model is not None else None
    if path is not None:
        lines.append(f"attention: {path} (--attention {rc.attention}"
                     + ("; 'fast' drops the bitwise reproducibility for speed)" if rc.attention != "fast" else ")"))
    if res.loads:
        lines.append(f"expert balance (max/mean load, mean over layers): first step "
                     f"{_balance(res.loads[0]):.2f} -> last step {_balance(res.loads[-1]):.2f}")
        bias = [m.expert_bias_E for m in res.model.moe_layers() if m.expert_bias_E is not None]
        if bias:
            b = torch.stack([x.detach().float().cpu() for x in bias])
            lines.append(f"expert bias range after training: [{b.min().item():+.4f}, {b.max().item():+.4f}]")
    if res.run_dir is not None:
        lines.append(f"run folder: {res.run_dir}/  (metrics.jsonl, checkpoint*.pt, routing_trace.pt, "
                     "training.png, config.json)")
        if res.stopped_at < cfg.steps:
            launch = "python -m megamoe.train" if world == 1 else \
                f"torchrun --nproc-per-node {world} -m megamoe.train"  # (per node, on several nodes)
            ep = "" if world == 1 or ep_size in (None, world) else f" --ep-size {ep_size}"
            lines.append(f"stopped after {res.stopped_at}/{cfg.steps} steps; continue with: "
                         f"{launch} --out {res.run_dir} --resume{ep}")
    lines.append("=" * 78)
    return "\n".join(lines)
