"""Shared test set-up: few threads (CI has 2 cores), wandb off, deterministic seeds."""

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

THREADS = int(os.environ.get("HBP_TEST_THREADS", "1"))
torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _threads():
    """Every test starts at THREADS and leaves the worker there (the next module's fixtures
    run before this one): a bench run in the worker's process sets its own count, and CPU
    kernels' scratch (what capture measures) depends on it."""
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(THREADS)


@pytest.fixture
def count_captures(monkeypatch):
    """`count_captures()` returns a list that every capture HCModule makes from then on
    appends to (how tests check that plans are cached per input signature)."""
    import hbp.integrations.torch.planning as hbp_torch

    def start() -> list:
        captures = []
        real = hbp_torch.capture
        monkeypatch.setattr(
            hbp_torch, "capture", lambda *a, **k: captures.append(1) or real(*a, **k)
        )
        return captures

    return start
