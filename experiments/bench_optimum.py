"""The planner against the optimum (Checkmate-style MILP) on every workload's graph.

    .venv/bin/python experiments/bench_optimum.py            # outputs/bench/optimum.{csv,md}
    .venv/bin/python experiments/bench_optimum.py --quick    # fewer budgets, 20 s per solve

Two sets of graphs, captured exactly as `run.py mode=tiny` captures them (same config
composition, chunked loss included):
- "small": profile small, the graphs of the bench's Pareto table (unet's, 132 values, is
  skipped: --max_values). The MILP has 20-60k variables there and rarely finishes on this
  CPU: each solve stops at --time_limit seconds
  and reports the best schedule found (an upper bound on the optimum) and the proven lower
  bound (the larger of the LP relaxation and the MILP's dual bound), so the optimum lies in
  [bound, min(best found, planner)].
- "reduced": the same model families cut down until the MILP proves optimality (one GPT-2
  block, ResNet-10, a 3-layer synthetic DAG; the smallest U-Net, one level, still has 76
  values, beyond the MILP): there the planner's gap to the optimum is exact.
Budgets span each graph's feasible range: min + f x (naive - min) for f in SPANS, where min
is the planner's smallest feasible peak and naive the simulated peak of plain autograd. Recompute is given as a fraction of one naive step's FLOPs (the bench's
"recompute ratio"). All figures are the simulator's predictions (the MILP schedules are not
executed); tiny runs measure within a few percent of the planner's prediction.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench"
SMALL = {name: [] for name in ("gpt2", "resnet", "unet", "synthetic_dag")}
REDUCED = {
    "gpt2": ["workload.n_layer=1"],
    "resnet": ["workload.depth=10"],
    "synthetic_dag": ["workload.depth=3"],
}
# Budgets across each graph's feasible range: min + f x (naive peak - min), where min is the
# planner's smallest feasible peak (fractions of naive such as 0.3 are infeasible on some
# graphs and trivial on others).
SPANS = (0.0, 0.25, 0.5, 0.75)


def tiny_graph(workload: str, overrides: list[str]):
    """The graph `run.py workload=... profile=small mode=tiny <overrides>` plans on."""
    import torch
    from hydra import compose, initialize_config_dir

    from hbp.bench import build_workload
    from hbp.graph.torch.capture import capture

    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", [f"workload={workload}", "profile=small", "mode=tiny", *overrides])
    wl = build_workload(cfg)
    batch = wl.make_batch(cfg.seed)
    return capture(wl.model, batch.args, batch.kwargs).graph


def run(graphs: dict, label: str, spans, time_limit: float, max_values: int) -> list[dict]:
    from hbp.analysis import naive_peak
    from hbp.optimum import frontier
    from hbp.planner import min_feasible_peak
    from hbp.planner.schedule_model import Schedule

    rows = []
    for workload, overrides in graphs.items():
        graph = tiny_graph(workload, overrides)
        values = Schedule(graph).N
        print(f"{label} {workload} {' '.join(overrides)}: {values} values", flush=True)
        if values > max_values:
            print(f"  skipped: more than {max_values} values (the LP alone runs for many minutes)")
            continue
        low, high = min_feasible_peak(graph)[0], naive_peak(graph)
        budgets = [int(low + f * (high - low)) for f in spans]
        for f, row in zip(spans, frontier(graph, budgets, time_limit=time_limit)):
            row["budget"] = "min" if f == 0 else f"min+{f:.0%}"
            row.update(graphs=label, workload=workload, config=" ".join(overrides))
            row.update(nodes=len(graph), values=values)
            print(_line(row), flush=True)
            rows.append(row)
    return rows


def _line(row: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:.2f}%"

    return (
        f"  budget={row['budget']} ({row['budget_bytes'] / row['naive_peak_bytes']:.3f}) "
        f"{row['status']}: best found {pct(row['best_found_ratio'])}, bound "
        f"{pct(row['bound_ratio'])}, planner {pct(row['planner_ratio'])}, "
        f"MILP {row['milp_time_s']:.1f} s"
    )


def markdown(frame) -> str:
    """One row per graph and budget; recompute as % of a naive step's FLOPs."""
    import pandas as pd

    def pct(x):
        return "-" if pd.isna(x) else f"{100 * x:.2f}"

    def gap(row):
        if row["status"] == "optimal":
            return "-" if pd.isna(row["gap"]) else f"{100 * row['gap']:+.1f}%"
        if pd.isna(row["gap_to_bound"]):
            return "-"
        return f"<= {100 * row['gap_to_bound']:+.1f}%"

    def excess(row):  # planner - optimum, in % of a naive step's FLOPs
        if row["status"] == "optimal":
            return f"{100 * (row['planner_ratio'] - row['best_found_ratio']):.2f}"
        if pd.isna(row["bound_ratio"]) or pd.isna(row["planner_ratio"]):
            return "-"
        return f"<= {100 * (row['planner_ratio'] - row['bound_ratio']):.2f}"

    lines = [
        "| graphs | workload | values | budget | budget / naive | MILP status | optimum "
        "(best found) % | lower bound % | planner % | planner vs optimum | excess, % of step "
        "| MILP s |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for _, r in frame.iterrows():
        config = r["config"] if isinstance(r["config"], str) else ""
        name = r["workload"] + (f" ({config})" if config else "")
        lines.append(
            f"| {r['graphs']} | {name} | {r['values']} | {r['budget']} | "
            f"{r['budget_bytes'] / r['naive_peak_bytes']:.3f} | {r['status']} | "
            f"{pct(r['best_found_ratio'])} | {pct(r['bound_ratio'])} | "
            f"{pct(r['planner_ratio'])} | {gap(r)} | {excess(r)} | {r['milp_time_s']:.1f} |"
        )
    return "\n".join(lines)


def write(rows: list[dict], out: Path):
    """optimum.csv / optimum.md in `out`: these rows replace earlier rows of the same graphs
    (set and workload), so a partial rerun (--only, --workloads) updates the table."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame["budget"] = frame["budget"].astype(str)
    path = out / "optimum.csv"
    if path.is_file():
        old = pd.read_csv(path, keep_default_na=False, na_values=[""])
        fresh = set(zip(frame["graphs"], frame["workload"]))
        keep = [(g, w) not in fresh for g, w in zip(old["graphs"], old["workload"])]
        frame = pd.concat([old[keep], frame], ignore_index=True)
    order = {"reduced": 0, "small": 1}
    frame = frame.sort_values("graphs", key=lambda c: c.map(order), kind="stable")
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    (out / "optimum.md").write_text(markdown(frame) + "\n")
    return frame


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two budgets, 20 s solves")
    parser.add_argument("--time_limit", type=float, default=None, help="seconds per MILP")
    parser.add_argument("--only", choices=("small", "reduced"), help="one set of graphs")
    parser.add_argument("--workloads", help="comma list (default: all four)")
    parser.add_argument(
        "--max_values", type=int, default=110, help="skip larger graphs (unet small: 132)"
    )
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)

    spans = (0.0, 0.5) if args.quick else SPANS
    limit = args.time_limit or (20.0 if args.quick else 120.0)
    chosen = args.workloads.split(",") if args.workloads else None
    start, rows, out, frame = time.perf_counter(), [], Path(args.out), None
    for label, graphs in (("small", SMALL), ("reduced", REDUCED)):
        if args.only not in (None, label):
            continue
        for workload, overrides in graphs.items():
            if chosen is None or workload in chosen:
                rows += run({workload: overrides}, label, spans, limit, args.max_values)
                if rows:
                    frame = write(rows, out)  # after every graph: an interrupted run keeps its rows
    if frame is None:
        print("no graph was solved", file=sys.stderr)
        return 1
    print(markdown(frame))
    print(f"wrote {out / 'optimum.md'} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
