"""Where the first hbp step's time goes: one workload's first `HCModule` step, under cProfile,
split into hbp's stages (capture, its parts, the scratch calibration, planning, the step).

    python experiments/first_step_profile.py --out outputs/first_step unet medium
    python experiments/first_step_profile.py --out /tmp/first_step unet tiny --budget min
    python experiments/first_step_profile.py --out /tmp/first_step hf medium arch=llama batch_size=4

Prints, and writes to `<out>/<workload>_<profile>[_<option values>]_<budget>.txt`: the first step's wall time, a warm
step's, each stage's cumulative seconds (a stage inside another counts in both), the number
of kernels the calibration measured (`measure_op` calls) and their seconds, and cProfile's top
functions by cumulative time. On CUDA the device is synchronized after each step; the
calibration's kernels run on it, the rest on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings
from pathlib import Path

import torch
from step_profile import profiling_device  # beside this script

import hbp
from hbp.workloads import build

#: (label, file suffix, function name) of hbp's stages, as cProfile names them.
STAGES = (
    ("capture", "graph/torch/capture.py", "capture"),
    ("  trace", "graph/torch/trace.py", "trace_module"),
    ("  profile", "graph/torch/profile.py", "profile_graph"),
    ("  calibration", "graph/torch/calibrate.py", "calibrate_scratch"),
    ("    kernels measured", "graph/torch/measure_op.py", "measure_op"),
    ("planning", "planner/__init__.py", "plan"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("profile")
    parser.add_argument("overrides", nargs="*", help="key=value: the workload's options")
    parser.add_argument("--budget", default="0.5", help="a fraction, or a string form")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = profiling_device()
    cuda = device == "cuda"
    overrides = dict(_option(text) for text in args.overrides)
    workload = build(args.workload, args.profile, seed=0, **overrides)
    batch = workload.make_batch(0).to(device)
    library = getattr(workload.model, "library_model", None)  # trained as its users do
    model = (library or workload.model).to(device)
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    hc = hbp.HCModule(model, budget=budget)

    def loss() -> torch.Tensor:
        if library is not None:
            return hc(**batch.kwargs).loss
        return workload.loss_fn(hc(*batch.args, **batch.kwargs), batch)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss().backward()
        if cuda:
            torch.cuda.synchronize()

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    try:
        step()
        error = None
    except hbp.BudgetError as raised:  # the time to learn it is a first step's too
        error = raised
    profiler.disable()
    first = time.perf_counter() - start
    if error is None:
        step()
        start = time.perf_counter()
        step()
        after = f"a warm step {(time.perf_counter() - start) * 1e3:.1f} ms"
    else:
        after = f"BudgetError: {str(error)[:160]}"
    stats = pstats.Stats(profiler)
    lines = [
        f"{args.workload} ({args.profile}) on {device}, budget {args.budget}: first step "
        f"{first:.2f} s (under cProfile), {after}; "
        f"{hc.captured.granularity} capture of {len(hc.captured.graph.nodes)} nodes",
    ]
    for label, suffix, name in STAGES:
        calls, seconds = _cumulative(stats, suffix, name)
        lines.append(f"{label:<22} {seconds:8.2f} s  ({calls} calls)")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    report = "\n".join(lines) + "\n\n" + text.getvalue()
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "_".join([args.workload, args.profile, *(t.partition("=")[2] for t in args.overrides)])
    (args.out / f"{name}_{args.budget}.txt".replace("%", "pct")).write_text(report)


def _option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, int(value) if value.isdigit() else value


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[int, float]:
    """(primitive calls, cumulative seconds) of the function `name` in a file ending `suffix`."""
    calls = seconds = 0
    for (path, _, function), (primitive, _, _, cumulative, _) in stats.stats.items():
        if function == name and path.endswith(suffix):
            calls += primitive
            seconds += cumulative
    return calls, seconds


if __name__ == "__main__":
    main()
