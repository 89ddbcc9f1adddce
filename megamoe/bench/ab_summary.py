"""One table from interleaved A/B benchmark runs: ``python -m megamoe.bench.ab_summary DIR [DIR ...]``.

Reads ``results.json`` in each DIR (or under it), as written by ``python -m megamoe.bench`` (for instance by
``scripts/gpu_all.sh abtiles``), groups the runs by the megamoe variant recorded in their metadata
(``meta.variant``: ``--tiles``, ``--ep-pull-programs``, ``--ep-comm-sms``, ``--ep-push-kernel``; older runs
recorded environment switches in ``meta.env``, read the same way; runs without any are "table"),
or by folder name with ``--by-folder`` (older runs that did not record their switches), and prints, per
(preset, tokens, routing, provider) and group, the forward+backward medians of every repetition, their median,
and the difference from the reference group (default "table", else the first group seen). Only rows whose
correctness check passed ("ok") are used; a group with a failed check is listed with its status.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

__all__ = ["load_runs", "summarize", "main"]


def _label(meta: dict, folder: Path, by_folder: bool) -> str:
    if by_folder:
        return folder.name
    variant = {**(meta.get("env") or {}), **(meta.get("variant") or {})}
    parts = [f"{k}={v}" for k, v in sorted(variant.items()) if v != ""]
    return " ".join(parts) or "table"


def load_runs(dirs: list[str], *, by_folder: bool = False) -> list[tuple[str, dict]]:
    """[(group label, result row)] of every results.json found in or under ``dirs`` (sorted by path)."""
    runs = []
    for d in dirs:
        root = Path(d)
        if root.is_file():
            files = [root] if root.suffix == ".json" else []  # a shell glob may also name the .log files
        else:
            files = sorted(root.rglob("results.json"))
        for f in files:
            js = json.loads(f.read_text())
            label = _label(js.get("meta", {}), f.parent, by_folder)
            runs += [(label, row) for row in js.get("results", [])]
    return runs


def summarize(runs: list[tuple[str, dict]], reference: str = "table") -> str:
    """The A/B table as text (see the module docstring)."""
    by_case: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    order: list[str] = []
    for label, row in runs:
        if label not in order:
            order.append(label)
        key = (row["preset"], row["tokens"], row["routing"], row["provider"])
        by_case[key][label].append(row)
    ref = reference if reference in order else (order[0] if order else reference)
    lines = [f"{'case':40s} {'group':52s} {'f+b ms per run':26s} {'median':>8s} {'vs ' + ref[:12]:>16s}"]
    for key in sorted(by_case):
        groups = by_case[key]
        ok = {g: [r["fwdbwd_ms"] for r in rows if r.get("status") == "ok"] for g, rows in groups.items()}
        base = statistics.median(ok[ref]) if ok.get(ref) else None
        case = f"{key[0]}:{key[1]} {key[2]} {key[3]}"
        for g in order:
            if g not in groups:
                continue
            times = ok[g]
            if not times:
                status = ",".join(sorted({r.get("status", "?") for r in groups[g]}))
                lines.append(f"{case:40s} {g[:52]:52s} {'(' + status + ')':26s}")
                continue
            med = statistics.median(times)
            diff = "" if base is None or g == ref else f"{med - base:+.2f} ({100 * (med / base - 1):+.1f}%)"
            lines.append(f"{case:40s} {g[:52]:52s} {' '.join(f'{t:.2f}' for t in times):26s} {med:8.2f} {diff:>16s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megamoe.bench.ab_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="benchmark output folders (or results.json files)")
    ap.add_argument("--by-folder", action="store_true", help="group by folder name instead of the recorded switches")
    ap.add_argument("--reference", default="table", help="the group the others are compared with (default: table)")
    args = ap.parse_args(argv)
    runs = load_runs(args.dirs, by_folder=args.by_folder)
    if not runs:
        ap.error(f"no results.json under {args.dirs}")
    print(summarize(runs, args.reference))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
