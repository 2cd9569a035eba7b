"""Plans of every workload, recorded, to check that a planner change leaves them as they were.

    python experiments/check_plans.py --record outputs/plan_check/before.json
    ... change the planner ...
    python experiments/check_plans.py --compare outputs/plan_check/before.json

The graphs (every workload in `hbp.workloads` at its "tiny" and "small" profiles, the step's
loss included, plus synthetic ones: residual nets and random DAGs) are captured once and kept
under outputs/plan_check/graphs/, so both runs plan the same graphs whatever the capture does
meanwhile. Each graph is planned at budgets 1.0, 0.5, 0.25 of its naive peak and "min";
recorded per plan: predicted peak bytes, predicted recompute FLOPs, how it was solved and the
segments, or the BudgetError's minimum. `--compare` prints every difference and exits 1 if any.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hbp.errors import BudgetError
from hbp.graph import synthetic
from hbp.graph.ir import Graph
from hbp.planner import plan

OUT = Path(__file__).resolve().parents[1] / "outputs" / "plan_check"
BUDGETS = (1.0, 0.5, 0.25, "min")


def workload_graph(name: str, profile: str, **overrides) -> Graph:
    from hbp.graph.torch.capture import capture
    from hbp.integrations.torch.loss import WithLoss
    from hbp.workloads import build

    wl = build(name, profile, seed=0, **overrides)
    batch = wl.make_batch(0)
    root = WithLoss(wl.model, lambda output: wl.loss_fn(output, batch), len(batch.args))
    with torch.enable_grad():
        return capture(root, tuple(batch.args), dict(batch.kwargs)).graph


def graphs() -> dict[str, Graph]:
    """name -> graph, captured once and cached as JSON."""
    from hbp.workloads import WORKLOADS

    folder = OUT / "graphs"
    folder.mkdir(parents=True, exist_ok=True)
    makers = {f"residual_net{n}": (lambda n=n: synthetic.residual_net(n)) for n in (3, 12, 48)}
    for seed in range(4):
        makers[f"random_dag12_{seed}"] = lambda s=seed: synthetic.random_dag(12, seed=s)
    for name in WORKLOADS:
        for profile in ("tiny", "small"):
            makers[f"{name}_{profile}"] = lambda n=name, p=profile: workload_graph(n, p)
    out = {}
    for key, make in makers.items():
        path = folder / f"{key}.json"
        if not path.exists():
            try:
                make().to_json(path)
            except Exception as err:  # noqa: BLE001 - a workload that cannot build here
                print(f"skip {key}: {type(err).__name__}: {err}"[:200], flush=True)
                continue
        out[key] = Graph.from_json(path)
    return out


def segments_text(segments) -> list:
    """[start, stop, recompute, children], and the pinned nodes when there are any (records made
    before pins compare equal on plans without them)."""
    return [
        [s.start, s.stop, bool(s.recompute), segments_text(s.children)]
        + ([list(s.pinned)] if s.pinned else [])
        for s in segments
    ]


def record() -> dict:
    results = {}
    for key, graph in graphs().items():
        for budget in BUDGETS:
            t0 = time.process_time()
            try:
                p = plan(graph, budget)
                row = {
                    "peak": int(p.predicted_peak_bytes),
                    "recompute": float(p.predicted_recompute_flops),
                    "solved_by": p.meta.get("solved_by"),
                    "segments": segments_text(p.segments),
                }
            except BudgetError as err:
                row = {"budget_error_minimum": int(err.minimum)}
            row["cpu_s"] = round(time.process_time() - t0, 3)
            results[f"{key}@{budget}"] = row
            print(f"{key}@{budget}: {row.get('peak')} {row.get('recompute')} {row['cpu_s']}s")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="write the plans here")
    parser.add_argument("--compare", type=Path, help="compare the plans with this record")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = record()
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(results, indent=1))
    if args.compare:
        before = json.loads(args.compare.read_text())
        diffs = 0
        for key in sorted(set(before) | set(results)):
            a = {k: v for k, v in before.get(key, {}).items() if k != "cpu_s"}
            b = {k: v for k, v in results.get(key, {}).items() if k != "cpu_s"}
            if a != b:
                diffs += 1
                print(f"DIFFERS {key}:\n  before {a}\n  after  {b}")
        cpu = [sum(r["cpu_s"] for r in res.values()) for res in (before, results)]
        print(
            f"{diffs} of {len(results)} plans differ; planning CPU s {cpu[0]:.1f} -> {cpu[1]:.1f}"
        )
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
