"""The GPT-2 124M shape (profile medium), side by side in one run:
naive, uniform checkpointing, hbp at the budget equal to checkpointing's measured peak, and
hbp at budget 0.25.

    python experiments/gpt2_medium.py [--quick] [--profile medium]

Writes outputs/bench/gpt2_medium/{<runs>, table.md, table.csv}. Recompute ratios are relative
to the naive run's FLOPs (plain training of the same model), so the chunked loss's logit
recomputation counts as recompute too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from hbp.units import MIB

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "bench" / "gpt2_medium"


def run(name: str, overrides: list[str], common: list[str]) -> dict:
    run_dir = OUT / name
    cmd = [sys.executable, "run.py", *common, *overrides, f"hydra.run.dir={run_dir}"]
    print("+", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((run_dir / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="medium")
    parser.add_argument("--quick", action="store_true", help="smaller batch, fewer steps")
    args = parser.parse_args(argv)
    common = ["workload=gpt2", f"profile={args.profile}", "logger=table", "count_naive_flops=false"]
    # A GPT-2 124M step at 8192 tokens takes minutes on 2 CPU cores: one timed step each.
    common += ["steps=1", "warmup=0"]
    if args.quick:
        common.append("workload.batch_size=2")
    OUT.mkdir(parents=True, exist_ok=True)

    naive = run("naive", ["mode=naive"], common)
    ckpt = run("checkpoint", ["mode=checkpoint"], common)
    # the tiny rows with the chunked loss, as docs/results.md's table was measured (its note)
    chunked = ["mode=tiny", "mode.chunked_loss=true"]
    at_ckpt = run(
        "tiny_at_checkpoint_peak", [*chunked, f"mode.budget={ckpt['peak_bytes']}"], common
    )
    quarter = run("tiny_0.25", [*chunked, "mode.budget=0.25"], common)

    rows = []
    for label, r in [("naive", naive), ("checkpoint", ckpt),
                     ("tiny @ checkpoint peak", at_ckpt), ("tiny @ 0.25", quarter)]:  # fmt: skip
        recompute = r["flops"] / naive["flops"] - 1
        rows.append({
            "mode": label,
            "budget MiB": (r.get("mode_budget_bytes") or float("nan")) / MIB,
            "peak MiB": r["peak_bytes"] / MIB,
            "peak / naive": r["peak_bytes"] / naive["peak_bytes"],
            "predicted MiB": (r.get("mode_predicted_peak_bytes") or float("nan")) / MIB,
            "recompute": recompute,
            "step s": r["step_time_s"],
            "time / naive": r["step_time_s"] / naive["step_time_s"],
        })  # fmt: skip
    table = pd.DataFrame(rows)
    ck_recompute = table.loc[1, "recompute"]
    checks = {
        "tiny@ckpt recompute <= 0.8x checkpoint's": table.loc[2, "recompute"] <= 0.8 * ck_recompute,
        "tiny@ckpt step time <= 0.9x checkpoint's": table.loc[2, "step s"] <= 0.9 * table.loc[1, "step s"],
        "tiny@0.25 peak <= 1.05x budget": quarter["peak_bytes"] <= 1.05 * (quarter.get("mode_budget_bytes") or 0),
        "tiny@0.25 step time <= 1.4x naive": table.loc[3, "time / naive"] <= 1.4,
    }  # fmt: skip
    table.to_csv(OUT / "table.csv", index=False)
    from hbp.analysis.collect import to_markdown

    text = (
        to_markdown(table)
        + "\n\n"
        + "\n".join(f"- {name}: {'yes' if ok else 'NO'}" for name, ok in checks.items())
    )
    (OUT / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
