"""The report's plots (matplotlib, Agg): the memory timeline of one step per mode and the
frontier-width profile of a graph. The Pareto figure is `hbp.report.pareto.plot_pareto`; the style of all three is
`hbp.report.style`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from hbp.analysis.frontier import Frontier
from hbp.analysis.simulate import Simulation
from hbp.planner.plan import Plan
from hbp.report.style import (
    PHASE_ALPHA,
    PHASE_COLORS,
    mode_handles,
    mode_style,
    no_data,
    phase_handles,
    pyplot,
    save_figure,
)
from hbp.units import MIB


def _shade_phases(ax, phases: pd.Series, x: pd.Series) -> None:
    """Shade each run of equal phase between its first and last x."""
    start = 0
    values, xs = list(phases), list(x)
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            color = PHASE_COLORS.get(values[start], "#dddddd")
            ax.axvspan(xs[start], xs[i - 1] + 1, color=color, alpha=PHASE_ALPHA, lw=0)
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
    plt = pyplot()
    rows = max(1, len(timelines) + (planned is not None))
    fig, axes = plt.subplots(rows, 1, figsize=(9, 1.9 * rows + 1.0), squeeze=False)
    axes = axes[:, 0]
    top = max((float(t["live_bytes"].max()) for t in timelines.values() if len(t)), default=0)
    if planned is not None:
        top = max(top, float(planned.peak_bytes))
    if not timelines and planned is None:
        no_data(axes[0], "no memory timeline to draw (runs logged with logger=table or wandb)")
    for ax, (label, timeline) in zip(axes, timelines.items()):
        if timeline.empty:
            no_data(ax, f"{label}: no timeline recorded")
            continue
        style = mode_style(label)
        ax.plot(timeline["op_index"], timeline["live_bytes"] / MIB, lw=1.2, color=style["color"])
        _shade_phases(ax, timeline["phase"], timeline["op_index"])
        peak = timeline["live_bytes"].max() / MIB
        # the tracker's tensors (tensor_peak_bytes): the table's peak_bytes is the allocator's,
        # with kernel workspace
        ax.set_title(f"{label}: measured tensors, peak {peak:.2f} MiB", fontsize=9, loc="left")
        ax.set_ylim(0, top / MIB * 1.08 if top else 1)
        ax.set_ylabel("live tensors (MiB)")
        ax.set_xlabel("op index in the measured step", fontsize=8)
    if planned is not None:
        ax = axes[-1]
        events = pd.DataFrame(planned.timeline, columns=["event", "live_bytes"])
        events["phase"] = events["event"].str.split(":", n=1).str[0]
        x = pd.Series(range(len(events)))
        ax.plot(x, events["live_bytes"] / MIB, lw=1.2, color=mode_style("tiny")["color"])
        ax.set_ylim(0, top / MIB * 1.08 if top else 1)
        _shade_phases(ax, events["phase"], x)
        names = events["event"].str.split(":", n=1).str[1]
        forward = events["phase"] == "forward"
        cuts = plan.cut_points() if plan is not None else []
        firsts = {s.first for s in plan.segments[1:]} if plan is not None else set()
        for i in x[forward & names.isin(firsts)]:
            ax.axvline(i, color="#333333", lw=0.9, ls="--")
        ax.set_title(
            f"the plan, simulated: {len(cuts) + 1} top-level segments, "
            f"peak {planned.peak_bytes / MIB:.2f} MiB",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("live memory (MiB)")
        ax.set_xlabel("planner event (forward, recompute, backward)", fontsize=8)
    from matplotlib.lines import Line2D

    phases = {p for t in timelines.values() if len(t) for p in t["phase"].unique()}
    if planned is not None:
        phases |= {event.split(":", 1)[0] for event, _ in planned.timeline}
    handles = mode_handles(timelines) + phase_handles(p for p in PHASE_COLORS if p in phases)
    if planned is not None:
        handles.append(Line2D([], [], color="#333333", lw=0.9, ls="--", label="plan boundary"))
    for h in handles:
        if isinstance(h, Line2D) and h.get_marker() not in ("", "None", None):
            h.set_marker("")
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=4, frameon=False)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    legend_rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.03 + 0.022 * legend_rows * 4 / rows, 1, 0.97))
    return save_figure(fig, path)


def plot_frontier(
    fr: Frontier, path: str | Path, *, title: str = "", cuts: list[int] | None = None
) -> Path:
    """The frontier-width profile of a graph: for every cut of its topological order, the
    bytes a checkpoint there keeps (`keep_bytes`), the gradient bytes crossing it and what
    plain autograd holds across it; the cheapest cuts dotted, `cuts` (a plan's) dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    x = range(len(fr.keep_bytes))
    naive_color, tiny_color = mode_style("naive")["color"], mode_style("tiny")["color"]
    ax.plot(x, fr.naive_live_bytes / MIB, label="plain autograd: live across the cut",
            color=naive_color, lw=1.0, alpha=0.7)  # fmt: skip
    ax.plot(x, fr.grad_bytes / MIB, label="gradients crossing", color="#56B4E9", lw=1.0, ls="--")
    # drawn last and thicker: where the gradients equal it, "keep" stays visible
    ax.plot(x, fr.keep_bytes / MIB, label="keep (frontier width)", color=tiny_color, lw=1.8,
            zorder=3)  # fmt: skip
    # the captured graph's own plain step (with the chunked loss where tiny built it): not the
    # bench's naive (NOTE [ One naive per run ]), so not called naive here
    ax.axhline(fr.naive_peak_bytes / MIB, color=naive_color, lw=0.8, ls=":",
               label="this graph's plain step peak (simulated)")  # fmt: skip
    if fr.min_peak_bytes is not None:
        ax.axhline(fr.min_peak_bytes / MIB, color=tiny_color, lw=0.8, ls=":",
                   label="least peak the planner reaches")  # fmt: skip
    smallest = list(fr.smallest_cuts(10))
    ax.plot(smallest, fr.keep_bytes[smallest] / MIB, "o", color=tiny_color, ms=4, zorder=4,
            label="10 cheapest cuts")  # fmt: skip
    for i, c in enumerate(cuts or []):
        ax.axvline(c, color="#333333", lw=0.9, ls="--", label="the plan's cuts" if i == 0 else None)
    ax.set_xlabel("cut c (before node c of the topological order)")
    ax.set_ylabel("memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title or "frontier-width profile", fontsize=10, loc="left")
    fig.legend(loc="lower center", fontsize=8, ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return save_figure(fig, path)
