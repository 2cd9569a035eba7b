"""What a new input signature costs: one HCModule, at its default budget, stepped at a batch
shape, again at it (warm), then at a new sequence length and a new batch size.

    OMP_NUM_THREADS=1 python experiments/new_signatures.py            # the 32-layer Llama
    OMP_NUM_THREADS=1 python experiments/new_signatures.py --layers 4

The Llama decoder of the planner benchmarks (`bench_capture.llama`: hidden 128, 4 heads, vocab
2048, 2 x 128 tokens). Per step: CPU s of the whole step (forward and backward), and for a
first step of its signature the capture's and the plan's CPU s as HCModule records them
(`Compiled.capture_time_s`, `plan_time_s`; the rest is the calibration, the step itself and
the measured closed loop), and what made the plan (`Plan.meta["solved_by"]`: "carried" for a
plan carried from another signature, NOTE [ Plans carried across sizes ]). Writes
outputs/bench/new_signatures_<layers>.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench"
#: (what the step is, batch, sequence length)
STEPS = (
    ("first step", 2, 128),
    ("warm step", 2, 128),
    ("new length", 2, 96),
    ("warm step", 2, 96),
    ("new batch size", 1, 128),
    ("warm step", 1, 128),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "experiments"))
    from bench_capture import llama

    import hbp

    model, (ids,), _, _ = llama(args.layers)
    hc = hbp.HCModule(model)
    lines = [
        f"Llama, {args.layers} layers, HCModule at its default budget (CPU s, one thread)",
        "",
        "| step | batch x tokens | step | capture | plan | plan made by |",
        "|---|---|---:|---:|---:|---|",
    ]
    for what, batch, length in STEPS:
        x = ids[:batch, :length]
        before = hc._current
        c0 = time.process_time()
        hc(x, labels=x).loss.backward()
        seconds = time.process_time() - c0
        compiled = hc._current
        new = compiled is not before and what != "warm step"
        capture = f"{compiled.capture_time_s:.2f}" if new else ""
        planned = f"{compiled.plan_time_s:.2f}" if new else ""
        made_by = compiled.plan.meta.get("solved_by", "") if new else ""
        lines.append(
            f"| {what} | {batch} x {length} | {seconds:.2f} | {capture} | {planned} | {made_by} |"
        )
        print(lines[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"new_signatures_{args.layers}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
