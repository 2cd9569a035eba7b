"""Plans carried across sequence lengths (`hbp.planner.carry`): what a plan made for one length
gives at another, against the plan the DP makes for that length itself.

    OMP_NUM_THREADS=1 python experiments/carried_plans.py            # writes the table
    OMP_NUM_THREADS=1 python experiments/carried_plans.py --budget 0.5

The step of a transformers Qwen2 causal LM from a config (hidden 128, 4 layers, vocab 1000,
random weights, batch 4; `experiments/variable_lengths.py`'s model) is captured at six lengths
from 48 to 128 tokens. Each length is planned by the DP at the budget (`plan`), and each of the
others' plans (with their least-peak plans, for a relative budget) is carried to it alone
(`carried_plan` with one donor). Per pair: whether a carried plan fits, the budget it resolved
to over the DP's own, its predicted peak over that budget, its recompute less the DP plan's
(% of the step's FLOPs), and the milliseconds it took against the DP's seconds. Writes
outputs/bench/carried_plans.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variable_lengths import VOCAB, qwen2  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "outputs" / "bench"
LENGTHS = (48, 64, 80, 96, 112, 128)


def captured_graphs(lengths) -> dict:
    import hbp

    model = qwen2()
    hbp.enable(model, budget=1.0, carry_plans=False)
    engine, out = hbp.engine_of(model), {}
    for length in lengths:
        ids = torch.randint(3, VOCAB, (4, length), generator=torch.Generator().manual_seed(length))
        model(input_ids=ids, labels=ids).loss.backward()
        out[length] = engine.captured.graph
    return out


def main(argv: list[str] | None = None) -> int:
    from hbp.planner import min_feasible_peak, plan
    from hbp.planner.budget import Budget
    from hbp.planner.carry import Donor, carried_plan, donor_floor_gap, structure_key

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="50%act")
    args = parser.parse_args(argv)
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    torch.set_num_threads(1)
    graphs = captured_graphs(LENGTHS)
    assert len({structure_key(g) for g in graphs.values()}) == 1
    own, least, gap, seconds = {}, {}, {}, {}
    for length, graph in graphs.items():
        started = time.process_time()
        own[length] = plan(graph, budget)
        seconds[length] = time.process_time() - started
        peak, least[length] = min_feasible_peak(graph)
        gap[length] = donor_floor_gap(graph, peak)
    lines = [
        f"Budget {budget!r}. Each cell: carried plan's budget / the DP's budget, predicted peak / "
        "budget, recompute less the DP plan's (% of step FLOPs); '-': no carried plan fits.",
        "",
        "| from \\ to | " + " | ".join(str(n) for n in LENGTHS) + " |",
        "|---|" + "---|" * len(LENGTHS),
    ]
    carried_ms = []
    for source in LENGTHS:
        cells = []
        for target in LENGTHS:
            if target == source:
                cells.append("")
                continue
            donor = Donor(graphs[source], own[source], least[source], gap[source])
            started = time.process_time()
            carried = carried_plan(graphs[target], Budget.parse(budget), [donor])
            carried_ms.append(1000 * (time.process_time() - started))
            if carried is None:
                cells.append("-")
                continue
            mine = own[target]
            extra = carried.predicted_recompute_flops - mine.predicted_recompute_flops
            cells.append(
                f"{carried.budget_bytes / mine.budget_bytes:.3f}, "
                f"{carried.predicted_peak_bytes / carried.budget_bytes:.3f}, "
                f"{100 * extra / mine.naive_flops:+.2f}%"
            )
        lines.append(f"| {source} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"The DP's own plan per length: {min(seconds.values()):.2f}-{max(seconds.values()):.2f} s "
        f"CPU; a carried plan: {min(carried_ms):.0f}-{max(carried_ms):.0f} ms. The DP plans' "
        "recompute: "
        + ", ".join(
            f"{n}: {100 * p.predicted_recompute_ratio:.2f}%" for n, p in sorted(own.items())
        )
        + ".",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "carried_plans.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
