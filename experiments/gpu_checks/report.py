"""The gpu check's verdicts and its two files: `gpu_check.json` (everything) and
`gpu_check.md` (the table docs/results.md "CUDA" shows).

A row fails when
- its gradients differ from plain autograd's by more than `TOLERANCE[dtype]` (relative to each
  parameter's largest gradient, `step.grad_diff`), or are NaN;
- its allocator peak is above `BUDGET_SLACK` x its budget (hbp rows at a fraction: that
  fraction of the plain step's measured peak);
- its status is "error" or "timeout".
A check fails when one of its rows fails, when it could not run to its end (its process
crashed or outlived its time limit) or, for a model check, when a convolution or attention op
got no kernel workspace measurement at capture. "n/a", "infeasible" (no plan meets the
budget: hbp.BudgetError) and "skipped" rows are reported, not failed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from hbp.units import MIB

#: Largest accepted gradient difference against plain autograd per dtype, relative to each
#: parameter's largest gradient: float32 kernels that differ only in summation order (a
#: recomputed segment, a fused compiled kernel, cuDNN's tf32 convolutions) land far below it;
#: bf16 autocast rounds every matmul input to 8 bits of mantissa.
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}
#: A measured peak may exceed its budget by this factor (allocator rounding, workspace).
BUDGET_SLACK = 1.05


def row_failures(row: dict) -> list[str]:
    """Why `row` fails (empty: it passes)."""
    failures = []
    status = row.get("status")
    if status in ("error", "timeout"):
        failures.append(f"{status}: {row.get('error', '')}".strip())
    diff = row.get("grad_diff")
    tolerance = TOLERANCE.get(row.get("dtype", "float32"), TOLERANCE["float32"])
    if diff is not None and not (diff <= tolerance):  # NaN fails too
        failures.append(f"gradient difference {diff:.3g} > {tolerance:g} ({row.get('dtype')})")
    budget, peak = row.get("budget_bytes"), row.get("peak_bytes")
    if budget and peak is not None and peak > BUDGET_SLACK * budget:
        failures.append(
            f"peak {_mib(peak)} MiB > {BUDGET_SLACK}x budget {_mib(budget)} MiB "
            f"({peak / budget:.3f}x)"
        )
    return failures


def check_failures(result: dict) -> list[str]:
    """Why a check's result fails: its rows', its own error, unmeasured workspace kernels."""
    failures = [f"{r['variant']}: {f}" for r in result.get("rows", []) for f in row_failures(r)]
    if result.get("error"):
        failures.append(result["error"])
    for row in result.get("rows", []):
        unmeasured = (row.get("workspace") or {}).get("unmeasured") or []
        if unmeasured:
            failures.append("no kernel workspace measured for " + ", ".join(unmeasured[:8]))
    return failures


def summarize(document: dict) -> dict:
    """Add each check's `failures` and the run's `failed` list and `ok` flag to `document`."""
    failed = []
    for name, result in document["checks"].items():
        result["failures"] = check_failures(result)
        if result["failures"]:
            failed.append(name)
    document["failed"] = failed
    document["ok"] = not failed
    return document


def write(document: dict, out: Path) -> tuple[Path, Path]:
    """Write `gpu_check.json` and `gpu_check.md` under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "gpu_check.json", out / "gpu_check.md"
    json_path.write_text(json.dumps(document, indent=1, default=_jsonable, allow_nan=True))
    md_path.write_text(markdown(document))
    return json_path, md_path


COLUMNS = (
    "check", "model", "variant", "dtype", "peak MiB", "reserved MiB", "predicted MiB",
    "budget MiB", "peak/budget", "recompute GFLOP", "step ms", "first step s", "grad diff",
    "status",
)  # fmt: skip


