"""The optimal planner: a dynamic programme over cut points, nested (a tree of intervals).

Problem. Given a graph and a budget, find the plan (a tiling of the topological order into
plain and recomputed segments, recomputed segments again tiled by children, recursively)
with the least recompute FLOPs whose simulated peak (`hbp.analysis.simulate`) fits. Cuts
are restricted to a candidate set (`candidate_cuts`); over that set the DP is exact for the
simulator's memory accounting, which decomposes over segments as follows (proved by the
brute-force tests in tests/test_planner.py).

Decomposition. Work on storage groups (a storage root and its aliases). Within a *level*
(the top-level tiling, or the children of a recomputed segment [c, d) during its recompute)
every event's live bytes are

    outer + K(e) + local(X, H, event) + pos(event)

where X = [e, f) is the child the event belongs to, K(e) the bytes the children before e
hold until their backward (groups a plain child's node saves, extras, groups a recomputed
child reads from before it), H the crossing groups at e (made before e, used at or after e
within the level) that are already held, `local` what X's own events add (computable from
e, f, H, the mode of X and the level's end d alone), `pos` the plan-independent part
(activation and parameter gradients, and the graph outputs the caller holds, which live for
the whole step), and `outer` what the enclosing levels hold (constant during the level). A
recomputed child's backward is a level of its own whose memory needs depend only on its
interval and the memory left, so it is a table T(e, f, m) shared by every parent. Early stop
(the recompute pass ends at its last save event) is handled with a flag: whether the rest of
the level has a save event. Torch starts a pass at the backward of that event (NOTE [
Recompute at the first unpack ] in `hbp.analysis.simulate`): the pass's events see the
positional bytes after the nodes that follow it (`CostModel.pass_pos`); those nodes (the
level's tail) have their backward before the pass, so they are charged not within the level
but with T's own base: in T(e, f) when a save event follows [e, f) in its parent level (or at
the top level), else in the parent's tail (`Solver.rec_tail`, `CostModel.tail_need`).

The DP runs right to left over (cut, H, flag) with memory discretised into slots of the
budget (exact when every byte count is a multiple of the slot: the slot is the gcd of the
graph's byte counts when that gives at most max(mem_slots, 1024) slots; otherwise
`mem_slots` equal slots with conservative rounding: a plan the DP accepts always fits).
Candidate cuts are limited (`candidate_cuts`) so that planning stays at a few seconds. A separate min-max DP without
discretisation gives the smallest peak reachable with the candidate cuts (BudgetError's
minimum) and a fallback plan when rounding rejects a budget that is in fact feasible.

Stages. `CostModel(info, cuts, bounds)` confines every level to one stage between two bounds,
and `Solver(..., end=b, need_offset=...)` runs the top level of one stage [a, b) on the
stage's own memory axis, with one table row per end requirement (`end_slots`: slots the
stage must leave free at b) and, beside each top table, the bytes kept by the plan it
chose (`_top_kept`). `hbp.planner.stages` combines the stages; `optimal_plan` takes its plan
on large graphs when it recomputes less than the whole-graph DP's.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from enum import IntEnum
from functools import reduce
from typing import NamedTuple

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph.ir import Graph
from hbp.planner.cuts import WORK_LIMIT, candidate_cuts, frontier_bytes, window_cuts
from hbp.planner.plan import Plan, Segment
from hbp.planner.tree import name_segments

__all__ = [
    "WORK_LIMIT",
    "CostModel",
    "PeakSolver",
    "Solver",
    "candidate_cuts",
    "finish_plan",
    "frontier_bytes",
    "min_feasible_peak",
    "optimal_plan",
    "window_cuts",
]

INF = math.inf


class ChildMode(IntEnum):
    """How a child of a level runs: plain autograd, or recomputed (checkpointed)."""

    PLAIN = 0
    RECOMPUTE = 1


class PassExtent(IntEnum):
    """How much of a child a recompute pass runs (torch's early stop: a pass ends at its
    last save event)."""

    FULL = 0  # all of it: the rest of the level has a save event
    UNTIL_SAVE = 1  # up to its own last save event: nothing after it saves
    NOT_RUN = 2  # none of it: no save event from here to the level's end


PLAIN, REC = ChildMode.PLAIN, ChildMode.RECOMPUTE
FULL, UNTIL_SAVE, NOT_RUN = PassExtent.FULL, PassExtent.UNTIL_SAVE, PassExtent.NOT_RUN


class SlotArrays(NamedTuple):
    """A profile's byte arrays at d (one entry per candidate end f) in memory slots."""

    key: tuple  # (slots, slot bytes, need offset) they were made for
    need: tuple  # need slots by PassExtent
    kept: np.ndarray  # kept slots
    fits: tuple  # need and kept within the slots, by PassExtent
    room: np.ndarray  # slots - kept (int)
    kept_slots: np.ndarray  # kept slots (int)
    low: tuple  # max(kept, need) by PassExtent, int lists: below it the child does not fit
    kept_list: list  # kept slots as an int list


