"""The tables a researcher reads (the printed summary, the report's comparison table): one
naive per run, fixed number formats, mode labels with only the options that apply, noisy
timings flagged and kept off the Pareto front, a distributed run's world and rank peaks."""

import pandas as pd
import pytest

from hbp.analysis.collect import format_cell, to_markdown
from hbp.analysis.labels import mode_label
from hbp.analysis.pareto import pareto_table
from hbp.bench.summary import format_summary, summary_frame
from hbp.units import MIB


def row(mode="tiny", workload="gpt2", peak=12.8, time_s=1.6078, p10=None, p90=None, **extra):
    params = {"tiny": {"budget": 0.3, "block_size": 1, "chunked_loss": True}}.get(mode, {})
    out = {
        "status": "ok", "framework": "torch", "workload": workload, "mode": mode,
        "profile": "small", "steps": 5, "peak_bytes": int(peak * MIB), "flops": 8.8e9,
        "step_time_s": time_s, "step_time_p10": p10 or time_s, "step_time_p90": p90 or time_s,
        "recompute_ratio": 0.195, "naive_peak_bytes": int(57.1 * MIB),
        "config": {"mode": {"name": mode, **params}},
    }  # fmt: skip
    if workload == "gpt2":
        out["workload_chunked_loss"] = mode == "tiny"
    out.update(extra)
    return out


def test_labels_show_only_the_options_that_apply():
    params = {"budget": 0.3, "block_size": 1, "chunked_loss": True}
    gpt2 = mode_label("tiny", params, {"workload_chunked_loss": True})
    assert gpt2 == "tiny(budget=0.3, block_size=1, chunked_loss=True)"
    dag = mode_label("tiny", params, {})  # synthetic_dag has no LM head
    assert dag == "tiny(budget=0.3, block_size=1)"
    cached = mode_label("tiny", {**params, "plan_cache": "/caches/a"}, {})  # changes no result
    assert cached == dag
    assert mode_label("checkpoint", {"block_size": 2.0, "segments": None}) == (
        "checkpoint(block_size=2)"
    )


def test_summary_has_one_naive_fixed_formats_and_no_range_for_one_sample():
    text = format_summary([row(steps=1, time_s=1607.8e-3)])
    assert "e+" not in text and "e-" not in text
    assert "1607.8" in text and "1607.8-1607.8" not in text
    header, values, naive_line = text.splitlines()
    assert "naive MiB" in header and "57.10" in values and "0.224" in values
    assert (
        naive_line.startswith("naive: plain autograd") and "without the chunked loss" in naive_line
    )
    assert text.count("naive MiB") == 1
    jax_line = format_summary([row(framework="jax")]).splitlines()[-1]  # no copy, no chunked loss
    assert jax_line == "naive: the compiled jax.jit(jax.grad(loss)) of the same workload"


def test_noisy_timings_are_flagged_and_kept_off_the_front():
    runs = pd.json_normalize(
        [
            row("naive", "synthetic_dag", peak=60, time_s=0.2, p10=0.064, p90=1.105),
            row("tiny", "synthetic_dag", peak=20, time_s=0.068, p10=0.066, p90=0.070),
            row("checkpoint", "synthetic_dag", peak=30, time_s=0.09, p10=0.088, p90=0.095),
        ],
        sep=".",
    )
    table = pareto_table(runs).set_index(pd.Index(["naive", "tiny", "checkpoint"]))
    assert table.loc["naive", "noisy"] and not table.loc["tiny", "noisy"]
    assert table.loc["naive", "p10-p90 ms"] == "64.0-1105.0 (noisy)"
    assert not table.loc["naive", "pareto"]
    # a ratio to a noisy naive time is not shown
    assert table["time / naive"].isna().all()
    assert table.loc["tiny", "pareto"] and not table.loc["checkpoint", "pareto"]
    assert "(noisy)" in to_markdown(table)


def test_budget_and_number_formats_are_fixed():
    assert format_cell("step ms", 1607.81) == "1607.8"
    assert format_cell("peak MiB", 12.7749) == "12.77"
    assert format_cell("grad err", 3.2e-7) == "3.2e-07"
    assert format_cell("budget", None) == "-"
    assert format_cell("pareto", True) == "yes"


def test_a_peak_over_its_budget_never_prints_as_one_and_small_flops_keep_digits():
    assert format_cell("peak / budget", 1.0000001) == "1.001"  # bytes over read as over
    assert format_cell("peak / budget", 1.0) == "1.000"
    assert format_cell("peak / budget", 0.9876) == "0.988"
    assert format_cell("step GFLOPs", 0.0012345) == "0.00123"  # a tiny model's step
    assert format_cell("step GFLOPs", 12.3456) == "12.35"
    assert format_cell("step GFLOPs", 0.0) == "0.00"


def test_distributed_summary_has_world_size_and_rank_peaks():
    rank_peaks = [int(12.8 * MIB), int(13.1 * MIB)]
    frame = summary_frame([row(distributed="ddp", world_size=2, rank_peak_bytes=rank_peaks)])
    assert frame["world"].iloc[0] == 2
    assert frame["rank peaks MiB"].iloc[0] == "12.8 / 13.1"
    table = pareto_table(pd.json_normalize([row(world_size=2, rank_peak_bytes=rank_peaks)]))
    assert table["rank peaks MiB"].iloc[0] == "12.8 / 13.1"
    assert "| 2 |" in to_markdown(table)


@pytest.mark.parametrize("value", [None, float("nan")])
def test_missing_values_print_as_a_dash(value):
    assert format_cell("peak MiB", value) == "-"


def test_the_plan_is_three_lines_that_call_nothing_naive():
    from hbp.graph import synthetic
    from hbp.modes.plan_text import plan_lines
    from hbp.planner import plan

    graph = synthetic.random_dag(12, seed=3, alias_prob=0.0)
    text = plan_lines(
        plan(graph, "min"), budget="min", planner="optimal", captured="12 nodes",
        chunked_loss=False,
    )  # fmt: skip
    lines = text.splitlines()
    assert len(lines) == 3 and "naive" not in text
    assert lines[1].startswith("  predicted peak") and "(budget min)" in lines[1]
