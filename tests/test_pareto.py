"""The Pareto report: ratios against naive, the front, and the files it writes."""

import json

import pytest

from hbp.report.pareto import write_pareto as write_report


def _run(root, name, mode, peak, time, budget=None, workload="gpt2", status="ok"):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {"mode": {"name": mode, **({"budget": budget} if budget is not None else {})}}
    row = {
        "status": status, "workload": workload, "mode": mode, "profile": "small",
        "peak_bytes": peak, "flops": 1e9, "step_time_s": time, "recompute_ratio": 0.0,
        "started_at": name, "config": config,
    }  # fmt: skip
    if mode == "tiny":
        row["mode_predicted_peak_bytes"] = peak * 0.98
    (run_dir / "metrics.json").write_text(json.dumps(row))


def test_ratios_front_and_files(tmp_path):
    runs = tmp_path / "runs"
    _run(runs, "a", "naive", 100 * 2**20, 1.0)
    _run(runs, "b", "checkpoint", 40 * 2**20, 1.3)
    _run(runs, "c", "tiny", 40 * 2**20, 1.2, budget=0.4)  # dominates checkpoint
    _run(runs, "d", "tiny", 20 * 2**20, 1.5, budget=0.2)
    _run(runs, "e", "naive", 10 * 2**20, 1.0, workload="resnet")

    table = write_report(runs, tmp_path / "report")
    gpt2 = table[table["workload"] == "gpt2"].set_index("mode")
    assert gpt2.loc["checkpoint", "peak / naive"] == pytest.approx(0.4)
    assert gpt2.loc["checkpoint", "time / naive"] == pytest.approx(1.3)
    assert gpt2.loc["tiny(budget=0.4)", "predicted MiB"] == pytest.approx(40 * 0.98)
    front = dict(zip(gpt2.index, gpt2["pareto"]))
    assert front == {
        "naive": True, "checkpoint": False, "tiny(budget=0.4)": True, "tiny(budget=0.2)": True,
    }  # fmt: skip
    for name in ("pareto.md", "pareto.csv", "pareto.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "tiny(budget=0.2)" in (tmp_path / "report" / "pareto.md").read_text()


def test_no_runs_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "empty", tmp_path / "out")


def test_report_draws_the_optimum_frontier(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from hbp.report.pareto import _plot_optimum

    runs, report = tmp_path / "runs", tmp_path / "report"
    _run(runs, "a", "naive", 100 * 2**20, 1.0)
    _run(runs, "b", "tiny", 40 * 2**20, 1.2, budget=0.4)
    optimum = pd.DataFrame(
        {
            "graphs": ["small", "small", "reduced"],
            "workload": ["gpt2"] * 3,
            "budget_bytes": [50, 30, 10],
            "naive_peak_bytes": [100, 100, 100],
            "best_found_ratio": [0.1, 0.3, 0.9],
            "bound_ratio": [0.05, None, 0.9],
            "planner_ratio": [0.1, 0.35, 0.9],
        }
    )
    report.mkdir()
    optimum.to_csv(report / "optimum.csv", index=False)
    write_report(runs, report)
    assert (report / "pareto.png").stat().st_size > 0

    fig, ax = plt.subplots()
    _plot_optimum(ax, optimum, "gpt2")  # the "small" graphs only, sorted by budget
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["MILP best found"].get_xdata()) == [0.3, 0.5]
    assert list(lines["MILP best found"].get_ydata()) == [0.3, 0.1]
    assert list(lines["MILP lower bound"].get_xdata()) == [0.5]  # no bound proven at 0.3
    assert list(lines["planner (predicted)"].get_ydata()) == [0.35, 0.1]
    plt.close(fig)
