"""The stages' side of a plan call: the staged plan within a budget, checked by the simulator
(`staged_candidate`), and the least budget a staged plan is found for (`staged_minimum`,
`staged_below`), from the cost model's least staged budget (NOTE [ The least staged budget ]
in hbp.planner.stages) refined by bisection."""

from __future__ import annotations

from hbp.analysis.plan_call import kept_for_plan_call
from hbp.analysis.simulate import simulate
from hbp.planner.cuts import current_coarse_cuts
from hbp.planner.dp import solver as solver_module
from hbp.planner.dp.least_peak import top_level
from hbp.planner.stages import least_staged_budget, staged_plan

__all__ = [
    "STAGED_MINIMUM_STEPS",
    "STAGED_REFINE_STEPS",
    "lowered",
    "staged_below",
    "staged_candidate",
    "staged_minimum",
]


def staged_candidate(graph, info, budget: int, pins: bool | None = None):
    """The staged plan (`hbp.planner.stages`) within `budget`: (segments, their simulation),
    or None. Its stage-boundary accounting is approximate: an overshoot is taken off the
    budget and the stages planned again (twice at most). Kept per budget while the stage
    tables are (NOTE [ A staged candidate found once per plan call ])."""
    pins = solver_module.PIN_VALUES if pins is None else pins
    key = ("staged candidate", budget, pins, current_coarse_cuts())
    return kept_for_plan_call(info, key, lambda: _staged_candidate(graph, info, budget, pins))


# NOTE [ A staged candidate found once per plan call ]
# "min" finds the least budget a staged plan is found for by trying budgets
# (`staged_below`, `lowered`), each a staged solve and a simulation of the whole graph; the
# plan at the budget found then asked for the same candidate again. Within one plan call a
# candidate is a function of the budget and the pins alone, so it is kept by them (NOTE
# [ Facts kept for one plan call ] in hbp.analysis.plan_call): the plan at "min" simulates
# the whole graph once less.


def _staged_candidate(graph, info, budget: int, pins: bool | None):
    target = budget
    for _ in range(3):
        segments = staged_plan(info, target, nested=False, pins=pins)
        if segments is None:
            return None
        segments = top_level(info, segments)
        sim = simulate(graph, segments, info=info)
        if sim.peak_bytes <= budget:
            return segments, sim
        target -= sim.peak_bytes - budget
    return None


#: Bisection steps for the least staged budget, where the one from the cost model
#: (`least_staged_budget`) simulates above itself (each step one staged solve).
STAGED_MINIMUM_STEPS = 6
#: Bisection steps within the allocation's rounding below the least staged budget found.
STAGED_REFINE_STEPS = 2


def staged_minimum(graph, info, pins, above: int, low: int = 0):
    """(the least budget a staged plan is found for, that candidate) where it is below
    `above`, else None; `low`: a budget none is found for. The cost model's least staged
    budget first (NOTE [ The least staged budget ] in hbp.planner.stages); where its plan simulates above it, a
    bisection between `low` and `above` (staged plans are not monotone in the budget: the
    budget reported is one a staged plan was found for, so planning for it succeeds)."""
    found = staged_below(graph, info, pins, above, low)
    if found is not None:
        return found
    least = max(least_staged_budget(info, nested=False, pins=pins)[1], low + 1)
    if least < above:  # no staged plan at the cost model's least budget
        low = least
    at_above = staged_candidate(graph, info, above, pins)
    if at_above is None or at_above[1].peak_bytes >= above:
        return None
    best = lowered(graph, info, pins, (above, at_above), low, STAGED_MINIMUM_STEPS)
    return best if best[0] < above else None


def staged_below(graph, info, pins, above: int, low: int = 0):
    """`staged_minimum`'s first step: (the least budget a staged plan is found for, that
    candidate) where a staged plan is found at the cost model's least staged budget or, where
    that is not below `above`, just below `above` (NOTE [ Just below the bound ]), refined
    within the allocation's rounding; else None. `staged_minimum` with the same `above` gives
    the same wherever this gives one (NOTE [ A floor under the least peak ] in
    hbp.planner.dp.least_peak)."""
    below, least = least_staged_budget(info, nested=False, pins=pins)
    start = min(max(least, low + 1), above - 1)
    if start <= max(low, below - 1):
        return None
    candidate = staged_candidate(graph, info, start, pins)
    if candidate is None:
        return None
    return lowered(graph, info, pins, (start, candidate), max(low, below - 1), STAGED_REFINE_STEPS)


# NOTE [ Just below the bound ]
# The cost model's least staged budget is one at which the stages surely allocate; the least
# one they may allocate at (`below`) is up to a slot per stage lower (NOTE [ The least staged
# budget ] in hbp.planner.stages). Where the bound `above` (the whole graph's floor) falls
# between the two, a staged plan found just below the bound already reaches less than any
# whole-graph plan, so the whole graph's least-peak DP, the larger part of the least budget's
# time on deep graphs, is not needed; the bisection then runs between `below` and it. A
# 32-layer Llama planned with pinned values (HCModule's plans) is such a graph.


def lowered(graph, info, pins, best: tuple, low: int, steps: int) -> tuple:
    """`best` = (a budget a staged plan is found for, that candidate), lowered by `steps`
    bisection steps towards `low`, a budget none is found for."""
    for _ in range(steps):
        middle = (low + best[0]) // 2
        candidate = staged_candidate(graph, info, middle, pins)
        if candidate is None:
            low = middle
        else:
            best = (middle, candidate)
    return best
