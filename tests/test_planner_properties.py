"""Properties of the planners over random DAGs (hypothesis): plans fit and validate,
recompute never grows with the budget, the naive budget needs no recompute, nesting never
loses to one level, and infeasible budgets report the true minimum."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hbp.analysis import naive_peak, simulate
from hbp.errors import BudgetError
from hbp.graph import synthetic
from hbp.planner import min_feasible_peak, optimal_plan, uniform_plan, validate_plan

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

graphs = st.builds(
    synthetic.random_dag,
    n=st.integers(3, 14),
    seed=st.integers(0, 10**6),
    skip_prob=st.sampled_from([0.0, 0.3, 0.6]),
    max_skip=st.integers(1, 6),
    alias_prob=st.sampled_from([0.0, 0.15, 0.3]),
    extra_output_prob=st.sampled_from([0.0, 0.2]),
    refinements=st.booleans(),
)


@SETTINGS
@given(graph=graphs, fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=4))
def test_plans_fit_validate_and_recompute_is_monotone_in_budget(graph, fractions):
    naive = naive_peak(graph)
    minimum = min_feasible_peak(graph)[0]
    budgets = sorted({minimum + round(f * (naive - minimum)) for f in fractions})
    previous = None
    for budget in budgets:
        p = optimal_plan(graph, budget)
        validate_plan(graph, p)
        sim = simulate(graph, p)
        assert sim.peak_bytes == p.predicted_peak_bytes <= budget
        assert sim.recompute_flops == pytest.approx(p.predicted_recompute_flops)
        if previous is not None:
            assert p.predicted_recompute_flops <= previous + 1e-9
        previous = p.predicted_recompute_flops


@SETTINGS
@given(graph=graphs)
def test_naive_budget_needs_no_recompute_and_below_minimum_fails(graph):
    naive = naive_peak(graph)
    p = optimal_plan(graph, naive)
    assert p.predicted_recompute_flops == 0 and p.predicted_peak_bytes == naive
    minimum, segments = min_feasible_peak(graph)
    assert simulate(graph, segments).peak_bytes == minimum
    with pytest.raises(BudgetError) as err:
        optimal_plan(graph, minimum - 1)
    assert err.value.minimum == minimum


@SETTINGS
@given(graph=graphs, fraction=st.floats(0.0, 1.0))
def test_nesting_never_loses_to_one_level(graph, fraction):
    naive = naive_peak(graph)
    one_level_min = min_feasible_peak(graph, nested=False)[0]
    assert min_feasible_peak(graph)[0] <= one_level_min
    budget = one_level_min + round(fraction * (naive - one_level_min))
    one = optimal_plan(graph, budget, nested=False)
    tree = optimal_plan(graph, budget)
    assert all(not s.children for s in one.segments)
    assert tree.predicted_recompute_flops <= one.predicted_recompute_flops + 1e-9


@SETTINGS
@given(graph=graphs, segments=st.integers(1, 6))
def test_optimal_is_no_worse_than_uniform_at_its_peak(graph, segments):
    u = uniform_plan(graph, segments)
    validate_plan(graph, u)
    o = optimal_plan(graph, u.predicted_peak_bytes)
    assert o.predicted_recompute_flops <= u.predicted_recompute_flops + 1e-9
