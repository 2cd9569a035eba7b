"""The report's plots (matplotlib, Agg): the memory timeline of one step per mode and the
frontier-width profile of a graph. The Pareto plot is `hbp.analysis.pareto.plot_pareto`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from hbp.analysis.frontier import Frontier
from hbp.analysis.simulate import Simulation
from hbp.planner.plan import Plan
from hbp.units import MIB

PHASE_COLORS = {"forward": "tab:blue", "recompute": "tab:green", "backward": "tab:orange"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shade_phases(ax, phases: pd.Series, x: pd.Series) -> None:
    """Shade each run of equal phase between its first and last x."""
    start = 0
    values, xs = list(phases), list(x)
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            color = PHASE_COLORS.get(values[start], "grey")
            ax.axvspan(xs[start], xs[i - 1] + 1, color=color, alpha=0.08, lw=0)
            start = i


def plot_memory_timeline(
    timelines: Mapping[str, pd.DataFrame],
    path: str | Path,
    *,
    title: str = "",
    plan: Plan | None = None,
    planned: Simulation | None = None,
) -> Path:
    """One panel per run: live bytes after every op of the measured step (the tracker's
    memory_timeline.parquet: op_index, live_bytes, phase), forward and backward shaded. With
    `plan` and `planned` (the simulation of that plan on the run's graph), a last panel shows
    the planned step over the planner's events (forward, recompute and backward shaded) with
    the plan's top-level segment boundaries marked: the measured tracker ops and the graph's
    nodes are not one to one, so the boundaries are drawn on the planner's own axis."""
    plt = _pyplot()
    rows = len(timelines) + (planned is not None)
    fig, axes = plt.subplots(rows, 1, figsize=(9, 1.9 * rows + 0.6), squeeze=False)
    axes = axes[:, 0]
    top = max((float(t["live_bytes"].max()) for t in timelines.values() if len(t)), default=0)
    for ax, (label, timeline) in zip(axes, timelines.items()):
        if timeline.empty:
            ax.set_title(f"{label}: no timeline", fontsize=9)
            continue
        ax.plot(timeline["op_index"], timeline["live_bytes"] / MIB, lw=1, color="k")
        _shade_phases(ax, timeline["phase"], timeline["op_index"])
        peak = timeline["live_bytes"].max() / MIB
        ax.set_title(f"{label}: measured, peak {peak:.3g} MiB", fontsize=9, loc="left")
        ax.set_ylim(0, top / MIB * 1.08 if top else 1)
        ax.set_ylabel("live MiB")
    axes[len(timelines) - 1].set_xlabel("op index in the step (tracker)")
    if planned is not None:
        ax = axes[-1]
        events = pd.DataFrame(planned.timeline, columns=["event", "live_bytes"])
        events["phase"] = events["event"].str.split(":", n=1).str[0]
        x = pd.Series(range(len(events)))
        ax.plot(x, events["live_bytes"] / MIB, lw=1, color="k")
        _shade_phases(ax, events["phase"], x)
        names = events["event"].str.split(":", n=1).str[1]
        forward = events["phase"] == "forward"
        cuts = plan.cut_points() if plan is not None else []
        firsts = {s.first for s in plan.segments[1:]} if plan is not None else set()
        for i in x[forward & names.isin(firsts)]:
            ax.axvline(i, color="tab:red", lw=0.8, ls="--")
        ax.set_title(
            f"the plan, simulated: {len(cuts) + 1} top-level segments (dashed: boundaries), "
            f"peak {planned.peak_bytes / MIB:.3g} MiB",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("live MiB")
        ax.set_xlabel("planner event (forward, recompute, backward)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in PHASE_COLORS.values()]
    fig.legend(handles, list(PHASE_COLORS), loc="upper right", fontsize=8, ncol=3)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return _save(fig, path)


def plot_frontier(
    fr: Frontier, path: str | Path, *, title: str = "", cuts: list[int] | None = None
) -> Path:
    """The frontier-width profile of a graph: for every cut of its topological order, the
    bytes a checkpoint there keeps (`keep_bytes`), the gradient bytes crossing it and what
    plain autograd holds across it; the cheapest cuts dotted, `cuts` (a plan's) dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    x = range(len(fr.keep_bytes))
    ax.plot(x, fr.naive_live_bytes / MIB, label="naive live across the cut", color="tab:grey")
    ax.plot(x, fr.keep_bytes / MIB, label="keep (frontier width)", color="tab:blue")
    ax.plot(x, fr.grad_bytes / MIB, label="gradients crossing", color="tab:orange", lw=0.8)
    ax.axhline(fr.naive_peak_bytes / MIB, color="k", lw=0.6, ls=":", label="naive step peak")
    if fr.min_peak_bytes is not None:
        ax.axhline(fr.min_peak_bytes / MIB, color="tab:green", lw=0.6, ls=":", label="min peak")
    for c in fr.smallest_cuts(10):
        ax.plot(c, fr.keep_bytes[c] / MIB, "o", color="tab:blue", ms=3)
    for c in cuts or []:
        ax.axvline(c, color="tab:red", lw=0.8, ls="--")
    ax.set_xlabel("cut (before node c, topological order)")
    ax.set_ylabel("MiB")
    ax.set_title(title or "frontier-width profile", fontsize=10, loc="left")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
