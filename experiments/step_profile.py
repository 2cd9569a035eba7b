"""Where a steady-state step's host time goes: GPT-2 (hbp's workload) plainly, under uniform
checkpointing and under `hbp.HCModule` at a few budgets, each timed and then profiled.

    python experiments/step_profile.py --out outputs/step_profile            # CUDA: profile small
    python experiments/step_profile.py --out /tmp/step_profile --profile tiny  # anywhere

Per variant: the median wall time of 30 steps (after 5 untimed; the device synchronized around
each), the plan (`str(hc.plan)`), and two files under --out: `<variant>_ops.txt`, the PyTorch
profiler's per-op table of 5 steps by self CPU time (CUDA kernels too on a GPU), and
`<variant>_py.txt`, cProfile's top Python functions over 10 steps. `summary.txt` holds the
printed lines. docs/results.md "CUDA" reads it: a pinned segment runs its forward and its
recompute under selective checkpointing's Python dispatch mode, op by op.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hbp
from hbp.modes.checkpoint import CheckpointMode
from hbp.workloads import build


def profiling_device() -> str:
    """ "cuda" where a CUDA device is visible, else "cpu" with one torch thread (the profiles
    of this folder run alone on a GPU machine, beside other jobs on a CPU one)."""
    if torch.cuda.is_available():
        return "cuda"
    torch.set_num_threads(1)
    return "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--profile", default=None, help="GPT-2's profile (small on CUDA, else tiny)"
    )
    parser.add_argument("--budgets", nargs="*", default=["0.5", "min"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = profiling_device()
    cuda = device == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    workload = build("gpt2", args.profile or ("small" if cuda else "tiny"), seed=0)
    batch = workload.make_batch(0).to(device)
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step_of(module, model):
        def step() -> None:
            model.zero_grad(set_to_none=True)
            workload.loss_fn(module(*batch.args, **batch.kwargs), batch).backward()

        return step

    def median_ms(step, steps: int = 30) -> float:
        for _ in range(5):
            step()
        times = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    def profiled(name: str, step) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                step()
            sync()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        (args.out / f"{name}_ops.txt").write_text(table)
        python = cProfile.Profile()
        python.enable()
        for _ in range(10):
            step()
        sync()
        python.disable()
        text = io.StringIO()
        pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(40)
        (args.out / f"{name}_py.txt").write_text(text.getvalue())

    model = copy.deepcopy(workload.model).to(device)
    log(f"naive: {median_ms(step_of(model, model)):.2f} ms")
    model = copy.deepcopy(workload.model).to(device)
    checkpointed = copy.copy(workload)
    checkpointed.model = model
    CheckpointMode().apply(checkpointed, batch)
    log(f"checkpoint: {median_ms(step_of(model, model)):.2f} ms")
    for given in args.budgets:
        budget = given if given == "min" or "%" in given else float(given)
        model = copy.deepcopy(workload.model).to(device)
        hc = hbp.HCModule(model, budget=budget)
        step = step_of(hc, model)
        try:
            ms = median_ms(step)
        except hbp.BudgetError as error:
            log(f"hbp@{given}: {str(error).splitlines()[0]}")
            continue
        log(f"hbp@{given}: {ms:.2f} ms")
        log(str(hc.plan))
        profiled(f"hbp_{given.replace('%', 'pct')}", step)
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
