"""JAX on XLA:CPU: `jax.grad` vs `hbp.jax.height_compressed_grad`, called as is and jitted.

    python experiments/bench_jax.py                  # writes outputs/bench/jax.{md,csv}
    python experiments/bench_jax.py --quick          # smaller model, one repeat

Workload: a 20-layer MLP chain with residual skips, `h = h + tanh(h @ w)`, 4096 x
1024 float32 activations (16 MiB each), 1024 x 1024 weights, loss `mean(h**2)`; hbp at
budget 0.3. Variants:
- `jax.grad`, `jax.jit(jax.grad)`: plain JAX;
- `hbp` (as is): `height_compressed_grad(loss, 0.3)` called eagerly (strategy "auto");
- `hbp pieces` (as is): the same with strategy="pieces" (separately compiled pieces);
- `jax.jit(hbp)`: the user's own `jax.jit` around it ("auto" runs "fenced" in the trace);
- `jax.jit(hbp remat)`, `hbp.jax.jit(hbp remat)`: the `jax.checkpoint` executor under a plain
  jit and under hbp's jit (XLA:CPU option that keeps the checkpoint barriers).

Every measurement runs in a fresh Python process (the RSS high-water mark belongs to that run)
with `MALLOC_MMAP_THRESHOLD_` fixed, so freed buffers go back to the OS and RSS tracks live
memory; each variant is repeated `--repeats` times (fresh process each). Columns (MiB):
temp = the compiled program's temp buffer (memory analysis; hbp as is: the program or piece
at the peak), peak = memory-analysis peak (temp + outputs; pieces: live arrays + the running
piece's temp + outputs), rss = process max-RSS growth of one call after a warm-up call (min-max
over the repeats; the baseline read once the warm-up call's temp has been unmapped:
`hbp.jax.rss_growth`), rss_first = the same for the first call, compilation included,
*_vs_jit = ratio to `jax.jit(jax.grad)` (rss: of the medians), max_err = the largest absolute
gradient difference to `jax.jit(jax.grad)`, step_s = the measured call's time (median over
the repeats; on a shared machine, a rough figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from hbp.units import MIB

BUDGET = 0.3
ROOT = Path(__file__).resolve().parents[1]
VARIANTS = (
    "jax.grad",
    "jax.jit(jax.grad)",
    "hbp",
    "hbp pieces",
    "jax.jit(hbp)",
    "jax.jit(hbp remat)",
    "hbp.jax.jit(hbp remat)",
)
REFERENCE = "jax.jit(jax.grad)"


def build(quick: bool):
    """(loss, params, x): the residual MLP chain, random weights, fixed seeds."""
    import jax
    import jax.numpy as jnp

    depth, batch, width = (12, 2048, 256) if quick else (20, 4096, 1024)
    keys = jax.random.split(jax.random.PRNGKey(0), depth + 1)
    params = [jax.random.normal(k, (width, width)) / width**0.5 for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width))

    def loss(params, x):
        h = x
        for w in params:
            h = h + jnp.tanh(h @ w)
        return jnp.mean(h**2)

    return loss, params, x


def make(variant: str, loss):
    import jax

    import hbp.jax as hj

    plain = {"jax.grad": jax.grad(loss), "jax.jit(jax.grad)": jax.jit(jax.grad(loss))}
    if variant in plain:
        return plain[variant]
    strategy = {"hbp pieces": "pieces", "jax.jit(hbp remat)": "remat"}.get(variant, "auto")
    if variant == "hbp.jax.jit(hbp remat)":
        strategy = "remat"
    grad_fn = hj.height_compressed_grad(loss, budget=BUDGET, strategy=strategy)
    if variant.startswith("jax.jit("):
        return jax.jit(grad_fn)
    if variant.startswith("hbp.jax.jit("):
        return hj.jit(grad_fn)
    return grad_fn


def worker(variant: str, quick: bool) -> dict:
    """One measurement, in this (fresh) process: compile and warm up, then one measured call
    (RSS growth, wall time). The gradients are compared with those the `REFERENCE` variant
    saved (`HBP_BENCH_REFERENCE`, written by the first measurement of each run)."""
    import jax.numpy as jnp

    import hbp.jax as hj

    loss, params, x = build(quick)
    fn = make(variant, loss)
    row = {"variant": variant}
    if hasattr(fn, "lower"):  # one jitted program: its memory analysis
        analysis = fn.lower(params, x).compile().memory_analysis()
        row["temp_mib"] = analysis.temp_size_in_bytes / MIB
        row["peak_mib"] = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / MIB
    with hj.record_pieces():  # the first call compiles everything (rss_first)
        first_growth = hj.rss_growth(fn, params, x)[0]
    row["rss_first_mib"] = first_growth / MIB if first_growth >= 0 else None
    with hj.record_pieces() as rec:
        growth, wall, got = hj.rss_growth(fn, params, x)
    row["rss_mib"] = growth / MIB if growth >= 0 else None
    row["step_s"] = wall
    if rec.records:  # hbp called as is: the programs it ran
        top = max(rec.records, key=lambda r: r.peak_bytes)
        names = [r.name for r in rec.records if r.name.startswith("one program (")]
        row.update(
            strategy=names[0][len("one program (") : -1] if names else "pieces",
            temp_mib=top.temp_bytes / MIB,
            peak_mib=top.peak_bytes / MIB,
            programs=len(rec.records),
        )
    reference = Path(os.environ.get("HBP_BENCH_REFERENCE", "/nonexistent"))
    if variant == REFERENCE:
        jnp.save(reference, jnp.concatenate([g.ravel() for g in got]))
        row["max_err"] = 0.0
    elif reference.exists():
        want = jnp.load(reference)
        row["max_err"] = float(jnp.max(jnp.abs(jnp.concatenate([g.ravel() for g in got]) - want)))
    if hasattr(fn, "plan") and fn.plan is not None:
        row["predicted_mib"] = fn.plan.predicted_peak_bytes / MIB
    return row


def run_one(variant: str, quick: bool, reference: Path) -> dict:
    env = dict(os.environ)
    env.update(
        MALLOC_MMAP_THRESHOLD_="65536",
        MALLOC_TRIM_THRESHOLD_="0",
        OMP_NUM_THREADS="1",
        JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        HBP_BENCH_REFERENCE=str(reference),
    )
    cmd = [sys.executable, __file__, "--worker", variant]
    if quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["no output"]
        last = next((x for x in reversed(lines) if "Error" in x), lines[-1])
        return {"variant": variant, "error": last[:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(rows: list[dict]) -> list[dict]:
    """One line per variant: memory analysis (deterministic), RSS min-max and median."""
    table = []
    for variant in [v for v in VARIANTS if any(r["variant"] == v for r in rows)]:
        runs = [r for r in rows if r["variant"] == variant and "error" not in r]
        if not runs:
            errors = [r["error"] for r in rows if r["variant"] == variant]
            table.append({"variant": variant, "error": errors[0] if errors else "not run"})
            continue
        rss = [r["rss_mib"] for r in runs if r.get("rss_mib") is not None]
        firsts = [r["rss_first_mib"] for r in runs if r.get("rss_first_mib") is not None]
        first = runs[0]
        table.append(
            {
                "variant": variant,
                "strategy": first.get("strategy", ""),
                "temp_mib": first.get("temp_mib"),
                "peak_mib": first.get("peak_mib"),
                "rss_mib": f"{min(rss):.0f}-{max(rss):.0f}" if rss else "",
                "rss_median": statistics.median(rss) if rss else None,
                "rss_first_mib": f"{min(firsts):.0f}-{max(firsts):.0f}" if firsts else "",
                "first_median": statistics.median(firsts) if firsts else None,
                "max_err": max((r["max_err"] for r in runs if "max_err" in r), default=None),
                "step_s": statistics.median(r["step_s"] for r in runs),
                "predicted_mib": first.get("predicted_mib"),
                "runs": len(runs),
            }
        )
    ref = next((t for t in table if t["variant"] == REFERENCE and "error" not in t), None)
    for t in table:
        if ref is None or "error" in t:
            continue
        if t.get("temp_mib") is not None:
            t["temp_vs_jit"] = t["temp_mib"] / ref["temp_mib"]
        if t.get("peak_mib") is not None:
            t["peak_vs_jit"] = t["peak_mib"] / ref["peak_mib"]
        if t.get("rss_median") is not None:
            t["rss_vs_jit"] = t["rss_median"] / ref["rss_median"]
        if t.get("first_median") is not None:
            t["first_vs_jit"] = t["first_median"] / ref["first_median"]
    return table


COLUMNS = [
    "variant",
    "strategy",
    "temp_mib",
    "temp_vs_jit",
    "peak_mib",
    "peak_vs_jit",
    "predicted_mib",
    "rss_mib",
    "rss_vs_jit",
    "rss_first_mib",
    "first_vs_jit",
    "max_err",
    "step_s",
    "runs",
    "error",
]


def to_markdown(table: list[dict]) -> str:
    columns = [c for c in COLUMNS if any(c in t for t in table)]

    def cell(v) -> str:
        if v is None or v == "":
            return ""
        if isinstance(v, float):
            return f"{v:.2g}" if abs(v) < 0.01 else f"{v:.3g}" if v < 100 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(t.get(c)) for c in columns) + " |" for t in table]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", metavar="VARIANT")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.quick)))
        return
    repeats = 1 if args.quick else args.repeats
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reference = out / "jax_reference_grads.npy"
    reference.unlink(missing_ok=True)
    variants = args.variants.split(",")
    variants = [REFERENCE] + [v for v in variants if v != REFERENCE]
    rows = []
    for _ in range(repeats):  # interleaved, so slow drift on a shared machine hits all alike
        for variant in variants:
            row = run_one(variant, args.quick, reference)
            print(json.dumps(row), flush=True)
            rows.append(row)
    table = summarise(rows)
    reference.unlink(missing_ok=True)
    (out / "jax_runs.json").write_text(json.dumps(rows, indent=1))
    import jax

    command = "python experiments/bench_jax.py" + (" --quick" if args.quick else "")
    header = (
        "# JAX: jax.grad vs hbp.jax.height_compressed_grad (budget 0.3)\n\n"
        f"Command: `{command}`; jax {jax.__version__}, backend {jax.default_backend()}; MiB; "
        f"one fresh process per measurement, {repeats} per variant.\n\n"
    )
    markdown = to_markdown(table)
    (out / "jax.md").write_text(header + markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
