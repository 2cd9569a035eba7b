"""The planners against brute force, the budget parser, and the planner entry points.

Brute force enumerates every plan over all cut subsets (one level: each segment plain or
recomputed; nested: recomputed segments tiled again, recursively) and simulates each: the
least recompute among those whose simulated peak fits is the optimum the DP must equal. Plans
here pin nothing (`PIN_VALUES` off); tests/test_planner_pins.py checks the DP with pins against
brute force over pinned plans."""

import contextlib
import gc
import math

import pytest

from hbp.analysis import naive_peak, simulate
from hbp.analysis.liveness import GraphInfo
from hbp.errors import BudgetError, ConfigError
from hbp.graph import synthetic
from hbp.graph.ir import Graph
from hbp.planner import (
    candidate_cuts,
    min_feasible_peak,
    optimal_plan,
    parse_budget,
    plan,
    uniform_plan,
    validate_plan,
)
from hbp.planner.cuts import cut_choices
from hbp.planner.dp import least_peak, solver
from hbp.planner.dp.cost_model import CostModel
from hbp.planner.dp.least_peak import forget_least_peaks, union_pays
from hbp.planner.plan import Plan, Segment
from hbp.units import MIB
from tests.helpers.oracles import least_recompute, plan_outcomes


@pytest.fixture(autouse=True)
def without_pins(monkeypatch):
    monkeypatch.setattr(solver, "PIN_VALUES", False)


