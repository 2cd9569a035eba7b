"""hbp.planner: plans that fit a memory budget with the least recompute (pure Python).

`plan(graph, budget)` is the entry point every integration uses. The planners:
- "optimal" (`optimal_plan`): exact DP over trees of intervals (nested recomputation),
- "one_level": the same DP restricted to one level of recomputed segments,
- "uniform" (`uniform_plan`): sqrt(n) equal segments, the classic baseline.
"""

from __future__ import annotations

import math
import traceback

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph.ir import Graph
from hbp.planner.budget import Budget, BudgetKind, least_fraction, parse_budget
from hbp.planner.cache import PlanCache, graph_fingerprint, load_plan, save_plan
from hbp.planner.dp import candidate_cuts, min_feasible_peak, optimal_plan
from hbp.planner.dp.recursion import planning
from hbp.planner.plan import Plan, Segment
from hbp.planner.schedules import schedule_plan
from hbp.planner.stages import stage_tables_kept
from hbp.planner.tree import validate_plan
from hbp.planner.uniform import uniform_plan
from hbp.units import MIB

PLANNERS = ("optimal", "one_level", "uniform")

__all__ = [
    "PLANNERS",
    "Plan",
    "PlanCache",
    "Segment",
    "candidate_cuts",
    "graph_fingerprint",
    "least_peak",
    "load_plan",
    "min_feasible_peak",
    "optimal_plan",
    "parse_budget",
    "plan",
    "save_plan",
    "uniform_plan",
    "validate_plan",
]


@planning(64)
def plan(
    graph: Graph,
    budget,
    *,
    block_size: int = 1,
    planner: str = "optimal",
    pins: bool | None = None,
    schedules: bool | None = None,
    cache=None,
    **options,
) -> Plan:
    """Plan one training step of `graph` within `budget`.

    Args:
        budget: float in (0, 1] = fraction of the simulated naive peak; int = bytes; str like
            "64MiB" (see `parse_budget`); "min" = the smallest peak the planner can reach
            (the least memory, whatever the recompute); "N%act" or a `Budget` of that kind =
            the least peak + N% of what checkpointing can save (`hbp.planner.budget`),
            resolved in this call (NOTE [ Relative budgets resolved where they are planned ]).
        block_size: leaf granularity: at most one cut per `block_size` consecutive nodes,
            at the cheapest position (see `candidate_cuts`).
        planner: "optimal", "one_level" or "uniform".
        pins: whether recomputed segments may keep nodes from the forward (optimal planners;
            None: `hbp.planner.dp.solver.PIN_VALUES`, on). Off for executors that cannot run
            them (compiled segments, JAX).
        schedules: whether a small graph may get an explicit schedule, when it recomputes
            less than the best plan of segments (NOTE [ Explicit schedules ] in
            `hbp.planner.schedules`; "optimal" planner only). None: as `pins` (both need the
            eager op-by-op executor).
        cache: a `hbp.planner.cache.PlanCache` (or its directory): the plan (or the
            BudgetError) for this graph's structure, budget and options is read from it when
            there, else planned and stored.
        options: passed to the planner (optimal: max_cuts, mem_slots; uniform: segments, by).

    Raises:
        ConfigError: bad budget, block_size or planner name.
        BudgetError: no plan fits (optimal planners), with the minimum in bytes.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "an int >= 1")
    if planner not in PLANNERS:
        raise ConfigError("planner", planner, " or ".join(repr(p) for p in PLANNERS))
    if cache is not None:
        return _cached_plan(
            graph,
            budget,
            cache,
            dict(options, block_size=block_size, planner=planner, pins=pins, schedules=schedules),
        )
    info = GraphInfo.of(graph)
    with stage_tables_kept(info):  # "min" and the plan share them
        result = _plan(graph, info, budget, block_size, planner, pins, schedules, options)
    if "framework" in graph.meta:  # what counted its FLOPs (the plan's text says)
        result.meta.setdefault("framework", graph.meta["framework"])
    return result


def _plan(graph, info, budget, block_size, planner, pins, schedules, options: dict) -> Plan:
    naive = simulate(graph, info=info)
    if _is_relative(budget):  # NOTE [ Relative budgets resolved where they are planned ]
        nested = planner != "one_level"

        def least() -> int:
            return min_feasible_peak(
                graph, block_size=block_size, nested=nested, info=info, value_only=True
            )[0]

        budget = Budget.parse(budget).resolve(naive.peak_bytes, least)
    if budget == "min":
        within = {k: options[k] for k in ("max_cuts", "staged") if k in options}
        if planner == "uniform":  # the whole-graph DP's least peak, as a reference
            within["staged"] = "never"
        budget_bytes, _ = min_feasible_peak(
            graph,
            block_size=block_size,
            nested=planner != "one_level",
            info=info,
            pins=pins,
            **within,
        )
    else:
        budget_bytes = parse_budget(budget, naive.peak_bytes)
    if planner == "uniform":
        segments = options.pop("segments", None) or max(1, round(math.sqrt(info.n)))
        return uniform_plan(graph, segments, budget_bytes=budget_bytes, info=info, **options)
    schedules = (pins is not False if schedules is None else schedules) and planner == "optimal"
    try:
        best = optimal_plan(
            graph,
            budget_bytes,
            block_size=block_size,
            nested=planner == "optimal",
            info=info,
            naive=naive,
            pins=pins,
            **options,
        )
    except BudgetError as err:
        # NOTE [ A BudgetError holds no frame's locals ]
        traceback.clear_frames(err.__traceback__)
        scheduled = schedules and schedule_plan(graph, budget_bytes, None, info=info, naive=naive)
        if scheduled:
            return scheduled
        err = _with_workspace(graph, _with_parameter_gradients(graph, err))
        raise _as_fraction(err, budget, naive.peak_bytes) from None
    if schedules:
        return schedule_plan(graph, budget_bytes, best, info=info, naive=naive) or best
    return best


def _is_relative(budget) -> bool:
    """Whether `budget` is an "N%act" form (a `Budget` of that kind or its string)."""
    if isinstance(budget, Budget):
        return budget.kind is BudgetKind.ACTIVATIONS
    return (
        isinstance(budget, str)
        and "%" in budget
        and Budget.parse(budget).kind is (BudgetKind.ACTIVATIONS)
    )


# NOTE [ Relative budgets resolved where they are planned ]
# An "N%act" budget is the least peak plus a share of what checkpointing saves above it, so
# resolving it runs what "min" runs: the least-peak DP and the stages' least budget, whose
# stage tables (NOTE [ Stage tables do not depend on the budget ] in hbp.planner.stages) the
# plan at the resolved bytes needs again. Resolved by the caller, then planned, the tables
# were built twice (once per call's `stage_tables_kept`); resolved inside `plan`, one
# GraphInfo and one scope serve both. The least peak is the one `least_peak` gives (no
# `pins` argument), as before.


def least_peak(graph: Graph, *, block_size: int = 1, planner: str = "optimal") -> int:
    """The least peak, in bytes, a plan of `graph` by `planner` reaches: what `plan(graph,
    "min", ...)` plans for and a BudgetError's `.minimum`."""
    return min_feasible_peak(
        graph, block_size=block_size, nested=planner != "one_level", value_only=True
    )[0]


