"""Planner figures (issue 11): plan quality and planning time against depth, and the gap to the
MILP optimum on random DAGs.

    python experiments/bench_planner.py            # depth sweep + random-DAG gap (a few minutes)
    python experiments/bench_planner.py --quick    # depths 12, 48 only; 6-op DAGs only
    python experiments/bench_planner.py --only depth   # or --only dags
    python experiments/bench_planner.py --only real    # captured transformers (see below)

Depth sweep: `hbp.graph.synthetic.residual_net(L)` at budget 0.5 of the naive peak (every
layer different, then identical layers: `same_layers=True`), planned by
`hbp.planner.plan` (the default: whole-graph DP, plus staged planning on large graphs) and by
the whole-graph DP alone (`staged="never"`, the planner before staged planning). Recompute is
in % of the graph's forward FLOPs; time is the CPU seconds (and wall seconds) of one `plan`
call on this machine. Random DAGs: `synthetic.random_dag(n)` for n = 5..8, 40 seeds, at 4 budgets from the
planner's minimum to naive (min, +1/4, +1/2, +3/4), planner recompute / MILP optimum, for
`hbp.planner.plan` (explicit schedules on graphs this small) and for the DP alone. Writes
outputs/bench/planner.md.

Real graphs (`--only real`, `--layers 2 8 32 64`, `--gpt2` adds GPT-2 124M's shape, the
"medium" profile of `hbp.workloads.gpt2`, `--unet` the DDPM U-Net of `hbp.workloads.unet` at
"medium"): a transformers `LlamaForCausalLM` from a config
(hidden 128, 4 heads, intermediate 344, vocab 2048, 2 x 128 tokens, random weights),
captured and calibrated as `HCModule` does on its first step, then planned at 0.5, 0.3 and
"min", each plan cold (the planner's remembered least peaks forgotten before it). Beside
them, one warm plain step (forward, loss, backward; median of 3). First step = capture +
calibration + plan(0.5): what the first call of an input signature adds to a plain step.
Writes outputs/bench/planner_real.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hbp.analysis import naive_peak
from hbp.analysis.liveness import GraphInfo
from hbp.graph import synthetic
from hbp.planner import min_feasible_peak, optimal_plan, plan
from hbp.planner.milp import solve
from hbp.planner.schedule_model import Schedule
from hbp.planner.stages import stage_signatures

OUT = Path(__file__).resolve().parents[1] / "outputs" / "bench"


def depth_sweep(depths: list[int], same_layers: bool = False) -> list[str]:
    lines = [
        "| layers | nodes | stages (distinct) | recompute % (plan) | solved by | "
        "plan CPU s (wall) | recompute % (whole-graph DP only) | whole-graph DP CPU s (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    first = None
    for layers in depths:
        graph = synthetic.residual_net(layers, same_layers=same_layers)
        forward = sum(n.flops for n in graph.nodes)
        keys = stage_signatures(GraphInfo.of(graph))
        p, t_plan = timed(plan, graph, 0.5)
        whole, t_whole = timed(plan, graph, 0.5, staged="never")
        ratio = p.predicted_recompute_flops / forward
        first = first if first is not None else ratio
        lines.append(
            f"| {layers} | {len(graph.nodes)} | {len(keys)} ({len(set(keys))}) | "
            f"{100 * ratio:.1f} ({ratio / first:.2f}x) | {p.meta['solved_by']} | {t_plan} | "
            f"{100 * whole.predicted_recompute_flops / forward:.1f} | {t_whole} |"
        )
        print(lines[-1], flush=True)
    return lines


def timed(fn, *args, **kwargs):
    """(result, "CPU s (wall s)") of one call."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    return out, f"{time.process_time() - c0:.2f} ({time.perf_counter() - w0:.2f})"


def small_graph_time() -> list[str]:
    graph = synthetic.residual_net(3)  # 184 nodes
    times = [timed(plan, graph, 0.5)[1] for _ in range(3)]
    line = f"residual_net(3), {len(graph.nodes)} nodes: plan in {min(times)} CPU s (wall s)"
    print(line, flush=True)
    return [line]


def dag_gaps(sizes: list[int], seeds: int = 40) -> list[str]:
    ratios, scheduled, dp_ratios, times = [], 0, [], []
    for n in sizes:
        for seed in range(seeds):
            graph = synthetic.random_dag(n, seed=seed, alias_prob=0.0)
            minimum, naive = min_feasible_peak(graph)[0], naive_peak(graph)
            schedule = Schedule(graph)
            for k in range(4):
                budget = minimum + k * (naive - minimum) // 4
                opt = solve(schedule, budget, relax=False)
                if opt.recompute_flops is None:
                    continue
                c0 = time.process_time()
                planned = plan(graph, budget)
                times.append(time.process_time() - c0)
                scheduled += bool(planned.schedule)
                best = opt.recompute_flops
                dp = optimal_plan(graph, budget).predicted_recompute_flops
                ratios.append(_ratio(planned.predicted_recompute_flops, best))
                dp_ratios.append(_ratio(dp, best))
    lines = []
    for name, rs in (("plan (default)", ratios), ("DP only (no explicit schedules)", dp_ratios)):
        within = sum(r <= 1.05 + 1e-9 for r in rs)
        lines.append(
            f"random DAGs n={sizes[0]}..{sizes[-1]}, {len(rs)} cases, {name}: "
            f"{100 * within / len(rs):.1f}% within 5% of the MILP optimum, median "
            f"{statistics.median(rs):.2f}, mean {statistics.mean(rs):.2f}, worst {max(rs):.2f}"
        )
        print(lines[-1], flush=True)
    lines.append(
        f"explicit schedules chosen in {scheduled} of {len(ratios)} cases; plan CPU s median "
        f"{statistics.median(times):.3f}, max {max(times):.2f}"
    )
    print(lines[-1], flush=True)
    return lines


def _ratio(planned: float, best: float) -> float:
    return planned / best if best > 1e-9 else (1.0 if planned < 1e-9 else 9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("depth", "dags", "real"), help="one part")
    parser.add_argument("--layers", type=int, nargs="*", default=[2, 8, 32, 64])
    parser.add_argument("--gpt2", action="store_true", help="also GPT-2 124M (medium profile)")
    parser.add_argument("--unet", action="store_true", help="also the DDPM U-Net (medium profile)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.only == "real":
        from bench_planner_real import real_graphs  # beside this script

        lines = real_graphs(args.layers, args.gpt2, args.unet)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "planner_real.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {OUT / 'planner_real.md'}")
        return 0
    depths = [12, 48] if args.quick else [12, 24, 48, 96, 192]
    lines = []
    if args.only != "dags":
        lines += ["## Planner: depth sweep (residual_net, budget 0.5)", ""]
        lines += ["Every layer different (random padding per layer):", ""]
        lines += depth_sweep(depths)
        lines += ["", "Identical layers (`same_layers=True`, as in a real model's stack):", ""]
        lines += depth_sweep(depths, same_layers=True)
        lines += ["", *small_graph_time(), ""]
    if args.only != "depth":
        lines += dag_gaps([6] if args.quick else [5, 6, 7, 8])
    OUT.mkdir(parents=True, exist_ok=True)
    name = f"planner_{args.only}.md" if args.only else "planner.md"
    (OUT / name).write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
