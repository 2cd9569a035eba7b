"""Telemetry: run-dir files, samplers, environment capture, logger selection."""

import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from hbp.errors import ConfigError
from hbp.telemetry import make_loggers
from hbp.telemetry.environment import capture_environment, git_revision
from hbp.telemetry.samplers import GpuSampler
from hbp.telemetry.tables import (
    TableLogger,
    jsonable,
    read_json,
    write_artifacts,
    write_config,
    write_error,
    write_metrics,
)
from hbp.telemetry.wandb_logger import WandbLogger, resolve_wandb_mode
from hbp.units import MIB


def test_jsonable_converts_numbers_paths_and_non_finite():
    value = {
        "i": np.int64(3),
        "f": np.float32(0.5),
        "t": torch.tensor(2.0),
        "nan": float("nan"),
        "inf": math.inf,
        "path": Path("/x/y"),
        "nested": [(1, 2), {"dtype": torch.float32}],
        "flag": True,
    }
    out = jsonable(value)
    assert out == {
        "i": 3,
        "f": 0.5,
        "t": 2.0,
        "nan": None,
        "inf": None,
        "path": "/x/y",
        "nested": [[1, 2], {"dtype": "torch.float32"}],
        "flag": True,
    }
    json.dumps(out, allow_nan=False)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_umasks_permissions(tmp_path, umask):
    import os

    from hbp.telemetry.tables import write_parquet, write_text

    old = os.umask(umask)
    try:
        files = [
            write_metrics(tmp_path, {"a": 1}),
            write_text(tmp_path / "t.txt", "x"),
            write_parquet(tmp_path / "t.parquet", pd.DataFrame({"a": [1]})),
        ]
    finally:
        os.umask(old)
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name


def test_metrics_roundtrip_leaves_no_temporary_files(tmp_path):
    row = {"workload": "gpt2", "peak_bytes": np.int64(123), "config": {"mode": {"name": "naive"}}}
    path = write_metrics(tmp_path, row)
    assert path == tmp_path / "metrics.json"
    assert read_json(path) == {
        "workload": "gpt2",
        "peak_bytes": 123,
        "config": {"mode": {"name": "naive"}},
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    write_metrics(tmp_path, {"a": 1})

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("hbp.files.os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_metrics(tmp_path, {"a": 2})
    assert read_json(tmp_path / "metrics.json") == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_error_record_has_type_message_traceback_and_context(tmp_path):
    try:
        raise ValueError("bad thing")
    except ValueError as error:
        write_error(tmp_path, error, {"workload": "unet"})
    record = read_json(tmp_path / "error.json")
    assert record["status"] == "error"
    assert record["workload"] == "unet"
    assert record["error_type"] == "ValueError"
    assert record["error"] == "bad thing"
    assert "raise ValueError" in record["traceback"]


def test_config_and_artifacts(tmp_path):
    write_config(tmp_path, {"mode": {"name": "tiny", "budget": 0.3}, "steps": 2})
    assert "budget: 0.3" in (tmp_path / "config.yaml").read_text()
    frame = pd.DataFrame({"a": [1, 2]})
    write_artifacts(
        tmp_path, {"plan.json": {"cuts": [1, 3]}, "plan.txt": "cut at 1", "nodes.parquet": frame}
    )
    assert read_json(tmp_path / "plan.json") == {"cuts": [1, 3]}
    assert (tmp_path / "plan.txt").read_text() == "cut at 1"
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "nodes.parquet"), frame)
    with pytest.raises(ValueError):
        write_artifacts(tmp_path, {"../escape.json": {}})


def test_table_logger_writes_parquet(tmp_path):
    steps = pd.DataFrame(
        {"step": [0, 1], "phase": ["timed", "measured"], "step_time_s": [0.1, 0.2]}
    )
    timeline = pd.DataFrame(
        {"op_index": [0], "live_bytes": [64], "phase": ["forward"], "op": ["mm"]}
    )
    TableLogger(tmp_path).log_run({}, steps, timeline)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "steps.parquet"), steps)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "memory_timeline.parquet"), timeline)


RSS_PROBE = """
import time
import numpy as np
import psutil
from hbp.telemetry.samplers import RssSampler

from hbp.units import MIB
with RssSampler(interval_s=0.005) as sampler:
    baseline = psutil.Process().memory_info().rss
    block = np.ones(64 * MIB // 8)  # touched pages: resident
    seen, deadline = sampler.samples, time.monotonic() + 10
    while sampler.samples < seen + 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # a loaded machine may not schedule the sampler for a while
    del block
assert sampler.results()["rss_peak_mb"] == sampler.peak_bytes / MIB
print(sampler.samples, sampler.peak_bytes - baseline)
"""


def test_rss_sampler_sees_a_64_mib_allocation():
    # A fresh process: in a long test session the allocator may serve 64 MiB from pages that
    # are already resident, and RSS would not move.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", RSS_PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    samples, growth = map(int, done.stdout.split())
    assert samples >= 3
    assert growth >= 60 * MIB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_sampler_records_nothing_without_a_gpu():
    with GpuSampler(0, interval_s=0.005) as sampler:
        time.sleep(0.02)
    assert sampler.results() == {}


@pytest.mark.gpu
def test_gpu_sampler_reads_memory_and_utilisation():
    with GpuSampler(torch.cuda.current_device(), interval_s=0.005) as sampler:
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            x = x @ x.T / 4096
        torch.cuda.synchronize()
    results = sampler.results()
    assert results["gpu_mem_peak_mb"] > 64
    assert 0 <= results["gpu_util_pct"] <= 100


