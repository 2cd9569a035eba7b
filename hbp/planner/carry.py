"""Plans carried to a new input signature of the same structure: the plans of other sizes of
one step (another sequence length or batch size), checked by the simulator at this one's
sizes, instead of the DP (NOTE [ Plans carried across sizes ]).

    key = structure_key(graph)                  # equal for every length of one model's step
    plan = carried_plan(graph, budget, donors)  # a donor's plan that fits here, or None
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph
from hbp.planner.budget import Budget, BudgetKind
from hbp.planner.cache import graph_digest
from hbp.planner.cuts import cut_choices
from hbp.planner.dp.finish import finish_plan
from hbp.planner.dp.least_peak import union_floor
from hbp.planner.plan import CARRIED, Plan, Segment

__all__ = [
    "CARRIED",
    "Donor",
    "carried_plan",
    "donor_floor_gap",
    "floor_under_least_peak",
    "structure_key",
]

# NOTE [ Plans carried across sizes ]
# Dynamic padding makes nearly every batch a new input signature, and on a graph the stages
# do not cover (a few layers) the DP takes seconds per signature (docs/results.md, variable-
# length batches), 40x a plain step. The graphs of one step at two sizes have the same nodes
# and wiring; only bytes and FLOPs differ. A plan is positions in that wiring, so a plan made
# for one size runs at another, and the simulator gives its peak and recompute there in
# milliseconds. `carried_plan` takes, of the plans made for other sizes, the one that
# recomputes least among those whose simulated peak fits this size's budget (and that do not
# recompute much more than at their own size: NOTE [ What a carried plan must meet ]); where
# none fits, the caller plans as before. What it gives up: the least recompute
# at this size (the DP could find a plan that recomputes less), never the budget (every
# candidate is simulated here, and HCModule measures the first step as it does any plan's).
# A budget relative to the least peak ("N%act") is resolved against the least of the donors'
# least-peak plans simulated here: a peak that a plan reaches, at least the least peak, equal
# to it where a donor was as long or longer (docs/results.md has the figures). Plans made from
# the DP are the donors, never carried ones: carrying does not drift.


def structure_key(graph: Graph) -> str:
    """A hex digest of `graph`'s nodes and wiring without its sizes: the ops, the modules,
    who reads and saves whom (by position), the flags the planner and the executors read,
    and the outputs; equal for the graphs of one step at two sizes."""

    def row(node, position) -> tuple:
        return (
            node.op,
            node.module,
            [position(v) for v in node.inputs],
            [position(v) for v in node.saved_inputs],
            [position(v) for v in node.grad_passthrough],
            None if node.alias_of is None else position(node.alias_of),
            node.requires_grad,
            node.saves_output,
            node.is_input,
            node.output_after_last_save,
            node.draws_random,
            node.writes_in_place,
        )

    return graph_digest(graph, row, tail=(bool(graph.rng_state_bytes),))


@dataclass
class Donor:
    """A plan made by the DP for another size of the same structure: `graph` it was made for,
    `plan`, `least`: the top-level segments of that graph's least-peak plan (None where not
    known; a relative budget needs one donor's), and `least_over_floor`: that graph's least
    peak over the floor under it (`donor_floor_gap`)."""

    graph: Graph
    plan: Plan
    least: list[Segment] | None = None
    least_over_floor: float = 1.0  # its least peak over the floor under it, at its size


def carried_plan(
    graph: Graph,
    budget: Budget,
    donors: Sequence[Donor],
    info: GraphInfo | None = None,
    *,
    block_size: int = 1,
    nested: bool = True,
) -> Plan | None:
    """The donors' plan that recomputes least of those whose simulated peak on `graph` fits
    `budget` resolved for `graph`, finished for `graph`; None where none fits, or fits only by
    recomputing much more than at its donor's size (`RECOMPUTE_GROWTH`), where the budget is met by
    the plain step (nothing to plan), where a budget relative to the least peak has no least
    peak known within `LEAST_PEAK_SLACK`, or for "min" and "fit" (NOTE [ Plans carried
    across sizes ], NOTE [ What a carried plan must meet ]). `block_size`, `nested`: the
    planner's, for the floor under the least peak."""
    if budget.kind in (BudgetKind.FIT, BudgetKind.MIN) or not donors:
        return None
    info = info or GraphInfo.of(graph)
    naive = simulate(graph, info=info)
    budget_bytes = budget.resolve(naive.peak_bytes, lambda: 0)
    if budget.kind is BudgetKind.ACTIVATIONS and budget_bytes < naive.peak_bytes:
        least = _least_peak_reached(graph, info, donors, block_size, nested)
        if least is None:
            return None
        budget_bytes = budget.resolve(naive.peak_bytes, lambda: least)
    if budget_bytes >= naive.peak_bytes:
        return None
    fits = []
    for donor in donors:
        if donor.plan.schedule:  # an explicit schedule is not a plan of segments
            continue
        segments = copy.deepcopy(donor.plan.segments)
        sim = simulate(graph, segments, info=info)
        ratio = sim.recompute_flops / naive.total_flops if naive.total_flops else 0.0
        allowed = donor.plan.predicted_recompute_ratio * RECOMPUTE_GROWTH + RECOMPUTE_SLACK
        if sim.peak_bytes <= budget_bytes and ratio <= allowed:
            fits.append((segments, sim))
    if not fits:
        return None
    segments, sim = min(fits, key=lambda x: (x[1].recompute_flops, x[1].peak_bytes))
    planner = donors[0].plan.meta.get("planner", "optimal")
    meta = {"planner": planner, "solved_by": CARRIED, "donors": len(donors)}
    return finish_plan(graph, segments, budget_bytes, info=info, naive=naive, meta=meta, sim=sim)


