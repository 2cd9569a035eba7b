"""Entry points of the DP planner: `optimal_plan` and `min_feasible_peak` (`finish_plan`, in
`hbp.planner.dp.finish`, is re-exported here).

`optimal_plan` picks the candidate cuts (`hbp.planner.cuts`), sizes the memory slots, runs
the least-recompute tables (`Solver`) and, where the slot rounding rejects a feasible budget,
the least-peak ones (`PeakSolver`); on large graphs it also plans in stages
(`hbp.planner.stages`) and keeps the better plan. Every plan it hands out is simulated
(`hbp.analysis.simulate`) and fits.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

from hbp.analysis.frontier import lower_bound
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import Simulation, simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph.ir import Graph
from hbp.planner.cuts import candidate_cuts, cut_choices
from hbp.planner.dp.cost_model import cost_model
from hbp.planner.dp.finish import finish_plan, kept_bytes
from hbp.planner.dp.held_sets import held_sets_bounded
from hbp.planner.dp.least_peak import (
    absorb_inputs,
    first_floor_above,
    floor_above,
    known_above,
    known_least_peak,
    least_known,
    least_peak_cached,
    least_peak_over,
    least_peak_value,
    reach_cuts,
    top_level,
    union_floor,
    union_pays,
)
from hbp.planner.dp.modes import INF
from hbp.planner.dp.recursion import planning
from hbp.planner.dp.slots import at_the_least_peak, exact_slots, plan_within, slot_size
from hbp.planner.dp.solver import PinCharge, Solver
from hbp.planner.dp.staged_search import staged_below, staged_candidate, staged_minimum
from hbp.planner.plan import Plan, Segment, any_pinned
from hbp.planner.stages import least_staged_budget, stage_tables_kept

__all__ = [
    "STAGED",
    "absorb_inputs",
    "finish_plan",
    "kept_bytes",
    "min_feasible_peak",
    "optimal_plan",
]


class _Solved(NamedTuple):
    """The whole-graph DP's result: top-level segments, the memory axis, how it was solved
    ("dp": the tables; "min-peak": the least-peak plan, where slot rounding rejected a
    feasible budget) and, for "dp", the tables' recompute FLOPs."""

    segments: list[Segment]
    slots: int
    slot_bytes: float
    how: str
    recompute: float | None = None


def _solve(
    info: GraphInfo,
    cuts: list[int],
    budget_bytes: int,
    mem_slots: int,
    nested: bool,
    pins: bool | None = None,
    pin_charge: PinCharge = PinCharge.PASS,
    nested_pins: bool | None = None,
    tables_only: bool = False,
) -> _Solved | None:
    """Run the DP over `cuts` (`pins`: whether recomputed segments may pin nodes; None: the
    default, `hbp.planner.dp.solver.PIN_VALUES`; `pin_charge`: how a pin is charged;
    `nested_pins`: whether children of nested levels pin too, None: the solver's default;
    `tables_only`: None where the tables find no plan, instead of the least-peak plan or a
    BudgetError, for a caller that only reads the tables' value)."""
    known = None if info.rng_state_bytes else known_least_peak(info, cuts, nested)
    if known is not None and known > budget_bytes:
        # NOTE [ Known least peaks skip the tables ]
        if tables_only:
            return None
        raise BudgetError(budget_bytes, known, _plans_over(info, cuts, nested))
    model = cost_model(info, cuts)
    with planning(len(cuts)):
        slots, slot_bytes = slot_size(info, budget_bytes, mem_slots)
        solver = Solver(
            model,
            slots,
            slot_bytes,
            nested,
            pins=pins,
            pin_charge=pin_charge,
            nested_pins=nested_pins,
        )
        recompute = float(solver.top(0, frozenset())[0, slots])
        if recompute < INF:
            return _Solved(solver.top_plan(slots), slots, slot_bytes, "dp", recompute)
        if tables_only:
            return None
        minimum = least_peak_value(info, cuts, nested)  # NOTE [ A plan at the floor ]
        if minimum > budget_bytes:
            raise BudgetError(budget_bytes, minimum, _plans_over(info, cuts, nested))
        # the slot rounding rejected a feasible budget: the least-peak plan fits
        _, segments = least_peak_cached(info, cuts, nested)
        return _Solved(segments, slots, slot_bytes, "min-peak")