def assert_dp_equals_brute_force(graph, depth, nested, budgets=14):
    results = plan_outcomes(graph, depth)
    peaks = sorted({p for p, _ in results})
    step = max(1, len(peaks) // budgets)
    for budget in peaks[::step] + [peaks[-1]]:
        best = least_recompute(results, budget)
        p = optimal_plan(graph, budget, nested=nested, max_cuts=10**6)
        validate_plan(graph, p)
        assert p.predicted_recompute_flops == pytest.approx(best), (budget, p)
        assert p.predicted_peak_bytes <= budget
    with pytest.raises(BudgetError) as err:
        optimal_plan(graph, peaks[0] - 1, nested=nested, max_cuts=10**6)
    assert err.value.minimum == peaks[0]
    assert min_feasible_peak(graph, nested=nested, max_cuts=10**6)[0] == peaks[0]


@pytest.mark.parametrize("seed", range(4))
def test_one_level_dp_equals_brute_force_on_chains(seed):
    graph = synthetic.chain(6, seed=seed, refinements=seed % 2 == 1)
    assert_dp_equals_brute_force(graph, depth=1, nested=False)


@pytest.mark.parametrize("seed", range(6))
def test_one_level_dp_equals_brute_force_on_dags(seed):
    graph = synthetic.random_dag(6, seed=seed, extra_output_prob=0.2, refinements=seed >= 3)
    assert_dp_equals_brute_force(graph, depth=1, nested=False)


@pytest.mark.parametrize(
    "graph",
    [
        synthetic.chain(4, seed=0),
        synthetic.chain(4, seed=1, refinements=True),
        synthetic.random_dag(4, seed=2, extra_output_prob=0.3),
        synthetic.random_dag(4, seed=3, refinements=True),
    ],
    ids=["chain0", "chain1", "dag2", "dag3"],
)
def test_nested_dp_equals_brute_force_over_all_nestings(graph):
    assert_dp_equals_brute_force(graph, depth=4, nested=True)


def with_random_nodes(graph, state_bytes):
    """`graph` with every op drawing random numbers and generator states of `state_bytes`
    (NOTE [ Generator states of checkpoints ])."""
    for node in graph.nodes:
        node.draws_random = not node.is_input
    graph.rng_state_bytes = state_bytes
    return graph


@pytest.mark.parametrize("seed", [0, 2])  # DAGs where a plan blind to the states breaks
def test_plans_fit_with_generator_states(seed):
    """The DP does not see the states that segments nested in a recomputed one keep from the
    forward; its plans still fit once simulated, and BudgetError's minimum is reachable."""
    graph = with_random_nodes(synthetic.random_dag(5, seed=seed), state_bytes=1)
    results = plan_outcomes(graph, depth=3)
    blind = 0  # budgets that plans ignoring the states break
    for budget in range(min(p for p, _ in results) - 2, naive_peak(graph) + 1):
        try:
            p, fits = optimal_plan(graph, budget, max_cuts=10**6), budget
        except BudgetError as err:
            assert err.minimum > budget
            p, fits = optimal_plan(graph, err.minimum, max_cuts=10**6), err.minimum
        validate_plan(graph, p)
        assert p.predicted_peak_bytes <= fits
        assert p.predicted_recompute_flops >= least_recompute(results, fits) - 1e-6
        try:
            unaware = optimal_plan(without_states(graph), budget, max_cuts=10**6)
        except BudgetError:
            continue
        blind += simulate(graph, unaware).peak_bytes > budget
    assert blind


def test_a_budget_below_the_lower_bound_with_generator_states_skips_the_tables(monkeypatch):
    """Generator states only add to a plan's peak, so below `lower_bound` nothing fits: the
    BudgetError the recompute tables end in, without running them (NOTE [ Budgets below the
    lower bound ])."""
    from hbp.analysis.frontier import lower_bound
    from hbp.planner.dp import entry
    from hbp.planner.dp.least_peak import forget_least_peaks

    graph = with_random_nodes(synthetic.random_dag(12, seed=4), state_bytes=3)
    budget = lower_bound(GraphInfo.of(graph)) - 1
    tables = []

    class Counted(entry.Solver):
        def __init__(self, *args, **kwargs):
            tables.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(entry, "Solver", Counted)
    errors = []
    for bound in (lower_bound, lambda info: 0):  # the bound, then the tables' way
        monkeypatch.setattr(entry, "lower_bound", bound)
        forget_least_peaks()
        tables.clear()
        with pytest.raises(BudgetError) as err:
            optimal_plan(graph, budget)
        errors.append((err.value.minimum, err.value.detail, len(tables)))
    (minimum, detail, skipped), (long_minimum, long_detail, ran) = errors
    assert (minimum, detail) == (long_minimum, long_detail)
    assert skipped == 0 < ran
    assert optimal_plan(graph, minimum).predicted_peak_bytes <= minimum


def without_states(graph):
    copy = Graph.from_dict(graph.to_dict())
    copy.rng_state_bytes = 0
    return copy


def stopping_before_nodes(graph):
    """`graph` with capture facts of where a recompute pass that early-stops at a node ends
    (NOTE [ Early stop at the last pack ]): nodes that save only inputs run nothing of
    themselves (a Linear) or half their FLOPs, alternately."""
    k = 0
    for node in graph.nodes:
        if node.saved_inputs and not node.saves_output and not node.saved_extra_bytes:
            if k % 2 == 0:
                node.output_after_last_save, node.flops_after_last_save = True, node.flops
            else:
                node.flops_after_last_save = node.flops / 2
            k += 1
    return graph


@pytest.mark.parametrize("seed", range(3))
def test_dp_equals_brute_force_when_passes_stop_before_a_node(seed):
    graph = stopping_before_nodes(synthetic.random_dag(6, seed=seed, refinements=seed > 0))
    assert_dp_equals_brute_force(graph, depth=1, nested=False)
    graph = stopping_before_nodes(synthetic.random_dag(4, seed=seed + 10, refinements=True))
    assert_dp_equals_brute_force(graph, depth=4, nested=True)


# Graphs on which a DP that charged the whole node a pass stops at picks a costlier plan
# (chains 1, dag 12, nested 13, 19) or reports a higher minimum (chains 15, dag 6, nested 18, 39).
@pytest.mark.parametrize(
    ("graph", "depth", "nested"),
    [
        *[(synthetic.chain(6, seed=s, stop_facts=True), 1, False) for s in (1, 15)],
        (synthetic.random_dag(6, seed=6, stop_facts=True, refinements=True), 1, False),
        pytest.param(
            synthetic.random_dag(6, seed=12, stop_facts=True, refinements=True),
            1,
            False,
            marks=pytest.mark.xfail(
                strict=True,
                reason="the DP's least peak is 1 byte above brute force's (27 vs 26): a pass "
                "stopping at a node that runs part of its FLOPs before its last save and makes "
                "its output after it is charged whole (conservative), not analysed further",
            ),
        ),
        *[
            (synthetic.chain(4, seed=s, stop_facts=True, refinements=True), 4, True)
            for s in (13, 18)
        ],
        *[
            (synthetic.random_dag(4, seed=s, extra_output_prob=0.3, stop_facts=True), 4, True)
            for s in (19, 39)
        ],
    ],
    ids=[
        "chain1",
        "chain15",
        "dag6",
        "dag12",
        "nested-chain13",
        "nested-chain18",
        "nested-dag19",
        "nested-dag39",
    ],
)
def test_dp_equals_brute_force_when_passes_stop_inside_a_node(graph, depth, nested):
    """NOTE [ Early stop at the last pack ]: the DP charges a pass's last save event only its
    part before the last save, as the simulator does."""
    assert any(nd.flops_after_last_save for nd in graph.nodes)
    assert_dp_equals_brute_force(graph, depth=depth, nested=nested)


def test_nested_dp_beats_every_depth_two_plan():
    graph = synthetic.chain(5, seed=7)
    results = plan_outcomes(graph, depth=2)
    for budget in sorted({p for p, _ in results})[::3]:
        p = optimal_plan(graph, budget, max_cuts=10**6)
        assert p.predicted_peak_bytes <= budget
        assert p.predicted_recompute_flops <= least_recompute(results, budget) + 1e-9


def test_nesting_reaches_below_one_level():
    graph = synthetic.uniform_chain(12)
    one = min_feasible_peak(graph, nested=False)[0]
    tree, segments = min_feasible_peak(graph)
    assert tree < one
    assert max(s.depth() for s in segments) >= 2
    p = optimal_plan(graph, tree)
    validate_plan(graph, p)
    assert max(s.depth() for s in p.segments) >= 2


def test_budget_at_naive_peak_needs_no_recompute():
    graph = synthetic.residual_net(2)
    p = plan(graph, 1.0)
    assert p.predicted_recompute_flops == 0
    assert p.predicted_peak_bytes == p.naive_peak_bytes == naive_peak(graph)


@pytest.mark.parametrize("layers", [2, 8])  # the whole-graph DP; also staged (>= 400 nodes)
def test_planning_leaves_no_cyclic_garbage(layers):
    """A plan's cost models, profiles and tables are freed by reference counting when `plan`
    returns, not left as cycles for the collector (NOTE [ Profiles do not own their cost
    model ] in hbp.planner.dp.profile: one collection of them took 10-20% of a plan call)."""
    graph = synthetic.residual_net(layers)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        p = plan(graph, 0.5)
        gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage}
        found = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert p.predicted_peak_bytes <= 0.5 * p.naive_peak_bytes
    assert not kinds & {"CostModel", "ChildProfile", "ChildArrays", "Solver"}, kinds
    assert found < 5000


