"""`make bench`: every benchmark behind the README's tables, results under outputs/bench/.

    python experiments/bench.py                 # everything (about two hours on 2 cores)
    python experiments/bench.py --only matrix   # one part: matrix | optimum | chunked_ce | medium | jax | planner
    python experiments/bench.py --quick         # fewer steps and budgets (a smoke run)

Parts:
- matrix: the experiments conf/experiment/matrix_<mode>.yaml, one `python run.py
  experiment=<name>` each (profile small, every workload x {naive, checkpoint, tiny at budgets
  1.0 ... 0.1 and "min", sac, compile_budget}, verify=true), into
  outputs/bench/matrix/<mode>; then the Pareto report (pareto.md/.csv/.png).
- optimum: the planner against the MILP optimum on every workload's graph, and on reduced
  graphs of the same families where the MILP finishes (experiments/bench_optimum.py,
  optimum.md/.csv); the Pareto plot then gains the optimum's frontier (run after matrix).
- chunked_ce: the chunked LM head + cross-entropy against F.cross_entropy at GPT-2 vocab.
- medium: GPT-2 124M shape (profile medium): naive, checkpoint, tiny at the budget equal to
  checkpoint's measured peak, tiny at 0.25 (experiments/gpt2_medium.py).
- jax: jax.grad against hbp.jax.height_compressed_grad on an MLP chain
  (experiments/bench_jax.py, jax.md), then the JAX runner rows: the experiments
  conf/experiment/jax_runner*.yaml (framework=jax, gpt2 and synthetic_dag, naive, checkpoint
  and tiny at "min") into outputs/bench/jax_runner, printed with hbp.analysis.collect.
- planner: plan quality and planning time against depth (residual_net 12..192 layers at 0.5),
  planner vs MILP optimum on random DAGs (experiments/bench_planner.py, planner.md).
Every run is a `run.py` process (Hydra multirun), so one crash leaves the others intact.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench"


MATRIX = ("naive", "checkpoint", "tiny", "sac", "compile_budget")  # conf/experiment/matrix_*.yaml


def experiment(name: str, *overrides: str) -> None:
    """`python run.py experiment=<name>` (a Hydra multirun; finished runs in its sweep dir are
    skipped, so an interrupted `make bench` picks up where it stopped); failures are
    reported, not fatal."""
    cmd = [sys.executable, "run.py", f"experiment={name}", *overrides]
    print("+", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode:
        print(f"experiment {name} exited {done.returncode}; continuing", file=sys.stderr)


def matrix(quick: bool) -> None:
    for mode in MATRIX:
        overrides = ["steps=2"] if quick else []
        if quick and mode == "tiny":
            overrides.append("mode.budget=0.5,0.2")  # replaces the experiment's sweep
        experiment(f"matrix_{mode}", *overrides)
    from hbp.report.pareto import write_pareto

    table = write_pareto(OUT / "matrix", OUT)
    print(f"wrote {OUT / 'pareto.md'} ({len(table)} runs)")


def script(name: str, *args: str) -> None:
    cmd = [sys.executable, str(ROOT / "experiments" / name), *args]
    print("+", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT)
    if done.returncode:
        print(f"{name} exited {done.returncode}; continuing", file=sys.stderr)


def optimum(quick: bool) -> None:
    script("bench_optimum.py", *(["--quick"] if quick else []))
    if (OUT / "matrix").exists():  # redraw the Pareto report with the optimum's frontier
        from hbp.report.pareto import write_pareto

        write_pareto(OUT / "matrix", OUT)


def jax_part(quick: bool) -> None:
    script("bench_jax.py", *(["--quick"] if quick else []))
    experiment("jax_runner")  # small already (profile small, 6 runs); --quick does not change it
    experiment("jax_runner_tiny")
    from hbp.analysis.collect import collect, results_table, to_markdown

    runs = OUT / "jax_runner"
    table = to_markdown(results_table(collect(runs)))
    (OUT / "jax_runner.md").write_text(table + "\n")
    print(f"JAX in the runner ({runs}):\n{table}")


PARTS = {
    "matrix": matrix,
    "optimum": optimum,
    "chunked_ce": lambda quick: script("bench_chunked_ce.py", *(["--quick"] if quick else [])),
    "medium": lambda quick: script("gpt2_medium.py", *(["--quick"] if quick else [])),
    "jax": jax_part,
    "planner": lambda quick: script("bench_planner.py", *(["--quick"] if quick else [])),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(PARTS), action="append", help="run only these")
    parser.add_argument("--quick", action="store_true", help="fewer steps and budgets")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    OUT.mkdir(parents=True, exist_ok=True)
    for part in args.only or list(PARTS):
        print(f"== {part}", flush=True)
        PARTS[part](args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
