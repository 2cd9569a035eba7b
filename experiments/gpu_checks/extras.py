"""The checks beside the model matrix: hbp under bf16 autocast, torch.compile(hc), the chunked
cross-entropy against the plain loss, and DDP over NCCL. Each reports rows as models.py does
(the plain step first: the reference its gradients and the budget are read against)."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import hbp
from hbp.workloads import build

from .models import _step, plan_fields
from .sizes import ModelSpec
from .step import grad_diff, measure, release

#: The hbp budget the bf16, compile and DDP checks run at.
BUDGET = 0.5


def run_bf16_check(spec: ModelSpec, device: str, timed_steps: int, record: Callable) -> None:
    """Plain autograd and hbp@0.5, both under `torch.autocast(device, torch.bfloat16)`: the
    gradients are compared with the bf16 tolerance, the peak with half the bf16 plain peak."""

    def autocast():
        return torch.autocast(device_type=device, dtype=torch.bfloat16)

    _plain_then_hbp(spec, device, timed_steps, record, "bfloat16", autocast, compiled=False)


def run_compile_check(spec: ModelSpec, device: str, timed_steps: int, record: Callable) -> None:
    """Plain eager autograd, then `torch.compile(hbp.HCModule(model, budget=0.5))` (each plan
    segment compiled by HCModule itself; NOTE [ torch.compile of an HCModule ]). Its FLOPs are
    not counted (the counter would make Dynamo skip the frame): recompute is the plan's."""
    _plain_then_hbp(spec, device, timed_steps, record, "float32", contextlib.nullcontext, True)


def _plain_then_hbp(spec, device, timed_steps, record, dtype, context, compiled: bool) -> None:
    workload = build(spec.workload, spec.profile, seed=0, **spec.overrides)
    batch = workload.make_batch(0).to(device)
    reference = None
    hbp_name = f"compile(hbp@{BUDGET})" if compiled else f"hbp@{BUDGET}"
    for variant in ("naive", hbp_name):
        row = {"model": spec.describe(), "variant": variant, "dtype": dtype}
        try:
            model = copy.deepcopy(workload.model).to(device)
            params = list(model.parameters())
            hc = hbp.HCModule(model, budget=BUDGET) if variant != "naive" else None
            module = torch.compile(hc) if compiled and hc is not None else (hc or model)

            def loss_of(m, batch=batch):
                with context():
                    return workload.loss_fn(m(*batch.args, **batch.kwargs), batch)

            count = not (compiled and hc is not None)
            measured = measure(
                _step(loss_of, module), params, device, timed_steps=timed_steps, count_flops=count
            )
            row.update(measured.fields())
            if hc is not None:
                row.update(plan_fields(hc, BUDGET, reference))
                row["grad_diff"] = grad_diff(measured.grads, reference["grads"])
                if count and reference.get("flops") is not None:
                    row["recompute_flops"] = row["flops"] - reference["flops"]
            else:
                reference = row | {"grads": measured.grads}
            row["status"] = "ok"
        except hbp.BudgetError as error:
            row.update(status="infeasible", note=str(error)[:300])
        except Exception as error:  # noqa: BLE001 - recorded as the row's error
            row.update(status="error", error=f"{type(error).__name__}: {error}"[:600])
            row["traceback"] = traceback.format_exc()[-3000:]
        finally:
            model = module = hc = measured = None
            release(device)
        record(row)
        if reference is None:
            return  # the plain step failed: nothing to compare with


def run_chunked_ce_check(options: dict, device: str, timed_steps: int, record: Callable) -> None:
    """`hbp.ops.chunked_cross_entropy(hidden, weight, target)` against
    `F.cross_entropy(hidden @ weight.T, target)` on `tokens` x `dim` hidden states and a
    `vocab` x `dim` head (float32): peak of each, the loss difference (relative) and the largest
    gradient difference (hidden and weight)."""
    tokens, dim, vocab = options["tokens"], options["dim"], options["vocab"]
    generator = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(tokens, dim, generator=generator).to(device)
    weight0 = (torch.randn(vocab, dim, generator=generator) * 0.02).to(device)
    target = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    losses = {
        "plain": lambda h, w: F.cross_entropy(h @ w.T, target),
        "chunked": lambda h, w: hbp.ops.chunked_cross_entropy(h, w, target),
    }
    reference = None
    for variant, loss_fn in losses.items():
        row = {"model": f"cross-entropy ({tokens} tokens, vocab {vocab}, d {dim})"}
        row.update(variant=variant, dtype="float32")
        try:
            hidden = hidden0.clone().requires_grad_()
            weight = weight0.clone().requires_grad_()

            def step(hidden=hidden, weight=weight, loss_fn=loss_fn):
                loss = loss_fn(hidden, weight)
                loss.backward()
                return loss.detach()

            measured = measure(step, [hidden, weight], device, timed_steps=timed_steps)
            row.update(measured.fields())
            if reference is None:
                reference = row | {"grads": measured.grads}
            else:
                row["grad_diff"] = grad_diff(measured.grads, reference["grads"])
                row["loss_diff"] = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
                row["peak_vs_plain"] = row["peak_bytes"] / reference["peak_bytes"]
            row["status"] = "ok"
        except Exception as error:  # noqa: BLE001
            row.update(status="error", error=f"{type(error).__name__}: {error}"[:600])
            row["traceback"] = traceback.format_exc()[-3000:]
        finally:
            release(device)
        record(row)


def run_ddp_check(spec: ModelSpec, device: str, timed_steps: int, record: Callable) -> None:
    """DDP(HCModule(model, budget=0.5)) over NCCL on two devices, each rank the same batch:
    rank 0's gradients (averaged over identical ranks) must equal one plain step's. Skipped,
    with a row saying so, unless two or more CUDA devices are visible."""
    row = {"model": spec.describe(), "variant": f"DDP(hbp@{BUDGET}) x2", "dtype": "float32"}
    visible = torch.cuda.device_count() if device == "cuda" else 0
    if visible < 2:
        row.update(status="skipped", note=f"{visible} CUDA device(s) visible: DDP needs 2 or more")
        record(row)
        return
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "rank0.pt"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.multiprocessing.spawn(_ddp_rank, args=(2, spec, str(result)), nprocs=2, join=True)
        grads, plain, peak = torch.load(result)
    row.update(peak_bytes=peak, grad_diff=grad_diff(grads, plain), status="ok")
    record(row)


def _ddp_rank(rank: int, world: int, spec: ModelSpec, result: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        torch.cuda.set_device(rank)
        workload = build(spec.workload, spec.profile, seed=0, **spec.overrides)
        batch = workload.make_batch(0).to(f"cuda:{rank}")
        plain = copy.deepcopy(workload.model).to(rank)
        workload.loss_fn(plain(*batch.args, **batch.kwargs), batch).backward()
        model = workload.model.to(rank)
        ddp = DistributedDataParallel(hbp.HCModule(model, budget=BUDGET), device_ids=[rank])
        for _ in range(2):  # the first step plans; the second is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            workload.loss_fn(ddp(*batch.args, **batch.kwargs), batch).backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        if rank == 0:
            grads = [
                p.grad.detach().cpu() if p.grad is not None else None for p in model.parameters()
            ]
            reference = [
                p.grad.detach().cpu() if p.grad is not None else None for p in plain.parameters()
            ]
            torch.save((grads, reference, peak), result)
    finally:
        dist.destroy_process_group()
