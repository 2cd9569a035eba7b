"""The short summary table a run (or a sweep) prints at its end."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from hbp.units import MIB


def summary_frame(rows) -> pd.DataFrame:
    """The short summary table of runs: workload, mode, peak MiB, GFLOPs, step time (median
    and p10-p90, ms), recompute ratio; predicted peak MiB where a mode predicts one."""
    frame = pd.DataFrame(list(rows))
    table = pd.DataFrame(
        {
            "workload": frame["workload"],
            "mode": [mode_label(row) for row in frame.to_dict(orient="records")],
            "peak MiB": frame["peak_bytes"] / MIB,
            "GFLOPs": frame["flops"] / 1e9,
            "step ms": frame["step_time_s"] * 1e3,
            "p10-p90 ms": [
                f"{a * 1e3:.1f}-{b * 1e3:.1f}"
                for a, b in zip(frame["step_time_p10"], frame["step_time_p90"])
            ],
            "recompute": frame.get("recompute_ratio"),
        }
    )
    if "framework" in frame and (frame["framework"].fillna("torch") != "torch").any():
        table.insert(0, "framework", frame["framework"].fillna("torch"))
    if "mode_predicted_peak_bytes" in frame:
        table["predicted MiB"] = frame["mode_predicted_peak_bytes"] / MIB
    if "naive_peak_bytes" in frame:
        table["naive MiB"] = frame["naive_peak_bytes"] / MIB
        table["peak / naive"] = frame["peak_bytes"] / frame["naive_peak_bytes"]
    if "grad_max_rel_error" in frame:
        table["grad err"] = frame["grad_max_rel_error"]
    return table


def mode_label(row: Mapping) -> str:
    """ "checkpoint(block_size=2)": the mode and its configured parameters that are set."""
    params = (row.get("config") or {}).get("mode") or {}
    shown = [f"{k}={v}" for k, v in params.items() if k != "name" and v not in (None, False)]
    return f"{row['mode']}({', '.join(shown)})" if shown else str(row["mode"])


def format_summary(rows) -> str:
    table = summary_frame(rows)
    return table.to_string(index=False, float_format=lambda v: f"{v:.3g}", na_rep="-")
