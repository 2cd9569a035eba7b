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

from hbp.analysis.collect import collect, to_markdown
from hbp.analysis.pareto import pareto_table, plot_pareto

__all__ = ["Report", "comparison_table", "results_frame", "write_report"]

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
    table.insert(2, "budget", [None if v != v else str(v) for v in budget])
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
    from hbp.analysis.frontier import frontier
    from hbp.analysis.simulate import simulate
    from hbp.graph.ir import Graph
    from hbp.planner.plan import Plan
    from hbp.report.plots import plot_frontier, plot_memory_timeline

    ok = _ok_runs(report.runs)
    has = ok[[(Path(d) / TIMELINE_FILE).exists() for d in ok["run_dir"]]]
    has = has[has["mode"].isin(TIMELINE_MODES)]
    if has.empty:
        report.skipped["memory_timeline.png"] = "no naive/checkpoint/tiny run with a timeline"
    else:
        counts = has.groupby("workload", sort=False)["mode"].nunique()
        workload = counts.idxmax()
        rows = has[has["workload"] == workload].sort_values("peak_bytes", kind="stable")
        chosen = [
            rows[rows["mode"] == m].iloc[0] for m in TIMELINE_MODES if (rows["mode"] == m).any()
        ]
        timelines = {
            _label(run): pd.read_parquet(Path(run["run_dir"]) / TIMELINE_FILE) for run in chosen
        }
        plan = planned = None
        tiny = [run for run in chosen if run["mode"] == "tiny"]
        graph_dir = Path(tiny[0]["run_dir"]) if tiny else None
        if graph_dir is not None and (graph_dir / "plan.json").exists():
            graph = Graph.from_json(graph_dir / "graph.json")
            plan = Plan.from_dict(json.loads((graph_dir / "plan.json").read_text()))
            planned = simulate(graph, plan)
        title = f"{workload} ({chosen[0]['profile']}): one training step per mode"
        report.files.append(
            plot_memory_timeline(
                timelines, out / "memory_timeline.png", title=title, plan=plan, planned=planned
            )
        )
    graphs = sorted(ok["run_dir"], key=lambda d: not (Path(d) / "graph.json").exists())
    graph_dirs = [Path(d) for d in graphs if (Path(d) / "graph.json").exists()]
    if not graph_dirs:
        report.skipped["frontier.png"] = "no run with a captured graph (graph.json: mode=tiny)"
        return
    run_dir = graph_dirs[0]
    graph = Graph.from_json(run_dir / "graph.json")
    cuts = None
    if (run_dir / "plan.json").exists():
        cuts = Plan.from_dict(json.loads((run_dir / "plan.json").read_text())).cut_points()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    title = (
        f"{metrics['workload']} ({metrics['profile']}): frontier-width profile, "
        f"{len(graph)} nodes; dashed: the plan's cuts at budget {metrics.get('mode_budget')}"
    )
    report.files.append(
        plot_frontier(frontier(graph), out / "frontier.png", title=title, cuts=cuts)
    )


def _label(run: pd.Series) -> str:
    budget = run.get("config.mode.budget")
    return f"{run['mode']} (budget {budget})" if run["mode"] == "tiny" else str(run["mode"])
