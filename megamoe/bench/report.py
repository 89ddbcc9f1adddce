"""Benchmark output: FLOP/byte formulas, the fixed-width table, CSV, JSON and a PNG chart.

Legend: T tokens per rank, D hidden, F expert FFN, K top-k, S shared FFN, L local experts, W EP size.

FLOPs (per rank, counted on its own T tokens; DeepGEMM MegaMoE / MoK / SonicMoE convention):
  routed forward   6 * T * K * D * F   (gate+up GEMM 2*T*K*D*2F, down GEMM 2*T*K*F*D)
  shared forward   6 * T * D * S
  backward         2 x forward (dgrad + wgrad), so forward+backward = 3 x forward.
The TFLOP/s column counts **routed FLOPs only** (3 x routed forward over the fwd+bwd median time); the
shared expert is work every provider also does, so including it would flatter no one; its FLOPs are in
the CSV. "% peak" = TFLOP/s over the dense matmul TFLOP/s measured in the same run (for the FP8 providers:
over the dense FP8 e4m3 matmul TFLOP/s measured in the same run).
Bytes (per rank, in the CSV/JSON): ``dispatch_bytes`` = (token, slot) rows sent to other ranks x D x
element size (each direction; the combine moves the same amount back); ``weight_bytes`` = L * 3 * D * F x
element size (the routed weights read once per forward).
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field

import torch

from .timing import Stats

__all__ = ["Row", "flops", "dispatch_bytes", "run_metadata", "format_table", "write_outputs", "VARIANT_ARGS"]

# command-line settings that select a variant of megamoe (megamoe.config.KernelConfig / EPOptions), recorded apart
# in the metadata so that A/B runs can be grouped by them (megamoe.bench.ab_summary)
VARIANT_ARGS = ("tiles", "ep_pull_programs", "ep_comm_sms", "ep_push_kernel")


def flops(cfg, T: int) -> dict[str, int]:
    """Forward FLOPs per rank: {'routed_fwd', 'shared_fwd'} (see module docstring)."""
    return {"routed_fwd": cfg.routed_flops_fwd(T),
            "shared_fwd": 6 * T * cfg.hidden_size * cfg.shared_intermediate_size}


def dispatch_bytes(topk_ids_TK: torch.Tensor, rank: int, local_experts: int, hidden: int, elem: int) -> int:
    """Bytes of (token, slot) rows this rank sends to other ranks in one dispatch."""
    remote = (topk_ids_TK.reshape(-1).cpu() // local_experts != rank).sum().item()
    return int(remote) * hidden * elem


@dataclass
class Row:
    """One (case, provider) result. Times in ms (median, p20, p80), memory in GiB, NaN when not run."""

    preset: str
    tokens: int
    routing: str
    provider: str
    status: str                      # ok | skip | fail | error
    note: str = ""
    fwd: Stats = field(default_factory=Stats.empty)
    bwd: Stats = field(default_factory=Stats.empty)
    fwdbwd: Stats = field(default_factory=Stats.empty)
    peak_mem_gib: float = math.nan
    routed_flops_fwd: int = 0
    shared_flops_fwd: int = 0
    dispatch_bytes: int = 0
    weight_bytes: int = 0
    check_worst: str = ""
    fp8: bool = False                # routed experts in FP8: % peak against the dense FP8 rate
    tflops: float = math.nan
    pct_peak: float = math.nan
    speedup: dict = field(default_factory=dict)

    @property
    def case(self) -> str:
        return f"{self.preset} T={self.tokens} {self.routing}"


def finalize(rows: list[Row], matmul_tflops: float, baselines: list[str], fp8_matmul_tflops: float = math.nan) -> None:
    """Fill TFLOP/s, % of peak (FP8 rows: of ``fp8_matmul_tflops``), and speedup (baseline fwd+bwd / this fwd+bwd)
    for every row."""
    by_case: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.provider] = r
    for r in rows:
        ms = r.fwdbwd.median
        if r.status == "ok" and ms > 0:
            r.tflops = 3 * r.routed_flops_fwd / (ms * 1e-3) / 1e12
            peak = fp8_matmul_tflops if r.fp8 else matmul_tflops
            r.pct_peak = 100 * r.tflops / peak if peak > 0 else math.nan
        for b in baselines:
            base = by_case[r.case].get(b)
            if b != r.provider and base is not None and base.status == "ok" and r.status == "ok":
                r.speedup[b] = base.fwdbwd.median / ms


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001 - metadata is best effort
        return ""


def run_metadata(device: torch.device, world_size: int, args: dict) -> dict:
    """GPU, driver, CUDA, torch, triton, commit, world size, host and the command-line settings."""
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        triton_v = "n/a"
    # --commit names the commit where the tree has no .git (e.g. a copied working tree on a GPU host)
    commit = args.get("commit") or _sh(["git", "rev-parse", "--short=12", "HEAD"]) or "unknown"
    if commit != "unknown" and _sh(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += "-dirty"
    cuda = device.type == "cuda"
    return {
        "gpu": torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": (_sh(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines() or
                   ["n/a"])[0] if cuda else "n/a",
        "cuda": torch.version.cuda or "n/a",
        "torch": torch.__version__,
        "triton": triton_v,
        "commit": commit,
        "world_size": world_size,
        "host": platform.node(),
        "python": platform.python_version(),
        "settings": args,
        # the variant of megamoe this run measured (what differs from the defaults): tile overrides (--tiles), the
        # EP path's pull beside the first GEMM, SMs left to the exchange, result-row push (--ep-*)
        "variant": {k: args[k] for k in VARIANT_ARGS if args.get(k)},
    }


def _fmt(x: float, spec: str = "8.2f") -> str:
    width = spec.split(".")[0]
    if not (isinstance(x, (int, float)) and math.isfinite(x)):
        return format("-", ">" + width)
    if x != 0 and abs(x) < 0.1:  # CPU smoke runs: keep small rates readable
        return format(x, width + ".2g")
    return format(x, spec)


def routing_label(spec: str, width: int = 16) -> str:
    """A routing spec shortened for the table: ``trace:/a/b/run/routing_trace.pt`` -> ``trace:run``."""
    if spec.startswith("trace:"):
        parent = os.path.basename(os.path.dirname(spec[len("trace:"):])) or "file"
        spec = "trace:" + parent
    return spec if len(spec) <= width else spec[:width - 1] + "~"


def format_table(rows: list[Row], baselines: list[str]) -> str:
    """One fixed-width line per (case, provider) (the provider column as wide as the longest name)."""
    pw = max([10] + [len(r.provider) for r in rows])
    head = (f"{'preset':<14} {'T':>6} {'routing':<16} {'provider':<{pw}} {'fwd ms':>8} {'bwd ms':>8} "
            f"{'f+b ms':>8} {'p20-p80 f+b':>15} {'TFLOP/s':>8} {'%peak':>6} {'mem GiB':>8} "
            + " ".join(f"{'x vs ' + b:>10}" for b in baselines) + "  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = (f"{r.fwdbwd.p20:.2f}-{r.fwdbwd.p80:.2f}" if r.status == "ok" else "-")
        sp = " ".join(_fmt(r.speedup.get(b, math.nan), "10.2f") for b in baselines)
        note = r.note or (f"check: worst {r.check_worst}" if r.check_worst else "unchecked" if r.status == "ok" else "")
        status = r.status + (f" ({note})" if note else "")
        lines.append(f"{r.preset:<14} {r.tokens:>6} {routing_label(r.routing):<16} {r.provider:<{pw}} "
                     f"{_fmt(r.fwd.median)} "
                     f"{_fmt(r.bwd.median)} {_fmt(r.fwdbwd.median)} {spread:>15} {_fmt(r.tflops, '8.1f')} "
                     f"{_fmt(r.pct_peak, '6.1f')} {_fmt(r.peak_mem_gib)} {sp}  {status}")
    return "\n".join(lines)


def _flat(r: Row, baselines: list[str]) -> dict:
    d = {k: v for k, v in asdict(r).items() if k not in ("fwd", "bwd", "fwdbwd", "speedup")}
    for mode in ("fwd", "bwd", "fwdbwd"):
        s: Stats = getattr(r, mode)
        d.update({f"{mode}_ms": s.median, f"{mode}_p20_ms": s.p20, f"{mode}_p80_ms": s.p80, f"{mode}_n": s.n})
    for b in baselines:
        d[f"speedup_vs_{b}"] = r.speedup.get(b, math.nan)
    return d


def _plot(rows: list[Row], path: str, meta: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    provs = list(dict.fromkeys(r.provider for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) * max(1, len(provs)) / 2), 4.5))
    width = 0.8 / max(1, len(provs))
    for i, p in enumerate(provs):
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(cases):
            r = next((r for r in rows if r.case == c and r.provider == p and r.status == "ok"), None)
            if r is None:
                continue
            xs.append(j + (i - (len(provs) - 1) / 2) * width)
            ys.append(r.fwdbwd.median)
            lo.append(r.fwdbwd.median - r.fwdbwd.p20)
            hi.append(r.fwdbwd.p80 - r.fwdbwd.median)
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=p)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace(" ", "\n", 1) for c in cases], fontsize=8)
    ax.set_ylabel("forward+backward ms (median, p20-p80)")
    ax.set_title(f"{meta['gpu']} x{meta['world_size']}, torch {meta['torch']}, commit {meta['commit']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out_dir: str, rows: list[Row], meta: dict, ceilings: dict, baselines: list[str],
                  cases: list[dict], table: str) -> dict[str, str]:
    """Write results.csv, results.json, results.png and results.txt into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"results.{k}") for k in ("csv", "json", "png", "txt")}
    flat = [_flat(r, baselines) for r in rows]
    meta_cols = {k: v for k, v in meta.items() if k != "settings"}
    with open(paths["csv"], "w", newline="") as f:
        cols = list(flat[0].keys()) + list(meta_cols) + list(ceilings) if flat else list(meta_cols)
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for d in flat:
            w.writerow({**d, **meta_cols, **ceilings})
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "ceilings": ceilings, "cases": cases, "results": flat}, f, indent=1,
                  default=str)
    with open(paths["txt"], "w") as f:
        f.write(table + "\n")
    _plot(rows, paths["png"], meta)
    return paths
