"""Experiments and sweeps are configs: every `experiment=*` and `sweep=*` composes (Hydra
compose API) into a valid multirun, and a sweep is resumable: a second run into the same sweep
directory skips the finished jobs, `redo=true` reruns them, and a failed job is recorded with
its error while the others finish; parallel launchers give each job its share of the cores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from hbp import bench
from hbp.analysis.collect import collect
from hbp.bench.rundir import legacy_run_key

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
SWEEPS = sorted(p.stem for p in (CONF / "sweep").glob("*.yaml"))
TINY = ("steps=1", "warmup=0", "logger=none")


def hydra_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} interpolations
    return cfg


def run_py(*args: str, timeout: float = 600, threads_env: bool = True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    if not threads_env:  # let the bench choose torch threads from the launcher
        env.pop("OMP_NUM_THREADS")
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_documented_experiments_and_sweeps_exist():
    assert {"matrix_naive", "matrix_checkpoint", "matrix_tiny", "gpt2_medium"} <= set(EXPERIMENTS)
    assert {"block_size", "budget", "all_modes", "quick"} <= set(SWEEPS)


@pytest.mark.parametrize(
    "group, name", [("experiment", e) for e in EXPERIMENTS] + [("sweep", s) for s in SWEEPS]
)
def test_every_experiment_and_sweep_composes_into_a_valid_multirun(group, name, tmp_path):
    cfg = hydra_cfg(f"{group}={name}", f"output_root={tmp_path}", *TINY)
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert str(cfg.hydra.sweep.dir).startswith(str(tmp_path))  # a fixed dir: resumable
    assert "${run_key:}" in OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"]
    bench.validate(cfg)
    params = cfg.hydra.sweeper.params or {}
    for key, values in params.items():  # each swept value composes and validates too
        for value in str(values).split(","):
            bench.validate(hydra_cfg(f"{group}={name}", f"{key}={value}", *TINY))
    assert cfg.steps == 1  # the command line wins over the experiment's own values


def test_sweep_params_and_command_line_overrides():
    cfg = hydra_cfg("sweep=block_size", "profile=medium")
    assert cfg.mode.name == "checkpoint" and cfg.profile.name == "medium"
    assert cfg.hydra.sweeper.params["mode.block_size"] == "1,2,3,4,5,6"
    cfg = hydra_cfg("sweep=all_modes")
    assert set(cfg.hydra.sweeper.params.mode.split(",")) >= {"naive", "checkpoint", "tiny"}
    cfg = hydra_cfg("experiment=matrix_tiny")
    assert cfg.mode.name == "tiny" and cfg.verify is True
    assert "min" in cfg.hydra.sweeper.params["mode.budget"].split(",")


def test_run_key_ignores_bookkeeping_and_sees_every_measured_value():
    base = hydra_cfg("workload=synthetic_dag")
    assert bench.run_key(base) == bench.run_key(hydra_cfg("workload=synthetic_dag", "redo=true"))
    assert bench.run_key(base) == bench.run_key(
        hydra_cfg("workload=synthetic_dag", "output_root=/elsewhere")
    )
    assert bench.run_key(base) != bench.run_key(hydra_cfg("workload=synthetic_dag", "seed=1"))
    # NOTE [ Run keys ]: the logger says where results go, not what is measured; the keys
    # runs had with it in are still found
    wandb = hydra_cfg("workload=synthetic_dag", "logger=wandb")
    assert bench.run_key(wandb) == bench.run_key(base)
    assert legacy_run_key(wandb) != legacy_run_key(base) != bench.run_key(base)
    tiny = hydra_cfg("workload=synthetic_dag", "mode=tiny")
    for where in ("plan_cache=/caches/a", "mode.plan_cache=/caches/b"):  # where plans are kept
        assert bench.run_key(hydra_cfg("workload=synthetic_dag", "mode=tiny", where)) == (
            bench.run_key(tiny)
        )
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        task = compose("config", ["workload=synthetic_dag"])  # what the task function gets
    resolved = OmegaConf.to_container(task, resolve=True)  # metrics.json's `config`
    assert bench.run_key(resolved) == bench.run_key(task) == bench.run_key(base)


@pytest.mark.slow
def test_a_sweep_run_again_skips_finished_jobs_and_redo_reruns_them(tmp_path):
    args = (
        "sweep=block_size",
        "workload=synthetic_dag",
        "mode=tiny",
        *TINY,
        f"output_root={tmp_path}",
    )
    first = run_py(*args, "mode.block_size=1", "mode.budget=min,100")
    assert first.returncode == 1  # 100 bytes fit no plan: recorded, the other job finished
    assert "1 ran, 0 skipped" in first.stdout and "1 of 2 runs failed" in first.stderr
    sweep_dir = tmp_path / "sweeps" / "block_size"
    (failed,) = [p for p in sweep_dir.iterdir() if (p / "error.json").exists()]
    error = json.loads((failed / "error.json").read_text())
    assert error["error_type"] == "BudgetError" and "no plan fits" in error["error"]
    # a failed run says what a finished one says of itself: its key and the environment
    assert error["run_key"] and error["torch_version"] == torch.__version__ and "git_sha" in error
    (done,) = sweep_dir.glob("*/metrics.json")
    first_mtime = done.stat().st_mtime_ns
    record = done.parent / ".hydra" / "overrides.yaml"
    first_record = record.read_text()

    again = run_py("mode.block_size=1,2", *reversed(args))  # the same jobs, in another order
    assert again.returncode == 0, again.stderr
    assert "1 ran, 1 skipped" in again.stdout
    assert done.stat().st_mtime_ns == first_mtime  # not rerun
    # NOTE [ A skipped job's record ]: Hydra's record says which command made the numbers
    assert record.read_text() == first_record
    # another logger measures nothing else: skipped too (NOTE [ Run keys ])
    logged = run_py(*args, "mode.block_size=1", "logger=none")
    assert logged.returncode == 0 and "0 ran, 1 skipped" in logged.stdout, logged.stdout
    (done.parent / "stale.txt").write_text("from an earlier run")
    redo = run_py(*args, "mode.block_size=1", "redo=true")
    assert "1 ran, 0 skipped" in redo.stdout
    assert done.stat().st_mtime_ns > first_mtime
    # the job's directory holds this run's files only: its log says it ran, not "skipped"
    assert not (done.parent / "stale.txt").exists()
    log = next(done.parent.glob("*.log")).read_text()
    assert "skipped" not in log
    frame = collect(sweep_dir)
    assert sorted(frame["config.mode.block_size"]) == [1, 2]  # one row per key, no duplicates
    assert frame["run_key"].is_unique


def test_launcher_configs_compose():
    cfg = hydra_cfg("hydra/launcher=slurm", "hydra.launcher.partition=gpu")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"
    assert launcher.gpus_per_node == 1 and launcher.timeout_min > 0 and launcher.setup
    assert hydra_cfg("hydra/launcher=local").hydra.launcher._target_.endswith("LocalLauncher")
    assert hydra_cfg("hydra/launcher=joblib").hydra.launcher.n_jobs == -1


def test_threads_per_job_follow_the_launcher(monkeypatch):
    """joblib: the cores divided among n_jobs; submitit (local, slurm): cpus_per_task."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = min(len(os.sched_getaffinity(0)), bench.MAX_AUTO_THREADS)
    hydra_cfg("hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.mode=MULTIRUN")
    assert bench.parallel_jobs() == 2 and bench.launcher_cpus_per_task() is None
    assert bench.resolve_threads(None, bench.parallel_jobs()) == max(1, cpus // 2)
    hydra_cfg("hydra/launcher=local", "hydra.launcher.cpus_per_task=3", "hydra.mode=MULTIRUN")
    assert bench.parallel_jobs() == 1 and bench.launcher_cpus_per_task() == 3
    assert bench.resolve_threads(None, 1, per_job=bench.launcher_cpus_per_task()) == 3
    hydra_cfg("hydra/launcher=local", "hydra.launcher.cpus_per_task=3")  # a single run
    assert bench.launcher_cpus_per_task() is None and bench.parallel_jobs() == 1


@pytest.mark.slow
def test_submitit_local_launcher_runs_every_job_with_its_cpus_per_task(tmp_path):
    """Two jobs at once, each a submitit process with cpus_per_task=1 torch thread (the
    bench's own default would be every core, min(cpus, 16), in each job)."""
    result = run_py(
        "-m", "workload=synthetic_dag", "mode=naive,checkpoint", *TINY, "hydra/launcher=local",
        "hydra.launcher.cpus_per_task=1", f"output_root={tmp_path}", threads_env=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ran, 0 skipped" in result.stdout
    frame = collect(tmp_path)
    assert sorted(frame["mode"]) == ["checkpoint", "naive"]
    assert list(frame["threads"]) == [1, 1]
    assert list((tmp_path / "multirun").glob("*/*/.submitit"))  # it ran through submitit


@pytest.mark.slow
def test_an_experiment_runs_by_name_into_its_own_directory(tmp_path):
    """experiment=matrix_checkpoint (verify=true) on one workload, one step: its runs land in
    <output_root>/bench/matrix/checkpoint with gradients checked against plain autograd."""
    result = run_py(
        "experiment=matrix_checkpoint", "workload=synthetic_dag", *TINY, f"output_root={tmp_path}"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = collect(tmp_path / "bench" / "matrix" / "checkpoint").to_dict("records")
    assert row["mode"] == "checkpoint" and row["verify_passed"] is True
    assert row["threads"] == 1 and row["peak_bytes"] < row["naive_peak_bytes"]


def test_a_plan_cache_for_a_sweep_of_any_modes_is_read_by_the_next_run(tmp_path, capsys):
    """Top-level `plan_cache`: naive ignores it, tiny keeps its plan there; the next tiny run
    reads it, says so, and its label and key are those of a run without a cache."""
    rows = []
    for mode in ("naive", "tiny", "tiny"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(
                "config",
                ["workload=synthetic_dag", f"mode={mode}", *TINY, f"plan_cache={tmp_path}"],
            )
        rows.append(bench.run(cfg, tmp_path / "runs" / str(len(rows))))
    naive, first, again = rows
    assert "mode_plan_from_cache" not in naive
    assert (first["mode_plan_from_cache"], again["mode_plan_from_cache"]) == (False, True)
    assert again["peak_bytes"] == first["peak_bytes"] and again["run_key"] == first["run_key"]
    assert "read from the plan cache" in capsys.readouterr().out


def test_a_bad_value_in_a_sweep_list_stops_the_command_before_anything_runs(tmp_path):
    """NOTE [ Sweep lists checked up front ]: `mode.budget=0.5,abc` ran the 0.5 job, wrote
    error.json for abc and exited 1; now one line, exit code 2, nothing written."""
    done = run_py(
        "-m", "workload=synthetic_dag", "mode=tiny", "mode.budget=0.5,abc", *TINY,
        f"output_root={tmp_path}", f"hydra.sweep.dir={tmp_path}/sweeps/bad",
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith("error: mode.budget='abc' is not accepted")
    assert not (tmp_path / "sweeps").exists()
