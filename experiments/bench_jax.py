"""JAX on XLA:CPU: plain `jax.grad` vs `hbp.jax.height_compressed_grad` at several budgets.

    .venv/bin/python experiments/bench_jax.py            # writes outputs/bench/jax.{md,csv}
    .venv/bin/python experiments/bench_jax.py --quick    # smaller models, fewer steps

Workloads: a deep tanh MLP (a chain) and a small pre-LN transformer (attention + GELU MLP
blocks with residual connections). Modes:
- naive: `jax.jit(jax.grad(loss))`, one XLA program;
- pieces: `height_compressed_grad(loss, budget)` called eagerly (the default "auto"
  strategy): every segment a separately compiled program;
- remat: `height_compressed_grad(loss, budget, strategy="remat")` called eagerly: one
  program with `jax.checkpoint` segments, compiled with `hbp.jax.compiler_options()`;
- remat-plain-jit: `jax.jit(height_compressed_grad(loss, budget))`: the same program
  compiled with XLA:CPU's default passes (which undo the recomputation).

Every row runs in a fresh Python process (so the RSS high-water mark belongs to that run) with
`MALLOC_MMAP_THRESHOLD_` fixed, so freed buffers go back to the OS and RSS tracks live memory.
Columns (bytes in MiB): peak = memory analysis of the compiled programs that ran (pieces: max
of live arrays + temp + output of the running piece), temp = that program's temp buffer,
rss = max-RSS growth of one measured step, predicted = the planner's simulated peak,
recompute_ratio = predicted recompute FLOPs / forward FLOPs, step_s = median step time over
the timed steps (with min and max), *_vs_naive = ratio to the naive row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
BUDGETS = (1.0, 0.5, 0.3)
ROOT = Path(__file__).resolve().parents[1]


def build(workload: str, quick: bool):
    """(loss_fn, params, batch) for a workload, random weights, fixed seeds."""
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    if workload == "mlp":
        depth, batch, width = (16, 2048, 64) if quick else (32, 2048, 256)
        keys = jax.random.split(key, depth + 1)
        params = [jax.random.normal(k, (width, width)) / width**0.5 for k in keys[:-1]]
        x = jax.random.normal(keys[-1], (batch, width))

        def loss(params, x):
            for w in params:
                x = jnp.tanh(x @ w)
            return jnp.mean(x**2)

        return loss, params, x

    if workload == "transformer":
        blocks, batch, seq, width, heads = (2, 2, 64, 64, 4) if quick else (6, 4, 256, 256, 4)
        keys = iter(jax.random.split(key, 8 * blocks + 2))

        def dense(n_in, n_out):
            return jax.random.normal(next(keys), (n_in, n_out)) / n_in**0.5

        params = [
            {
                "ln1": jnp.ones((width,)),
                "qkv": dense(width, 3 * width),
                "proj": dense(width, width),
                "ln2": jnp.ones((width,)),
                "fc": dense(width, 4 * width),
                "out": dense(4 * width, width),
            }
            for _ in range(blocks)
        ]
        x = jax.random.normal(next(keys), (batch, seq, width))

        def layer_norm(h, scale):
            mu = jnp.mean(h, -1, keepdims=True)
            var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
            return (h - mu) * jax.lax.rsqrt(var + 1e-5) * scale

        def attention(h, p):
            b, t, d = h.shape
            q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
            q, k, v = (a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in (q, k, v))
            scores = q @ k.transpose(0, 1, 3, 2) / (d // heads) ** 0.5
            mask = jnp.tril(jnp.ones((t, t), bool))
            att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
            return (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d) @ p["proj"]

        def loss(params, x):
            h = x
            for p in params:
                h = h + attention(layer_norm(h, p["ln1"]), p)
                h = h + jax.nn.gelu(layer_norm(h, p["ln2"]) @ p["fc"]) @ p["out"]
            return jnp.mean(h**2)

        return loss, params, x
    raise SystemExit(f"unknown workload {workload!r}: expected mlp or transformer")


def worker(workload: str, mode: str, budget: float, steps: int, quick: bool) -> dict:
    """One row, in this (fresh) process."""
    import jax

    import hbp
    import hbp.jax as hj

    loss, params, x = build(workload, quick)
    row = {"workload": workload, "mode": mode, "budget": budget if mode != "naive" else None}
    plan = None
    if mode == "naive":
        fn = jax.jit(jax.grad(loss))
    else:
        strategy = "remat" if mode == "remat" else "auto"
        grad_fn = hj.height_compressed_grad(loss, budget=budget, strategy=strategy)
        plan_start = time.perf_counter()
        try:
            plan = grad_fn.get_plan(params, x)
        except hbp.BudgetError as e:
            return {**row, "error": f"infeasible: minimum {e.minimum / MIB:.2f} MiB"}
        row["plan_s"] = time.perf_counter() - plan_start
        fn = jax.jit(grad_fn) if mode == "remat-plain-jit" else grad_fn
    report = hj.measure(fn, params, x)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn(params, x))
        times.append(time.perf_counter() - start)
    row.update(
        strategy=report.strategy,
        peak_mib=report.peak_bytes / MIB,
        temp_mib=report.temp_bytes / MIB,
        rss_mib=report.rss_growth_bytes / MIB if report.rss_growth_bytes >= 0 else None,
        pieces=report.n_pieces,
        step_s=statistics.median(times),
        step_min_s=min(times),
        step_max_s=max(times),
    )
    if plan is not None:
        row.update(
            predicted_mib=plan.predicted_peak_bytes / MIB,
            naive_predicted_mib=plan.naive_peak_bytes / MIB,
            segments=len(plan.segments),
            depth=max((s.depth() for s in plan.segments), default=0),
            recompute_ratio=plan.predicted_recompute_ratio,
        )
    return row


def run_row(workload: str, mode: str, budget: float, steps: int, quick: bool) -> dict:
    env = dict(os.environ)
    env.update(
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="0",
        OMP_NUM_THREADS="1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    cmd = [sys.executable, __file__, "--worker", workload, mode, str(budget), "--steps", str(steps)]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"workload": workload, "mode": mode, "budget": budget, "error": last[:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def to_markdown(table) -> str:
    """A pipe table (pandas' to_markdown needs tabulate, which hbp does not depend on)."""

    def cell(v) -> str:
        if v is None or (isinstance(v, float) and v != v):
            return ""
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(False)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "MODE", "BUDGET"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench"))
    args = parser.parse_args()
    if args.worker:
        workload, mode, budget = args.worker
        print(json.dumps(worker(workload, mode, float(budget), args.steps, args.quick)))
        return

    import pandas as pd

    rows = []
    for workload in args.workloads.split(","):
        configs = [("naive", 1.0)]
        for mode in ("pieces", "remat", "remat-plain-jit"):
            configs += [(mode, b) for b in BUDGETS]
        for mode, budget in configs:
            row = run_row(workload, mode, budget, args.steps, args.quick)
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = pd.DataFrame(rows)
    naive = table[table["mode"] == "naive"].set_index("workload")
    table["peak_vs_naive"] = table["peak_mib"] / table["workload"].map(naive["peak_mib"])
    table["time_vs_naive"] = table["step_s"] / table["workload"].map(naive["step_s"])
    columns = [
        "workload",
        "mode",
        "budget",
        "strategy",
        "predicted_mib",
        "peak_mib",
        "peak_vs_naive",
        "temp_mib",
        "rss_mib",
        "pieces",
        "segments",
        "depth",
        "recompute_ratio",
        "step_s",
        "step_min_s",
        "step_max_s",
        "time_vs_naive",
    ]
    table = table[[c for c in columns if c in table] + [c for c in table if c not in columns]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "jax.csv", index=False)
    header = (
        "# JAX on XLA:CPU: naive jax.grad vs hbp.jax.height_compressed_grad\n\n"
        f"Command: `python experiments/bench_jax.py{' --quick' if args.quick else ''}`; "
        f"jax {__import__('jax').__version__}; MiB; one fresh process per row.\n\n"
    )
    markdown = to_markdown(table)
    (out / "jax.md").write_text(header + markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
