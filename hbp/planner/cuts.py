"""Candidate cuts: where the planners may cut the topological order.

`candidate_cuts` keeps the whole-graph DP's work bounded (a few dozen cuts, the cheapest
frontiers first); `window_cuts` spreads cuts evenly for staged planning
(`hbp.planner.stages`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_call import kept_for_plan_call

# DP work grows like cuts^3 x the number of held sets per cut (`held_sets`); this bound keeps
# planning at 1-3 s of CPU (56 cuts with 1-2 groups crossing each).
WORK_LIMIT = 56**3 * 3


#: Where set, the number of evenly spread candidate cuts (None: the usual choice); set by
#: `coarse_cuts` (NOTE [ Cuts that many values cross ] in hbp.planner.dp.held_sets).
_COARSE_CUTS: ContextVar[int | None] = ContextVar("coarse_cuts", default=None)


@contextlib.contextmanager
def coarse_cuts(k: int | None) -> Iterator[None]:
    """Inside, `candidate_cuts` gives the best position of each of `k` equal runs of the
    graph's positions, and `window_cuts` the best of each region (None: as outside)."""
    token = _COARSE_CUTS.set(k)
    try:
        yield
    finally:
        _COARSE_CUTS.reset(token)


def current_coarse_cuts() -> int | None:
    """The count `coarse_cuts` set, None outside it."""
    return _COARSE_CUTS.get()


def frontier_bytes(info: GraphInfo) -> np.ndarray:
    """w[c] for c in [0, n]: bytes of storage made before c and touched at or after c
    (forward users, aliases), outputs included."""
    return _frontier(info)[0]


