"""The least-peak DP: the same recursion as `Solver`, minimising the peak in exact bytes,
recompute FLOPs as the tie-break. It gives the smallest peak reachable over the candidate
cuts (BudgetError's minimum) and a plan reaching it."""

from __future__ import annotations

from typing import NamedTuple

from hbp.planner.dp.cost_model import CostModel
from hbp.planner.dp.modes import FULL, INF, NOT_RUN, PLAIN, REC, UNTIL_SAVE, RestSaves
from hbp.planner.dp.profile import ChildArrays, ChildProfile
from hbp.planner.dp.recursion import Choice, Recursion

__all__ = ["PeakSolver", "PeakValue"]


class PeakValue(NamedTuple):
    """A table entry: the least peak above the level's kept bytes, its recompute FLOPs, the
    choice reaching it and (T(e, f) only) the flag of the level inside."""

    peak: float
    cost: float
    choice: Choice | None
    rest: RestSaves | None = None


class _PeakLists(NamedTuple):
    """A child's arrays as Python lists (floats), for the scalar loop."""

    kept: list
    need: tuple  # by PassExtent
    flops: tuple  # by PassExtent FULL, UNTIL_SAVE
    has_save: list  # bools


class PeakSolver(Recursion):
    """Memoised least-peak tables: top(e, H), tail(d, e, H, flag) and rec(e, f) = T(e, f),
    as `Solver`'s, with values `PeakValue`."""

    def __init__(self, model: CostModel, nested: bool = True):
        super().__init__(model, nested)
        self._memo: dict = {}

    def rec(self, e: int, f: int) -> PeakValue:
        key = ("rec", e, f)
        if key not in self._memo:
            H = self.model.crossing_in(e, f, False)
            if self.nested:
                a = self.tail(f, e, H, RestSaves.YES)
                b = self.tail(f, e, H, RestSaves.NO)
                best, rest = (a, RestSaves.YES) if _order(a) <= _order(b) else (b, RestSaves.NO)
                value = best._replace(rest=rest)
            else:
                value = self._fill(f, e, H, None, False, only=(f, PLAIN))
            fork = self.model.fork_bytes(e, f)
            self._memo[key] = value._replace(peak=value.peak + fork) if fork else value
        return self._memo[key]

    def tail(self, d, e, H, flag) -> PeakValue:
        key = (d, e, H, flag)
        if key not in self._memo:
            if e == d:
                self._memo[key] = PeakValue(0.0, 0.0, None) if flag == RestSaves.NO else _INFEASIBLE
            else:
                self._memo[key] = self._fill(d, e, H, flag, False)
        return self._memo[key]

    def top(self, e, H) -> PeakValue:
        key = ("top", e, H)
        if key not in self._memo:
            if e == self.model.n:
                self._memo[key] = PeakValue(float(self.model.pos_after[self.model.n]), 0.0, None)
            else:
                self._memo[key] = self._fill(self.model.n, e, H, None, True)
        return self._memo[key]

    def _fill(self, d, e, H, flag, top, only=None) -> PeakValue:
        """The least (peak, recompute) over the options, ends f in order within each mode
        (NOTE [ The least-peak fill walks the options itself ]); `only` = (f, mode): that
        child alone, as `Recursion.options` has it."""
        m = self.model
        memo = self._memo
        best_peak, best_cost, best_choice = INF, INF, None
        own_tail = m.own_tail_until(None if top else d)
        variants = _TOP if top else _VARIANTS[flag]
        for mode in (PLAIN, REC) if only is None else (only[1],):
            if mode == REC and only is None and not self.nested and not top:
                continue
            prof = ChildProfile.of(m, e, H, mode, top)
            p = prof.at(m.stop_of(e) if top else d)
            f_list = p.f_list
            if not f_list:
                continue
            lists = p.peak_lists
            if lists is None:
                lists = p.peak_lists = _peak_lists(p)
            kept_list, needs, flops, has_save = lists
            H_list = prof.held_list(p.d)
            # a recomputed child spanning the whole rest [e, d) with everything it reads held
            # is the same plan without the extra nesting (and a cycle): `Recursion.options`
            skip = (
                len(f_list) - 1
                if mode == REC and not top and f_list[-1] == d and H == m.crossing_in(e, d, False)
                else -1
            )
            ends = range(len(f_list)) if only is None else _index_of(f_list, only[0])
            for i in ends:
                if i == skip:
                    continue
                f = f_list[i]
                kept = kept_list[i]
                H2 = H_list[i]
                saves = has_save[i]
                rec_peak = None  # a recomputed child's: kept + T(e, f)'s peak (and its tail's)
                for extent, flag2, needs_save in variants:
                    if needs_save is not None and saves != needs_save:
                        continue
                    need = needs[extent][i]
                    if top:
                        sub = memo.get(("top", f, H2))
                        if sub is None:
                            sub = self.top(f, H2)
                    else:
                        sub = memo.get((d, f, H2, flag2))
                        if sub is None:
                            sub = self.tail(d, f, H2, flag2)
                    x = kept + sub.peak
                    peak = x if x > need else need  # max(need, x)
                    cost = sub.cost
                    if not top and extent != NOT_RUN:
                        cost += flops[extent][i]
                    if mode == REC:  # T(e, f) is the same for every option of this f
                        if rec_peak is None:
                            r = memo.get(("rec", e, f))
                            if r is None:
                                r = self.rec(e, f)
                            rec_peak, rec_cost = kept + r.peak, r.cost
                            if f <= own_tail:  # it counts its tail itself
                                x = kept + m.tail_need(e, f)
                                if x > rec_peak:
                                    rec_peak = x
                        if rec_peak > peak:
                            peak = rec_peak
                        cost += rec_cost
                    if peak < best_peak or (peak == best_peak and cost < best_cost):
                        best_peak, best_cost = peak, cost
                        best_choice = Choice(f, mode, extent, H2, flag2)
        return PeakValue(best_peak, best_cost, best_choice)

    def floor(self) -> int:
        """The largest least peak of recomputing one interval between adjacent cuts alone: a
        lower bound of `top(0, {})` (NOTE [ A floor under the least peak ] in
        hbp.planner.dp.least_peak)."""
        cuts = self.model.cuts
        return max((int(self.rec(e, f).peak) for e, f in zip(cuts[:-1], cuts[1:])), default=0)

    def chain_peak(self) -> float | None:
        """The modelled peak of one plan: every interval between adjacent cuts a recomputed
        top-level child, each with its least-peak T(e, f) inside; the value `top(0, {})`
        gives that option path, by `_fill`'s arithmetic (NOTE [ A plan at the floor ] in
        hbp.planner.dp.least_peak). None where an interval is no candidate end."""
        m = self.model
        states, e, H = [], 0, frozenset()
        while e < m.n:
            prof = ChildProfile.of(m, e, H, REC, True)
            p = prof.at(m.stop_of(e))
            if not p.f_list:
                return None
            i = 0  # the nearest candidate end: the next cut
            f = p.f_list[i]
            if p.peak_lists is None:
                p.peak_lists = _peak_lists(p)
            kept, need, _, _ = p.peak_lists
            states.append((e, f, kept[i], need[FULL][i]))
            e, H = f, prof.held_list(p.d)[i]
        peak = float(m.pos_after[m.n])  # top(n, H)
        for e, f, kept, need in reversed(states):
            rest = kept + peak
            own = kept + self.rec(e, f).peak
            if f <= m.own_tail_until(None):  # it counts its tail itself
                own = max(own, kept + m.tail_need(e, f))
            peak = max(need, rest, own)
        return peak

    # rebuilding the plan ---------------------------------------------------------------------
    def _choose(self, d, e, H, flag, top, budget, row) -> tuple[Choice, int]:
        value = self.top(e, H) if top else self.tail(d, e, H, flag)
        return value.choice, 0

    def _nested_level(self, e, f, budget) -> tuple[RestSaves, int] | None:
        if not self.nested:
            return None
        return self.rec(e, f).rest, 0


