"""The memory/time trade-off of every mode, per workload: table, Pareto front and plot.

    python -m hbp.analysis.pareto outputs/bench/matrix --out outputs/bench

reads every run under the root (`hbp.analysis.collect`), expresses each run's measured peak
and median step time relative to naive's on the same workload and profile, marks the runs on
the Pareto front (no other run of that workload is at least as good in both and better in
one) and writes pareto.md, pareto.csv and pareto.png into --out. When --out holds
optimum.csv (experiments/bench_optimum.py), the plot also shows the optimum's predicted
recompute frontier beside the runs' measured recompute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from hbp.analysis.collect import collect, naive_reference, results_table, to_markdown
from hbp.units import MIB


def pareto_table(frame: pd.DataFrame) -> pd.DataFrame:
    """`results_table` plus step time relative to naive, hbp's predicted peak where the mode
    predicts one, the gradient check where it ran, and a `pareto` flag per workload."""
    ok = frame[frame.get("status", pd.Series("ok", index=frame.index)).fillna("ok") == "ok"]
    table = results_table(frame)
    if table.empty:
        return table
    table.insert(
        table.columns.get_loc("step ms") + 1,
        "time / naive",
        (ok["step_time_s"] / naive_reference(ok, "step_time_s")).to_numpy(),
    )
    if "mode_predicted_peak_bytes" in ok:
        table["predicted MiB"] = (ok["mode_predicted_peak_bytes"].astype(float) / MIB).to_numpy()
    if "grad_max_rel_error" in ok:
        table["grad err"] = ok["grad_max_rel_error"].astype(float).to_numpy()
    table["pareto"] = pareto_flags(table)
    return table


def pareto_flags(table: pd.DataFrame) -> list[bool]:
    """True where no other row of the same framework and workload has peak and time both <=
    and one <."""
    flags = []
    framework = table.get("framework", pd.Series("torch", index=table.index))
    for i, row in table.iterrows():
        same_kind = (table["workload"] == row["workload"]) & (framework == framework[i])
        same = table[same_kind & (table.index != i)]
        dominated = (
            (same["peak MiB"] <= row["peak MiB"])
            & (same["step ms"] <= row["step ms"])
            & ((same["peak MiB"] < row["peak MiB"]) | (same["step ms"] < row["step ms"]))
        ).any()
        flags.append(not dominated)
    return flags


def plot_pareto(table: pd.DataFrame, path: str | Path, optimum: pd.DataFrame | None = None) -> Path:
    """One column per workload. Top: peak / naive (x) against step time / naive (y), one
    marker style per mode, hbp's budgets joined by a line. Bottom (runs that count FLOPs):
    peak / naive against recompute FLOPs / naive step FLOPs, with the optimum's predicted
    frontier when `optimum` (experiments/bench_optimum.py's table, graphs "small") is given:
    the MILP's best schedule per budget, its proven lower bound and the planner's
    prediction. Saved as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(table["workload"]))
    fig, axes = plt.subplots(
        2, len(workloads), figsize=(4.2 * len(workloads), 7.4), squeeze=False, sharex="col"
    )
    for col, workload in enumerate(workloads):
        rows = table[table["workload"] == workload]
        families = rows["mode"].str.split("(", n=1).str[0]
        if "framework" in rows:  # "jax tiny" apart from torch's "tiny"
            families = families.where(
                rows["framework"] == "torch", rows["framework"] + " " + families
            )
        for ax, y in zip(axes[:, col], ("time / naive", "recompute ratio")):
            for family in dict.fromkeys(families):
                pts = rows[families == family].dropna(subset=[y]).sort_values("peak / naive")
                if pts.empty:
                    continue
                mode = family.split()[-1]
                style = ("-" if mode == "tiny" and len(pts) > 1 else "") + MARKERS.get(mode, "x")
                if mode != family:  # another framework's points: a dashed line
                    style = style.replace("-", "--")
                ax.plot(
                    pts["peak / naive"], pts[y], style,
                    label=family, markersize=6,
                )  # fmt: skip
            ax.grid(alpha=0.3)
        if optimum is not None:
            naive = rows.loc[rows["mode"] == "naive", "peak MiB"]
            naive_bytes = float(naive.iloc[0]) * MIB if len(naive) else None
            _plot_optimum(axes[1, col], optimum, workload, naive_bytes)
        axes[0, col].set_title(workload)
        axes[1, col].set_xlabel("peak / naive")
    axes[0, 0].set_ylabel("step time / naive")
    axes[1, 0].set_ylabel("recompute FLOPs / naive step")
    axes[0, -1].legend(fontsize=8)
    axes[1, -1].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


MARKERS = {"naive": "s", "checkpoint": "^", "tiny": "o", "sac": "D", "compile_budget": "v"}


def _plot_optimum(
    ax, optimum: pd.DataFrame, workload: str, naive_bytes: float | None = None
) -> None:
    """The MILP's frontier for one workload: budget / naive (x; `naive_bytes` = the naive
    run's measured peak, so the points share the runs' axis even where tiny's graph differs
    from naive's, as gpt2's chunked loss does; default: the graph's own naive peak) against
    the recompute ratios (y)."""
    rows = optimum[(optimum["workload"] == workload) & (optimum["graphs"] == "small")]
    naive = rows["naive_peak_bytes"] if naive_bytes is None else naive_bytes
    rows = rows.assign(x=rows["budget_bytes"] / naive).sort_values("x")
    for column, style, label in (
        ("best_found_ratio", "k:+", "MILP best found"),
        ("bound_ratio", "k--", "MILP lower bound"),
        ("planner_ratio", "C2:x", "planner (predicted)"),
    ):
        pts = rows.dropna(subset=[column])
        if not pts.empty:
            ax.plot(pts["x"], pts[column], style, label=label, linewidth=1, markersize=5)


def read_optimum(path: str | Path) -> pd.DataFrame | None:
    """experiments/bench_optimum.py's optimum.csv, or None when there is none."""
    path = Path(path)
    return pd.read_csv(path) if path.is_file() else None


def write_report(root: str | Path, out: str | Path) -> pd.DataFrame:
    """Collect the runs under `root`; write pareto.md, pareto.csv and pareto.png into `out`
    (the plot includes the optimum's frontier when `out`/optimum.csv exists)."""
    table = pareto_table(collect(root))
    if table.empty:
        raise FileNotFoundError(f"no finished runs under {root}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "pareto.csv", index=False)
    (out / "pareto.md").write_text(to_markdown(table) + "\n")
    plot_pareto(table, out / "pareto.png", read_optimum(out / "optimum.csv"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hbp.analysis.pareto", description=__doc__)
    parser.add_argument("root", help="directory of runs (searched recursively)")
    parser.add_argument("--out", default="outputs/bench", help="where the report goes")
    args = parser.parse_args(argv)
    try:
        table = write_report(args.root, args.out)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(to_markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
