"""The DP with pinned values (NOTE [ Pin candidates ] in hbp/planner/dp/cost_model.py) against
brute force over plans with pins: every plan of one level (or two) over all cut subsets, each
recomputed segment (at any level) pinning no node or any one node with storage of its own,
simulated. The DP's plans lie between the optimum with pins and the optimum without: never
more recompute than without pins, never over the budget (a pin charged until its child's pass
where that fits by simulation, else through its backward), and strictly less where a pin
pays."""

import pytest
import torch

import hbp
import hbp.planner
from hbp.analysis import simulate
from hbp.analysis.liveness import GraphInfo
from hbp.errors import BudgetError
from hbp.graph import synthetic
from hbp.planner import candidate_cuts, optimal_plan, validate_plan
from hbp.planner.dp import solver
from tests.helpers.oracles import all_pins, least_recompute_pinned, pinned_plan_outcomes

# (graph, depth, whether a pin pays at some budget: the check is not vacuous)
CASES = [
    (synthetic.random_dag(6, seed=15, alias_prob=0.0), 1, True),
    (synthetic.random_dag(6, seed=18, alias_prob=0.0), 1, True),
    (synthetic.random_dag(6, seed=3, refinements=True), 1, False),
    (synthetic.chain(6, seed=2, refinements=True), 1, False),
    (synthetic.random_dag(4, seed=15, alias_prob=0.0), 2, False),
    (synthetic.random_dag(4, seed=8, alias_prob=0.0), 2, True),
]


@pytest.mark.parametrize(
    ("graph", "depth", "pays"),
    CASES,
    ids=["dag15", "dag18", "dag3", "chain2", "nested-dag15", "nested-dag8"],
)
def test_dp_with_pins_lies_between_the_optima_with_and_without_pins(graph, depth, pays):
    results = pinned_plan_outcomes(graph, depth)
    peaks = sorted({p for p, _, _ in results})
    gained = 0
    for budget in peaks[:: max(1, len(peaks) // 16)] + [peaks[-1]]:
        with_pins, without = (
            least_recompute_pinned(results, budget, True),
            least_recompute_pinned(results, budget, False),
        )
        try:
            plan = optimal_plan(graph, budget, nested=depth > 1, max_cuts=10**6)
        except BudgetError:  # pins never lower the least peak: only below it
            assert without is None
            continue
        validate_plan(graph, plan)  # fits by simulation, every value read is live
        assert plan.predicted_peak_bytes <= budget
        recompute = plan.predicted_recompute_flops
        assert with_pins - 1e-9 <= recompute <= without + 1e-9, (budget, plan)
        gained += recompute < without - 1e-9
        assert recompute < without - 1e-9 or not any(all_pins(s) for s in plan.segments)
    assert (gained > 0) == pays


def test_pins_can_be_turned_off(monkeypatch):
    graph = synthetic.random_dag(7, seed=15, alias_prob=0.0)
    budget = 0
    with_pins = None
    for budget in range(int(graph.nodes[1].output_bytes), 10**6):
        try:
            with_pins = optimal_plan(graph, budget)
        except BudgetError as err:
            budget = err.minimum
            continue
        if any(s.pinned for s in with_pins.segments):
            break
    assert with_pins is not None and any(s.pinned for s in with_pins.segments)
    monkeypatch.setattr(solver, "PIN_VALUES", False)
    without = optimal_plan(graph, budget)
    assert not any(s.pinned for s in without.segments)
    assert without.predicted_recompute_flops > with_pins.predicted_recompute_flops


def test_plans_without_pins_for_executors_that_cannot_run_them(monkeypatch):
    """`plan(..., pins=False)` (compiled segments, JAX) never pins and recomputes at least as
    much as the plan with pins; HCModule(compile=True) and hbp.jax plan that way."""
    from hbp.integrations.jax.planning import make_plan

    graph = synthetic.residual_net(4)
    with_pins = hbp.planner.plan(graph, 0.5)
    without = hbp.planner.plan(graph, 0.5, pins=False)
    assert any(s.pinned for s in with_pins.segments)
    assert not any(s.pinned for s in without.segments)
    assert without.predicted_recompute_flops > with_pins.predicted_recompute_flops
    assert without.predicted_peak_bytes <= without.budget_bytes
    assert not any(s.pinned for s in make_plan(graph, 0.5).segments)

    asked = []
    real_plan = hbp.planner.plan

    def recording(*args, **kwargs):
        asked.append(kwargs.get("pins"))
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(hbp.planner, "plan", recording)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    x = torch.randn(128, 16)
    for compile_, expected in ((False, True), ({"backend": "eager"}, False)):
        hc = hbp.HCModule(model, budget=1.0, compile=compile_)
        hc(x).sum().backward()
        assert asked[-1] is expected


def test_a_pin_its_childs_pass_never_reaches_is_planned_again():
    """Charged until the child's pass (PinCharge.PASS), a pin whose child's nested plan stops
    its pass before it saves nothing: the tables promise less than the plan recomputes, and
    `optimal_plan` takes the plan made with the pin charged through the backward instead."""
    from hbp.planner.dp import entry

    graph = synthetic.random_dag(5, seed=15, alias_prob=0.0)
    info = GraphInfo.of(graph)
    cuts = candidate_cuts(info, 1, 64)
    by_charge = {}
    for charge in solver.PinCharge:
        solved = entry._solve(info, cuts, 25, 256, True, None, charge)
        sim = simulate(graph, solved.segments, info=info)
        by_charge[charge] = (solved.recompute, sim.recompute_flops, sim.peak_bytes)
    promised, recomputes, _ = by_charge[solver.PinCharge.PASS]
    assert promised < recomputes  # the pin goes unanswered
    plan = optimal_plan(graph, 25)
    assert plan.predicted_peak_bytes <= 25
    assert plan.predicted_recompute_flops == by_charge[solver.PinCharge.BACKWARD][1] < recomputes
    assert "charged through the backward" in plan.meta["solved_by"]


def test_small_cost_models_offer_every_node_as_a_pin(monkeypatch):
    """On small cost models a recomputed child may pin any node its pass runs, not only the two
    best by FLOPs and by FLOPs per byte (NOTE [ Pin candidates ]). In this 7-op DAG at its
    least peak the MILP optimum keeps op1 (neither candidate: op2 has more FLOPs and more
    FLOPs per byte) from the forward; the DP reaches it with op1 pinned and not otherwise."""
    from hbp.analysis import naive_peak
    from hbp.planner import min_feasible_peak
    from hbp.planner.dp import cost_model
    from hbp.planner.milp import solve
    from hbp.planner.schedule_model import Schedule

    graph = synthetic.random_dag(7, seed=32, alias_prob=0.0)
    budget = min_feasible_peak(graph)[0]
    assert budget < naive_peak(graph)
    optimum = solve(Schedule(graph), budget, relax=False).recompute_flops
    plan = optimal_plan(graph, budget)
    validate_plan(graph, plan)
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_recompute_flops == pytest.approx(optimum)
    assert [q for s in plan.segments for q in all_pins(s)] == [1]  # op1
    monkeypatch.setattr(cost_model, "EVERY_PIN_MAX_CUTS", 0)  # the two candidates only
    two = optimal_plan(graph, budget)
    assert two.predicted_recompute_flops > optimum + 1
