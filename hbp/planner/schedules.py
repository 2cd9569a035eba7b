"""Explicit schedules: on small graphs, the integer programme's schedule as a plan.

A plan of segments (checkpoints, nested, with pinned values) holds a recomputed segment's
input until the segment's backward ends. Some schedules recompute less: they recompute a value
for one backward, let it go, and recompute it again for a later one (NOTE [ Explicit
schedules ]). `schedule_plan` solves the Checkmate-style programme of `hbp.planner.milp`
(node mode: a backward's saved tensors come from its own node's last run, which is what torch
can execute) on graphs of at most `MAX_VALUES` forward values, starting from the DP's plan,
and returns its schedule as a `Plan` when it recomputes less than that plan.
`hbp.runtime.executors.schedule` runs such plans.
"""

from __future__ import annotations

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import Simulation
from hbp.graph.ir import Graph
from hbp.planner.plan import Plan, Segment, StageRecompute
from hbp.planner.schedule_model import Schedule, forward_values

# NOTE [ Explicit schedules ]
# The programme's stages are the forward nodes in order, then one per node with a backward,
# in reverse order: autograd's own order on a graph recorded in topological order (the
# engine runs the ready node created last). A schedule recomputes values only at the start
# of backward stages (`Schedule(forward_recompute=False)`): a value recomputed in the forward
# would be a second autograd node for the same op. Everything else follows from the
# recomputations (`Schedule.steps`): a node's backward uses what its last run saved, a value
# is kept while a later stage needs it and let go at its last use. The programme is solved
# only where it is small (MAX_VALUES values: its solve time grows fast with the values) and
# only replaces the DP's plan when it recomputes at least SAVING less: most small graphs' optimum
# is a checkpoint plan, which the DP finds exactly.

MAX_VALUES = 10
TIME_LIMIT_S = 2.0
SAVING = 0.01


def schedule_plan(
    graph: Graph,
    budget_bytes: int,
    dp_plan: Plan | None,
    *,
    info: GraphInfo,
    naive: Simulation,
) -> Plan | None:
    """The programme's schedule within `budget_bytes` as a plan, if `graph` is small enough
    and it recomputes less than `dp_plan` (None: the DP found no plan); else None."""
    if len(forward_values(info)) > MAX_VALUES or not _views_only(graph):
        return None
    from hbp.planner.milp import solve  # HiGHS loads only when a small graph is solved

    sch = Schedule(graph, info, forward_recompute=False)
    start = [dp_plan] if dp_plan is not None else []
    optimum = solve(sch, budget_bytes, time_limit=TIME_LIMIT_S, relax=False, start=start)
    if optimum.best_found_flops is None:
        return None
    recomputed = _without_useless(sch, optimum.schedule, budget_bytes)
    if recomputed is None:
        return None
    peak, flops = sch.evaluate(recomputed)
    if dp_plan is not None and flops >= dp_plan.predicted_recompute_flops * (1 - SAVING):
        return None
    names = info.names
    stages: dict[int, list[int]] = {}
    for t, i in sorted(recomputed):
        stages.setdefault(sch.stages[t][2], []).append(sch.nodes[i])
    return Plan(
        [Segment(0, info.n, False, first=names[0], last=names[-1])],
        budget_bytes=int(budget_bytes),
        predicted_peak_bytes=int(peak),
        predicted_recompute_flops=float(flops),
        naive_peak_bytes=naive.peak_bytes,
        naive_flops=naive.total_flops,
        meta={
            "planner": "schedule",
            "solved_by": f"milp ({optimum.status})",
            "solve_time_s": optimum.solve_time_s,
        },
        schedule=[
            StageRecompute(node, tuple(values))
            for node, values in sorted(stages.items(), reverse=True)
        ],
    )


def _without_useless(
    sch: Schedule, recomputed: dict[tuple[int, int], int], budget_bytes: int
) -> dict[tuple[int, int], int] | None:
    """`recomputed` less every recomputation the schedule does without (None if it does not
    fit): ops without counted FLOPs (elementwise ops, views) cost the programme nothing, so
    its optimum may run them again for no reason. Each is dropped, last stage first, where
    the schedule without it still fits and recomputes and peaks no more."""
    fits = sch.evaluate(recomputed)
    if fits is None or fits[0] > budget_bytes:
        return None
    recomputed = dict(recomputed)
    for key in sorted(recomputed, reverse=True):
        del recomputed[key]
        without = sch.evaluate(recomputed)
        if without is None or without[0] > fits[0] or without[1] > fits[1]:
            recomputed[key] = 1
        else:
            fits = without
    return recomputed


def _views_only(graph: Graph) -> bool:
    """Whether every alias reads no forward value but its storage's (views, not in-place
    ops with other inputs): the programme folds an alias into its root, so recomputing the
    root's value makes the alias too."""
    is_input = {n.name for n in graph.nodes if n.is_input}
    return all(
        all(x == n.alias_of or x in is_input for x in n.inputs)
        for n in graph.nodes
        if n.alias_of is not None
    )