def test_a_budget_error_leaves_its_callers_frames_to_reference_counting():
    """NOTE [ A BudgetError holds no frame's locals ]: a caller that catches a BudgetError
    gets its locals (HCModule's: the step's outputs) freed when it returns, not when the
    collector next runs."""
    import weakref

    import torch

    graph = synthetic.residual_net(3)

    def caller():
        held = torch.ones(4)
        try:
            plan(graph, 1)
        except BudgetError:
            pass
        return weakref.ref(held)

    gc.collect()
    gc.disable()
    try:
        released = caller()() is None
    finally:
        gc.enable()
    assert released


def test_discretised_plans_fit_and_trade_memory_for_recompute():
    graph = synthetic.residual_net(3)
    naive = naive_peak(graph)
    previous = -1.0
    for fraction in (0.8, 0.5, 0.3, 0.21):
        p = plan(graph, fraction, max_cuts=24)
        assert p.meta["solved_by"] == "dp" and p.meta["mem_slots"] == 256
        validate_plan(graph, p)
        assert p.predicted_peak_bytes <= int(fraction * naive)
        assert p.predicted_recompute_flops >= previous
        previous = p.predicted_recompute_flops
    assert previous > 0


def test_infeasible_budget_reports_minimum_in_mib():
    graph = synthetic.residual_net(1)
    minimum = min_feasible_peak(graph, max_cuts=24)[0]
    with pytest.raises(BudgetError, match=r"smallest feasible budget is [0-9.]+ MiB") as err:
        plan(graph, minimum - 1, max_cuts=24)
    assert err.value.minimum == minimum
    assert err.value.budget == minimum - 1
    validate_plan(graph, plan(graph, minimum, max_cuts=24))


