"""The report of a directory of runs: one table file, the comparison table and the figures.

    python -m hbp.report outputs/sweeps/quick                  # or any dir of runs (recursive)
    python -m hbp.report outputs/sweeps/quick --workload gpt2  # only gpt2's timeline/frontier

`write_report(root)` gathers every run under `root` (`hbp.analysis.collect`: metrics.json, and
error.json rows for the failed ones) into `root/results.parquet`, builds the comparison table
(`comparison_table`: per workload, mode with the parameters that apply, budget, peak,
recompute, step time and its p10-p90 range, ratios to naive, the Pareto flag; NOTE [ One
naive per run ] in hbp.analysis.collect) and writes beside it, every figure in the one style
of `hbp.report.style`:

- `pareto.png`: per workload, every mode's points, peak against step time and against
  recompute (`hbp.report.pareto.plot_pareto`);
- `memory_timeline_<workload>.png`, for every workload (or those named): one step of each
  mode that recorded a timeline (its lowest-peak run; live bytes over op index, forward and
  backward shaded) and the tiny run's plan, simulated, with its segment boundaries marked
  (`plots.plot_memory_timeline`);
- `frontier_<workload>.png`: the frontier-width profile of that workload's captured graph
  (graph.json of a tiny run), the plan's cuts marked (`plots.plot_frontier`).

A figure whose inputs are missing (no timelines: runs logged with logger=none; no tiny run:
no graph) is not written; `Report.skipped` says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from hbp.analysis.collect import (
    NAIVE_MODEL,
    NAIVE_WITHOUT_CHUNKED_LOSS,
    base_workloads,
    collect,
    frameworks,
    ok_runs,
    provenance,
    to_markdown,
)
from hbp.analysis.pareto import pareto_table
from hbp.units import MIB

__all__ = [
    "Report",
    "comparison_table",
    "load_graph",
    "plot_graph",
    "plot_timeline",
    "results_frame",
    "run_figures",
    "runs_or_quick_sweep",
    "write_report",
]

# NOTE [ The pareto module runs as a script ]
# `python -m hbp.report.pareto` imports this package first; imported here at the top, the
# module was then in sys.modules before it ran as __main__, and runpy warned on every call.
# It is imported where a figure is drawn.

RESULTS_FILE = "results.parquet"
TIMELINE_FILE = "memory_timeline.parquet"
PLAN_FILE = "plan.json"
GRAPH_FILE = "graph.json"


@dataclass
class Report:
    """What `write_report` made: the runs (one row each), the comparison table, the files
    written and the figures skipped (name -> why)."""

    runs: pd.DataFrame
    table: pd.DataFrame
    files: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    repeats: int = 0  # finished runs left out: an older run of a key a later run has

    def format(self) -> str:
        """The comparison table, one markdown table per workload."""
        if self.table.empty:
            return "no finished runs"
        parts = []
        for workload, rows in self.table.groupby("workload", sort=False):
            parts += [f"## {workload}", to_markdown(rows.drop(columns="workload")), ""]
        lm_head = (
            "workload_chunked_loss" in self.runs
            and self.runs["workload_chunked_loss"].notna().any()
        )
        model = NAIVE_MODEL + (NAIVE_WITHOUT_CHUNKED_LOSS if lm_head else "")
        parts.append(f"naive: {model}; each run measures it on a copy")
        parts.append(f"made with: {provenance(ok_runs(self.runs))}")
        return "\n".join(parts).rstrip()


def results_frame(root: str | Path) -> pd.DataFrame:
    """Every run under `root`, failed ones included (status "error"), with columns that
    parquet can store: a column mixing types (a budget of 0.3 in one run and "min" in
    another, lists) is stored as JSON text."""
    frame = collect(root, include_errors=True)
    for column in frame.columns:
        if frame[column].dtype != object:
            continue
        kinds = {type(v) for v in frame[column] if v is not None and v == v}
        if len(kinds) > 1 or kinds & {list, dict, tuple}:
            frame[column] = [
                None if v is None or v != v else v if isinstance(v, str) else json.dumps(v)
                for v in frame[column]
            ]
    return frame


def latest_of_each_key(runs: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """`runs` with one finished run per run key, the latest (`started_at`), and how many
    were left out. Two finished runs with one key measured the same experiment (NOTE [ Run
    keys ] in hbp.bench.rundir): a directory holding two sweeps of it, or a sweep run again
    under another logger before the logger left the key, showed each mode twice under one
    label, and one of the two naive runs became every ratio's denominator."""
    if runs.empty or "run_key" not in runs:
        return runs, 0
    ok = ok_runs(runs)
    keyed = ok[ok["run_key"].notna()]
    order = keyed.get("started_at", pd.Series("", index=keyed.index)).fillna("").astype(str)
    latest = order.groupby(keyed["run_key"]).idxmax()
    dropped = keyed.index.difference(latest.to_numpy())
    return runs.drop(index=dropped), len(dropped)


