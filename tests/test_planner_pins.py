"""The DP with pinned values (NOTE [ Pin candidates ] in hbp/planner/dp/cost_model.py) against
brute force over plans with pins: every plan of one level (or two) over all cut subsets, each
recomputed segment (at any level) pinning no node or any one node with storage of its own,
simulated. The DP's plans lie between the optimum with pins and the optimum without: never
more recompute than without pins, never over the budget (a pin charged until its child's pass
where that fits by simulation, else through its backward), and strictly less where a pin
pays."""

import itertools

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
from hbp.planner.plan import Segment
from tests.test_planner import tilings


def pinned_tilings(info: GraphInfo, cuts: list[int], depth: int):
    """Every plan over `cuts` up to `depth` levels, with every choice of one pin (or none) per
    recomputed segment at any level (a node pinned once)."""

    def pins(seg):
        if not seg.recompute:
            return [()]
        own = [
            q
            for q in range(seg.start, seg.stop)
            if not info.is_input[q] and info.root[q] == q and info.storage_bytes[q] > 0
        ]
        return [(), *((q,) for q in own)]

    def variants(segments):
        """Every pinned version of `segments` (children first)."""
        per_segment = []
        for s in segments:
            options = []
            for kids in variants(s.children) if s.children else [[]]:
                taken = {q for k in kids for q in all_pins(k)}
                for q in pins(s):
                    if not set(q) & taken:
                        options.append(Segment(s.start, s.stop, s.recompute, kids, pinned=q))
            per_segment.append(options)
        return [list(combo) for combo in itertools.product(*per_segment)]

    for tiling in tilings(0, info.n, cuts, depth):  # tests/test_planner.py's enumeration
        yield from variants(tiling)


def all_pins(seg: Segment) -> list[int]:
    return [*seg.pinned, *(q for c in seg.children for q in all_pins(c))]


def brute_force(graph, depth):
    """(peak, recompute, pins anywhere) of every plan."""
    info = GraphInfo.of(graph)
    cuts = candidate_cuts(info, 1, max_cuts=10**6)
    out = []
    for plan in pinned_tilings(info, cuts, depth):
        sim = simulate(graph, plan, info=info)
        out.append((sim.peak_bytes, sim.recompute_flops, any(all_pins(s) for s in plan)))
    return out


def least(results, budget, pins: bool):
    fits = [r for p, r, pinned in results if p <= budget and (pins or not pinned)]
    return min(fits) if fits else None


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
    results = brute_force(graph, depth)
    peaks = sorted({p for p, _, _ in results})
    gained = 0
    for budget in peaks[:: max(1, len(peaks) // 16)] + [peaks[-1]]:
        with_pins, without = least(results, budget, True), least(results, budget, False)
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
    from hbp.planner.milp import Schedule

    graph = synthetic.random_dag(7, seed=32, alias_prob=0.0)
    budget = min_feasible_peak(graph)[0]
    assert budget < naive_peak(graph)
    optimum = Schedule(graph).solve(budget, relax=False).recompute_flops
    plan = optimal_plan(graph, budget)
    validate_plan(graph, plan)
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_recompute_flops == pytest.approx(optimum)
    assert [q for s in plan.segments for q in all_pins(s)] == [1]  # op1
    monkeypatch.setattr(cost_model, "EVERY_PIN_MAX_CUTS", 0)  # the two candidates only
    two = optimal_plan(graph, budget)
    assert two.predicted_recompute_flops > optimum + 1
