"""Facts kept for one plan call (NOTE [ Facts kept for one plan call ] in
hbp.analysis.plan_call): made once per key inside a plan call, dropped when it ends, made anew
outside one; the plans are the ones made without them."""

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_call import kept_for_plan_call, plan_call_scope
from hbp.graph import synthetic
from hbp.planner import cuts as cuts_module
from hbp.planner import plan


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


def test_a_plan_call_finds_its_candidate_cuts_once_per_size_and_plans_the_same(monkeypatch):
    graph = synthetic.residual_net(24, same_layers=True)
    made = []
    find = cuts_module._candidate_cuts
    monkeypatch.setattr(
        cuts_module,
        "_candidate_cuts",
        lambda info, block_size, max_cuts: (
            made.append((block_size, max_cuts)) or find(info, block_size, max_cuts)
        ),
    )
    kept = plan(graph, "min")
    assert made and len(made) == len(set(made))
    with plan_call_scope(info := GraphInfo.of(graph)):
        handed = cuts_module.candidate_cuts(info)
        handed.append(-1)  # a copy: the one kept is not changed
        assert cuts_module.candidate_cuts(info)[-1] != -1
    made.clear()
    monkeypatch.setattr(cuts_module, "kept_for_plan_call", lambda info, key, make: make())
    again = plan(graph, "min")
    assert len(made) > len(set(made))  # asked again for the same sizes
    assert (kept.predicted_peak_bytes, kept.segments) == (
        again.predicted_peak_bytes,
        again.segments,
    )