def _budget_text(value) -> str:
    """A mode's budget as the table shows it: "0.3", "min", "64MiB"; "-" for none."""
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, str):
        try:  # JSON text from results_frame
            value = json.loads(value)
        except ValueError:
            return value
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def comparison_table(runs: pd.DataFrame) -> pd.DataFrame:
    """`pareto_table` of the finished runs with the mode's budget as its own column ("-"
    for a mode without one)."""
    table = pareto_table(runs)
    if table.empty:
        return table
    ok = ok_runs(runs)
    budget = ok.get("config.mode.budget")
    values = [None] * len(table) if budget is None else list(budget)
    table.insert(table.columns.get_loc("mode") + 1, "budget", [_budget_text(v) for v in values])
    if "mode_budget_bytes" in ok and ok["mode_budget_bytes"].notna().any():
        # what the budget came to in bytes (tiny's), beside the peak to check it against
        budget_mib = ok["mode_budget_bytes"].astype(float) / MIB
        table.insert(table.columns.get_loc("peak MiB"), "budget MiB", budget_mib.to_numpy())
        # the measured peak against it: above 1 is over the budget (a run under FSDP, whose
        # all-gathered parameters no plan counts, is)
        over = ok["peak_bytes"].astype(float) / ok["mode_budget_bytes"].astype(float)
        table.insert(table.columns.get_loc("peak MiB") + 1, "peak / budget", over.to_numpy())
    return table


