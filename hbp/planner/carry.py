"""Plans carried to a new input signature of the same structure: the plans of other sizes of
one step (another sequence length or batch size), checked by the simulator at this one's
sizes, instead of the DP (NOTE [ Plans carried across sizes ]).

    key = structure_key(graph)                  # equal for every length of one model's step
    plan = carried_plan(graph, budget, donors)  # a donor's plan that fits here, or None
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph
from hbp.planner.budget import Budget, BudgetKind
from hbp.planner.dp.finish import finish_plan
from hbp.planner.plan import CARRIED, Plan, Segment

__all__ = ["CARRIED", "Donor", "carried_plan", "structure_key"]

# NOTE [ Plans carried across sizes ]
# Dynamic padding makes nearly every batch a new input signature, and on a graph the stages
# do not cover (a few layers) the DP takes seconds per signature (docs/results.md, variable-
# length batches), 40x a plain step. The graphs of one step at two sizes have the same nodes
# and wiring; only bytes and FLOPs differ. A plan is positions in that wiring, so a plan made
# for one size runs at another, and the simulator gives its peak and recompute there in
# milliseconds. `carried_plan` takes, of the plans made for other sizes (for "min", their
# least-peak plans too), the one that recomputes least among those whose simulated peak fits
# this size's budget; where none fits, the caller plans as before. What it gives up: the least recompute
# at this size (the DP could find a plan that recomputes less), never the budget (every
# candidate is simulated here, and HCModule measures the first step as it does any plan's).
# A budget relative to the least peak ("N%act", "min") is resolved against the least of the
# donors' least-peak plans simulated here: a peak that a plan reaches, at least the least
# peak, equal to it where a donor was as long or longer (docs/results.md has the figures).
# Plans made from the DP are the donors, never carried ones: carrying does not drift.


def structure_key(graph: Graph) -> str:
    """A hex digest of `graph`'s nodes and wiring without its sizes: the ops, the modules,
    who reads and saves whom (by position), the flags the planner and the executors read,
    and the outputs; equal for the graphs of one step at two sizes."""
    index = {node.name: i for i, node in enumerate(graph.nodes)}

    def positions(names) -> list | None:
        return None if names is None else [index.get(v, v) for v in names]

    rows = [
        (
            node.op,
            node.module,
            positions(node.inputs),
            positions(node.saved_inputs),
            positions(node.grad_passthrough),
            None if node.alias_of is None else index.get(node.alias_of, node.alias_of),
            node.requires_grad,
            node.saves_output,
            node.is_input,
            node.output_after_last_save,
            node.draws_random,
            node.writes_in_place,
        )
        for node in graph.nodes
    ]
    text = json.dumps(
        [
            rows,
            positions(graph.outputs),
            positions(graph.grad_outputs),
            positions(graph.held_outputs),
            bool(graph.rng_state_bytes),
        ],
        default=str,
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Donor:
    """A plan made by the DP for another size of the same structure: `graph` it was made for,
    `plan`, and `least`: the top-level segments of that graph's least-peak plan (None where
    not known; a relative budget needs one donor's)."""

    graph: Graph
    plan: Plan
    least: list[Segment] | None = None


def carried_plan(
    graph: Graph, budget: Budget, donors: Sequence[Donor], info: GraphInfo | None = None
) -> Plan | None:
    """The donors' plan (for "min", or least-peak plan) that recomputes least of those
    whose simulated peak on `graph` fits `budget` resolved for `graph`, finished for `graph`;
    None where none fits, where the budget is met by the plain step (nothing to plan), where a
    budget relative to the least peak has no donor's least-peak plan, or for "fit" (NOTE
    [ Plans carried across sizes ])."""
    if budget.kind is BudgetKind.FIT or not donors:
        return None
    info = info or GraphInfo.of(graph)
    naive = simulate(graph, info=info)
    sims = {}  # segments' key -> (segments, simulation), each candidate simulated once

    def simulated(segments: list[Segment]):
        key = _segments_key(segments)
        if key not in sims:
            mine = copy.deepcopy(segments)
            sims[key] = (mine, simulate(graph, mine, info=info))
        return sims[key]

    least = [simulated(d.least)[1].peak_bytes for d in donors if d.least is not None]
    relative = budget.kind in (BudgetKind.ACTIVATIONS, BudgetKind.MIN)
    if relative and not least:
        return None
    budget_bytes = budget.resolve(naive.peak_bytes, lambda: min(least))
    if budget_bytes == "min":
        budget_bytes = min(least)
    if budget_bytes >= naive.peak_bytes:
        return None
    # NOTE [ Least-peak plans are carried for "min" alone ]
    candidates = {} if budget.kind is not BudgetKind.MIN else dict(sims)
    for donor in donors:
        if not donor.plan.schedule:  # an explicit schedule is not a plan of segments
            segments, sim = simulated(donor.plan.segments)
            candidates[_segments_key(segments)] = (segments, sim)
    fits = [(s, sim) for s, sim in candidates.values() if sim.peak_bytes <= budget_bytes]
    if not fits:
        return None
    segments, sim = min(fits, key=lambda x: (x[1].recompute_flops, x[1].peak_bytes))
    planner = donors[0].plan.meta.get("planner", "optimal")
    meta = {"planner": planner, "solved_by": CARRIED, "donors": len(donors)}
    return finish_plan(graph, segments, budget_bytes, info=info, naive=naive, meta=meta, sim=sim)


# NOTE [ Least-peak plans are carried for "min" alone ]
# A donor's least-peak plan gives the least peak a relative budget is resolved against; as a
# plan to run, it recomputes as much as a plan can. Carried to a longer length whose budget
# the donors' own plans exceed, it fits (about half the budget on a Qwen2) and recomputed
# 28-39% of the step's FLOPs more than that length's own plan (docs/results.md): a plan
# the DP's seconds are better spent on. So it is a candidate only where the budget is "min",
# the least peak itself, the budget the donors' own plans were made for.


def _segments_key(segments: list[Segment]) -> tuple:
    return tuple(
        (s.start, s.stop, s.recompute, s.pinned, _segments_key(s.children)) for s in segments
    )
