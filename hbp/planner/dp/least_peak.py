"""The least peak the whole-graph DP reaches: `PeakSolver` over the candidate cut sets, each
result remembered per graph structure (BudgetError's minimum, "min", and the budgets
relative to the least peak all ask for it)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import weakref

import numpy as np

from hbp.analysis.frontier import lower_bound
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_call import kept_for_plan_call
from hbp.analysis.simulate import simulate
from hbp.planner.cuts import dp_work
from hbp.planner.dp.cost_model import CostModel, cost_model
from hbp.planner.dp.peak import PeakSolver
from hbp.planner.dp.recursion import planning, simplify
from hbp.planner.plan import Segment

__all__ = [
    "absorb_inputs",
    "first_floor_above",
    "floor_above",
    "forget_least_peaks",
    "info_fingerprint",
    "known_above",
    "known_least_over",
    "known_least_peak",
    "known_least_peaks",
    "least_known",
    "least_peak_cached",
    "least_peak_floor",
    "least_peak_over",
    "least_peak_plan",
    "least_peak_value",
    "reach_cuts",
    "remember_coarse_cuts",
    "remembered_coarse_cuts",
    "top_level",
    "union_floor",
    "union_of",
]


def absorb_inputs(info: GraphInfo, segments: list[Segment]) -> list[Segment]:
    """Merge a leading segment made only of graph inputs into the next one (graph inputs are
    never run nor recomputed, so this changes nothing but the printout)."""
    first = segments[0] if segments else None
    if len(segments) < 2 or not all(info.is_input[j] for j in range(first.start, first.stop)):
        return segments

    def extend(seg: Segment) -> Segment:
        kids = [extend(seg.children[0]), *seg.children[1:]] if seg.children else []
        return Segment(first.start, seg.stop, seg.recompute, kids, pinned=seg.pinned)

    return [extend(segments[1]), *segments[2:]]


def top_level(info: GraphInfo, segments: list[Segment]) -> list[Segment]:
    """A solver's top-level segments as a plan hands them out: simplified (`simplify`; the
    whole graph as one plain segment when nothing is left), leading graph inputs absorbed."""
    return absorb_inputs(info, simplify(segments) or [Segment(0, info.n)])


def least_peak_plan(
    info: GraphInfo, model: CostModel, nested: bool, solver: PeakSolver | None = None
) -> tuple[int, list[Segment]]:
    """The least-peak plan (`PeakSolver`; `solver`: one over `model` with tables made) and its
    peak. Where the graph keeps generator states, the simulated peak: the DP does not see
    every copy (NOTE [ Generator states of checkpoints ] in hbp.analysis.simulate), so the
    minimum is one that a plan reaches."""
    solver = solver or PeakSolver(model, nested)
    peak = int(solver.top(0, frozenset()).peak)
    segments = solver.top_plan()
    if info.rng_state_bytes:
        plan = top_level(info, segments)
        peak = max(peak, simulate(None, plan, info=info).peak_bytes)
    return peak, segments


def least_peak_over(
    info: GraphInfo, choices: list[list[int]], nested: bool, value_only: bool = False
) -> tuple[int, list[Segment] | None]:
    """The least peak over the union of the cut sets of `choices` (NOTE [ Least peak over
    other cut choices ] in hbp.planner.cuts) and its top-level plan; `value_only`: the
    peak alone, the plan None (NOTE [ A plan at the floor ])."""
    cuts = choices[0]
    if len(choices) > 1:
        first = None if info.rng_state_bytes else known_least_peak(info, cuts, nested)
        if first is None or first > lower_bound(info):  # no set goes below the lower bound
            cuts = reach_cuts(info, choices, nested)
    if value_only and not info.rng_state_bytes:
        return least_peak_value(info, cuts, nested), None
    peak, segments = least_peak_cached(info, cuts, nested)
    if info.rng_state_bytes and cuts != choices[0]:  # NOTE [ Simulated least peaks ]
        first_peak, first_segments = least_peak_cached(info, choices[0], nested)
        if first_peak < peak:
            peak, segments = first_peak, first_segments
    return peak, top_level(info, segments)


# NOTE [ Simulated least peaks ]
# Where the graph keeps generator states, a least peak is its plan's simulated peak
# (`least_peak_plan`): the DP does not see every state a checkpoint keeps, so a plan space
# that holds another (the union of the cut choices holds the first set) can pick a plan whose
# states simulate higher than the other space's plan. A BudgetError's minimum is taken over
# the first set first (the whole-graph DP's own); "min" took the union's alone, and named a
# budget above one that a BudgetError named and that planned (a Pegasus with dropout,
# docs/real-models.md). The least over the first set and the others' is the one both name.


def union_of(choices: list[list[int]]) -> list[int]:
    """The cuts of every set of `choices`, in order."""
    return sorted(set().union(*choices))


def reach_cuts(info: GraphInfo, choices: list[list[int]], nested: bool) -> list[int]:
    """The cuts the least peak over the cut choices is taken over: their union where it pays
    (`union_pays`), else the set of `choices` whose least peak is the least (the first of
    equals; a set whose floor is at least the least found before it is not searched: NOTE
    [ A floor under the least peak ]). Remembered."""
    if len(choices) == 1 or union_pays(info, choices):
        return union_of(choices)
    known = _remembered(info)
    key = _reach_key(choices, nested)
    if key not in known:
        best, reach = None, choices[0]
        for cuts in choices:
            if best is not None and least_peak_floor(info, cuts, nested) >= best:
                continue  # it reaches no less than `best`, and comes after it
            peak = least_peak_value(info, cuts, nested)
            if best is None or peak < best:
                best, reach = peak, cuts
        known[key] = reach
    return known[key]


def union_pays(info: GraphInfo, choices: list[list[int]]) -> bool:
    """Whether the DP over the union of `choices` is estimated to cost at most `UNION_WORK`
    times the DPs over each set (`dp_work`; NOTE [ The union where it pays ]). Kept on `info`
    (a private field: not in its fingerprint)."""
    known = info.__dict__.setdefault("_union_pays", {})
    key = tuple(map(tuple, choices))
    if key not in known:
        *each, union = dp_work(info, [*choices, union_of(choices)])
        known[key] = union <= UNION_WORK * sum(each)
    return known[key]


def known_least_over(info: GraphInfo, choices: list[list[int]], nested: bool) -> int | None:
    """The least peak over the cut choices (`least_peak_over`'s, over `reach_cuts`) where
    it is remembered, else None."""
    if len(choices) == 1 or union_pays(info, choices):
        return known_least_peak(info, union_of(choices), nested)
    known = _LEAST_PEAKS.get(id(info))
    reach = None if known is None else known.get(_reach_key(choices, nested))
    return None if reach is None else known_least_peak(info, reach, nested)


def _reach_key(choices: list[list[int]], nested: bool) -> tuple:
    """`reach_cuts`' key in the dict of remembered least peaks."""
    return ("reach", tuple(map(tuple, choices)), nested)


#: The union of the cut choices is searched where its DP's estimated work is at most this many
#: times the sets' together (NOTE [ The union where it pays ]).
UNION_WORK = 2.0

# NOTE [ The union where it pays ]
# One least-peak DP over the union of the cut choices usually costs about what the DPs over
# each set cost together (the sets share most of their cuts), and its plan space holds
# theirs. Where many groups cross the cuts and were made in different intervals (a U-Net's
# skip connections, kept from every level of the encoder until the decoder's), every cut the
# union adds to the encoder splits those groups' makers further, and the held sets a cut
# sees multiply with the intervals the groups crossing it are made in. `dp_work` charges a
# cut 2^k held sets for k such intervals (an overestimate, used only to compare one cut set
# with another), and the union is searched only where that estimate is within `UNION_WORK`
# times the sets' together; else the least peak is the least of the sets' least peaks, and
# a budget only other cuts reach is planned over the set that reaches the least (docs/planner.md
# has the graphs and times).


def least_peak_cached(info: GraphInfo, cuts: list[int], nested: bool):
    """`least_peak_plan` over `cuts`, remembered per graph structure (NOTE [ Least peaks are
    remembered ]): "min" and a BudgetError ask the same least peaks several times for one
    graph, and every plan call of a graph asks them again."""
    known = _remembered(info)
    key = (tuple(cuts), nested)
    if key not in known:
        model = cost_model(info, cuts)
        with planning(len(model.cuts)):
            known[key] = least_peak_plan(info, model, nested)
    peak, segments = known[key]
    return peak, copy.deepcopy(segments)


def least_peak_value(info: GraphInfo, cuts: list[int], nested: bool) -> int:
    """`least_peak_cached(info, cuts, nested)[0]`, without the least-peak DP where a plan
    reaches the floor (NOTE [ A plan at the floor ]). Remembered."""
    exact = known_least_peak(info, cuts, nested)
    if exact is not None:
        return exact
    if info.rng_state_bytes:
        return least_peak_cached(info, cuts, nested)[0]
    model = cost_model(info, cuts)
    known = _remembered(info)
    with planning(len(model.cuts)):
        solver = PeakSolver(model, nested)
        floor = solver.floor()
        known.setdefault(("floor", tuple(cuts), nested), floor)
        chain = solver.chain_peak() if len(model.cuts) > 1 else None
        if chain is not None and int(chain) == floor:
            known[("value", tuple(cuts), nested)] = floor
            return floor
        # the DP, on the tables the floor made (what `least_peak_cached` remembers)
        known[(tuple(cuts), nested)] = least_peak_plan(info, model, nested, solver)
    return known[(tuple(cuts), nested)][0]


# NOTE [ A plan at the floor ]
# The floor (NOTE [ A floor under the least peak ]) is at most the least peak; a plan whose
# modelled peak equals it proves that it is the least peak, without the least-peak DP. The
# plan tried is one of the DP's own options: every interval between adjacent cuts a
# recomputed top-level child, each with its least-peak T(e, f) (the floor's tables) inside,
# valued by the same arithmetic (`PeakSolver.chain_peak`). On stacks of layers the largest
# interval's recompute is what the least peak is, and the chain reaches it: a 32-layer Llama
# at batch 1, 27,492,872 B both ways. Where it does not, the DP runs as before. Only the value
# is had this way: callers that need the least-peak plan itself (a "min-peak" fallback, the
# plan over other cut choices) still run the DP, so no plan changes; "min", "N%act" and a
# BudgetError's minimum ask for the value. Graphs with generator states are left out (their
# least peak is a simulated one).


def least_peak_floor(info: GraphInfo, cuts: list[int], nested: bool) -> int:
    """A lower bound of the least peak over `cuts` (`least_peak_cached`): the largest least
    peak of recomputing one interval between adjacent cuts alone (NOTE [ A floor under the
    least peak ]); the least peak itself where it is remembered. Remembered as it is."""
    exact = known_least_peak(info, cuts, nested)
    if exact is not None:
        return exact
    known = _remembered(info)
    key = ("floor", tuple(cuts), nested)
    if key not in known:
        model = cost_model(info, cuts)
        with planning(len(model.cuts)):
            known[key] = PeakSolver(model, nested).floor()
    return known[key]


# NOTE [ A floor under the least peak ]
# Every plan over a set of cuts runs the backward of each interval between two adjacent cuts
# with that interval's activations present, stored or recomputed, and at least what
# recomputing the interval alone needs: its recomputed activations, their gradients and the
# positional memory of its backward (parameter gradients of the nodes after it). The DP's
# T(e, f) of an interval without inner cuts is exactly that (one plain child); a plan adds
# what its other segments keep, never less, so the largest such T is at most the DP's least
# peak. Taking it costs a cost model and one T per interval (a few hundredths of a second at
# 50 cuts, against about a second for the least-peak DP), and on stacks of layers it is close
# to the least peak or equal to it (a 32-layer Llama: 30,205,444 B under 30,369,284). It
# decides without the DP that the whole graph cannot fit a budget below it, and that the
# stages reach less where their least budget is below it; the least peak itself is computed
# only where the floor cannot decide. `experiments/check_floor.py` checks the bound on every
# graph of `experiments/check_plans.py` and on random DAGs; graphs with generator states are
# left out (their least peak is a simulated one).


def known_least_peaks(info: GraphInfo, choices: list[list[int]], nested: bool) -> list[int]:
    """The remembered least peaks (`least_peak_cached`) over the first cut set of `choices`
    and over their union (at most the first set's: NOTE [ Least peak over other cut choices ]
    in hbp.planner.cuts), in that order; none for graphs with generator states."""
    if info.rng_state_bytes:
        return []
    known = (known_least_peak(info, choices[0], nested), known_least_over(info, choices, nested))
    return [k for k in known if k is not None]


def least_known(info: GraphInfo, choices: list[list[int]], nested: bool) -> bool:
    """Whether the least peak over the first cut set of `choices` or their union is
    remembered."""
    return bool(known_least_peaks(info, choices, nested))


def known_above(info: GraphInfo, choices: list[list[int]], nested: bool, budget: int):
    """A remembered least peak above `budget` over the first cut set of `choices` or over
    their union, else None: where there is one, the tables over the first set cannot fit the
    budget."""
    return next((k for k in known_least_peaks(info, choices, nested) if k > budget), None)


def union_floor(info: GraphInfo, choices: list[list[int]], nested: bool) -> int:
    """The floor of the least peak over the union of `choices`, at most the least of every
    set (NOTE [ A floor under the least peak ]); kept for the plan call (NOTE [ Facts kept
    for one plan call ] in hbp.analysis.plan_call)."""
    key = ("union floor", tuple(tuple(cuts) for cuts in choices), nested)
    return kept_for_plan_call(info, key, lambda: least_peak_floor(info, union_of(choices), nested))


def floor_above(info: GraphInfo, choices: list[list[int]], nested: bool, budget: int) -> bool:
    """Whether the floor of the least peak over the union of `choices` (at most the least of
    every set: NOTE [ A floor under the least peak ]) is above `budget`: then no whole-graph
    plan fits it. Never for graphs with generator states."""
    return not info.rng_state_bytes and union_floor(info, choices, nested) > budget


def first_floor_above(
    info: GraphInfo, choices: list[list[int]], nested: bool, budget: int
) -> int | None:
    """The floor of the least peak over the first cut set of `choices` where it is above
    `budget` and the union of `choices` is known to reach the budget, else None (NOTE [ The
    first set's floor skips its tables ]). Never for graphs with generator states."""
    if len(choices) < 2 or info.rng_state_bytes:
        return None
    reached = known_least_over(info, choices, nested)
    if reached is None or reached > budget:
        return None
    floor = least_peak_floor(info, choices[0], nested)
    return floor if floor > budget else None


# NOTE [ The first set's floor skips its tables ]
# "min" is the least peak over the union of the cut choices (where the union pays), which is
# often below the first set's: a 4-layer Qwen2 of 319 nodes reaches 6,433,284 B over the union
# and 6,828,036 over the first set. The recompute tables over the first set then end in INF at
# that budget (they find only plans whose modelled peak is at least the set's least peak: NOTE
# [ Known least peaks skip the tables ]), and their BudgetError sends the budget to the
# union's tables. Where the union's least peak is known to reach the budget and the first
# set's floor (NOTE [ A floor under the least peak ]: a few hundredths of a second) is above
# it, the first set's tables are not run (`first_floor_above`, which `optimal_plan` asks
# before them): the same plan, without them (docs/planner.md has the times).


def _remembered(info: GraphInfo) -> dict:
    """The dict of least peaks (and floors) remembered for `info`'s structure."""
    known = _LEAST_PEAKS.get(id(info))
    if known is None:
        fingerprint = info_fingerprint(info)
        known = _BY_FINGERPRINT.pop(fingerprint, None) or {}
        _BY_FINGERPRINT[fingerprint] = known  # the most recent last
        while len(_BY_FINGERPRINT) > REMEMBERED_GRAPHS:
            _BY_FINGERPRINT.pop(next(iter(_BY_FINGERPRINT)))
        _LEAST_PEAKS[id(info)] = known
        weakref.finalize(info, _LEAST_PEAKS.pop, id(info), None)
    return known


def known_least_peak(info: GraphInfo, cuts: list[int], nested: bool) -> int | None:
    """The least peak over `cuts` where `least_peak_cached` already has it, else None."""
    known = _LEAST_PEAKS.get(id(info))
    if known is None:
        return None
    found = known.get((tuple(cuts), nested))
    if found is None:  # NOTE [ A plan at the floor ]: the value alone
        return known.get(("value", tuple(cuts), nested))
    return found[0]


# NOTE [ Known least peaks skip the tables ]
# The recompute tables find a plan only where some plan over the same cuts has a modelled
# peak within the budget (their slots round bytes up; a pin only adds charges: NOTE [ Pin
# candidates ] in hbp.planner.dp.cost_model), and the least-peak DP's value is the least such
# peak over those cuts. Where it, or the least over the union of the cut choices (at most
# it), is already known (remembered: "min" computes it before planning at it) and above the
# budget, the tables would end in INF and a BudgetError after them, so the tables are not
# run. Graphs with generator states are excluded (their least peak is a simulated one).


# NOTE [ Least peaks are remembered ]
# The least-peak DP is the costliest part of a BudgetError and of "min" (one DP per cut set
# of `cut_choices`), and a graph is often planned several times: at several budgets, "min"
# after a BudgetError, again after a re-capture of the same model. Its results depend on the
# GraphInfo arrays alone (`info_fingerprint`), so they are kept for the last
# REMEMBERED_GRAPHS graph structures of the process. The segments handed out are copies
# (callers name them in place).
REMEMBERED_GRAPHS = 8

#: id(GraphInfo) -> {(cuts, nested): (least peak, its segments)} (`least_peak_cached`) and
#: {("floor", cuts, nested): floor} (`least_peak_floor`) and {("reach", choices, nested): cuts}
#: (`reach_cuts`), the dict of `_BY_FINGERPRINT` for that GraphInfo's structure.
_LEAST_PEAKS: dict[int, dict] = {}
#: info_fingerprint -> the same dicts, the most recently used last.
_BY_FINGERPRINT: dict[str, dict] = {}
#: info_fingerprint -> the count of spread cuts its DP needs (NOTE [ Cuts that many values
#: cross ] in hbp.planner.dp.held_sets), the most recently found last.
_COARSE_BY_FINGERPRINT: dict[str, int] = {}


def remembered_coarse_cuts(info: GraphInfo) -> int | None:
    """The count of spread cuts remembered for `info`'s structure, else None (no fingerprint
    is taken while no structure has one)."""
    if not _COARSE_BY_FINGERPRINT:
        return None
    return _COARSE_BY_FINGERPRINT.get(info_fingerprint(info))


def remember_coarse_cuts(info: GraphInfo, count: int) -> None:
    """Remember that `info`'s structure plans over `count` spread cuts."""
    _COARSE_BY_FINGERPRINT[info_fingerprint(info)] = count
    while len(_COARSE_BY_FINGERPRINT) > REMEMBERED_GRAPHS:
        _COARSE_BY_FINGERPRINT.pop(next(iter(_COARSE_BY_FINGERPRINT)))


def info_fingerprint(info: GraphInfo) -> str:
    """A digest of every GraphInfo field the planner reads (all but the node names)."""
    digest = hashlib.sha256()
    for name in sorted(field.name for field in dataclasses.fields(info)):
        if name in ("names", "users"):  # labels; users follow from inputs (what is kept on
            continue  # it, tables and lists, is not a field: derived)
        value = getattr(info, name)
        digest.update(name.encode())
        if isinstance(value, np.ndarray):
            digest.update(str(value.dtype).encode())
            digest.update(value.tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def forget_least_peaks() -> None:
    """Forget every remembered least peak and count of spread cuts (cold planning, for
    benchmarks and tests)."""
    _BY_FINGERPRINT.clear()
    _LEAST_PEAKS.clear()
    _COARSE_BY_FINGERPRINT.clear()
