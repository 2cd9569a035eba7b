"""The least-recompute DP: tables over memory slots, filled right to left.

Nested tables: tail(d, e, H, flag) is the least recompute FLOPs of the children [e, d) of a
level ending at d, at every number of memory slots m, given the held set H at e and whether
they include a save event (`RestSaves`). The top table top(e, H) is the same for the top
level (one row per end requirement, see `hbp.planner.stages`). `rec(e, f)` = T(e, f): the
cost of recomputing [e, f) (its recompute pass plus its children) within the slots given.

Memory is discretised into slots (`slot_bytes`); needs are rounded up, so a plan the DP
accepts always fits. An option's value (`_option_rows`, top level `_top_rows`) is computed
by one function that both the table fill and the plan rebuild call.

A recomputed child, at any level, may also pin one node (NOTE [ Pin candidates ] in
`hbp.planner.dp.cost_model`): the rows of `_pin_rows`, beside the child's unpinned rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np

from hbp.planner.dp.cost_model import CostModel
from hbp.planner.dp.modes import FULL, INF, NOT_RUN, PLAIN, REC, UNTIL_SAVE, RestSaves
from hbp.planner.dp.profile import ChildArrays, ChildProfile
from hbp.planner.dp.recursion import Choice, Option, Recursion

__all__ = ["NESTED_PINS", "PIN_VALUES", "PinCharge", "SlotArrays", "Solver"]

#: Whether `Solver`s let recomputed children pin a node by default (`_pin_rows`).
#: The brute-force tests of the plan space without pins turn it off.
PIN_VALUES = True
#: Whether children of nested levels pin too (`_pin_rows`), beside top-level children, on
#: cost models of at most NESTED_PINS_MAX_CUTS candidate cuts (NOTE [ Pin candidates ]).
NESTED_PINS = True
NESTED_PINS_MAX_CUTS = 16


class PinCharge(str, Enum):
    """How the DP charges a pin (NOTE [ Pin candidates ] in hbp.planner.dp.cost_model).

    BACKWARD: kept from the child's forward through its whole backward (an upper bound: the
    plans fit by simulation). PASS: kept until the child's recompute pass, which it replaces
    q's value in (exact when the pass runs q; where the child's nested plan stops its pass
    before q, the pin is held longer and the plan may overshoot: `optimal_plan` then plans
    again with BACKWARD)."""

    BACKWARD = "backward"
    PASS = "pass"


class SlotArrays(NamedTuple):
    """A child's byte arrays at a level end (one entry per candidate end f) in memory slots."""

    key: tuple  # (slots, slot bytes, need offset) they were made for
    need: tuple  # need slots by PassExtent
    kept: np.ndarray  # kept slots
    fits: tuple  # need and kept within the slots, by PassExtent
    room: np.ndarray  # slots - kept (int)
    kept_slots: np.ndarray  # kept slots (int)
    low: tuple  # max(kept, need) by PassExtent, int lists: below it the child does not fit
    kept_list: list  # kept slots as an int list


class _TopRows(NamedTuple):
    """The values of a top-level option, one row per (end f, pin): `idx` the f indices,
    `states` the held sets at f, `cost` and `kept` (bytes kept across the forward) each
    (row, end requirement, m), `kept_slots` the child's kept slots, `pinned` its pins and
    `pin_slots` the slots of them its backward gets back (`PinCharge.PASS`)."""

    idx: np.ndarray
    states: list[frozenset]
    cost: np.ndarray
    kept: np.ndarray
    kept_slots: list[int]
    pinned: list[tuple[int, ...]]
    pin_slots: list[int]


