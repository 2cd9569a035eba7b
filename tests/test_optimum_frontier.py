"""The optimum's frontier: bounds when the MILP stops early, and `frontier` rows as the bench
and the Pareto plot read them."""

import pytest

from hbp.analysis import naive_peak
from hbp.graph import synthetic
from hbp.optimum import frontier
from hbp.planner import min_feasible_peak
from hbp.planner.milp import solve
from hbp.planner.schedule_model import Schedule


def test_an_optimal_solve_reports_itself_as_best_found_and_bound():
    graph = synthetic.random_dag(6, seed=2, alias_prob=0.0)
    budget = (min_feasible_peak(graph)[0] + naive_peak(graph)) // 2
    opt = solve(Schedule(graph), budget)
    assert opt.status == "optimal"
    assert opt.best_found_flops == opt.recompute_flops == opt.proven_bound_flops
    assert opt.lower_bound_flops <= opt.recompute_flops + 1e-6  # the LP relaxation


def test_a_time_limited_solve_brackets_the_optimum():
    # 16 nodes: 0.05 s stops the solve, the exact one takes seconds (40 nodes took over 5 min
    # once every node carried calibrated scratch fields)
    graph = synthetic.random_dag(16, seed=1, alias_prob=0.0)
    sch = Schedule(graph)
    budget = (min_feasible_peak(graph)[0] + naive_peak(graph)) // 2
    stopped = solve(sch, budget, time_limit=0.05)
    assert stopped.status == "time limit" and stopped.recompute_flops is None
    exact = solve(sch, budget, time_limit=600, relax=False)
    assert exact.status == "optimal"
    if stopped.best_found_flops is not None:  # an incumbent is a feasible schedule
        assert stopped.best_found_flops >= exact.recompute_flops - 1e-6
    if stopped.proven_bound_flops is not None:
        assert stopped.proven_bound_flops <= exact.recompute_flops + 1e-6


def test_frontier_rows():
    graph = synthetic.random_dag(6, seed=3, alias_prob=0.0)
    rows = frontier(graph, [1.0, 0.8, "min"], time_limit=60)
    assert [r["budget"] for r in rows] == [1.0, 0.8, "min"]
    assert rows[0]["optimum_flops"] == rows[0]["planner_flops"] == 0
    assert rows[2]["budget_bytes"] == min_feasible_peak(graph)[0]
    for r in rows:
        if r["status"] != "optimal":
            assert r["status"] == "infeasible" and r["planner_flops"] is None
            continue
        # the optimum bounds the planner from below (node mode, a graph without aliases)
        assert r["gap"] >= -1e-9 and r["gap_to_bound"] == pytest.approx(r["gap"])
        assert r["optimum_ratio"] == pytest.approx(r["optimum_flops"] / r["naive_flops"])
        assert r["planner_peak_bytes"] <= r["budget_bytes"]