class CostModel:
    """The simulator's accounting, decomposed over segments (see the module docstring)."""

    def __init__(self, info: GraphInfo, cuts: list[int], bounds: list[int] | None = None):
        self.info = info
        self.cuts = [int(c) for c in cuts]
        # stage bounds (a subset of the cuts, 0 and n included): no level crosses one
        self.bounds = sorted({0, info.n, *bounds}) if bounds else [0, info.n]
        n = self.n = info.n
        root = info.root
        gid = -np.ones(n, dtype=np.int64)
        roots = [j for j in range(n) if root[j] == j and info.storage_bytes[j] > 0]
        for g, j in enumerate(roots):
            gid[j] = g
        self.node_group = np.where(gid[root] >= 0, gid[root], -1)
        G = len(roots)
        self.g_root = np.array(roots, dtype=np.int64)
        self.g_size = info.storage_bytes[self.g_root].astype(np.int64) if G else np.zeros(0, int)
        forced = np.zeros(G, dtype=bool)
        held_to_end = np.zeros(G, dtype=bool)  # an output in it is not a seed let go
        touches: list[list[int]] = [[] for _ in range(G)]
        holders: list[list[int]] = [[] for _ in range(G)]
        readers: list[list[int]] = [[] for _ in range(G)]
        for j in range(n):
            g = self.node_group[j]
            if g >= 0:
                touches[g].append(j)
                if info.is_held[j]:
                    forced[g] = True
                    held_to_end[g] |= not info.seed_let_go[j]
                if info.saves_output[j]:
                    holders[g].append(j)
            if info.is_input[j]:
                continue
            for v in info.inputs[j]:
                gv = self.node_group[v]
                if gv >= 0:
                    touches[gv].append(j)
                    readers[gv].append(j)
            for v in info.saved[j]:
                gv = self.node_group[v]
                if gv >= 0:
                    holders[gv].append(j)
        self.g_forced = forced
        self.g_touch = [sorted(set(t)) for t in touches]
        self.g_hold = [sorted(set(h)) for h in holders]
        self.g_read = [sorted(set(r)) for r in readers]
        self.g_lu = np.array([t[-1] for t in self.g_touch], dtype=np.int64)
        self.g_hmin = np.array([h[0] if h else n for h in self.g_hold], dtype=np.int64)

        # prefix sums over positions (index t+1 = sum over nodes <= t)
        self.flops_pre = np.concatenate([[0.0], np.cumsum(info.flops)])
        self.extra_pre = np.concatenate([[0], np.cumsum(info.extra_bytes)])
        self.root_pre = {}  # top flag -> prefix of sizes by root position
        self.end_pre = {}  # (top, mode) -> prefix of sizes by finite end position
        self.hold_pre = {}  # top -> prefix of sizes by first-holder position
        for top in (False, True):
            keep = ~forced if top else np.ones(G, dtype=bool)
            self.root_pre[top] = _prefix(self.g_root[keep], self.g_size[keep], n)
            self.hold_pre[top] = _prefix(self.g_hmin[keep], self.g_size[keep], n)
            for mode in (PLAIN, REC):
                finite = keep & ((self.g_hmin >= n) if mode == PLAIN else True)
                self.end_pre[top, mode] = _prefix(self.g_lu[finite], self.g_size[finite], n)
        # outputs live from their creation to the end of the step (top level only)
        self.out_pre = _prefix(self.g_root[forced], self.g_size[forced], n)
        self.out_total = int(self.g_size[forced].sum())
        # grad seeds the caller lets go of once backward starts (`GraphInfo.seed_let_go`):
        # counted as freed then only when no node reads or saves them (else held to the end:
        # conservative)
        unused = np.array([not h and not r for h, r in zip(self.g_hold, self.g_read)], dtype=bool)
        let_go = forced & ~held_to_end & unused
        self.seeds_let_go_bytes = int(self.g_size[let_go].sum())
        self._positional()
        # save events: last save event before position f; first node reading from before e
        last = -1
        self.last_save = np.full(n + 1, -1, dtype=np.int64)
        for j in range(n):
            if info.save_event[j]:
                last = j
            self.last_save[j + 1] = last
        self.min_input = np.array(
            [
                min((-1 if info.is_input[v] else v) for v in info.inputs[j])
                if info.inputs[j] and not info.is_input[j]
                else n
                for j in range(n)
            ],
            dtype=np.int64,
        )
        self.node_event = ~info.is_input
        self._crossing_sets()
        self._crossing_in: dict = {}
        self._by_first_touch: dict = {}
        self._crossing_lists: dict = {}
        self._intervals: dict = {}
        self._meets: dict = {}
        self._interned: dict = {}
        self._profiles: dict = {}
        self._first_reader: dict = {}
        self._save_free_mask: dict = {}
        first = np.full(n + 1, n, dtype=np.int64)
        for j in range(n - 1, -1, -1):
            first[j] = j if info.save_event[j] else first[j + 1]
        self.next_save = first  # first save event at or after each position
        self._bwd_pos = np.where(info.has_backward, self.pos_bwd, -INF)
        # a pass stopping at node j runs j (1) or nothing of it (0)
        self.runs_at_stop = info.runs_at_stop.astype(np.int64)
        self.stop_flops = info.stop_flops
        self._tail_needs: dict = {}

    # -- plan-independent parts ---------------------------------------------------------------
    def _positional(self) -> None:
        """Gradients, parameter gradients, outputs and backward scratch live at each backward
        event (pos_bwd) and when the backward of nodes >= d is done (pos_after[d], when the
        recompute pass of a segment ending at d runs). Same rules as the simulator."""
        info, n = self.info, self.n
        size: list[int] = []
        refs: list[int] = []
        grad = [-1] * n
        live = self.out_total

        def new(nbytes: int) -> int:
            size.append(int(nbytes))
            refs.append(1)
            return len(size) - 1

        for j in range(n):
            if info.grad_seed[j]:
                grad[j] = new(info.grad_bytes[j])
                live += int(info.grad_bytes[j])
        self.pos_bwd = np.zeros(n, dtype=np.int64)
        self.pos_after = np.zeros(n + 1, dtype=np.int64)
        self.pos_after[n] = live
        live -= self.seeds_let_go_bytes  # after the backward-start event, as the simulator
        for j in range(n - 1, -1, -1):
            if info.has_backward[j]:
                scratch = int(info.backward_transient[j])
                for v in info.inputs[j]:
                    if not info.receives_grad[v]:
                        continue
                    passed = v in info.passthrough[j] and grad[j] >= 0
                    if grad[v] < 0:
                        if passed:
                            grad[v] = grad[j]
                            refs[grad[j]] += 1
                        else:
                            grad[v] = new(info.grad_bytes[v])
                            live += int(info.grad_bytes[v])
                        continue
                    if refs[grad[v]] - (grad[v] == grad[j]) > 1:  # see the simulator
                        refs[grad[v]] -= 1
                        grad[v] = new(info.grad_bytes[v])
                        live += int(info.grad_bytes[v])
                    elif not passed:  # the computed gradient, until added in place
                        scratch += int(info.grad_bytes[v])
                live += int(info.param_grad_bytes[j])
                self.pos_bwd[j] = live + scratch
                if grad[j] >= 0:
                    refs[grad[j]] -= 1
                    if refs[grad[j]] == 0:
                        live -= size[grad[j]]
                    grad[j] = -1
            self.pos_after[j] = live

    def _crossing_sets(self) -> None:
        """F(c): groups made before c and touched at or after c, for every candidate cut c."""
        self.crossing: dict[int, list[int]] = {}
        order = np.argsort(self.g_root, kind="stable")
        active: set[int] = set()
        k = 0
        for c in range(self.n + 1):
            while k < len(order) and self.g_root[order[k]] < c:
                active.add(int(order[k]))
                k += 1
            active = {g for g in active if self.g_lu[g] >= c}
            if c in self._cut_set:
                self.crossing[c] = sorted(active)

    def stop_of(self, e: int) -> int:
        """The end of the stage that position e lies in (n without stages)."""
        return self.bounds[bisect_right(self.bounds, e)]

    def start_of(self, d: int) -> int:
        """The start of the stage that a level ending at d lies in."""
        return self.bounds[bisect_left(self.bounds, d) - 1]

    @property
    def _cut_set(self) -> set[int]:
        s = getattr(self, "_cs", None)
        if s is None:
            s = self._cs = set(self.cuts)
        return s

    def lu_in(self, g: int, d: int) -> int:
        """Last touch of group g before position d (-1 if none)."""
        t = self.g_touch[g]
        k = bisect_left(t, d)
        return t[k - 1] if k else -1

    def touched_in(self, g: int, lo: int, hi: int) -> bool:
        t = self.g_touch[g]
        k = bisect_left(t, lo)
        return k < len(t) and t[k] < hi

    def first_at_or_after(self, seq: list[int], lo: int) -> int:
        k = bisect_left(seq, lo)
        return seq[k] if k < len(seq) else self.n

    def crossing_in(self, c: int, d: int, top: bool) -> frozenset[int]:
        """Crossing groups at c within a level ending at d (outputs excluded at the top)."""
        key = (c, d, top)
        r = self._crossing_in.get(key)
        if r is None:
            by_touch = self._by_first_touch.get((c, top))
            if by_touch is None:
                by_touch = self._first_touch_order(c, top)
            touches, groups, sets = by_touch
            k = bisect_left(touches, d)  # groups touched in [c, d): a prefix
            r = sets.get(k)
            if r is None:
                r = sets[k] = frozenset(groups[:k])
            self._crossing_in[key] = r
        return r

    def meet(self, a: frozenset[int], b: frozenset[int]) -> frozenset[int]:
        """a & b, one shared object per distinct result (cheaper hashing and equality)."""
        key = (a, b)
        r = self._meets.get(key)
        if r is None:
            r = a & b
            r = self._meets[key] = self._interned.setdefault(r, r)
        return r

    def interval(self, e: int, d: int, mode: int) -> dict:
        """The parts of _Profile.at(d) that do not depend on the held set (memoised; the
        arrays are shared and read-only): candidate f in (e, d], their offsets f - e - 1,
        whether [e, f) has a save event and the pass FLOPs by variant (PLAIN: `until_run`, the
        offset of the last event a pass that stops in [e, f) records, -1 for none)."""
        key = (e, d, mode)
        r = self._intervals.get(key)
        if r is None:
            f_list = self.cuts[bisect_right(self.cuts, e) : bisect_right(self.cuts, d)]
            fs = np.array(f_list, dtype=np.int64)
            r = {"f_list": f_list, "f": fs, "idx": fs - e - 1}
            r["flops_full"] = self.flops_pre[fs] - self.flops_pre[e]
            if mode == PLAIN:
                ls = self.last_save[fs]
                has_save = ls >= e
                # the pass runs up to the last save event, of which it runs the FLOPs before
                # its last save, and its event only if some of it runs (NOTE [ Early stop at
                # the last pack ] in hbp.analysis.simulate)
                at = np.maximum(ls, 0)
                run_end = np.where(has_save, ls + self.runs_at_stop[at], e)
                r["until_run"] = run_end - 1 - e  # offset of the last event (-1: none)
                r["flops_until"] = np.where(
                    has_save,
                    self.flops_pre[at] - self.flops_pre[e] + self.stop_flops[at],
                    0.0,
                )
            else:
                has_save = self.first_reader_from_before(e) < fs
                r["zeros"] = np.zeros(len(fs))
                r["flops_until"] = np.zeros(len(fs))
                # its checkpoint's copy of the generator state: live from its forward on, and
                # kept until its backward when it saves something (NOTE [ Random state of
                # recomputed segments ] in hbp.analysis.simulate)
                info = self.info
                random = (info.random_before[fs] > info.random_before[e]) * info.rng_state_bytes
                r["state"] = random.astype(np.int64)
                r["state_kept"] = np.where(info.next_save[e] < fs, random, 0).astype(np.int64)
            r["has_save"] = has_save
            for v in r.values():
                if isinstance(v, np.ndarray):
                    v.flags.writeable = False
            self._intervals[key] = r
        return r

    def crossing_window(self, d: int, first: int, last: int) -> list[frozenset[int]]:
        """crossing_in(f, d, False) for the cuts f = cuts[first:last] (memoised)."""
        key = (d, first, last)
        r = self._crossing_lists.get(key)
        if r is None:
            r = self._crossing_lists[key] = [
                self.crossing_in(f, d, False) for f in self.cuts[first:last]
            ]
        return r

    def _first_touch_order(self, c: int, top: bool) -> tuple:
        """Crossing groups at c (outputs excluded at the top) sorted by their first touch at
        or after c: (first touches, groups, cache of prefix sets by length)."""
        pairs = sorted(
            (self.first_at_or_after(self.g_touch[g], c), g)
            for g in self.crossing[c]
            if not (top and self.g_forced[g])
        )
        r = self._by_first_touch[c, top] = ([t for t, _ in pairs], [g for _, g in pairs], {})
        return r

    def save_free_tiling(self, e: int, d: int) -> bool:
        """Whether [e, d) can be tiled by candidate-cut children without save events (plain
        children without saving nodes, recomputed children that read nothing from before
        them): the only tails a recompute pass can stop before."""
        return bool(self.save_free_mask(d)[e])

    def save_free_mask(self, d: int) -> np.ndarray:
        """Boolean array over positions f in [0, d]: save_free_tiling(f, d) (False for
        positions that are not candidate cuts). A child [f, g) is save-free iff g is at most
        max(next save event, first reader from before f)."""
        r = self._save_free_mask.get(d)
        if r is None:
            r = np.zeros(d + 1, dtype=bool)
            r[d] = True
            nearest = d  # nearest cut > f from which a save-free tiling to d exists
            k = bisect_left(self.cuts, d)
            lo = bisect_left(self.cuts, self.start_of(d))
            for f in reversed(self.cuts[lo:k]):
                reach = max(self.next_save[f], self.first_reader_from_before(f))
                if nearest <= reach:
                    r[f] = True
                    nearest = f
            self._save_free_mask[d] = r
        return r

    def fork_bytes(self, e: int, f: int) -> int:
        """Bytes the recompute pass of a recomputed [e, f) holds beside its children's: the
        copy of the generator state it restores afterwards (NOTE [ Generator states of
        checkpoints ] in hbp.analysis.simulate); charged through its whole backward (conservative)."""
        info = self.info
        if info.keeps_rng_state(e, f) and info.next_save[e] < f:
            return info.rng_state_bytes
        return 0

    def pass_pos(self, d: int) -> int:
        """Positional bytes while the recompute pass of a segment ending at d runs: it runs at
        the backward of the segment's last save event (NOTE [ Recompute at the first unpack ])."""
        return int(self.pos_after[self.last_save[d] + 1])

    def tail_need(self, e: int, f: int) -> float:
        """Bytes (positional) at the backward events of the tail of a recomputed [e, f): its
        nodes after its last save event, which run before its recompute pass with nothing of
        the pass live (-inf without such events)."""
        key = (e, f)
        r = self._tail_needs.get(key)
        if r is None:
            lo = max(e, int(self.last_save[f]) + 1)
            r = self._tail_needs[key] = float(self._bwd_pos[lo:f].max()) if lo < f else -INF
        return r

    def first_reader_from_before(self, e: int) -> int:
        """First node at or after e that reads a value made before e or a graph input."""
        r = self._first_reader.get(e)
        if r is None:
            fr = np.flatnonzero((self.min_input[e:] < e) & self.node_event[e:])
            r = self._first_reader[e] = e + int(fr[0]) if len(fr) else self.n
        return r

    # -- one child's needs --------------------------------------------------------------------
    def profile(self, e: int, H: frozenset[int], mode: int, top: bool) -> _Profile:
        key = (e, H, mode, top)
        p = self._profiles.get(key)
        if p is None:
            p = self._profiles[key] = _Profile(self, e, H, mode, top)
        return p


