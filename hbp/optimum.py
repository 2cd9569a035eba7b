"""`python -m hbp.optimum`: the planner's recompute against the optimum (MILP) at budgets.

Usage (key=value arguments):
    python -m hbp.optimum graph=dag:8:seed=3 budget=0.5
    python -m hbp.optimum graph=chain:10 budget=0.3,0.5,1.0 mode=tensor
    python -m hbp.optimum graph=path/to/graph.json budget=64MiB
    python -m hbp.optimum workload=gpt2 profile=small budget=0.5,min time_limit=120
    python -m hbp.optimum graph=outputs/<run>/graph.json budget=0.3   # a tiny run's graph

graph: "chain:N", "dag:N", "uniform:N", "residual:LAYERS" (optional ":seed=S"), or an IR
JSON file (`Graph.to_json`); workload/profile: capture a registered workload's model
(needs torch). budget: as everywhere (fraction of the naive peak, bytes, "64MiB", "min" = the
planner's smallest feasible peak); a comma list gives one row each. mode: "node" (saved tensors come from re-running their op, what a
torch executor can do; default) or "tensor" (Checkmate's model). time_limit: seconds per
solve (wall time; past it the best schedule found and the proven lower bound are reported).
max_values: refuse graphs with more forward values (default 150; the MILP grows about
quadratically with them: docs/planner.md has its solve times).
"""

from __future__ import annotations

import sys

from hbp.analysis.simulate import Simulation, simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph import synthetic
from hbp.graph.ir import Graph
from hbp.planner import min_feasible_peak, optimal_plan, parse_budget
from hbp.planner.milp import solve
from hbp.planner.plan import Plan
from hbp.planner.schedule_model import Schedule

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
    from hbp.graph.torch.capture import capture  # the CLI may use torch; the planner never
    from hbp.workloads import build

    wl = build(name, profile)
    batch = wl.make_batch(0)
    return capture(wl.model, batch.args, batch.kwargs).graph


def compare(
    graph: Graph,
    budget,
    *,
    mode: str = "node",
    time_limit: float = 60.0,
    schedule: Schedule | None = None,
    naive: Simulation | None = None,
    warm_start: bool = True,
) -> dict:
    """The optimum (MILP), its bounds and the planner's recompute at one budget.

    Returns a flat dict (bytes, FLOPs, seconds): budget_bytes, naive_peak_bytes, naive_flops,
    status ("optimal", "infeasible", "time limit", ...), optimum_flops (None unless optimal),
    best_found_flops (the MILP's best schedule: an upper bound on the optimum), lp_bound_flops
    (the LP relaxation), bound_flops (best proven lower bound), planner_flops and
    planner_peak_bytes (None when the planner finds no plan), gap (planner / optimum - 1; None
    unless both are known), gap_to_bound (planner / bound - 1: the most the planner can be off
    when the MILP did not finish), milp_time_s, lp_time_s, planner_time_s, variables.
    `schedule` (`Schedule(graph, mode=mode)`) and `naive` (`simulate(graph)`) may be passed
    in when comparing at several budgets, so that they are built once. `warm_start`: the
    MILP starts from the planner's plan (NOTE [ Starting from the planner's schedule ] in
    hbp.planner.milp), so its best schedule is never worse than the plan's.
    """
    naive = naive or simulate(graph)
    if budget == "min":
        budget_bytes = min_feasible_peak(graph)[0]
    else:
        budget_bytes = parse_budget(budget, naive.peak_bytes)
    sch = schedule or Schedule(graph, mode=mode)
    try:
        plan = optimal_plan(graph, budget_bytes)
        planner, planner_peak = plan.predicted_recompute_flops, plan.predicted_peak_bytes
        planner_time = plan.meta["solve_time_s"]
    except BudgetError:
        plan, planner, planner_peak, planner_time = None, None, None, None
    opt = solve(sch, budget_bytes, time_limit=time_limit, start=_starts(graph, plan, warm_start))
    tolerance = 1e-9 * max(1.0, naive.total_flops)  # solver round-off on a FLOP sum
    if planner is not None and opt.best_found_flops is not None:
        if abs(planner - opt.best_found_flops) <= tolerance:
            planner = opt.best_found_flops
    return {
        "budget_bytes": budget_bytes,
        "naive_peak_bytes": naive.peak_bytes,
        "naive_flops": naive.total_flops,
        "status": opt.status,
        "optimum_flops": opt.recompute_flops,
        "best_found_flops": opt.best_found_flops,
        "lp_bound_flops": opt.lower_bound_flops,
        "bound_flops": opt.proven_bound_flops,
        "planner_flops": planner,
        "planner_peak_bytes": planner_peak,
        "gap": _relative(planner, opt.recompute_flops, tolerance),
        "gap_to_bound": _relative(planner, opt.proven_bound_flops, tolerance),
        "milp_time_s": opt.solve_time_s,
        "lp_time_s": opt.lp_time_s,
        "planner_time_s": planner_time,
        "variables": opt.variables,
    }


