"""Run tables: every bench run under a directory as one pandas DataFrame.

    frame = collect("outputs/sweeps/quick")
    print(to_markdown(results_table(frame)))

or from the shell (the tables of docs/results.md are made this way):

    python -m hbp.analysis.collect outputs/multirun/<date>/<time> --markdown
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from hbp.analysis.labels import mode_label
from hbp.units import MIB

METRICS_FILE = "metrics.json"
ERROR_FILE = "error.json"
NOISY_SPREAD = 1.5  # p90 / p10 above this: the run's step time is noisy (hbp.report.style)
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


#: Run fields that set runs of one workload apart, beside the workload's own config
#: (`config.workload.*`): NOTE [ Runs compared within one setting ].
SETTING_FIELDS = ("profile", "device")
#: Fields that also set runs apart, labelled by name ("seed=1", "git_sha=018bdb3"): a
#: different seed, thread count, code version or processor is another setting to compare
#: within (not the host: a cluster's jobs land on many alike hosts).
NAMED_SETTING_FIELDS = ("seed", "threads", "git_sha", "git_dirty", "device_name")


def setting_labels(runs: pd.DataFrame) -> pd.Series:
    """Each run's workload, followed by what sets it apart from the other runs of that
    workload in `runs` where something does ("gpt2 (tiny)", "hf (arch=bert)"): the runs one
    comparison holds (NOTE [ Runs compared within one setting ])."""
    config = [
        c for c in runs.columns if c.startswith("config.workload.") and c != "config.workload.name"
    ]
    varying: dict[str, list[str]] = {}
    for name, rows in runs.groupby("workload", sort=False):
        varying[name] = [
            c
            for c in (*SETTING_FIELDS, *NAMED_SETTING_FIELDS, *config)
            if c in rows and rows[c].map(_setting_text).nunique() > 1
        ]
    labels = []
    for _, row in runs.iterrows():
        parts = [
            _setting_text(row[c])
            if c in SETTING_FIELDS
            else f"{c.removeprefix('config.workload.')}={_setting_text(row[c], c)}"
            for c in varying[row["workload"]]
        ]
        labels.append(row["workload"] + (f" ({', '.join(parts)})" if parts else ""))
    return pd.Series(labels, index=runs.index, dtype=object)


def _setting_text(value, field_name: str = "") -> str:
    if value is None or value != value:
        return "default"
    return str(value)[:SHA_CHARS] if field_name == "git_sha" else str(value)


#: Characters of a commit's hash shown in labels and provenance lines.
SHA_CHARS = 10


# NOTE [ Runs compared within one setting ]
# A ratio to naive, a Pareto front and a table compare runs that differ in their mode only.
# A directory may hold runs of one workload at two profiles, on two devices or of two of its
# configurations (`workload=hf workload.arch=llama,bert`), with two seeds or thread counts,
# from two code versions or on two processors: each such setting gets its own naive, front,
# table and figure panel, labelled by what differs ("gpt2 (tiny)", "gpt2 (threads=2)"), so a
# bert run is never divided by a llama's naive time, a 2-thread run by a 1-thread naive, nor
# pushed off the front by a smaller profile's run. Labels name only what varies: a directory of one
# setting keeps plain workload names.


#: The fields of the runs' environment a report names (`provenance`).
PROVENANCE_FIELDS = ("hbp_version", "git_sha", "torch_version", "hostname", "device_name")


def provenance(runs: pd.DataFrame) -> str:
    """One line naming what the runs were made with: each environment field's distinct
    values ("git_sha 018bdb3, 15ff5e7 (dirty)"), so that a table of mixed versions says so."""
    parts = [f"{len(runs)} runs"]
    for name in PROVENANCE_FIELDS:
        if name not in runs:
            continue
        column = runs[name].dropna().map(lambda v, name=name: _setting_text(v, name))
        if name == "git_sha" and "git_dirty" in runs:
            dirty = runs["git_dirty"].reindex(column.index).fillna(False).astype(bool)
            column = column.where(~dirty, column + " (dirty)")
        values = list(dict.fromkeys(column))
        if values:
            parts.append(f"{name} {', '.join(values)}")
    return "; ".join(parts)


def base_workloads(labels: pd.Series) -> pd.Series:
    """The workload names of `setting_labels`' labels."""
    return labels.str.split(" (", n=1, regex=False).str[0]


