"""The report of a directory of runs: one table file, the comparison table and the plots.

    python -m hbp.report outputs/sweeps/quick        # or any dir of runs (searched recursively)

`write_report(root)` gathers every run under `root` (`hbp.analysis.collect`: metrics.json, and
error.json rows for the failed ones) into `root/results.parquet`, builds the comparison table
(`hbp.analysis.pareto.pareto_table`: per workload, mode with its parameters, budget, peak,
recompute, step time, ratios to naive, the Pareto flag) and writes beside it:

- `pareto.png`: per workload, every mode's points, peak / naive against step time / naive and
  against recompute (`hbp.analysis.pareto.plot_pareto`);
- `memory_timeline.png`: one step of naive vs checkpoint vs tiny on one workload (live bytes
  over op index, forward/backward shaded) and the tiny run's plan, simulated, with its
  segment boundaries marked (`plots.plot_memory_timeline`);
- `frontier.png`: the frontier-width profile of that run's captured graph (graph.json), the
  plan's cuts marked (`hbp.analysis.frontier`, `plots.plot_frontier`).

A plot whose inputs are missing (no timelines: runs logged with logger=none; no tiny run: no
graph) is skipped with a line saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from hbp.analysis.collect import collect, frameworks, to_markdown
from hbp.analysis.pareto import pareto_table, plot_pareto

__all__ = [
    "Report",
    "comparison_table",
    "load_graph",
    "plot_graph",
    "plot_timeline",
    "results_frame",
    "runs_or_quick_sweep",
    "write_report",
]

RESULTS_FILE = "results.parquet"
TIMELINE_FILE = "memory_timeline.parquet"
TIMELINE_MODES = ("naive", "checkpoint", "tiny")


@dataclass
class Report:
    """What `write_report` made: the runs (one row each), the comparison table, the files
    written and the plots skipped (name -> why)."""

    runs: pd.DataFrame
    table: pd.DataFrame
    files: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def format(self) -> str:
        """The comparison table, one markdown table per workload."""
        if self.table.empty:
            return "no finished runs"
        parts = []
        for workload, rows in self.table.groupby("workload", sort=False):
            parts += [f"## {workload}", to_markdown(rows.drop(columns="workload")), ""]
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


def comparison_table(runs: pd.DataFrame) -> pd.DataFrame:
    """`pareto_table` of the finished runs with the mode's budget as its own column."""
    table = pareto_table(runs)
    if table.empty:
        return table
    ok = runs[runs.get("status", pd.Series("ok", index=runs.index)).fillna("ok") == "ok"]
    budget = ok.get("config.mode.budget", pd.Series(None, index=ok.index))
    table.insert(
        table.columns.get_loc("mode") + 1, "budget", [None if v != v else str(v) for v in budget]
    )
    return table


def write_report(root: str | Path, out: str | Path | None = None) -> Report:
    """Collect the runs under `root` and write results.parquet, pareto.png,
    memory_timeline.png and frontier.png into `out` (default: `root`). Raises
    FileNotFoundError when `root` does not exist or holds no finished run."""
    from hbp.telemetry.tables import write_parquet

    root = Path(root)
    out = Path(out) if out is not None else root
    runs = results_frame(root)
    table = comparison_table(runs) if not runs.empty else pd.DataFrame()
    if table.empty:
        raise FileNotFoundError(f"no finished runs under {root}")
    out.mkdir(parents=True, exist_ok=True)
    report = Report(runs, table)
    report.files.append(write_parquet(out / RESULTS_FILE, runs))
    report.files.append(plot_pareto(table, out / "pareto.png"))
    _timeline_and_frontier(report, out)
    return report


def _ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs.get("status", pd.Series("ok", index=runs.index)).fillna("ok") == "ok"]


def _timeline_and_frontier(report: Report, out: Path) -> None:
    for name, plot in (("memory_timeline.png", plot_timeline), ("frontier.png", plot_graph)):
        made = plot(report.runs, out / name)
        if isinstance(made, Path):
            report.files.append(made)
        else:
            report.skipped[name] = made


