"""Plan trees: walking them, naming their segments, and validating a plan against a graph."""

from __future__ import annotations

from collections.abc import Iterator

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import check_tiling, simulate
from hbp.graph.ir import Graph
from hbp.planner.plan import MIB, Plan, Segment


def walk(segments: list[Segment], depth: int = 0) -> Iterator[tuple[int, Segment]]:
    """(depth, segment) for every segment of the tree, parents before children."""
    for s in segments:
        yield depth, s
        yield from walk(s.children, depth + 1)


def name_segments(info: GraphInfo, segments: list[Segment]) -> list[Segment]:
    """Fill every segment's `first` / `last` with node names (in place; returns segments)."""
    for _, s in walk(segments):
        s.first, s.last = info.names[s.start], info.names[s.stop - 1]
    return segments


def validate_plan(graph: Graph, plan: Plan, *, info: GraphInfo | None = None) -> None:
    """Check that `plan` can run on `graph` within its budget.

    Checks: the segments tile the graph (recursively, children only under recomputed
    segments); every value a node reads when it runs (forward or recompute) is live, i.e.
    stored or recomputed (the simulator checks this at every event); graph inputs are never
    recomputed; the simulated peak is within `plan.budget_bytes` (when set) and equals the
    plan's prediction (when set), which catches a plan made for another graph.

    Raises:
        ValueError: naming the first problem found.
    """
    info = info or GraphInfo.of(graph)
    check_tiling(plan.segments, 0, info.n)
    for _, s in walk(plan.segments):
        if s.recompute and all(info.is_input[j] for j in range(s.start, s.stop)):
            raise ValueError(
                f"plan: segment [{s.start}, {s.stop}) holds only graph inputs, which exist "
                "before the step and cannot be recomputed"
            )
    sim = simulate(graph, plan, info=info, check=True)
    if plan.budget_bytes and sim.peak_bytes > plan.budget_bytes:
        raise ValueError(
            f"plan: simulated peak {sim.peak_bytes / MIB:.3f} MiB ({sim.peak_bytes} bytes, at "
            f"{sim.peak_phase} of {sim.peak_at!r}) exceeds the budget "
            f"{plan.budget_bytes / MIB:.3f} MiB ({plan.budget_bytes} bytes)"
        )
    if plan.predicted_peak_bytes and sim.peak_bytes != plan.predicted_peak_bytes:
        raise ValueError(
            f"plan: simulated peak {sim.peak_bytes} bytes differs from the plan's predicted "
            f"{plan.predicted_peak_bytes} bytes: was it made for another graph?"
        )