@held_sets_bounded
@planning(64)
def optimal_plan(
    graph: Graph,
    budget_bytes: int,
    *,
    block_size: int = 1,
    max_cuts: int = 64,
    mem_slots: int = 256,
    nested: bool = True,
    info: GraphInfo | None = None,
    staged: str | None = None,
    naive: Simulation | None = None,
    pins: bool | None = None,
) -> Plan:
    """The plan with the least recompute FLOPs whose simulated peak fits `budget_bytes`.

    Exact over trees of intervals whose cuts are in `candidate_cuts(info, block_size,
    max_cuts)` (one level only if `nested=False`), up to memory discretisation into at most
    max(mem_slots, 1024) slots of the gcd of the graph's byte counts (exact when the budget
    spans at most that many) or `mem_slots` equal slots of the budget (conservative).

    On large graphs (`staged`: "auto", the default `STAGED`) the graph is also planned in
    stages (`hbp.planner.stages`: per-stage tables over fine cuts, one allocation across
    stages) and that plan is taken when it fits and recomputes less.

    `pins`: whether recomputed segments may pin nodes (NOTE [ Pin candidates ]);
    off for executors that cannot run pins (compiled segments, JAX). None: `PIN_VALUES`.

    Raises:
        BudgetError: no plan over the candidate cuts fits; `.minimum` is the smallest peak
            any such plan reaches (bytes).
    """
    t0 = time.perf_counter()
    info = info or GraphInfo.of(graph)
    with stage_tables_kept(info):  # NOTE [ Stage tables do not depend on the budget ]
        budget_bytes = int(budget_bytes)
        staged = STAGED if staged is None else staged
        if staged not in ("auto", "always", "never"):
            raise ConfigError("staged", staged, "'auto', 'always' or 'never'")
        naive = naive or simulate(graph, info=info)  # plain autograd's step (callers may have it)
        cuts = candidate_cuts(info, block_size, max_cuts)
        stages = block_size == 1 and staged != "never"
        stages = stages and (staged == "always" or _staged_pays(info, cuts))
        meta = {"planner": "optimal", "nested": nested, "block_size": block_size}
        if budget_bytes >= naive.peak_bytes:  # plain autograd fits: nothing to recompute
            meta.update(candidate_cuts=len(cuts) - 2, mem_slots=0, slot_bytes=0.0)
            meta["solved_by"] = "naive fits"
            plan = finish_plan(
                graph, [Segment(0, info.n)], budget_bytes, info=info, naive=naive, meta=meta
            )
            plan.meta["solve_time_s"] = time.perf_counter() - t0
            return plan

        def whole_graph(cuts: list[int]) -> tuple[Plan, str]:
            return _whole_graph_plan(
                graph,
                info,
                cuts,
                budget_bytes,
                naive,
                meta,
                mem_slots,
                nested,
                max_cuts,
                block_size,
                pins,
            )

        choices = cut_choices(info, block_size, max_cuts)
        below_bound = budget_bytes < lower_bound(info)
        if below_bound:  # NOTE [ Budgets below the lower bound ]: no table can fit it
            least_peak_over(info, choices, nested)
            if info.rng_state_bytes:  # the error the tables end in, without them
                minimum, _ = least_peak_cached(info, cuts, nested)
                err = BudgetError(budget_bytes, minimum, _plans_over(info, cuts, nested))
                return _below_whole_graph(
                    graph, info, meta, budget_bytes, err, naive, pins, t0, stages, block_size,
                    max_cuts, nested, below_bound=True, mem_slots=mem_slots,
                )  # fmt: skip

        def below_the_known_least() -> Plan | None:
            """Where a remembered least peak is above the budget, the plan below the whole
            graph, without the tables (NOTE [ Known least peaks skip the tables ])."""
            above = known_above(info, choices, nested, budget_bytes)
            if above is None and floor_above(info, choices, nested, budget_bytes):
                # NOTE [ A floor under the least peak ] in hbp.planner.dp.least_peak
                found = _staged_below_the_floor(
                    graph, info, meta, budget_bytes, naive, pins, t0, stages, nested, cuts,
                    choices, below_bound,
                )  # fmt: skip
                if found is not None:
                    return found
                least_peak_over(info, choices, nested)  # the floor could not decide
                above = known_above(info, choices, nested, budget_bytes)
            if above is None:
                return _below_the_first_sets_floor()
            err = BudgetError(budget_bytes, above, _plans_over(info, cuts, nested))
            return _below_whole_graph(
                graph, info, meta, budget_bytes, err, naive, pins, t0, stages, block_size, max_cuts,
                nested, below_bound=below_bound, mem_slots=mem_slots,
            )  # fmt: skip

        def _below_the_first_sets_floor() -> Plan | None:
            """The plan over the union without the first set's tables, where its floor is
            above a budget the union reaches (NOTE [ The first set's floor skips its tables ]
            in hbp.planner.dp.least_peak)."""
            floor = first_floor_above(info, choices, nested, budget_bytes)
            if floor is None:
                return None
            err = BudgetError(budget_bytes, floor, _plans_over(info, cuts, nested))
            plan = _below_whole_graph(
                graph, info, meta, budget_bytes, err, naive, pins, t0, stages, block_size, max_cuts,
                nested, below_bound=below_bound, mem_slots=mem_slots,
            )  # fmt: skip
            if plan.meta.pop("whole_graph_minimum", None) is not None:
                plan.meta["whole_graph_floor"] = floor  # a floor, not the set's least peak
            return plan

        if stages and not below_bound and not info.rng_state_bytes:
            # NOTE [ A budget below the stages' reach ]
            below_stages, _ = least_staged_budget(info, nested=False, pins=pins)
            if budget_bytes < below_stages and not floor_above(info, choices, nested, budget_bytes):
                least_peak_over(info, choices, nested)
        known = below_the_known_least()
        if known is not None:
            return known
        candidate = None
        if staged == "auto" and stages and max_cuts > STAGED_WHOLE_GRAPH_CUTS:
            # NOTE [ Fewer whole-graph cuts beside stages ]: the staged plan against the DP's
            # value over fewer cuts (its plan is not needed: not simulated)
            candidate = staged_candidate(graph, info, budget_bytes, pins)
            fewer = candidate_cuts(info, block_size, STAGED_WHOLE_GRAPH_CUTS)
            # NOTE [ No staged plan and a known least peak ]
            if candidate is not None or not least_known(info, choices, nested):
                # None: below what the fewer cuts reach, or where only their least-peak plan fits
                solved = _solve(
                    info, fewer, budget_bytes, mem_slots, nested, pins, tables_only=True
                )
                if solved is not None:
                    if candidate is not None and candidate[1].recompute_flops < (
                        solved.recompute * (1 - 1e-9)
                    ):
                        meta.update(
                            candidate_cuts=len(fewer) - 2,
                            mem_slots=solved.slots,
                            slot_bytes=solved.slot_bytes,
                            whole_graph_recompute=solved.recompute,
                        )
                        return _as_staged(graph, info, meta, budget_bytes, candidate, naive, t0)
                elif not info.rng_state_bytes:  # NOTE [ A budget below the fewer cuts' reach ]
                    least_peak_over(info, choices, nested)
                    known = below_the_known_least()
                    if known is not None:
                        return known
        try:
            plan, how = whole_graph(cuts)
        except BudgetError as err:
            return _below_whole_graph(
                graph, info, meta, budget_bytes, err, naive, pins, t0, stages, block_size, max_cuts,
                nested, mem_slots=mem_slots,
            )  # fmt: skip
        plan, how = at_the_least_peak(graph, info, cuts, plan, how, naive, mem_slots, nested, pins)
        if how == "dp" and stages:
            candidate = candidate or staged_candidate(graph, info, budget_bytes, pins)
            if _takes(candidate, plan, staged == "always"):
                meta = dict(plan.meta, whole_graph_recompute=plan.predicted_recompute_flops)
                return _as_staged(graph, info, meta, budget_bytes, candidate, naive, t0)
        plan.meta["solve_time_s"] = time.perf_counter() - t0
        return plan