@pytest.mark.parametrize("union", [True, False], ids=["union", "each set"])
def test_least_peak_is_over_other_cut_choices(union, monkeypatch):
    # NOTE [ Least peak over other cut choices ] in hbp.planner.cuts: the cuts chosen for 6
    # reach 95 bytes at least, the union of those for 6, 9 (1.5x) and 12 (2x) 55. With the
    # union ruled out (NOTE [ The union where it pays ]) the sets alone reach it too.
    if not union:
        monkeypatch.setattr(least_peak, "UNION_WORK", 0.0)
    forget_least_peaks()
    over, where = (
        ("union of cut choices", "the union of") if union else ("another cut choice", "the best of")
    )
    graph = synthetic.random_dag(40, seed=0)
    info = GraphInfo.of(graph)
    choices = cut_choices(info, 1, max_cuts=6)
    assert [len(c) for c in choices] == [8, 11, 14]
    assert union_pays(info, choices) == union
    assert min_feasible_peak(graph, max_cuts=10**6)[0] <= 55  # all cuts: a superset
    peak, segments = min_feasible_peak(graph, max_cuts=6)
    assert peak == 55
    assert simulate(graph, segments).peak_bytes == 55
    p = optimal_plan(graph, 60, max_cuts=6)
    assert p.meta["solved_by"] == f"dp ({over})"
    # the first set's floor (NOTE [ A floor under the least peak ]) is above the budget: its
    # tables are not run (NOTE [ The first set's floor skips its tables ]); its least is 95
    assert 60 < p.meta["whole_graph_floor"] <= 95
    assert p.predicted_peak_bytes <= 60
    validate_plan(graph, p)
    # NOTE [ A budget only other cuts reach ]: at the least peak, the recompute tables over
    # the union recompute less than the least-peak plan's tie-break (118 against 222 FLOPs)
    least = plan(graph, "min", max_cuts=6)
    assert least.predicted_peak_bytes == 55
    assert least.predicted_recompute_flops < simulate(graph, segments).recompute_flops
    assert p.predicted_recompute_flops <= least.predicted_recompute_flops
    with pytest.raises(BudgetError, match=f"least over {where} 3 cut choices") as err:
        optimal_plan(graph, 54, max_cuts=6)
    assert err.value.minimum == 55


def test_a_budget_errors_detail_does_not_depend_on_what_was_planned_before():
    """The least peak is over the union of the cut choices whichever path finds the error:
    the tables, the remembered least peaks or the lower bound (a fraction's error, whose
    detail also names the plain step's peak in MiB, never "0.00" on a small graph)."""
    graph = synthetic.random_dag(40, seed=0)
    details = []
    for first in (None, "min", 54, 0.1):
        for budget in (54, 0.1):
            forget_least_peaks()
            if first is not None:
                with contextlib.suppress(BudgetError):
                    plan(graph, first, max_cuts=6)
            with pytest.raises(BudgetError) as err:
                plan(graph, budget, max_cuts=6)
            assert err.value.minimum == 55
            details.append(err.value.detail)
    assert all("least over the union of 3 cut choices" in d for d in details), details
    assert len(set(details)) == 2  # one per budget
    assert "(0.000127 MiB)" in details[1]


def test_a_budget_only_other_cuts_reach_is_planned_a_slot_above_where_slots_round():
    """Byte counts with no common slot: at the least peak itself the tables' rounded slots
    reject plans that reach it exactly; one slot above, they find plans that simulate within
    it (106 FLOPs against 156 at the least peak; 162 where they found none, and the
    least-peak DP's own plan recomputes 204)."""
    for seed, least, flops in ((8, 23192, 106), (6, 23585, 162)):
        p = plan(synthetic.random_dag(30, seed=seed, max_bytes=5000), "min", max_cuts=6)
        assert p.meta["solved_by"] == "dp (union of cut choices)"
        assert p.predicted_peak_bytes <= p.budget_bytes == least
        assert p.predicted_recompute_flops == flops


