"""The Pareto figure and files of a directory of runs.

    python -m hbp.report.pareto outputs/bench/matrix --out outputs/bench

writes pareto.md, pareto.csv and pareto.png into --out (`write_pareto`); when --out holds
optimum.csv (experiments/bench_optimum.py), the figure also shows the optimum's predicted
recompute frontier beside the runs' measured recompute. `python -m hbp.report` draws the same
figure with the rest of the report.

The figure (`plot_pareto`): one column per workload; top, peak against step time; bottom,
peak against recompute FLOPs. Both relative to naive (NOTE [ One naive per run ] in
hbp.analysis.collect) where the runs know their naive, else in MiB and ms with a line saying
so. Every mode in its colour and marker (hbp.report.style), the points of one mode joined in
order of peak and labelled with the parameter they vary (tiny's budget, checkpoint's
block_size), the Pareto front as a grey step line, noisy times hollow, one legend.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import pandas as pd

from hbp.analysis.collect import MIB, collect, to_markdown
from hbp.analysis.pareto import pareto_table, read_optimum
from hbp.report.style import (
    MODE_COLORS,
    NOISY_SPREAD,
    mode_handles,
    mode_style,
    no_data,
    pyplot,
    save_figure,
)

__all__ = ["main", "mode_family", "plot_pareto", "write_pareto"]

_PARAM = re.compile(r"(\w+)=([^,()]+)")


def mode_family(table: pd.DataFrame) -> pd.Series:
    """Each row's mode without its parameters; "jax tiny" for another framework's."""
    families = table["mode"].str.split("(", n=1).str[0]
    if "framework" in table:
        families = families.where(
            table["framework"].fillna("torch") == "torch", table["framework"] + " " + families
        )
    return families


def _params(label: str) -> dict[str, str]:
    return dict(_PARAM.findall(label.partition("(")[2]))


def _point_labels(rows: pd.DataFrame) -> tuple[list[str], list[str]]:
    """What tells a mode's points apart: (the parameters that vary among them, each point's
    values of those, joined by ", "). A budget is always shown, even on a single point."""
    params = [_params(label) for label in rows["mode"]]
    keys = sorted({k for p in params for k in p})
    varying = [k for k in keys if len({p.get(k) for p in params}) > 1]
    if "budget" in keys and "budget" not in varying:
        varying.insert(0, "budget")
    return varying, [", ".join(p.get(k, "-") for k in varying) for p in params]


def plot_pareto(table: pd.DataFrame, path: str | Path, optimum: pd.DataFrame | None = None) -> Path:
    """The Pareto figure of `pareto_table`'s table (or `comparison_table`'s), saved as a PNG
    at `path`. `optimum`: experiments/bench_optimum.py's table (graphs "small"), drawn on the
    recompute panels: the MILP's best schedule per budget, its proven lower bound and the
    planner's prediction."""
    plt = pyplot()
    workloads = list(dict.fromkeys(table["workload"]))
    fig, axes = plt.subplots(
        2, len(workloads), figsize=(4.6 * len(workloads) + 0.6, 8.2), squeeze=False
    )
    families_seen: list[str] = []
    labelled: dict[str, list[str]] = {}  # family -> the parameters its point labels show
    extra_handles = []
    any_noisy = any_front = False
    for col, workload in enumerate(workloads):
        rows = table[table["workload"] == workload]
        relative = bool(rows["peak / naive"].notna().all())
        x = "peak / naive" if relative else "peak MiB"
        time_relative = (
            bool(rows["time / naive"].notna().any()) if "time / naive" in rows else False
        )
        top_y = "time / naive" if time_relative else "step ms"
        notes = []
        if not relative:
            notes.append("no naive run in this directory: peaks shown in MiB")
        if not time_relative:
            notes.append("no naive time (none, or noisy): times in ms")
        families = mode_family(rows)
        axes[0, col].set_title(workload + "".join(f"\n{n}" for n in notes), fontsize=10)
        for ax, y in zip(axes[:, col], (top_y, "recompute ratio")):
            drawn = rows.dropna(subset=[x, y])
            if drawn.empty:
                what = "step times" if y == top_y else "FLOP counts (count_naive_flops=true)"
                no_data(ax, f"no {what} for {workload}")
                continue
            for family in dict.fromkeys(families[drawn.index]):
                pts = drawn[families[drawn.index] == family].sort_values(x)
                style = mode_style(family)
                noisy = pts.get("noisy", pd.Series(False, index=pts.index)).fillna(False)
                noisy = noisy.astype(bool) & (y == top_y)
                ax.plot(pts[x], pts[y], **{**style, "marker": ""}, alpha=0.6)
                clean = pts[~noisy]
                ax.plot(clean[x], clean[y], **{**style, "linestyle": ""})
                if noisy.any():
                    any_noisy = True
                    hollow = {**style, "linestyle": "", "markerfacecolor": "white"}
                    ax.plot(pts[noisy][x], pts[noisy][y], **hollow)
                varying, texts = _point_labels(pts)
                for k, ((_, row), text) in enumerate(zip(pts.iterrows(), texts)):
                    if text:  # alternate above / below: neighbours with equal y stay legible
                        ax.annotate(
                            text, (row[x], row[y]), xytext=(4, 5 if k % 2 == 0 else -11),
                            textcoords="offset points", fontsize=7, color=style["color"],
                        )  # fmt: skip
                families_seen.append(family)
                labelled.setdefault(family, varying)
            if y == top_y and "pareto" in drawn:
                front = drawn[drawn["pareto"].fillna(False).astype(bool)].sort_values(x)
                if len(front) > 1:
                    any_front = True
                    ax.step(front[x], front[y], where="post", color="#888888", lw=2.5,
                            alpha=0.35, zorder=0)  # fmt: skip
            if relative:
                ax.axvline(1.0, color="#bbbbbb", lw=0.8, zorder=0)
            if y != "step ms":
                ax.axhline(0.0 if y == "recompute ratio" else 1.0, color="#bbbbbb", lw=0.8,
                           zorder=0)  # fmt: skip
            ax.grid(alpha=0.3)
            ax.set_xlabel("peak memory / naive's" if relative else "peak memory (MiB)")
        if optimum is not None and relative:
            naive = rows["peak MiB"] / rows["peak / naive"]
            naive_bytes = float(naive.iloc[0]) * MIB if len(naive) else None
            extra_handles += _plot_optimum(axes[1, col], optimum, workload, naive_bytes)
        axes[0, col].set_ylabel(
            "step time / naive's (median)" if time_relative else "step time (ms, median)"
        )
        axes[1, col].set_ylabel("recompute FLOPs / naive step's")
    from matplotlib.lines import Line2D

    handles = mode_handles(sorted(dict.fromkeys(families_seen), key=_mode_order))
    for handle in handles:
        if labelled.get(handle.get_label()):
            handle.set_label(
                f"{handle.get_label()} (points: {', '.join(labelled[handle.get_label()])})"
            )
    if any_front:
        handles.append(Line2D([], [], color="#888888", lw=2.5, alpha=0.35, label="Pareto front"))
    if any_noisy:
        handles.append(
            Line2D([], [], color="#444444", marker="o", ls="", markerfacecolor="white",
                   label=f"noisy time (p90/p10 > {NOISY_SPREAD}): off the front")
        )  # fmt: skip
    by_label = {h.get_label(): h for h in [*handles, *extra_handles]}
    fig.legend(
        handles=list(by_label.values()), loc="lower center", ncol=min(6, len(by_label)),
        fontsize=8, frameon=False,
    )  # fmt: skip
    rows_of_legend = math.ceil(len(by_label) / min(6, len(by_label)))
    fig.tight_layout(rect=(0, 0.035 * rows_of_legend + 0.01, 1, 1))
    return save_figure(fig, path, dpi=110)


