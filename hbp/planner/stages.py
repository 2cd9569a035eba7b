"""Staged planning: the same quality at any depth (large graphs).

The exact DP (`hbp.planner.dp`) keeps planning at seconds by limiting the candidate cuts to
a few dozen over the whole graph, and its memory axis to a few hundred slots of the budget.
On a deep stack both coarsen with depth: a 192-layer net gets a third of a cut per layer
and a slot larger than a layer's activations. Staged planning keeps both per stage:

1. Stages. The topological order is split at *stage bounds*: cuts where the fewest storage
   groups cross (between the layers of a stack, the residual stream alone), about
   `stage_nodes` nodes apart (`stage_bounds`).
2. One table per stage. Within a stage, the top-level DP of `hbp.planner.dp` runs over
   evenly spread fine cuts (`window_cuts`) with the stage's own memory axis: slots of the
   stage's own bytes, counted above the smallest positional memory (gradients, parameter
   gradients) of its backward. Its table gives, for every memory level m, the least
   recompute of the stage and, among the plans that reach it, the least bytes kept across
   the stage's forward. Every level where (recompute, kept) changes is an *option*
   (need bytes, kept bytes, recompute FLOPs); dominated options are dropped.
3. Across stages. Choosing one option per stage is the top-level recursion of the DP with
   stages as children: F(s, m) = min over options o of stage s with need(o) <= m of
   cost(o) + F(s + 1, m - kept(o)), over a fine global axis (`global_slots` slots of the
   budget, rounded up: conservative). This is the per-layer budget allocation of
   torchtitan's memory-budget ILP and of HiRemate's hierarchy, solved exactly by a DP.

The plan space is the DP's with no segment crossing a stage bound (a recomputed segment
spans at most one stage: long-span recomputation, as at the smallest budgets, stays with the
whole-graph DP, which `optimal_plan` also runs). The stage boundary state is approximated
(nothing held across a bound; a value both held by a stage and read by the next is counted
twice, which only over-estimates), so the result is simulated and the budget tightened by
any overshoot before it is handed out.
"""

from __future__ import annotations

import contextlib
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.planner.cuts import _frontier, current_coarse_cuts, window_cuts
from hbp.planner.dp import solver as solver_module
from hbp.planner.dp.cost_model import CostModel, cost_models_shared
from hbp.planner.dp.modes import INF
from hbp.planner.dp.recursion import planning
from hbp.planner.dp.solver import Solver
from hbp.planner.plan import Segment


@dataclass
class StageOption:
    """One plan of a stage: its memory needs, what it keeps, what it recomputes."""

    need_bytes: float  # memory it needs above what the stages before it keep
    kept_bytes: float  # bytes it holds from its forward until its backward
    cost: float  # recompute FLOPs
    local_slots: int  # where to rebuild it in the stage's table
    row: int  # with which end requirement


