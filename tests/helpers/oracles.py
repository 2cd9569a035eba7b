"""Brute-force oracles the planner and the MILP are checked against (tiny graphs only).

Plans: every tree of intervals over the candidate cuts (one level: each segment plain or
recomputed; nested: recomputed segments tiled again, recursively), simulated; with pins, each
recomputed segment also pinning no node or any one node with storage of its own. Schedules: every
choice of recomputations (stage, value) of a `Schedule`, with `Schedule.evaluate`'s accounting.
"""

from __future__ import annotations

import itertools

from hbp.analysis import simulate
from hbp.analysis.liveness import GraphInfo
from hbp.planner import candidate_cuts
from hbp.planner.plan import Segment
from hbp.planner.schedule_model import Schedule


def tilings(start, stop, cuts, depth):
    """Every plan of [start, stop) over `cuts`, recomputed segments nested up to `depth`
    levels (a single child is left out: it is the same plan as no children)."""
    inner = [c for c in cuts if start < c < stop]
    for r in range(len(inner) + 1):
        for chosen in itertools.combinations(inner, r):
            bounds = [start, *chosen, stop]
            choices = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                options = [Segment(a, b), Segment(a, b, True)]
                if depth > 1:
                    options += [
                        Segment(a, b, True, kids)
                        for kids in tilings(a, b, cuts, depth - 1)
                        if len(kids) > 1
                    ]
                choices.append(options)
            for combo in itertools.product(*choices):
                yield list(combo)


def plan_outcomes(graph, depth):
    """(peak bytes, recompute FLOPs) of every plan."""
    info = GraphInfo.of(graph)
    cuts = candidate_cuts(info, 1, max_cuts=10**6)
    return [
        (s.peak_bytes, s.recompute_flops)
        for s in (simulate(graph, t, info=info) for t in tilings(0, info.n, cuts, depth))
    ]


def least_recompute(results, budget):
    fits = [r for p, r in results if p <= budget]
    return min(fits) if fits else None


def pinned_tilings(info: GraphInfo, cuts: list[int], depth: int):
    """Every plan over `cuts` up to `depth` levels, with every choice of one pin (or none) per
    recomputed segment at any level (a node pinned once)."""

    def pins(seg):
        if not seg.recompute:
            return [()]
        own = [
            q
            for q in range(seg.start, seg.stop)
            if not info.is_input[q] and info.root[q] == q and info.storage_bytes[q] > 0
        ]
        return [(), *((q,) for q in own)]

    def variants(segments):
        """Every pinned version of `segments` (children first)."""
        per_segment = []
        for s in segments:
            options = []
            for kids in variants(s.children) if s.children else [[]]:
                taken = {q for k in kids for q in all_pins(k)}
                for q in pins(s):
                    if not set(q) & taken:
                        options.append(Segment(s.start, s.stop, s.recompute, kids, pinned=q))
            per_segment.append(options)
        return [list(combo) for combo in itertools.product(*per_segment)]

    for tiling in tilings(0, info.n, cuts, depth):
        yield from variants(tiling)


def all_pins(seg: Segment) -> list[int]:
    return [*seg.pinned, *(q for c in seg.children for q in all_pins(c))]


def pinned_plan_outcomes(graph, depth):
    """(peak, recompute, pins anywhere) of every plan."""
    info = GraphInfo.of(graph)
    cuts = candidate_cuts(info, 1, max_cuts=10**6)
    out = []
    for plan in pinned_tilings(info, cuts, depth):
        sim = simulate(graph, plan, info=info)
        out.append((sim.peak_bytes, sim.recompute_flops, any(all_pins(s) for s in plan)))
    return out


def least_recompute_pinned(results, budget, pins: bool):
    fits = [r for p, r, pinned in results if p <= budget and (pins or not pinned)]
    return min(fits) if fits else None


def schedule_outcomes(schedule: Schedule) -> list[tuple[float, float]]:
    """(peak bytes, recompute FLOPs) of every choice of recomputations (stage, value) that
    is executable, with `Schedule.evaluate`'s accounting (tiny graphs only: 2^choices)."""
    choices = [
        (t, i)
        for t in range(schedule.T)
        for i in schedule.ops(t)
        if not (schedule.stages[t][1] == "f" and schedule.stages[t][2] == i)
    ]
    out = []
    for bits in itertools.product((0, 1), repeat=len(choices)):
        result = schedule.evaluate({c: b for c, b in zip(choices, bits) if b})
        if result is not None:
            out.append(result)
    return out


def least_schedule_recompute(schedule: Schedule, budget_bytes: int, results=None) -> float | None:
    """Least recompute over every schedule (see `schedule_outcomes`) that fits the budget."""
    results = schedule_outcomes(schedule) if results is None else results
    fits = [cost for peak, cost in results if peak <= budget_bytes]
    return min(fits) if fits else None