def _mode_order(family: str) -> tuple:
    """Legend order: the modes in MODE_COLORS' order, torch's before another framework's."""
    name = family.split()[-1]
    order = list(MODE_COLORS)
    return (order.index(name) if name in order else len(order), family != name, family)


def _plot_optimum(ax, optimum: pd.DataFrame, workload: str, naive_bytes: float | None = None):
    """The MILP's frontier for one workload: budget / naive (x; `naive_bytes` = the runs'
    naive peak, so the points share the runs' axis even where tiny's graph differs from
    naive's, as gpt2's chunked loss does; default: the graph's own naive peak) against the
    recompute ratios (y). Returns the legend handles drawn."""
    rows = optimum[(optimum["workload"] == workload) & (optimum["graphs"] == "small")]
    naive = rows["naive_peak_bytes"] if naive_bytes is None else naive_bytes
    rows = rows.assign(x=rows["budget_bytes"] / naive).sort_values("x")
    handles = []
    for column, style, color, label in (
        ("best_found_ratio", ":+", "#000000", "MILP best found"),
        ("bound_ratio", "--", "#000000", "MILP lower bound"),
        ("planner_ratio", ":x", MODE_COLORS["tiny"], "planner (predicted)"),
    ):
        pts = rows.dropna(subset=[column])
        if not pts.empty:
            (line,) = ax.plot(
                pts["x"], pts[column], style, label=label, linewidth=1, markersize=5, color=color
            )
            handles.append(line)
    return handles


def write_pareto(root: str | Path, out: str | Path) -> pd.DataFrame:
    """Collect the runs under `root`; write pareto.md, pareto.csv and pareto.png into `out`
    (the figure includes the optimum's frontier when `out`/optimum.csv exists)."""
    from hbp.telemetry.tables import write_text

    table = pareto_table(collect(root))
    if table.empty:
        raise FileNotFoundError(f"no finished runs under {root}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "pareto.csv", table.to_csv(index=False))
    write_text(out / "pareto.md", to_markdown(table) + "\n")
    plot_pareto(table, out / "pareto.png", read_optimum(out / "optimum.csv"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hbp.report.pareto", description=__doc__)
    parser.add_argument("root", help="directory of runs (searched recursively)")
    parser.add_argument("--out", default="outputs/bench", help="where the report goes")
    args = parser.parse_args(argv)
    try:
        table = write_pareto(args.root, args.out)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(to_markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
