"""Planning once per structure: identical stages of a captured-like stack share their tables,
plans and BudgetErrors are read back from a PlanCache, saved plans load for their graph only,
and a budget below the lower bound gets the same BudgetError as the long way."""

import contextlib
import dataclasses

import pytest

from hbp.analysis import naive_peak
from hbp.analysis.frontier import lower_bound
from hbp.analysis.liveness import GraphInfo
from hbp.errors import BudgetError, ConfigError
from hbp.graph import synthetic
from hbp.graph.ir import Graph, Node
from hbp.planner import PlanCache, graph_fingerprint, load_plan, plan, save_plan
from hbp.planner import dp as dp_package
from hbp.planner.dp import entry
from hbp.planner.dp.least_peak import forget_least_peaks
from hbp.planner.stages import stage_signatures, staged_plan


def with_constants(graph: Graph, every: int = 60, at: int = 17) -> Graph:
    """`graph` with a constant (no inputs, no gradient: a captured `torch.tensor(...)`) added
    inside each layer, as a captured transformer has."""
    nodes = []
    for j, node in enumerate(graph.nodes):
        nodes.append(node)
        if j % every == at:
            nodes.append(Node(f"const_{j}", "tensor", requires_grad=False))
    return Graph(nodes, list(graph.outputs), dict(graph.meta))


def renamed(graph: Graph) -> Graph:
    names = {n.name: f"x{i}" for i, n in enumerate(graph.nodes)}

    def node(n: Node) -> Node:
        return dataclasses.replace(
            n,
            name=names[n.name],
            inputs=tuple(names[v] for v in n.inputs),
            saved_inputs=tuple(names[v] for v in n.saved_inputs),
            grad_passthrough=tuple(names[v] for v in n.grad_passthrough),
            alias_of=None if n.alias_of is None else names[n.alias_of],
            module="elsewhere",
        )

    return Graph([node(n) for n in graph.nodes], [names[o] for o in graph.outputs], {})


def test_identical_layers_with_constants_share_stage_tables_and_plan_as_without_sharing():
    graph = with_constants(synthetic.residual_net(8, same_layers=True))
    info = GraphInfo.of(graph)
    keys = stage_signatures(info)
    # two stages per layer, then the first and last ones: the middle layers share two tables
    assert len(keys) >= 14 and len(set(keys)) <= 6
    budget = int(0.5 * naive_peak(graph))
    assert staged_plan(info, budget) == staged_plan(info, budget, reuse=False)


def test_plan_cache_reads_back_plans_and_budget_errors(tmp_path, monkeypatch):
    graph = synthetic.residual_net(2, ops_per_layer=24, same_layers=True)
    made = plan(graph, 0.5, cache=tmp_path)
    with pytest.raises(BudgetError) as first:
        plan(graph, 0.05, cache=tmp_path)

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr("hbp.planner.optimal_plan", no_planning)
    other = renamed(graph)
    assert graph_fingerprint(other) == graph_fingerprint(graph)
    again = plan(other, 0.5, cache=PlanCache(tmp_path))
    assert again.meta["from_cache"]
    assert again.predicted_peak_bytes == made.predicted_peak_bytes
    assert again.predicted_recompute_flops == made.predicted_recompute_flops
    assert [(s.start, s.stop, s.recompute) for s in again.segments] == [
        (s.start, s.stop, s.recompute) for s in made.segments
    ]
    assert again.segments[0].first == "x0"  # names of the graph it is loaded for
    with pytest.raises(BudgetError) as cached:
        plan(other, 0.05, cache=tmp_path)
    assert cached.value.minimum == first.value.minimum
    with pytest.raises(AssertionError, match="planned again"):  # another budget: a miss
        plan(graph, 0.6, cache=tmp_path)


def test_saved_plan_loads_for_its_graph_only(tmp_path):
    graph = synthetic.residual_net(2, ops_per_layer=24, same_layers=True)
    made = plan(graph, 0.5)
    path = save_plan(made, tmp_path / "plan.json", graph)
    loaded = load_plan(path, renamed(graph))
    assert loaded.segments[0].start == made.segments[0].start
    assert loaded.predicted_peak_bytes == made.predicted_peak_bytes
    with pytest.raises(ConfigError, match="fingerprint differs"):
        load_plan(path, synthetic.residual_net(3, ops_per_layer=24, same_layers=True))


def test_budget_below_the_lower_bound_raises_the_minimum_of_the_long_way(monkeypatch):
    graph = synthetic.residual_net(2, ops_per_layer=24)
    info = GraphInfo.of(graph)
    budget = lower_bound(info) - 1
    with pytest.raises(BudgetError) as fast:
        plan(graph, budget)
    forget_least_peaks()
    monkeypatch.setattr(entry, "lower_bound", lambda info: 0)  # no shortcut
    with pytest.raises(BudgetError) as slow:
        plan(graph, budget)
    assert fast.value.minimum == slow.value.minimum
    assert fast.value.minimum == dp_package.min_feasible_peak(graph)[0]


@pytest.mark.parametrize("budget", ["min", "50%act"])
def test_a_plan_call_makes_one_cost_model_per_cut_set_and_plans_as_with_one_per_solve(
    budget, monkeypatch
):
    """NOTE [ One cost model per cut set in a plan call ]: "min" and "N%act" run the
    least-peak DP and the recompute tables over the same cuts; they share one cost model,
    dropped when the call returns, and the plan is the one of a model per solve."""
    from hbp.planner import stages as stages_module
    from hbp.planner.dp import cost_model as cost_model_module

    graph = synthetic.random_dag(40, seed=3)
    made: list[tuple] = []
    original = cost_model_module.CostModel.__init__

    def counted(self, info, cuts, bounds=None):
        made.append((tuple(cuts), tuple(bounds or ())))
        original(self, info, cuts, bounds)

    monkeypatch.setattr(cost_model_module.CostModel, "__init__", counted)
    forget_least_peaks()
    shared = plan(graph, budget, schedules=False)
    assert made and len(made) == len(set(made)), made
    assert "_cost_models" not in GraphInfo.of(graph).__dict__

    made.clear()
    monkeypatch.setattr(stages_module, "cost_models_shared", _one_model_per_solve)
    forget_least_peaks()
    apart = plan(graph, budget, schedules=False)
    assert len(made) > len(set(made))  # the same cuts' model made again for another solve
    assert apart.segments == shared.segments
    assert apart.predicted_recompute_flops == shared.predicted_recompute_flops


@contextlib.contextmanager
def _one_model_per_solve(info):
    yield True  # the outermost scope: the stage tables are still dropped at its end