def _prefix(pos: np.ndarray, size: np.ndarray, n: int) -> np.ndarray:
    """out[t + 1] = sum of size where pos <= t, for t in [-1, n)."""
    acc = np.zeros(n + 2, dtype=np.int64)
    ok = pos < n
    np.add.at(acc, pos[ok] + 1, size[ok])
    return np.cumsum(acc)[: n + 1]


class _Profile:
    """Needs of a child X = [e, f) with a given mode, state H and level kind, for every f.

    Arrays are indexed by position t in [e, n) (offset e); `at(d)` specialises them to a
    level ending at d and samples them at the candidate cuts f in (e, d].
    """

    def __init__(self, m: CostModel, e: int, H: frozenset[int], mode: int, top: bool):
        self.m, self.e, self.H, self.mode, self.top = m, e, H, mode, top
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
        live += info.forward_transient[e:stop]
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
        self._at: dict[int, dict] = {}
        self._held: dict = {}
        self._held_lists: dict = {}
        self._held_full: dict = {}
        self._held_fulls: list | None = None
        self._first_cut = 0

    def at(self, d: int) -> dict:
        """Per candidate f in (e, d]: arrays f, need (bytes, by variant), kept, H_out, flops."""
        r = self._at.get(d)
        if r is not None:
            return r
        m, e, mode, top = self.m, self.e, self.mode, self.top
        shared = m.interval(e, d, mode)
        f_list, fs, idx = shared["f_list"], shared["f"], shared["idx"]
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
        out = {"f": fs, "f_list": f_list, "kept": self.kept[idx].astype(np.int64)}
        if mode == REC:
            out["kept"] = out["kept"] + shared["state_kept"]
        pos_pass = 0 if top else m.pass_pos(d)
        full = fwd_max[idx] + pos_pass
        if mode == PLAIN:
            if top:
                bwd = self.bwd_max[idx]
            else:  # nodes after the level's last save event are the level's tail
                last = int(m.last_save[d]) - e
                bwd = self.bwd_max[np.minimum(idx, max(last, 0))] if last >= 0 else idx * 0 - INF
            out["need_full"] = np.maximum(np.maximum(full, bwd), 0)
            last = shared["until_run"]
            ls_need = np.where(last >= 0, fwd_max[np.maximum(last, 0)] + pos_pass, -INF)
            out["need_until"] = np.maximum(np.maximum(ls_need, bwd), 0)
            out["need_none"] = np.maximum(bwd, 0)
        else:
            out["need_full"] = np.maximum(full + shared["state"], 0)
            out["need_until"] = out["need_none"] = shared["zeros"]
        out["flops_full"], out["flops_until"] = shared["flops_full"], shared["flops_until"]
        out["has_save"] = shared["has_save"]
        out["d"] = d
        self._at[d] = out
        return out

    def held_list(self, d: int) -> list[frozenset[int]]:
        """held_after(f, d) for every candidate f in (e, d], in order."""
        r = self._held_lists.get(d)
        if r is None:
            m = self.m
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
            r = self._held[key] = held & self.m.crossing_in(f, d, self.top) if held else held
        return r

    def _held_at(self, f: int) -> frozenset[int]:
        """Groups crossing f (outputs excluded at the top) that are held after [e, f),
        whatever the level's end: held_after(f, d) is this set within crossing_in(f, d)."""
        m, e = self.m, self.e
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


