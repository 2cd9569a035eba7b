"""What `Solver` and `PeakSolver` share: the options of a level's first child, and the walk
that rebuilds a plan from the choices their tables record.

A level ending at d with its first child starting at e (held set H, `RestSaves` flag) chooses
the child's end f, its mode (`ChildMode`) and how much of it the level's recompute pass runs
(`PassExtent`), which fixes the flag of the rest [f, d). At the top level there is no pass
(FULL, no flag). The rest is the table at (f, H2, flag): the recursion is over
(e, H, flag) right to left, and a recomputed child's backward is the table T(e, f).
"""

from __future__ import annotations

import contextlib
import gc
import sys
from itertools import groupby
from typing import NamedTuple

import numpy as np

from hbp.planner.dp.cost_model import CostModel
from hbp.planner.dp.modes import (
    FULL,
    NOT_RUN,
    PLAIN,
    REC,
    UNTIL_SAVE,
    ChildMode,
    PassExtent,
    RestSaves,
)
from hbp.planner.dp.profile import ChildArrays, ChildProfile
from hbp.planner.plan import Segment

__all__ = ["Choice", "Option", "Recursion", "planning", "simplify"]


class Option(NamedTuple):
    """One (mode, pass extent) of a level's first child [e, f), for the selected ends f."""

    mode: ChildMode
    extent: PassExtent
    rest: RestSaves | None  # the flag of the rest [f, d) (None at the top level)
    profile: ChildProfile
    arrays: ChildArrays  # the child's arrays at the level's end
    select: np.ndarray  # bool per candidate f: this option is open to it


class Choice(NamedTuple):
    """What a table chose at (e, H, flag): the first child [e, f) and the rest's state."""

    f: int
    mode: ChildMode
    extent: PassExtent
    H: frozenset  # the held set at f
    rest: RestSaves | None
    pinned: tuple[int, ...] = ()  # nodes a recomputed child pins (NOTE [ Pinned values ] in
    # hbp.analysis.simulate; `Solver._pin_rows`)
    pin_slots: int = 0  # slots of the pins the child's backward gets back (`PinCharge.PASS`)