def stage_bounds(info: GraphInfo, cuts: list[int], stage_nodes: int) -> list[int]:
    """Stage bounds among `cuts`: every next bound at least `stage_nodes / 2` and at most
    `2 * stage_nodes` positions after the previous, at the cut with the fewest crossing
    storage groups (then fewest bytes, then nearest to `stage_nodes`); where no cut is that
    near, the first cut after (NOTE [ A stage past a span without cuts ])."""
    w, count = _frontier(info)
    n = info.n
    bounds = [0]
    inner = [c for c in cuts if 0 < c < n]
    k = 0
    while True:
        last = bounds[-1]
        lo, hi = last + max(1, stage_nodes // 2), last + 2 * stage_nodes
        if n - last <= 2 * stage_nodes:
            break
        window = [c for c in inner[k:] if lo <= c <= hi]
        if not window:  # NOTE [ A stage past a span without cuts ]
            after = next((c for c in inner[k:] if c > hi), None)
            if after is None:
                break
            window = [after]
        best = min(window, key=lambda c: (count[c], w[c], abs(c - last - stage_nodes)))
        bounds.append(best)
        k = inner.index(best) + 1
    return [*bounds, n]


# NOTE [ A stage past a span without cuts ]
# A span where no cut may fall (the in-place writes into a buffer that BigBird-Pegasus'
# block-sparse attention fills: NOTE [ A write into a view reaches backward through its base ]
# in hbp.analysis.liveness) left the window after a bound empty, and the bounds stopped there:
# everything after it was one stage, 531 nodes and 87 cuts of BigBird's decoder, whose table
# took 27 s of a 35 s first step. The stage now ends at the first cut after the span, and the
# bounds go on from it.


def staged_plan(
    info: GraphInfo,
    budget_bytes: int,
    *,
    stage_nodes: int = 40,
    per_region: int = 6,
    region: int = 32,
    stage_slots: int = 128,
    global_slots: int = 8192,
    nested: bool = True,
    levels: int = 4,
    reuse: bool = True,
    pins: bool | None = None,
) -> list[Segment] | None:
    """Top-level segments of a staged plan within `budget_bytes` (by the cost model), or
    None when no combination of stage options fits. `reuse`: solve identical stages once
    (NOTE [ Identical stages are solved once ]; off: every stage solved, for tests); `pins`:
    whether recomputed segments may pin nodes (None: `PIN_VALUES`)."""
    settings = _settings(stage_nodes, per_region, region, stage_slots, nested, levels, reuse, pins)
    cuts, stages, reps, options = _tables(info, settings)
    choice = _allocate(options, budget_bytes, global_slots)
    if choice is None:
        return None
    segments: list[Segment] = []
    # (stage solved, option) -> its plan: a function of the tables alone, kept with them
    rebuilt: dict[tuple, list[Segment]] = info.__dict__.setdefault("_stage_plans", {})
    rebuilt = rebuilt.setdefault((settings, current_coarse_cuts()), {})
    with planning(len(cuts)):
        for (a, _), (first, solver), opts, k in zip(stages, reps, options, choice):
            plan = rebuilt.get((first, k))
            if plan is None:
                o = opts[k]
                plan = rebuilt[first, k] = solver.top_plan(o.local_slots, start=first, row=o.row)
            segments.extend(_shifted(s, a - first) for s in plan)
    return segments


#: `least_staged_budget` where a stage has no option (its table is infinite within its slots):
#: above every budget, so no caller looks for a staged plan.
NO_STAGED_PLAN = 2**62


def least_staged_budget(
    info: GraphInfo,
    *,
    stage_nodes: int = 40,
    per_region: int = 6,
    region: int = 32,
    stage_slots: int = 128,
    global_slots: int = 8192,
    nested: bool = True,
    levels: int = 4,
    reuse: bool = True,
    pins: bool | None = None,
) -> tuple[int, int]:
    """(a budget below which, and one at which, `staged_plan` (same settings) surely finds
    no / a combination of stage options by the cost model (NOTE [ The least staged
    budget ]))."""
    settings = _settings(stage_nodes, per_region, region, stage_slots, nested, levels, reuse, pins)
    options = _tables(info, settings)[3]
    if not all(options):  # a stage with no plan within its memory axis: no staged plan
        return NO_STAGED_PLAN, NO_STAGED_PLAN
    least = 0.0  # the least peak of the stages after, above what they are given
    for opts in reversed(options):
        least = min(max(o.need_bytes, o.kept_bytes + least) for o in opts)
    # each stage's need and kept are rounded up to a slot of the budget in `_allocate`
    rounding = (len(options) + 1) / global_slots
    return int(least), int(math.ceil(least * (1 + rounding))) + 1


# NOTE [ The least staged budget ]
# The least peak of a staged plan by the cost model is a min-max over one option per stage:
# going backwards, L(s) = min over options o of stage s of max(need(o), kept(o) + L(s + 1)),
# L(after the last) = 0 (an option's need counts from what the stages before keep). It takes
# the tables, which every staged plan of the graph needs anyway, and no solve. `_allocate`
# rounds each stage's need and kept bytes up to slots of 1/global_slots of the budget, so a
# budget (stages + 1) slots above L surely allocates (below L none does), and the caller
# (`hbp.planner.dp.staged_search.staged_minimum`) bisects between the two a few steps; what each
# plan simulates to is checked, as for every staged plan.


def _settings(stage_nodes, per_region, region, stage_slots, nested, levels, reuse, pins) -> tuple:
    """The key of a set of stage tables: `pins=None` is the solver's default
    (`hbp.planner.dp.solver.PIN_VALUES`, read now), so that a caller naming it and one leaving
    it out share the tables (the least budget for "N%act" and the plan for it)."""
    pins = solver_module.PIN_VALUES if pins is None else pins
    return (stage_nodes, per_region, region, stage_slots, nested, levels, reuse, pins)


def _tables(info: GraphInfo, settings: tuple):
    """The stage tables of `settings` (`_stage_tables`), kept on `info` while the caller is
    inside `stage_tables_kept` (NOTE [ Stage tables do not depend on the budget ])."""
    known = info.__dict__.setdefault("_stage_tables", {})
    key = (settings, current_coarse_cuts())  # NOTE [ Cuts that many values cross ]
    if key not in known:
        known[key] = _stage_tables(info, *settings)
    return known[key]


def _stage_tables(
    info: GraphInfo, stage_nodes, per_region, region, stage_slots, nested, levels, reuse, pins
) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, Solver]], list[list[StageOption]]]:
    """The budget-independent part of `staged_plan`: cuts, stages, per stage the stage solved
    (its start and solver) and its options."""
    model = _staged_model(info, stage_nodes, per_region, region)
    cuts, bounds = model.cuts, model.bounds
    stages = list(zip(bounds[:-1], bounds[1:]))
    solved: dict[tuple, tuple[int, Solver, list[StageOption]]] = {}
    reps, options = [], []  # per stage: (start of the stage solved, its solver); its options
    with planning(len(cuts)):
        for a, b in stages:
            # NOTE [ Identical stages are solved once ]
            key = stage_signature(model, a, b) if reuse else (a,)
            if key not in solved:
                solver = _stage_solver(model, a, b, stage_slots, nested, levels, pins)
                solved[key] = (a, solver, _stage_options(solver, a))
            first, solver, opts = solved[key]
            reps.append((first, solver))
            # needs count the positional bytes below the stage's base (parameter gradients
            # of the stages after it), which differ between identical stages
            lift = _stage_base(model, a, b) - solver.offset
            options.append([replace(o, need_bytes=o.need_bytes + lift) for o in opts])
    return cuts, stages, reps, options