def test_environment_names_versions_device_and_commit():
    env = capture_environment("cpu")
    assert env["torch_version"] == torch.__version__
    assert env["device"] == "cpu"
    assert env["threads"] == torch.get_num_threads()
    assert env["hostname"]
    sha, _ = git_revision()
    assert env["git_sha"] == sha
    assert sha is None or len(sha) == 40


def test_environment_without_git(tmp_path):
    assert git_revision(tmp_path) == (None, None)


def test_make_loggers(tmp_path):
    assert make_loggers({"name": "none"}, tmp_path) == []
    (table,) = make_loggers({"name": "table"}, tmp_path)
    assert isinstance(table, TableLogger)
    loggers = make_loggers({"name": "wandb", "wandb": {"mode": "offline"}}, tmp_path)
    assert [type(lg) for lg in loggers] == [TableLogger, WandbLogger]
    with pytest.raises(ConfigError, match="none, table, wandb"):
        make_loggers({"name": "csv"}, tmp_path)


def test_wandb_mode_environment_wins(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_wandb_mode(None) == "offline"
    assert resolve_wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode("online") == "disabled"
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ConfigError, match="logger.wandb.mode"):
        resolve_wandb_mode(None)


def test_wandb_disabled_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    WandbLogger(tmp_path, {"mode": "offline"}).log_run({"a": 1}, pd.DataFrame(), pd.DataFrame())
    assert list(tmp_path.iterdir()) == []


def wandb_records(path: Path) -> list:
    """The records of an offline run's run-*.wandb file (LevelDB log format: 32 KiB blocks of
    chunks, each with a 7-byte header: crc32c, length, type full/first/middle/last) as
    wandb's protobuf Records: what `wandb sync` uploads."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer / padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            chunks.append(pending)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


@pytest.mark.slow
def test_wandb_offline_sweep_has_group_tags_plan_table_and_images(tmp_path):
    """A sweep with logger=wandb (offline): each run's offline files name the sweep as group,
    carry workload/mode/profile tags, per-step history, the timeline image, and for tiny the
    plan as a table and the Pareto image of the sweep so far."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "run.py", "-m", "workload=synthetic_dag", "mode=naive,tiny", "steps=1",
         "warmup=0", "logger=wandb", f"output_root={tmp_path}",
         f"hydra.sweep.dir={tmp_path}/sweeps/s1"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    for mode in ("naive", "tiny"):
        (offline,) = (tmp_path / "sweeps" / "s1").glob(f"synthetic_dag_{mode}_*/wandb/offline-*")
        records = wandb_records(next(offline.glob("run-*.wandb")))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run.run_group == "sweeps/s1"
        assert set(run.tags) == {"workload=synthetic_dag", f"mode={mode}", "profile=small"}
        history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
        keys = {item.key or "/".join(item.nested_key) for h in history for item in h.item}
        assert {"step_time_s", "loss"} <= keys
        # the measured step's time is under its phase, not beside the timed steps'
        assert "measured/step_time_s" in keys
        images = {p.name.rsplit("_", 2)[0] for p in (offline / "files/media/images").glob("*.png")}
        # naive ran first: alone, it has no trade-off to show, so no (empty) Pareto figure
        assert images == ({"memory_timeline", "pareto"} if mode == "tiny" else {"memory_timeline"})
        tables = list((offline / "files/media/table").glob("*.table.json"))
        plans = [p for p in tables if p.name.startswith("plan_")]
        assert len(plans) == (mode == "tiny")
    plan = json.loads((offline.parents[1] / "plan.json").read_text())

    def count(segments):
        return sum(1 + count(s["children"]) for s in segments)

    table = json.loads(plans[0].read_text())
    assert "recompute" in table["columns"] and len(table["data"]) == count(plan["segments"])


def test_a_step_without_a_memory_timeline_writes_no_timeline_file(tmp_path):
    """compile_budget's step records no per-op live bytes: no empty memory_timeline.parquet,
    whose presence the report and the notebooks read as "this run has a timeline" (the
    memory-timeline notebook raised KeyError 'live_bytes' on a sweep with such a run)."""
    from hbp.runtime.tracker import TIMELINE_COLUMNS
    from hbp.telemetry.tables import STEPS_FILE, TIMELINE_FILE, TableLogger

    steps = pd.DataFrame({"step": [0], "step_time_s": [0.1]})
    for name in ("empty", "full"):
        (tmp_path / name).mkdir()
    TableLogger(tmp_path / "empty").log_run({}, steps, pd.DataFrame())
    assert (tmp_path / "empty" / STEPS_FILE).exists()
    assert not (tmp_path / "empty" / TIMELINE_FILE).exists()
    timeline = pd.DataFrame([(0, 64, "forward", "mm")], columns=list(TIMELINE_COLUMNS))
    TableLogger(tmp_path / "full").log_run({}, steps, timeline)
    assert pd.read_parquet(tmp_path / "full" / TIMELINE_FILE)["live_bytes"].tolist() == [64]


def test_a_run_names_the_version_of_the_library_its_model_comes_from():
    """A figure depends on the library's version of the model: a transformers model records
    transformers' version; hbp's own models record none (the process may import others)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    from hbp.telemetry.environment import model_libraries

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))
    assert model_libraries(model) == {"transformers_version": transformers.__version__}
    assert model_libraries(torch.nn.Sequential(torch.nn.Linear(2, 2))) == {}