def naive_reference(runs: pd.DataFrame, column: str) -> pd.Series:
    """For each run, `column` of the naive run of the same framework and setting (workload,
    profile, device, workload config: `setting_labels`), NaN where there is none, aligned
    with `runs`' index."""
    keys = pd.DataFrame(
        {
            "framework": frameworks(runs),
            "workload": setting_labels(runs),
            "profile": runs["profile"],
        }
    )
    naive_rows = runs["mode"] == "naive"
    naive = runs[column][naive_rows].groupby([keys[c][naive_rows] for c in keys]).first()
    return pd.Series(
        [naive.get(tuple(k), math.nan) for k in keys.itertuples(index=False)],
        index=runs.index,
        dtype=float,
    )


# NOTE [ One naive per run ]
# "naive" is plain autograd on the workload as mode=naive builds it: the workload's own loss
# (gpt2: the full LM head, without hbp's chunked loss), same seed, same batch. Every run
# measures it on a copy (`naive_peak_bytes`, the allocator's peak; hbp.bench.step), so a run's
# ratio to naive needs no naive run beside it; a naive run's own peak is the same number. The
# printed summary, the plan line the bench prints and the report all use this one naive. A
# mode that builds the workload differently (`mode.chunked_loss=true`, off in every mode by
# default) is compared against it too: what the chunked loss saves is then part of what the
# mode saves.
NAIVE_MODEL = "plain autograd on the workload as mode=naive builds it"
NAIVE_WITHOUT_CHUNKED_LOSS = " (without the chunked loss)"


def naive_peak(runs: pd.DataFrame) -> pd.Series:
    """Each run's naive peak in bytes (NOTE [ One naive per run ]): its own measured
    `naive_peak_bytes`, else the naive run's peak on the same workload, profile and framework,
    else NaN."""
    own = runs.get("naive_peak_bytes", pd.Series(math.nan, index=runs.index)).astype(float)
    return own.fillna(naive_reference(runs, "peak_bytes"))


def mode_labels(runs: pd.DataFrame) -> list[str]:
    """`hbp.analysis.labels.mode_label` of every run of a collected frame."""
    params = [c for c in runs.columns if c.startswith("config.mode.") and c != "config.mode.name"]
    facts = [c for c in runs.columns if c.startswith("workload_")]
    labels = []
    for _, row in runs.iterrows():
        mode_params = {c.removeprefix("config.mode."): row[c] for c in params}
        labels.append(mode_label(row["mode"], mode_params, {c: row[c] for c in facts}))
    return labels


def ok_runs(frame: pd.DataFrame) -> pd.DataFrame:
    """The finished runs of a collected frame (status "ok" or no status)."""
    return frame[frame.get("status", pd.Series("ok", index=frame.index)).fillna("ok") == "ok"]


def time_spread(runs: pd.DataFrame) -> pd.Series:
    """p90 / p10 of each run's timed steps; NaN with one timed step (no spread to show)."""
    p10 = runs.get("step_time_p10", pd.Series(math.nan, index=runs.index)).astype(float)
    p90 = runs.get("step_time_p90", pd.Series(math.nan, index=runs.index)).astype(float)
    steps = runs.get("steps", pd.Series(2, index=runs.index)).fillna(2).astype(float)
    return (p90 / p10).where((steps > 1) & (p10 > 0))


def time_range(runs: pd.DataFrame) -> list[str]:
    """Each run's "p10-p90" in ms, "(noisy)" after it where p90 / p10 > NOISY_SPREAD, "-" for
    one timed step."""
    spread = time_spread(runs)
    out = []
    for (_, row), s in zip(runs.iterrows(), spread):
        if s != s:
            out.append("-")
            continue
        text = f"{row['step_time_p10'] * 1e3:.1f}-{row['step_time_p90'] * 1e3:.1f}"
        out.append(text + (" (noisy)" if s > NOISY_SPREAD else ""))
    return out


