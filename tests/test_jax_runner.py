"""framework=jax in the bench: the plain-JAX workloads, the JAX modes under the runner, their
metrics.json, the error contract and torch + JAX runs in one collected table.

The JAX runs are run.py multiruns in a subprocess (profile tiny) with
XLA_FLAGS=--xla_backend_optimization_level=0: that option only lowers LLVM's optimisation of
the generated CPU code (compilation is about 3x faster); XLA's HLO passes, buffer assignment
and so the memory analysis the tests read are the same. Memory claims use the compiled
step's memory analysis (deterministic), never RSS or time.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

jax = pytest.importorskip("jax")

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from hbp import bench  # noqa: E402
from hbp.analysis.collect import collect, results_table  # noqa: E402
from hbp.errors import ConfigError  # noqa: E402
from hbp.workloads import build as build_torch  # noqa: E402
from hbp.workloads import describe  # noqa: E402
from hbp.workloads.jax import build as build_jax  # noqa: E402
from hbp.workloads.jax import params_from_torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("naive", "checkpoint", "tiny")
FAST = ("profile=tiny", "steps=2", "warmup=1", "verify=true")
# Fields of a torch run that a JAX run has no counterpart for.
TORCH_ONLY = {"torch_version"}


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", list(overrides))


def run_py(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "XLA_FLAGS": "--xla_backend_optimization_level=0",
    }
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "run.py", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def run_modes(root: Path, workload: str, tiny_budget: str) -> dict:
    """mode -> metrics row of `workload` under framework=jax (run.py multiruns into root,
    logger=table); "stdout" -> the last multirun's output."""
    base = ("-m", "framework=jax", f"workload={workload}", *FAST, f"output_root={root}")
    if tiny_budget == "min":  # tiny's default
        calls = [("mode=" + ",".join(MODES),)]
    else:  # mode.budget is tiny's key only
        calls = [("mode=naive,checkpoint",), ("mode=tiny", f"mode.budget={tiny_budget}")]
    for extra in calls:
        result = run_py(*base, *extra)
        assert result.returncode == 0, result.stdout + result.stderr
    frame = collect(root)
    rows = frame[frame["workload"] == workload].to_dict(orient="records")
    return {row["mode"]: row for row in rows} | {"stdout": result.stdout}


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_runs")


@pytest.fixture(scope="module")
def dag_runs(runs_root):
    return run_modes(runs_root / "dag", "synthetic_dag", "0.3")


@pytest.fixture(scope="module")
def gpt2_runs(runs_root):
    # At profile tiny the parameters and their gradients are half of GPT-2's naive peak and
    # the logits most of the rest: 0.3 is below the least reachable peak (0.53x).
    return run_modes(runs_root / "gpt2", "gpt2", "min")


@pytest.fixture(scope="module")
def torch_run(runs_root):
    torch.set_num_threads(1)
    cfg = make_cfg("workload=synthetic_dag", "mode=naive", *FAST, "logger=none")
    cfg.output_root = str(runs_root)
    return bench.run(cfg, runs_root / "torch" / "synthetic_dag_naive")


# ------------------------------------------------------------------------------ workloads


@pytest.mark.parametrize("name", ["gpt2", "synthetic_dag"])
def test_jax_workload_is_its_torch_twin(name):
    """With the torch model's weights, the JAX loss equals the torch loss: same model, same
    profile sizes (and the JAX init has the torch parameters' names and shapes)."""
    twin = build_torch(name, "tiny", seed=0)
    workload = build_jax(name, "tiny", seed=0)
    keep = ("wte.weight", "wpe.weight") if name == "gpt2" else ()
    params = params_from_torch(twin.model, keep_layout=keep)
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == jax.tree.map(lambda x: x.shape, workload.params)
    batch = twin.make_batch(0)
    inputs = (*batch.args,) if name == "gpt2" else (batch.args[0], batch.targets)
    got = float(jax.jit(workload.loss)(params, *(jax.numpy.asarray(t.numpy()) for t in inputs)))
    want = float(twin.step_loss(twin.model, batch).detach())
    assert got == pytest.approx(want, rel=1e-5)
    assert workload.config["params"] == twin.config["params"]


def test_jax_workload_is_seeded():
    a, b = build_jax("synthetic_dag", "tiny", seed=3), build_jax("synthetic_dag", "tiny", seed=3)
    c = build_jax("synthetic_dag", "tiny", seed=4)

    def leaves(w):
        return [np.asarray(x) for x in jax.tree.leaves((w.params, w.batch))]

    assert all((x == y).all() for x, y in zip(leaves(a), leaves(b)))
    assert not all((x == y).all() for x, y in zip(leaves(a), leaves(c)))


# ---------------------------------------------------------------------------- the runner


