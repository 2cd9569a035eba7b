"""A Plan from top-level segments: `finish_plan` fills in its predictions from the simulator,
`kept_bytes` what its recomputed segments hold (every planner hands out its plans through
them)."""

from __future__ import annotations

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph
from hbp.planner.plan import Plan, Segment
from hbp.planner.tree import name_segments

__all__ = ["finish_plan", "kept_bytes"]


def finish_plan(
    graph: Graph,
    segments: list[Segment],
    budget_bytes: int,
    *,
    info: GraphInfo | None = None,
    naive=None,
    meta: dict | None = None,
    sim=None,
) -> Plan:
    """A Plan for `segments` with its predictions filled in from the simulator (`sim`: the
    simulation of these segments, when the caller has it)."""
    info = info or GraphInfo.of(graph)
    naive = naive or simulate(graph, info=info)
    name_segments(info, segments)
    sim = sim or simulate(graph, segments, info=info)
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
