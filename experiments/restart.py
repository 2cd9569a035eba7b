"""A restarted job with `plan_cache=`: what its first step costs against the first run's.

    OMP_NUM_THREADS=1 python experiments/restart.py llama32      # the 32-layer Llama decoder
    OMP_NUM_THREADS=1 python experiments/restart.py gpt2         # GPT-2 124M, profile medium

Runs the same first step twice, each in a fresh process, with one (new, empty) cache
directory: `HCModule(model, plan_cache=dir).prepare(batch)` (capture, scratch calibration and
planning at the default budget), then one step. The first run measures each op's workspace
and plans; the second reads both from the directory (plans by the captured graph's
fingerprint; workspaces under `dir/scratch`, the whole calibrated graph's by its code and its
inputs' layouts, each op's by its signature). Per run: CPU s of the first step's preparation
and of the step, the ops the calibration ran on real inputs and those it measured, whether
the plan came from the cache, and the plan's predicted and measured peaks. Writes
outputs/bench/restart_<model>.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench"
MODELS = {"llama32": "bench_capture.llama(32)", "gpt2": "bench_capture.gpt2_medium()"}


def one_run(model: str, cache: str) -> dict:
    """The first step of `model` with `plan_cache=cache`, in this process."""
    import torch

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_capture  # noqa: F401  (MODELS name its makers)

    import hbp.graph.torch.calibrate as calibrate
    from hbp.integrations.torch import HCModule

    torch.set_num_threads(1)
    measured = []  # the measurements made (not the ops without a tensor argument, skipped)
    measure = calibrate.measure_op
    calibrate.measure_op = lambda *a: measured.append(measure(*a)) or measured[-1]
    ran = []  # the ops the calibration's forward run ran to read signatures off real inputs
    run_node = calibrate.run_node
    calibrate.run_node = lambda *a: ran.append(1) or run_node(*a)
    module, args, kwargs, loss_fn = eval(MODELS[model])
    hc = HCModule(module, plan_cache=cache)
    c0 = time.process_time()
    plan = hc.prepare(*args, **kwargs)
    prepare_s = time.process_time() - c0
    c0 = time.process_time()
    loss_fn(hc(*args, **kwargs)).backward()
    step_s = time.process_time() - c0
    return {
        "prepare_s": round(prepare_s, 2),
        "step_s": round(step_s, 2),
        "ops_run": len(ran),
        "ops_measured": sum(m is not None for m in measured),
        "plan_from_cache": bool(plan.meta.get("from_cache")),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": hc.measured_peak_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.model, args.child)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for run in ("first run", "restarted"):
            out = subprocess.run(
                [sys.executable, __file__, args.model, "--child", cache],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append({"run": run, **json.loads(out.stdout.strip().splitlines()[-1])})
            print(rows[-1], flush=True)
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"restart_{args.model}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
