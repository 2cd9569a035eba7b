"""The budget as a promise on the real step: allocator-measured peaks against the
budget and against the prediction, on the four workloads.

    python experiments/bench_budget.py [--workloads gpt2,resnet] [--budgets 0.5,min]

Per workload (profile small) and budget, three ways to run the step:
- `loss_fn`: `HCModule(model, budget, loss_fn=...)`, hbp plans the whole step (model + loss);
  one measured step: allocator peak / budget, prediction / allocator peak, and the tracker's
  tensor peak beside it (the difference is kernel workspace);
- `closed loop`: `HCModule(model, budget, calibrate=True)`, the loss computed by the caller;
  the first step is measured by the closed loop, the second by `allocator_peak`;
- `estimate`: `hbp.estimate`'s naive peak against the allocator peak of the plain step.
Writes outputs/budget/budget.csv and prints the table. CPU, one thread.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import pandas as pd
import torch

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import BudgetError
from hbp.runtime.tracker import MemoryTracker
from hbp.units import MIB
from hbp.workloads import build


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def measure(workload: str, budget) -> dict:
    wl = build(workload, "small", seed=0)
    batch = wl.make_batch(0)
    model = wl.model

    def loss_fn(output):
        return wl.loss_fn(output, batch)

    row: dict = {"workload": workload, "budget": budget}
    # hbp sees the loss
    hc = hbp.HCModule(model, budget, loss_fn=loss_fn)
    try:
        plan = hc.prepare(*batch.args, targets=(), **batch.kwargs)
    except BudgetError as err:
        row["error"] = str(err)
        return row

    def step():
        hc(*batch.args, targets=(), **batch.kwargs).backward()

    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    _, peak = allocator_peak(step)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with MemoryTracker(record_timeline=False) as tracker:
        step()
    row.update(
        budget_mib=plan.budget_bytes / MIB,
        predicted_mib=plan.predicted_peak_bytes / MIB,
        peak_mib=peak / MIB,
        tensor_peak_mib=tracker.peak_bytes / MIB,
        peak_over_budget=peak / plan.budget_bytes,
        predicted_over_peak=plan.predicted_peak_bytes / peak,
    )
    # the caller's loss, closed loop
    loop = hbp.HCModule(model, budget, calibrate=True)

    def caller_step():
        loss_fn(loop(*batch.args, **batch.kwargs)).backward()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        caller_step()
        first = loop.measured_peak_bytes
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        _, second = allocator_peak(caller_step)
    loop_budget = loop.compiled.budget_bytes
    row.update(
        loop_budget_mib=loop_budget / MIB,
        loop_step1_over_budget=first / loop_budget,
        loop_step2_over_budget=second / loop_budget,
        loop_replanned=any("Planned again" in str(w.message) for w in caught),
    )
    return row


def estimate_row(workload: str) -> dict:
    wl = build(workload, "small", seed=0)
    batch = wl.make_batch(0)
    model = wl.model
    start = time.perf_counter()
    est = hbp.estimate(
        model,
        *batch.args,
        loss_fn=lambda output: wl.loss_fn(output, batch),
        budgets=[1.0],
        **batch.kwargs,
    )
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    _, naive = allocator_peak(
        lambda: wl.loss_fn(model(*batch.args, **batch.kwargs), batch).backward()
    )
    return {
        "workload": workload,
        "estimate_naive_mib": est.naive_peak_bytes / MIB,
        "measured_naive_mib": naive / MIB,
        "estimate_over_measured": est.naive_peak_bytes / naive,
        "estimate_min_mib": est.min_peak_bytes / MIB,
        "estimate_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="gpt2,resnet,unet,synthetic_dag")
    parser.add_argument("--budgets", default="0.5,min")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, estimates = [], []
    for workload in args.workloads.split(","):
        estimates.append(estimate_row(workload))
        print(estimates[-1], flush=True)
        for budget in map(_value, args.budgets.split(",")):
            rows.append(measure(workload, budget))
            print(rows[-1], flush=True)
    out = Path("outputs/budget")
    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    table.to_csv(out / "budget.csv", index=False)
    pd.DataFrame(estimates).to_csv(out / "estimate.csv", index=False)
    with pd.option_context("display.width", 200, "display.precision", 3):
        print(table.drop(columns=[c for c in table if c.startswith("loop_budget")]))
        print(pd.DataFrame(estimates))


if __name__ == "__main__":
    main()
