"""Planning time at a few budgets on the captured step of the planner benchmarks' Llama
decoder (`bench_capture.llama`: hidden 128, 4 heads, vocab 2048, 128 tokens), as HCModule
captures and calibrates it, at a batch size of choice: per budget the plan (predicted peak and
recompute FLOPs, or the BudgetError's minimum) and the least of three cold `plan` calls in
CPU seconds (least peaks forgotten before each); and the least of seven simulations of the
plain step and of each plan, in CPU milliseconds.

    OMP_NUM_THREADS=1 python experiments/plan_budgets.py --layers 32 --batch 1
    OMP_NUM_THREADS=1 python experiments/plan_budgets.py --layers 64 --batch 2 50%act

To time two versions of the planner, run it with each on PYTHONPATH (a `git worktree` of the
older commit): the captured graph is pickled under outputs/bench/ once and read by both.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("budgets", nargs="*", default=["50%act", "min", "0.3"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    from bench_capture import llama
    from bench_planner_real import forget_least_peaks

    import hbp
    from hbp.analysis.liveness import GraphInfo
    from hbp.analysis.simulate import simulate
    from hbp.planner import plan

    path = ROOT / "outputs" / "bench" / f"llama{args.layers}_b{args.batch}.pkl"
    if path.exists():
        graph = pickle.loads(path.read_bytes())
    else:
        model, (ids,), _, _ = llama(args.layers)
        batch = ids[: args.batch]
        hc = hbp.HCModule(model)
        hc.prepare(batch, labels=batch)
        graph = hc.captured.graph
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(graph))
    info = GraphInfo.of(graph)
    naive = _least_ms(lambda: simulate(graph, info=info))
    print(
        f"{args.layers} layers, batch {args.batch}: one simulation of the plain step {naive:.1f} ms"
    )
    for given in args.budgets:
        budget = float(given) if given.replace(".", "", 1).isdigit() else given
        seconds, made = [], None
        for _ in range(3):
            forget_least_peaks()
            start = time.process_time()
            try:
                made = plan(graph, budget, pins=True)
                result = f"peak {made.predicted_peak_bytes:,} B, recompute {made.predicted_recompute_flops:.4g}"
            except hbp.BudgetError as err:
                result = f"BudgetError, minimum {err.minimum:,} B"
            seconds.append(time.process_time() - start)
        if made is not None:
            ms = _least_ms(lambda made=made: simulate(graph, made.segments, info=info))
            result += f", its simulation {ms:.1f} ms"
        print(
            f"{args.layers} layers, batch {args.batch}, {given}: {result}; {min(seconds):.2f} CPU s"
        )


def _least_ms(run, times: int = 7) -> float:
    """The least of `times` runs of `run`, in CPU milliseconds."""
    least = float("inf")
    for _ in range(times):
        start = time.process_time()
        run()
        least = min(least, time.process_time() - start)
    return least * 1000


if __name__ == "__main__":
    main()
