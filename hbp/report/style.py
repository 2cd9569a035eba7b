"""The bench's visual language, used by every figure (the report, the wandb logger, the
notebooks): one colour and one marker per mode, the same in every panel and every file; the
phases of a step shaded the same way; one legend per figure; figures saved atomically with
the umask's permissions.

    from hbp.report.style import mode_style, mode_handles
    ax.plot(x, y, **mode_style("tiny"))            # colour, marker, line style of mode tiny
    fig.legend(handles=mode_handles(["naive", "tiny"]), ...)

A mode of another framework ("jax tiny") keeps its mode's colour and marker, drawn hollow
with a dashed line, so a JAX point sits beside its torch twin and is told apart at a glance.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hbp.analysis.collect import NOISY_SPREAD

__all__ = [
    "MODE_COLORS",
    "MODE_MARKERS",
    "NOISY_SPREAD",
    "PHASE_COLORS",
    "mode_color",
    "mode_handles",
    "mode_style",
    "no_data",
    "phase_handles",
    "pyplot",
    "save_figure",
]

# Colour-blind-safe (Okabe-Ito) colours: fixed per mode, never from matplotlib's cycle.
MODE_COLORS: dict[str, str] = {
    "naive": "#000000",
    "checkpoint": "#0072B2",
    "tiny": "#D55E00",
    "sac": "#CC79A7",
    "compile_budget": "#009E73",
    "library_checkpoint": "#E69F00",
}
MODE_MARKERS: dict[str, str] = {
    "naive": "s",
    "checkpoint": "^",
    "tiny": "o",
    "sac": "D",
    "compile_budget": "v",
    "library_checkpoint": "P",
}
OTHER_COLOR = "#777777"
OTHER_MARKER = "X"
# Shading of a step's phases on timelines: light, so the mode's line stays readable over it.
PHASE_COLORS: dict[str, str] = {
    "forward": "#56B4E9",
    "recompute": "#F0E442",
    "backward": "#999999",
}
PHASE_ALPHA = 0.18
# A run's step time is "noisy" when its p90 / p10 is above NOISY_SPREAD: drawn hollow with
# its p10-p90 range, flagged in the tables, and never put on a Pareto front by its time.


def _mode_name(mode: str) -> tuple[str, bool]:
    """("tiny", False) for "tiny" or "tiny(budget=0.3)"; ("tiny", True) for "jax tiny"."""
    family = str(mode).split("(", 1)[0].strip()
    parts = family.split()
    return parts[-1], len(parts) > 1 and parts[0] != "torch"


def mode_color(mode: str) -> str:
    return MODE_COLORS.get(_mode_name(mode)[0], OTHER_COLOR)


def mode_style(mode: str) -> dict:
    """Keyword arguments of `Axes.plot` for `mode`'s points and line: colour, marker, line
    style; another framework's ("jax tiny") hollow and dashed."""
    name, other_framework = _mode_name(mode)
    color = mode_color(name)
    style = {
        "color": color,
        "marker": MODE_MARKERS.get(name, OTHER_MARKER),
        "markersize": 7,
        "markeredgecolor": color,
        "linestyle": "--" if other_framework else "-",
        "linewidth": 1.2,
    }
    if other_framework:
        style["markerfacecolor"] = "white"
    return style


def mode_handles(modes: Iterable[str]):
    """Legend handles, one per mode (in the order given, duplicates dropped)."""
    from matplotlib.lines import Line2D

    return [
        Line2D([], [], label=mode, **mode_style(mode)) for mode in dict.fromkeys(map(str, modes))
    ]


def phase_handles(phases: Iterable[str] = ("forward", "recompute", "backward")):
    from matplotlib.patches import Patch

    return [
        Patch(facecolor=PHASE_COLORS[p], alpha=PHASE_ALPHA * 2, label=f"{p} (shaded)")
        for p in phases
    ]


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def no_data(ax, message: str) -> None:
    """A panel that has nothing to draw says why in its middle (never a blank panel)."""
    ax.text(
        0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", fontsize=9,
        wrap=True, color="#444444",
        bbox={"boxstyle": "round", "facecolor": "#f3f3f3", "edgecolor": "#bbbbbb"},
    )  # fmt: skip
    ax.set_xticks([])
    ax.set_yticks([])


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save `fig` as a PNG at `path` (atomically, with the umask's permissions) and close it."""
    from hbp.telemetry.tables import atomic_write

    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        plt.close(fig)
    return path
