"""Run tables: every bench run under a directory as one pandas DataFrame.

    frame = collect("outputs/multirun/2025-01-01/12-00-00")
    print(to_markdown(results_table(frame)))

or from the shell (the README's results table is made this way):

    python -m hbp.analysis.collect outputs/multirun/<date>/<time> --markdown
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import pandas as pd

from hbp.units import MIB

METRICS_FILE = "metrics.json"
ERROR_FILE = "error.json"
DEFAULT_FRAMEWORK = "torch"  # what a metrics.json without a `framework` field ran on


def _read_records(root: Path, name: str) -> list[dict]:
    records = []
    for path in sorted(root.rglob(name)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            warnings.warn(f"skipping {path}: {error}", stacklevel=3)
            continue
        if not isinstance(record, dict):
            warnings.warn(f"skipping {path}: not a JSON object", stacklevel=3)
            continue
        record["run_dir"] = str(path.parent)
        records.append(record)
    return records


def collect(root: str | Path, *, include_errors: bool = False) -> pd.DataFrame:
    """One row per run under `root` (every metrics.json, recursively).

    Columns: the metrics.json fields (framework, workload, mode, profile, peak_bytes, flops,
    ...), the nested `config` flattened into `config.<group>.<key>` columns (e.g.
    `config.mode.budget`), and `run_dir`. `framework` is "torch" for runs written before the
    field existed (torch and JAX runs share one table: hbp/bench/jax_run.py). With `include_errors`, failed runs (error.json) are rows too, with
    status "error" and their error fields. Rows are ordered by start time, then run dir. A
    root without runs gives an empty DataFrame; a root that does not exist raises
    FileNotFoundError.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no such run directory: {root}")
    records = _read_records(root, METRICS_FILE)
    if include_errors:
        records += _read_records(root, ERROR_FILE)
    if not records:
        return pd.DataFrame()
    for record in records:
        record.setdefault("framework", DEFAULT_FRAMEWORK)
    frame = pd.json_normalize(records, sep=".")
    keys = [c for c in ("started_at", "run_dir") if c in frame]
    return frame.sort_values(keys, kind="stable").reset_index(drop=True)


def frameworks(runs: pd.DataFrame) -> pd.Series:
    """Each run's framework ("torch" where the column is missing or empty)."""
    column = runs.get("framework", pd.Series(DEFAULT_FRAMEWORK, index=runs.index))
    return column.fillna(DEFAULT_FRAMEWORK)


def naive_reference(runs: pd.DataFrame, column: str) -> pd.Series:
    """For each run, `column` of the naive run of the same framework on the same workload and
    profile (NaN where there is none), aligned with `runs`' index."""
    keys = pd.DataFrame(
        {"framework": frameworks(runs), "workload": runs["workload"], "profile": runs["profile"]}
    )
    naive_rows = runs["mode"] == "naive"
    naive = runs[column][naive_rows].groupby([keys[c][naive_rows] for c in keys]).first()
    return pd.Series(
        [naive.get(tuple(k), math.nan) for k in keys.itertuples(index=False)],
        index=runs.index,
        dtype=float,
    )


def results_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The README table: per run, workload, mode (with its set parameters), peak MiB, the peak
    relative to naive's of the same framework on the same workload and profile, GFLOPs,
    recompute ratio, step time (median ms); first a `framework` column when some run is not
    torch's. Rows in `frame` order."""
    if frame.empty:
        return pd.DataFrame()
    ok = frame[frame.get("status", pd.Series("ok", index=frame.index)).fillna("ok") == "ok"]
    mode_params = sorted(
        c for c in ok.columns if c.startswith("config.mode.") and c != "config.mode.name"
    )

    def label(row) -> str:
        shown = []
        for column in mode_params:
            value = row[column]
            if value is None or value is False or (isinstance(value, float) and math.isnan(value)):
                continue
            if isinstance(value, float) and value.is_integer():  # ints turned float by NaNs
                value = int(value)
            shown.append(f"{column.removeprefix('config.mode.')}={value}")
        return f"{row['mode']}({', '.join(shown)})" if shown else row["mode"]

    naive_peak = naive_reference(ok, "peak_bytes")
    table = pd.DataFrame(
        {
            "workload": ok["workload"].to_numpy(),
            "mode": [label(row) for _, row in ok.iterrows()],
            "peak MiB": (ok["peak_bytes"] / MIB).to_numpy(),
            "peak / naive": (ok["peak_bytes"] / naive_peak).to_numpy(),
            "GFLOPs": (ok["flops"] / 1e9).to_numpy(),
            "recompute ratio": ok.get("recompute_ratio", pd.Series(math.nan, index=ok.index))
            .astype(float)
            .to_numpy(),
            "step ms": (ok["step_time_s"] * 1e3).to_numpy(),
        }
    )
    if (frameworks(ok) != DEFAULT_FRAMEWORK).any():
        table.insert(0, "framework", frameworks(ok).to_numpy())
    return table


def to_markdown(table: pd.DataFrame, digits: int = 3) -> str:
    """A GitHub-flavoured markdown table; floats with `digits` significant digits (whole
    numbers from 10**digits up), NaN as "-"."""

    def cell(value) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"
        return str(value)

    header = "| " + " | ".join(map(str, table.columns)) + " |"
    rule = (
        "|"
        + "|".join("---:" if pd.api.types.is_numeric_dtype(table[c]) else "---" for c in table)
        + "|"
    )
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(False)]
    return "\n".join([header, rule, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hbp.analysis.collect", description="Tabulate the bench runs under ROOT."
    )
    parser.add_argument("root", help="a directory of runs, e.g. outputs/multirun/<date>/<time>")
    parser.add_argument("--markdown", action="store_true", help="print the results table")
    parser.add_argument("--csv", metavar="PATH", help="write every collected column to PATH")
    parser.add_argument("--errors", action="store_true", help="include failed runs (error.json)")
    args = parser.parse_args(argv)
    try:
        frame = collect(args.root, include_errors=args.errors)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.csv:
        frame.to_csv(args.csv, index=False)
    if frame.empty:
        print(f"no runs under {args.root}", file=sys.stderr)
        return 1
    table = results_table(frame)
    if args.markdown:
        print(to_markdown(table))
    else:
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.errors and "status" in frame:
        failed = frame[frame["status"] == "error"]
        for _, row in failed.iterrows():
            print(f"failed: {row['run_dir']}: {row.get('error_type')}: {row.get('error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
