"""The cost model: the simulator's accounting decomposed over the segments of a plan.

Work on storage groups (a storage root and its aliases). Within a *level* (the top-level
tiling, or the children of a recomputed segment [c, d) during its recompute) every event's
live bytes are

    outer + K(e) + local(X, H, event) + pos(event)

where X = [e, f) is the child the event belongs to, K(e) the bytes the children before e
hold until their backward (groups a plain child's node saves, extras, groups a recomputed
child reads from before it), H the crossing groups at e (made before e, used at or after e
within the level) that are already held, `local` what X's own events add (computable from
e, f, H, the mode of X and the level's end d alone: `ChildProfile`), `pos` the
plan-independent part (activation and parameter gradients, and the graph outputs the caller
holds, which live for the whole step: `hbp.analysis.positional`), and `outer` what the
enclosing levels hold (constant during the level). A recomputed child's backward is a level
of its own whose memory needs depend only on its interval and the memory left, so it is a
table T(e, f, m) shared by every parent (`hbp.planner.dp.solver`).

Early stop (the recompute pass ends at its last save event) is handled with a flag: whether
the rest of the level has a save event (`RestSaves`). Torch starts a pass at the backward of
that event (NOTE [ Recompute at the first unpack ] in `hbp.analysis.simulate`): the pass's
events see the positional bytes after the nodes that follow it (`CostModel.pass_pos`); those
nodes (the level's tail) have their backward before the pass, so they are charged not within
the level but with T's own base: in T(e, f) when a save event follows [e, f) in its parent
level (or at the top level), else in the parent's tail (`CostModel.own_tail_until`,
`CostModel.tail_need`).

Stages: `CostModel(info, cuts, bounds)` confines every level to one stage between two bounds
(`hbp.planner.stages`).
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_call import kept_for_plan_call, plan_call_scope
from hbp.analysis.positional import positional_bytes
from hbp.planner.dp.modes import INF, PLAIN, REC, ChildMode

__all__ = [
    "EVERY_PIN_MAX_CUTS",
    "EVERY_PIN_MAX_NODES",
    "CostModel",
    "Interval",
    "cost_model",
    "cost_models_shared",
]

#: On cost models of at most EVERY_PIN_MAX_CUTS cuts, a recomputed child whose pass runs at most
#: EVERY_PIN_MAX_NODES nodes may pin any of them, not only the two best by FLOPs and by FLOPs
#: per byte (NOTE [ Pin candidates ]).
EVERY_PIN_MAX_CUTS = 16
EVERY_PIN_MAX_NODES = 16


@dataclass(eq=False)
class Interval:
    """What a child [e, f) costs whatever is held, for every candidate end f in (e, d].

    f_list / f: the candidate ends (list and array); idx: their offsets f - e - 1.
    flops_full: FLOPs of a pass that runs all of [e, f); flops_until: of a pass that stops at
    its last save event (plain), 0 (recomputed: a pass only enters it).
    has_save: [e, f) has a save event (plain: a node that saves; recomputed: it reads
    something from before it, which entering it saves).
    until_run (plain): offset of the last event a pass stopping in [e, f) records (-1: none).
    zeros, state, state_kept (recomputed): zeros; the generator-state bytes its checkpoint
    copies, and those it keeps until its backward.
    """

    f_list: list[int]
    f: np.ndarray
    idx: np.ndarray
    flops_full: np.ndarray
    flops_until: np.ndarray | None = None
    has_save: np.ndarray | None = None
    until_run: np.ndarray | None = None
    zeros: np.ndarray | None = None
    state: np.ndarray | None = None
    state_kept: np.ndarray | None = None


class CostModel:
    """The simulator's accounting, decomposed over segments (see the module docstring)."""

    def __init__(self, info: GraphInfo, cuts: list[int], bounds: list[int] | None = None):
        self.info = info
        self.cuts = [int(c) for c in cuts]
        # stage bounds (a subset of the cuts, 0 and n included): no level crosses one
        self.bounds = sorted({0, info.n, *bounds}) if bounds else [0, info.n]
        n = self.n = info.n
        facts = info.lists  # NOTE [ Event loops read Python lists ] in hbp.analysis.liveness
        root = info.root
        roots = np.flatnonzero((root == np.arange(n)) & (info.storage_bytes > 0))
        G = len(roots)
        gid = -np.ones(n, dtype=np.int64)
        gid[roots] = np.arange(G)
        self.node_group = np.where(gid[root] >= 0, gid[root], -1)
        self.g_root = roots.astype(np.int64)
        self.g_size = info.storage_bytes[self.g_root].astype(np.int64) if G else np.zeros(0, int)
        forced = np.zeros(G, dtype=bool)
        touches: list[list[int]] = [[] for _ in range(G)]
        holders: list[list[int]] = [[] for _ in range(G)]
        readers: list[list[int]] = [[] for _ in range(G)]
        node_group = self.node_group.tolist()
        for j in range(n):
            g = node_group[j]
            if g >= 0:
                touches[g].append(j)
                if facts.is_held[j]:
                    forced[g] = True
                if facts.saves_output[j]:
                    holders[g].append(j)
            if facts.is_input[j]:
                continue
            for v in info.inputs[j]:
                gv = node_group[v]
                if gv >= 0:
                    touches[gv].append(j)
                    readers[gv].append(j)
            for v in info.saved[j]:
                gv = node_group[v]
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
        # gradients, parameter gradients, outputs (and the grad seeds let go once backward
        # starts) and backward scratch: at each backward event (pos_bwd) and once the backward
        # of nodes >= d is done (pos_after[d], when the recompute pass of a segment ending at d
        # runs)
        positional = positional_bytes(info)
        self.pos_bwd, self.pos_after = positional.at_backward, positional.after
        # out-of-place sums (into broadcast gradients, of parameter gradients) after a
        # node's releases (-inf: none)
        self.pos_late = positional.late
        self.out_total = positional.held_output_bytes
        # save events: last save event before position f; first node reading from before e
        saves_at = np.where(info.save_event, np.arange(n), -1)
        self.last_save = np.concatenate([[-1], np.maximum.accumulate(saves_at)]).astype(np.int64)
        is_input = facts.is_input
        self.min_input = np.array(
            [
                min((-1 if is_input[v] else v) for v in info.inputs[j])
                if info.inputs[j] and not is_input[j]
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
        self.profiles: dict = {}  # (e, H, mode, top) -> ChildProfile: `ChildProfile.of`'s memo
        self._first_reader: dict = {}
        self._save_free_mask: dict = {}
        self.next_save = info.next_save  # first save event at or after each position
        # a tail saves nothing: what it holds is the same at its late sums
        self._bwd_pos = np.where(info.has_backward, np.maximum(self.pos_bwd, self.pos_late), -INF)
        # a pass stopping at node j runs j (1) or nothing of it (0)
        self.runs_at_stop = info.runs_at_stop.astype(np.int64)
        self.stop_flops = info.stop_flops
        self._tail_needs: dict = {}
        # NOTE [ Pin candidates ]
        # A recomputed child [e, f) may pin one node q (NOTE [ Pinned values ] in
        # hbp.analysis.simulate) that its pass runs whole (q before its last save event t):
        # the pass then skips q's FLOPs. At the top level the pin is stored in the forward;
        # in a nested level only where the level's pass runs the child whole (extent FULL),
        # and only on cost models of at most `NESTED_PINS_MAX_CUTS` cuts (their rows cost
        # planning time in proportion: docs/planner.md "Pinned values"). The DP offers two candidates per
        # (e, f) rather than every node (which would multiply the rows by the interval's
        # length): the node with the most FLOPs in [e, t) and the one with the most FLOPs per
        # byte, from a running argmax per e (`pin_candidates`). On small cost models (at most
        # EVERY_PIN_MAX_CUTS cuts, a pass of at most EVERY_PIN_MAX_NODES nodes) it offers
        # every eligible node: the value worth keeping is often a cheap one that a later
        # recompute reads (the random DAGs of the planner bench; README "Pinned values").
        # Eligible: nodes with storage of their own and FLOPs, without forward scratch (a
        # composite op whose intermediates the executor's MUST_SAVE would store too) and not
        # drawing random numbers (a pinned op does not run in the pass, so the generator
        # would not advance for the ops after it). A pin costs its output and saved extras
        # (`pin_bytes`), charged in the child's whole forward and kept across the rest of the
        # level (where the rest reads q, q's group joins the held set at f instead of being
        # counted twice), then
        # (`Solver.pin_charge`): PinCharge.PASS, until the child's pass (its tail's backward
        # sees it; in the pass it is q's value, which the pass's accounting counts), or
        # PinCharge.BACKWARD, through the child's whole backward (an upper bound).
        # `optimal_plan` plans with PASS; where the child's nested plan stops its pass before
        # q (q then is held on and saves nothing) the plan may overshoot or recompute more
        # than the tables say, and it plans again with BACKWARD (`_pins_checked`).
        self.pin_bytes = (info.storage_bytes + info.extra_bytes).astype(np.int64)
        self.pin_flops = np.where(
            ~info.is_input
            & (info.root == np.arange(n))
            & (info.storage_bytes > 0)
            & (info.forward_scratch_bytes == 0)
            & ~info.draws_random,
            info.flops,
            0.0,
        )
        self._pin_candidates: dict = {}

    def _crossing_sets(self) -> None:
        """F(c): groups made before c and touched at or after c, for every candidate cut c."""
        self.crossing: dict[int, list[int]] = {}
        order = np.argsort(self.g_root, kind="stable").tolist()
        g_root, g_lu = self.g_root.tolist(), self.g_lu.tolist()
        active: set[int] = set()
        k = 0
        for c in sorted(self._cut_set):
            while k < len(order) and g_root[order[k]] < c:
                active.add(order[k])
                k += 1
            active = {g for g in active if g_lu[g] >= c}
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

    def interval(self, e: int, d: int, mode: ChildMode) -> Interval:
        """The parts of `ChildProfile.at(d)` that do not depend on the held set (memoised; the
        arrays are shared and read-only)."""
        key = (e, d, mode)
        r = self._intervals.get(key)
        if r is None:
            f_list = self.cuts[bisect_right(self.cuts, e) : bisect_right(self.cuts, d)]
            fs = np.array(f_list, dtype=np.int64)
            r = Interval(f_list, fs, fs - e - 1, self.flops_pre[fs] - self.flops_pre[e])
            if mode == PLAIN:
                ls = self.last_save[fs]
                r.has_save = ls >= e
                # the pass runs up to the last save event, of which it runs the FLOPs before
                # its last save, and its event only if some of it runs (NOTE [ Early stop at
                # the last pack ] in hbp.analysis.simulate)
                at = np.maximum(ls, 0)
                run_end = np.where(r.has_save, ls + self.runs_at_stop[at], e)
                r.until_run = run_end - 1 - e
                r.flops_until = np.where(
                    r.has_save,
                    self.flops_pre[at] - self.flops_pre[e] + self.stop_flops[at],
                    0.0,
                )
            else:
                r.has_save = self.first_reader_from_before(e) < fs
                r.zeros = np.zeros(len(fs))
                r.flops_until = np.zeros(len(fs))
                # its checkpoint's copy of the generator state: live from its forward on, and
                # kept until its backward when it saves something (NOTE [ Generator states of
                # checkpoints ] in hbp.analysis.simulate)
                info = self.info
                random = (info.random_before[fs] > info.random_before[e]) * info.rng_state_bytes
                r.state = random.astype(np.int64)
                r.state_kept = np.where(info.next_save[e] < fs, random, 0).astype(np.int64)
            for v in vars(r).values():
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

    def own_tail_until(self, d: int | None) -> int:
        """The last end f at which a recomputed child of a level ending at d counts its tail
        itself: a save event follows it in the level (after it, the child's tail is the
        level's tail, counted where the level's is). The top level (d=None): every child.
        The solvers read it once per level and compare each end with it."""
        return self.n if d is None else int(self.last_save[d])

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
    def pin_candidates(self, e: int, f: int) -> tuple[int, ...]:
        """The nodes a recomputed child [e, f) may pin (NOTE [ Pin candidates ]):
        among the nodes before its last save event, the one with the most FLOPs and the one
        with the most FLOPs per byte kept (one or two nodes; none without a pass)."""
        t = int(self.last_save[f])  # the pass runs [e, t], t itself maybe in part
        if t <= e:
            return ()
        if len(self.cuts) <= EVERY_PIN_MAX_CUTS and t - e <= EVERY_PIN_MAX_NODES:
            return tuple(q for q in range(e, t) if self.pin_flops[q] > 0)
        by_flops, by_ratio = self._pin_candidates.get(e) or self._pin_scan(e)
        out = (int(by_flops[t - 1 - e]), int(by_ratio[t - 1 - e]))
        out = tuple(q for q in dict.fromkeys(out) if self.pin_flops[q] > 0)
        return out

    def _pin_scan(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Running argmax of FLOPs and of FLOPs per byte over [e, t], for t from e on."""
        stop = self.stop_of(e)
        flops = self.pin_flops[e:stop]
        ratio = flops / np.maximum(self.pin_bytes[e:stop], 1)
        idx = np.arange(e, stop)
        out = []
        for v in (flops, ratio):
            best = np.maximum.accumulate(v) if len(v) else v
            out.append(np.maximum.accumulate(np.where(v >= best, idx, e)) if len(v) else idx)
        self._pin_candidates[e] = r = (out[0], out[1])
        return r


def _prefix(pos: np.ndarray, size: np.ndarray, n: int) -> np.ndarray:
    """out[t + 1] = sum of size where pos <= t, for t in [-1, n)."""
    acc = np.zeros(n + 2, dtype=np.int64)
    ok = pos < n
    np.add.at(acc, pos[ok] + 1, size[ok])
    return np.cumsum(acc)[: n + 1]


# NOTE [ One cost model per cut set in a plan call ]
# A plan call solves several tables over the same cuts: "min" runs the least-peak DP, the
# recompute tables at the least peak and, where slots round, again a slot above; "N%act" the
# least-peak DP and the tables at the resolved budget; a plan with pins may solve twice more.
# Each made its own `CostModel`, and each model computed again what depends only on the graph
# and the cuts: the children's profiles and their arrays at every level end, the intervals,
# the held sets (a fifth to a third of a small graph's planning time). Inside
# `cost_models_shared(info)` (the planner's entry points hold it for their call) one model per
# cut set serves every solve; the caches that depend on a solver's slots are keyed by them
# (`SlotArrays.key`). On exit the models are dropped: kept on the GraphInfo they would hold
# their caches for as long as the graph lives.


@contextlib.contextmanager
def cost_models_shared(info: GraphInfo) -> Iterator[bool]:
    """Inside, `cost_model(info, cuts)` gives one model per cut set (NOTE [ One cost model
    per cut set in a plan call ]); the outermost exit drops them. Yields whether this is the
    outermost scope (a caller keeping other per-call caches drops them with it)."""
    with plan_call_scope(info) as outermost:  # NOTE [ Facts kept for one plan call ]
        yield outermost


def cost_model(info: GraphInfo, cuts: list[int]) -> CostModel:
    """The cost model of the whole graph over `cuts`: inside `cost_models_shared(info)` the
    one made for the same cuts before, else a new one."""
    key = ("cost model", tuple(int(c) for c in cuts))
    return kept_for_plan_call(info, key, lambda: CostModel(info, cuts))
