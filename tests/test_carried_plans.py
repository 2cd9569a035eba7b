"""Plans carried across input sizes: a new sequence length (or batch size) of a step planned
before runs a plan made for another size, where the simulator puts it within this size's
budget, instead of the planner's; same gradients as the plain model, the measured peak within
the budget; its own plan after `OWN_PLAN_AFTER` calls; off with `carry_plans=False`."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.compare import run_step
from helpers.step import assert_same_step
from models.toy import HFStyleLM
from models.traits import ShapeBranches
from torch import nn

import hbp
import hbp.integrations.torch.planning as planning
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, ConfigError
from hbp.planner import min_feasible_peak, plan
from hbp.planner.budget import Budget
from hbp.planner.carry import CARRIED, Donor, carried_plan, donor_floor_gap, structure_key


def lm() -> HFStyleLM:
    torch.manual_seed(0)
    return HFStyleLM(vocab=200, dim=48, heads=4, depth=3, max_len=96)


def batch(length: int, size: int = 4) -> tuple:
    generator = torch.Generator().manual_seed(length * 10 + size)
    ids = torch.randint(0, 200, (size, length), generator=generator)
    return (ids,), {"attention_mask": torch.ones_like(ids), "labels": ids}


def loss_of(out):
    return out.loss


def graphs(*lengths: int) -> list:
    """The captured graphs of the LM's step at `lengths` (nothing recomputed)."""
    hc = hbp.HCModule(lm(), budget=1.0, calibrate=False, carry_plans=False)
    out = []
    for length in lengths:
        args, kwargs = batch(length)
        hc(*args, **kwargs).loss.backward()
        out.append(hc.captured.graph)
    return out


def test_one_step_at_two_lengths_has_one_structure_and_another_step_another():
    long, short = graphs(80, 40)
    assert structure_key(long) == structure_key(short)
    assert long.nodes[5].output_bytes != short.nodes[5].output_bytes or any(
        a.output_bytes != b.output_bytes for a, b in zip(long.nodes, short.nodes)
    )
    hc = hbp.HCModule(ShapeBranches(), budget=1.0, calibrate=False)
    keys = set()
    for rows in (256, 64):  # Python branches on the shape: another graph
        hc(torch.randn(rows, 64)).sum().backward()
        keys.add(structure_key(hc.captured.graph))
    assert len(keys) == 2


def test_a_longer_lengths_plan_carried_to_a_shorter_one_fits_its_budget():
    long, short = graphs(80, 64)
    donor = plan(long, 0.6)
    carried = carried_plan(short, Budget.parse(0.6), [Donor(long, donor)])
    naive = simulate(short).peak_bytes
    assert carried is not None and carried.meta["solved_by"] == CARRIED
    assert carried.budget_bytes == int(0.6 * naive)  # the fraction of this size's plain step
    assert carried.predicted_peak_bytes <= carried.budget_bytes
    # the predictions are this graph's: the donor's segments simulated here
    again = simulate(short, carried.segments)
    assert again.peak_bytes == carried.predicted_peak_bytes
    assert again.recompute_flops == carried.predicted_recompute_flops
    assert [s.start for s in carried.segments] == [s.start for s in donor.segments]
    assert "carried" in str(carried)


def test_nothing_is_carried_where_no_plan_fits_or_nothing_needs_one():
    long, short = graphs(80, 40)
    plain = plan(short, 1.0)  # nothing recomputed: the short step's plain plan
    assert [(s.start, s.stop, s.recompute) for s in plain.segments] == [
        (0, len(short.nodes), False)
    ]
    tight = int(0.6 * simulate(long).peak_bytes)
    assert carried_plan(long, Budget.parse(tight), [Donor(short, plain)]) is None
    assert carried_plan(short, Budget.parse(1.0), [Donor(long, plan(long, 0.5))]) is None
    assert carried_plan(short, Budget.parse("fit"), [Donor(long, plan(long, 0.5))]) is None
    # a budget relative to the least peak needs a donor's least-peak plan
    assert carried_plan(short, Budget.parse("50%act"), [Donor(long, plan(long, 0.5))]) is None
    assert carried_plan(short, Budget.parse(0.5), []) is None


def test_a_relative_budget_is_resolved_against_a_least_peak_plan_reached_here():
    long, short = graphs(80, 64)
    least = min_feasible_peak(long)[1]
    donor = Donor(long, plan(long, "50%act"), least)
    carried = carried_plan(short, Budget.parse("50%act"), [donor])
    assert carried is not None
    exact_least = min_feasible_peak(short)[0]
    reached = simulate(short, copy.deepcopy(least)).peak_bytes
    assert exact_least <= reached <= 1.05 * exact_least  # an upper bound, near the least
    naive = simulate(short).peak_bytes
    assert carried.budget_bytes == reached + (naive - reached) // 2
    assert carried.predicted_peak_bytes <= carried.budget_bytes
    # the least-peak plan resolves the budget; the plan run is the donor's own
    assert [s.start for s in carried.segments] == [s.start for s in donor.plan.segments]
    assert carried_plan(short, Budget.parse("min"), [donor]) is None  # the least itself: planned