# ---------------------------------------------------------------------------------------------
# the solver


@dataclass
class _Choice:
    f: int
    mode: int
    variant: int  # FULL / UNTIL_SAVE / NOT_RUN (top level: FULL)
    H: frozenset
    sub_flag: int  # flag of the tail after f (nested levels)


class Solver:
    """Memoised DP tables over a cost model.

    Nested tables: tail(d, e, H, flag) -> cost array over memory slots for the children
    [e, d) of a level ending at d; flag 1 = the tail has a save event, 0 = it has none.
    Top table: top(e, H) -> cost array. `rec(e, f)` = T(e, f): cost array of recomputing
    [e, f) (its recompute pass plus its children) within the slots given.
    """

    def __init__(
        self,
        model: CostModel,
        slots: int,
        slot_bytes: float,
        nested: bool = True,
        *,
        end: int | None = None,
        need_offset: float = 0.0,
    ):
        self.m = model
        self.M = slots
        self.slot = slot_bytes
        self.nested = nested
        # the top level ends at `end` (a stage bound; n: the whole graph); needs are counted
        # in slots above `need_offset` bytes (a stage's own memory axis)
        self.end = model.n if end is None else int(end)
        self.offset = float(need_offset)
        # top tables have one row per end requirement: slots a stage must leave free at its
        # end (hbp.planner.stages); a whole-graph solve has one row, 0
        self.end_slots = np.zeros(1, dtype=np.int64)
        self.mi = np.arange(slots + 1)
        self._tail: dict = {}
        self._top: dict = {}
        self._top_kept: dict = {}  # (e, H) -> kept bytes of the top plan chosen at each m
        self._rec: dict = {}
        self._rec_plain: dict = {}
        self._rec_need: dict = {}
        self._rec_tail: dict = {}
        self._first_finite: dict = {}  # id(table) -> first slot with a finite value
        self._shifted: dict = {}  # id(T(e, f) table) -> it with the fork slots off

    def sl(self, x):
        """Bytes -> slots, rounded up (conservative)."""
        return np.ceil(np.asarray(x, dtype=float) / self.slot - 1e-9)

    # T(e, f) ---------------------------------------------------------------------------------
    def rec(self, e: int, f: int, lowest: int = 0, tail: bool = True) -> np.ndarray:
        """T(e, f) over slots (`_rec_table`), with the slots its pass's generator state copy
        takes (`CostModel.fork_bytes`) off."""
        fork = self._fork_slots(e, f)
        table = self._rec_table(e, f, max(lowest - fork, 0), tail)
        if not fork:
            return table
        r = self._shifted.get(id(table))
        if r is None:
            r = np.full(self.M + 1, INF)
            r[fork:] = table[: max(self.M + 1 - fork, 0)]
            self._shifted[id(table)] = r
        return r

    def _fork_slots(self, e: int, f: int) -> int:
        fork = self.m.fork_bytes(e, f)
        return int(self.sl(fork)) if fork else 0

    def _rec_table(self, e: int, f: int, lowest: int = 0, tail: bool = True) -> np.ndarray:
        """T(e, f) over slots, exact at every m >= `lowest`; with `tail`, infeasible where its
        tail's backward does not fit (`rec_tail`; without, the parent level counts it).

        Recomputing [e, f) as one plain child costs the FLOPs up to its last save event, and
        no nested plan costs less (each node up to that event runs at least once), so where
        the plain recompute fits (m >= its need) T equals it; the nested tables are only
        built when a caller needs T below that."""
        plain = self._rec_plain.get((e, f))
        if plain is None:
            plain = self._rec_plain[e, f] = self._plain_recompute(e, f)
            finite = np.flatnonzero(plain < INF)
            self._rec_need[e, f] = int(finite[0]) if len(finite) else self.M + 1
        if not self.nested or lowest >= self._rec_need[e, f]:
            return self._with_tail(e, f, plain, False) if tail else plain
        r = self._rec.get((e, f))
        if r is None:
            H = self.m.crossing_in(e, f, False)
            r = np.minimum(self.tail(f, e, H, 1), self.tail(f, e, H, 0))
            self._rec[e, f] = r = np.minimum(r, plain)
        return self._with_tail(e, f, r, True) if tail else r

    def _with_tail(self, e: int, f: int, table: np.ndarray, nested: bool) -> np.ndarray:
        """`table` made infinite below the slots of the tail's backward (memoised)."""
        key = (e, f, nested)
        r = self._rec_tail.get(key)
        if r is None:
            need = self.m.tail_need(e, f)
            r = table
            if need > -INF:
                low = int(self.sl(max(need - self.offset, 0.0)))
                if low > 0:
                    r = table.copy()
                    r[: min(low, self.M + 1)] = INF
            self._rec_tail[key] = r
        return r

    def rec_tail(self, d: int, f: int) -> bool:
        """Whether a recomputed child ending at f of a level ending at d counts its tail
        itself: a save event follows it in the level (else its tail is the level's tail,
        counted where the level's is). The top level (d=None) always does."""
        return d is None or self.m.last_save[d] >= f

    def top_kept(self, e: int, H: frozenset) -> np.ndarray:
        """Bytes kept across the forward by the plan that top(e, H) chose at each m (one row
        per end requirement)."""
        self.top(e, H)
        return self._top_kept[e, H]

    def _plain_recompute(self, e: int, f: int) -> np.ndarray:
        """T(e, f) restricted to one plain child: the level [e, f) with the single child
        [e, f), which runs until its last save event (or not at all without one): its FLOPs
        wherever m covers its need and what it keeps, else infinite. (The general recursion,
        `_evaluate(f, e, H, None, only=(f, PLAIN))`, gives the same table.)"""
        H = self.m.crossing_in(e, f, False)
        p = self.m.profile(e, H, PLAIN, False).at(f)
        slots = p.get("slots")
        if slots is None or slots.key != (self.M, self.slot, self.offset):
            slots = p["slots"] = self._slot_arrays(p)
        i = len(p["f_list"]) - 1  # the child ending at f
        has_save = bool(p["has_save"][i])
        variant = UNTIL_SAVE if has_save else NOT_RUN
        out = np.full(self.M + 1, INF)
        if slots.fits[variant][i]:
            out[slots.low[variant][i] :] = p["flops_until"][i] if has_save else 0.0
        return out

    def tail(self, d: int, e: int, H: frozenset, flag: int) -> np.ndarray:
        key = (d, e, H, flag)
        r = self._tail.get(key)
        if r is None:
            if e == d:
                r = np.zeros(self.M + 1) if flag == 0 else np.full(self.M + 1, INF)
            else:
                r = self._evaluate(d, e, H, flag)
            self._tail[key] = r
        return r

    def top(self, e: int, H: frozenset) -> np.ndarray:
        key = (e, H)
        r = self._top.get(key)
        if r is None:
            if e == self.m.n:
                need = self.sl(max(0.0, self.m.pos_after[self.m.n] - self.offset))
                need = np.maximum(need, self.end_slots)[:, None]
                r = np.where(self.mi[None, :] >= need, 0.0, INF)
                self._top_kept[key] = np.zeros_like(r)
            elif e == self.end:  # a stage ends here: the stages after it are planned apart
                r = np.where(self.mi[None, :] >= self.end_slots[:, None], 0.0, INF)
                self._top_kept[key] = np.zeros_like(r)
            else:
                r = self._evaluate(self.m.n, e, H, None, top=True)
            self._top[key] = r
        return r

    def _options(self, d, e, H, flag, top, only=None):
        """Per (mode, variant) of the first child [e, f): yield (mode, variant, sub_flag,
        profile, its arrays at d, selected f mask)."""
        m = self.m
        for mode in (PLAIN, REC):
            if only is not None and mode != only[1]:
                continue
            if mode == REC and only is None and not self.nested and not top:
                continue
            prof = m.profile(e, H, mode, top)
            p = prof.at(m.stop_of(e) if top else d)
            if len(p["f"]) == 0:
                continue
            sel = np.ones(len(p["f"]), dtype=bool)
            if only is not None:
                sel = p["f"] == only[0]
            if mode == REC and not top and H == m.crossing_in(e, d, False):
                # a recomputed child spanning the whole rest [e, d) with everything it reads
                # already held is the same plan without the extra nesting (and a cycle)
                sel &= p["f"] != d
            if top:
                yield mode, FULL, None, prof, p, sel
                continue
            hs = p["has_save"]
            if flag == 1:
                yield mode, FULL, 1, prof, p, sel
                yield mode, UNTIL_SAVE, 0, prof, p, sel & hs
            elif flag == 0:
                yield mode, NOT_RUN, 0, prof, p, sel & ~hs
            else:  # one-level segment: its children are a single plain child
                yield mode, FULL, 1, prof, p, sel & hs
                yield mode, UNTIL_SAVE, 0, prof, p, sel & hs
                yield mode, NOT_RUN, 0, prof, p, sel & ~hs

    def _option_costs(self, d, e, top, mode, variant, sub_flag, prof, p, sel):
        """Cost over slots for the selected f that can be feasible: (f indices, next states,
        array (k, M+1)).

        Option value at m: pass FLOPs + T(e, f)[m - kept] (recomputed child) + the tail's
        value at m - kept, if m >= the child's own need and m >= kept; else infinite."""
        slots, keep, rows, states = self._feasible_rows(d, top, variant, sub_flag, prof, p, sel)
        M = self.M
        need = slots.need[variant]
        f_list = p["f_list"]
        if not keep:
            return np.zeros(0, dtype=np.int64), states, None
        idx = np.array(keep)
        k = len(idx)
        kept_i = slots.kept_slots[idx]
        mi = self.mi
        cols = mi[None, :] - kept_i[:, None]
        flat = (np.arange(k) * (M + 1))[:, None] + np.minimum(np.maximum(cols, 0), M)
        table_rows = np.array(rows)
        cost = table_rows.ravel()[flat]
        # infeasible below the child's kept slots and below its own need
        cost[mi[None, :] < np.maximum(kept_i, need[idx])[:, None]] = INF
        if not top and variant != NOT_RUN:
            flops = p["flops_full" if variant == FULL else "flops_until"][idx]
            cost += flops[:, None]
        if mode == REC:
            # the smallest slot count each row's recompute is asked about
            first_sub = np.argmax(table_rows < INF, axis=1)
            lowest = np.maximum(np.maximum(need[idx], kept_i), kept_i + first_sub) - kept_i
            rec = self.rec
            recs = np.array(
                [
                    rec(e, f_list[i], int(lo), self.rec_tail(None if top else d, f_list[i]))
                    for i, lo in zip(keep, lowest.tolist())
                ]
            ).ravel()
            cost += recs[flat]
        return idx, states, cost

    def _feasible_rows(self, d, top, variant, sub_flag, prof, p, sel):
        """The selected f whose rest can be feasible: (slot arrays, f indices, rest tables,
        next states)."""
        M = self.M
        slots = p.get("slots")
        if slots is None or slots.key != (M, self.slot, self.offset):
            slots = p["slots"] = self._slot_arrays(p)
        ok = sel & slots.fits[variant]  # the child's need and kept bytes fit in M slots
        if sub_flag == 0:  # the rest must be a tail without save events
            save_free = p.get("save_free")
            if save_free is None:
                save_free = p["save_free"] = self.m.save_free_mask(d)[p["f"]]
            ok &= save_free
        idx = np.flatnonzero(ok)
        rows, keep, states = [], [], []
        f_list, H_list = p["f_list"], prof.held_list(p["d"])
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
            memo, table = self._tail, self.tail
            for i, lim in zip(idx.tolist(), limit):
                f, H2 = f_list[i], H_list[i]
                sub = memo.get((d, f, H2, sub_flag))
                if sub is None:
                    sub = table(d, f, H2, sub_flag)
                if sub.item(lim) < INF:  # tables are non-increasing in m
                    rows.append(sub)
                    keep.append(i)
                    states.append(H2)
        return slots, keep, rows, states

    def _slot_arrays(self, p: dict) -> SlotArrays:
        """A profile's byte arrays at d in slots (needs above `self.offset`, rounded up)."""
        M = self.M
        need = tuple(
            self.sl(np.maximum(p[k] - self.offset, 0.0))
            for k in ("need_full", "need_until", "need_none")
        )
        kept = self.sl(p["kept"])
        kept_int = kept.astype(np.int64)
        if "flops_lists" not in p:
            p["flops_lists"] = (p["flops_full"].tolist(), p["flops_until"].tolist())
        return SlotArrays(
            key=(M, self.slot, self.offset),
            need=need,
            kept=kept,
            fits=tuple((x <= M) & (kept <= M) for x in need),
            room=(M - kept).astype(np.int64),
            kept_slots=kept_int,
            low=tuple(np.maximum(kept_int, x).astype(np.int64).tolist() for x in need),
            kept_list=kept_int.tolist(),
        )

    def _evaluate(self, d, e, H, flag, top=False, only=None) -> np.ndarray:
        best = np.full(self.M + 1, INF)
        if flag == 0 and not self.m.save_free_tiling(e, d):
            return best
        M = self.M
        first_finite = self._first_finite
        if top:
            return self._evaluate_top(e, H)
        for mode, variant, sub_flag, prof, p, sel in self._options(d, e, H, flag, top, only):
            slots, keep, rows, _ = self._feasible_rows(d, top, variant, sub_flag, prof, p, sel)
            if not keep:
                continue
            # row by row, the same sums as _option_costs: (rest + pass FLOPs) + recompute
            lows, kept_list = slots.low[variant], slots.kept_list
            flops = None
            if not top and variant != NOT_RUN:
                flops = p["flops_lists"][variant]
            f_list = p["f_list"]
            for i, sub in zip(keep, rows):
                kept = kept_list[i]
                lo = lows[i]  # max(kept, need): below it the option is infeasible
                part = sub[lo - kept : M + 1 - kept]
                if flops is not None:
                    part = part + flops[i]
                if mode == REC:
                    first = first_finite.get(id(sub))
                    if first is None:
                        first = first_finite[id(sub)] = int(np.argmax(sub < INF))
                    lowest = max(lo, kept + first) - kept
                    table = self.rec(e, f_list[i], lowest, self.rec_tail(d, f_list[i]))
                    part = part + table[lo - kept : M + 1 - kept]
                low_best = best[lo:]
                np.minimum(low_best, part, out=low_best)
        return best

    def _evaluate_top(self, e: int, H: frozenset) -> np.ndarray:
        """top(e, H), one row per end requirement: the least recompute at every m and, among
        the plans that reach it, the least bytes kept (`_top_kept`: what a stage hands the
        stages after it)."""
        shape = (len(self.end_slots), self.M + 1)
        best, best_kept = np.full(shape, INF), np.zeros(shape)
        for option in self._options(self.m.n, e, H, None, True):
            rows = self._top_rows(e, *option)
            if rows is None:
                continue
            _, _, cost, kept = rows
            c_min = cost.min(axis=0)
            k_min = np.where(cost == c_min, kept, INF).min(axis=0)
            better = (c_min < best) | ((c_min == best) & (k_min < best_kept))
            best = np.where(better, c_min, best)
            best_kept = np.where(better, k_min, best_kept)
        self._top_kept[e, H] = best_kept
        return best

    def _top_rows(self, e, mode, variant, sub_flag, prof, p, sel):
        """The top-level options of one (mode, variant) at e: (f indices, next states,
        cost and kept bytes, each (option, end requirement, m)), or None. The one place
        the top level's option values are computed (table fill and plan rebuild).

        Option value at m: T(e, f)[m - kept] (recomputed child) + the rest's value at
        m - kept, if m >= the child's own need and m >= kept; else infinite."""
        M = self.M
        slots, keep, rows, states = self._feasible_rows(
            self.m.n, True, variant, sub_flag, prof, p, sel
        )
        if not keep:
            return None
        shape = (len(keep), len(self.end_slots), M + 1)
        cost, kept = np.full(shape, INF), np.zeros(shape)
        lows, kept_list, f_list = slots.low[variant], slots.kept_list, p["f_list"]
        for j, (i, sub, H2) in enumerate(zip(keep, rows, states)):
            k, lo = kept_list[i], lows[i]  # below max(kept, need) the child does not fit
            cost[j, :, lo:] = sub[:, lo - k : M + 1 - k]
            if mode == REC:  # asked from the smallest m at which the rest is feasible
                first = int(np.argmax(sub[0] < INF))
                rec = self.rec(e, f_list[i], max(lo, k + first) - k)
                cost[j, :, lo:] += rec[lo - k : M + 1 - k]
            kept[j, :, lo:] = self._top_kept[f_list[i], H2][:, lo - k : M + 1 - k]
            kept[j, :, lo:] += p["kept"][i]
        return np.array(keep), states, cost, kept

    # reconstruction ---------------------------------------------------------------------------
    def _pick(self, d, e, H, flag, top, slots) -> tuple[_Choice, int]:
        """The option that achieves the table's value at `slots`, and its kept slots."""
        target = self.tail(d, e, H, flag)[slots]
        for mode, variant, sub_flag, prof, p, sel in self._options(d, e, H, flag, top):
            idx, states, cost = self._option_costs(d, e, top, mode, variant, sub_flag, prof, p, sel)
            if cost is None:
                continue
            col = cost[:, slots]
            k = int(np.argmin(col))
            if col[k] <= target + 1e-9 * max(1.0, abs(target)):
                i = idx[k]
                kept = int(p["slots"].kept_slots[i])
                return _Choice(int(p["f"][i]), mode, variant, states[k], sub_flag), kept
        raise RuntimeError("DP reconstruction failed")  # pragma: no cover

    def _pick_top(self, e, H, slots, row) -> tuple[_Choice, int]:
        """The top-level option that achieves top(e, H)[row, slots] with the table's kept
        bytes, and its kept slots."""
        target = self.top(e, H)[row, slots]
        target_kept = self._top_kept[e, H][row, slots]
        for option in self._options(self.m.n, e, H, None, True):
            rows = self._top_rows(e, *option)
            if rows is None:
                continue
            idx, states, cost, kept = rows
            fits = (cost[:, row, slots] <= target + 1e-9 * max(1.0, abs(target))) & (
                kept[:, row, slots] <= target_kept
            )
            for k in np.flatnonzero(fits).tolist():
                p, i = option[4], idx[k]
                choice = _Choice(int(p["f"][i]), option[0], option[1], states[k], option[2])
                return choice, int(p["slots"].kept_slots[i])
        raise RuntimeError("DP reconstruction failed")  # pragma: no cover

    def top_plan(self, slots: int, start: int = 0, row: int = 0) -> list[Segment]:
        """The top-level segments from `start` (0 or a stage bound) to `self.end`, for end
        requirement `row`."""
        segs: list[Segment] = []
        e, H = start, frozenset()
        while e < self.end:
            c, kept = self._pick_top(e, H, slots, row)
            seg = Segment(e, c.f, c.mode == REC)
            if c.mode == REC:
                seg.children = self.rec_plan(e, c.f, slots - kept)
            segs.append(seg)
            slots -= kept
            e, H = c.f, c.H
        return segs

    def rec_plan(self, e: int, f: int, slots: int) -> list[Segment]:
        """Children of the recomputed segment [e, f) given `slots` for its backward."""
        slots -= self._fork_slots(e, f)
        self._rec_table(e, f, slots)
        if not self.nested or slots >= self._rec_need[e, f]:
            return []  # recomputed as plain autograd
        H = self.m.crossing_in(e, f, False)
        t1, t0 = self.tail(f, e, H, 1)[slots], self.tail(f, e, H, 0)[slots]
        flag = 1 if t1 <= t0 else 0
        kids: list[Segment] = []
        d = f
        while e < d:
            c, kept = self._pick(d, e, H, flag, False, slots)
            seg = Segment(e, c.f, c.mode == REC)
            if c.mode == REC:
                seg.children = self.rec_plan(e, c.f, slots - kept)
            kids.append(seg)
            slots -= kept
            e, H, flag = c.f, c.H, c.sub_flag
        return simplify(kids)


