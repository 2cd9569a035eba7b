"""Frontier analysis: what each cut of the topological order costs to keep.

For every cut c (between node c-1 and node c; c in [0, n]):
- `keep_bytes[c]`: storage made before c that is read at or after c (forward users and
  aliases). This is what a checkpoint at c must keep: a recomputed segment starting at c
  holds exactly these values (those it reads) until its backward is done.
- `grad_bytes[c]`: gradient bytes crossing c in backward (values made before c whose
  gradient is produced by nodes at or after c): live whenever backward is at the cut.
- `naive_live_bytes[c]`: what plain autograd holds across c in forward (everything saved so
  far, outputs, and the crossing values): the quantity checkpointing attacks.

Plus the naive peak, a lower bound on any plan's peak (the working set of the most demanding
single node: its backward needs its saved values, its output gradient, the gradients it
creates and every gradient and parameter gradient alive at that moment, which no plan can
avoid), and, when the caller gives it, the smallest peak the planner reaches
(`hbp.planner.min_feasible_peak`: the analysis does not import the planner).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.positional import positional_bytes
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph


@dataclass
class Frontier:
    """Per-cut byte counts (arrays of length n + 1) and the step's bounds, in bytes."""

    names: list[str]
    keep_bytes: np.ndarray
    grad_bytes: np.ndarray
    naive_live_bytes: np.ndarray
    naive_peak_bytes: int
    lower_bound_bytes: int
    min_peak_bytes: int | None = None

    def smallest_cuts(self, k: int = 10) -> list[int]:
        """The k interior cuts with the smallest keep_bytes (ties: earlier first)."""
        n = len(self.names)
        interior = range(1, n)
        return sorted(sorted(interior, key=lambda c: (self.keep_bytes[c], c))[:k])


def frontier(
    graph: Graph, *, min_peak_bytes: int | None = None, info: GraphInfo | None = None
) -> Frontier:
    """Frontier analysis of `graph` (see the module docstring). `min_peak_bytes`: the
    planner's least peak (`hbp.planner.min_feasible_peak(graph)[0]`), recorded as given."""
    info = info or GraphInfo.of(graph)
    n = info.n
    root = info.root
    # storage groups: made at the root, last touched by an alias or a reader
    last_touch = np.full(n, -1, dtype=np.int64)
    held = np.zeros(n, dtype=bool)  # kept by a backward or as an output
    for j in range(n):
        r = root[j]
        last_touch[r] = max(last_touch[r], j, info.last_user[j])
        if info.is_held[j] or info.saves_output[j]:
            held[r] = True
        for v in info.saved[j]:
            held[root[v]] = True
    keep = np.zeros(n + 2, dtype=np.int64)
    naive = np.zeros(n + 2, dtype=np.int64)
    for r in range(n):
        size = int(info.storage_bytes[r])
        if root[r] != r or size == 0:
            continue
        keep[r + 1] += size
        keep[last_touch[r] + 1] -= size  # crossing c iff r < c <= last touch
        naive[r + 1] += size
        naive[(n + 1) if held[r] else (last_touch[r] + 1)] -= size
    extras = np.concatenate([[0], np.cumsum(info.extra_bytes)])
    keep = np.maximum(np.cumsum(keep)[: n + 1], 0)
    naive = np.cumsum(naive)[: n + 1] + extras
    grads = np.zeros(n + 2, dtype=np.int64)
    for v in range(n):
        if info.receives_grad[v] and info.grad_bytes[v]:
            first_consumer = max((u for u in info.users[v] if info.has_backward[u]), default=-1)
            if first_consumer > v:
                grads[v + 1] += info.grad_bytes[v]
                grads[first_consumer + 1] -= info.grad_bytes[v]
    grads = np.cumsum(grads)[: n + 1]
    naive_peak = simulate(graph, info=info).peak_bytes
    result = Frontier(
        names=info.names,
        keep_bytes=keep,
        grad_bytes=grads,
        naive_live_bytes=naive,
        naive_peak_bytes=naive_peak,
        lower_bound_bytes=lower_bound(info),
    )
    result.min_peak_bytes = min_peak_bytes
    return result


def lower_bound(info: GraphInfo) -> int:
    """Bytes no plan can go below: max over nodes of what their forward event or their
    backward event needs live whatever is recomputed (plan-independent gradients, parameter
    gradients and outputs included)."""
    at_backward = positional_bytes(info).at_backward.tolist()
    facts = info.lists  # NOTE [ Event loops read Python lists ] in hbp.analysis.liveness
    root, storage_bytes, extra_bytes = facts.root, facts.storage_bytes, facts.extra_bytes
    is_out_root = np.zeros(info.n, dtype=bool)
    is_out_root[info.root[info.is_held]] = True
    out_root = is_out_root.tolist()
    out_made = np.concatenate([[0], np.cumsum(info.storage_bytes * is_out_root)]).tolist()
    best = 0
    for j in range(info.n):
        if facts.is_input[j]:
            continue
        roots = {root[v] for v in info.inputs[j]} | {root[j]}
        fwd = sum(storage_bytes[r] for r in roots if not out_root[r])
        fwd += out_made[j + 1] + facts.forward_scratch_bytes[j]
        if facts.has_backward[j]:
            fwd += extra_bytes[j]
        best = max(best, fwd)
        if facts.has_backward[j]:
            saved = {root[v] for v in info.saved[j]}
            if facts.saves_output[j]:
                saved.add(root[j])
            kept = sum(storage_bytes[r] for r in saved if not out_root[r])
            best = max(best, at_backward[j] + kept + extra_bytes[j])
    return best
