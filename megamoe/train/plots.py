"""The run's picture: train / validation loss curves and a heatmap of expert load over steps.

Legend: P logged steps, L_ MoE layers, E experts.

Reads ``metrics.jsonl`` (so a resumed run plots its whole history) and writes ``training.png`` with
matplotlib's non-interactive Agg backend; :func:`plot_compare` draws the loss curves of several runs in one plot
(``--fp8-vs-bf16``). Load is shown as count / mean count per (layer, expert):
1.0 is perfect balance; the aux-loss-free bias should pull every row toward it over the run.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_metrics", "plot_compare", "plot_run"]


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(train records, validation records) of a metrics.jsonl file, each sorted by step."""
    train, val = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            (val if "val_loss" in rec else train).append(rec)
    return sorted(train, key=lambda r: r["step"]), sorted(val, key=lambda r: r["step"])


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot_run(run_dir: Path, title: str = "") -> Path:
    """Write ``run_dir/training.png`` from ``run_dir/metrics.jsonl``; returns its path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    train, val = read_metrics(Path(run_dir) / "metrics.jsonl")
    if not train:
        raise ValueError(f"plot_run: {run_dir}/metrics.jsonl has no training records")
    steps = [r["step"] + 1 for r in train]  # loss of step s is measured before update s: plot at s + 1
    loss = [r["loss"] for r in train]
    fig, (ax_loss, ax_load) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.3]})

    ax_loss.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8)
    ax_loss.plot(steps, _smooth(loss, max(1, len(loss) // 50)), color="tab:blue", lw=1.6, label="train")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="tab:orange",
                     lw=1.6, label="validation")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats / byte)")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()

    counts_PLE = np.asarray([r["expert_counts"] for r in train], dtype=np.float64)
    P, L, E = counts_PLE.shape
    ratio_PLE = counts_PLE / np.maximum(counts_PLE.mean(axis=2, keepdims=True), 1e-9)
    img = ratio_PLE.reshape(P, L * E).T  # rows: (layer, expert), columns: steps
    vmax = max(2.0, float(np.percentile(img, 99)))
    im = ax_load.imshow(img, aspect="auto", interpolation="nearest", cmap="magma", vmin=0.0, vmax=vmax,
                        extent=(steps[0] - 0.5, steps[-1] + 0.5, L * E, 0))
    for layer in range(1, L):
        ax_load.axhline(layer * E, color="white", lw=0.6)
    ax_load.set_yticks([layer * E + E / 2 for layer in range(L)], [f"layer {layer}" for layer in range(L)])
    ax_load.set_xlabel("step")
    ax_load.set_title(f"expert load / mean ({E} experts per layer; 1 = balanced)")
    fig.colorbar(im, ax=ax_load, fraction=0.04)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_compare(runs: dict[str, Path], path: Path, title: str = "") -> Path:
    """One plot of the train (smoothed) and validation losses of several runs, e.g. ``{"bf16": dir, "fp8": dir}``
    (each a run folder with metrics.jsonl); written to ``path``, returned."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (label, run_dir), color in zip(runs.items(), ("tab:blue", "tab:red", "tab:green", "tab:purple")):
        train, val = read_metrics(Path(run_dir) / "metrics.jsonl")
        if not train:
            raise ValueError(f"plot_compare: {run_dir}/metrics.jsonl has no training records")
        steps = [r["step"] + 1 for r in train]
        loss = [r["loss"] for r in train]
        ax.plot(steps, loss, color=color, alpha=0.2, lw=0.8)
        ax.plot(steps, _smooth(loss, max(1, len(loss) // 50)), color=color, lw=1.6, label=f"{label} train")
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=color, lw=1.2,
                    label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title or "loss, same seed and data")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
