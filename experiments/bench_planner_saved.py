"""Planning alone on saved captured graphs: the issue's Llama decoders captured and calibrated
once (as HCModule does) and pickled, then `plan` timed in CPU seconds (`time.process_time`,
for a loaded machine) at 0.5, 0.3 and "min" with the least peaks forgotten before each, and
each result recorded (peak or BudgetError minimum, segments) to compare two versions of the
planner exactly.

    python experiments/bench_planner_saved.py save DIR 2 8 32 64
    python experiments/bench_planner_saved.py plan DIR OUT.json 2 8 32 64
    python experiments/bench_planner_saved.py compare A.json B.json
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_planner_real import BUDGETS, forget_least_peaks, llama, plan_any  # noqa: E402

from hbp.errors import BudgetError  # noqa: E402


def save(folder: Path, layers: list[int]) -> None:
    from hbp.graph.torch.calibrate import calibrate_scratch
    from hbp.graph.torch.capture import capture
    from hbp.integrations.torch.loss import WithLoss

    folder.mkdir(parents=True, exist_ok=True)
    for n in layers:
        model, args, kwargs, loss_fn = llama(n)
        root = WithLoss(model, loss_fn, len(args))
        with torch.enable_grad():
            captured = capture(root, args, kwargs)
        calibrate_scratch(captured, args, kwargs)
        with open(folder / f"llama{n}.pkl", "wb") as f:
            pickle.dump(captured.graph, f)
        print(f"llama{n}: {len(captured.graph.nodes)} nodes", flush=True)


def _segment(s) -> list:
    return [s.start, s.stop, bool(s.recompute), [_segment(c) for c in s.children], list(s.pinned)]


def plan_all(folder: Path, out: Path, layers: list[int]) -> None:
    results = {}
    print("| layers | " + " | ".join(f"plan({b!r}) CPU s" for b in BUDGETS) + " |")
    print("|---:|" + "---:|" * len(BUDGETS))
    for n in layers:
        with open(folder / f"llama{n}.pkl", "rb") as f:
            graph = pickle.load(f)
        cells = []
        for budget in BUDGETS:
            forget_least_peaks()
            c0 = time.process_time()
            try:
                p = plan_any(graph, budget)
                r = {
                    "peak": p.predicted_peak_bytes,
                    "flops": p.predicted_recompute_flops,
                    "segments": [_segment(s) for s in p.segments],
                }
            except BudgetError as err:
                r = {"minimum": err.minimum, "error": str(err)}
            r["cpu_s"] = time.process_time() - c0
            results[f"{n}/{budget}"] = r
            tag = " (BudgetError)" if "minimum" in r else ""
            cells.append(f"{r['cpu_s']:.2f}{tag}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    out.write_text(json.dumps(results))


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    differ = 0
    for key in sorted(set(x) & set(y)):
        ra = {k: v for k, v in x[key].items() if k != "cpu_s"}
        rb = {k: v for k, v in y[key].items() if k != "cpu_s"}
        same = ra == rb
        differ += not same
        print(f"{key}: {'same' if same else 'DIFFERENT'} "
              f"({x[key]['cpu_s']:.2f} s -> {y[key]['cpu_s']:.2f} s CPU)")  # fmt: skip
    print(f"{differ} of {len(set(x) & set(y))} differ")
    return int(differ > 0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "save":
        save(Path(rest[0]), [int(v) for v in rest[1:]])
    elif cmd == "plan":
        plan_all(Path(rest[0]), Path(rest[1]), [int(v) for v in rest[2:]])
    elif cmd == "compare":
        sys.exit(compare(Path(rest[0]), Path(rest[1])))
    else:
        sys.exit(__doc__)