def markdown(document: dict) -> str:
    """The run's table, its failures, the kernel workspace found, and the environment."""
    env = document.get("environment", {})
    lines = [
        f"# gpu check: {'PASSED' if document.get('ok') else 'FAILED'}",
        "",
        f"Device: {env.get('device_name', '?')} ({document.get('device')}), torch "
        f"{env.get('torch')} (pinned: {env.get('torch_pinned')}), CUDA {env.get('cuda')}, transformers {env.get('transformers')}, "
        f"hbp at {env.get('git_sha') or '?'} (sources {env.get('source_digest') or '?'}); "
        f"{document.get('wall_s', 0):.0f} s.",
        "Tolerances (grad diff, relative to each parameter's largest gradient): "
        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
        + f"; peaks may exceed their budget by {BUDGET_SLACK}x.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    notes = []
    for name, result in document["checks"].items():
        for row in result.get("rows", []):
            lines.append("| " + " | ".join(_cells(name, row)) + " |")
            if row.get("note"):
                notes.append(f"- {name} {row['variant']}: {row['note']}")
        if result.get("summary"):
            notes.append(f"- {name}: {result['summary']}")
        if not result.get("rows") and not result.get("summary"):
            notes.append(f"- {name}: {result.get('error') or 'no rows'}")
    lines += ["", "Notes:", *(notes or ["- none"]), "", "Kernel workspace measured at capture:"]
    for name, result in document["checks"].items():
        for row in result.get("rows", []):
            if row.get("workspace"):
                lines.append(f"- {name}: {_workspace_line(row['workspace'])}")
    failures = [f"- {n}: {f}" for n, r in document["checks"].items() for f in r["failures"]]
    lines += ["", "Failures:", *(failures or ["- none"]), ""]
    return "\n".join(lines)


def _cells(check: str, row: dict) -> list[str]:
    peak, budget = row.get("peak_bytes"), row.get("budget_bytes")
    recompute = row.get("recompute_flops")
    if recompute is None and row.get("predicted_recompute_flops") is not None:
        recompute = row["predicted_recompute_flops"]  # compiled: the plan's prediction
    status = row.get("status", "?")
    if row_failures(row):
        status = "FAIL: " + "; ".join(row_failures(row))[:120]
    return [
        check,
        row.get("model", ""),
        row.get("variant", ""),
        row.get("dtype", ""),
        _mib(peak),
        _mib(row.get("reserved_bytes")),
        _mib(row.get("predicted_peak_bytes")),
        _mib(budget),
        f"{peak / budget:.3f}" if peak and budget else "-",
        f"{recompute / 1e9:.2f}" if recompute is not None else "-",
        f"{row['step_time_s'] * 1e3:.1f}" if _finite(row.get("step_time_s")) else "-",
        f"{row['first_step_s']:.2f}" if _finite(row.get("first_step_s")) else "-",
        f"{row['grad_diff']:.2e}" if row.get("grad_diff") is not None else "-",
        status,
    ]


def _workspace_line(workspace: dict) -> str:
    ops = workspace.get("ops", {})
    wanted = {op: v for op, v in ops.items() if v["forward"] or v["backward"]}
    measured = sum(v["measured"] for v in ops.values())
    nodes = sum(v["nodes"] for v in ops.values())
    parts = [
        f"{op} fwd {v['forward'] / MIB:.2f} / bwd {v['backward'] / MIB:.2f} MiB"
        for op, v in sorted(
            wanted.items(), key=lambda kv: -max(kv[1]["forward"], kv[1]["backward"])
        )
    ][:6]
    missing = workspace.get("unmeasured") or []
    return (
        f"{measured}/{nodes} nodes measured ({workspace.get('granularity')} capture); largest: "
        + (", ".join(parts) or "none")
        + (f"; NOT measured: {', '.join(missing[:8])}" if missing else "")
    )


def _mib(value) -> str:
    if not _finite(value):
        return "-"
    return f"{value / MIB:.1f}" if value >= 10 * MIB else f"{value / MIB:.2f}"


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _jsonable(value):
    return str(value)