def results_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The results table (docs/results.md): per run, workload (with what sets its setting
    apart, `setting_labels`), mode (with its set parameters
    that apply), peak MiB, the peak relative to the run's naive (NOTE [ One naive per run ]),
    GFLOPs, recompute ratio, step time (median ms) and its p10-p90 range; first a `framework`
    column when some run is not torch's. Rows in `frame` order."""
    if frame.empty:
        return pd.DataFrame()
    ok = ok_runs(frame)
    table = pd.DataFrame(
        {
            "workload": setting_labels(ok).to_numpy(),
            "mode": mode_labels(ok),
            "peak MiB": (ok["peak_bytes"] / MIB).to_numpy(),
            "peak / naive": (ok["peak_bytes"] / naive_peak(ok)).to_numpy(),
            "GFLOPs": (ok["flops"].astype(float) / 1e9).to_numpy(),
            "recompute ratio": ok.get("recompute_ratio", pd.Series(math.nan, index=ok.index))
            .astype(float)
            .to_numpy(),
            "step ms": (ok["step_time_s"] * 1e3).to_numpy(),
            "p10-p90 ms": time_range(ok),
        }
    )
    if (frameworks(ok) != DEFAULT_FRAMEWORK).any():
        table.insert(0, "framework", frameworks(ok).to_numpy())
    return table


def _small_to_three_digits(value: float) -> str:
    """Two decimals, or three significant digits below 1 (a tiny model's 0.00123 GFLOPs)."""
    return f"{value:.2f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"


def _over_rounds_up(value: float) -> str:
    """Three decimals, rounded up above 1: a peak a few bytes over its budget reads 1.001,
    not 1.000."""
    if value > 1:
        return f"{math.ceil(value * 1000) / 1000:.3f}"
    return f"{value:.3f}"


# Fixed formats per column (never "1.61e+03"): sizes and times with a fixed number of
# decimals, ratios with three, gradient errors in scientific notation.
#: How a float column prints: a format string or a function, by the end of the column's name.
COLUMN_FORMATS = {
    "MiB": "{:.2f}",
    "ratio": "{:.3f}",
    "/ naive": "{:.3f}",
    "peak / naive": "{:.3f}",
    "/ budget": _over_rounds_up,
    "GFLOPs": _small_to_three_digits,
    "ms": "{:.1f}",
    "grad err": "{:.1e}",
    "recompute": "{:.3f}",
    "world": "{:.0f}",
}


def format_cell(column: str, value) -> str:
    """`value` of `column` as the tables print it: NaN / None as "-", booleans as yes / "",
    floats by COLUMN_FORMATS (the longest key that `column` ends with; else 3 decimals)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else ""
    if isinstance(value, (float, np.floating)):
        keys = [k for k in COLUMN_FORMATS if str(column).endswith(k)]
        form = COLUMN_FORMATS[max(keys, key=len)] if keys else "{:.3f}"
        return form(float(value)) if callable(form) else form.format(float(value))
    if isinstance(value, (np.integer,)):
        return str(int(value))
    return str(value)


def format_table(table: pd.DataFrame) -> pd.DataFrame:
    """`table` with every cell as the text `format_cell` gives it."""
    return pd.DataFrame(
        {c: [format_cell(c, v) for v in table[c]] for c in table.columns}, index=table.index
    )


def to_markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table, cells formatted by `format_cell`."""
    header = "| " + " | ".join(map(str, table.columns)) + " |"
    rule = (
        "|"
        + "|".join(
            "---:"
            if pd.api.types.is_numeric_dtype(table[c]) and not pd.api.types.is_bool_dtype(table[c])
            else "---"
            for c in table
        )
        + "|"
    )
    cells = format_table(table)
    body = ["| " + " | ".join(row) + " |" for row in cells.itertuples(index=False)]
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
        print(format_table(table).to_string(index=False))
    if args.errors and "status" in frame:
        failed = frame[frame["status"] == "error"]
        for _, row in failed.iterrows():
            print(f"failed: {row['run_dir']}: {row.get('error_type')}: {row.get('error')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
