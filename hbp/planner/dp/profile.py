"""One child's needs: the bytes a child X = [e, f) of a level adds at its own events, and
what it keeps, for every candidate end f (the `local` term of `hbp.planner.dp.cost_model`)."""

from __future__ import annotations

import weakref
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import numpy as np

from hbp.planner.dp.cost_model import CostModel
from hbp.planner.dp.modes import INF, PLAIN, REC, ChildMode

__all__ = ["ChildArrays", "ChildProfile"]


@dataclass(eq=False)
class ChildArrays:
    """A child [e, f) in a level ending at d, one entry per candidate end f in (e, d].

    Attributes:
        d: the level's end.
        f_list / f: the candidate ends (list and array).
        kept: bytes it holds from its forward until its backward.
        need: bytes its events need above what the children before it keep, by
            `PassExtent` of the level's recompute pass (FULL, UNTIL_SAVE, NOT_RUN).
        flops: FLOPs of the level's pass over it, by `PassExtent` (FULL, UNTIL_SAVE).
        has_save: it has a save event (where a pass may stop).
        slots, save_free, flops_lists, peak_lists: the solvers' caches.
    """

    d: int
    f_list: list[int]
    f: np.ndarray
    kept: np.ndarray
    need: tuple[np.ndarray, np.ndarray, np.ndarray]
    flops: tuple[np.ndarray, np.ndarray]
    has_save: np.ndarray
    slots: Any = None
    save_free: np.ndarray | None = None
    flops_lists: tuple | None = None
    peak_lists: Any = None


#: The most child profiles (starts x held sets) one cost model's DP may make before it gives up
#: on its cut set (NOTE [ Cuts that many values cross ] in hbp.planner.dp.held_sets).
MAX_PROFILES = 16384


class TooManyHeldSets(Exception):
    """The DP over a cut set met more held sets than `MAX_PROFILES` profiles: its cuts are
    crossed by many values whose holding each child decides (NOTE [ Cuts that many values
    cross ] in hbp.planner.dp.held_sets)."""