def test_a_least_peak_known_only_loosely_resolves_nothing():
    long, short = graphs(80, 64)
    own = plan(long, "50%act")
    loose = own.segments  # as the least-peak plan: its peak is far above the least
    assert simulate(short, copy.deepcopy(loose)).peak_bytes > 1.05 * min_feasible_peak(short)[0]
    assert carried_plan(short, Budget.parse("50%act"), [Donor(long, own, loose)]) is None
    # a fraction needs no least peak
    assert carried_plan(short, Budget.parse(0.6), [Donor(long, plan(long, 0.6), loose)])


def test_a_plan_that_fits_by_recomputing_far_more_than_at_its_own_size_is_not_carried():
    long, short = graphs(80, 64)
    donor = plan(long, 0.6)
    assert carried_plan(short, Budget.parse(0.6), [Donor(long, donor)]) is not None
    # the same plan, as if it had recomputed nothing at its own size
    thrifty = dataclasses.replace(donor, predicted_recompute_flops=0.0)
    assert carried_plan(short, Budget.parse(0.6), [Donor(long, thrifty)]) is None


def test_new_lengths_run_carried_plans_with_the_plain_models_gradients(count_captures):
    captures = count_captures()
    model = lm()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.6, calibrate=False)
    solved = []
    for length in (80, 64, 72, 64):
        args, kwargs = batch(length)
        got = run_step(hc, model, args, kwargs, loss_fn=loss_of)
        expected = run_step(reference, reference, args, kwargs, loss_fn=loss_of)
        assert_same_step(expected, got)
        assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes, (got.peak_bytes, hc.plan)
        assert any(s.recompute for s in hc.plan.segments)
        solved.append(hc.plan.meta["solved_by"])
    assert len(captures) == 3
    assert solved[0] != CARRIED and solved[1:] == [CARRIED] * 3
    # another batch size of the same step is carried too
    args, kwargs = batch(64, size=2)
    got = run_step(hc, model, args, kwargs, loss_fn=loss_of)
    assert_same_step(run_step(reference, reference, args, kwargs, loss_fn=loss_of), got)
    assert hc.plan.meta["solved_by"] == CARRIED
    assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes


def test_carry_plans_false_plans_every_length_and_a_carried_budget_is_the_same():
    on = hbp.HCModule(lm(), budget=0.6, calibrate=False)
    off = hbp.HCModule(lm(), budget=0.6, calibrate=False, carry_plans=False)
    for length in (80, 64):
        for hc in (on, off):
            args, kwargs = batch(length)
            hc(*args, **kwargs).loss.backward()
    assert on.plan.meta["solved_by"] == CARRIED and off.plan.meta["solved_by"] != CARRIED
    assert on.plan.budget_bytes == off.plan.budget_bytes
    # recomputing more than the DP's own plan is what carrying may cost, never the budget
    assert on.plan.predicted_recompute_flops >= off.plan.predicted_recompute_flops


def planned_at_80(monkeypatch, own_plan_after: int) -> tuple:
    """(model, a plain copy, its HCModule at 0.6 planned at 80 tokens), with signatures
    getting their own plans after `own_plan_after` carried calls."""
    monkeypatch.setattr(planning, "OWN_PLAN_AFTER", own_plan_after)
    model = lm()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.6, calibrate=False)
    hc(*batch(80)[0], **batch(80)[1]).loss.backward()
    return model, reference, hc


def test_a_signature_gets_its_own_plan_after_it_ran_carried_plans_often(monkeypatch):
    model, reference, hc = planned_at_80(monkeypatch, 3)
    solved = []
    for _ in range(4):
        args, kwargs = batch(64)
        got = run_step(hc, model, args, kwargs, loss_fn=loss_of)
        assert_same_step(run_step(reference, reference, args, kwargs, loss_fn=loss_of), got)
        solved.append(hc.plan.meta["solved_by"])
    assert solved[:3] == [CARRIED] * 3 and solved[3] != CARRIED  # 3 calls, then its own
    own = hc.plan
    hc(*batch(64)[0], **batch(64)[1]).loss.backward()
    assert hc.plan is own  # planned once


def test_carry_plans_is_checked():
    with pytest.raises(ConfigError, match="carry_plans"):
        hbp.HCModule(lm(), carry_plans="yes")
    hc = hbp.HCModule(lm())
    with pytest.raises(ConfigError, match="carry_plans"):
        hc.carry_plans = 1
    assert hc.carry_plans is True