def _cached_plan(graph: Graph, budget, cache, options: dict) -> Plan:
    """`plan(graph, budget, **options)` read from `cache` (a PlanCache or a directory), or
    planned and stored there (a BudgetError too)."""
    if not isinstance(cache, PlanCache):
        cache = PlanCache(cache)
    found = cache.get(graph, budget, options)
    if found is not None:
        found.meta["from_cache"] = True
        return found
    try:
        made = plan(graph, budget, **options)
    except BudgetError as err:
        cache.put(graph, budget, err, options)
        raise
    cache.put(graph, budget, made, options)
    return made


def _with_parameter_gradients(graph: Graph, err: BudgetError) -> BudgetError:
    """`err`, saying how much of its minimum is parameter gradients where they are half of it
    or more: no plan frees them within the step (they live from their node's backward to the
    optimizer), so recompute cannot go below them and the user needs another tool."""
    grads = sum(node.param_grad_bytes for node in graph.nodes)
    if grads * 2 < err.minimum:
        return err
    return err.with_detail(
        f"{grads / MIB:.2f} MiB of it are parameter gradients, which no checkpointing frees "
        "(they live until the optimizer step): below that, shard or offload them (FSDP), or "
        "freeze parameters"
    )


def _as_fraction(err: BudgetError, budget, naive_bytes: int) -> BudgetError:
    """`err`, with its minimum as a fraction of the plain step's peak where the budget was
    given as one."""
    given = budget if isinstance(budget, Budget) else Budget.parse(budget)
    if given.kind is not BudgetKind.FRACTION or naive_bytes <= 0:
        return err
    return err.with_detail(least_fraction(err.minimum, naive_bytes))


def _with_workspace(graph: Graph, err: BudgetError) -> BudgetError:
    """`err`, naming the op whose kernel workspace is half of its minimum or more (a CPU
    depthwise convolution's backward): the op holds it while it runs, whatever is recomputed
    around it, so recompute cannot go below it."""
    node = max(graph.nodes, key=lambda n: max(n.forward_scratch_bytes, n.backward_scratch_bytes))
    scratch = max(node.forward_scratch_bytes, node.backward_scratch_bytes)
    if scratch * 2 < err.minimum:
        return err
    where = "backward" if node.backward_scratch_bytes >= node.forward_scratch_bytes else "forward"
    return err.with_detail(
        f"{scratch / MIB:.2f} MiB of it is the workspace of {node.module or node.name} "
        f"({node.op})'s {where} kernel, held while it runs whatever is recomputed: a smaller "
        "input or another kernel lowers it"
    )


# NOTE [ A BudgetError holds no frame's locals ]
# The DP hands a BudgetError down through helpers that take it as an argument and raise it
# again, so the frames it passes through hold it in their locals while its traceback holds
# those frames: a reference cycle, freed only by the garbage collector. Through each frame's
# caller it also held the caller's frames, up to the step that planned again: HCModule's
# `_run`, whose locals hold the module's output. A re-plan that raised (the closed loop's,
# where no plan fits the lowered target) thus kept the step's outputs (a transformers
# model's logits and key/value cache) alive after the caller let them go, until a collection:
# the measured peak rose by their size and HCModule took them for outputs the caller keeps.
# The locals of the frames the error was raised through are cleared where the planner
# catches it (the frames still running, the planner's own and its callers', are not).
