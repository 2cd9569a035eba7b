"""The Pareto report: ratios against naive, the front, and the files it writes."""

import json

import pytest

from hbp.report.pareto import write_pareto as write_report


def _run(
    root, name, mode, peak, time, budget=None, workload="gpt2", status="ok", profile="small",
    device="cpu", arch=None,
):  # fmt: skip
    run_dir = root / name
    run_dir.mkdir(parents=True)
    config = {"mode": {"name": mode, **({"budget": budget} if budget is not None else {})}}
    config["workload"] = {"name": workload, "arch": arch}
    row = {
        "status": status, "workload": workload, "mode": mode, "profile": profile,
        "device": device, "peak_bytes": peak, "flops": 1e9, "step_time_s": time,
        "recompute_ratio": 0.0, "started_at": name, "config": config,
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


def test_runs_are_compared_within_their_profile_device_and_workload_config(tmp_path):
    """A directory of two profiles, two devices and two architectures of one workload: each
    setting has its own naive and its own front (NOTE [ Runs compared within one setting ]);
    a small profile's run does not push the other's off the front, and a bert run is not
    divided by a llama's naive time."""
    runs = tmp_path / "runs"
    _run(runs, "a", "naive", 100 * 2**20, 1.0)
    _run(runs, "b", "tiny", 40 * 2**20, 1.2, budget=0.4)
    _run(runs, "c", "naive", 2 * 2**20, 0.1, profile="tiny")
    _run(runs, "d", "tiny", 1 * 2**20, 0.2, budget=0.4, profile="tiny")
    _run(runs, "e", "naive", 100 * 2**20, 0.05, device="cuda")
    _run(runs, "f", "naive", 8 * 2**20, 2.0, workload="hf", arch="llama")
    _run(runs, "g", "naive", 6 * 2**20, 0.5, workload="hf", arch="bert")
    _run(runs, "h", "tiny", 3 * 2**20, 1.0, workload="hf", arch="bert", budget="min")

    table = write_report(runs, tmp_path / "report")
    by = {(row["workload"], row["mode"]): row for _, row in table.iterrows()}
    assert set(table["workload"]) == {
        "gpt2 (small, cpu)", "gpt2 (tiny, cpu)", "gpt2 (small, cuda)", "hf (arch=llama)",
        "hf (arch=bert)",
    }  # fmt: skip
    assert by["gpt2 (small, cpu)", "naive"]["pareto"]  # the tiny profile's run: another setting
    assert by["gpt2 (tiny, cpu)", "tiny(budget=0.4)"]["peak / naive"] == pytest.approx(0.5)
    assert by["gpt2 (small, cuda)", "naive"]["pareto"]
    bert = table[table["workload"] == "hf (arch=bert)"].set_index("mode")
    assert bert.loc["naive", "time / naive"] == pytest.approx(1.0)
    assert bert.loc["tiny(budget=min)", "time / naive"] == pytest.approx(2.0)


def test_the_pareto_module_runs_as_a_script_without_warnings(tmp_path):
    """NOTE [ The pareto module runs as a script ]: `python -m hbp.report.pareto` (the
    documented command) printed runpy's RuntimeWarning first."""
    import subprocess
    import sys

    runs = tmp_path / "runs"
    _run(runs, "a", "naive", 100 * 2**20, 1.0)
    _run(runs, "b", "checkpoint", 50 * 2**20, 1.3)
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "hbp.report.pareto", str(runs), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and (tmp_path / "out" / "pareto.md").exists()