def test_a_band_plan_over_its_budget_is_read_lower_from_the_same_tables(monkeypatch):
    """The plan one slot above the least peak simulates over it here: the plan a slot lower is
    read from the same tables (one solve over the union), not solved again at the budget,
    and it is the plan that solve found (252 FLOPs; NOTE [ One solve read at lower slot
    counts ])."""
    from hbp.planner.dp import entry, slots

    built = []  # the module of each recompute-table solve
    for module in (entry, slots):
        real = module.Solver
        monkeypatch.setattr(
            module, "Solver", lambda *a, _r=real, _m=module, **k: built.append(_m) or _r(*a, **k)
        )
    p = plan(synthetic.random_dag(30, seed=4, max_bytes=5000), "min", max_cuts=6)
    assert p.meta["solved_by"] == "dp (union of cut choices)"
    assert p.meta["read_at_slots"] == p.meta["mem_slots"] - 1
    assert p.predicted_peak_bytes <= p.budget_bytes == 22866
    assert p.predicted_recompute_flops == 252
    # the union's tables once: the first cut set's floor is above the budget, so its tables
    # are not run (NOTE [ The first set's floor skips its tables ])
    assert built == [slots]


def test_the_bands_slacks_are_read_from_one_solve(monkeypatch):
    """Where the tables a slot above the least peak find no plan, the slack a few slots above
    is read from the same solve, not solved again (NOTE [ One solve for the band's
    slacks ]); where neither finds one, the least-peak plan is taken."""
    from hbp.planner.dp import slots

    solves = []  # the slot counts of each band solve
    real = slots.Solver
    monkeypatch.setattr(
        slots, "Solver", lambda m, n, *a, **k: solves.append(n) or real(m, n, *a, **k)
    )
    p = plan(synthetic.random_dag(30, seed=0, max_bytes=5000), "min", max_cuts=6)
    assert p.meta["solved_by"] == "min-peak (other cuts)"
    (top,) = solves  # one solve; BAND_SLACK (1, 4): a slot above the least peak and 3 more
    assert 256 < top <= 256 + 3
    # its values at m slots do not depend on the slots above m
    info = GraphInfo.of(synthetic.random_dag(30, seed=4, max_bytes=5000))
    model = CostModel(info, cut_choices(info, 1, max_cuts=6)[0])
    low, high = (solver.Solver(model, n, 150.0).top(0, frozenset())[0] for n in (256, 259))
    assert (low == high[:257]).all() and low[0] == solver.INF > low[-1]


def test_a_budget_only_other_cuts_reach_takes_a_staged_plan_that_recomputes_less():
    """Below the first cut set's least peak (122 bytes here) as above it, a staged plan that
    fits and recomputes less than the whole-graph plan is taken."""
    graph = synthetic.random_dag(60, seed=5)
    whole = optimal_plan(graph, 107, max_cuts=6, staged="never")
    assert whole.meta["solved_by"] == "dp (union of cut choices)"
    staged = optimal_plan(graph, 107, max_cuts=6, staged="always")
    assert staged.meta["solved_by"] == "staged" and 107 < staged.meta["whole_graph_floor"] <= 122
    assert staged.predicted_peak_bytes <= 107
    assert staged.predicted_recompute_flops < whole.predicted_recompute_flops
    validate_plan(graph, staged)


def test_budget_error_says_when_parameter_gradients_are_most_of_the_minimum():
    graph = synthetic.uniform_chain(8, nbytes=MIB)
    for node in graph.nodes[1:]:
        node.param_grad_bytes = 4 * MIB  # a weight of 4 MiB per MiB of activation
    minimum = min_feasible_peak(graph)[0]
    with pytest.raises(BudgetError, match=r"32\.00 MiB of it are parameter gradients") as err:
        plan(graph, minimum - 1)
    assert err.value.minimum == minimum
    assert "FSDP" in str(err.value)
    light = synthetic.uniform_chain(8, nbytes=MIB)  # no parameters: the usual message
    with pytest.raises(BudgetError) as err:
        plan(light, min_feasible_peak(light)[0] - 1)
    assert "parameter gradients" not in str(err.value)