class Recursion:
    """The options of a level's first child and the plan walk, over a cost model.

    Subclasses fill their tables from `options` and implement `_choose` (the choice that
    achieves a table's value) and `_nested_level` (whether a recomputed segment is re-tiled,
    and with which flag and budget)."""

    def __init__(self, model: CostModel, nested: bool = True, end: int | None = None):
        self.model = model
        self.nested = nested
        # the top level ends at `end` (a stage bound; n: the whole graph)
        self.end = model.n if end is None else int(end)

    def options(self, d, e, H, flag, top, only=None) -> list[Option]:
        """The options of the first child [e, f) of a level ending at d (the top level:
        `top`), in the order the tables break ties: plain before recomputed, then by pass
        extent. `only` = (f, mode): that child alone."""
        m = self.model
        out: list[Option] = []
        for mode in (PLAIN, REC):
            if only is not None and mode != only[1]:
                continue
            if mode == REC and only is None and not self.nested and not top:
                continue
            prof = ChildProfile.of(m, e, H, mode, top)
            p = prof.at(m.stop_of(e) if top else d)
            if len(p.f) == 0:
                continue
            sel = np.ones(len(p.f), dtype=bool)
            if only is not None:
                sel = p.f == only[0]
            if mode == REC and not top and H == m.crossing_in(e, d, False):
                # a recomputed child spanning the whole rest [e, d) with everything it reads
                # already held is the same plan without the extra nesting (and a cycle)
                sel &= p.f != d
            if top:
                out.append(Option(mode, FULL, None, prof, p, sel))
                continue
            hs = p.has_save
            if flag == RestSaves.YES:
                out.append(Option(mode, FULL, RestSaves.YES, prof, p, sel))
                out.append(Option(mode, UNTIL_SAVE, RestSaves.NO, prof, p, sel & hs))
            elif flag == RestSaves.NO:
                out.append(Option(mode, NOT_RUN, RestSaves.NO, prof, p, sel & ~hs))
            else:  # one-level segment: its children are a single plain child
                out.append(Option(mode, FULL, RestSaves.YES, prof, p, sel & hs))
                out.append(Option(mode, UNTIL_SAVE, RestSaves.NO, prof, p, sel & hs))
                out.append(Option(mode, NOT_RUN, RestSaves.NO, prof, p, sel & ~hs))
        return out

    @staticmethod
    def by_mode(options: list[Option]) -> list[list[Option]]:
        """`options` grouped by mode (they share the profile and its arrays)."""
        return [list(group) for _, group in groupby(options, key=lambda o: o.mode)]

    # -- rebuilding the plan -----------------------------------------------------------------
    def top_plan(self, budget: int = 0, start: int = 0, row: int = 0) -> list[Segment]:
        """The top-level segments from `start` (0 or a stage bound) to `self.end`; `budget`
        and `row`: the table entry to rebuild (Solver: slots and end requirement)."""
        return self._walk(start, self.end, frozenset(), None, True, budget, row, ())

    def rec_plan(self, e: int, f: int, budget: int = 0, taken: tuple = ()) -> list[Segment]:
        """Children of the recomputed segment [e, f) (none: it recomputes as plain
        autograd) given `budget` for its backward; `taken`: nodes its ancestors pin (a
        child's pin of one of them is dropped: a node is pinned once)."""
        level = self._nested_level(e, f, budget)
        if level is None:
            return []
        flag, budget = level
        H = self.model.crossing_in(e, f, False)
        return simplify(self._walk(e, f, H, flag, False, budget, 0, taken))

    def _walk(self, e, d, H, flag, top, budget, row, taken) -> list[Segment]:
        segments: list[Segment] = []
        while e < d:
            choice, kept = self._choose(d, e, H, flag, top, budget, row)
            pins = tuple(q for q in choice.pinned if q not in taken)
            seg = Segment(e, choice.f, choice.mode == REC, pinned=pins)
            if choice.mode == REC:
                back = choice.pin_slots
                seg.children = self.rec_plan(e, choice.f, budget - kept + back, taken + pins)
            segments.append(seg)
            budget -= kept
            e, H, flag = choice.f, choice.H, choice.rest
        return segments

    def _choose(self, d, e, H, flag, top, budget, row) -> tuple[Choice, int]:
        raise NotImplementedError

    def _nested_level(self, e, f, budget) -> tuple[RestSaves, int] | None:
        raise NotImplementedError


def simplify(segments: list[Segment]) -> list[Segment]:
    """Merge adjacent plain segments (same semantics) and drop children that are a single
    plain child (a recomputed segment without children recomputes as plain autograd)."""
    out: list[Segment] = []
    for s in segments:
        if s.recompute and len(s.children) == 1 and not s.children[0].recompute:
            s = Segment(s.start, s.stop, True, pinned=s.pinned)
        if out and not s.recompute and not out[-1].recompute:
            out[-1] = Segment(out[-1].start, s.stop, False)
        else:
            out.append(s)
    if len(out) == 1 and not out[0].recompute:
        return []
    return out


@contextlib.contextmanager
def planning(num_cuts: int):
    """Raise the recursion limit for the memoised recursion and pause the cyclic garbage
    collector: the DP allocates millions of small tuples and sets that live until it ends,
    and the collector's repeated scans of them cost 20-40% of the planning time. The entry
    points (`hbp.planner.plan`, `optimal_plan`, `min_feasible_peak`) run under it as a
    decorator: their cost models, stage tables and simulations allocate the same way.
    Nested uses are safe: the outermost restores both."""
    old = sys.getrecursionlimit()
    was_enabled = gc.isenabled()
    sys.setrecursionlimit(max(old, 20 * num_cuts + 1000))
    gc.disable()
    try:
        yield
    finally:
        sys.setrecursionlimit(old)
        if was_enabled:
            gc.enable()
