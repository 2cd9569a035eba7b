"""End to end: `python run.py ...` in a subprocess, as a user runs it.

One multirun of the four workloads x naive/checkpoint (profile small, one timed step, with
verify) backs most tests; a single run checks the table + wandb-offline outputs; bad input
checks the error contract (message, exit code, nothing written); a failing job in a multirun
must leave the other runs intact.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from hbp.analysis.collect import collect

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("gpt2", "resnet", "unet", "synthetic_dag")
FAST = ("profile=small", "steps=1", "warmup=0")


def run_py(*args: str, env: dict | None = None, timeout: float = 600):
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", **(env or {})}
    environ.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The README's multirun (plus verify=true, one timed step) into a fresh output root."""
    root = tmp_path_factory.mktemp("sweep")
    result = run_py(
        "-m",
        "workload=" + ",".join(WORKLOADS),
        "mode=naive,checkpoint",
        *FAST,
        "logger=none",
        "verify=true",
        f"output_root={root}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return root, result, collect(root)


def test_multirun_writes_one_metrics_file_per_run(sweep):
    root, result, frame = sweep
    paths = sorted((root / "multirun").glob("*/*/*/metrics.json"))
    assert len(paths) == 8
    names = sorted(p.parent.name.rsplit("_", 1)[0] for p in paths)
    assert names == sorted(f"{w}_{m}" for w in WORKLOADS for m in ("naive", "checkpoint"))
    assert len(frame) == 8 and set(frame["status"]) == {"ok"}
    assert "8 runs in" in result.stdout  # the sweep's summary table
    assert not any(p.suffix == ".parquet" for p in files_under(root))  # logger=none


@pytest.mark.parametrize("workload", WORKLOADS)
def test_checkpoint_uses_less_memory_and_more_flops_than_naive(sweep, workload):
    frame = sweep[2].set_index(["workload", "mode"])
    naive, ckpt = frame.loc[(workload, "naive")], frame.loc[(workload, "checkpoint")]
    assert ckpt["peak_bytes"] < naive["peak_bytes"]
    assert ckpt["flops"] > naive["flops"]
    assert ckpt["naive_flops"] == naive["flops"]
    assert ckpt["recompute_ratio"] == pytest.approx(ckpt["flops"] / naive["flops"] - 1)
    assert naive["recompute_ratio"] == 0


def test_gradients_of_every_run_match_plain_autograd(sweep):
    frame = sweep[2]
    assert (frame["grad_max_rel_error"] < 1e-4).all(), frame[
        ["workload", "mode", "grad_max_rel_error"]
    ]
    assert frame["verify_passed"].all()
    assert (frame.loc[frame["mode"] == "naive", "grad_max_rel_error"] == 0).all()


def test_metrics_json_has_the_summary_fields(sweep):
    root = sweep[0]
    path = next((root / "multirun").glob("*/*/gpt2_checkpoint_*/metrics.json"))
    row = json.loads(path.read_text())
    for key in (
        "workload",
        "mode",
        "profile",
        "device",
        "params",
        "peak_bytes",
        "peak_mib",
        "tensor_peak_bytes",
        "scratch_bytes",
        "flops",
        "recompute_ratio",
        "step_time_s",
        "step_time_p10",
        "step_time_p90",
        "samples_per_s",
        "tokens_per_s",
        "optimizer_step_s",
        "rss_peak_mb",
        "loss",
        "grad_max_rel_error",
        "verify_passed",
        "torch_version",
        "python_version",
        "hbp_version",
        "git_sha",
        "hostname",
        "threads",
        "config",
    ):
        assert key in row, key
    assert row["mode_num_segments"] == 2 and row["mode_segment_sizes"] == "2,2"
    assert row["device"] == "cpu" and row["threads"] == 1
    assert row["peak_mib"] == row["peak_bytes"] / 2**20
    assert row["samples_per_s"] == pytest.approx(
        row["workload_samples_per_batch"] / row["step_time_s"]
    )
    assert row["config"]["mode"] == {
        "name": "checkpoint",
        "segments": None,
        "block_size": None,
        "chunked_loss": False,
    }
    assert (path.parent / "config.yaml").exists()


@pytest.mark.slow
def test_single_run_with_tables_and_offline_wandb(tmp_path):
    result = run_py(
        "workload=synthetic_dag",
        "mode=checkpoint",
        "profile=small",
        "steps=2",
        "warmup=1",
        "logger=wandb",
        f"output_root={tmp_path}",
        env={"WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = (tmp_path / "runs").glob("*/*_synthetic_dag_checkpoint")
    assert "synthetic_dag" in result.stdout and "peak MiB" in result.stdout  # summary table
    assert f"wrote {run_dir}" in result.stdout  # where to look
    metrics = json.loads((run_dir / "metrics.json").read_text())
    steps = pd.read_parquet(run_dir / "steps.parquet")
    assert list(steps["phase"]) == ["warmup", "timed", "timed", "measured", "instrumented"]
    assert (steps["step_time_s"] > 0).all() and steps["loss"].notna().all()
    timeline = pd.read_parquet(run_dir / "memory_timeline.parquet")
    assert list(timeline.columns) == ["op_index", "live_bytes", "phase", "op"]
    assert timeline["live_bytes"].max() == metrics["tensor_peak_bytes"]
    assert metrics["peak_bytes"] == metrics["tensor_peak_bytes"] + metrics["scratch_bytes"]
    assert metrics["scratch_bytes"] >= 0
    assert set(timeline["phase"]) == {"forward", "backward"}
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb"))


BAD_INPUT = [
    (
        ["workload=bert"],
        2,
        ["workload='bert'", "diffusers_unet, gpt2, hf, resnet, synthetic_dag, unet"],
    ),
    (["mode=fast"], 2, ["mode='fast'", "checkpoint", "naive"]),
    (["profile=huge"], 2, ["profile='huge'", "large, medium, small"]),
    (["-m", "workload=gpt2,bert"], 2, ["workload='bert'", "gpt2, hf, resnet"]),
    (["stepz=3"], 2, ["stepz is not a key of this config", "steps, threads"]),
    (["mode=tiny", "mode.budgt=0.5"], 2, ["mode.budgt is not a key", "mode has", "budget"]),
    (["steps=0"], 2, ["steps=0", "an integer >= 1"]),
    (["-m", "warmup=-1"], 2, ["warmup=-1", "an integer >= 0"]),
    (["+workload.depth=3"], 2, ["workload.depth=3", "n_layer"]),
    # known once planned: the way out in the bench's own key, with no library default
    (
        ["workload=synthetic_dag", "mode=tiny", "mode.budget=0.01", "steps=1", "warmup=0"],
        2,
        ["no plan fits", "mode.budget=0.", "or more plans", "mode.budget='min'"],
    ),
]


@pytest.mark.parametrize(
    "args, code, expected", BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_bad_input_gets_one_clear_message_and_writes_nothing(tmp_path, args, code, expected):
    result = run_py(*args, "logger=none", f"output_root={tmp_path / 'out'}")
    assert result.returncode == code
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert files_under(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu(tmp_path):
    result = run_py("device=cuda", f"output_root={tmp_path}")
    assert result.returncode == 2
    assert "device='cuda'" in result.stderr and "auto or cpu" in result.stderr
    assert files_under(tmp_path) == []


def test_unwritable_output_root(tmp_path):
    (tmp_path / "file").write_text("")
    result = run_py(f"output_root={tmp_path / 'file' / 'out'}")
    assert result.returncode == 2
    assert "output_root=" in result.stderr and "writable directory" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.slow
def test_a_failing_job_leaves_the_rest_of_the_sweep_intact(tmp_path):
    result = run_py(
        "-m",
        "workload=synthetic_dag",
        "mode=tiny",
        "mode.budget=min,100,1.0",  # 100 bytes: no plan fits, known only once the job runs
        *FAST,
        "logger=none",
        f"output_root={tmp_path}",
    )
    assert result.returncode == 1
    assert "2 ran, 0 skipped" in result.stdout and "1 of 3 runs failed: " in result.stderr
    (sweep_dir,) = (tmp_path / "multirun").glob("*/*")
    (failed,) = [p for p in sweep_dir.iterdir() if (p / "error.json").exists()]
    assert f"{failed.name} (budget 100)" in result.stderr  # which of the sweep's jobs
    assert f"failed: {failed.name} " in result.stderr
    assert not (failed / "metrics.json").exists()
    error = json.loads((failed / "error.json").read_text())
    assert error["error_type"] == "BudgetError" and "no plan fits" in error["error"]
    frame = collect(tmp_path)
    assert sorted(map(str, frame["config.mode.budget"])) == ["1.0", "min"]
    assert len(collect(tmp_path, include_errors=True)) == 3