def write_report(
    root: str | Path, out: str | Path | None = None, workloads: list[str] | None = None
) -> Report:
    """Collect the runs under `root` and write results.parquet, pareto.png and, per workload
    (all, or those in `workloads`), memory_timeline_<workload>.png and
    frontier_<workload>.png into `out` (default: `root`). Raises FileNotFoundError when
    `root` does not exist or holds no finished run, ValueError for a workload it has none
    of."""
    from hbp.telemetry.tables import write_parquet

    root = Path(root)
    out = Path(out) if out is not None else root
    runs, repeats = latest_of_each_key(results_frame(root))
    table = comparison_table(runs) if not runs.empty else pd.DataFrame()
    if table.empty:
        raise FileNotFoundError(f"no finished runs under {root}")
    names = base_workloads(table["workload"])
    present = list(dict.fromkeys(names))
    chosen = list(workloads) if workloads else present
    unknown = [w for w in chosen if w not in present]
    if unknown:
        raise ValueError(
            f"no finished run of workload {', '.join(unknown)} under {root}: "
            f"it has {', '.join(present)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    table = table[names.isin(chosen).to_numpy()]
    report = Report(runs, table, repeats=repeats)
    report.files.append(write_parquet(out / RESULTS_FILE, runs))
    # a chosen subset gets its own name: the whole directory's figure stays
    pareto = "pareto.png" if chosen == present else f"pareto_{'_'.join(chosen)}.png"
    from hbp.report.pareto import plot_pareto  # NOTE [ The pareto module runs as a script ]

    report.files.append(plot_pareto(table, out / pareto))
    for workload in chosen:
        for stem, plot in (("memory_timeline", plot_timeline), ("frontier", plot_graph)):
            name = f"{stem}_{workload}.png"
            made = plot(runs, out / name, workload=workload)
            if isinstance(made, Path):
                report.files.append(made)
            else:
                report.skipped[name] = made
    return report


def plot_timeline(runs: pd.DataFrame, path: str | Path, workload: str | None = None) -> Path | str:
    """The memory timeline figure of `workload` (default: the workload with the most modes
    that have a timeline): one panel per mode with a timeline (its lowest-peak run), the tiny
    run's plan simulated below. Returns the path, or why there is no figure."""
    from hbp.analysis.collect import mode_labels
    from hbp.report.plots import plot_memory_timeline

    ok = ok_runs(runs)
    ok = ok[frameworks(ok) == "torch"]  # JAX runs have no per-op timeline
    has = ok[[(Path(d) / TIMELINE_FILE).exists() for d in ok["run_dir"]]] if len(ok) else ok
    if workload is not None:
        has = has[has["workload"] == workload]
    if has.empty:
        return "no run with a timeline (runs logged with logger=table or wandb)"
    if workload is None:
        workload = has.groupby("workload", sort=False)["mode"].nunique().idxmax()
    rows = has[has["workload"] == workload].sort_values("peak_bytes", kind="stable")
    chosen = rows.drop_duplicates("mode")
    order = ["naive", "checkpoint", "tiny"]
    chosen = chosen.iloc[
        sorted(range(len(chosen)), key=lambda i: (order + [chosen["mode"].iloc[i]]).index(
            chosen["mode"].iloc[i]
        ))
    ]  # fmt: skip
    labels = mode_labels(chosen)
    timelines = {
        label: pd.read_parquet(Path(run["run_dir"]) / TIMELINE_FILE)
        for label, (_, run) in zip(labels, chosen.iterrows())
    }
    tiny = [Path(d) for d, m in zip(chosen["run_dir"], chosen["mode"]) if m == "tiny"]
    plan = planned = None
    if tiny:
        plan, planned = _planned(tiny[0])
    title = f"{workload} ({chosen['profile'].iloc[0]}): one training step per mode"
    return plot_memory_timeline(timelines, path, title=title, plan=plan, planned=planned)


def _planned(run_dir: Path):
    """(Plan, its Simulation) of a run with plan.json and graph.json; (plan, None) for an
    explicit schedule (its timeline is not the simulator's: NOTE [ Explicit schedules ]);
    (None, None) without them."""
    if not (run_dir / PLAN_FILE).is_file() or not (run_dir / GRAPH_FILE).is_file():
        return None, None
    from hbp.analysis.simulate import simulate

    graph, plan = load_graph(run_dir)
    return plan, (None if plan.schedule else simulate(graph, plan))


def load_graph(run_dir: str | Path):
    """(Graph, Plan or None) of a run that captured its graph (graph.json: mode=tiny)."""
    from hbp.graph.ir import Graph
    from hbp.planner.plan import Plan

    run_dir = Path(run_dir)
    graph = Graph.from_json(run_dir / GRAPH_FILE)
    plan_file = run_dir / PLAN_FILE
    plan = Plan.from_dict(json.loads(plan_file.read_text())) if plan_file.exists() else None
    return graph, plan


def plot_graph(runs: pd.DataFrame, path: str | Path, workload: str | None = None) -> Path | str:
    """The frontier-width profile of `workload`'s captured graph (its first run with a
    graph.json; default: the first such run of any workload), the plan's cuts marked.
    Returns the path, or why there is no figure."""
    from hbp.analysis.frontier import frontier
    from hbp.planner import min_feasible_peak
    from hbp.report.plots import plot_frontier

    ok = ok_runs(runs)
    if workload is not None:
        ok = ok[ok["workload"] == workload]
    with_graph = [Path(d) for d in ok["run_dir"] if (Path(d) / GRAPH_FILE).exists()]
    if not with_graph:
        return "no run with a captured graph (graph.json: mode=tiny)"
    graph, plan = load_graph(with_graph[0])
    row = ok[ok["run_dir"] == str(with_graph[0])].iloc[0]
    title = (
        f"{row['workload']} ({row['profile']}): frontier-width profile, {len(graph)} nodes, "
        f"plan at budget {_budget_text(row.get('config.mode.budget'))}"
    )
    cuts = plan.cut_points() if plan is not None else None
    minimum = min_feasible_peak(graph)[0]
    return plot_frontier(frontier(graph, min_peak_bytes=minimum), path, title=title, cuts=cuts)


def run_figures(
    run_dir: str | Path, summary: dict, timeline: pd.DataFrame, sweep_dir: Path | None = None
) -> dict[str, Path]:
    """The figures of one finished run for its loggers (wandb), written into `run_dir`:
    `memory_timeline` (the run's step; its plan simulated below where there is one) and
    `pareto` (the run with the other runs of its sweep; left out for a run alone, which
    has no trade-off to show)."""
    from hbp.analysis.collect import mode_labels
    from hbp.report.plots import plot_memory_timeline
    from hbp.telemetry.tables import jsonable

    run_dir = Path(run_dir)
    row = pd.json_normalize([jsonable(summary)], sep=".")
    figures = {}
    if timeline is not None and not timeline.empty:
        plan, planned = _planned(run_dir)
        figures["memory_timeline"] = plot_memory_timeline(
            {mode_labels(row)[0]: timeline},
            run_dir / "memory_timeline.png",
            title=f"{summary.get('workload')} ({summary.get('profile')})",
            plan=plan,
            planned=planned,
        )
    frames = [row]
    if sweep_dir is not None and Path(sweep_dir).is_dir():
        others = collect(sweep_dir)
        if not others.empty and "run_dir" in others:
            others = others[others["run_dir"] != str(run_dir)]
        frames.insert(0, others)
    runs = pd.concat([f for f in frames if not f.empty], ignore_index=True)
    table = pareto_table(runs)
    if len(table) > 1:
        from hbp.report.pareto import plot_pareto

        figures["pareto"] = plot_pareto(table, run_dir / "pareto.png")
    return figures


QUICK_SWEEP = ("-m", "sweep=quick", "workload=synthetic_dag", "steps=1", "warmup=0")


def runs_or_quick_sweep(sweep_dir: str | Path) -> pd.DataFrame:
    """The finished runs of one sweep directory (`collect`); when it holds none, first a
    small sweep into it (run.py's `sweep=quick` on synthetic_dag, one step each: naive,
    checkpoint and tiny, about half a minute on a CPU). What the notebooks start with."""
    import os
    import subprocess
    import sys

    sweep_dir = Path(sweep_dir)
    runs = collect(sweep_dir) if sweep_dir.is_dir() else pd.DataFrame()
    if not runs.empty:
        return runs
    run_py = Path(__file__).resolve().parents[2] / "run.py"
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    command = [
        sys.executable, str(run_py), *QUICK_SWEEP, f"hydra.sweep.dir={sweep_dir.absolute()}",
    ]  # fmt: skip
    print("no runs in", sweep_dir, "- running:", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=run_py.parent, env=env, check=True, capture_output=True)
    return collect(sweep_dir)
