"""The short summary table a run (or a sweep) prints at its end, in the report's formats and
with its one naive (NOTE [ One naive per run ] in hbp.analysis.collect)."""

from __future__ import annotations

import pandas as pd

from hbp.analysis.collect import (
    NAIVE_MODEL,
    NAIVE_WITHOUT_CHUNKED_LOSS,
    format_table,
    mode_labels,
    naive_peak,
    time_range,
)
from hbp.telemetry.tables import jsonable
from hbp.units import MIB


def summary_frame(rows) -> pd.DataFrame:
    """The short summary table of runs (metrics.json rows): workload, mode with the
    parameters that apply, peak MiB, GFLOPs, step time (median and p10-p90 ms, "(noisy)"
    where p90 / p10 > 1.5), recompute ratio; predicted MiB where a mode predicts one; naive
    MiB and peak / naive; the world size and every rank's peak for a distributed run."""
    frame = pd.json_normalize([jsonable(dict(row)) for row in rows], sep=".")
    column = lambda name: frame.get(name, pd.Series(float("nan"), index=frame.index))  # noqa: E731
    table = pd.DataFrame(
        {
            "workload": frame["workload"],
            "mode": mode_labels(frame),
            "peak MiB": column("peak_bytes").astype(float) / MIB,
            "GFLOPs": column("flops").astype(float) / 1e9,
            "step ms": column("step_time_s").astype(float) * 1e3,
            "p10-p90 ms": time_range(frame),
            "recompute": column("recompute_ratio").astype(float),
        }
    )
    if "framework" in frame and (frame["framework"].fillna("torch") != "torch").any():
        table.insert(0, "framework", frame["framework"].fillna("torch"))
    if "mode_predicted_peak_bytes" in frame:
        table["predicted MiB"] = frame["mode_predicted_peak_bytes"].astype(float) / MIB
    naive = naive_peak(frame)
    if naive.notna().any():
        table["naive MiB"] = naive / MIB
        table["peak / naive"] = column("peak_bytes").astype(float) / naive
    if "grad_max_rel_error" in frame:
        table["grad err"] = frame["grad_max_rel_error"].astype(float)
    if "world_size" in frame and frame["world_size"].notna().any():
        from hbp.analysis.pareto import rank_peaks

        table["world"] = frame["world_size"].astype(float)
        table["rank peaks MiB"] = [rank_peaks(v) for v in column("rank_peak_bytes")]
    return table


def format_summary(rows) -> str:
    """The summary table as text; a last line says what naive is where the table has one."""
    rows = list(rows)
    table = summary_frame(rows)
    text = format_table(table).to_string(index=False)
    if "naive MiB" in table and all(row.get("framework") == "jax" for row in rows):
        text += "\nnaive: the compiled jax.jit(jax.grad(loss)) of the same workload"
    elif "naive MiB" in table:
        lm_head = any(row.get("workload_chunked_loss") is not None for row in rows)
        model = NAIVE_MODEL + (NAIVE_WITHOUT_CHUNKED_LOSS if lm_head else "")
        text += f"\nnaive: {model}, measured on a copy"
    return text
