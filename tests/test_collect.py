"""hbp.analysis.collect: every run's metrics.json under a root as one DataFrame."""

import math

import pytest

from hbp.analysis.collect import collect, main, results_table, to_markdown
from hbp.telemetry.tables import write_error, write_metrics
from hbp.units import MIB


def make_run(root, name, workload, mode, peak_mib, flops, started, **mode_params):
    run_dir = root / name
    run_dir.mkdir(parents=True)
    ratio = 0.0 if mode == "naive" else 0.25
    write_metrics(
        run_dir,
        {
            "status": "ok",
            "workload": workload,
            "mode": mode,
            "profile": "small",
            "peak_bytes": int(peak_mib * MIB),
            "flops": flops,
            "recompute_ratio": ratio,
            "step_time_s": 0.01,
            "started_at": started,
            "config": {
                "workload": {"name": workload, "n_layer": None},
                "mode": {"name": mode, **mode_params},
                "steps": 1,
            },
        },
    )
    return run_dir


@pytest.fixture
def runs(tmp_path):
    make_run(
        tmp_path / "a",
        "1_gpt2_checkpoint",
        "gpt2",
        "checkpoint",
        10,
        150,
        "2025-01-01T00:00:02",
        segments=2,
    )
    make_run(tmp_path / "a", "0_gpt2_naive", "gpt2", "naive", 40, 100, "2025-01-01T00:00:01")
    make_run(
        tmp_path / "b" / "deeper", "0_resnet_naive", "resnet", "naive", 8, 50, "2025-01-01T00:00:03"
    )
    return tmp_path


def test_collect_finds_every_run_and_flattens_the_config(runs):
    frame = collect(runs)
    assert list(frame["mode"]) == ["naive", "checkpoint", "naive"]  # by start time
    assert list(frame["workload"]) == ["gpt2", "gpt2", "resnet"]
    assert frame.loc[1, "config.mode.segments"] == 2
    assert math.isnan(frame.loc[0, "config.mode.segments"])
    assert set(frame["config.steps"]) == {1}
    assert frame.loc[2, "run_dir"] == str(runs / "b" / "deeper" / "0_resnet_naive")
    assert "config" not in frame.columns


def test_failed_runs_only_on_request(runs):
    failed = runs / "a" / "2_unet_naive"
    failed.mkdir()
    write_error(failed, RuntimeError("out of memory"), {"workload": "unet", "mode": "naive"})
    assert len(collect(runs)) == 3
    frame = collect(runs, include_errors=True)
    assert len(frame) == 4
    row = frame[frame["status"] == "error"].iloc[0]
    assert (row["workload"], row["error_type"], row["error"]) == (
        "unet",
        "RuntimeError",
        "out of memory",
    )


def test_unreadable_metrics_are_skipped_with_a_warning(runs):
    broken = runs / "a" / "3_half_written"
    broken.mkdir()
    (broken / "metrics.json").write_text('{"workload": "gp')
    with pytest.warns(UserWarning, match="3_half_written"):
        frame = collect(runs)
    assert len(frame) == 3


def test_empty_and_missing_roots(tmp_path):
    assert collect(tmp_path).empty
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        collect(tmp_path / "nope")


def test_results_table_relates_each_run_to_naive(runs):
    table = results_table(collect(runs))
    assert list(table["mode"]) == ["naive", "checkpoint(segments=2)", "naive"]
    assert list(table["peak / naive"]) == [1.0, 0.25, 1.0]
    assert list(table["peak MiB"]) == [40.0, 10.0, 8.0]
    markdown = to_markdown(table)
    lines = markdown.splitlines()
    assert lines[0].startswith("| workload | mode | peak MiB | peak / naive |")
    assert lines[1].startswith("|---|---|---:|")
    assert "| gpt2 | checkpoint(segments=2) | 10.00 | 0.250 |" in lines[3]


def test_command_line(runs, capsys):
    assert main([str(runs), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 5 and "| resnet | naive |" in out
    assert main([str(runs / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_runs_of_other_threads_seeds_or_code_are_compared_apart_and_named(tmp_path):
    """NOTE [ Runs compared within one setting ]: a 2-thread run from another commit is not
    divided by the 1-thread naive of this one; the labels say what differs, and the
    provenance line names every commit (dirty where it was)."""
    from hbp.analysis.collect import naive_reference, provenance, setting_labels
    from hbp.telemetry.tables import read_json

    a = make_run(tmp_path, "a", "gpt2", "naive", 40, 100, "2025-01-01T00:00:01")
    b = make_run(tmp_path, "b", "gpt2", "naive", 40, 100, "2025-01-01T00:00:02")
    c = make_run(tmp_path, "c", "gpt2", "checkpoint", 10, 150, "2025-01-01T00:00:03")
    for run_dir, threads, sha, dirty, time in (
        (a, 1, "15ff5e76743a9b54", False, 0.1),
        (b, 2, "018bdb31f34b783c", True, 1.5),
        (c, 2, "018bdb31f34b783c", True, 1.8),
    ):
        row = read_json(run_dir / "metrics.json")
        row.update(threads=threads, git_sha=sha, git_dirty=dirty, step_time_s=time)
        write_metrics(run_dir, row)
    runs = collect(tmp_path).sort_values("started_at")
    assert list(setting_labels(runs)) == [
        "gpt2 (threads=1, git_sha=15ff5e7674, git_dirty=False)",
        "gpt2 (threads=2, git_sha=018bdb31f3, git_dirty=True)",
        "gpt2 (threads=2, git_sha=018bdb31f3, git_dirty=True)",
    ]
    assert list(naive_reference(runs, "step_time_s")) == [0.1, 1.5, 1.5]
    assert provenance(runs) == "3 runs; git_sha 15ff5e7674, 018bdb31f3 (dirty)"