# NOTE [ Stage tables do not depend on the budget ]
# A staged plan's stages, their tables and options are the same at every budget; only the
# allocation across stages (`_allocate`) depends on it, and which of the plans rebuilt from
# the tables (one per stage solved and option) it takes.
# `optimal_plan` asks for staged plans several times per call (a tightened budget after an
# overshoot, the bisection of a BudgetError's staged minimum), so the tables are kept on the
# GraphInfo (`_stage_tables`, per setting), and the plans rebuilt from them (`_stage_plans`),
# for the rest of the `optimal_plan` call, which drops them when it returns
# (`stage_tables_kept`): the solvers refer back to the GraphInfo, so left on it they would
# make a cycle for the collector to find (NOTE [ Profiles do not own their cost model ]).


@contextlib.contextmanager
def stage_tables_kept(info: GraphInfo) -> Iterator[None]:
    """Inside, staged plans of `info` share their tables; on exit they are dropped (NOTE
    [ Stage tables do not depend on the budget ])."""
    # one scope for both per-call caches: NOTE [ One cost model per cut set in a plan call ]
    with cost_models_shared(info) as outermost:
        try:
            yield
        finally:
            if outermost:  # the outermost drops them, and the stage plans rebuilt from them
                info.__dict__.pop("_stage_tables", None)
                info.__dict__.pop("_stage_plans", None)


# NOTE [ Identical stages are solved once ]
# Real models are stacks of identical layers, so most stages of a deep graph are copies of
# one another: the same nodes, bytes and FLOPs at the same offsets, the same values crossing
# in and out, the same positional memory above the stage's own base. A stage's table depends
# on nothing else, so a stage whose signature (`stage_signature`) equals an earlier one's
# takes that stage's options and its rebuilt plan, shifted to its own positions. The
# signature lists everything the cost model reads within a stage, relative to the stage's
# start (a value made before the stage by the order of first reference, a position after it
# as "after", positional bytes above the stage's base); two stages whose tables could differ
# never share one (tests check the plans against solving every stage). Only the needs move:
# they are counted from the stage's own base (the parameter gradients of the stages after
# it, which differ between identical stages).

# NOTE [ Signature of what the tables read ]
# The signature holds a field as the tables read it, not as it is stored: the positional
# bytes at backward events only where a node has a backward (elsewhere they are never read,
# and on a captured transformer the nodes without backward in each layer, views of the
# rotary tables and scalar constants, carry the parameter gradients of the layers after it:
# every layer's signature differed), and a node's first input only as compared with
# positions in the stage (a node without inputs, such as a constant, holds n, which reads as
# "after the stage"). Captured stacks of identical layers then share their tables like
# synthetic ones.


def _staged_model(info: GraphInfo, stage_nodes: int, per_region: int, region: int) -> CostModel:
    """The cost model of staged planning: stage bounds, then window cuts within each stage
    (the same cuts within identical stages)."""
    bounds = stage_bounds(info, window_cuts(info, per_region, region), stage_nodes)
    return CostModel(info, window_cuts(info, per_region, region, bounds), bounds)


