"""Plans at module level: where op-level capture fails, the graph is the chain of recorded
child-module calls, and only some plans over it can be executed (NOTE [ Module-level plans ]).

`module_level_plan` chooses among the executable plans; HCModule and `hbp.estimate` both call
it, so `budget="min"` and `BudgetError.minimum` are the same figure in both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError
from hbp.planner.dp.least_peak import info_fingerprint
from hbp.planner.plan import Plan, Segment

if TYPE_CHECKING:  # the planner imports no torch
    from hbp.graph.torch.captured import CapturedGraph

__all__ = ["checkpointed_calls", "module_level_plan"]

# NOTE [ Module-level plans ]
# Where op-level capture fails, the graph is the chain of recorded child-module calls
# (repeated blocks at any depth). The executor can only checkpoint whole calls, or runs of
# an nn.Sequential's children: code between the calls cannot be re-run on its own, so
# nested plans and segments spanning such code are not executable. The plan is therefore
# chosen among the executable ones. The least memory the fallback reaches is the lesser of
# every call checkpointed alone and the planner's least plan as executed; budget="min" is
# planned as a budget of that peak (of the plans that reach it, the least recompute), and
# its plan's peak is BudgetError.minimum. For a budget: the planner's plan
# (planned again for a budget lowered by the excess while its execution is over), and every
# call checkpointed alone then run plainly, the most expensive first, while the simulated
# peak stays within the budget; the one of these that fits with the least recompute runs.

# NOTE [ Module-level plans are remembered ]
# Whatever its budget, a module-level plan call asks the planner for "min" and seven budgets
# across the range (and a few lowered targets), and `hbp.estimate` makes one call per budget
# it is asked, then HCModule one per budget of its own: on a 19-node graph of six blocks, 25
# planner calls of ~0.3 s for an estimate of two budgets, where 8 are distinct. The planner's
# segments (or its BudgetError) are remembered per graph structure (`info_fingerprint`, as
# the least peaks are), budget and planner options, for the last REMEMBERED_PLANS of them.
REMEMBERED_PLANS = 64
_PLANNED: dict[tuple, list[Segment] | None] = {}


def _planner_segments(graph, info, budget, block_size: int, planner: str) -> list[Segment] | None:
    """`hbp.planner.plan(graph, budget)`'s segments, None where it raises BudgetError (NOTE
    [ Module-level plans are remembered ]). A copy: the caller may change them."""
    from hbp.planner import plan as make_plan

    key = (info_fingerprint(info), budget, block_size, planner)
    if key not in _PLANNED:
        try:
            segments = make_plan(graph, budget, block_size=block_size, planner=planner).segments
        except BudgetError:
            segments = None
        _PLANNED[key] = segments
        while len(_PLANNED) > REMEMBERED_PLANS:
            _PLANNED.pop(next(iter(_PLANNED)))
    return copy.deepcopy(_PLANNED[key])


def checkpointed_calls(n_nodes: int, recomputed: list[int]) -> list[Segment]:
    """Segments over a module-level graph of `n_nodes` nodes: call i checkpointed alone for
    each i in `recomputed`, the rest plain (node 0 is the graph input)."""
    marks = set(recomputed)
    return [Segment(0, 1)] + [Segment(i, i + 1, i in marks) for i in range(1, n_nodes)]


def module_level_plan(
    captured: CapturedGraph,
    naive_peak_bytes: int,
    budget_bytes: int | None,
    *,
    executable: Callable[[Plan, CapturedGraph], Plan],
    block_size: int = 1,
    planner: str = "optimal",
) -> Plan:
    """The executable module-level plan with the least recompute within `budget_bytes`
    (None: the least peak), NOTE [ Module-level plans ].

    Args:
        captured: a module-level capture (its graph: node 0 the input, one node per call).
        naive_peak_bytes: its plain step's simulated peak.
        budget_bytes: the budget; None for the least memory reachable ("min").
        executable: `executable(plan, captured)` is the plan the module-level executor really
            runs (whole calls checkpointed: `hbp.runtime.executors.segments.per_call_plan`).
        block_size, planner: as for `hbp.planner.plan`.

    Raises:
        BudgetError: no executable plan fits `budget_bytes` (`.minimum` is the least one).
    """
    graph = captured.graph
    info = GraphInfo.of(graph)
    n = len(graph)
    naive = naive_peak_bytes
    # A call that overwrites its input in place cannot start a checkpoint: the saved input
    # would be the overwritten one at recompute.
    overwritten = {graph.index(name) for name in captured.mutated_inputs}

    def executed(segments: list[Segment]) -> tuple[Plan, Any] | None:
        plan = executable(Plan(segments), captured)
        if any(s.recompute and s.start in overwritten for s in plan.segments):
            return None
        return plan, simulate(graph, plan, info=info)

    def planned(budget: int | str) -> tuple[Plan, Any] | None:
        """The planner's plan for `budget`, as executed; None if it has none."""
        segments = _planner_segments(graph, info, budget, block_size, planner)
        return None if segments is None else executed(segments)

    alone = [i for i in range(1, n) if i not in overwritten]
    candidates = [executed(checkpointed_calls(n, alone)), planned("min")]
    lowest = candidates[-1][1].peak_bytes if candidates[-1] else naive
    step = (naive - lowest) / 8  # the planner's plans across the range, as executed
    candidates += [planned(int(lowest + k * step)) for k in range(1, 8)]
    least = min(filter(None, candidates), key=lambda option: option[1].peak_bytes)

    def within(budget: int) -> tuple[Plan, Any]:
        """Of `least`, the planner's plan (lowered while its execution is over `budget`) and
        every call alone then run plainly while it fits, the least recompute within `budget`."""
        options = [least]
        target = budget
        for _ in range(6):
            option = planned(target) if target > 0 else None
            if option is None:  # no plan, or not executable
                break
            if option[1].peak_bytes <= budget:
                options.append(option)
                break
            target -= option[1].peak_bytes - budget
        recomputed = alone
        for i in sorted(alone, key=lambda i: -info.flops[i]):
            trial = [j for j in recomputed if j != i]
            if executed(checkpointed_calls(n, trial))[1].peak_bytes <= budget:
                recomputed = trial
        options.append(executed(checkpointed_calls(n, recomputed)))
        fitting = [o for o in options if o is not None and o[1].peak_bytes <= budget]
        return min(fitting, key=lambda option: (option[1].recompute_flops, option[1].peak_bytes))

    # "min"'s plan (its peak is the least or below), needed where the budget is below `least`
    at_least = None
    if budget_bytes is None or least[1].peak_bytes > budget_bytes:
        at_least = within(least[1].peak_bytes)
    if budget_bytes is None:
        chosen, budget_bytes = at_least, at_least[1].peak_bytes
    elif at_least is not None and at_least[1].peak_bytes > budget_bytes:
        raise BudgetError(
            budget_bytes,
            at_least[1].peak_bytes,
            "the least that checkpointing whole child calls reaches (a module-level plan: "
            f"op-level capture failed, {captured.fallback_reason})",
        )
    else:
        chosen = within(budget_bytes)
    plan, sim = chosen
    plan.budget_bytes = budget_bytes
    plan.predicted_peak_bytes = sim.peak_bytes
    plan.predicted_recompute_flops = sim.recompute_flops
    plan.naive_peak_bytes = naive
    plan.naive_flops = simulate(graph, info=info).total_flops  # the plain step's, as finish_plan
    plan.meta.update(planner="module-level (executable plans)", solved_by="least recompute")
    return plan
