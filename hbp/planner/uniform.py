"""Uniform checkpointing (Chen et al. 2016): k segments of equal size, all but the last
recomputed once in backward. The baseline the optimal planner must beat."""

from __future__ import annotations

import time

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.errors import ConfigError
from hbp.graph.ir import Graph
from hbp.planner.dp import finish_plan
from hbp.planner.plan import Plan, Segment


def uniform_plan(
    graph: Graph,
    segments: int,
    *,
    by: str = "nodes",
    budget_bytes: int | None = None,
    info: GraphInfo | None = None,
) -> Plan:
    """Split the graph's non-input nodes into `segments` equal parts and recompute all but the
    last (sqrt(n) segments give Chen et al.'s O(sqrt(n)) memory).

    Args:
        segments: number of segments, >= 1 (clipped to the number of nodes).
        by: "nodes" (equal node counts) or "flops" (equal forward FLOPs).
        budget_bytes: recorded in the plan; default: its own predicted peak.

    Raises:
        ConfigError: segments < 1 or an unknown `by`.
    """
    t0 = time.perf_counter()
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ConfigError("segments", segments, "an int >= 1")
    if by not in ("nodes", "flops"):
        raise ConfigError("by", by, "'nodes' or 'flops'")
    info = info or GraphInfo.of(graph)
    n = info.n
    first = 0
    while first < n and info.is_input[first]:
        first += 1
    if by == "nodes":
        weight = np.ones(n - first)
    else:
        weight = info.flops[first:] + 1e-9  # zero-FLOP views still take a position
    cum = np.concatenate([[0.0], np.cumsum(weight)])
    k = max(1, min(segments, n - first))
    targets = cum[-1] * np.arange(1, k) / k
    cuts = sorted({first + int(np.searchsorted(cum, t, side="left")) for t in targets})
    cuts = [c for c in cuts if first < c < n]
    bounds = [0, *cuts, n]
    segs = [Segment(a, b, True) for a, b in zip(bounds[:-1], bounds[1:])]
    segs[-1].recompute = False
    plan = finish_plan(
        graph,
        segs,
        0,
        info=info,
        meta={"planner": "uniform", "segments": len(segs), "by": by},
    )
    plan.budget_bytes = int(budget_bytes) if budget_bytes is not None else plan.predicted_peak_bytes
    plan.meta["solve_time_s"] = time.perf_counter() - t0
    return plan
