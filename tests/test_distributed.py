"""HCModule data-parallel on 2 CPU processes (gloo on 127.0.0.1): under DDP and under FSDP2
(`fully_shard`) the gradients equal the single-process gradients of the two ranks' batches
together, and each rank's measured peak keeps the saving against the same wrapper without
HCModule; `torchrun ... run.py distributed=ddp` writes one metrics.json from rank 0."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hbp import HCModule
from hbp.bench.distributed import Distributed, free_port, wrap
from hbp.runtime.measure import step_peak
from hbp.workloads import build

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
WORKLOAD = ("synthetic_dag", "small")
BUDGET = 0.3


def full_grads(module) -> list[torch.Tensor]:
    """Parameter gradients, gathered whole where FSDP sharded them (a collective)."""
    return [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for p in module.parameters()
    ]


def rank_step(kind: str, rank: int, hc: bool) -> dict:
    """One step of the workload on this rank's batch (seed = rank) under `kind`, with or
    without HCModule: gradients (rank 0 keeps them) and the measured peak."""
    workload = build(*WORKLOAD, seed=0)
    batch = workload.make_batch(rank)
    module = workload.model
    if hc:
        module = HCModule(module, BUDGET)
        module.prepare(*batch.args, **batch.kwargs)
    module = wrap(module, Distributed(kind, rank, WORLD), torch.device("cpu"))
    workload.step_loss(module, batch).backward()  # first step: FSDP and HCModule settle
    grads = full_grads(module)
    for p in module.parameters():
        p.grad = None
    _, peak = step_peak(lambda: workload.step_loss(module, batch).backward(), "cpu")
    return {"grads": grads if rank == 0 else None, "peak": peak}


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {}
        for kind in ("ddp", "fsdp"):
            for hc in (False, True):
                results[f"{kind}_{'hc' if hc else 'plain'}"] = rank_step(kind, rank, hc)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def reference_grads() -> list[torch.Tensor]:
    """Single process: the mean of the gradients of the ranks' batches (DDP's average)."""
    workload = build(*WORKLOAD, seed=0)
    total = None
    for rank in range(WORLD):
        workload.model.zero_grad(set_to_none=True)
        workload.step_loss(workload.model, workload.make_batch(rank)).backward()
        grads = [p.grad.clone() for p in workload.model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return [t / WORLD for t in total]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_gradients_equal_single_process(ranks, kind):
    reference = reference_grads()
    for variant in ("plain", "hc"):
        grads = ranks[0][f"{kind}_{variant}"]["grads"]
        assert len(grads) == len(reference)
        for g, r in zip(grads, reference):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_memory_saving_holds_per_rank(ranks, kind):
    for rank in ranks:
        plain, hc = rank[f"{kind}_plain"]["peak"], rank[f"{kind}_hc"]["peak"]
        assert hc < 0.6 * plain, (kind, hc, plain)


@pytest.mark.slow
def test_torchrun_ddp_run_writes_one_metrics_file_from_rank_0(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", "run.py",
         "distributed=ddp", "workload=synthetic_dag", "mode=tiny", "steps=1", "warmup=0",
         "logger=none", f"output_root={tmp_path}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (metrics,) = tmp_path.rglob("metrics.json")
    row = json.loads(metrics.read_text())
    assert row["distributed"] == "ddp" and row["world_size"] == 2
    assert len(row["rank_peak_bytes"]) == 2 and row["peak_bytes"] == row["rank_peak_bytes"][0]
    assert max(row["rank_peak_bytes"]) < 0.6 * row["naive_peak_bytes"]
    assert len(list(tmp_path.rglob(".hydra"))) == 1  # rank 1 wrote nothing
    from hbp.report import comparison_table, results_frame

    table = comparison_table(results_frame(tmp_path))  # ddp and fsdp rows told apart
    assert list(table["distributed"]) == ["ddp"] and list(table["world"]) == [2]
