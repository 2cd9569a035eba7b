"""`python -m hbp.optimum`: the planner's recompute against the optimum (MILP) at budgets.

Usage (key=value arguments):
    python -m hbp.optimum graph=dag:8:seed=3 budget=0.5
    python -m hbp.optimum graph=chain:10 budget=0.3,0.5,1.0 mode=tensor
    python -m hbp.optimum graph=path/to/graph.json budget=64MiB
    python -m hbp.optimum workload=gpt2 profile=small budget=0.5

graph: "chain:N", "dag:N", "uniform:N", "residual:LAYERS" (optional ":seed=S"), or an IR
JSON file (`Graph.to_json`); workload/profile: capture a registered workload's model
(needs torch). budget: as everywhere (fraction of the naive peak, bytes, "64MiB"); a comma
list gives one row each. mode: "node" (saved tensors come from re-running their op, what a
torch executor can do; default) or "tensor" (Checkmate's model). time_limit: seconds per
solve. max_values: refuse graphs with more forward values (the MILP grows ~quadratically).
"""

from __future__ import annotations

import sys

from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph import synthetic
from hbp.graph.ir import Graph
from hbp.planner import optimal_plan, parse_budget
from hbp.planner.optimum import Schedule

GENERATORS = {
    "chain": synthetic.chain,
    "dag": synthetic.random_dag,
    "uniform": synthetic.uniform_chain,
    "residual": synthetic.residual_net,
}


def load_graph(spec: str) -> Graph:
    """A graph from a generator spec ("dag:8:seed=3") or an IR JSON file path."""
    if spec.endswith(".json"):
        return Graph.from_json(spec)
    name, *rest = spec.split(":")
    if name not in GENERATORS or not rest:
        raise ConfigError(
            "graph", spec, "KIND:N[:seed=S] with KIND in " + ", ".join(GENERATORS) + ", or a .json"
        )
    kw = {}
    for part in rest[1:]:
        key, _, value = part.partition("=")
        kw[key] = int(value)
    return GENERATORS[name](int(rest[0]), **kw)


def capture_workload(name: str, profile: str) -> Graph:
    """The op-level graph of a workload's model on its batch (imports torch)."""
    from hbp.graph.torch_capture import capture  # the CLI may use torch; the planner never
    from hbp.workloads import build

    wl = build(name, profile)
    batch = wl.make_batch(0)
    return capture(wl.model, batch.args, batch.kwargs).graph


def compare(graph: Graph, budget, *, mode: str = "node", time_limit: float = 60.0) -> dict:
    """Optimal recompute (MILP), its LP bound, and the planner's recompute at one budget."""
    naive = simulate(graph)
    budget_bytes = parse_budget(budget, naive.peak_bytes)
    sch = Schedule(graph, mode=mode)
    opt = sch.solve(budget_bytes, time_limit=time_limit)
    try:
        plan = optimal_plan(graph, budget_bytes)
        planner = plan.predicted_recompute_flops
        planner_time = plan.meta["solve_time_s"]
    except BudgetError:
        planner, planner_time = None, None
    gap = None
    if planner is not None and opt.recompute_flops is not None:
        if abs(planner - opt.recompute_flops) <= 1e-9 * max(1.0, naive.total_flops):
            planner = opt.recompute_flops  # solver round-off
        gap = (
            (planner - opt.recompute_flops) / opt.recompute_flops
            if opt.recompute_flops
            else (0.0 if planner == 0 else float("inf"))
        )
    return {
        "budget_bytes": budget_bytes,
        "naive_peak_bytes": naive.peak_bytes,
        "naive_flops": naive.total_flops,
        "status": opt.status,
        "optimum_flops": opt.recompute_flops,
        "lp_bound_flops": opt.lower_bound_flops,
        "planner_flops": planner,
        "gap": gap,
        "milp_time_s": opt.solve_time_s,
        "lp_time_s": opt.lp_time_s,
        "planner_time_s": planner_time,
        "variables": opt.variables,
    }


def _fmt(x, unit=""):
    if x is None:
        return "-"
    return f"{x:.3g}{unit}" if unit == "s" else f"{x:.4g}{unit}"


def main(argv: list[str] | None = None) -> int:
    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv) if "=" in a)
    known = {"graph", "workload", "profile", "budget", "mode", "time_limit", "max_values"}
    unknown = set(args) - known
    if unknown:
        raise ConfigError("argument", sorted(unknown), "key=value with keys " + ", ".join(known))
    if "workload" in args:
        graph = capture_workload(args["workload"], args.get("profile", "small"))
        label = f"workload={args['workload']} profile={args.get('profile', 'small')}"
    else:
        graph = load_graph(args.get("graph", "dag:8"))
        label = args.get("graph", "dag:8")
    mode = args.get("mode", "node")
    values = Schedule(graph, mode=mode).N
    limit = int(args.get("max_values", 60))
    if values > limit:
        raise ConfigError(
            "graph", label, f"at most max_values={limit} forward values for the MILP ({values})"
        )
    naive = simulate(graph)
    print(
        f"{label}: {len(graph)} nodes, {values} forward values, naive peak "
        f"{naive.peak_bytes} bytes, {naive.total_flops:.4g} step FLOPs, mode={mode}"
    )
    print(
        f"{'budget':>12} {'optimum':>10} {'LP bound':>10} {'planner':>10} {'gap':>8} "
        f"{'gap/step':>9} {'MILP s':>7} {'LP s':>6} {'plan s':>6}"
    )
    for budget in args.get("budget", "0.5").split(","):
        try:
            value = float(budget) if "." in budget and budget[-1].isdigit() else budget
            if isinstance(value, str) and value.isdigit():
                value = int(value)
            r = compare(graph, value, mode=mode, time_limit=float(args.get("time_limit", 60)))
        except ConfigError as err:
            print(f"{budget:>12} {err}")
            continue
        step_gap = None
        if r["planner_flops"] is not None and r["optimum_flops"] is not None:
            step_gap = 100 * (r["planner_flops"] - r["optimum_flops"]) / r["naive_flops"]
        print(
            f"{r['budget_bytes']:>12} {_fmt(r['optimum_flops']):>10} "
            f"{_fmt(r['lp_bound_flops']):>10} {_fmt(r['planner_flops']):>10} "
            f"{_fmt(None if r['gap'] is None else 100 * r['gap'], '%'):>8} "
            f"{_fmt(step_gap, '%'):>9} {r['milp_time_s']:>7.2f} {r['lp_time_s']:>6.2f} "
            f"{_fmt(r['planner_time_s'], 's'):>6}"
            + ("" if r["status"] == "optimal" else f"  ({r['status']})")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