def check_runs(rows: dict, torch_row: dict) -> None:
    naive, ckpt, tiny = (rows[m] for m in MODES)
    for mode in MODES:
        row = rows[mode]
        assert row["framework"] == "jax" and row["mode"] == mode and row["status"] == "ok"
        # the torch run's fields, filled where JAX has them
        shared = {k for k in torch_row if k != "config" and not k.startswith("workload_")}
        assert shared - set(row) <= TORCH_ONLY, shared - set(row)
        facts = describe(row["workload"], "tiny")  # the torch twin's workload facts
        assert {f"workload_{k}" for k in facts} <= set(row)
        assert row["params"] == facts["params"]
        assert row["config.framework.name"] == "jax"
        parts = row["xla_temp_bytes"] + row["xla_output_bytes"] - row["xla_alias_bytes"]
        assert row["peak_bytes"] == parts > 0
        assert row["xla_output_bytes"] >= row["workload_param_bytes"]  # the gradients
        assert row["flops"] > 0 and row["naive_flops"] == naive["flops"]
        assert row["naive_peak_bytes"] == naive["peak_bytes"]
        assert row["recompute_ratio"] == pytest.approx(row["flops"] / naive["flops"] - 1)
        assert row["step_time_s"] > 0 and row["optimizer_step_s"] > 0
        assert row["rss_first_call_growth_bytes"] >= 0 and row["rss_growth_bytes"] >= 0
        assert row["verify_passed"] and row["grad_max_rel_error"] < 1e-5
    # hbp's plan lowers what XLA compiles; jax.checkpoint recomputes
    assert tiny["xla_temp_bytes"] < naive["xla_temp_bytes"]
    assert tiny["peak_bytes"] < naive["peak_bytes"]
    assert tiny["mode_predicted_peak_bytes"] <= tiny["mode_budget_bytes"]
    assert tiny["flops"] > naive["flops"] and ckpt["flops"] > naive["flops"]
    assert ckpt["mode_num_segments"] >= 1
    tiny_dir = Path(tiny["run_dir"])
    assert (tiny_dir / "plan.json").exists() and (tiny_dir / "graph.json").exists()


def test_synthetic_dag_under_every_jax_mode(dag_runs, torch_run):
    check_runs(dag_runs, torch_run)


@pytest.mark.slow
def test_gpt2_under_every_jax_mode(gpt2_runs, torch_run):
    check_runs(gpt2_runs, torch_run)


def test_torch_runs_record_their_framework(torch_run):
    assert torch_run["framework"] == "torch"


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "overrides, field, accepted",
    [
        (("mode=sac",), "mode.name", "naive, checkpoint, tiny with framework=jax"),
        (("workload=resnet",), "workload.name", "gpt2, synthetic_dag with framework=jax"),
        (("workload.dropout=0.1",), "workload.dropout", "0 with framework=jax"),
        (("distributed=ddp",), "distributed.name", "none with framework=jax"),
        (("mode=tiny", "mode.chunked_loss=true"), "mode.chunked_loss", "false with framework=jax"),
    ],
)
def test_bad_jax_combinations_are_refused(overrides, field, accepted, tmp_path):
    cfg = make_cfg("framework=jax", *overrides, f"output_root={tmp_path}")
    with pytest.raises(ConfigError) as error:
        bench.validate(cfg)
    assert error.value.field == field and accepted in str(error.value)


def test_run_py_refuses_a_bad_combination_with_one_line(tmp_path):
    result = run_py("framework=jax", "mode=sac", f"output_root={tmp_path / 'o'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: mode.name='sac' is not accepted: expected one of naive, checkpoint, tiny "
        "with framework=jax"
    ]
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- collect


def test_collect_puts_torch_and_jax_runs_in_one_table(runs_root, dag_runs, torch_run, tmp_path):
    frame = collect(runs_root)
    mine = frame[frame["workload"] == "synthetic_dag"]
    assert sorted(mine["framework"]) == ["jax", "jax", "jax", "torch"]
    table = results_table(mine)
    table["mode"] = table["mode"].str.split("(").str[0]  # the label without its parameters
    table = table.set_index(["framework", "mode"])
    # peak / naive against the naive run of the same framework
    assert table.loc[("torch", "naive"), "peak / naive"] == 1
    assert table.loc[("jax", "naive"), "peak / naive"] == 1
    want = dag_runs["tiny"]["peak_bytes"] / dag_runs["naive"]["peak_bytes"]
    assert table.loc[("jax", "tiny"), "peak / naive"] == pytest.approx(want)
    # a metrics.json from before the field existed reads as torch
    old = json.loads((Path(torch_run["run_dir"]) / "metrics.json").read_text())
    del old["framework"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.json").write_text(json.dumps(old))
    assert list(collect(tmp_path)["framework"]) == ["torch"]


# ------------------------------------------------------------------------- run.py, slow


def test_jax_sweep_prints_and_logs_like_torch(dag_runs):
    """The multirun's summary has the framework column; logger=table writes the per-step
    rows (steps.parquet) of every run."""
    assert "framework" in dag_runs["stdout"]
    for mode in MODES:
        steps = pd.read_parquet(Path(dag_runs[mode]["run_dir"]) / "steps.parquet")
        assert list(steps["phase"]) == ["first", "warmup", "timed", "timed", "measured"]
        assert (steps["step_time_s"] > 0).all()