# NOTE [ Budgets below the lower bound ]
# `hbp.analysis.frontier.lower_bound` is what the most demanding node's forward or backward
# event holds whatever is recomputed: no plan's simulated peak is below it, so neither the
# recompute tables (over the fewer cuts beside stages, then over all) nor a staged plan can
# fit a budget below it (they would end in INF and None). Such a budget goes straight to
# what a BudgetError needs: the least peaks (`_below_whole_graph`), the same error as after
# those tables. With generator states too: their copies only add to a plan's peak, so no
# plan fits below the bound either, and the error is the one the tables end in (the
# least-peak plan's simulated peak over the first cut set, then `_below_whole_graph`).


def _plans_over(info: GraphInfo, cuts: list[int], nested: bool) -> str:
    """A BudgetError's detail: the plan space searched."""
    kind = "nested" if nested else "one-level"
    return f"{kind} plans over {len(cuts) - 2} candidate cuts of {info.n} nodes"


def _below_whole_graph(
    graph, info, meta, budget: int, err, naive, pins, t0, stages, block_size, max_cuts, nested,
    below_bound: bool = False, mem_slots: int = 256,
) -> Plan:  # fmt: skip
    """The plan for a budget below the whole-graph DP's least peak over the first cut set
    (`err`): where the union of the other cut sets reaches it, the recompute tables' plan
    over that union (or its least-peak plan, where it recomputes less), else a staged plan,
    else `err` with the least minimum (`below_bound`: the budget is below `lower_bound`,
    where nothing fits)."""
    choices = cut_choices(info, block_size, max_cuts)
    others = len(choices) > 1
    if others and not info.rng_state_bytes and err.minimum <= lower_bound(info):
        others = False  # no cut set goes below the lower bound
    if others:  # NOTE [ Least peak over other cut choices ] in hbp.planner.cuts
        least, segments = least_peak_over(info, choices, nested)
        reach = reach_cuts(info, choices, nested)  # NOTE [ The union where it pays ]
        union = union_pays(info, choices)
        over = "union of cut choices" if union else "another cut choice"
        if least <= budget:  # NOTE [ A budget only other cuts reach ] in hbp.planner.cuts
            meta = dict(meta, solved_by="min-peak (other cuts)", whole_graph_minimum=err.minimum)
            plan = finish_plan(graph, segments, budget, info=info, naive=naive, meta=meta)
            slot = 0 if exact_slots(info, budget, mem_slots) else -(-budget // mem_slots)
            slacks = tuple(s * slot for s in BAND_SLACK) if slot else (0,)
            tables = plan_within(
                graph, info, reach, budget, slacks, naive, meta, mem_slots, nested, pins
            )
            if tables is not None and (
                tables.predicted_recompute_flops <= plan.predicted_recompute_flops
            ):
                least_rec = plan.predicted_recompute_flops  # the least-peak plan's
                meta = dict(tables.meta, solved_by=f"dp ({over})")
                plan = dataclasses.replace(tables, meta=dict(meta, least_peak_recompute=least_rec))
            candidate = staged_candidate(graph, info, budget, pins) if stages else None
            if _takes(candidate, plan, False):  # as above the band: the staged plan, if less
                meta = dict(plan.meta, whole_graph_recompute=plan.predicted_recompute_flops)
                return _as_staged(graph, info, meta, budget, candidate, naive, t0)
            plan.meta["solve_time_s"] = time.perf_counter() - t0
            return plan
        if least <= err.minimum:  # the least over every choice, however `err` was found
            where = "the union of" if union else "the best of"
            err = BudgetError(
                budget, least, f"{err.detail}, least over {where} {len(choices)} cut choices"
            )
    if not stages:
        raise err from None
    return _staged_below_whole_graph(
        graph, info, meta, budget, err, naive, pins, t0, fits=not below_bound
    )


def _whole_graph_plan(
    graph, info, cuts, budget_bytes, naive, meta, mem_slots, nested, max_cuts, block_size, pins
) -> tuple[Plan, str]:
    """The whole-graph DP's plan over `cuts`, and how the DP solved it ("dp": the tables;
    "min-peak": the least-peak plan, where slot rounding rejected a feasible budget)."""
    segments, slots, slot_bytes, how, value = _solve(
        info, cuts, budget_bytes, mem_slots, nested, pins
    )
    segments = top_level(info, segments)
    meta = dict(meta, candidate_cuts=len(cuts) - 2, mem_slots=slots, slot_bytes=slot_bytes)
    meta["solved_by"] = how
    plan = finish_plan(graph, segments, budget_bytes, info=info, naive=naive, meta=meta)
    if how == "dp" and any_pinned(segments):
        plan = _pins_checked(graph, info, plan, value, cuts, mem_slots, nested, naive, pins)
    if plan.predicted_peak_bytes > budget_bytes and info.rng_state_bytes and how == "dp":
        plan = _replanned(graph, info, plan, cuts, mem_slots, nested, naive, pins)
    if plan.predicted_peak_bytes > budget_bytes:  # a model mismatch: never hand it out
        peak, fallback = min_feasible_peak(
            graph, block_size=block_size, max_cuts=max_cuts, nested=nested, info=info
        )
        if peak > budget_bytes and info.rng_state_bytes:
            raise BudgetError(budget_bytes, peak, "counting the generator states checkpoints keep")
        if peak > budget_bytes:
            raise RuntimeError(
                f"planner: the DP's plan simulates to {plan.predicted_peak_bytes} bytes over "
                f"the budget of {budget_bytes} and no fallback fits; please report this graph"
            )
        plan = finish_plan(graph, fallback, budget_bytes, info=info, naive=naive, meta=plan.meta)
        plan.meta["solved_by"] = "min-peak (dp over budget)"
    return plan, how


def _pins_checked(graph, info, plan, value, cuts, mem_slots, nested, naive, pins) -> Plan:
    """`plan` (made with `PinCharge.PASS`, whose tables' value was `value`), or, where `plan`
    is over the budget or recomputes more than the tables said (a pin that the child's nested
    plan stops its pass before is held longer and saves nothing: NOTE [ Pin candidates ]),
    the best that fits of: `plan`, the plan with pins charged through the backward
    (`PinCharge.BACKWARD`) and the plan without pins in nested levels."""
    budget = plan.budget_bytes
    if plan.predicted_peak_bytes <= budget and (
        plan.predicted_recompute_flops <= value * (1 + 1e-9) + 1e-9
    ):
        return plan
    options = [plan]
    for charge, nested_pins, label in (
        (PinCharge.BACKWARD, None, "pins charged through the backward"),
        (PinCharge.PASS, False, "no pins in nested levels"),
    ):
        segments, _, _, how, _ = _solve(
            info, cuts, budget, mem_slots, nested, pins, charge, nested_pins
        )
        segments = top_level(info, segments)
        meta = dict(plan.meta, solved_by=f"{how} ({label})")
        options.append(finish_plan(graph, segments, budget, info=info, naive=naive, meta=meta))
    fitting = [p for p in options if p.predicted_peak_bytes <= budget]
    if not fitting:
        return options[1]  # the upper-bound charge: as without PinCharge.PASS
    return min(fitting, key=lambda p: p.predicted_recompute_flops)


def _replanned(graph, info, plan, cuts, mem_slots, nested, naive, pins) -> Plan:
    """The DP's plan for the budget less the excess of `plan` (twice at most): the DP does not
    see the generator states that segments nested in a recomputed one keep from the forward
    (NOTE [ Generator states of checkpoints ] in hbp.analysis.simulate). `plan` itself
    when no such plan fits."""
    budget = target = plan.budget_bytes
    for _ in range(2):
        target -= plan.predicted_peak_bytes - budget
        try:
            segments, _, _, how, _ = _solve(info, cuts, target, mem_slots, nested, pins)
        except BudgetError:
            break
        segments = top_level(info, segments)
        meta = dict(plan.meta, solved_by=f"{how} (below the budget: random states)")
        plan = finish_plan(graph, segments, budget, info=info, naive=naive, meta=meta)
        if plan.predicted_peak_bytes <= budget:
            break
    return plan


# NOTE [ A budget only other cuts reach ] in hbp.planner.cuts: where slots round, the union's
# tables are read down to the budget from this many slots above it, the second where the
# first finds no plan that fits (one solve: NOTE [ One solve for the band's slacks ] in
# hbp.planner.dp.slots)
BAND_SLACK = (1, 4)
# "auto": graphs from STAGED_MIN_NODES nodes on, where the candidate cuts thin out, are also
# planned in stages and the staged plan is taken when it recomputes less; "always": taken
# whenever it fits (tests); "never"
STAGED = "auto"
STAGED_MIN_NODES = 400
# NOTE [ Fewer whole-graph cuts beside stages ]
# Where staged planning runs, it plans every budget where recomputation stays within a stage
# over fine cuts; the whole-graph DP is needed for long-span recomputation (the smallest
# budgets), where a few dozen cuts over the whole graph are what matter. Its work grows like
# cuts^2.5, so beside stages it first runs over STAGED_WHOLE_GRAPH_CUTS cuts: when the staged
# plan recomputes less than that DP's value (its plan is not built nor simulated), the staged
# plan is taken; otherwise (or when the budget is below what those cuts reach) the DP runs
# over all `max_cuts` and its plan is compared with the staged one as always. The plans are
# those of the full DP beside stages unless the 32-cut DP loses to the staged plan while the
# full one would beat it (none of experiments/check_plans.py's plans).
STAGED_WHOLE_GRAPH_CUTS = 32
# NOTE [ A budget below the fewer cuts' reach ]
# Where the DP over the fewer cuts finds no plan, the budget is near or below the least peak,
# and the full tables (the costliest part of a plan call) often find none either. The least
# peak over the union of the cut choices is computed first (a BudgetError needs it anyway,
# and it is remembered): above the budget, no table over the first set can fit it (NOTE
# [ Known least peaks skip the tables ]), and the budget goes where the tables' BudgetError
# would have sent it, `_below_whole_graph`.


# NOTE [ A budget below the stages' reach ]
# The stages' least budget by the cost model (NOTE [ The least staged budget ] in
# hbp.planner.stages) takes only the stage tables, which a plan beside stages builds anyway.
# A budget below it has no staged plan, so it fits only where the whole graph's least peak
# is at most the budget: that least peak (remembered; a BudgetError needs it) is taken first,
# and where it is above the budget the tables over the fewer cuts and over all cuts (which
# would end in INF) are not run; the budget goes to `_below_whole_graph` as after them. Where
# it is at most the budget, planning goes on as before, the least peak known.


# NOTE [ No staged plan and a known least peak ]
# The DP over the fewer cuts decides two things: whether the staged plan recomputes less than
# it (no staged plan: nothing to decide), and, where it finds no plan, whether the least peak
# is above the budget (known already: `below_the_known_least` has just said it is not). So
# where no staged plan fits and the least peak is remembered ("min", "N%act"), either way the
# next step is the DP over all cuts, and the fewer cuts' tables are not run.


def _staged_below_the_floor(
    graph, info, meta, budget: int, naive, pins, t0, stages, nested, cuts, choices, below_bound
) -> Plan | None:
    """For a budget below the floor of the whole graph's least peak (no whole-graph plan fits
    it): the staged plan within it, or the BudgetError whose minimum is the stages' least
    budget where that is below the floor (the least of all); None where only the whole
    graph's least peak can decide (what `_below_whole_graph` then gives is the same)."""
    if not stages:
        return None
    floor = union_floor(info, choices, nested)
    candidate = None if below_bound else staged_candidate(graph, info, budget, pins)
    if candidate is not None:
        meta = dict(meta, whole_graph_floor=floor)
        return _as_staged(graph, info, meta, budget, candidate, naive, t0)
    found = staged_below(graph, info, pins, floor, budget)
    if found is None:
        return None
    raise BudgetError(budget, found[0], f"{_plans_over(info, cuts, nested)}; less in stages")


def _staged_pays(info: GraphInfo, cuts: list[int]) -> bool:
    return info.n >= STAGED_MIN_NODES and len(cuts) - 2 < info.n // 4


def _staged_below_whole_graph(
    graph, info, meta, budget: int, err, naive, pins, t0, fits: bool = True
) -> Plan:
    """The staged plan within `budget`, below the whole-graph DP's least peak (`err`): the
    stages' fine cuts can reach less than the whole graph's candidate cuts (a ControlNet
    beside a frozen UNet: 3.19 MiB staged, 3.40 whole-graph). None fits: `err`, its minimum
    lowered to the least budget a staged plan is found for where that is less. `fits=False`:
    the budget is known to be below every plan's peak (NOTE [ Budgets below the lower
    bound ])."""
    candidate = staged_candidate(graph, info, budget, pins) if fits else None
    if candidate is not None:
        meta = dict(meta, whole_graph_minimum=err.minimum)
        return _as_staged(graph, info, meta, budget, candidate, naive, t0)
    found = staged_minimum(graph, info, pins, err.minimum, budget)
    if found is None:
        raise err
    detail = f"{err.detail}; less in stages" if err.detail else "in stages"
    raise BudgetError(budget, found[0], detail) from err


def _takes(candidate, plan: Plan, always: bool) -> bool:
    """Whether the staged `candidate` replaces `plan`: it fits and recomputes less (or, with
    `always`, it fits)."""
    if candidate is None:
        return False
    return always or candidate[1].recompute_flops < plan.predicted_recompute_flops


def _as_staged(graph, info, meta: dict, budget: int, candidate, naive, t0: float) -> Plan:
    """`candidate` (`_staged_candidate`) as the Plan handed out."""
    segments, sim = candidate
    meta = dict(meta, solved_by="staged")
    plan = finish_plan(graph, segments, budget, info=info, naive=naive, meta=meta, sim=sim)
    plan.meta["solve_time_s"] = time.perf_counter() - t0
    return plan


@held_sets_bounded
@planning(64)
def min_feasible_peak(
    graph: Graph,
    *,
    block_size: int = 1,
    max_cuts: int = 64,
    nested: bool = True,
    info: GraphInfo | None = None,
    staged: str | None = None,
    pins: bool | None = None,
    value_only: bool = False,
) -> tuple[int, list[Segment] | None]:
    """The least budget `optimal_plan` (same arguments) finds a plan for, and that plan's
    top-level segments: the smallest simulated peak over the whole-graph DP's cut sets
    (`cut_choices`: NOTE [ Least peak over other cut choices ] in hbp.planner.cuts) or, where
    `optimal_plan` also plans in stages and they reach less, the least budget a staged plan
    is found for (its plan simulates at or below it). `value_only`: the segments may be None
    (the whole graph's least peak without its plan: NOTE [ A plan at the floor ] in
    hbp.planner.dp.least_peak)."""
    info = info or GraphInfo.of(graph)
    with stage_tables_kept(info):
        choices = cut_choices(info, block_size, max_cuts)
        staged = STAGED if staged is None else staged
        cuts = candidate_cuts(info, block_size, max_cuts)
        stages = block_size == 1 and (
            staged == "always" or staged == "auto" and _staged_pays(info, cuts)
        )
        if stages and not info.rng_state_bytes:
            # NOTE [ A floor under the least peak ] in hbp.planner.dp.least_peak: the stages
            # below the whole graph's floor reach less than it, without its least peak
            found = staged_below(graph, info, pins, union_floor(info, choices, nested))
            if found is not None:
                return found[0], found[1][0]
        best = least_peak_over(info, choices, nested, value_only)
        if stages:
            found = staged_minimum(graph, info, pins, best[0])
            if found is not None:
                best = (found[0], found[1][0])
    return best