class ChildProfile:
    """Needs of a child X = [e, f) with a given mode, state H and level kind, for every f.

    Arrays are indexed by position t in [e, n) (offset e); `at(d)` specialises them to a
    level ending at d and samples them at the candidate cuts f in (e, d].
    """

    @classmethod
    def of(
        cls, m: CostModel, e: int, H: frozenset[int], mode: ChildMode, top: bool
    ) -> ChildProfile:
        """The needs of a child starting at e with held set H, memoised in `m.profiles`."""
        key = (e, H, mode, top)
        p = m.profiles.get(key)
        if p is None:
            if len(m.profiles) >= MAX_PROFILES:
                raise TooManyHeldSets(f"{len(m.profiles)} child profiles over {len(m.cuts)} cuts")
            p = m.profiles[key] = cls(m, e, H, mode, top)
        return p

    def __init__(self, m: CostModel, e: int, H: frozenset[int], mode: ChildMode, top: bool):
        # NOTE [ Profiles do not own their cost model ]: the cost model caches its profiles;
        # a strong reference back would make every cost model, with the ~100k tuples, lists
        # and arrays of its caches, cyclic garbage that only the collector frees (a
        # collection of it is a sizeable part of a plan call). A proxy lets reference counting
        # free it when the solver is done.
        self.model = weakref.proxy(m)
        self.e, self.H, self.mode, self.top = e, H, mode, top
        n = m.n
        info = m.info
        stop = self.stop = m.stop_of(e)  # arrays cover positions [e, stop)
        t = np.arange(e, stop)
        cross = [g for g in m.crossing[e] if not (top and m.g_forced[g])]
        self.local_cross = [g for g in cross if g not in H]
        # forward: live local bytes at the event of node t, over the whole graph scope
        rp, ep = m.root_pre[top], m.end_pre[top, mode]
        live = (rp[t + 1] - rp[e]) - (ep[t] - ep[e])
        for g in cross:  # groups made before e whose finite end lies in [e, t)
            end = m.g_lu[g]
            if (mode == REC or m.g_hmin[g] >= n) and end < n:
                live[end - e + 1 :] += m.g_size[g]
        self.first_hold = {}
        self.first_read = {}
        for g in self.local_cross:
            self.first_hold[g] = m.first_at_or_after(m.g_hold[g], e)
            self.first_read[g] = m.first_at_or_after(m.g_read[g], e)
            held = self.first_hold[g] < n if mode == PLAIN else True
            end = n if held else m.g_lu[g]
            live[: end - e + 1] += m.g_size[g]
        if mode == PLAIN:
            live += m.extra_pre[t + 1] - m.extra_pre[e]
        else:  # run with saving off: extras are made and dropped within the node's event
            live += info.extra_bytes[e:stop]
        if top:
            live += m.out_pre[t + 1]
        live += info.forward_scratch_bytes[e:stop]
        self.live = live.astype(float)
        self.live[~m.node_event[e:stop]] = -INF
        # kept bytes after [e, f) for f in (e, n]: index f - e - 1
        if mode == PLAIN:
            hp = m.hold_pre[top]
            held = (hp[t + 1] - hp[e]) + (m.extra_pre[t + 1] - m.extra_pre[e])
            for g in cross:  # made before e, first held at or after e: not new
                h = m.g_hmin[g]
                if e <= h < n:
                    held[h - e :] -= m.g_size[g]
            for g in self.local_cross:
                h = self.first_hold[g]
                if h < n:
                    held[h - e :] += m.g_size[g]
            self.kept = held
            bwd = (held + m.pos_bwd[e:stop]).astype(float)
            late = m.pos_late[e:stop]
            if np.isfinite(late).any():  # after node t's releases, the holds before t's
                before = np.concatenate(([0], held[:-1]))
                bwd = np.maximum(bwd, before + late)
            bwd[~info.has_backward[e:stop]] = -INF
            self.bwd_max = np.maximum.accumulate(bwd) if len(bwd) else bwd
        else:
            kept = np.zeros(stop - e, dtype=np.int64)
            for g in self.local_cross:
                r = self.first_read[g]
                if r < n:
                    kept[r - e :] += m.g_size[g]
            self.kept = kept
            self.first_input_reader = m.first_reader_from_before(e)
        self._at: dict[int, ChildArrays] = {}
        self._held: dict = {}
        self._held_lists: dict = {}
        self._held_full: dict = {}
        self._held_fulls: list | None = None
        self._first_cut = 0

    def at(self, d: int) -> ChildArrays:
        """The child's arrays in a level ending at d, one entry per candidate f in (e, d]."""
        r = self._at.get(d)
        if r is not None:
            return r
        m, e, mode, top = self.model, self.e, self.mode, self.top
        shared = m.interval(e, d, mode)
        idx = shared.idx
        live = self.live[: d - e].copy()
        if not top:  # groups that the level does not use after their last touch before d
            for g in m.crossing[d]:
                rg = m.g_root[g]
                if rg >= e:
                    held = m.g_hmin[g] < d if mode == PLAIN else False
                    start = rg
                elif g in self.first_hold:  # a local crossing group at e
                    start = e
                    if mode == PLAIN:
                        held = self.first_hold[g] < d
                    else:
                        held = self.first_read[g] < d
                else:
                    continue
                if not held:
                    lo = max(m.lu_in(g, d), start - 1) + 1
                    live[lo - e :] -= m.g_size[g]
        fwd_max = np.maximum.accumulate(live) if len(live) else live
        kept = self.kept[idx].astype(np.int64)
        if mode == REC:
            kept = kept + shared.state_kept
        pos_pass = 0 if top else m.pass_pos(d)
        full = fwd_max[idx] + pos_pass
        if mode == PLAIN:
            if top:
                bwd = self.bwd_max[idx]
            else:  # nodes after the level's last save event are the level's tail
                last = int(m.last_save[d]) - e
                bwd = self.bwd_max[np.minimum(idx, max(last, 0))] if last >= 0 else idx * 0 - INF
            last = shared.until_run
            ls_need = np.where(last >= 0, fwd_max[np.maximum(last, 0)] + pos_pass, -INF)
            need = (
                np.maximum(np.maximum(full, bwd), 0),
                np.maximum(np.maximum(ls_need, bwd), 0),
                np.maximum(bwd, 0),
            )
        else:
            need = (np.maximum(full + shared.state, 0), shared.zeros, shared.zeros)
        out = ChildArrays(
            d,
            shared.f_list,
            shared.f,
            kept,
            need,
            (shared.flops_full, shared.flops_until),
            shared.has_save,
        )
        self._at[d] = out
        return out

    def held_list(self, d: int) -> list[frozenset[int]]:
        """held_after(f, d) for every candidate f in (e, d], in order."""
        r = self._held_lists.get(d)
        if r is None:
            m = self.model
            if self._held_fulls is None:  # _held_at(f) for every cut f > e
                first = bisect_right(m.cuts, self.e)
                self._first_cut = first
                self._held_fulls = [
                    self._held_full[f] if f in self._held_full else self._held_at(f)
                    for f in m.cuts[first : bisect_right(m.cuts, self.stop)]
                ]
            first, last = self._first_cut, bisect_right(m.cuts, d)
            if self.top:  # crossing_in(f, n, top) holds every group _held_at(f) can hold
                r = self._held_lists[d] = self._held_fulls[: last - first]
                return r
            crossing = m.crossing_window(d, first, last)
            meet = m.meet
            r = [meet(a, b) if a else a for a, b in zip(self._held_fulls[: last - first], crossing)]
            self._held_lists[d] = r
        return r

    def held_after(self, f: int, d: int) -> frozenset[int]:
        """H at f after this child [e, f), in a level ending at d (memoised)."""
        key = (f, d)
        r = self._held.get(key)
        if r is None:
            held = self._held_full.get(f)
            if held is None:
                held = self._held_at(f)
            r = self._held[key] = held & self.model.crossing_in(f, d, self.top) if held else held
        return r

    def _held_at(self, f: int) -> frozenset[int]:
        """Groups crossing f (outputs excluded at the top) that are held after [e, f),
        whatever the level's end: held_after(f, d) is this set within crossing_in(f, d)."""
        m, e = self.model, self.e
        held = []
        for g in m.crossing[f]:
            if self.top and m.g_forced[g]:
                continue
            if g in self.H:
                held.append(g)
            elif m.g_root[g] < e:
                if g in self.first_hold:
                    first = self.first_hold[g] if self.mode == PLAIN else self.first_read[g]
                    if first < f:
                        held.append(g)
                # else: made before the level and not held: impossible for a real state
            elif self.mode == PLAIN and m.g_hmin[g] < f:
                held.append(g)
        r = self._held_full[f] = frozenset(held)
        return r
