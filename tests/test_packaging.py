"""`pip install hbp` is the library alone: its dependencies are torch, numpy and highspy (the
MILP optimum), and the library's step (HCModule, planner, simulator) runs with the bench's
packages unimportable; the bench's packages are the extra `hbp[bench]`."""

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
BENCH_ONLY = ("hydra", "omegaconf", "wandb", "pandas", "pyarrow", "matplotlib", "psutil")


def test_bench_dependencies_are_an_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = [
        d.split("[")[0].split("=")[0].split(">")[0].split("<")[0] for d in project["dependencies"]
    ]
    assert sorted(core) == ["highspy", "numpy", "torch"]
    # a range for users (checked on 2.11 with CUDA by gpu-check); `make` pins the suite's
    assert any(d.startswith("torch>=2.11") for d in project["dependencies"])
    bench = " ".join(project["optional-dependencies"]["bench"])
    for name in ("hydra-core", "wandb", "pandas", "pyarrow", "matplotlib", "psutil"):
        assert name in bench
    makefile = (REPO / "Makefile").read_text()
    assert "'.[dev,jax,launchers,bench]' 'torch==2.13.0'" in makefile


def test_the_library_runs_without_the_bench_packages():
    blocked = ", ".join(repr(name) for name in BENCH_ONLY)
    script = f"""
import sys
for name in ({blocked}):
    sys.modules[name] = None  # `import name` raises ImportError
import torch, hbp
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
wrapped = hbp.HCModule(model, budget=0.5)
wrapped(torch.randn(512, 64)).square().mean().backward()
assert wrapped.plan is not None and all(p.grad is not None for p in model.parameters())
assert all(sys.modules[name] is None for name in ({blocked}))
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
