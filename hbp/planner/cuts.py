"""Candidate cuts: where the planners may cut the topological order.

`candidate_cuts` keeps the whole-graph DP's work bounded (a few dozen cuts, the cheapest
frontiers first); `window_cuts` spreads cuts evenly for staged planning
(`hbp.planner.stages`)."""

from __future__ import annotations

import numpy as np

from hbp.analysis.liveness import GraphInfo

# DP work grows like cuts^3 x the number of held-sets per cut (2^crossing groups); this
# bound keeps planning at 1-3 s of CPU (56 cuts with 1-2 groups crossing each).
WORK_LIMIT = 56**3 * 3


def frontier_bytes(info: GraphInfo) -> np.ndarray:
    """w[c] for c in [0, n]: bytes of storage made before c and touched at or after c
    (forward users, aliases), outputs included."""
    return _frontier(info)[0]


def _frontier(info: GraphInfo) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, number of storage groups) crossing each cut c in [0, n]."""
    n = info.n
    w = np.zeros(n + 2, dtype=np.int64)
    count = np.zeros(n + 2, dtype=np.int64)
    root = info.root
    lu = np.full(n, -1, dtype=np.int64)
    for j in range(n):
        r = root[j]
        lu[r] = max(lu[r], j, info.last_user[j])
    for r in range(n):
        if root[r] == r and info.storage_bytes[r] > 0 and lu[r] > r:
            w[r + 1] += info.storage_bytes[r]
            w[lu[r] + 1] -= info.storage_bytes[r]
            count[r + 1] += 1
            count[lu[r] + 1] -= 1
    return np.cumsum(w)[: n + 1], np.cumsum(count)[: n + 1]


def candidate_cuts(info: GraphInfo, block_size: int = 1, max_cuts: int = 64) -> list[int]:
    """Positions c (cut before node c) the planner may use, plus 0 and n.

    Positions inside the leading run of graph inputs are never useful. Of the others at most
    `max_cuts` are kept, fewer where many values cross the cuts (the DP's work,
    `WORK_LIMIT`, grows with 2^(values crossing)): local minima of the frontier bytes (bytes
    crossing the cut) first, then positions with fewer crossing values, then fewer bytes
    (equal ones evenly spread over the graph). Small graphs keep every position, so the DP
    is exact over all cut subsets there.

    With block size k, the positions are grouped into windows of k consecutive positions and
    of the kept ones only the one with the smallest frontier is used per window: a leaf of
    the interval tree is then about k nodes, cut where it is cheapest. The set for
    block size k is a subset of the set for block size 1, so the planner and its minimum are
    never worse at block size 1 than at a coarser one.
    """
    n = info.n
    if n == 0:
        return [0]
    first = 0
    while first < n and info.is_input[first]:
        first += 1
    pos = list(range(max(first, 1), n))
    if not pos:
        return [0, n]
    w, count = _frontier(info)
    wp = [int(w[c]) for c in pos]
    minima = _minima(pos, wp)
    ranked = sorted(
        range(len(pos)),
        key=lambda k: (pos[k] not in minima, count[pos[k]], wp[k], _spread(k, len(pos))),
    )
    chosen, states = [], 0.0
    for k in ranked:
        states += 2.0 ** min(int(count[pos[k]]), 20)
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
    return sorted({0, *chosen, n})


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


# NOTE [ Both ends of a flat frontier minimum ]
# A run of positions with the same, locally least frontier (a value crossing a few
# zero-storage or same-size ops: views, a norm feeding a Linear) offers two different cuts.
# Its last position lets a segment start after the run; its first lets a segment end before
# it. The two recompute differently: a recompute pass stops inside its last save event
# (NOTE [ Early stop inside a node ] in hbp.analysis.liveness), so a segment ending right
# after a Linear that saves only its input skips that Linear's matmul, while one that also
# takes the next norm (which saves its input) runs the matmul again. A transformer block's
# output before the final norm is such a run; the block boundary is its first position.
# Both ends rank as minima.


def _spread(k: int, n: int) -> int:
    """Bit-reversed rank: a tie-break that spreads equal-frontier cuts evenly."""
    bits = max(1, (n - 1).bit_length())
    return int(f"{k:0{bits}b}"[::-1], 2)


def window_cuts(info: GraphInfo, per_region: int = 6, region: int = 32) -> list[int]:
    """Candidate cuts spread evenly: in every run of `region` consecutive positions, the
    `per_region` best by `candidate_cuts`'s ranking (frontier local minima, fewer crossing
    values, fewer bytes)."""
    n = info.n
    first = 0
    while first < n and info.is_input[first]:
        first += 1
    pos = list(range(max(first, 1), n))
    if not pos:
        return [0, n]
    w, count = _frontier(info)
    chosen = []
    for lo in range(0, len(pos), region):
        block = pos[lo : lo + region]
        minima = {
            c
            for c in block
            if (c == pos[0] or w[c] <= w[c - 1]) and (c == pos[-1] or w[c] < w[c + 1])
        }
        ranked = sorted(
            range(len(block)),
            key=lambda k: (
                block[k] not in minima,
                count[block[k]],
                w[block[k]],
                _spread(k, len(block)),
            ),
        )
        chosen.extend(block[k] for k in ranked[:per_region])
    return sorted({0, *chosen, n})
