"""The MILP optimum: it matches brute force over its own schedules on tiny graphs, bounds the
planner from below, and the planner stays close to it."""

import pytest

from hbp.analysis import naive_peak
from hbp.errors import BudgetError, ConfigError
from hbp.graph import synthetic
from hbp.optimum import compare, main
from hbp.planner import min_feasible_peak, optimal_plan
from hbp.planner.optimum import Schedule, all_schedules, brute_force

TINY = [
    synthetic.chain(3, seed=0),
    synthetic.chain(3, seed=1, refinements=True),
    synthetic.random_dag(3, seed=5, extra_output_prob=0.3, refinements=True),
    synthetic.random_dag(3, seed=6, refinements=True),
    synthetic.random_dag(3, seed=11, extra_output_prob=0.5),
]


@pytest.mark.parametrize("mode", ["node", "tensor"])
@pytest.mark.parametrize("index", range(len(TINY)))
def test_milp_equals_brute_force_on_tiny_graphs(index, mode):
    graph = TINY[index]
    sch = Schedule(graph, mode=mode)
    naive = naive_peak(graph)
    assert sch.evaluate({})[0] == naive  # no recompute: the simulator's naive peak
    schedules = all_schedules(sch)
    for budget in range(max(1, naive - 10), naive + 1):
        opt = sch.solve(budget)
        best = brute_force(sch, budget, schedules)
        if best is None:
            assert opt.status == "infeasible"
        else:
            assert opt.status == "optimal"
            assert opt.recompute_flops == pytest.approx(best)
            assert opt.lower_bound_flops <= opt.recompute_flops + 1e-6


@pytest.mark.parametrize("seed", range(6))
def test_optimum_bounds_the_planner(seed):
    graph = synthetic.random_dag(6, seed=seed, alias_prob=0.0, extra_output_prob=0.2)
    node, tensor = Schedule(graph), Schedule(graph, mode="tensor")
    naive = naive_peak(graph)
    minimum = min_feasible_peak(graph)[0]
    for budget in sorted({minimum, (minimum + naive) // 2, naive}):
        planned = optimal_plan(graph, budget).predicted_recompute_flops
        best = node.solve(budget, relax=False).recompute_flops
        assert best is not None and best <= planned + 1e-6
        assert tensor.solve(budget, relax=False).recompute_flops <= best + 1e-6
    assert node.solve(naive).recompute_flops == 0


def test_planner_is_optimal_on_uniform_chains():
    # Revolve's setting: the tree of intervals reaches the optimum at every budget
    graph = synthetic.uniform_chain(6)
    sch = Schedule(graph)
    for budget in range(min_feasible_peak(graph)[0], naive_peak(graph) + 1):
        opt = sch.solve(budget, relax=False)
        assert optimal_plan(graph, budget).predicted_recompute_flops == pytest.approx(
            opt.recompute_flops
        )


def test_planner_is_mostly_within_five_percent_of_the_optimum():
    # Measured over 25 DAGs x 4 budgets: 89% within 5%, median ratio 1.00, mean 1.04, worst
    # 1.55 (per-op remat can rerun one saving op where a segment reruns a longer stretch).
    within, cases = 0, 0
    for seed in range(8):
        graph = synthetic.random_dag(6, seed=seed, alias_prob=0.0)
        minimum, naive = min_feasible_peak(graph)[0], naive_peak(graph)
        for budget in {minimum, (minimum + naive) // 2}:
            opt = Schedule(graph).solve(budget, relax=False).recompute_flops
            planned = optimal_plan(graph, budget).predicted_recompute_flops
            within += planned <= 1.05 * opt + 1e-6
            cases += 1
    assert within / cases >= 0.75


def test_compare_and_cli(tmp_path, capsys):
    graph = synthetic.random_dag(6, seed=4)
    r = compare(graph, 1.0)
    assert r["optimum_flops"] == r["planner_flops"] == 0 and r["gap"] == 0
    path = tmp_path / "g.json"
    graph.to_json(path)
    assert main([f"graph={path}", "budget=0.8,1.0"]) == 0
    out = capsys.readouterr().out
    assert "optimum" in out and "planner" in out and out.count("\n") == 4
    assert main(["graph=uniform:6", "budget=1"]) == 0  # 1 byte: infeasible, reported
    assert "infeasible" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="graph"):
        main(["graph=nope:3"])
    with pytest.raises(ConfigError, match="max_values"):
        main(["graph=residual:1", "max_values=10"])
    with pytest.raises(BudgetError):
        optimal_plan(graph, 1)