def stage_signatures(
    info: GraphInfo, stage_nodes: int = 40, per_region: int = 6, region: int = 32
) -> list[tuple]:
    """`stage_signature` of every stage `staged_plan` plans (equal ones share a table)."""
    model = _staged_model(info, stage_nodes, per_region, region)
    bounds = model.bounds
    return [stage_signature(model, a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def stage_signature(model: CostModel, a: int, b: int) -> tuple:
    """Everything the stage [a, b)'s table depends on, relative to a (hashable)."""
    info, n = model.info, model.n
    base = _stage_base(model, a, b)
    outside: dict[int, int] = {}  # group or value made before a -> order of first reference

    def value(v: int) -> int:  # a value: its offset in the stage, or -1 - its order outside
        if v >= a:
            return v - a
        return -1 - outside.setdefault(int(info.root[v]), len(outside))

    def position(t: int) -> int:  # a position past the stage reads as "after" (b - a + 1)
        return t - a if t <= b else b - a + 1

    scalars = [
        getattr(info, name)[a:b].tobytes()
        for name in (
            "storage_bytes", "is_input", "is_output", "grad_seed", "is_held", "seed_let_go",
            "seed_grad_held", "receives_grad", "has_backward", "grad_bytes", "saves_output",
            "extra_bytes", "param_grad_bytes", "save_event", "flops", "backward_flops",
            "forward_scratch_bytes", "backward_scratch_bytes", "stop_flops", "runs_at_stop",
            "draws_random",
        )
    ]  # fmt: skip
    nodes = tuple(
        (
            tuple(value(v) for v in info.inputs[j]),
            tuple(value(v) for v in info.saved[j]),
            tuple(value(v) for v in info.passthrough[j]),
            value(int(info.root[j])),
            position(int(info.last_user[j])) if info.last_user[j] >= 0 else -1,
        )
        for j in range(a, b)
    )
    groups = set(model.node_group[a:b][model.node_group[a:b] >= 0].tolist())
    for j in range(a, b):
        groups.update(int(model.node_group[v]) for v in (*info.inputs[j], *info.saved[j]))
    for c in model.cuts[bisect_left(model.cuts, a) : bisect_right(model.cuts, b)]:
        groups.update(model.crossing[c])
    groups.discard(-1)

    def within(seq: list[int]) -> tuple:  # positions in [a, b); whether any lies before
        lo, hi = bisect_left(seq, a), bisect_left(seq, b)
        return lo > 0, tuple(t - a for t in seq[lo:hi]), hi < len(seq)

    described = sorted(
        (
            value(int(model.g_root[g])),
            int(model.g_size[g]),
            bool(model.g_forced[g]),
            position(int(model.g_lu[g])),
            # first holder: before the stage, in it, after it, never
            (-2 if model.g_hmin[g] < a else position(int(model.g_hmin[g])))
            if model.g_hmin[g] < n
            else -1,
            within(model.g_touch[g]),
            within(model.g_hold[g]),
            within(model.g_read[g]),
        )
        for g in sorted(groups)
    )
    last_before = int(model.last_save[a])  # the pass of a level without save events
    positions = np.arange(a, b + 1)
    return (
        b == n,
        *scalars,
        nodes,
        tuple(described),
        # read only at backward events (NOTE [ Signature of what the tables read ])
        np.where(info.has_backward[a:b], model.pos_bwd[a:b] - base, 0.0).tobytes(),
        np.where(info.has_backward[a:b], model.pos_late[a:b] - base, 0.0).tobytes(),
        (model.pos_after[a : b + 1] - base).tobytes(),
        float(model.pos_after[last_before + 1] - base),
        model.out_pre[a : b + 1].tobytes(),
        np.where(model.last_save[a : b + 1] >= a, model.last_save[a : b + 1] - a, -1).tobytes(),
        (np.minimum(model.next_save[a : b + 1], b) - positions).tobytes(),
        (info.random_before[a : b + 1] - info.random_before[a]).tobytes(),
        # compared with positions e in [a, b] only (`min_input < e`): n (no input) as b
        np.where(model.min_input[a:b] >= a, np.minimum(model.min_input[a:b], b) - a, -1).tobytes(),
        tuple(c - a for c in model.cuts[bisect_left(model.cuts, a) : bisect_right(model.cuts, b)]),
        float(model.pos_after[n] - base) if b == n else 0.0,
        model.out_total if b == n else 0,
    )


def _stage_base(model: CostModel, a: int, b: int) -> float:
    """The smallest positional bytes of the stage's backward: its memory axis starts there."""
    pos = model.pos_bwd[a:b][model.info.has_backward[a:b]]
    return float(pos.min()) if len(pos) else 0.0


def _shifted(segment: Segment, delta: int) -> Segment:
    """`segment` (and its children) moved by `delta` positions, names left to fill."""
    return replace(
        segment,
        start=segment.start + delta,
        stop=segment.stop + delta,
        children=[_shifted(c, delta) for c in segment.children],
        pinned=tuple(q + delta for q in segment.pinned),
        first="",
        last="",
    )


def _stage_solver(
    model: CostModel, a: int, b: int, slots: int, nested: bool, levels: int, pins: bool | None
) -> Solver:
    """A Solver whose top level is the stage [a, b), on the stage's own memory axis, with
    `levels + 1` end requirements from 0 to the bytes the stage could keep at most."""
    info = model.info
    pos = model.pos_bwd[a:b][info.has_backward[a:b]]
    base = _stage_base(model, a, b)
    own = (
        info.storage_bytes[a:b].sum()
        + info.extra_bytes[a:b].sum()
        + info.forward_scratch_bytes[a:b].max(initial=0)
        + info.backward_scratch_bytes[a:b].max(initial=0)
        + info.grad_bytes[a:b].max(initial=0)
    )
    top = float(pos.max()) if len(pos) else 0.0
    if b == model.n:
        top = max(top, float(model.pos_after[model.n]))
    span = float(own) + top - base + float(model.out_total if b == model.n else 0)
    slot = 2 * max(span, 1.0) / slots  # room for needs and for the free space left at the end
    solver = Solver(model, slots, slot, nested, end=b, need_offset=base, pins=pins)
    most = float(info.storage_bytes[a:b].sum() + info.extra_bytes[a:b].sum())
    solver.end_slots = np.unique(np.round(np.linspace(0, most / slot, levels + 1))).astype(int)
    return solver


def _stage_options(solver: Solver, a: int) -> list[StageOption]:
    """The distinct (need, kept, cost) points of a stage's table, dominated ones dropped.

    Row 0 of the table gives the least recompute within m; plans that keep less at a higher
    recompute (worth it where later stages need the memory) come from the rows that ask
    the stage to leave free slots at its end (`Solver.end_slots`)."""
    cost = solver.top(a, frozenset())
    kept = solver.top_kept(a, frozenset())
    found: list[StageOption] = []
    for row in range(cost.shape[0]):
        previous = None
        for m in np.flatnonzero(cost[row] < INF).tolist():
            point = (float(cost[row, m]), float(kept[row, m]))
            if point != previous:  # the plan changes at m
                need = solver.offset + m * solver.slot
                found.append(StageOption(need, point[1], point[0], m, row))
                previous = point
    found.sort(key=lambda o: (o.need_bytes, o.cost, o.kept_bytes))
    out: list[StageOption] = []
    for o in found:  # keep it unless an option needing at most as much is as good
        if not any(p.cost <= o.cost and p.kept_bytes <= o.kept_bytes for p in out):
            out.append(o)
    return out


def _allocate(options: list[list[StageOption]], budget: int, slots: int) -> list[int] | None:
    """One option per stage, least total cost with every stage's need within the budget
    left by the stages before it (a DP over `slots` slots of the budget, rounded up)."""
    slot = budget / slots
    F = np.zeros(slots + 1)  # after the last stage: nothing left to need
    picks = []
    for opts in reversed(options):
        best = np.full(slots + 1, INF)
        arg = np.full(slots + 1, -1, dtype=np.int64)
        for k, o in enumerate(opts):
            kept = math.ceil(o.kept_bytes / slot - 1e-9)
            need = max(kept, math.ceil(o.need_bytes / slot - 1e-9))
            if need > slots:
                continue
            value = o.cost + F[need - kept : slots + 1 - kept]  # at slots need..slots
            better = value < best[need:]
            best[need:][better] = value[better]
            arg[need:][better] = k
        F = best
        picks.append(arg)
    picks.reverse()
    if F[slots] == INF:
        return None
    m, choice = slots, []
    for arg, opts in zip(picks, options):
        k = int(arg[m])
        choice.append(k)
        m -= math.ceil(opts[k].kept_bytes / slot - 1e-9)
    return choice
