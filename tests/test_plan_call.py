"""Facts kept for one plan call (NOTE [ Facts kept for one plan call ] in
hbp.analysis.plan_call): made once per key inside a plan call, dropped when it ends, made anew
outside one; the plans are the ones made without them."""

import pytest

from hbp.analysis import positional as positional_module
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_call import kept_for_plan_call, plan_call_scope
from hbp.graph import synthetic
from hbp.planner import cuts as cuts_module
from hbp.planner import plan
from hbp.planner.dp import staged_search
from hbp.planner.dp.least_peak import info_fingerprint


def test_a_fact_is_made_once_inside_a_scope_and_dropped_after_it():
    info = GraphInfo.of(synthetic.residual_net(4))
    made = []

    def make():
        made.append(1)
        return len(made)

    assert kept_for_plan_call(info, "k", make) == 1
    assert kept_for_plan_call(info, "k", make) == 2  # no scope: made anew
    with plan_call_scope(info) as outer:
        with plan_call_scope(info) as inner:
            assert outer and not inner
            assert kept_for_plan_call(info, "k", make) == 3
        assert kept_for_plan_call(info, "k", make) == 3  # an inner exit keeps it
        assert kept_for_plan_call(info, "other", make) == 4
    assert kept_for_plan_call(info, "k", make) == 5
    assert "_plan_call_kept" not in info.__dict__


@pytest.mark.parametrize(
    "module, name", [(cuts_module, "_candidate_cuts"), (staged_search, "_staged_candidate")]
)
def test_a_plan_call_makes_each_fact_once_and_plans_the_same(monkeypatch, module, name):
    """The candidate cuts per (block size, count) and the staged candidate per (budget, pins)
    (NOTE [ A staged candidate found once per plan call ]): made once each in a plan call, and
    asked for again without the scope, with the same plan."""
    graph = synthetic.residual_net(24, same_layers=True)
    made, make = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: made.append(args[-2:]) or make(*args))
    kept = plan(graph, "min", staged="always")
    assert made and len(made) == len(set(made))
    made.clear()
    monkeypatch.setattr(module, "kept_for_plan_call", lambda info, key, make: make())
    again = plan(graph, "min", staged="always")
    assert len(made) > len(set(made))  # asked again for the same keys
    assert (kept.predicted_peak_bytes, kept.segments) == (
        again.predicted_peak_bytes,
        again.segments,
    )


def test_kept_candidate_cuts_are_handed_out_as_copies():
    info = GraphInfo.of(synthetic.residual_net(8))
    with plan_call_scope(info):
        handed = cuts_module.candidate_cuts(info)
        handed.append(-1)
        assert cuts_module.candidate_cuts(info)[-1] != -1


@pytest.mark.parametrize(
    "module, name", [(positional_module, "_positional_bytes"), (cuts_module, "_frontier_of")]
)
def test_whole_graph_passes_of_the_info_alone_are_made_once_per_plan_call(
    monkeypatch, module, name
):
    """The plan-independent backward bytes (read by every cost model and the lower bound)
    and the frontier (by every candidate-cut ranking and the stage bounds): one pass each per
    plan call, the same plan as with a pass per ask."""
    graph = synthetic.residual_net(24, same_layers=True)
    made, make = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda info: made.append(1) or make(info))
    kept = plan(graph, "min", staged="always")
    assert len(made) == 1
    made.clear()
    monkeypatch.setattr(module, "kept_for_plan_call", lambda info, key, make: make())
    again = plan(graph, "min", staged="always")
    assert len(made) > 1
    assert (kept.predicted_peak_bytes, kept.segments) == (
        again.predicted_peak_bytes,
        again.segments,
    )


def test_the_remembered_least_peaks_key_reads_fields_not_what_is_kept_on_the_info():
    """`GraphInfo.lists` (NOTE [ Event loops read Python lists ] in hbp.analysis.liveness) and
    the caches kept on an info are not part of the graph's structure: the least peaks one
    info found are found by another of the same graph whether or not either made its lists."""
    graph = synthetic.residual_net(6)
    fresh, used = GraphInfo.of(graph), GraphInfo.of(graph)
    assert used.lists.storage_bytes == used.storage_bytes.tolist()
    assert info_fingerprint(fresh) == info_fingerprint(used)
