"""The DP's states stay bounded (NOTE [ Cuts that many values cross ] in
hbp.planner.dp.held_sets): a loop that keeps each step's output for after it, whose held sets
double with every cut in it, is planned over evenly spread cuts, with a warning once per
structure, within its budget and with the plain model's gradients."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import hbp
from hbp.analysis import simulate
from hbp.graph.torch.capture import capture
from hbp.integrations.torch.loss import WithLoss
from hbp.planner import plan
from hbp.planner.dp import held_sets
from hbp.planner.dp import profile as profile_module
from hbp.planner.dp.least_peak import forget_least_peaks
from tests.models.toy import UnrolledCells

VOCAB = 100


def _cells_and_tokens(steps: int):
    torch.manual_seed(0)
    return UnrolledCells(VOCAB), torch.randint(0, VOCAB, (4, steps + 1))


def _loss(output, targets):
    return F.cross_entropy(output.reshape(-1, VOCAB), targets.reshape(-1))


def test_a_loop_keeping_its_outputs_plans_over_spread_cuts_and_trains_exactly(monkeypatch):
    """With the profile limit lowered so that 8 steps reach it: HCModule's plan is made over
    evenly spread cuts (warned once; a second module of the same structure starts there,
    unwarned), the step's gradients are the plain model's, and the allocator's peak keeps the
    budget."""
    monkeypatch.setattr(profile_module, "MAX_PROFILES", 300)
    forget_least_peaks()
    model, tokens = _cells_and_tokens(8)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    _loss(model(inputs), targets).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    hc = hbp.HCModule(model, loss_fn=_loss)
    with pytest.warns(UserWarning, match="cuts spread evenly"):
        hc(inputs, targets=targets).backward()
    assert hc.plan.meta["coarse_cuts"] in held_sets.COARSE_CUTS
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain[name], rtol=0, atol=0)
    assert hc.measured_peak_bytes <= hc.budget_bytes
    model.zero_grad(set_to_none=True)
    again = hbp.HCModule(model, loss_fn=_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        again.prepare(inputs, targets=targets)
    assert again.plan.meta["coarse_cuts"] == hc.plan.meta["coarse_cuts"]


def test_sixteen_unrolled_steps_plan_in_bounded_states_and_still_checkpoint_the_loop():
    """At the real limit: 16 steps, whose DP over the usual cuts made 2^k held sets (52 s and
    2 GiB before the limit), plan "min" over spread cuts, and the least peak still saves on
    the plain step (the loop is checkpointed every few steps), to the simulator's byte."""
    forget_least_peaks()
    model, tokens = _cells_and_tokens(16)
    targets = tokens[:, 1:]
    root = WithLoss(model, lambda output: _loss(output, targets), 1)
    with torch.enable_grad():
        graph = capture(root, (tokens[:, :-1],), {}).graph
    made = []
    original = profile_module.ChildProfile.__init__

    def counted(self, *args):
        made.append(1)
        original(self, *args)

    with pytest.MonkeyPatch.context() as patch, pytest.warns(UserWarning, match="spread evenly"):
        patch.setattr(profile_module.ChildProfile, "__init__", counted)
        least = plan(graph, "min")
    assert least.meta["coarse_cuts"] in held_sets.COARSE_CUTS
    # profiles made, the attempt that gave up included
    assert len(made) < 2 * profile_module.MAX_PROFILES
    assert simulate(graph, least).peak_bytes == least.predicted_peak_bytes
    assert least.predicted_peak_bytes < 0.9 * least.naive_peak_bytes