class PeakSolver:
    """The same recursion minimising the peak (exact bytes), recompute FLOPs as tie-break.

    Values are (peak bytes above the level's kept bytes, recompute FLOPs, choice)."""

    def __init__(self, model: CostModel, nested: bool = True):
        self.m = model
        self.nested = nested
        self._memo: dict = {}

    def rec(self, e: int, f: int):
        key = ("rec", e, f)
        if key not in self._memo:
            H = self.m.crossing_in(e, f, False)
            if self.nested:
                a, b = self.tail(f, e, H, 1), self.tail(f, e, H, 0)
                self._memo[key] = min(a, b, key=_order) + ((1 if _order(a) <= _order(b) else 0),)
            else:
                self._memo[key] = self._evaluate(f, e, H, None, False, only=f) + (None,)
            fork = self.m.fork_bytes(e, f)
            if fork:
                peak, *rest = self._memo[key]
                self._memo[key] = (peak + fork, *rest)
        return self._memo[key]

    def tail(self, d, e, H, flag):
        key = (d, e, H, flag)
        if key not in self._memo:
            if e == d:
                self._memo[key] = (0.0, 0.0, None) if flag == 0 else (INF, INF, None)
            else:
                self._memo[key] = self._evaluate(d, e, H, flag, False)
        return self._memo[key]

    def top(self, e, H):
        key = ("top", e, H)
        if key not in self._memo:
            if e == self.m.n:
                self._memo[key] = (float(self.m.pos_after[self.m.n]), 0.0, None)
            else:
                self._memo[key] = self._evaluate(self.m.n, e, H, None, True)
        return self._memo[key]

    def _evaluate(self, d, e, H, flag, top, only=None):
        m = self.m
        memo = self._memo
        best_peak, best_cost, best_choice = INF, INF, None
        for mode in (PLAIN, REC):
            if mode == REC and not self.nested and not top and only is None:
                continue
            if only is not None and mode != PLAIN:
                continue
            prof = m.profile(e, H, mode, top)
            p = prof.at(m.stop_of(e) if top else d)
            lists = p.get("peak_lists")
            if lists is None:
                lists = p["peak_lists"] = _peak_lists(p)
            f_list, kept_list, needs, flops, has_save = lists
            H_list = prof.held_list(p["d"])
            skip_whole = mode == REC and not top and H == m.crossing_in(e, d, False)
            for i, f in enumerate(f_list):
                if only is not None and f != only:
                    continue
                if skip_whole and f == d:
                    continue  # see Solver._options
                if top:
                    variants = _TOP_VARIANTS
                elif flag == 1:
                    variants = _FLAG1_VARIANTS if has_save[i] else _FLAG1_NOSAVE_VARIANTS
                elif flag == 0:
                    variants = _NO_VARIANTS if has_save[i] else _NOT_RUN_VARIANTS
                else:
                    variants = _FLAG1_VARIANTS if has_save[i] else _NOT_RUN_VARIANTS
                kept = kept_list[i]
                H2 = H_list[i]
                for variant, sub_flag in variants:
                    need = needs[variant][i]
                    if top:
                        sub = memo.get(("top", f, H2))
                        if sub is None:
                            sub = self.top(f, H2)
                    else:
                        sub = memo.get((d, f, H2, sub_flag))
                        if sub is None:
                            sub = self.tail(d, f, H2, sub_flag)
                    x = kept + sub[0]
                    peak = x if x > need else need  # max(need, x)
                    cost = sub[1]
                    if not top and variant != NOT_RUN:
                        cost += flops[variant][i]
                    if mode == REC:
                        r = memo.get(("rec", e, f))
                        if r is None:
                            r = self.rec(e, f)
                        x = kept + r[0]
                        if x > peak:
                            peak = x
                        if top or m.last_save[d] >= f:  # it counts its tail (Solver.rec_tail)
                            x = kept + m.tail_need(e, f)
                            if x > peak:
                                peak = x
                        cost += r[1]
                    if peak < best_peak or (peak == best_peak and cost < best_cost):
                        best_peak, best_cost = peak, cost
                        best_choice = _Choice(f, mode, variant, H2, sub_flag)
        return (best_peak, best_cost, best_choice)

    def top_plan(self) -> list[Segment]:
        segs, e, H = [], 0, frozenset()
        while e < self.m.n:
            c = self.top(e, H)[2]
            seg = Segment(e, c.f, c.mode == REC)
            if c.mode == REC:
                seg.children = self.rec_plan(e, c.f)
            segs.append(seg)
            e, H = c.f, c.H
        return segs

    def rec_plan(self, e, f):
        if not self.nested:
            return []
        flag = self.rec(e, f)[3]
        H = self.m.crossing_in(e, f, False)
        kids, d = [], f
        while e < d:
            c = self.tail(d, e, H, flag)[2]
            seg = Segment(e, c.f, c.mode == REC)
            if c.mode == REC:
                seg.children = self.rec_plan(e, c.f)
            kids.append(seg)
            e, H, flag = c.f, c.H, c.sub_flag
        return simplify(kids)


