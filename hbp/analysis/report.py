"""A printable memory report of a graph: naive peak, bounds, and where the cheap cuts are."""

from __future__ import annotations

import numpy as np

from hbp.analysis.frontier import Frontier, frontier
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph
from hbp.units import MIB


def _mib(x: float) -> str:
    return f"{x / MIB:9.2f} MiB" if x >= MIB / 100 else f"{int(x):>9d} B  "


def format_report(graph: Graph, *, cuts: int = 10, min_peak_bytes: int | None = None) -> str:
    """Naive peak (and where it happens), the lower bound and, if given, the planner's
    minimum feasible peak (`hbp.planner.min_feasible_peak(graph)[0]`), the frontier's
    spread, and the `cuts` cheapest cuts with their node names."""
    info = GraphInfo.of(graph)
    fr: Frontier = frontier(graph, min_peak_bytes=min_peak_bytes, info=info)
    naive = simulate(graph, info=info)
    n = info.n
    interior = fr.keep_bytes[1:n] if n > 1 else np.zeros(1)
    lines = [
        f"Graph: {n} nodes ({int(info.is_input.sum())} inputs), "
        f"{info.flops.sum():.4g} forward FLOPs, {naive.total_flops:.4g} step FLOPs",
        f"  naive peak        {_mib(fr.naive_peak_bytes)}  ({naive.peak_phase} of "
        f"{naive.peak_at!r})",
        f"  lower bound       {_mib(fr.lower_bound_bytes)}  (the most demanding single node)",
    ]
    if fr.min_peak_bytes is not None:
        ratio = fr.min_peak_bytes / fr.naive_peak_bytes if fr.naive_peak_bytes else 0.0
        lines.append(
            f"  minimum feasible  {_mib(fr.min_peak_bytes)}  ({ratio:.3f}x naive; planner, nested)"
        )
    lines += [
        f"  keep bytes per cut: min {_mib(interior.min()).strip()}, median "
        f"{_mib(float(np.median(interior))).strip()}, max {_mib(interior.max()).strip()}",
        f"  naive live across cuts peaks at {_mib(fr.naive_live_bytes.max()).strip()}",
        f"Cheapest {min(cuts, max(n - 1, 0))} cuts (cut before node c):",
        f"  {'c':>6}  {'keep':>13}  {'grad':>13}  {'naive live':>13}  node",
    ]
    for c in fr.smallest_cuts(cuts):
        lines.append(
            f"  {c:>6}  {_mib(fr.keep_bytes[c])}  {_mib(fr.grad_bytes[c])}  "
            f"{_mib(fr.naive_live_bytes[c])}  {info.names[c]}"
        )
    return "\n".join(lines)