def _frontier(info: GraphInfo) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, number of storage groups) crossing each cut c in [0, n], made once per plan
    call (NOTE [ Facts kept for one plan call ]; shared and read-only)."""
    return kept_for_plan_call(info, "frontier", lambda: _frontier_of(info))


def _frontier_of(info: GraphInfo) -> tuple[np.ndarray, np.ndarray]:
    n = info.n
    roots, ends = _crossing_groups(info)
    sizes = info.storage_bytes[roots]
    w = np.zeros(n + 2, dtype=np.int64)
    count = np.zeros(n + 2, dtype=np.int64)
    np.add.at(w, roots + 1, sizes)
    np.add.at(w, ends + 1, -sizes)
    np.add.at(count, roots + 1, 1)
    np.add.at(count, ends + 1, -1)
    return np.cumsum(w)[: n + 1], np.cumsum(count)[: n + 1]


def _crossing_groups(info: GraphInfo) -> tuple[np.ndarray, np.ndarray]:
    """(root, last touch) of every storage group touched after the node that makes it: the
    group crosses the cuts c with root < c <= last touch."""
    nodes = np.arange(info.n)
    last_touch = np.full(info.n, -1, dtype=np.int64)
    np.maximum.at(last_touch, info.root, np.maximum(nodes, info.last_user))
    roots = np.flatnonzero((info.root == nodes) & (info.storage_bytes > 0) & (last_touch > nodes))
    return roots, last_touch[roots]


def dp_work(info: GraphInfo, cut_sets: list[list[int]]) -> list[float]:
    """The DP's estimated work over each of `cut_sets`: the inner cuts squared times the held
    sets summed over them, where a cut's held sets are 2^k for the k intervals between the
    set's cuts that the storage groups crossing it are made in (NOTE [ The union where it
    pays ] in hbp.planner.dp.least_peak)."""
    roots, ends = _crossing_groups(info)
    out = []
    for cuts in cut_sets:
        bounds = np.asarray(cuts, dtype=np.int64)
        inner = bounds[1:-1, None]
        crossing_at, group = np.nonzero((roots < inner) & (ends >= inner))
        made_in = np.zeros((len(inner), len(bounds) + 1), dtype=bool)
        made_in[crossing_at, np.searchsorted(bounds, roots[group], side="right")] = True
        held_sets = 2.0 ** np.minimum(made_in.sum(axis=1), 30)
        out.append(len(inner) ** 2 * float(held_sets.sum()))
    return out


def candidate_cuts(info: GraphInfo, block_size: int = 1, max_cuts: int = 64) -> list[int]:
    """Positions c (cut before node c) the planner may use, plus 0 and n.

    Positions inside the leading run of graph inputs are never useful. Of the others at most
    `max_cuts` are kept, fewer where many values cross the cuts (the DP's work,
    `WORK_LIMIT`, grows with the held sets per cut, `held_sets`): local minima of the
    frontier bytes (bytes crossing the cut) first, then positions with fewer crossing values
    than the fewest within `LOCAL_RADIUS` spacings around them (NOTE [ Crossing counts are
    local ]), then fewer bytes (equal ones evenly spread over the graph). Small graphs keep
    every position, so the DP is exact over all cut subsets there.

    With block size k, the positions are grouped into windows of k consecutive positions and
    of the kept ones only the one with the smallest frontier is used per window: a leaf of
    the interval tree is then about k nodes, cut where it is cheapest. The set for
    block size k is a subset of the set for block size 1, so the planner and its minimum are
    never worse at block size 1 than at a coarser one.
    """
    # NOTE [ Facts kept for one plan call ]
    key = ("candidate cuts", block_size, max_cuts, _COARSE_CUTS.get())
    return list(kept_for_plan_call(info, key, lambda: _candidate_cuts(info, block_size, max_cuts)))


def _candidate_cuts(info: GraphInfo, block_size: int, max_cuts: int) -> tuple[int, ...]:
    n = info.n
    if n == 0:
        return (0,)
    first = 0
    while first < n and info.is_input[first]:
        first += 1
    last = n  # NOTE [ A trailing run of the inputs' views ]
    while last > first and _costs_nothing(info, last - 1):
        last -= 1
    pos = list(range(max(first, 1), last))
    if not pos:
        return (0, n)
    w, count = _frontier(info)
    coarse = _COARSE_CUTS.get()
    if coarse is not None:  # NOTE [ Cuts that many values cross ]
        runs = np.array_split(np.array(pos), min(coarse, len(pos)))
        free = ([c for c in run.tolist() if not info.no_cut[c]] for run in runs)
        chosen = [c for run in free if run for c in _best_in(run, pos, w, count, 1)]
        return tuple(sorted({0, *chosen, n}))
    wp = w[pos[0] : pos[-1] + 1]
    minima = _minima(pos, wp.tolist())
    excess = _excess_count(count[pos[0] : pos[-1] + 1], LOCAL_RADIUS * max(1, n // max_cuts))
    not_minimum = np.array([c not in minima for c in pos])
    # by (not a minimum, excess count, bytes, spread); the last key of lexsort is its first
    ranked = np.lexsort((_spreads(len(pos)), wp, excess, not_minimum)).tolist()
    chosen, states = [], 0.0
    for k in ranked:
        if info.no_cut[pos[k]]:  # NOTE [ A write into a view reaches backward through its base ]
            continue
        states += held_sets(int(count[pos[k]]))
        if len(chosen) >= max_cuts or len(chosen) ** 2 * states > WORK_LIMIT:
            break
        chosen.append(pos[k])
    if block_size > 1:  # the cheapest kept position per window (the last one on ties)
        window: dict[int, int] = {}
        for c in sorted(chosen):
            k = (c - pos[0]) // block_size
            if k not in window or w[c] <= w[window[k]]:
                window[k] = c
        chosen = list(window.values())
    return tuple(sorted({0, *chosen, n}))


def cut_choices(info: GraphInfo, block_size: int = 1, max_cuts: int = 64) -> list[list[int]]:
    """The distinct candidate-cut sets `candidate_cuts` chooses for `max_cuts`, 1.5x and 2x
    as many (NOTE [ Least peak over other cut choices ]), `max_cuts`'s first."""
    out: list[list[int]] = []
    for k in (max_cuts, max_cuts * 3 // 2, max_cuts * 2):
        cuts = candidate_cuts(info, block_size, k)  # each kept for the plan call
        if cuts not in out:
            out.append(cuts)
    return out


# NOTE [ Least peak over other cut choices ]
# Where the work limit stops `candidate_cuts` (most real graphs: about 55 cuts whatever
# `max_cuts` is), `max_cuts` still decides which cuts are kept, through the radius the
# crossing counts are compared within (NOTE [ Crossing counts are local ]). The least peak
# depends on that choice: MobileViT's 398 nodes reach 8.73 MiB over the cuts chosen for 64,
# 7.11 over those for 96 or 128; a diffusers UNet's 590 nodes 10.48 and 9.92 MB. So the
# least peak ("min", a BudgetError's minimum) is taken over the union of the sets chosen for
# 1, 1.5 and 2 times `max_cuts`, and a budget below what the first set reaches is planned
# over the union where it fits (NOTE [ A budget only other cuts reach ]). One least-peak DP
# over the union (the sets share most of their cuts: a few more cuts than the largest) costs
# less than one per set and reaches at most the least of each (its plan space holds theirs).
# Budgets the first set reaches are planned over it alone: the recompute DP costs about
# three times the least-peak DP.

# NOTE [ A budget only other cuts reach ]
# Such a budget ("min" on these graphs) was given the union's least-peak plan. The least-peak
# DP breaks ties by recompute state by state, which is not the least recompute of the whole
# plan at that peak: a child's lower peak is taken even where the level's peak is set by
# something else and a costlier child would have fitted. At the same least peak, the
# recompute tables over the union found plans with 75% less recompute on
# experiments/check_plans.py's small diffusers UNet and 3% less on its 48-layer residual
# net. So the tables run over the union too, and the plan that recomputes less is taken;
# they cost about three times the least-peak DP, and only budgets in this band pay it. Where
# slots round (`_slot_size` in hbp.planner.dp.entry), the tables at the least peak itself
# reject most plans that reach it exactly (each need and kept term is rounded up), so they
# run one slot above the budget, and their plan is taken only where it simulates within
# the budget, else the plans a slot lower and below are read from the same tables (NOTE
# [ One solve read at lower slot counts ] in hbp.planner.dp.slots; on check_plans' 48-layer
# residual net 231.7 instead of 266.7 GFLOP at the same peak). Where none of those fits,
# they run once more four slots above and are read down the same way (a T5 of
# tests/test_min_is_measured.py: 13.9 MFLOP at the least peak, where the least-peak plan
# recomputes 29.4; four slots above as the first try lost elsewhere: the residual net fell
# back to its least-peak plan, 275.5 GFLOP). As above the band, a staged plan that fits and
# recomputes less is taken instead (a diffusers UNet2DModel of four levels, one byte below
# the first set's least peak: 2.0 MFLOP staged against 17.9 MFLOP over the union).


# NOTE [ Crossing counts are local ]
# Values that live across a long stretch of the graph cross every cut in it: an
# encoder-decoder's encoder output (read by every decoder block's cross-attention), position
# biases and masks made in the first block and passed to all later ones. Ranked by the
# number of crossing values alone, every cut of such a stretch lost to the cuts elsewhere
# (T5's decoder: 6 values cross its block boundaries, 3 the encoder's), the work limit was
# spent before any was reached, and the whole decoder was one segment: the least peak was
# 30.5 MiB where checkpointing each block peaks at 16.2 MiB. A cut is ranked by how many
# more values cross it than cross the best position near it (within LOCAL_RADIUS average
# spacings of `max_cuts` cuts): between the blocks of a stretch every boundary ranks as
# well as a boundary elsewhere, while inside a block the positions where attention's
# queries, keys and values are alive still rank below the block's boundaries.
# The work estimate must then not overcharge such cuts: charged 2^count held sets (64 for
# T5's decoder boundaries, 2^9 inside a UNet's skip connections) they exhausted the work
# limit after a few cuts and the rest of the graph went without (a UNet's least peak rose
# 6%). The DP's held sets at a cut are not arbitrary subsets of the crossing values: a value
# is held because an enclosing recomputed segment reads it or an earlier child saves it, so
# the sets follow the order in which the values are made and first used. Counted on real
# graphs (GPT-2, BERT, T5, a diffusers UNet: at most 7, 11, 17, 24, 28, 31, 47 distinct held
# sets at 3..9 crossing values), they grow about like 1 + count * (count + 1) / 2, which
# `held_sets` charges (2^count below 3 values, where that is smaller).
LOCAL_RADIUS = 2


def held_sets(count: int) -> float:
    """The DP's estimated number of held sets at a cut that `count` storage groups cross
    (NOTE [ Crossing counts are local ])."""
    return min(2.0 ** min(count, 20), 1 + count * (count + 1) / 2)


def _excess_count(count: np.ndarray, radius: int) -> np.ndarray:
    """count[k] minus the least count within `radius` positions of k."""
    padded = np.pad(count, radius, constant_values=np.iinfo(np.int64).max)
    floor = np.lib.stride_tricks.sliding_window_view(padded, 2 * radius + 1).min(axis=1)
    return count - floor


def _minima(pos: list[int], wp: list[int]) -> set[int]:
    """Positions where the frontier bytes `wp` have a local minimum: both ends of a flat
    minimum (NOTE [ Both ends of a flat frontier minimum ])."""
    last = len(pos) - 1
    out = set()
    for k, c in enumerate(pos):
        down = k == 0 or wp[k] <= wp[k - 1]
        up = k == last or wp[k] <= wp[k + 1]
        strict_before = k == 0 or wp[k] < wp[k - 1]
        strict_after = k == last or wp[k] < wp[k + 1]
        if (down and strict_after) or (strict_before and up):
            out.add(c)
    return out


def _costs_nothing(info: GraphInfo, j: int) -> bool:
    """Whether node `j` holds no storage of its own: a view of a graph input, or a value of
    no bytes (a slice of the arguments' tuple)."""
    root = int(info.root[j])
    return bool(info.is_input[root]) or int(info.storage_bytes[root]) == 0


# NOTE [ A trailing run of the inputs' views ]
# A capture through a loss wrapper (`WithLoss`: `HCModule(..., loss_fn=)`, `hbp.estimate`)
# ends with views of its inputs after the loss (the targets handed back, or the slice of the
# arguments that holds them), which cost nothing.
# Cuts among them are as useless as cuts among the leading inputs, and they hid a useful one:
# the frontier drops to nothing after the loss, so the position just before the loss, the
# last of a plateau where the logits cross, was no local minimum and was not kept, while the
# same model's graph that ends at its loss keeps it (the end counts as a rise). GPT-2 small at
# "min" reached 24.50 MiB through the wrapper and 24.00 without it. Positions stop before
# such a trailing run, as they start after the leading inputs.


# NOTE [ Both ends of a flat frontier minimum ]
# A run of positions with the same, locally least frontier (a value crossing a few
# zero-storage or same-size ops: views, a norm feeding a Linear) offers two different cuts.
# Its last position lets a segment start after the run; its first lets a segment end before
# it. The two recompute differently: a recompute pass stops inside its last save event
# (NOTE [ Early stop at the last pack ] in hbp.analysis.simulate), so a segment ending right
# after a Linear that saves only its input skips that Linear's matmul, while one that also
# takes the next norm (which saves its input) runs the matmul again. A transformer block's
# output before the final norm is such a run; the block boundary is its first position.
# Both ends rank as minima.


def _spread(k: int, n: int) -> int:
    """Bit-reversed rank: a tie-break that spreads equal-frontier cuts evenly."""
    bits = max(1, (n - 1).bit_length())
    return int(f"{k:0{bits}b}"[::-1], 2)


def _spreads(n: int) -> np.ndarray:
    """`_spread(k, n)` for every k in [0, n)."""
    bits = max(1, (n - 1).bit_length())
    k = np.arange(n)
    reversed_k = np.zeros(n, dtype=np.int64)
    for bit in range(bits):
        reversed_k |= ((k >> bit) & 1) << (bits - 1 - bit)
    return reversed_k


def window_cuts(
    info: GraphInfo, per_region: int = 6, region: int = 32, bounds: list[int] | None = None
) -> list[int]:
    """Candidate cuts spread evenly: in every run of `region` consecutive positions, the
    `per_region` best by `candidate_cuts`'s ranking (frontier local minima, fewer crossing
    values, fewer bytes). With `bounds` (stage bounds, kept as cuts), the runs start again at
    every bound, so that identical stages get identical cuts (NOTE [ Identical stages are
    solved once ] in hbp.planner.stages)."""
    n = info.n
    first = 0
    while first < n and info.is_input[first]:
        first += 1
    pos = list(range(max(first, 1), n))
    if not pos:
        return [0, n]
    w, count = _frontier(info)
    coarse = _COARSE_CUTS.get()  # NOTE [ Cuts that many values cross ]
    starts = sorted({pos[0], *(b for b in bounds or () if pos[0] < b < n)})
    chosen = [*starts] if bounds else []
    for start, stop in zip(starts, [*starts[1:], n]):
        for lo in range(start, stop, region):
            block = list(range(lo, min(lo + region, stop)))
            block = [c for c in block if not info.no_cut[c]]
            chosen.extend(_best_in(block, pos, w, count, per_region if coarse is None else 1))
    return sorted({0, *(c for c in chosen if not info.no_cut[c]), n})


def _best_in(block: list[int], pos: list[int], w, count, k: int) -> list[int]:
    """The `k` best positions of `block` by `candidate_cuts`'s ranking."""
    minima = {
        c for c in block if (c == pos[0] or w[c] <= w[c - 1]) and (c == pos[-1] or w[c] < w[c + 1])
    }
    ranked = sorted(
        range(len(block)),
        key=lambda i: (
            block[i] not in minima,
            count[block[i]],
            w[block[i]],
            _spread(i, len(block)),
        ),
    )
    return [block[i] for i in ranked[:k]]