_TOP_VARIANTS = ((FULL, None),)
_FLAG1_VARIANTS = ((FULL, 1), (UNTIL_SAVE, 0))
_FLAG1_NOSAVE_VARIANTS = ((FULL, 1),)
_NOT_RUN_VARIANTS = ((NOT_RUN, 0),)
_NO_VARIANTS = ()


def _peak_lists(p: dict) -> tuple:
    """A profile's arrays at d as Python lists (floats), for PeakSolver's scalar loop."""
    needs = tuple(p[k].astype(float).tolist() for k in ("need_full", "need_until", "need_none"))
    flops = (p["flops_full"].astype(float).tolist(), p["flops_until"].astype(float).tolist())
    kept = p["kept"].astype(float).tolist()
    return p["f_list"], kept, needs, flops, p["has_save"].tolist()


def _order(v):
    return (v[0], v[1])


def simplify(segments: list[Segment]) -> list[Segment]:
    """Merge adjacent plain segments (same semantics) and drop children that are a single
    plain child (a recomputed segment without children recomputes as plain autograd)."""
    out: list[Segment] = []
    for s in segments:
        if s.recompute and len(s.children) == 1 and not s.children[0].recompute:
            s = Segment(s.start, s.stop, True)
        if out and not s.recompute and not out[-1].recompute:
            out[-1] = Segment(out[-1].start, s.stop, False)
        else:
            out.append(s)
    if len(out) == 1 and not out[0].recompute:
        return []
    return out


