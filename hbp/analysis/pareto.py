"""The memory/time trade-off of every mode, per workload: the comparison table and its
Pareto front (the plot and the files are `hbp.report.pareto`'s).

Each run's measured peak and median step time are expressed relative to naive's (NOTE [ One
naive per run ] in hbp.analysis.collect); a run is on the Pareto front when no other run of
that workload and framework is at least as good in both and better in one. A run whose step
time is noisy (p90 / p10 above NOISY_SPREAD) is never on the front and never pushes another
run off it: its time says too little.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from hbp.analysis.collect import (
    NOISY_SPREAD,
    naive_reference,
    ok_runs,
    results_table,
    time_spread,
)
from hbp.units import MIB

__all__ = ["pareto_flags", "pareto_table", "rank_peaks", "read_optimum"]


def pareto_table(frame: pd.DataFrame) -> pd.DataFrame:
    """`results_table` plus step time relative to the naive run's (NaN where the directory
    has no naive run), a `noisy` flag, hbp's predicted peak where the mode predicts one, the
    gradient check where it ran, and a `pareto` flag per workload."""
    ok = ok_runs(frame)
    table = results_table(frame)
    if table.empty:
        return table
    naive_time = naive_reference(ok, "step_time_s")
    table.insert(
        table.columns.get_loc("step ms") + 1,
        "time / naive",
        (ok["step_time_s"] / naive_time).to_numpy(),
    )
    noisy = (time_spread(ok) > NOISY_SPREAD).to_numpy()
    naive_noisy = _naive_noisy(ok).to_numpy()
    table.insert(table.columns.get_loc("p10-p90 ms") + 1, "noisy", noisy)
    # a ratio to a noisy naive time is as noisy as the naive time
    table.loc[naive_noisy, "time / naive"] = float("nan")
    if "mode_predicted_peak_bytes" in ok:
        table["predicted MiB"] = (ok["mode_predicted_peak_bytes"].astype(float) / MIB).to_numpy()
    if "grad_max_rel_error" in ok:
        table["grad err"] = ok["grad_max_rel_error"].astype(float).to_numpy()
    if "world_size" in ok and ok["world_size"].notna().any():
        kind = ok.get("distributed")  # ddp and fsdp rows told apart
        if kind is not None:
            table["distributed"] = kind.fillna("none").to_numpy()
        table["world"] = ok["world_size"].astype(float).to_numpy()
        table["rank peaks MiB"] = [rank_peaks(v) for v in ok.get("rank_peak_bytes")]
    table["pareto"] = pareto_flags(table)
    return table


def _naive_noisy(ok: pd.DataFrame) -> pd.Series:
    spread = time_spread(ok).fillna(1.0)
    return naive_reference(ok.assign(_spread=spread), "_spread") > NOISY_SPREAD


def rank_peaks(value) -> str:
    """ "12.8 / 12.9" (MiB, rank order) from a run's rank_peak_bytes (a list, or JSON text)."""
    import json

    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, (list, tuple)):
        return "-"
    return " / ".join(f"{v / MIB:.1f}" if v is not None else "-" for v in value)


def pareto_flags(table: pd.DataFrame) -> list[bool]:
    """True where no other row of the same framework and workload has peak and time both <=
    and one <. Rows flagged `noisy` are neither on the front nor dominate another row."""
    flags = []
    framework = table.get("framework", pd.Series("torch", index=table.index))
    noisy = table.get("noisy", pd.Series(False, index=table.index)).fillna(False).astype(bool)
    for i, row in table.iterrows():
        if noisy[i]:
            flags.append(False)
            continue
        same_kind = (table["workload"] == row["workload"]) & (framework == framework[i])
        same = table[same_kind & (table.index != i) & ~noisy]
        dominated = (
            (same["peak MiB"] <= row["peak MiB"])
            & (same["step ms"] <= row["step ms"])
            & ((same["peak MiB"] < row["peak MiB"]) | (same["step ms"] < row["step ms"]))
        ).any()
        flags.append(not dominated)
    return flags


def read_optimum(path: str | Path) -> pd.DataFrame | None:
    """experiments/bench_optimum.py's optimum.csv, or None when there is none."""
    path = Path(path)
    return pd.read_csv(path) if path.is_file() else None
