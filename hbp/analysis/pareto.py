"""The memory/time trade-off of every mode, per workload: table, Pareto front and plot.

    python -m hbp.analysis.pareto outputs/bench/matrix --out outputs/bench

reads every run under the root (`hbp.analysis.collect`), expresses each run's measured peak
and median step time relative to naive's on the same workload and profile, marks the runs on
the Pareto front (no other run of that workload is at least as good in both and better in
one) and writes pareto.md, pareto.csv and pareto.png into --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from hbp.analysis.collect import collect, naive_reference, results_table, to_markdown

MIB = 1024 * 1024


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
    """True where no other row of the same workload has peak and time both <= and one <."""
    flags = []
    for i, row in table.iterrows():
        same = table[(table["workload"] == row["workload"]) & (table.index != i)]
        dominated = (
            (same["peak MiB"] <= row["peak MiB"])
            & (same["step ms"] <= row["step ms"])
            & ((same["peak MiB"] < row["peak MiB"]) | (same["step ms"] < row["step ms"]))
        ).any()
        flags.append(not dominated)
    return flags


def plot_pareto(table: pd.DataFrame, path: str | Path) -> Path:
    """One panel per workload: peak / naive (x) against step time / naive (y), one marker
    style per mode, hbp's budgets joined by a line. Saved as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(table["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    markers = {"naive": "s", "checkpoint": "^", "tiny": "o", "sac": "D", "compile_budget": "v"}
    for ax, workload in zip(axes[0], workloads):
        rows = table[table["workload"] == workload]
        families = rows["mode"].str.split("(", n=1).str[0]
        for family in dict.fromkeys(families):
            pts = rows[families == family].sort_values("peak / naive")
            style = "-" if family == "tiny" and len(pts) > 1 else ""
            ax.plot(
                pts["peak / naive"], pts["time / naive"], style + markers.get(family, "x"),
                label=family, markersize=6,
            )  # fmt: skip
        ax.set_title(workload)
        ax.set_xlabel("measured peak / naive")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("step time / naive")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(root: str | Path, out: str | Path) -> pd.DataFrame:
    """Collect the runs under `root`; write pareto.md, pareto.csv and pareto.png into `out`."""
    table = pareto_table(collect(root))
    if table.empty:
        raise FileNotFoundError(f"no finished runs under {root}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "pareto.csv", index=False)
    (out / "pareto.md").write_text(to_markdown(table) + "\n")
    plot_pareto(table, out / "pareto.png")
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