def plot_timeline(runs: pd.DataFrame, path: str | Path) -> Path | str:
    """memory_timeline.png of the workload with the most of naive / checkpoint / tiny runs that
    have a timeline (tiny: its lowest peak), the tiny run's plan simulated below. Returns the
    path, or why there is no plot."""
    from hbp.report.plots import plot_memory_timeline

    ok = _ok_runs(runs)
    ok = ok[frameworks(ok) == "torch"]  # JAX runs have no per-op timeline
    has = ok[[(Path(d) / TIMELINE_FILE).exists() for d in ok["run_dir"]]] if len(ok) else ok
    has = has[has["mode"].isin(TIMELINE_MODES)]
    if has.empty:
        return "no naive/checkpoint/tiny run with a timeline (logger=table or wandb)"
    workload = has.groupby("workload", sort=False)["mode"].nunique().idxmax()
    rows = has[has["workload"] == workload].sort_values("peak_bytes", kind="stable")
    chosen = [rows[rows["mode"] == m].iloc[0] for m in TIMELINE_MODES if (rows["mode"] == m).any()]
    timelines = {
        _label(run): pd.read_parquet(Path(run["run_dir"]) / TIMELINE_FILE) for run in chosen
    }
    plan = planned = None
    tiny = [Path(run["run_dir"]) for run in chosen if run["mode"] == "tiny"]
    if tiny and (tiny[0] / "plan.json").exists() and (tiny[0] / "graph.json").exists():
        from hbp.analysis.simulate import simulate

        graph, plan = load_graph(tiny[0])
        # an explicit schedule's timeline is not the simulator's (NOTE [ Explicit schedules ])
        planned = None if plan.schedule else simulate(graph, plan)
    title = f"{workload} ({chosen[0]['profile']}): one training step per mode"
    return plot_memory_timeline(timelines, path, title=title, plan=plan, planned=planned)


def load_graph(run_dir: str | Path):
    """(Graph, Plan or None) of a run that captured its graph (graph.json: mode=tiny)."""
    from hbp.graph.ir import Graph
    from hbp.planner.plan import Plan

    run_dir = Path(run_dir)
    graph = Graph.from_json(run_dir / "graph.json")
    plan_file = run_dir / "plan.json"
    plan = Plan.from_dict(json.loads(plan_file.read_text())) if plan_file.exists() else None
    return graph, plan


def plot_graph(runs: pd.DataFrame, path: str | Path) -> Path | str:
    """frontier.png: the frontier-width profile of the first run's captured graph, the plan's
    cuts marked. Returns the path, or why there is no plot."""
    from hbp.analysis.frontier import frontier
    from hbp.planner import min_feasible_peak
    from hbp.report.plots import plot_frontier

    ok = _ok_runs(runs)
    with_graph = [Path(d) for d in ok["run_dir"] if (Path(d) / "graph.json").exists()]
    if not with_graph:
        return "no run with a captured graph (graph.json: mode=tiny)"
    graph, plan = load_graph(with_graph[0])
    row = ok[ok["run_dir"] == str(with_graph[0])].iloc[0]
    title = (
        f"{row['workload']} ({row['profile']}): frontier-width profile, {len(graph)} nodes; "
        f"dashed: the plan's cuts at budget {row.get('config.mode.budget')}"
    )
    cuts = plan.cut_points() if plan is not None else None
    minimum = min_feasible_peak(graph)[0]
    return plot_frontier(frontier(graph, min_peak_bytes=minimum), path, title=title, cuts=cuts)


def _label(run: pd.Series) -> str:
    budget = run.get("config.mode.budget")
    return f"{run['mode']} (budget {budget})" if run["mode"] == "tiny" else str(run["mode"])


QUICK_SWEEP = ("-m", "sweep=quick", "workload=synthetic_dag", "steps=1", "warmup=0")


def runs_or_quick_sweep(outputs: str | Path) -> pd.DataFrame:
    """The finished runs under `outputs` (`collect`); when there are none, first a small sweep
    into it (run.py's `sweep=quick` on synthetic_dag, one step each: naive, checkpoint and
    tiny, about half a minute on a CPU). What the notebooks start with."""
    import os
    import subprocess
    import sys

    outputs = Path(outputs)
    runs = collect(outputs) if outputs.is_dir() else pd.DataFrame()
    if not runs.empty:
        return runs
    run_py = Path(__file__).resolve().parents[2] / "run.py"
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    command = [sys.executable, str(run_py), *QUICK_SWEEP, f"output_root={outputs.absolute()}"]
    print("no runs under", outputs, "- running:", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=run_py.parent, env=env, check=True, capture_output=True)
    return collect(outputs)
