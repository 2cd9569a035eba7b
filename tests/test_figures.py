"""The bench's figures, read back as pixels: every mode in its one colour in every panel, one
legend, no blank panel (a directory without a naive run is drawn in MiB, not left empty),
timelines in their mode's colour over the phase shading, the frontier's "keep" line on top."""

import json

import matplotlib.image
import numpy as np
import pandas as pd
import pytest

from hbp.analysis.collect import collect
from hbp.analysis.pareto import pareto_table
from hbp.report.pareto import plot_pareto
from hbp.report.plots import plot_frontier, plot_memory_timeline
from hbp.report.style import MODE_COLORS, mode_style
from hbp.units import MIB


def colour_mask(image: np.ndarray, colour: str, tolerance: float = 0.03) -> np.ndarray:
    """Pixels of `image` (RGB(A) floats in [0, 1]) within `tolerance` of `colour` (#rrggbb)."""
    rgb = np.array([int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return (np.abs(image[..., :3] - rgb) <= tolerance).all(axis=-1)


def has_colour(image: np.ndarray, colour: str, at_least: int = 6) -> bool:
    return int(colour_mask(image, colour).sum()) >= at_least


def ink(image: np.ndarray) -> float:
    """The fraction of pixels that are not white."""
    return float((image[..., :3] < 0.97).any(axis=-1).mean())


def write_run(root, name, workload, mode, peak_mib, time_s, *, naive_mib=None, **params):
    run = root / name
    run.mkdir(parents=True)
    row = {
        "status": "ok", "workload": workload, "mode": mode, "profile": "small", "steps": 3,
        "peak_bytes": peak_mib * MIB, "flops": 1e9, "step_time_s": time_s,
        "step_time_p10": time_s * 0.95, "step_time_p90": time_s * 1.05,
        "recompute_ratio": 0.0 if mode == "naive" else 0.3 * (1 - peak_mib / 100),
        "started_at": name, "config": {"mode": {"name": mode, **params}},
    }  # fmt: skip
    if naive_mib is not None:
        row["naive_peak_bytes"] = naive_mib * MIB
    (run / "metrics.json").write_text(json.dumps(row))


@pytest.fixture
def sweep(tmp_path):
    """naive, checkpoint and tiny at two budgets on two workloads."""
    root = tmp_path / "sweep"
    for workload, scale in (("gpt2", 1.0), ("resnet", 2.0)):
        write_run(root, f"{workload}_n", workload, "naive", 100 * scale, 1.0)
        write_run(root, f"{workload}_c", workload, "checkpoint", 45 * scale, 1.3, block_size=2)
        for budget in (0.5, 0.3):
            write_run(
                root, f"{workload}_t{budget}", workload, "tiny", 100 * budget * scale,
                1.1 + budget, budget=budget,
            )  # fmt: skip
    return root


def test_pareto_figure_has_each_mode_in_its_colour_in_every_panel(sweep, tmp_path):
    table = pareto_table(collect(sweep))
    image = matplotlib.image.imread(plot_pareto(table, tmp_path / "pareto.png"))
    height, width = image.shape[:2]
    panels = image[: int(height * 0.88)]  # above the one legend
    legend = image[int(height * 0.9) :]
    for column in (panels[:, : width // 2], panels[:, width // 2 :]):
        top, bottom = column[: len(column) // 2], column[len(column) // 2 :]
        for mode in ("naive", "checkpoint", "tiny"):
            assert has_colour(top, MODE_COLORS[mode]), mode
        for mode in ("checkpoint", "tiny"):  # naive's recompute is 0: on the axis line
            assert has_colour(bottom, MODE_COLORS[mode]), mode
    for mode in ("naive", "checkpoint", "tiny"):  # one legend, below the panels
        assert has_colour(legend, MODE_COLORS[mode], at_least=3), mode


def test_a_directory_without_naive_is_drawn_in_mib_not_left_blank(tmp_path):
    root = tmp_path / "block_size"
    for size in (1, 2, 3):
        write_run(root, f"c{size}", "gpt2", "checkpoint", 40 + 10 * size, 1 + 0.1 * size,
                  block_size=size)  # fmt: skip
    table = pareto_table(collect(root))
    assert table["peak / naive"].isna().all()
    image = matplotlib.image.imread(plot_pareto(table, tmp_path / "pareto.png"))
    top = image[: image.shape[0] // 2]
    assert has_colour(top, MODE_COLORS["checkpoint"], at_least=30)
    assert ink(image) > 0.03


def test_runs_with_their_own_naive_are_drawn_relative_without_a_naive_run(tmp_path):
    root = tmp_path / "block_size"
    for size in (1, 2):
        write_run(root, f"c{size}", "gpt2", "checkpoint", 40 + 10 * size, 1.0, naive_mib=100,
                  block_size=size)  # fmt: skip
    table = pareto_table(collect(root))
    assert list(table["peak / naive"]) == pytest.approx([0.5, 0.6])
    assert table["time / naive"].isna().all()  # no naive run: no naive time


def test_timeline_panels_are_drawn_in_their_modes_colours(tmp_path):
    ops = np.arange(60)
    phase = np.where(ops < 30, "forward", "backward")

    def timeline(scale):
        live = np.where(ops < 30, ops, 60 - ops) * scale * MIB
        return pd.DataFrame({"op_index": ops, "live_bytes": live, "phase": phase})

    path = plot_memory_timeline(
        {"naive": timeline(1.0), "tiny(budget=0.3)": timeline(0.3)}, tmp_path / "timeline.png"
    )
    image = matplotlib.image.imread(path)
    height = image.shape[0]
    first, second = image[: int(height * 0.45)], image[int(height * 0.45) : int(height * 0.85)]
    assert has_colour(first, MODE_COLORS["naive"]) and not has_colour(first, MODE_COLORS["tiny"])
    assert has_colour(second, MODE_COLORS["tiny"])


def test_an_empty_timeline_says_so_instead_of_a_blank_panel(tmp_path):
    image = matplotlib.image.imread(plot_memory_timeline({}, tmp_path / "empty.png"))
    assert ink(image) > 0.005  # the message and its box


def test_frontier_keep_line_is_visible_over_the_gradients(tmp_path):
    from hbp.analysis.frontier import frontier
    from hbp.graph import synthetic

    graph = synthetic.random_dag(12, seed=3, alias_prob=0.0)
    fr = frontier(graph)
    fr.grad_bytes = fr.keep_bytes.copy()  # the case where "keep" used to hide
    image = matplotlib.image.imread(plot_frontier(fr, tmp_path / "frontier.png", cuts=[4]))
    assert has_colour(image[: int(image.shape[0] * 0.8)], mode_style("tiny")["color"], 40)


def test_another_frameworks_points_keep_the_modes_colour_hollow():
    torch_style, jax_style = mode_style("tiny"), mode_style("jax tiny")
    assert torch_style["color"] == jax_style["color"] == MODE_COLORS["tiny"]
    assert jax_style["markerfacecolor"] == "white" and jax_style["linestyle"] == "--"
