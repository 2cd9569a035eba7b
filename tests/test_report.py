"""`python -m hbp.report <dir>`: every run under <dir> (failed ones too) in results.parquet,
the comparison table per workload with ratios to naive, and the three plots."""

import math
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from hbp import bench
from hbp.errors import ConfigError
from hbp.report import write_report
from hbp.report.__main__ import main
from hbp.telemetry.tables import write_error

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def bench_run(root: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", ["steps=1", "warmup=0", "logger=table", *overrides])
    name = "_".join(o.split("=")[1] for o in overrides)
    return bench.run(cfg, root / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """naive, checkpoint and tiny on synthetic_dag, naive on gpt2 (tables on), one failure."""
    root = tmp_path_factory.mktemp("report")
    for mode in ("naive", "checkpoint", "tiny"):
        bench_run(root, "workload=synthetic_dag", f"mode={mode}")
    bench_run(root, "workload=gpt2", "mode=naive", "logger=none")
    write_error(
        root / "failed",
        ConfigError("mode.budget", 0.01, "a budget >= the minimum"),
        {"workload": "synthetic_dag", "mode": "tiny", "mode_budget": 0.01},
    )
    return root


def test_report_writes_parquet_table_and_plots(runs, capsys):
    assert main([str(runs)]) == 0
    out = capsys.readouterr().out
    assert "4 finished runs, 1 failed" in out
    # its directory, its mode and budget (a sweep's directory names carry a key only), its error
    assert "failed: failed (tiny, budget 0.01): mode.budget=0.01 is not accepted" in out
    assert "## synthetic_dag" in out and "## gpt2" in out
    results = pd.read_parquet(runs / "results.parquet")
    assert len(results) == 5 and (results["status"] == "error").sum() == 1
    assert set(results["mode"]) == {"naive", "checkpoint", "tiny"}
    for name in ("pareto.png", "memory_timeline_synthetic_dag.png", "frontier_synthetic_dag.png"):
        assert (runs / name).read_bytes()[:8] == PNG, name
        assert (runs / name).stat().st_mode & 0o777 == 0o666 & ~current_umask(), name
    assert "skipped memory_timeline_gpt2.png: no run with a timeline" in out


def current_umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_report_draws_only_the_workloads_named(runs, tmp_path, capsys):
    assert main([str(runs), "--out", str(tmp_path), "--workload", "synthetic_dag"]) == 0
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    assert written == [
        "frontier_synthetic_dag.png",
        "memory_timeline_synthetic_dag.png",
        "pareto_synthetic_dag.png",  # the whole directory's pareto.png is not replaced
    ]
    assert main([str(runs), "--out", str(tmp_path), "--workload", "resnet"]) == 2
    assert "no finished run of workload resnet" in capsys.readouterr().err


def test_a_run_key_run_twice_is_reported_once_and_the_header_counts_agree(runs, tmp_path, capsys):
    """Two sweeps of the same configs under one directory: each key is reported once (its
    latest run) and the header says how many repeats were left out; with --workload, how many
    rows the tables show."""
    import json
    import shutil

    both = tmp_path / "both"
    shutil.copytree(runs, both / "a")
    shutil.copytree(runs, both / "b")
    again = next((both / "b").glob("*naive*/metrics.json"))
    metrics = json.loads(again.read_text())
    metrics["started_at"] = "9999-01-01T00:00:00"  # the later run of its key
    again.write_text(json.dumps(metrics))
    assert main([str(both), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "4 finished runs, 4 older runs of the same run key left out, 2 failed" in out, out
    report = write_report(both, tmp_path / "out")
    naive = report.runs[report.runs["mode"] == "naive"]
    assert again.parent.name in set(naive["run_dir"].map(lambda p: Path(p).name))
    assert str(again.parent) in set(naive["run_dir"])
    assert main([str(both), "--out", str(tmp_path / "out"), "--workload", "gpt2"]) == 0
    assert "4 finished runs (1 in the tables)" in capsys.readouterr().out


def test_comparison_table_has_ratios_to_naive(runs):
    report = write_report(runs, runs / "elsewhere")
    table = report.table.set_index(["workload", report.table["mode"].str.split("(").str[0]])
    dag = table.loc["synthetic_dag"]
    assert dag.loc["naive", "peak / naive"] == 1 and dag.loc["naive", "time / naive"] == 1
    assert dag.loc["checkpoint", "peak / naive"] < 1 and dag.loc["tiny", "peak / naive"] < 1
    assert dag.loc["checkpoint", "recompute ratio"] > 0
    assert dag.loc["tiny", "budget"] == "min" and dag.loc["naive", "budget"] == "-"
    # what tiny's budget came to, beside the peak it bounds ("min": the predicted peak)
    assert dag.loc["tiny", "budget MiB"] == pytest.approx(dag.loc["tiny", "predicted MiB"])
    assert math.isnan(dag.loc["naive", "budget MiB"])
    # the measured peak against the budget, beside it
    assert dag.loc["tiny", "peak / budget"] == pytest.approx(
        dag.loc["tiny", "peak MiB"] / dag.loc["tiny", "budget MiB"]
    )
    assert dag.loc["tiny", "peak / budget"] <= 1.001 and math.isnan(
        dag.loc["naive", "peak / budget"]
    )
    assert {"budget", "peak MiB", "recompute ratio", "step ms", "time / naive"} <= set(table)
    assert not [name for name in report.skipped if "synthetic_dag" in name]
    # one timed step: no p10-p90 range; synthetic_dag has no LM head: no chunked_loss in labels
    assert set(dag["p10-p90 ms"]) == {"-"}
    assert not any("chunked_loss" in label for label in report.table["mode"])
    assert (runs / "elsewhere" / "results.parquet").exists()


def test_report_of_an_empty_or_missing_dir_is_an_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_plots_without_timelines_or_graphs_are_skipped_with_a_reason(runs, tmp_path):
    only = tmp_path / "gpt2_naive"
    only.mkdir()
    (only / "metrics.json").write_text((runs / "gpt2_naive_none" / "metrics.json").read_text())
    report = write_report(tmp_path)
    assert "no run with a timeline" in report.skipped["memory_timeline_gpt2.png"]
    assert "graph.json" in report.skipped["frontier_gpt2.png"]
    assert (tmp_path / "pareto.png").exists()


def test_a_naive_run_measures_its_own_naive_reference(tmp_path):
    """The naive reference is a plain step on a copy, measured as the run's own steps are:
    a naive run is 1.000 of it, also where the parameters' gradients are most of the step
    (profile tiny), which a reference step that also copied the gradients doubled."""
    row = bench_run(tmp_path, "workload=gpt2", "mode=naive", "profile=tiny", "logger=none")
    assert row["naive_peak_bytes"] == row["peak_bytes"] and row["peak_vs_naive"] == 1.0
