"""`make gpu-check` (experiments/gpu_check.py) where there is no GPU: it stops at once without
one, names a missing package, judges rows by the stated tolerances and budget slack, and with
--cpu runs every check on tiny shapes and writes a JSON file and a markdown table that say what
was measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "experiments"))

import gpu_check  # noqa: E402
from gpu_checks import report  # noqa: E402

from hbp.units import MIB  # noqa: E402


def _run(*args: str, timeout: float = 900, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", **env_vars)
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_without_cuda_it_stops_at_once_with_one_line_and_status_2(tmp_path):
    done = _run("--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == gpu_check.EXIT_NO_CUDA == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpu_check: no CUDA device visible") and "--cpu" in line
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_a_missing_package_is_named_with_status_3(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "REQUIRED", ("torch", "no_such_package_for_gpu_check"))
    status, _ = gpu_check.preflight(cpu=True)
    assert status == gpu_check.EXIT_MISSING == 3
    message = capsys.readouterr().err
    assert "cannot import no_such_package_for_gpu_check" in message and "WHEELS" in message


@pytest.mark.slow
def test_a_check_past_its_time_limit_is_ended_and_recorded_and_the_others_still_run(tmp_path):
    """The hanging check (a test hook) and its child are killed at the run's deadline; its row
    done before the hang is kept; DDP (no process) is still reported; the run exits 1."""
    started = time.perf_counter()
    done = _run("--cpu", "--only", "chunked_ce", "ddp", "--time-limit", "20", "--out",
                str(tmp_path), timeout=300, GPU_CHECK_HANG="chunked_ce")  # fmt: skip
    assert time.perf_counter() - started < 150
    assert done.returncode == gpu_check.EXIT_FAILED == 1
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    hung = checks["chunked_ce"]
    assert hung["error"].startswith("timeout: still running after")
    assert [r["variant"] for r in hung["rows"]] == ["before the hang"]
    assert checks["ddp"]["rows"][0]["status"] == "skipped"
    sleepers = subprocess.run(["pgrep", "-f", "time.sleep\\(3600\\)"], capture_output=True)
    assert sleepers.stdout.strip() == b"", "the hanging check's child outlived it"


def _row(**fields) -> dict:
    return {"variant": "hbp@0.5", "dtype": "float32", "status": "ok", **fields}


def test_rows_fail_on_gradient_mismatch_nan_and_peak_over_budget():
    assert report.row_failures(_row(grad_diff=0.9e-3, peak_bytes=105, budget_bytes=100)) == []
    (grad,) = report.row_failures(_row(grad_diff=2e-3))
    assert "gradient difference 0.002 > 0.001 (float32)" in grad
    assert report.row_failures(_row(grad_diff=2e-3, dtype="bfloat16")) == []  # bf16: 3e-2
    assert report.row_failures(_row(grad_diff=math.nan))
    (peak,) = report.row_failures(_row(peak_bytes=106 * MIB, budget_bytes=100 * MIB))
    assert "peak 106.0 MiB > 1.05x budget 100.0 MiB (1.060x)" in peak
    # Reported, not failed: no plan for the budget, a variant that does not apply, no devices.
    for status in ("infeasible", "n/a", "skipped"):
        assert report.row_failures(_row(status=status)) == []
    assert report.row_failures(_row(status="error", error="RuntimeError: boom"))


def test_every_hbp_row_is_held_to_a_budget_in_bytes_but_min():
    """A fraction of the naive row's measured peak, bytes as given, an "N%act" budget as hbp
    resolved it; "min" has none. The bf16 and compile checks pass their fraction, not their
    variant's name (a name gave no budget, and their peaks went unjudged)."""
    from types import SimpleNamespace

    from gpu_checks import extras
    from gpu_checks.models import plan_fields

    plan = SimpleNamespace(predicted_peak_bytes=90, predicted_recompute_flops=0, budget_bytes=95)
    hc = SimpleNamespace(plan=plan, budget_bytes=100)
    naive = {"peak_bytes": 1000}
    budgets = {extras.BUDGET: 1000 * extras.BUDGET, 0.3: 300, 4096: 4096, "50%act": 100}
    for budget, expected in budgets.items():
        assert plan_fields(hc, budget, naive)["budget_bytes"] == expected, budget
    assert plan_fields(hc, "min", naive)["budget_bytes"] is None