class _PinRow(NamedTuple):
    """One pinned row of a recomputed child [e, f) (`_pin_rows`)."""

    i: int  # the f index
    sub: np.ndarray  # the rest's table
    H2: frozenset  # the held set at f
    pinned: tuple[int, ...]
    kept: int  # kept slots, the pin's included
    lo: int  # the least slots at which it can fit
    kept_bytes: float
    saved: float  # the FLOPs the pin saves in the child's pass
    back: int  # slots of the pin that the child's backward gets back (PinCharge.PASS)
    tail_low: int  # slots the child's tail needs beside the pin (PinCharge.PASS; else 0)


@dataclass
class _KnownRec:
    """The two tables T(e, f) can be (NOTE [ Known T(e, f) tables ]): `plain` from
    `lowest` = `least_plain` on, `nested` below it (None: not built yet)."""

    least_plain: int
    plain: np.ndarray | None
    nested: np.ndarray | None


class _Rows(NamedTuple):
    """The options' children that can be feasible: their indices, rest tables, next states."""

    slots: SlotArrays
    keep: list[int]
    rest: list[np.ndarray]
    states: list[frozenset]


class Solver(Recursion):
    """Memoised DP tables over a cost model (see the module docstring)."""

    def __init__(
        self,
        model: CostModel,
        slots: int,
        slot_bytes: float,
        nested: bool = True,
        *,
        end: int | None = None,
        need_offset: float = 0.0,
        pins: bool | None = None,
        pin_charge: PinCharge = PinCharge.BACKWARD,
        nested_pins: bool | None = None,
    ):
        super().__init__(model, nested, end)
        # recomputed children may pin a node (`_pin_rows`)
        self.pins = PIN_VALUES if pins is None else pins
        if nested_pins is None:
            nested_pins = NESTED_PINS and len(model.cuts) <= NESTED_PINS_MAX_CUTS
        self.nested_pins = self.pins and nested_pins
        self.pin_charge = PinCharge(pin_charge)
        self.n_slots = slots
        self.slot = slot_bytes
        # needs are counted in slots above `need_offset` bytes (a stage's own memory axis)
        self.offset = float(need_offset)
        # top tables have one row per end requirement: slots a stage must leave free at its
        # end (hbp.planner.stages); a whole-graph solve has one row, 0
        self.end_slots = np.zeros(1, dtype=np.int64)
        self.slot_index = np.arange(slots + 1)
        self._tail: dict = {}
        self._top: dict = {}
        self._top_kept: dict = {}  # (e, H) -> kept bytes of the top plan chosen at each m
        self._rec: dict = {}
        self._rec_plain: dict = {}
        self._rec_need: dict = {}
        self._rec_tail: dict = {}
        self._first_finite: dict = {}  # id(table) -> first slot with a finite value
        self._shifted: dict = {}  # id(T(e, f) table) -> it with the fork slots off
        self._rec_known: dict = {}  # (e, f, tail) -> _KnownRec

    def sl(self, x):
        """Bytes -> slots, rounded up (conservative)."""
        return np.ceil(np.asarray(x, dtype=float) / self.slot - 1e-9)

    # T(e, f) ---------------------------------------------------------------------------------
    def rec(self, e: int, f: int, lowest: int = 0, tail: bool = True) -> np.ndarray:
        """T(e, f) over slots (`_rec_table`), with the slots its pass's generator state copy
        takes (`CostModel.fork_bytes`) off."""
        key = (e, f, tail)
        known = self._rec_known.get(key)  # NOTE [ Known T(e, f) tables ]
        if known is not None:
            table = known.plain if lowest >= known.least_plain else known.nested
            if table is not None:
                return table
        fork = self._fork_slots(e, f)
        table = self._rec_table(e, f, max(lowest - fork, 0), tail)
        if fork:
            r = self._shifted.get(id(table))
            if r is None:
                r = np.full(self.n_slots + 1, INF)
                r[fork:] = table[: max(self.n_slots + 1 - fork, 0)]
                self._shifted[id(table)] = r
            table = r
        # NOTE [ Known T(e, f) tables ]: T(e, f) is one of two table objects, the plain
        # recompute's (where `lowest` covers its need) and the nested one's: remembered per
        # (e, f, tail), one lookup replaces the five calls that find them (each row of a
        # recomputed child asks for one; ~70k on a 184-node graph)
        need = self._rec_need[e, f]
        least_plain = fork + need if self.nested and need > 0 else 0
        if known is None:
            known = self._rec_known[key] = _KnownRec(least_plain, None, None)
        if lowest >= least_plain:
            known.plain = table
        else:
            known.nested = table
        return table

    def _fork_slots(self, e: int, f: int) -> int:
        if not self.model.info.rng_state_bytes:
            return 0
        fork = self.model.fork_bytes(e, f)
        return int(self.sl(fork)) if fork else 0

    def _rec_table(self, e: int, f: int, lowest: int = 0, tail: bool = True) -> np.ndarray:
        """T(e, f) over slots, exact at every m >= `lowest`; with `tail`, infeasible where its
        tail's backward does not fit (`CostModel.own_tail_until`; without, the parent level
        counts it).

        Recomputing [e, f) as one plain child costs the FLOPs up to its last save event, and
        no nested plan costs less (each node up to that event runs at least once), so where
        the plain recompute fits (m >= its need) T equals it; the nested tables are only
        built when a caller needs T below that."""
        plain = self._rec_plain.get((e, f))
        if plain is None:
            plain = self._rec_plain[e, f] = self._plain_recompute(e, f)
            finite = np.flatnonzero(plain < INF)
            self._rec_need[e, f] = int(finite[0]) if len(finite) else self.n_slots + 1
        if not self.nested or lowest >= self._rec_need[e, f]:
            return self._with_tail(e, f, plain, False) if tail else plain
        r = self._rec.get((e, f))
        if r is None:
            H = self.model.crossing_in(e, f, False)
            r = np.minimum(self.tail(f, e, H, RestSaves.YES), self.tail(f, e, H, RestSaves.NO))
            self._rec[e, f] = r = np.minimum(r, plain)
        return self._with_tail(e, f, r, True) if tail else r

    def _with_tail(self, e: int, f: int, table: np.ndarray, nested: bool) -> np.ndarray:
        """`table` made infinite below the slots of the tail's backward (memoised)."""
        key = (e, f, nested)
        r = self._rec_tail.get(key)
        if r is None:
            need = self.model.tail_need(e, f)
            r = table
            if need > -INF:
                low = int(self.sl(max(need - self.offset, 0.0)))
                if low > 0:
                    r = table.copy()
                    r[: min(low, self.n_slots + 1)] = INF
            self._rec_tail[key] = r
        return r

    def top_kept(self, e: int, H: frozenset) -> np.ndarray:
        """Bytes kept across the forward by the plan that top(e, H) chose at each m (one row
        per end requirement)."""
        self.top(e, H)
        return self._top_kept[e, H]

    def _plain_recompute(self, e: int, f: int) -> np.ndarray:
        """T(e, f) restricted to one plain child: the level [e, f) with the single child
        [e, f), which runs until its last save event (or not at all without one): its FLOPs
        wherever m covers its need and what it keeps, else infinite. (The general recursion
        over `options(f, e, H, None, False, only=(f, PLAIN))` gives the same table.)"""
        H = self.model.crossing_in(e, f, False)
        p = ChildProfile.of(self.model, e, H, PLAIN, False).at(f)
        slots = self._slot_arrays(p)
        i = len(p.f_list) - 1  # the child ending at f
        has_save = bool(p.has_save[i])
        extent = UNTIL_SAVE if has_save else NOT_RUN
        out = np.full(self.n_slots + 1, INF)
        if slots.fits[extent][i]:
            out[slots.low[extent][i] :] = p.flops[UNTIL_SAVE][i] if has_save else 0.0
        return out

    # the tables ------------------------------------------------------------------------------
    def tail(self, d: int, e: int, H: frozenset, flag: RestSaves) -> np.ndarray:
        key = (d, e, H, flag)
        r = self._tail.get(key)
        if r is None:
            if e == d:
                r = (
                    np.zeros(self.n_slots + 1)
                    if flag == RestSaves.NO
                    else np.full(self.n_slots + 1, INF)
                )
            else:
                r = self._fill(d, e, H, flag)
            self._tail[key] = r
        return r

    def top(self, e: int, H: frozenset) -> np.ndarray:
        key = (e, H)
        r = self._top.get(key)
        if r is None:
            mi = self.slot_index
            if e == self.model.n:
                need = self.sl(max(0.0, self.model.pos_after[self.model.n] - self.offset))
                need = np.maximum(need, self.end_slots)[:, None]
                r = np.where(mi[None, :] >= need, 0.0, INF)
                self._top_kept[key] = np.zeros_like(r)
            elif e == self.end:  # a stage ends here: the stages after it are planned apart
                r = np.where(mi[None, :] >= self.end_slots[:, None], 0.0, INF)
                self._top_kept[key] = np.zeros_like(r)
            else:
                r = self._fill_top(e, H)
            self._top[key] = r
        return r

    def _fill(self, d, e, H, flag) -> np.ndarray:
        """tail(d, e, H, flag): at every m, the least value of its options."""
        best = np.full(self.n_slots + 1, INF)
        if flag == RestSaves.NO and not self.model.save_free_tiling(e, d):
            return best
        for option in self.options(d, e, H, flag, False):
            for _, _, lo, value, _, _, _ in self._option_rows(d, e, option):
                low_best = best[lo:]
                np.minimum(low_best, value, out=low_best)
        return best

    def _option_rows(self, d, e, option: Option):
        """The value of `option` (a nested level's first child) for each of its ends f that
        can be feasible: yields (index of f, held set at f, lo, value, pins, kept slots,
        pin slots back) where value[m - lo] is its least recompute at m >= lo (infeasible
        below lo = max(kept, need)); a recomputed child also yields its pinned rows
        (`_pin_rows`).

        Value at m: pass FLOPs + T(e, f)[m - kept] (recomputed child) + the rest's value at
        m - kept. The one place a nested option's value is computed: the table fill and the
        plan rebuild both call it."""
        rows = self._feasible_rows(d, False, option)
        if not rows.keep:
            return
        M = self.n_slots
        p = option.arrays
        lows, kept_list = rows.slots.low[option.extent], rows.slots.kept_list
        flops = None
        if option.extent != NOT_RUN:
            if p.flops_lists is None:
                p.flops_lists = (p.flops[FULL].tolist(), p.flops[UNTIL_SAVE].tolist())
            flops = p.flops_lists[option.extent]
        own_tail = self.model.own_tail_until(d)
        for i, sub, H2 in zip(rows.keep, rows.rest, rows.states):
            kept = kept_list[i]
            lo = lows[i]  # max(kept, need): below it the option is infeasible
            value = sub[lo - kept : M + 1 - kept]
            if flops is not None:
                value = value + flops[i]
            if option.mode == REC:
                first = self._first_finite_slot(sub)
                lowest = max(lo, kept + first) - kept
                f = p.f_list[i]
                table = self.rec(e, f, lowest, f <= own_tail)
                value = value + table[lo - kept : M + 1 - kept]
            yield i, H2, lo, value, (), kept, 0
        if option.mode == REC and option.extent == FULL and self.nested_pins:
            for row in self._pin_rows(d, e, option, rows):
                value = row.sub[row.lo - row.kept : M + 1 - row.kept] + (flops[row.i] - row.saved)
                value = value + self._pinned_rec(e, p.f_list[row.i], row)
                yield row.i, row.H2, row.lo, value, row.pinned, row.kept, row.back

    def _first_finite_slot(self, row: np.ndarray, table: np.ndarray | None = None) -> int:
        """The first slot at which `row` is finite, memoised by the identity of the memoised
        table it is (or, `table`, the first row of): tables live as long as the solver, so
        their identities are not reused while it runs. Never a temporary view's."""
        key = id(row if table is None else table)
        first = self._first_finite.get(key)
        if first is None:
            first = self._first_finite[key] = int(np.argmax(row < INF))
        return first

    def _pinned_rec(self, e: int, f: int, row: _PinRow) -> np.ndarray:
        """T(e, f) at m - kept for m in [row.lo, M] for a pinned row: with the pin's slots
        given back to it (`back`) and its tail's need checked beside the pin (`tail_low`)."""
        M = self.n_slots
        first = int(np.argmax(row.sub < INF))  # (a row view at the top level: not memoised)
        k = row.kept - row.back
        lowest = max(row.lo, row.kept + first) - k
        table = self.rec(e, f, lowest, tail=not row.back)[row.lo - k : M + 1 - k]
        if row.tail_low > row.lo:
            table = table.copy()
            table[: row.tail_low - row.lo] = INF
        return table

    def _fill_top(self, e: int, H: frozenset) -> np.ndarray:
        """top(e, H), one row per end requirement: the least recompute at every m and, among
        the plans that reach it, the least bytes kept (`_top_kept`: what a stage hands the
        stages after it)."""
        shape = (len(self.end_slots), self.n_slots + 1)
        best, best_kept = np.full(shape, INF), np.zeros(shape)
        for option in self.options(self.model.n, e, H, None, True):
            rows = self._top_rows(e, option)
            if rows is None:
                continue
            cost, kept = rows.cost, rows.kept
            c_min = cost.min(axis=0)
            k_min = np.where(cost == c_min, kept, INF).min(axis=0)
            better = (c_min < best) | ((c_min == best) & (k_min < best_kept))
            best = np.where(better, c_min, best)
            best_kept = np.where(better, k_min, best_kept)
        self._top_kept[e, H] = best_kept
        return best

    def _top_rows(self, e, option: Option) -> _TopRows | None:
        """The values of a top-level option (`_TopRows`), or None. The one place the top
        level's option values are computed (table fill and plan rebuild).

        Value at m: T(e, f)[m - kept] (recomputed child) + the rest's value at m - kept, if
        m >= the child's own need and m >= kept; else infinite. A pinned row (`_pin_rows`)
        keeps the pin's bytes too (in its kept bytes and its forward need) and runs the pin's
        FLOPs once fewer in T(e, f)'s pass."""
        M = self.n_slots
        rows = self._feasible_rows(self.model.n, True, option)
        if not rows.keep:
            return None
        p = option.arrays
        lows, kept_list = rows.slots.low[option.extent], rows.slots.kept_list
        items = [
            _PinRow(i, sub, H2, (), kept_list[i], lows[i], p.kept[i], 0.0, 0, 0)
            for i, sub, H2 in zip(rows.keep, rows.rest, rows.states)
        ]
        if option.mode == REC and self.pins:
            items += self._pin_rows(None, e, option, rows)
        shape = (len(items), len(self.end_slots), M + 1)
        cost, kept = np.full(shape, INF), np.zeros(shape)
        for j, row in enumerate(items):
            i, sub, H2, k, lo = row.i, row.sub, row.H2, row.kept, row.lo
            # below max(kept, need) the child does not fit
            cost[j, :, lo:] = sub[:, lo - k : M + 1 - k]
            if option.mode == REC and row.pinned:
                cost[j, :, lo:] += self._pinned_rec(e, p.f_list[i], row._replace(sub=sub[0]))
                cost[j, :, lo:] -= row.saved
            elif option.mode == REC:  # asked from the smallest m at which the rest is feasible
                first = self._first_finite_slot(sub[0], sub)
                rec = self.rec(e, p.f_list[i], max(lo, k + first) - k)
                cost[j, :, lo:] += rec[lo - k : M + 1 - k]
            kept[j, :, lo:] = self._top_kept[p.f_list[i], H2][:, lo - k : M + 1 - k]
            kept[j, :, lo:] += row.kept_bytes
        idx = np.array([row.i for row in items])
        return _TopRows(
            idx,
            [row.H2 for row in items],
            cost,
            kept,
            [row.kept for row in items],
            [row.pinned for row in items],
            [row.back for row in items],
        )

    def _pin_rows(self, d, e, option: Option, rows: _Rows) -> list[_PinRow]:
        """The pinned rows of a recomputed child [e, f) (NOTE [ Pin candidates ]): at the top
        level, and in a nested level whose pass runs the child whole (`FULL`: the pin is
        stored in that pass). Per pin candidate q, the pin is kept and charged in the child's
        whole forward and kept across the rest of the level; then through the child's
        backward (`PinCharge.BACKWARD`, an upper bound of NOTE [ Pinned values ] in
        hbp.analysis.simulate: the DP's plans fit by simulation) or until its pass
        (`PinCharge.PASS`: its tail's backward sees it). A pin whose value the rest of the
        level reads is held by the child for the rest (its group joins the held set at f), not
        counted twice. `d`: the level's end (None: the top level)."""
        M, model, p = self.n_slots, self.model, option.arrays
        need = p.need[option.extent]
        passing = self.pin_charge == PinCharge.PASS
        out = []
        top = d is None
        for i, sub0, H0 in zip(rows.keep, rows.rest, rows.states):
            f = p.f_list[i]
            candidates = model.pin_candidates(e, f)
            if not candidates:
                continue
            crossing = model.crossing_in(f, model.stop_of(e) if top else d, top)
            k0 = rows.slots.kept_list[i]
            tail = model.tail_need(e, f) if passing else -INF
            for q in candidates:
                sub, H2 = sub0, H0
                g = int(model.node_group[q])
                if g in crossing and g not in H2:  # the rest reads it: the pin holds it
                    H2 = H2 | {g}
                    sub = self.top(f, H2) if top else self.tail(d, f, H2, option.rest)
                pin = int(model.pin_bytes[q])
                kept_bytes = p.kept[i] + pin
                k = int(self.sl(kept_bytes))
                lo = max(k, int(self.sl(max(need[i] + pin - self.offset, 0.0))))
                if lo > M or sub.item(M - k) == INF:
                    continue
                back = k - k0 if passing else 0
                tail_low = 0
                if passing and tail > -INF:
                    tail_low = k + int(self.sl(max(tail - self.offset, 0.0)))
                    if tail_low > M:
                        continue
                saved = float(model.pin_flops[q])
                out.append(_PinRow(i, sub, H2, (q,), k, lo, kept_bytes, saved, back, tail_low))
        return out

    def _feasible_rows(self, d, top, option: Option) -> _Rows:
        """The selected ends f whose rest can be feasible, with the rest's tables."""
        p = option.arrays
        slots = self._slot_arrays(p)
        ok = option.select & slots.fits[option.extent]  # need and kept fit in M slots
        if option.rest == RestSaves.NO:  # the rest must be a tail without save events
            if p.save_free is None:
                p.save_free = self.model.save_free_mask(d)[p.f]
            ok &= p.save_free
        idx = np.flatnonzero(ok)
        rows, keep, states = [], [], []
        f_list, H_list = p.f_list, option.profile.held_list(p.d)
        limit = slots.room[idx].tolist()
        if top:
            memo, table = self._top, self.top
            for i, lim in zip(idx.tolist(), limit):
                f, H2 = f_list[i], H_list[i]
                sub = memo.get((f, H2))
                if sub is None:
                    sub = table(f, H2)
                if sub.item(lim) < INF:  # tables are non-increasing in m
                    rows.append(sub)
                    keep.append(i)
                    states.append(H2)
        else:
            memo, table, flag = self._tail, self.tail, option.rest
            for i, lim in zip(idx.tolist(), limit):
                f, H2 = f_list[i], H_list[i]
                sub = memo.get((d, f, H2, flag))
                if sub is None:
                    sub = table(d, f, H2, flag)
                if sub.item(lim) < INF:  # tables are non-increasing in m
                    rows.append(sub)
                    keep.append(i)
                    states.append(H2)
        return _Rows(slots, keep, rows, states)

    def _slot_arrays(self, p: ChildArrays) -> SlotArrays:
        """A child's byte arrays in slots (needs above `self.offset`, rounded up; cached)."""
        M = self.n_slots
        key = (M, self.slot, self.offset)
        if p.slots is not None and p.slots.key == key:
            return p.slots
        # the three needs (by PassExtent) as one array: a few numpy calls per child, not 20
        need = np.ceil(np.maximum(np.stack(p.need) - self.offset, 0.0) / self.slot - 1e-9)
        kept = self.sl(p.kept)
        kept_int = kept.astype(np.int64)
        fits = (need <= M) & (kept <= M)
        p.slots = SlotArrays(
            key=key,
            need=tuple(need),
            kept=kept,
            fits=tuple(fits),
            room=M - kept_int,
            kept_slots=kept_int,
            low=tuple(np.maximum(kept_int, need).astype(np.int64).tolist()),
            kept_list=kept_int.tolist(),
        )
        return p.slots

    # rebuilding the plan ---------------------------------------------------------------------
    def _choose(self, d, e, H, flag, top, slots, row) -> tuple[Choice, int]:
        """The option that achieves the table's value at `slots` (top level: with the table's
        kept bytes, at end requirement `row`), and its kept slots."""
        if top:
            return self._choose_top(e, H, slots, row)
        target = self.tail(d, e, H, flag)[slots]
        for option in self.options(d, e, H, flag, False):
            best_value, best = INF, None
            for i, H2, lo, value, pins, kept, back in self._option_rows(d, e, option):
                v = value[slots - lo] if slots >= lo else INF
                if v < best_value or best is None:
                    best_value, best = v, (i, H2, pins, kept, back)
            if best is not None and best_value <= target + 1e-9 * max(1.0, abs(target)):
                i, H2, pins, kept, back = best
                p = option.arrays
                f = int(p.f[i])
                choice = Choice(f, option.mode, option.extent, H2, option.rest, pins, back)
                return choice, kept
        raise RuntimeError("DP reconstruction failed")  # pragma: no cover

    def _choose_top(self, e, H, slots, row) -> tuple[Choice, int]:
        target = self.top(e, H)[row, slots]
        target_kept = self._top_kept[e, H][row, slots]
        for option in self.options(self.model.n, e, H, None, True):
            rows = self._top_rows(e, option)
            if rows is None:
                continue
            cost, kept = rows.cost, rows.kept
            fits = (cost[:, row, slots] <= target + 1e-9 * max(1.0, abs(target))) & (
                kept[:, row, slots] <= target_kept
            )
            for k in np.flatnonzero(fits).tolist():
                p, i = option.arrays, rows.idx[k]
                f, pins, back = int(p.f[i]), rows.pinned[k], rows.pin_slots[k]
                choice = Choice(
                    f, option.mode, option.extent, rows.states[k], option.rest, pins, back
                )
                return choice, int(rows.kept_slots[k])
        raise RuntimeError("DP reconstruction failed")  # pragma: no cover

    def _nested_level(self, e, f, slots) -> tuple[RestSaves, int] | None:
        slots -= self._fork_slots(e, f)
        self._rec_table(e, f, slots)
        if not self.nested or slots >= self._rec_need[e, f]:
            return None  # recomputed as plain autograd
        H = self.model.crossing_in(e, f, False)
        with_save = self.tail(f, e, H, RestSaves.YES)[slots]
        without = self.tail(f, e, H, RestSaves.NO)[slots]
        return (RestSaves.YES if with_save <= without else RestSaves.NO), slots