def test_budget_error_names_the_op_whose_workspace_is_most_of_the_minimum():
    """A kernel's workspace (a CPU depthwise convolution's backward: most of a ConvNeXt's
    least peak) is held while the op runs, whatever is recomputed: the error names the op."""
    graph = synthetic.uniform_chain(8, nbytes=MIB)
    graph.nodes[5].backward_scratch_bytes = 16 * MIB
    graph.nodes[5].module = "encoder.stages.3.dwconv"
    minimum = min_feasible_peak(graph)[0]
    assert minimum >= 16 * MIB
    with pytest.raises(BudgetError, match=r"16\.00 MiB of it is the workspace of encoder") as err:
        plan(graph, minimum - 1)
    assert err.value.minimum == minimum and "backward kernel" in str(err.value)


def test_plan_entry_point_options_and_errors():
    graph = synthetic.residual_net(2)
    p = plan(graph, "40MiB", planner="one_level", max_cuts=24)
    assert all(not s.children for s in p.segments)
    assert p.meta["planner"] == "optimal" and p.meta["nested"] is False
    with pytest.raises(ConfigError, match="planner"):
        plan(graph, 0.5, planner="greedy")
    with pytest.raises(ConfigError, match="block_size"):
        plan(graph, 0.5, block_size=0)
    with pytest.raises(ConfigError, match="budget"):
        plan(graph, 1.5)


def test_block_size_keeps_one_cheapest_cut_per_block():
    info = GraphInfo.of(synthetic.residual_net(2))
    cuts = candidate_cuts(info, block_size=10, max_cuts=10**6)
    interior = cuts[1:-1]
    assert len(interior) == math.ceil((info.n - 1) / 10)
    assert all(b - a <= 19 for a, b in zip(interior, interior[1:]))
    p = plan(synthetic.residual_net(2), 0.4, block_size=10)
    validate_plan(synthetic.residual_net(2), p)
    assert set(p.cut_points()) <= set(cuts)


def test_uniform_plan_recomputes_all_but_the_last_segment():
    graph = synthetic.uniform_chain(16)
    p = uniform_plan(graph, 4)
    assert [(s.start, s.stop, s.recompute) for s in p.segments] == [
        (0, 5, True),
        (5, 9, True),
        (9, 13, True),
        (13, 17, False),
    ]
    assert p.predicted_recompute_flops == 12  # the first 12 ops once more
    validate_plan(graph, p)
    by_flops = uniform_plan(graph, 4, by="flops")
    assert by_flops.cut_points() == p.cut_points()
    with pytest.raises(ConfigError, match="segments"):
        uniform_plan(graph, 0)


def test_optimal_beats_uniform_at_uniform_peak():
    graph = synthetic.residual_net(6)
    u = uniform_plan(graph, 6)
    o = optimal_plan(graph, u.predicted_peak_bytes, max_cuts=24)
    assert o.predicted_peak_bytes <= u.predicted_peak_bytes
    assert o.predicted_recompute_flops < u.predicted_recompute_flops


def test_plan_prints_segments_and_predictions():
    graph = synthetic.residual_net(2)
    p = plan(graph, 0.3, max_cuts=24)
    text = str(p)
    assert "recompute" in text and "plain" in text
    assert f"{p.predicted_peak_bytes / 2**20:.2f} MiB" in text
    assert f"{100 * p.predicted_recompute_ratio:.1f}% of naive step FLOPs" in text
    first = p.segments[0]
    assert f"{first.first} .. {first.last}" in text
    assert Plan.from_dict(p.to_dict()).segments == p.segments


def test_a_plans_text_says_what_counted_its_flops():
    """torch's FLOP counter counts matmuls, convolutions and attention (a recompute of
    elementwise ops is 0 FLOPs there): a plan of a torch capture says so; JAX's counts every
    equation, and its plan does not."""
    from hbp.planner.plan import TORCH_FLOPS

    for framework, said in (("torch", True), ("jax", False), (None, False)):
        graph = synthetic.residual_net(2)
        if framework is not None:
            graph.meta["framework"] = framework
        p = plan(graph, 0.3, max_cuts=24)
        assert p.meta.get("framework") == framework
        assert (TORCH_FLOPS in str(p)) == said, framework


