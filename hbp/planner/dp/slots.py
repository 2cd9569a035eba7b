"""The tables' memory axis: how a budget is cut into slots, and plans read from one solve at
the slot counts at and below a budget's (NOTE [ One solve read at lower slot counts ])."""

from __future__ import annotations

import dataclasses
import math
from functools import reduce

from hbp.analysis.liveness import GraphInfo
from hbp.planner.dp.cost_model import cost_model
from hbp.planner.dp.finish import finish_plan
from hbp.planner.dp.least_peak import known_least_peak, top_level
from hbp.planner.dp.modes import INF
from hbp.planner.dp.recursion import planning
from hbp.planner.dp.solver import PinCharge, Solver
from hbp.planner.plan import Plan

__all__ = ["at_the_least_peak", "byte_gcd", "exact_slots", "plan_within", "slot_size"]

# NOTE [ One solve read at lower slot counts ]
# The tables hold the least recompute at every slot count up to the budget's, so one solve
# answers every lower budget on the same axis: its plan at k slots is rebuilt without filling
# a table again. Where a plan the tables chose simulates above the budget (slot rounding
# where the tables run a slot above it, pins charged until their pass, generator states the
# tables do not see), the plans at the slot counts below are read in turn, and the first that
# simulates within the budget is taken. Solving again at each lower budget instead cost a
# full solve per try (with the pin and generator-state checks of a plan over its budget, four
# or five solves of ~3.5 s on a T5's union of 61 cuts). The same reading serves "min" over
# the first cut set where the tables at the least peak find no plan (rounded slots) and the
# least-peak plan would run: solved a slot above and read down, they find one that fits (a
# BART of tests/test_min_is_measured.py: 11.0 instead of 24.6 MFLOP at the same peak). Where
# the tables at the least peak do find a plan, they are not run again: a slot above and read
# down, they found less recompute on 2 of check_plans' 19 "min" plans (2-6%) for ~30% more
# planning time over all 76.
LOWER_READS = 12


def byte_gcd(info: GraphInfo) -> int:
    arrays = (info.storage_bytes, info.extra_bytes, info.grad_bytes, info.param_grad_bytes)
    return reduce(math.gcd, (int(x) for arr in arrays for x in arr if x), 0) or 1


def exact_slots(info: GraphInfo, budget: int, mem_slots: int) -> bool:
    """Whether `budget` spans few enough slots of the gcd of the graph's byte counts for the
    tables to use them (`slot_size`): no need is then rounded."""
    return _exact(budget, byte_gcd(info), mem_slots)


def _exact(budget: int, gcd: int, mem_slots: int) -> bool:
    return budget // gcd <= max(mem_slots, 1024)


def slot_size(info: GraphInfo, budget: int, mem_slots: int) -> tuple[int, float]:
    """The tables' slots for `budget`, and the bytes of one."""
    g = byte_gcd(info)
    if _exact(budget, g, mem_slots):
        return int(budget // g), float(g)
    return mem_slots, budget / mem_slots


def plan_within(
    graph, info: GraphInfo, cuts: list[int], budget: int, slacks: tuple[int, ...], naive,
    meta: dict, mem_slots: int, nested: bool, pins: bool | None,
) -> Plan | None:  # fmt: skip
    """The recompute tables over `cuts` solved once, on the slots of `budget + slacks[0]`
    and as many more as the largest slack needs: for each slack in turn, the plan at the most
    slots within `budget + slack` that simulates within `budget`, read down from there (NOTE
    [ One solve read at lower slot counts ], NOTE [ One solve for the band's slacks ]), or
    None where none of those fits."""
    model = cost_model(info, cuts)
    with planning(len(cuts)):
        slots, slot_bytes = slot_size(info, budget + slacks[0], mem_slots)
        tops = [slots] + [int((budget + s) // slot_bytes) for s in slacks[1:]]
        solver = Solver(model, max(tops), slot_bytes, nested, pins=pins, pin_charge=PinCharge.PASS)
        values = solver.top(0, frozenset())[0]
        meta = dict(meta, candidate_cuts=len(cuts) - 2, slot_bytes=slot_bytes)
        read = set()
        for top in tops:
            for k in range(top, max(top - LOWER_READS, -1), -1):
                if values[k] >= INF:
                    break  # the tables are non-increasing in slots: none fits below
                if k in read:
                    continue
                read.add(k)
                segments = top_level(info, solver.top_plan(k))
                plan = finish_plan(
                    graph, segments, budget, info=info, naive=naive, meta=dict(meta, mem_slots=top)
                )
                if plan.predicted_peak_bytes <= budget:
                    plan.meta.update(solved_by="dp", read_at_slots=k)
                    return plan
    return None


# NOTE [ One solve for the band's slacks ]
# Where the tables at a slot above the budget find no plan that fits, they were solved again
# a few slots above (`BAND_SLACK` in hbp.planner.dp.entry), a second full solve; on a U-Net
# and a T5 both found none, and each cost seconds. The tables hold every slot count up to
# their top (NOTE [ One solve read at lower slot counts ]), and their values at m slots do not
# depend on how many slots there are above m, so one solve on the first slack's slot size,
# with the slots the largest slack adds, answers every slack: each is read down from its own
# top, a slot count read once. The first slack's plans are those of a solve of its own; a
# later slack's are on the first's slot size (within a slot of its own solve's).


def at_the_least_peak(graph, info, cuts, plan, how, naive, mem_slots, nested, pins):
    """`plan` (and how it was solved), or where the tables found no plan at the budget (it is
    within a slot of the least peak over `cuts`: `how` "min-peak", the least-peak plan) and
    slots round, the tables' plan a slot above it read down to the budget, where that
    recomputes less (NOTE [ One solve read at lower slot counts ])."""
    budget = plan.budget_bytes
    least = known_least_peak(info, cuts, nested)
    slot = -(-budget // mem_slots)
    if how != "min-peak" or least is None or budget > least + slot:
        return plan, how
    if exact_slots(info, budget, mem_slots):  # no rounding: the tables' answer was exact
        return plan, how
    read = plan_within(
        graph, info, cuts, budget, (slot,), naive, plan.meta, mem_slots, nested, pins
    )
    if read is None or read.predicted_recompute_flops >= plan.predicted_recompute_flops:
        return plan, how
    return dataclasses.replace(read, meta=dict(read.meta, solved_by="dp (a slot above)")), "dp"
