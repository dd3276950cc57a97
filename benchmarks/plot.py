"""The benchmark's plot: per op and shape, cuLA's speedup over FLA (and over FlashInfer where timed), the fraction
of the floor it reaches, and its error against the reference it was checked with. matplotlib is optional
(``pip install -e '.[bench]'``): without it the plot is skipped and the run says so.

Redraw from a benchmark's JSON (for instance a run stopped before its end):

    python -m benchmarks.plot results/benchmark.json [--out results/BENCHMARK.png]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# (title, [(row field, legend)], x-axis): one panel each; a field no row has is left out, a panel with none says so
PANELS = [
    ("speedup (x)", [("speedup", "over FLA"), ("speedup_vs_flashinfer", "over FlashInfer")], "linear"),
    ("fraction of the floor", [("floor_fraction", "floor ms / cuLA ms")], "linear"),
    ("cuLA's rel RMSE vs FLA", [("rel_rmse", "output or final state, the larger")], "log"),
]


def log_axis_range(values: list[float]) -> tuple[float, float] | None:
    """None where a log axis suits these positive values; else the linear range that replaces it. Within about a
    decade a log axis labels its minor ticks, which overlap, and a linear range fitted to close values labels digits
    that overlap: from zero instead, where a few ticks read the level."""
    if not values or max(values) >= 20 * min(values):
        return None
    return 0.0, 1.15 * max(values)


def write_plot(rows: list[dict], path: Path, title: str) -> str:
    """Draws ``rows`` (the JSON's rows) into the PNG ``path``; returns what it did, for the run's log and table."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "skipped: matplotlib is not installed (pip install -e '.[bench]')"
    several_modes = len({r["mode"] for r in rows}) > 1
    labels = [f"{r['op']} {r['shape']}" + (f" {r['mode']}" if several_modes else "") for r in rows]
    fig = Figure(figsize=(16, 1.5 + 0.3 * max(len(rows), 4)), layout="constrained")
    fig.suptitle(title)
    axes = fig.subplots(1, len(PANELS), sharey=True)
    for ax, (panel, series, scale) in zip(axes, PANELS, strict=True):
        ax.set_title(panel, fontsize=10)
        ax.set_xscale(scale)
        ax.grid(axis="x", alpha=0.3)
        drawn = [(field, legend) for field, legend in series if any(r.get(field) is not None for r in rows)]
        height = 0.8 / max(len(drawn), 1)
        for i, (field, legend) in enumerate(drawn):
            values = [math.nan if r.get(field) is None else r[field] for r in rows]  # nan: nothing drawn
            at = [y - 0.4 + (i + 0.5) * height for y in range(len(rows))]
            if scale == "log":  # markers: a bar's length from an arbitrary left edge would mean nothing
                ax.plot(values, at, "o", label=legend)
            else:
                bars = ax.barh(at, values, height=height, label=legend)
                ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
        finite = [r[f] for r in rows for f, _ in drawn if r.get(f) is not None and r[f] > 0]
        if scale == "log" and log_axis_range(finite) is not None:
            from matplotlib.ticker import MaxNLocator

            ax.set_xscale("linear")
            ax.set_xlim(*log_axis_range(finite))
            ax.xaxis.set_major_locator(MaxNLocator(4))
            ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
        if not drawn:
            ax.text(0.5, 0.5, "not measured in this run", transform=ax.transAxes, ha="center", color="gray")
        elif len(drawn) > 1:
            ax.legend(fontsize=8)
        if panel.startswith("speedup") and drawn:
            ax.axvline(1.0, color="black", lw=0.8)  # parity
        if panel.startswith("fraction") and drawn:
            ax.set_xlim(0, 1)
    axes[0].set_yticks(range(len(rows)), labels, fontsize=8)
    axes[0].invert_yaxis()  # first row on top, as in the table
    fig.savefig(path, dpi=110)
    return f"written to {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="a benchmark's JSON (python -m benchmarks.run --json FILE)")
    parser.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the JSON, same name)")
    args = parser.parse_args(argv)
    result = json.loads(args.json.read_text())
    out = args.out or args.json.with_suffix(".png")
    print(f"plot {write_plot(result['rows'], out, 'cuLA vs FLA: ' + result['env'].get('gpu', ''))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