def absorb_inputs(info: GraphInfo, segments: list[Segment]) -> list[Segment]:
    """Merge a leading segment made only of graph inputs into the next one (graph inputs are
    never run nor recomputed, so this changes nothing but the printout)."""
    first = segments[0] if segments else None
    if len(segments) < 2 or not all(info.is_input[j] for j in range(first.start, first.stop)):
        return segments

    def extend(seg: Segment) -> Segment:
        kids = [extend(seg.children[0]), *seg.children[1:]] if seg.children else []
        return Segment(first.start, seg.stop, seg.recompute, kids)

    return [extend(segments[1]), *segments[2:]]


# ---------------------------------------------------------------------------------------------
# entry points


def _slot_size(info: GraphInfo, model: CostModel, budget: int, mem_slots: int) -> tuple:
    sizes = [
        int(x)
        for arr in (
            info.storage_bytes,
            info.extra_bytes,
            info.grad_bytes,
            info.param_grad_bytes,
        )
        for x in arr
        if x
    ]
    g = reduce(math.gcd, sizes, 0) or 1
    if budget // g <= max(mem_slots, 1024):
        return int(budget // g), float(g)
    return mem_slots, budget / mem_slots


@contextlib.contextmanager
def _planning(num_cuts: int):
    """Raise the recursion limit for the memoised recursion and pause the cyclic garbage
    collector: the DP allocates millions of small tuples and sets that live until it ends,
    and the collector's repeated scans of them cost 20-40% of the planning time."""
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


def _solve(info: GraphInfo, cuts: list[int], budget_bytes: int, mem_slots: int, nested: bool):
    """Run the DP; returns (segments, slots, slot bytes, how it was solved)."""
    model = CostModel(info, cuts)
    with _planning(len(cuts)):
        slots, slot_bytes = _slot_size(info, model, budget_bytes, mem_slots)
        solver = Solver(model, slots, slot_bytes, nested)
        if solver.top(0, frozenset())[0, slots] < INF:
            return solver.top_plan(slots), slots, slot_bytes, "dp"
        minimum, segments = _least_peak(info, model, nested)
        if minimum > budget_bytes:
            raise BudgetError(
                budget_bytes,
                minimum,
                f"{'nested' if nested else 'one-level'} plans over {len(cuts) - 2} "
                f"candidate cuts of {info.n} nodes",
            )
        # the slot rounding rejected a feasible budget: the least-peak plan fits
        return segments, slots, slot_bytes, "min-peak"


def _least_peak(info: GraphInfo, model: CostModel, nested: bool) -> tuple[int, list[Segment]]:
    """The least-peak plan (`PeakSolver`) and its peak. Where the graph keeps generator states,
    the simulated peak: the DP does not see every copy (NOTE [ Generator states of
    checkpoints ] in hbp.analysis.simulate), so the minimum is one that a plan reaches."""
    solver = PeakSolver(model, nested)
    peak = int(solver.top(0, frozenset())[0])
    segments = solver.top_plan()
    if info.rng_state_bytes:
        plan = absorb_inputs(info, simplify(list(segments)) or [Segment(0, info.n)])
        peak = max(peak, simulate(None, plan, info=info).peak_bytes)
    return peak, segments


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
) -> Plan:
    """The plan with the least recompute FLOPs whose simulated peak fits `budget_bytes`.

    Exact over trees of intervals whose cuts are in `candidate_cuts(info, block_size,
    max_cuts)` (one level only if `nested=False`), up to memory discretisation into at most
    max(mem_slots, 1024) slots of the gcd of the graph's byte counts (exact when the budget
    spans at most that many) or `mem_slots` equal slots of the budget (conservative).

    On large graphs (`staged`: "auto", the default `STAGED`) the graph is also planned in
    stages (`hbp.planner.stages`: per-stage tables over fine cuts, one allocation across
    stages) and that plan is taken when it fits and recomputes less.

    Raises:
        BudgetError: no plan over the candidate cuts fits; `.minimum` is the smallest peak
            any such plan reaches (bytes).
    """
    t0 = time.perf_counter()
    info = info or GraphInfo.of(graph)
    budget_bytes = int(budget_bytes)
    naive = simulate(graph, info=info)
    cuts = candidate_cuts(info, block_size, max_cuts)
    if budget_bytes >= naive.peak_bytes:  # plain autograd fits: nothing to recompute
        segments, slots, slot_bytes, how = [Segment(0, info.n)], 0, 0.0, "naive fits"
    else:
        segments, slots, slot_bytes, how = _solve(info, cuts, budget_bytes, mem_slots, nested)
    segments = absorb_inputs(info, simplify(segments) or [Segment(0, info.n)])
    plan = finish_plan(
        graph,
        segments,
        budget_bytes,
        info=info,
        naive=naive,
        meta={
            "planner": "optimal",
            "nested": nested,
            "block_size": block_size,
            "candidate_cuts": len(cuts) - 2,
            "mem_slots": slots,
            "slot_bytes": slot_bytes,
            "solved_by": how,
        },
    )
    if plan.predicted_peak_bytes > budget_bytes and info.rng_state_bytes and how == "dp":
        plan = _replanned(graph, info, plan, cuts, mem_slots, nested, naive)
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
    staged = STAGED if staged is None else staged
    if staged not in ("auto", "always", "never"):
        raise ConfigError("staged", staged, "'auto', 'always' or 'never'")
    if how == "dp" and block_size == 1 and staged != "never":
        if staged == "always" or _staged_pays(info, cuts):
            plan = _better_staged(graph, info, plan, naive, always=staged == "always") or plan
    plan.meta["solve_time_s"] = time.perf_counter() - t0
    return plan