def test_a_signature_keeps_its_carried_plan_where_the_planner_finds_none(monkeypatch):
    import hbp.planner

    model, reference, hc = planned_at_80(monkeypatch, 1)
    hc(*batch(64)[0], **batch(64)[1]).loss.backward()
    carried = hc.plan
    assert carried.meta["solved_by"] == CARRIED

    def no_plan(graph, budget, **options):
        raise BudgetError(int(budget), int(budget) + 1, "the DP's cuts do not reach it")

    monkeypatch.setattr(hbp.planner, "plan", no_plan)
    args, kwargs = batch(64)
    got = run_step(hc, model, args, kwargs, loss_fn=loss_of)  # its own plan was due: none
    assert_same_step(run_step(reference, reference, args, kwargs, loss_fn=loss_of), got)
    assert hc.plan is carried
    hc(*batch(64)[0], **batch(64)[1]).loss.backward()  # and is not tried at every call
    assert hc.plan is carried


def test_a_carried_plan_made_again_from_a_measured_step_is_carried_again(tmp_path):
    """The closed loop plans a signature again for its budget less what its measured step
    held beside the plan: a carried plan's signature tries the carried plans first there too,
    and neither is kept on disk as the signature's own."""
    hc = hbp.HCModule(lm(), budget=0.6, calibrate=False, plan_cache=tmp_path)
    for length in (80, 64):
        args, kwargs = batch(length)
        hc(*args, **kwargs).loss.backward()
    compiled = hc.compiled
    first = compiled.plan
    assert first.meta["solved_by"] == CARRIED
    on_disk = sorted(tmp_path.rglob("*.json"))
    hc._replan(compiled, first.predicted_peak_bytes)  # what a measured step asks for
    assert compiled.plan is not first and compiled.plan.meta["solved_by"] == CARRIED
    assert compiled.plan.predicted_peak_bytes <= first.predicted_peak_bytes
    assert sorted(tmp_path.rglob("*.json")) == on_disk
    hc._replan(compiled, first.predicted_peak_bytes - 1)  # below every carried plan's peak
    assert compiled.plan.meta["solved_by"] != CARRIED
    assert compiled.plan.predicted_peak_bytes < first.predicted_peak_bytes


def test_a_carried_plan_that_recomputes_less_than_the_signatures_own_stays(monkeypatch):
    import hbp.planner

    real = hbp.planner.plan

    def costlier(graph, budget, **options):  # the DP's plan, as if it recomputed more
        made = real(graph, budget, **options)
        return dataclasses.replace(made, predicted_recompute_flops=float("inf"))

    _, _, hc = planned_at_80(monkeypatch, 1)
    hc(*batch(64)[0], **batch(64)[1]).loss.backward()
    carried = hc.plan
    assert carried.meta["solved_by"] == CARRIED
    monkeypatch.setattr(hbp.planner, "plan", costlier)
    hc(*batch(64)[0], **batch(64)[1]).loss.backward()  # its own plan was due
    assert hc.plan is carried


class ResidualMLP(nn.Module):
    """Residual MLP blocks over a sequence: the floor under its least peak is far below it."""

    def __init__(self, dim: int = 64, depth: int = 4):
        super().__init__()
        self.inp, self.out = nn.Linear(16, dim), nn.Linear(dim, 1)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
            )
            for _ in range(depth)
        )

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def test_the_donors_own_gap_over_the_floor_lets_the_default_budget_carry():
    """The floor under this model's least peak is 11-32% below it at every length; the donor
    measured that gap at its own length, so its least-peak plan resolves "50%act" here."""
    on, off = [
        hbp.HCModule(copy.deepcopy(ResidualMLP()), calibrate=False, carry_plans=carry)
        for carry in (True, False)
    ]
    torch.manual_seed(0)
    for hc in (on, off):
        for length in (96, 64):
            hc(torch.randn(4, length, 16)).square().mean().backward()
    assert on.plan.meta["solved_by"] == CARRIED
    assert off.plan.budget_bytes <= on.plan.budget_bytes <= 1.05 * off.plan.budget_bytes
    assert on.plan.predicted_peak_bytes <= on.plan.budget_bytes
    long, short = (c.captured.graph for c in on._compiled.values())
    least, segments = min_feasible_peak(long)
    gap = donor_floor_gap(long, least)
    assert gap > 1.1  # the floor is far under the least peak
    donor = Donor(long, plan(long, "50%act"), segments, gap)
    assert carried_plan(short, Budget.parse("50%act"), [donor]) is not None
    without_gap = dataclasses.replace(donor, least_over_floor=1.0)
    assert carried_plan(short, Budget.parse("50%act"), [without_gap]) is None
