"""Capture, calibration and planning time on captured transformers, beside a warm plain step
(`python experiments/bench_planner.py --only real`; see that script's docstring)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from bench_capture import llama  # beside this script

from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError
from hbp.graph.torch.calibrate import calibrate_scratch
from hbp.graph.torch.capture import capture
from hbp.integrations.torch.loss import WithLoss
from hbp.planner import plan
from hbp.planner.dp.least_peak import forget_least_peaks as forget_least_peaks_of_planner

BUDGETS = (0.5, 0.3, "min", "50%act")
DEFAULT_BUDGET = "50%act"  # HCModule's and hbp.enable's


def gpt2_medium():
    from hbp.workloads import build

    wl = build("gpt2", "medium", seed=0)
    batch = wl.make_batch(0)
    return wl.model, tuple(batch.args), dict(batch.kwargs), lambda out: wl.loss_fn(out, batch)


def unet_medium():
    """The DDPM CIFAR-10 U-Net (`hbp.workloads.unet`, profile medium: skip connections from
    every level of the encoder to the decoder)."""
    from hbp.workloads import build

    wl = build("unet", "medium", seed=0)
    batch = wl.make_batch(0)
    return wl.model, tuple(batch.args), dict(batch.kwargs), lambda out: wl.loss_fn(out, batch)


MAKERS = {"GPT-2": "gpt2_medium()", "U-Net": "unet_medium()"}


def plan_any(graph, budget):
    """`plan(graph, budget)`: every budget form HCModule takes ("50%act" resolved inside
    `plan`, as HCModule has it resolved: the least peak plus half of what checkpointing can
    save)."""
    return plan(graph, budget)


def timed(fn):
    """(result, CPU s, wall s) of one call."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def plain_step(model, args, kwargs, loss_fn) -> tuple[float, float]:
    """Median (CPU s, wall s) of 3 warm plain steps."""

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(*args, **kwargs)).backward()

    step()
    runs = [timed(step)[1:] for _ in range(3)]
    model.zero_grad(set_to_none=True)
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def hcmodule_first_step(model, args, kwargs, loss_fn) -> float:
    """CPU s of HCModule's first step at its default budget, as a user runs it: capture,
    calibration, planning, the executor's step and the allocator-measured closed loop."""
    from hbp.graph.torch.calibrate import clear_cache
    from hbp.integrations.torch import HCModule

    forget_least_peaks()
    clear_cache()
    hc = HCModule(model)
    model.zero_grad(set_to_none=True)
    c0 = time.process_time()
    loss_fn(hc(*args, **kwargs)).backward()
    cpu = time.process_time() - c0
    model.zero_grad(set_to_none=True)
    return cpu


def first_step_in_a_fresh_process(name: str) -> float:
    """`hcmodule_first_step` of the row's model in a new process (no cache of this one's)."""
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.path.insert(0, 'experiments'); torch.set_num_threads(1); "
        "import bench_planner_real as b; "
        f"m = b.{_maker(name)}; "
        "print(b.hcmodule_first_step(*m))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def _maker(name: str) -> str:
    """The call in this module that builds the row `name`'s model."""
    for prefix, call in MAKERS.items():
        if name.startswith(prefix):
            return call
    return f"llama({int(name.split(',')[1].split()[0])})"


def forget_least_peaks() -> None:
    """Cold planning: the least peaks the planner remembers per graph structure forgotten."""
    forget_least_peaks_of_planner()


def row(name: str, model, args, kwargs, loss_fn) -> str:
    step_cpu, step_wall = plain_step(model, args, kwargs, loss_fn)
    root = WithLoss(model, loss_fn, len(args))
    with torch.enable_grad():
        captured, cap_cpu, cap_wall = timed(lambda: capture(root, args, kwargs))
    _, cal_cpu, cal_wall = timed(lambda: calibrate_scratch(captured, args, kwargs))
    graph = captured.graph
    _, sim_cpu, sim_wall = timed(lambda: simulate(graph))
    cells, first = [], None
    for budget in BUDGETS:
        forget_least_peaks()

        def planned(budget=budget):
            try:
                return plan_any(graph, budget)
            except BudgetError as err:
                return err

        result, cpu, wall = timed(planned)
        tag = " (BudgetError)" if isinstance(result, BudgetError) else ""
        cells.append(f"{cpu:.2f} ({wall:.2f}){tag}")
        if budget == DEFAULT_BUDGET:  # what a first step plans for unless told otherwise
            first = (cpu, wall)
    hc_cpu = first_step_in_a_fresh_process(name)
    first_cpu = cap_cpu + cal_cpu + sim_cpu + first[0]
    first_wall = cap_wall + cal_wall + sim_wall + first[1]
    line = (
        f"| {name} | {len(graph.nodes)} | {step_cpu:.3f} ({step_wall:.3f}) | "
        f"{cap_cpu:.2f} ({cap_wall:.2f}) | {cal_cpu:.2f} ({cal_wall:.2f}) | "
        + " | ".join(cells)
        + f" | {first_cpu:.1f} ({first_wall:.1f}) | {first_cpu / step_cpu:.0f}x "
        f"| {hc_cpu:.1f} ({hc_cpu / step_cpu:.0f}x) |"
    )
    print(line, flush=True)
    return line


def real_graphs(layers: list[int], gpt2: bool, unet: bool = False) -> list[str]:
    lines = [
        "## Planner on captured models: CPU s (wall s), one thread",
        "",
        "| model | nodes | plain step | capture | calibration | plan(0.5) | plan(0.3) | "
        'plan("min") | plan("50%act") | first step overhead | overhead / plain step (CPU) | '
        "HCModule's first step (/ plain step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for n in layers:
        lines.append(row(f"Llama, {n} layers", *llama(n)))
    if gpt2:
        lines.append(row("GPT-2 124M (medium: 8 x 1024 tokens)", *gpt2_medium()))
    if unet:
        lines.append(row("U-Net, DDPM CIFAR-10 (medium: 16 x 32 x 32)", *unet_medium()))
    lines += [
        "",
        'First step overhead = capture + calibration + naive simulation + plan("50%act"), the '
        "default budget. Each plan "
        "is cold (no least peaks remembered). Timings are from a shared machine: rough.",
    ]
    return lines
