"""A loop over stacked weights under `jax.jit`: hbp's compiled step against plain `jax.grad`.

    python experiments/jax_stacked_weights.py     # writes outputs/bench/jax_stacked_weights.md

Workloads: `lax.scan` over `W[12, 256, 256]` (3 MiB), `h = h + tanh(h @ W[i])`, loss
`mean(h**2)`, at batch 64, 256 and 1024, with the same layers' weights in a Python list next
to it; and a `fori_loop` over stacked `W1[8, 256, 512]`, `b1`, `W2[8, 512, 256]`, `b2`
(`W1[i]` is a `dynamic_slice` at a computed index) at batch 64 and 512. Each cell is the compiled program's memory analysis (temp + outputs, MiB) of
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


def fori_mlp(p, x):
    def body(i, h):
        return h + jnp.tanh(h @ p["W1"][i] + p["b1"][i]) @ p["W2"][i] + p["b2"][i]

    return jnp.mean(jax.lax.fori_loop(0, FORI_LAYERS, body, x) ** 2)


FORI_LAYERS, FORI_HIDDEN = 8, 512


def fori_params():
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    return {
        "W1": jax.random.normal(keys[0], (FORI_LAYERS, WIDTH, FORI_HIDDEN)) * WIDTH**-0.5,
        "b1": jnp.zeros((FORI_LAYERS, FORI_HIDDEN)),
        "W2": jax.random.normal(keys[1], (FORI_LAYERS, FORI_HIDDEN, WIDTH)) * FORI_HIDDEN**-0.5,
        "b2": jnp.zeros((FORI_LAYERS, WIDTH)),
    }


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
    for batch in (64, 512):
        x = jax.random.normal(jax.random.PRNGKey(1), (batch, WIDTH))
        plain = compiled_mib(jax.grad(fori_mlp), fori_params(), x)
        cells = [cell(fori_mlp, b, fori_params(), x) for b in BUDGETS]
        lines.append(f"| fori_loop MLP | {batch} | {plain:.2f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
