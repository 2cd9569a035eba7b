"""A Python loop that keeps each step's output for after it: two stacked nn.LSTMCells unrolled
over T tokens (`tests/models/toy.py`'s `UnrolledCells`, hidden 96, vocab 500, batch 4), whose
held sets double with every cut in the loop (NOTE [ Cuts that many values cross ] in
hbp.planner.dp.held_sets). Per T: the captured step's nodes, `plan(graph, "min")`'s CPU
seconds, its least peak over the naive one, the cuts it planned over, and `hbp.enable`'s first
step in a fresh process (wall s, as `engine.summary()` splits it, and the resident peak).

    OMP_NUM_THREADS=1 python experiments/unrolled_loop.py 12 16 24
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VOCAB, HIDDEN, BATCH = 500, 96, 4


def _case(steps: int):
    from tests.models.toy import UnrolledCells

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, steps + 1))
    return UnrolledCells(VOCAB, HIDDEN), tokens[:, :-1], tokens[:, 1:]


def _loss(output, targets):
    return F.cross_entropy(output.reshape(-1, VOCAB), targets.reshape(-1))


def planned(steps: int) -> str:
    """The row's planner columns, on the captured step (loss included)."""
    from hbp.graph.torch.capture import capture
    from hbp.integrations.torch.loss import WithLoss
    from hbp.planner import plan

    model, inputs, targets = _case(steps)
    root = WithLoss(model, lambda output: _loss(output, targets), 1)
    with torch.enable_grad():
        graph = capture(root, (inputs,), {}).graph
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        least = plan(graph, "min")
    seconds = time.process_time() - start
    cuts = least.meta.get("coarse_cuts")
    return (
        f"| {steps} | {len(graph.nodes)} | {seconds:.1f} s | "
        f"{least.predicted_peak_bytes / least.naive_peak_bytes:.3f} | "
        f"{'the usual' if cuts is None else f'{cuts} spread evenly'} |"
    )


def first_step(steps: int) -> str:
    """`hbp.enable`'s first step of this case, in this (fresh) process."""
    import hbp

    model, inputs, targets = _case(steps)
    hbp.enable(model)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loss(model(inputs), targets).backward()
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    split = hbp.engine_of(model).summary().splitlines()[0].split(", ", 2)[-1]
    return f" {wall:.1f} s ({split}), {rss:.2f} GiB |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", type=int, nargs="+")
    parser.add_argument("--first-step", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.first_step is not None:
        print(first_step(args.first_step))
        return
    print('| unroll T | nodes | plan("min") | least peak / naive | cuts | first step |')
    print("|---:|---:|---:|---:|---|---|")
    for steps in args.steps:
        row = planned(steps)
        child = [sys.executable, __file__, "0", "--first-step", str(steps)]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        print(row + done.stdout.rstrip().splitlines()[-1])


if __name__ == "__main__":
    main()