@pytest.mark.parametrize(
    "budget, expected",
    [
        (0.5, 500),
        (1.0, 1000),
        (1, 1),
        (1000, 1000),
        ("1000", 1000),
        ("0.25", 250),
        ("1000B", 1000),
        ("1e3B", 1000),
        ("1KB", 1000),
        ("0.5KiB", 512),
    ],
)
def test_parse_budget_forms(budget, expected):
    assert parse_budget(budget, 1000) == expected


def test_parse_budget_sizes():
    big = 2**40
    assert parse_budget("64MiB", big) == 64 * 2**20
    assert parse_budget("1.5GiB", big) == 3 * 2**29
    assert parse_budget("500MB", big) == 500 * 10**6
    assert parse_budget("2e6B", big) == 2 * 10**6


@pytest.mark.parametrize(
    "budget", [True, False, 0, -5, 0.0, -0.1, float("nan"), 1.5, 1001, "2KB", "abc", "", None, []]
)
def test_parse_budget_rejects(budget):
    with pytest.raises(ConfigError) as err:
        parse_budget(budget, 1000)
    assert err.value.field == "budget"
    assert "64MiB" in str(err.value)


def test_budget_min_plans_at_the_smallest_feasible_peak():
    """budget="min" plans at exactly the minimum that BudgetError reports for a lower budget."""
    from hbp.errors import BudgetError
    from hbp.graph import synthetic
    from hbp.planner import min_feasible_peak, plan

    graph = synthetic.residual_net(4)
    least = plan(graph, "min")
    minimum, _ = min_feasible_peak(graph)
    assert least.budget_bytes == minimum
    assert least.predicted_peak_bytes <= minimum
    with pytest.raises(BudgetError) as error:
        plan(graph, minimum - 1)
    assert error.value.minimum == minimum


def test_finer_block_size_is_never_worse():
    # The cut limit prunes this graph's 70 positions. Windows used to be chosen before the
    # pruning, so block size 2 kept cuts that block size 1 dropped: minimum 81 bytes at block
    # size 2 against 89 at block size 1. Now each block size uses a subset of block size 1's.
    graph = synthetic.random_dag(70, seed=2, alias_prob=0.0)
    info = GraphInfo.of(graph)
    cuts = {k: set(candidate_cuts(info, k)) for k in (1, 2, 3, 4, 8)}
    assert len(cuts[1]) < info.n  # pruned: the nesting is what guarantees the order below
    assert all(cuts[k] <= cuts[1] for k in (2, 3, 4, 8))
    minimum = {k: min_feasible_peak(graph, block_size=k, info=info)[0] for k in (1, 2, 3)}
    assert minimum[1] <= min(minimum[2], minimum[3])
    with pytest.raises(BudgetError) as err:
        optimal_plan(graph, minimum[1] - 1, block_size=3, info=info)
    assert err.value.minimum >= minimum[1]
    budget = minimum[3] + 4
    flops = {k: optimal_plan(graph, budget, block_size=k, info=info) for k in (1, 3)}
    assert flops[1].predicted_recompute_flops <= flops[3].predicted_recompute_flops
    assert flops[1].predicted_peak_bytes <= budget


def _each_block_checkpointed(graph) -> list[Segment]:
    """The libraries' own checkpointing in the plan space: each block of
    `graph.meta["blocks"]` recomputed, keeping its inputs; the code between blocks plain."""
    segments, pos = [], 0
    for first, last in graph.meta["blocks"]:
        start, stop = graph.index(first), graph.index(last) + 1
        if start > pos:
            segments.append(Segment(pos, start))
        segments.append(Segment(start, stop, True))
        pos = stop
    return [*segments, Segment(pos, len(graph))]


@pytest.mark.parametrize("layers", [4])  # 8 layers too when changing cuts.py (~1 min)
def test_encoder_decoder_least_peak_is_below_checkpointing_each_block(layers):
    # NOTE [ Crossing counts are local ]: five values (the encoder output, biases, a mask, the
    # residual) cross every cut between decoder blocks, two between encoder blocks. Ranked by
    # the count alone, no decoder boundary was a candidate: the least peak was 13.9 MiB (4
    # layers) and 27.1 MiB (8 layers) where checkpointing each block peaks at 6.8 / 7.6 MiB.
    graph = synthetic.encoder_decoder_net(layers)
    info = GraphInfo.of(graph)
    blocks = simulate(graph, _each_block_checkpointed(graph), info=info)
    least, segments = min_feasible_peak(graph, info=info)
    assert least < blocks.peak_bytes
    assert simulate(graph, segments, info=info).peak_bytes == least
    at_blocks = optimal_plan(graph, blocks.peak_bytes, info=info)
    assert at_blocks.predicted_peak_bytes <= blocks.peak_bytes
    assert at_blocks.predicted_recompute_flops <= blocks.recompute_flops