def test_a_check_fails_on_its_own_error_and_on_unmeasured_kernel_workspace(tmp_path):
    workspace = {"granularity": "op", "ops": {}, "unmeasured": ["Conv2d (conv_1)"]}
    document = {
        "device": "cuda",
        "environment": {},
        "checks": {
            "good": {"rows": [_row(grad_diff=0.0)]},
            "timed_out": {"rows": [_row(grad_diff=0.0)], "error": "timeout: still running"},
            "workspace": {"rows": [_row(grad_diff=0.0, workspace=workspace)]},
        },
    }
    report.summarize(document)
    assert document["failed"] == ["timed_out", "workspace"] and not document["ok"]
    assert (
        "no kernel workspace measured for Conv2d (conv_1)"
        in document["checks"]["workspace"]["failures"]
    )
    json_path, md_path = report.write(document, tmp_path)
    assert json.loads(json_path.read_text())["failed"] == ["timed_out", "workspace"]
    table = md_path.read_text()
    assert table.startswith("# gpu check: FAILED")
    assert "| " + " | ".join(report.COLUMNS) + " |" in table
    assert "NOT measured: Conv2d (conv_1)" in table


@pytest.mark.slow
def test_cpu_run_measures_and_writes_json_and_table(tmp_path):
    """Four checks on CPU (tiny shapes; the full --cpu run takes minutes on a shared machine):
    GPT-2 under every variant with gradients equal to plain autograd's, hbp's peak within its
    budget (at the uniform checkpointing's peak with less recompute) and every kernel's
    workspace measured; the chunked loss against the plain one; DDP skipped with a line saying
    why; Trainer on `hbp.enable(model)` with the plain Trainer's losses and gradients, its
    peak within the default budget's bytes."""
    only = ("gpt2_small", "chunked_ce", "ddp", "trainer")
    done = _run("--cpu", "--only", *only, "--out", str(tmp_path))
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    document = json.loads((tmp_path / "gpu_check.json").read_text())
    assert document["ok"] and document["failed"] == [] and document["device"] == "cpu"
    checks = document["checks"]
    assert list(checks) == list(only)
    rows = {r["variant"]: r for r in checks["gpt2_small"]["rows"]}
    assert list(rows) == [
        "naive", "checkpoint", "library", "hbp@0.5", "hbp@0.3", "hbp@min", "hbp@50%act",
        "hbp@baseline",
    ]  # fmt: skip
    naive = rows["naive"]
    assert naive["status"] == "ok" and naive["peak_bytes"] > 0 and naive["flops"] > 0
    assert rows["library"]["status"] == "n/a"  # hbp's own GPT-2 has no library checkpointing
    for variant in ("checkpoint", "hbp@0.5", "hbp@min"):
        row = rows[variant]
        assert row["status"] == "ok", row
        assert row["grad_diff"] <= report.TOLERANCE["float32"]
        assert row["recompute_flops"] >= 0 and row["peak_bytes"] < naive["peak_bytes"]
    hc = rows["hbp@0.5"]
    assert hc["budget_bytes"] == int(0.5 * naive["peak_bytes"])
    assert 0 < hc["predicted_peak_bytes"] and hc["peak_bytes"] <= 1.05 * hc["budget_bytes"]
    assert rows["hbp@0.3"]["status"] in ("ok", "infeasible")
    default = rows["hbp@50%act"]  # held to the bytes hbp resolved its default budget to
    assert default["status"] == "ok" and default["grad_diff"] == 0
    assert rows["hbp@min"]["peak_bytes"] < default["budget_bytes"] < naive["peak_bytes"]
    assert default["peak_bytes"] <= 1.05 * default["budget_bytes"]
    # held to the uniform checkpointing's measured peak, hbp recomputes less than it
    at_baseline, checkpoint = rows["hbp@baseline"], rows["checkpoint"]
    assert at_baseline["status"] == "ok" and at_baseline["grad_diff"] == 0
    assert at_baseline["budget_bytes"] == checkpoint["peak_bytes"]
    assert at_baseline["peak_bytes"] <= at_baseline["budget_bytes"]
    assert at_baseline["recompute_flops"] < checkpoint["recompute_flops"]
    workspace = hc["workspace"]
    assert workspace["unmeasured"] == []
    assert workspace["ops"]["scaled_dot_product_attention"]["measured"] >= 1
    plain, chunked = checks["chunked_ce"]["rows"]
    assert chunked["peak_vs_plain"] < 1 and chunked["loss_diff"] < 1e-5
    assert chunked["grad_diff"] <= report.TOLERANCE["float32"]
    (ddp,) = checks["ddp"]["rows"]
    assert ddp["status"] == "skipped" and "DDP over NCCL needs 2 or more" in ddp["note"]
    plain, enabled = checks["trainer"]["rows"]
    assert [plain["variant"], enabled["variant"]] == ["Trainer plain", "Trainer hbp.enable"]
    assert len(enabled["losses"]) == 3 and enabled["loss_diff"] < 1e-5
    assert enabled["status"] == "ok" and enabled["grad_diff"] <= report.TOLERANCE["float32"]
    assert enabled["peak_bytes"] <= 1.05 * enabled["budget_bytes"] < plain["peak_bytes"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("# gpu check: PASSED") and "| gpt2_small |" in table
    assert "DDP over NCCL needs 2 or more" in table and "Failures:\n- none" in table
