"""The notebooks run top to bottom (nbclient) on one sweep directory made here (HBP_SWEEP):
analysis.ipynb, pareto.ipynb, memory_timeline.ipynb, frontier.ipynb; they write their
figures where HBP_FIGURES says and nowhere else; and one makes its own small sweep when the
sweep directory is empty.

The kernel is this interpreter (a kernelspec written to a temporary JUPYTER_PATH), so the
notebook sees the same hbp, torch and pandas as the tests, whatever kernels the machine has.
"""

import json
import re
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from nbclient import NotebookClient

from hbp import bench
from hbp.graph import synthetic
from hbp.optimum import frontier

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"
KERNEL = "hbp-tests"


@pytest.fixture
def outputs(tmp_path):
    """Four small real runs (two workloads x naive/checkpoint) with tables."""
    root = tmp_path / "outputs"
    for workload in ("synthetic_dag", "gpt2"):
        for mode in ("naive", "checkpoint"):
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
                cfg = compose(
                    "config",
                    [
                        f"workload={workload}",
                        f"mode={mode}",
                        "steps=1",
                        "warmup=0",
                        "logger=table",
                        f"output_root={root}",
                    ],
                )
            bench.run(cfg, root / "runs" / f"{workload}_{mode}")
    rows = frontier(synthetic.random_dag(6, seed=3, alias_prob=0.0), [1.0, 0.8], time_limit=60)
    optimum = pd.DataFrame(rows).assign(graphs="reduced", workload="dag", config="")
    (root / "bench").mkdir()
    optimum.to_csv(root / "bench" / "optimum.csv", index=False)  # bench_optimum.py's table
    return root


def rows_of(outputs) -> list[dict]:
    return pd.read_csv(outputs / "bench" / "optimum.csv").to_dict("records")


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hbp tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return KERNEL


@pytest.mark.slow
def test_analysis_notebook_executes(outputs, kernel, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    monkeypatch.setenv("HBP_SWEEP", str(outputs / "runs"))
    monkeypatch.setenv("HBP_OPTIMUM", str(outputs / "bench" / "optimum.csv"))
    monkeypatch.setenv("HBP_FIGURES", str(figures))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=180,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()

    def text(cell) -> str:
        parts = []
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
        return "".join(parts)

    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert f"4 runs in {outputs / 'runs'}" in text(code[0])
    assert "checkpoint" in text(code[1]) and "synthetic_dag" in text(code[1])
    assert (figures / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (figures / "memory_timeline_gpt2.png").exists()
    assert (figures / "memory_timeline_synthetic_dag.png").exists()
    assert not list(outputs.rglob("*.png"))  # nothing written into the sweep
    solved = sum(r["status"] == "optimal" for r in rows_of(outputs))
    assert f"{solved} of 2 solved to optimality" in text(code[-2])
    markdown = text(code[-1])
    assert "| gpt2 | checkpoint |" in markdown and "| synthetic_dag | naive |" in markdown


@pytest.fixture(scope="module")
def sweep_outputs(tmp_path_factory):
    """naive, checkpoint and tiny on synthetic_dag with tables (what `make sweep` makes, smaller)."""
    root = tmp_path_factory.mktemp("notebook_outputs")
    for mode in ("naive", "checkpoint", "tiny"):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(
                "config", ["workload=synthetic_dag", f"mode={mode}", "steps=1", "warmup=0"]
            )
        bench.run(cfg, root / "sweeps" / "quick" / mode)
    return root / "sweeps" / "quick"


def execute(name: str, kernel: str, outputs: Path, figures: Path, monkeypatch) -> list[str]:
    """Run notebooks/<name>.ipynb on the sweep directory `outputs`; the text output of each
    code cell."""
    monkeypatch.setenv("HBP_SWEEP", str(outputs))
    monkeypatch.setenv("HBP_FIGURES", str(figures))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = REPO / "notebooks" / f"{name}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=300,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    texts = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        parts = [o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs]
        texts.append("".join(parts))
    return texts


@pytest.mark.slow
def test_memory_timeline_notebook(sweep_outputs, kernel, tmp_path, monkeypatch):
    texts = execute("memory_timeline", kernel, sweep_outputs, tmp_path, monkeypatch)
    assert "synthetic_dag" in texts[1] and "checkpoint" in texts[1]
    png = tmp_path / "memory_timeline_synthetic_dag.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for mode in ("naive", "checkpoint", "tiny"):
        assert re.search(rf"{mode}: peak +[\d.]+ MiB in (forward|backward) at op \d+", texts[3])


@pytest.mark.slow
def test_frontier_notebook(sweep_outputs, kernel, tmp_path, monkeypatch):
    texts = execute("frontier", kernel, sweep_outputs, tmp_path, monkeypatch)
    assert "naive peak" in texts[1] and "lower bound" in texts[1]
    assert "plan cuts: [" in texts[2]
    assert (tmp_path / "frontier_synthetic_dag.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_pareto_notebook_makes_its_own_small_sweep_when_outputs_is_empty(
    kernel, tmp_path, monkeypatch
):
    empty = tmp_path / "sweep"
    texts = execute("pareto", kernel, empty, tmp_path / "figures", monkeypatch)
    assert "no runs in" in texts[0] and f"3 runs in {empty}" in texts[0]
    assert len(list(empty.glob("*/metrics.json"))) == 3
    assert "| naive | - | " in texts[1] and "| checkpoint |" in texts[1] and "tiny(" in texts[1]
    assert "pareto front of synthetic_dag:" in texts[2]  # the workload named
    assert (tmp_path / "figures" / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