def _starts(graph: Graph, plan: Plan | None, warm_start: bool) -> list[Plan]:
    """The plans the MILP starts from (NOTE [ Starting from the planner's schedule ] in
    hbp.planner.milp): the planner's, and the planner's without pins (a pin is dearer as a
    schedule than as planned)."""
    if not warm_start or plan is None:
        return []
    try:
        return [plan, optimal_plan(graph, plan.budget_bytes, pins=False)]
    except BudgetError:  # only a plan with pins fits
        return [plan]


def _relative(value: float | None, reference: float | None, tolerance: float) -> float | None:
    """value / reference - 1 (0 when both are ~0, inf when only the reference is)."""
    if value is None or reference is None:
        return None
    if reference <= tolerance:
        return 0.0 if value <= tolerance else float("inf")
    return (value - reference) / reference


def frontier(graph: Graph, budgets, *, mode: str = "node", time_limit: float = 60.0) -> list[dict]:
    """`compare` at each budget (fractions of the naive peak, bytes, "64MiB", "min" = the
    planner's smallest feasible peak), each row with `budget` (as given) and the recompute
    figures also as fractions of one naive step's FLOPs (`*_ratio`)."""
    rows, sch, naive = [], Schedule(graph, mode=mode), simulate(graph)
    for budget in budgets:
        result = compare(graph, budget, time_limit=time_limit, schedule=sch, naive=naive)
        row = {"budget": budget, **result}
        for key in ("optimum", "best_found", "lp_bound", "bound", "planner"):
            value = row[f"{key}_flops"]
            row[f"{key}_ratio"] = None if value is None else value / row["naive_flops"]
        rows.append(row)
    return rows


def _fmt(x, unit=""):
    if x is None:
        return "-"
    return f"{x:.3g}{unit}" if unit == "s" else f"{x:.4g}{unit}"


def _budget_value(text: str):
    """A budget from the command line: "0.5" -> 0.5, "1000000" -> 1000000 bytes, else as
    written ("64MiB", "min")."""
    if text.isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


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
    sch = Schedule(graph, mode=mode)
    values = sch.N
    limit = int(args.get("max_values", 150))
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
        f"{'budget':>12} {'optimum':>10} {'bound':>10} {'planner':>10} {'gap':>8} "
        f"{'gap/step':>9} {'MILP s':>7} {'LP s':>6} {'plan s':>6}"
    )
    for budget in args.get("budget", "0.5").split(","):
        try:
            r = compare(
                graph,
                _budget_value(budget),
                time_limit=float(args.get("time_limit", 60)),
                schedule=sch,
                naive=naive,
            )
        except ConfigError as err:
            print(f"{budget:>12} {err}")
            continue
        best, planner = r["best_found_flops"], r["planner_flops"]
        gap = r["gap"] if r["status"] == "optimal" else r["gap_to_bound"]
        step_gap = None if best is None or planner is None else (planner - best) / r["naive_flops"]
        note = "" if r["status"] == "optimal" else f"  ({r['status']}"
        if r["status"] == "time limit":  # optimum in [bound, best found]; gap is an upper bound
            note += "; optimum column = best found, gap = planner vs the proven bound"
        print(
            f"{r['budget_bytes']:>12} {_fmt(best):>10} "
            f"{_fmt(r['bound_flops']):>10} {_fmt(planner):>10} "
            f"{_fmt(None if gap is None else 100 * gap, '%'):>8} "
            f"{_fmt(None if step_gap is None else 100 * step_gap, '%'):>9} "
            f"{r['milp_time_s']:>7.2f} {r['lp_time_s']:>6.2f} "
            f"{_fmt(r['planner_time_s'], 's'):>6}" + (note + ")" if note else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