def _replanned(graph, info, plan, cuts, mem_slots, nested, naive) -> Plan:
    """The DP's plan for the budget less the excess of `plan` (twice at most): the DP does not
    see the generator states that segments nested in a recomputed one keep from the forward
    (NOTE [ Generator states of checkpoints ] in hbp.analysis.simulate). `plan` itself
    when no such plan fits."""
    budget = target = plan.budget_bytes
    for _ in range(2):
        target -= plan.predicted_peak_bytes - budget
        try:
            segments, _, _, how = _solve(info, cuts, target, mem_slots, nested)
        except BudgetError:
            break
        segments = absorb_inputs(info, simplify(segments) or [Segment(0, info.n)])
        meta = dict(plan.meta, solved_by=f"{how} (below the budget: random states)")
        plan = finish_plan(graph, segments, budget, info=info, naive=naive, meta=meta)
        if plan.predicted_peak_bytes <= budget:
            break
    return plan


# "auto": graphs from STAGED_MIN_NODES nodes on, where the candidate cuts thin out, are also
# planned in stages and the staged plan is taken when it recomputes less; "always": taken
# whenever it fits (tests); "never"
STAGED = "auto"
STAGED_MIN_NODES = 400


def _staged_pays(info: GraphInfo, cuts: list[int]) -> bool:
    return info.n >= STAGED_MIN_NODES and len(cuts) - 2 < info.n // 4


def _better_staged(graph, info, plan, naive, always=False) -> Plan | None:
    """The staged plan (`hbp.planner.stages`) when it fits and recomputes less than `plan`
    (or, with `always`, when it fits).
    Its stage-boundary accounting is approximate: an overshoot is taken off the budget and
    the stages planned again (twice at most)."""
    from hbp.planner.stages import staged_plan

    budget = target = plan.budget_bytes
    for _ in range(3):
        segments = staged_plan(info, target, nested=False)
        if segments is None:
            return None
        sim = simulate(graph, segments, info=info)
        if sim.peak_bytes <= budget:
            break
        target -= sim.peak_bytes - budget
    else:
        return None
    if sim.recompute_flops >= plan.predicted_recompute_flops and not always:
        return None
    segments = absorb_inputs(info, simplify(segments) or [Segment(0, info.n)])
    meta = dict(plan.meta, solved_by="staged", whole_graph_recompute=plan.predicted_recompute_flops)
    return finish_plan(graph, segments, budget, info=info, naive=naive, meta=meta)


def min_feasible_peak(
    graph: Graph,
    *,
    block_size: int = 1,
    max_cuts: int = 64,
    nested: bool = True,
    info: GraphInfo | None = None,
) -> tuple[int, list[Segment]]:
    """The smallest simulated peak over the planner's plan space, and a plan reaching it."""
    info = info or GraphInfo.of(graph)
    model = CostModel(info, candidate_cuts(info, block_size, max_cuts))
    with _planning(len(model.cuts)):
        peak, segments = _least_peak(info, model, nested)
        segments = absorb_inputs(info, simplify(segments) or [Segment(0, info.n)])
    return peak, segments


def finish_plan(
    graph: Graph,
    segments: list[Segment],
    budget_bytes: int,
    *,
    info: GraphInfo | None = None,
    naive=None,
    meta: dict | None = None,
) -> Plan:
    """A Plan for `segments` with its predictions filled in from the simulator."""
    info = info or GraphInfo.of(graph)
    naive = naive or simulate(graph, info=info)
    name_segments(info, segments)
    sim = simulate(graph, segments, info=info)
    kept = kept_bytes(info, segments)
    meta = dict(meta or {})
    meta["cuts"] = [info.names[s.start] for s in segments[1:]]
    meta["predicted_peak_phase"] = sim.peak_phase
    meta["predicted_peak_at"] = sim.peak_at
    return Plan(
        segments=segments,
        budget_bytes=int(budget_bytes),
        predicted_peak_bytes=sim.peak_bytes,
        predicted_recompute_flops=sim.recompute_flops,
        naive_peak_bytes=naive.peak_bytes,
        naive_flops=naive.total_flops,
        kept_bytes=kept,
        meta=meta,
    )


def kept_bytes(info: GraphInfo, segments: list[Segment]) -> int:
    """Bytes of distinct storage the top-level recomputed segments hold as inputs."""
    roots = set()
    for s in segments:
        if s.recompute:
            roots.update(int(info.root[v]) for v in info.segment_inputs(s.start, s.stop))
    return int(sum(info.storage_bytes[r] for r in roots))
