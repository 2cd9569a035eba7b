"""A loop over stacked weights under `jax.jit`: hbp's compiled step against plain `jax.grad`.

    python experiments/jax_stacked_weights.py     # writes outputs/bench/jax_stacked_weights.md

Workload: `lax.scan` over `W[12, 256, 256]` (3 MiB), `h = h + tanh(h @ W[i])`, loss
`mean(h**2)`, at batch 64, 256 and 1024; the same layers with their weights in a Python list
next to it. Each cell is the compiled program's memory analysis (temp + outputs, MiB) of
`jax.jit(height_compressed_grad(loss, budget))`, then the plan's predicted peak; "warns"
marks a plan that warns (NOTE [ Loops over stacked weights ]). Memory only: deterministic.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import hbp.jax as hj
from hbp.errors import BudgetError
from hbp.units import MIB

LAYERS, WIDTH = 12, 256
BUDGETS = ("min", 0.3, 0.5, 0.7)


def stacked(w, x):
    h, _ = jax.lax.scan(lambda h, wi: (h + jnp.tanh(h @ wi), None), x, w)
    return jnp.mean(h**2)


def listed(ws, x):
    for wi in ws:
        x = x + jnp.tanh(x @ wi)
    return jnp.mean(x**2)


def compiled_mib(fn, *args) -> float:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / MIB


def cell(loss, budget, *args) -> str:
    grad_fn = hj.height_compressed_grad(loss, budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            measured = compiled_mib(grad_fn, *args)
        except BudgetError:
            return "BudgetError"
    warned = any("stacked weights" in str(c.message) for c in caught)
    plan = grad_fn.plan.predicted_peak_bytes / MIB
    return f"{measured:.2f} / {plan:.2f}" + (" warns" if warned else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench/jax_stacked_weights.md")
    args = parser.parse_args()
    head = "| weights | batch | plain jax.grad | " + " | ".join(map(str, BUDGETS)) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(BUDGETS)]
    w = jax.random.normal(jax.random.PRNGKey(0), (LAYERS, WIDTH, WIDTH)) / 16
    for batch in (64, 256, 1024):
        x = jax.random.normal(jax.random.PRNGKey(1), (batch, WIDTH))
        for name, loss, weights in (("stacked", stacked, w), ("list", listed, list(w))):
            plain = compiled_mib(jax.grad(loss), weights, x)
            cells = [cell(loss, b, weights, x) for b in BUDGETS]
            lines.append(f"| {name} | {batch} | {plain:.2f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