#: A carried plan may recompute at most this many times its donor's share of the step's FLOPs,
#: plus `RECOMPUTE_SLACK` (NOTE [ What a carried plan must meet ]).
RECOMPUTE_GROWTH = 1.25
RECOMPUTE_SLACK = 0.01
#: A relative budget is resolved against a least-peak plan's peak at most this far above the
#: floor under the least peak, beyond the donor's own gap (NOTE [ What a carried plan must
#: meet ]).
LEAST_PEAK_SLACK = 0.05


def floor_under_least_peak(info: GraphInfo, block_size: int = 1, nested: bool = True) -> int:
    """The floor under the least peak of `info`'s graph over the planner's cut choices (a
    lower bound: NOTE [ A floor under the least peak ] in hbp.planner.dp.least_peak)."""
    return union_floor(info, cut_choices(info, block_size), nested)


def donor_floor_gap(graph: Graph, least_peak: int, block_size: int = 1, nested: bool = True):
    """`least_peak` (the graph's own) over the floor under it: `Donor.least_over_floor`."""
    floor = floor_under_least_peak(GraphInfo.of(graph), block_size, nested)
    return least_peak / floor if floor > 0 else 1.0


def _least_peak_reached(graph, info, donors, block_size: int, nested: bool) -> int | None:
    """The least peak the donors' least-peak plans reach on `graph`, of those within their
    donor's gap over the floor (`Donor.least_over_floor`) plus `LEAST_PEAK_SLACK`, else None."""
    floor = None
    reached = []
    for donor in donors:
        if donor.least is None:
            continue
        peak = simulate(graph, copy.deepcopy(donor.least), info=info).peak_bytes
        if floor is None:
            floor = floor_under_least_peak(info, block_size, nested)
        if peak <= floor * max(1.0, donor.least_over_floor) * (1 + LEAST_PEAK_SLACK):
            reached.append(peak)
    return min(reached, default=None)


# NOTE [ What a carried plan must meet ]
# Fitting the budget is not enough. A plan made for another size can fit this one by
# recomputing far more than this size's own plan would: a T5 whose source and target lengths
# vary apart ran a carried plan recomputing 41% of its step's FLOPs where its own plan
# recomputed 8% (a new-user trial), and a donor's least-peak plan, carried as a plan to a
# longer Qwen2 length, 28-39% more than that length's own (docs/results.md). The own plan's
# recompute is what the DP would find; the donor's own share at its size is the nearest fact
# at hand, so a carried plan may recompute at most RECOMPUTE_GROWTH times it, plus
# RECOMPUTE_SLACK of the step (a Qwen2's carried plans: up to 1.1 times), and the least-peak
# plans only resolve budgets, never run. A budget relative to the least peak ("N%act") needs
# this size's least peak; the donors' least-peak plans simulated here reach an upper bound of
# it. The floor under the least peak (NOTE [ A floor under the least peak ] in
# hbp.planner.dp.least_peak) is a lower bound, cheap at any size, but 11-32% below the least
# peak on a UNet, a HuBERT, a GPT-2 and residual MLPs (a new-user trial: with the bound within
# 5% of the floor, none of them carried a plan at "50%act"). The gap between the two is a fact
# of the structure, which the donor measured at its own size (its least peak is exact there):
# so a donor's least-peak plan resolves the budget where it reaches at most the floor times
# the donor's own gap, plus LEAST_PEAK_SLACK. "min" asks for the least peak itself and is
# never carried.