_INFEASIBLE = PeakValue(INF, INF, None)


def _peak_lists(p: ChildArrays) -> _PeakLists:
    needs = tuple(x.astype(float).tolist() for x in p.need)
    flops = (p.flops[FULL].astype(float).tolist(), p.flops[UNTIL_SAVE].astype(float).tolist())
    return _PeakLists(p.kept.astype(float).tolist(), needs, flops, p.has_save.tolist())


# (pass extent, the rest's flag, whether the child must have a save event (None: either)) per
# option of a level's first child, in `Recursion.options`' order: at the top level, and by the
# level's flag (None: a one-level segment)
_TOP = ((FULL, None, None),)
_VARIANTS = {
    RestSaves.YES: ((FULL, RestSaves.YES, None), (UNTIL_SAVE, RestSaves.NO, True)),
    RestSaves.NO: ((NOT_RUN, RestSaves.NO, False),),
    None: (
        (FULL, RestSaves.YES, True),
        (UNTIL_SAVE, RestSaves.NO, True),
        (NOT_RUN, RestSaves.NO, False),
    ),
}

# NOTE [ The least-peak fill walks the options itself ]
# `Recursion.options` builds, per fill, an Option per (mode, extent) with a numpy mask of the
# ends it is open to; the least-peak tables fill each state once with a scalar loop, where
# those objects and masks were a quarter of the time. `_fill` walks the same options in the
# same order (plain before recomputed, ends in order, extents as `options` lists them: ties
# go the same way) from each child's cached lists (`_PeakLists`, with `has_save`), a fill
# restricted to one child (`only`) included.


def _index_of(f_list: list, f: int) -> list[int]:
    """[the index of end `f` in `f_list`], or [] where it is not a candidate end."""
    return [f_list.index(f)] if f in f_list else []


def _order(v: PeakValue) -> tuple[float, float]:
    return (v.peak, v.cost)
