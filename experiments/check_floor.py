"""The floor under the least peak (NOTE [ A floor under the least peak ] in
hbp.planner.dp.least_peak) against the least peak itself, on every graph of
`experiments/check_plans.py` and on random DAGs: the floor must never be above it, and the
least peak had without the DP (`least_peak_value`, NOTE [ A plan at the floor ]) must be the
DP's.

    python experiments/check_floor.py [--dags 30]

Prints, per graph and cut set (the first of `cut_choices` and their union), the floor and the
least peak, with "at floor" where the plan at the floor was found; exits 1 if a floor is
above its least peak or a value differs from the DP's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from check_plans import graphs  # noqa: E402

from hbp.analysis.liveness import GraphInfo  # noqa: E402
from hbp.graph import synthetic  # noqa: E402
from hbp.planner.cuts import cut_choices  # noqa: E402
from hbp.planner.dp.least_peak import (  # noqa: E402
    _remembered,
    forget_least_peaks,
    least_peak_cached,
    least_peak_floor,
    least_peak_value,
    union_of,
)


def check(name: str, graph) -> bool:
    """Print the floor and least peak of `graph`'s cut sets; False where a floor is above."""
    info = GraphInfo.of(graph)
    if info.rng_state_bytes:
        print(f"skip {name}: generator states (the floor is not used)")
        return True
    choices = cut_choices(info)
    ok = True
    cells = []
    for label, cuts in (("first", choices[0]), ("union", union_of(choices))):
        forget_least_peaks()
        value = least_peak_value(info, cuts, True)
        at_floor = ("value", tuple(cuts), True) in _remembered(info)
        forget_least_peaks()
        floor = least_peak_floor(info, cuts, True)
        least = least_peak_cached(info, cuts, True)[0]
        ok = ok and floor <= least and value == least
        cells.append(f"{label} {floor:,} <= {least:,}" + (" (at floor)" if at_floor else ""))
    print(("ok   " if ok else "ABOVE ") + f"{name}: " + "; ".join(cells), flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dags", type=int, default=30, help="random DAGs per size")
    args = parser.parse_args(argv)
    ok = all([check(name, graph) for name, graph in graphs().items()])
    for seed in range(args.dags):
        for n in (8, 16, 30):
            dag = synthetic.random_dag(n, seed=seed, skip_prob=0.3, max_skip=6)
            ok = check(f"random_dag{n}_{seed}", dag) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