def test_relative_budget_is_resolved_by_plan_as_by_the_caller():
    """plan(graph, "N%act") plans at the least peak + N% of what checkpointing saves, the
    bytes `Budget.resolve` gives from `least_peak` (NOTE [ Relative budgets resolved where
    they are planned ])."""
    from hbp.planner import least_peak
    from hbp.planner.budget import Budget

    graph = synthetic.random_dag(14, seed=1, skip_prob=0.3, max_skip=6)  # three budgets apart
    naive = naive_peak(graph)
    for form in ("50%act", Budget.activations(0.25), "0%act"):
        expected = Budget.parse(form).resolve(naive, lambda: least_peak(graph))
        planned = plan(graph, form)
        assert planned.budget_bytes == expected
        assert planned.predicted_peak_bytes <= expected
        assert planned.segments == plan(graph, expected).segments
    with pytest.raises(ConfigError):
        plan(graph, "150%act")


@pytest.mark.parametrize(
    "graph",
    [
        *(
            synthetic.random_dag(n, seed=s, skip_prob=0.3, max_skip=6)
            for n in (8, 14)
            for s in range(6)
        ),
        synthetic.residual_net(1),
        synthetic.encoder_decoder_net(1),
    ],
)
def test_the_floor_is_never_above_the_least_peak(graph):
    """NOTE [ A floor under the least peak ]: the cheap floor bounds the least-peak DP from
    below over every cut set (the plans that skip the DP on it are the DP's plans)."""
    from hbp.planner.dp.least_peak import (
        forget_least_peaks,
        least_peak_cached,
        least_peak_floor,
        union_of,
    )

    info = GraphInfo.of(graph)
    choices = cut_choices(info)
    every = [list(range(info.n + 1))] if info.n <= 20 else []  # every position a cut
    for cuts in (choices[0], union_of(choices), *every):
        forget_least_peaks()
        floor = least_peak_floor(info, cuts, True)
        assert 0 < floor <= least_peak_cached(info, cuts, True)[0]


@pytest.mark.parametrize(
    "graph",
    [
        *(
            synthetic.random_dag(n, seed=s, skip_prob=0.3, max_skip=6)
            for n in (8, 14)
            for s in (0, 1)
        ),
        synthetic.residual_net(2),
        synthetic.encoder_decoder_net(1),
    ],
)
def test_the_least_peak_value_is_the_least_peak_dps(graph):
    """NOTE [ A plan at the floor ]: the least peak had without the DP, where a plan of the
    DP's own reaches the floor, is the DP's least peak over every cut set (where the plan
    falls short, the DP runs on the floor's tables: the same value). A decoder where the
    plan reaches the floor: tests/test_planner_staged.py."""
    from hbp.planner.dp.least_peak import least_peak_cached, least_peak_value, union_of

    info = GraphInfo.of(graph)
    choices = cut_choices(info)
    for cuts in (choices[0], union_of(choices)):
        forget_least_peaks()
        value = least_peak_value(info, cuts, True)
        forget_least_peaks()
        assert value == least_peak_cached(info, cuts, True)[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_dp_equals_brute_force_with_out_of_place_parameter_gradient_sums(seed):
    """A parameter read by several nodes whose held gradient cannot take the next one in
    place (`Node.grad_sum_bytes`): the sum comes after the node has released what it saved,
    which the DP counts against the holds before the node's own (`Positional.late`), as the
    simulator does; counted beside the node's saved values, its least peak was above brute
    force's."""
    graph = synthetic.random_dag(6, seed=seed, refinements=True)
    for k, node in enumerate(graph.nodes):
        if not node.is_input and node.saved_inputs and k % 2:
            node.grad_sum_bytes = 3
    assert any(n.grad_sum_bytes for n in graph.nodes)
    assert_dp_equals_brute_force(graph, depth=2, nested=True)
