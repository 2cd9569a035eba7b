"""The least peak over other cut choices where their union does not pay (NOTE [ The union
where it pays ] in hbp.planner.dp.least_peak): each set is searched alone and the least of
them is the minimum (tests/test_planner.py plans a budget only another set reaches, with the
union ruled out)."""

import pytest
import torch

from hbp.analysis import simulate
from hbp.analysis.liveness import GraphInfo
from hbp.graph.torch.capture import capture
from hbp.integrations.torch.loss import WithLoss
from hbp.planner import min_feasible_peak
from hbp.planner.cuts import cut_choices, dp_work
from hbp.planner.dp import least_peak, peak, solver
from hbp.planner.dp.least_peak import forget_least_peaks, union_of, union_pays
from hbp.workloads import build


@pytest.fixture(autouse=True)
def without_pins(monkeypatch):
    monkeypatch.setattr(solver, "PIN_VALUES", False)


def test_a_unets_union_is_not_searched_and_its_least_peak_is_the_best_sets():
    """A DDPM U-Net's structure (four levels, two blocks each, skip connections): the cuts the
    union adds in the encoder split the skips' makers, and its DP had 21x the states of the
    largest set's. The least peak is taken over each set alone, and no DP runs over the
    union."""
    wl = build("unet", "tiny", seed=0, channel_mult=(1, 2, 2, 2), num_res_blocks=2)
    batch = wl.make_batch(0)
    root = WithLoss(wl.model, lambda out: wl.loss_fn(out, batch), len(batch.args))
    with torch.enable_grad():
        graph = capture(root, tuple(batch.args), dict(batch.kwargs)).graph
    info = GraphInfo.of(graph)
    choices = cut_choices(info)
    assert len(choices) == 3
    union = union_of(choices)
    *each, whole = dp_work(info, [*choices, union])
    assert whole > 2 * sum(each)
    assert not union_pays(info, choices)

    searched = []  # the cut count of every least-peak DP
    real = peak.PeakSolver

    class Recording(real):
        def __init__(self, model, nested=True):
            searched.append(len(model.cuts))
            super().__init__(model, nested)

    forget_least_peaks()
    mp = pytest.MonkeyPatch()
    mp.setattr(least_peak, "PeakSolver", Recording)
    try:
        least, segments = min_feasible_peak(graph, info=info, staged="never")
    finally:
        mp.undo()
    assert len(union) not in searched
    each = [least_peak.least_peak_cached(info, cuts, True)[0] for cuts in choices]
    assert least == min(each) < each[0]  # another set reaches less than the first
    assert simulate(graph, segments).peak_bytes == least
