"""The steady-state step of HCModule against the plain step, on the issue's transformers Llama
(`bench_capture.llama`: hidden 128, 4 heads, 2 x 128 tokens) at the default budget: what the
checkpoint machinery costs on the host once the plan is made.

    OMP_NUM_THREADS=1 python experiments/bench_step_overhead.py 32
    OMP_NUM_THREADS=1 python experiments/bench_step_overhead.py 32 --budget 0.5 --steps 11

Prints the median wall time of `steps` plain steps and `steps` HCModule steps (after three of
each untimed, the first HCModule step planning), their ratio, and the plan's segments (all,
recomputed). On CPU at this width the recompute is a few percent of the FLOPs, so the ratio is
mostly host time per segment and saved tensor; a GPU step of small kernels pays it the same.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from bench_capture import llama

import hbp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", type=int)
    parser.add_argument("--budget", default=None, help="as HCModule takes it: 0.5, min, 50%%act")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model, inputs, kwargs, _ = llama(args.layers)
    budget = args.budget  # a string HCModule parses itself ("0.5" is a fraction)
    hc = hbp.HCModule(model) if budget is None else hbp.HCModule(model, budget)

    def plain():
        model.zero_grad(set_to_none=True)
        model(*inputs, **kwargs).loss.backward()

    def wrapped():
        model.zero_grad(set_to_none=True)
        hc(*inputs, **kwargs).loss.backward()

    for _ in range(3):
        wrapped()
        plain()
    times = {"plain": [], "hbp": []}
    for _ in range(args.steps):  # interleaved: a slower spell of the machine hits both
        for name, step in (("plain", plain), ("hbp", wrapped)):
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    plain_s, hbp_s = (statistics.median(times[k]) for k in ("plain", "hbp"))

    def count(segments, recomputed_only):
        return sum(
            (not recomputed_only or s.recompute) + count(s.children, recomputed_only)
            for s in segments
        )

    segments = hc.plan.segments
    print(
        f"| {args.layers} | {budget or 'default'} | {plain_s:.3f} | {hbp_s:.3f} | "
        f"{hbp_s / plain_s:.2f} | {count(segments, False)} ({count(segments, True)}) |"
    )


if __name__ == "__main__":
    main()
