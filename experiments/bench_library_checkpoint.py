"""HCModule vs each library's own checkpointing, on real transformers and diffusers models.

    python experiments/bench_library_checkpoint.py [--profile small] [--threads 2] [--steps 3]
        [--models gpt2 llama bert t5 vit diffusers_unet]

For each model (hbp.workloads hf arch=gpt2|llama|bert|t5|vit and diffusers_unet, random
weights, seed 0) four runs, each on a freshly built copy:
  naive        plain autograd
  library      the library's own checkpointing (mode=library_checkpoint: transformers
               activation_checkpointing_enable(use_reentrant=False), diffusers
               enable_gradient_checkpointing())
  hbp@library  HCModule(model, budget=<library's measured peak in bytes>)
  hbp@min      HCModule(model, budget="min")
A step is forward + the model's own loss + backward, parameter gradients set to None before
it. Per run: one warm-up step; the peak by the allocator (`allocator_peak`: the PyTorch
profiler's allocation events, kernel workspace and parameter gradients included: what decides
out-of-memory) of one step; the FLOPs of one step (`TotalFlopCounterMode`); then --steps timed
steps (median wall time, and median CPU time of the process, steadier on a shared machine).
recompute = FLOPs / naive FLOPs - 1. grad err = max over parameters of max|g - g_naive| /
max|g_naive|. A run that fails (capture, BudgetError, crash) is a row with its error.

Writes outputs/bench/library_checkpoint/table.md and table.csv and prints the table, then
whether the target holds per model: hbp@library fits (<= 1.05x the library's peak) with
no more recompute than the library, and hbp@min is below the library's peak.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hbp import HCModule  # noqa: E402
from hbp.allocator import allocator_peak
from hbp.modes.library_checkpoint import LibraryCheckpointMode  # noqa: E402
from hbp.runtime.flops import TotalFlopCounterMode  # noqa: E402
from hbp.units import MIB  # noqa: E402
from hbp.workloads import build  # noqa: E402

MODELS = ("gpt2", "llama", "bert", "t5", "vit", "diffusers_unet")
FIT_TOLERANCE = 1.05  # "fits" = measured peak <= 1.05x the library's peak
OUT = Path("outputs/bench/library_checkpoint")


def make(model: str, profile: str):
    if model == "diffusers_unet":
        return build("diffusers_unet", profile, seed=0)
    return build("hf", profile, seed=0, arch=model)


def measure(workload, module, steps: int) -> dict:
    """Warm-up, allocator peak, FLOPs and timed steps of `module` (see the module docstring)."""
    batch = workload.make_batch(0)
    params = list(workload.model.parameters())

    def step():
        for p in params:
            p.grad = None
        torch.manual_seed(0)
        loss = workload.step_loss(module, batch)
        loss.backward()
        return float(loss.detach())

    step()
    gc.collect()
    loss, peak = allocator_peak(step)
    with TotalFlopCounterMode() as counter:
        step()
    flops = int(counter.get_total_flops())
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    return dict(
        loss=loss,
        peak_bytes=peak,
        flops=flops,
        step_s=statistics.median(walls),
        cpu_s=statistics.median(cpus),
        grads=grads,
    )


def grad_error(grads, reference) -> float:
    worst = 0.0
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None:
            if g is not r:
                return float("inf")
            continue
        scale = r.abs().max().item()
        error = (g - r).abs().max().item()
        worst = max(worst, error / scale if scale > 0 else error)
    return worst


def run_one(model: str, run: str, profile: str, steps: int, budget=None) -> dict:
    """One row; any exception becomes the row's error."""
    row = dict(model=model, run=run, budget=budget)
    started = time.perf_counter()
    try:
        workload = make(model, profile)
        module = workload.model
        if run == "library":
            mode = LibraryCheckpointMode()
            module = mode.apply(workload, workload.make_batch(0))
            row["granularity"] = mode.method
        elif run.startswith("hbp"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = HCModule(workload.model, budget)
                batch = workload.make_batch(0)
                module.prepare(*batch.args, **batch.kwargs)
            row["granularity"] = module.compiled.captured.granularity
            row["predicted_peak_bytes"] = module.plan.predicted_peak_bytes
            row["capture_s"] = module.compiled.capture_time_s
            row["plan_s"] = module.compiled.plan_time_s
            capture = [str(w.message) for w in caught if "Capture" in type(w.message).__name__]
            row["warning"] = capture[0][:300] if capture else None
        else:
            row["granularity"] = "-"
        row["params"] = workload.config["params"]
        row.update(measure(workload, module, steps))
    except Exception as error:  # recorded, never fatal: the other rows still run
        row["error"] = f"{type(error).__name__}: {error}"[:500]
        row["traceback"] = traceback.format_exc()[-2000:]
    row["wall_s"] = time.perf_counter() - started
    gc.collect()
    return row


def bench_model(model: str, profile: str, steps: int) -> list[dict]:
    naive = run_one(model, "naive", profile, steps)
    library = run_one(model, "library", profile, steps)
    rows = [naive, library]
    lib_peak = library.get("peak_bytes")
    if lib_peak:
        rows.append(run_one(model, "hbp@library", profile, steps, budget=int(lib_peak)))
    else:
        rows.append(dict(model=model, run="hbp@library", error="no library peak to aim for"))
    rows.append(run_one(model, "hbp@min", profile, steps, budget="min"))
    reference = naive.get("grads")
    for row in rows:
        if naive.get("flops") and row.get("flops"):
            row["recompute"] = row["flops"] / naive["flops"] - 1
        if lib_peak and row.get("peak_bytes"):
            row["peak_vs_library"] = row["peak_bytes"] / lib_peak
        if naive.get("peak_bytes") and row.get("peak_bytes"):
            row["peak_vs_naive"] = row["peak_bytes"] / naive["peak_bytes"]
        if reference is not None and row.get("grads") is not None:
            row["grad_err"] = grad_error(row["grads"], reference)
    for row in rows:
        row.pop("grads", None)
        row.setdefault("error", None)
    return rows


def verdict(rows: list[dict]) -> str:
    """The target (module docstring) for one model, said with the figures."""
    by_run = {r["run"]: r for r in rows}
    lib, at_lib, at_min = by_run["library"], by_run["hbp@library"], by_run["hbp@min"]
    model = rows[0]["model"]
    if lib.get("error") or at_lib.get("error"):
        return f"{model}: NOT MET: {at_lib.get('error') or lib.get('error')}"
    fits = at_lib["peak_vs_library"] <= FIT_TOLERANCE
    less = at_lib["recompute"] <= lib["recompute"]
    below = not at_min.get("error") and at_min["peak_bytes"] < lib["peak_bytes"]
    status = "met" if fits and less and below else "NOT MET"
    min_text = at_min.get("error") or f"{at_min['peak_bytes'] / MIB:.1f} MiB"
    return (
        f"{model}: {status}: at the library's peak {at_lib['peak_vs_library']:.3f}x "
        f"({'fits' if fits else 'over 1.05x'}), recompute {at_lib['recompute']:.3f} vs "
        f"library {lib['recompute']:.3f} ({'no more' if less else 'MORE'}); min {min_text} vs "
        f"library {lib['peak_bytes'] / MIB:.1f} MiB ({'below' if below else 'NOT below'})"
    )


def table(frame: pd.DataFrame) -> pd.DataFrame:
    def fmt(value, spec):
        return "-" if value is None or pd.isna(value) else format(value, spec)

    out = pd.DataFrame(
        {
            "model": frame["model"],
            "run": frame["run"],
            "capture": frame.get("granularity"),
            "peak MiB": [fmt(v / MIB, ".2f") for v in pd.to_numeric(frame["peak_bytes"])],
            "peak / library": [fmt(v, ".3f") for v in frame.get("peak_vs_library")],
            "peak / naive": [fmt(v, ".3f") for v in frame.get("peak_vs_naive")],
            "recompute": [fmt(v, ".3f") for v in frame.get("recompute")],
            "step s": [fmt(v, ".2f") for v in frame["step_s"]],
            "cpu s": [fmt(v, ".2f") for v in frame["cpu_s"]],
            "grad err": [fmt(v, ".1e") for v in frame.get("grad_err")],
            "error": [e if isinstance(e, str) else "" for e in frame["error"]],
        }
    )
    out["capture"] = [
        {"-": "-"}.get(c, c.split(" ")[0] if isinstance(c, str) else "-") for c in out["capture"]
    ]
    return out


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub table of string cells (pandas' to_markdown needs tabulate)."""
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    for values in frame.itertuples(index=False):
        cells = [str(v).replace("|", "/").replace("\n", " ") for v in values]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="small")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    started = time.perf_counter()
    rows, verdicts = [], []
    for model in args.models:
        model_rows = bench_model(model, args.profile, args.steps)
        rows.extend(model_rows)
        verdicts.append(verdict(model_rows))
        print(verdicts[-1], f"({time.perf_counter() - started:.0f} s so far)", flush=True)
    frame = pd.DataFrame(rows)
    for column in ("peak_bytes", "step_s", "cpu_s", "granularity"):
        if column not in frame:
            frame[column] = None
    args.out.mkdir(parents=True, exist_ok=True)
    frame.drop(columns=["traceback"], errors="ignore").to_csv(args.out / "table.csv", index=False)
    shown = table(frame)
    header = (
        f"profile={args.profile}, {args.threads} threads, torch {torch.__version__}, "
        f"{args.steps} timed steps, {time.perf_counter() - started:.0f} s in all\n\n"
    )
    markdown = header + to_markdown(shown) + "\n\n" + "\n".join(verdicts) + "\n"
    (args.out / "table.md").write_text(markdown)
    for row in rows:
        if row.get("traceback"):
            (args.out / f"error_{row['model']}_{row['run']}.txt").write_text(row["traceback"])
    print(shown.to_string(index=False))
    print("\n".join(verdicts))
    print(f"wrote {args.out / 'table.md'} and table.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
