"""Staged planning (hbp.planner.stages): plans of deep graphs that fit, validate, execute with
exact gradients, and keep their quality as the depth grows."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hbp
from hbp.analysis import naive_peak, simulate
from hbp.analysis.liveness import GraphInfo
from hbp.graph import synthetic
from hbp.planner import optimal_plan, validate_plan
from hbp.planner.cuts import window_cuts
from hbp.planner.dp import entry
from hbp.planner.stages import (
    StageOption,
    _allocate,
    stage_bounds,
    stage_signatures,
    staged_plan,
)


@pytest.fixture
def always_staged(monkeypatch):
    """Take the staged plan whenever it fits, on every graph, however small."""
    monkeypatch.setattr(entry, "STAGED", "always")


def forward_flops(graph):
    return sum(n.flops for n in graph.nodes)


def test_deep_residual_net_is_planned_in_stages_and_fits():
    graph = synthetic.residual_net(12)
    p = optimal_plan(graph, int(0.5 * naive_peak(graph)))
    validate_plan(graph, p)
    assert p.meta["solved_by"] == "staged"
    assert p.predicted_recompute_flops < p.meta["whole_graph_recompute"]
    assert simulate(graph, p).peak_bytes <= p.budget_bytes


def test_staged_quality_does_not_fall_with_depth():
    ratios = []
    for layers in (6, 24):
        graph = synthetic.residual_net(layers)
        info = GraphInfo.of(graph)
        budget = int(0.5 * naive_peak(graph))
        segments = staged_plan(info, budget, nested=False)
        sim = simulate(graph, segments, info=info, check=True)
        assert sim.peak_bytes <= budget
        ratios.append(sim.recompute_flops / forward_flops(graph))
    assert ratios[1] <= 1.05 * ratios[0]


def test_stage_bounds_go_on_past_a_span_without_cuts():
    """NOTE [ A stage past a span without cuts ]: no cut within reach of the last bound (in
    place writes into one buffer forbid them) ends that stage at the first cut after the
    span; the bounds went no further, and the rest of the graph was one stage."""
    graph = synthetic.residual_net(12)
    info = GraphInfo.of(graph)
    gap = range(60, 200)  # no cut may fall here
    cuts = [c for c in range(info.n + 1) if c not in gap]
    bounds = stage_bounds(info, cuts, stage_nodes=40)
    assert set(bounds) <= set(cuts)
    after = [b for b in bounds if b >= gap.stop]
    assert after[0] == gap.stop  # the stage over the span ends at the first cut after it
    spans = [b - a for a, b in zip(after, after[1:])]
    assert len(spans) > 3 and max(spans) <= 2 * 40  # the rest is split as before


def test_stage_bounds_fall_between_layers():
    graph = synthetic.residual_net(6)
    info = GraphInfo.of(graph)
    bounds = stage_bounds(info, list(range(info.n + 1)), stage_nodes=40)
    inner = [info.names[b - 1] for b in bounds[1:-1]]
    assert inner and all(name.endswith(("res1", "res2")) for name in inner), inner


def signatures(graph) -> list[tuple]:
    return stage_signatures(GraphInfo.of(graph))


def test_identical_layers_are_solved_once():
    """NOTE [ Identical stages are solved once ]: a stack of identical layers has a handful of
    distinct stages (first, last, the repeated ones), and reusing their tables gives the
    plan of solving every stage."""
    graph = synthetic.residual_net(12, same_layers=True)
    keys = signatures(graph)
    assert len(keys) > 20 and len(set(keys)) <= 5
    assert len(set(signatures(synthetic.residual_net(12)))) == len(keys)  # layers differ
    info = GraphInfo.of(graph)
    for fraction in (0.5, 0.3):
        budget = int(fraction * naive_peak(graph))
        reused = staged_plan(info, budget, nested=False)
        assert reused == staged_plan(info, budget, nested=False, reuse=False)
        assert simulate(graph, reused, info=info, check=True).peak_bytes <= budget


@pytest.mark.parametrize(
    ("graph", "stage_nodes"),
    [
        (synthetic.residual_net(6, same_layers=True, ops_per_layer=30), 20),
        (synthetic.encoder_decoder_net(6), 40),  # values read by every block of a side
        (synthetic.random_dag(60, seed=3, skip_prob=0.3, max_skip=6), 8),
    ],
    ids=["stack", "encoder-decoder", "random-dag"],
)
def test_stage_reuse_gives_the_plans_of_solving_every_stage(graph, stage_nodes):
    info = GraphInfo.of(graph)
    for fraction in (0.8, 0.6, 0.45):
        budget = int(fraction * naive_peak(graph))
        kwargs = dict(nested=False, stage_nodes=stage_nodes)
        assert staged_plan(info, budget, **kwargs) == staged_plan(
            info, budget, reuse=False, **kwargs
        )


def test_stage_signature_tells_apart_what_changes_a_table():
    """Twin stages of a stack of identical layers stop sharing a signature when one of them
    differs in FLOPs, in bytes, or in a value that crosses into it from far before."""
    keys = signatures(synthetic.residual_net(8, same_layers=True))
    twin = next(j for j in range(3, len(keys)) if keys[j] == keys[j - 2])  # period 2 stages

    def changed(edit) -> list[tuple]:
        graph = synthetic.residual_net(8, same_layers=True)
        info = GraphInfo.of(graph)
        bounds = stage_bounds(info, window_cuts(info), 40)
        edit(graph, bounds[twin] + 5)  # a node inside stage `twin`
        return signatures(graph)

    def flops(graph, k):
        graph.nodes[k].flops += 1.0

    def nbytes(graph, k):
        graph.nodes[k].output_bytes += 4

    def skip(graph, k):  # node k also reads the first layer norm's output
        node = graph.nodes[k]
        node.inputs = (*node.inputs, graph.nodes[1].name)

    for edit in (flops, nbytes, skip):
        edited = changed(edit)
        assert edited[twin] != edited[twin - 2], edit.__name__


def test_allocation_spends_memory_where_it_saves_most():
    # two stages, each: keep 6 bytes for free, or keep 2 bytes for a recompute cost
    cheap = [StageOption(6, 6, 0.0, 0, 0), StageOption(6, 2, 10.0, 0, 0)]
    dear = [StageOption(6, 6, 0.0, 0, 0), StageOption(6, 2, 50.0, 0, 0)]
    # budget 10: stage 1 keeps k1, stage 2 needs 6 on top: only (2, any) fits -> k1 = 2
    assert _allocate([cheap, dear], 10, 10) == [1, 0]
    assert _allocate([dear, cheap], 10, 10) == [1, 0]
    # budget 8 after both keep: both must keep little
    assert _allocate([cheap, dear], 7, 7) is None
    assert _allocate([cheap, dear], 12, 12) == [0, 0]


SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    graph=st.builds(
        synthetic.random_dag,
        n=st.integers(16, 40),
        seed=st.integers(0, 10**6),
        skip_prob=st.sampled_from([0.0, 0.3]),
        max_skip=st.integers(1, 4),
        alias_prob=st.sampled_from([0.0, 0.2]),
        refinements=st.booleans(),
    ),
    fraction=st.floats(0.4, 0.95),
)
def test_staged_plans_fit_and_validate(graph, fraction):
    budget = int(fraction * naive_peak(graph))
    info = GraphInfo.of(graph)
    segments = staged_plan(info, budget, nested=False, stage_nodes=8)
    if segments is None:
        return
    # tiles; every value a node reads is live at every event (the plan can run)
    simulate(graph, segments, info=info, check=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(entry, "STAGED", "always")
        try:
            p = optimal_plan(graph, budget, info=info)
        except hbp.BudgetError:
            return
    validate_plan(graph, p)  # within its budget, prediction = simulation


class Stack(nn.Module):
    def __init__(self, depth=16, width=48):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 2 * width),
                nn.GELU(),
                nn.Linear(2 * width, width),
            )
            for _ in range(depth)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_staged_plan_executes_with_exact_gradients(always_staged):
    """HCModule plans a 16-layer stack in stages and runs it: same gradients bitwise."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(64, 48)
    reference = [p.detach().clone() for p in model.parameters()]
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    hc = hbp.HCModule(model, budget=0.75)
    out = hc(x)
    out.square().sum().backward()
    assert hc.plan.meta["solved_by"] == "staged"
    assert any(s.recompute for s in hc.plan.segments)
    for p, r, g in zip(model.parameters(), reference, expected, strict=True):
        assert torch.equal(p.detach(), r)
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_stages_plan_below_the_whole_graph_minimum():
    """The stages' fine cuts can reach less than the whole graph's candidate cuts (fourth
    trial: a ControlNet beside a frozen UNet, 3.19 MiB staged under a whole-graph minimum of
    3.40, where a budget between them raised). Here the whole graph gets 8 candidate cuts."""
    from hbp.errors import BudgetError
    from hbp.planner import min_feasible_peak

    graph = synthetic.residual_net(8, same_layers=True)
    whole, _ = min_feasible_peak(graph, max_cuts=8, staged="never")
    budget = (whole + min_feasible_peak(graph, staged="never")[0]) // 2
    plan = optimal_plan(graph, budget, max_cuts=8)
    # the whole graph's least peak, or the floor under it that proved it above the budget
    # (NOTE [ A floor under the least peak ])
    below = plan.meta.get("whole_graph_minimum", plan.meta.get("whole_graph_floor"))
    assert plan.meta["solved_by"] == "staged" and budget < below <= whole
    assert simulate(graph, plan.segments).peak_bytes == plan.predicted_peak_bytes <= budget
    validate_plan(graph, plan)
    # below what anything reaches: the error's minimum is a staged plan's peak, and fits
    with pytest.raises(BudgetError, match="less in stages") as err:
        optimal_plan(graph, budget // 8, max_cuts=8)
    assert err.value.minimum < budget
    assert optimal_plan(graph, err.value.minimum, max_cuts=8).predicted_peak_bytes <= (
        err.value.minimum
    )
    # "min" is that same least budget: the whole graph's and the stages' least, not the
    # whole graph's alone
    least, segments = min_feasible_peak(graph, max_cuts=8)
    assert least == err.value.minimum < whole
    assert simulate(graph, segments).peak_bytes <= least


def test_budget_below_the_stages_reach_raises_without_the_recompute_tables(monkeypatch):
    """A budget below the stages' least budget and the whole graph's least peak is decided by
    the least peaks alone (NOTE [ A budget below the stages' reach ]): no recompute table is
    built, and the error is the one the tables' path gives (its minimum plans and fits)."""
    from hbp.errors import BudgetError
    from hbp.planner import min_feasible_peak
    from hbp.planner.dp.least_peak import forget_least_peaks

    graph = synthetic.residual_net(12)
    least = min_feasible_peak(graph)[0]
    forget_least_peaks()
    solved = []
    solve = entry._solve
    monkeypatch.setattr(entry, "_solve", lambda *a, **k: solved.append(a) or solve(*a, **k))
    with pytest.raises(BudgetError) as err:
        optimal_plan(graph, least * 3 // 4)
    assert solved == []
    assert err.value.minimum == least
    plan = optimal_plan(graph, err.value.minimum)
    assert simulate(graph, plan.segments).peak_bytes <= err.value.minimum


def test_a_bound_between_the_stages_two_least_budgets_is_searched_just_below(monkeypatch):
    """Where the bound (the whole graph's floor) lies between the budget below which the stages
    surely find nothing and the one at which they surely allocate, a staged plan is looked for
    just below the bound (NOTE [ Just below the bound ]): found there, it is the least budget,
    and the whole graph's least-peak DP does not run."""
    from hbp.planner import min_feasible_peak
    from hbp.planner.dp import staged_search
    from hbp.planner.stages import least_staged_budget, stage_tables_kept

    graph = synthetic.residual_net(8, same_layers=True)
    info = GraphInfo.of(graph)
    with stage_tables_kept(info):
        below, least = least_staged_budget(info, nested=False)
        bound = (below + least) // 2
        found = staged_search.staged_below(graph, info, None, bound)
        assert found is not None and below <= found[0] < bound
        assert found[1][1].peak_bytes <= found[0]
        assert staged_search.staged_minimum(graph, info, None, bound)[0] == found[0]
    monkeypatch.setattr(entry, "union_floor", lambda *a: bound)
    ran = []
    monkeypatch.setattr(entry, "least_peak_over", lambda *a: ran.append(a))
    budget, segments = min_feasible_peak(graph)
    assert ran == [] and budget == found[0]
    assert simulate(graph, segments).peak_bytes <= budget
    assert optimal_plan(graph, budget).predicted_peak_bytes <= budget


def test_a_stage_without_options_means_no_staged_plan(monkeypatch):
    """A stage whose table is infinite within its memory axis has no option (seen on
    transformers' RWKV before its loop was kept whole): no staged plan exists, which the
    least staged budget says (`NO_STAGED_PLAN`) instead of failing on an empty stage."""
    from hbp.planner import stages

    info = GraphInfo.of(synthetic.residual_net(12))
    real = stages._tables(info, stages._settings(40, 6, 32, 128, False, 4, True, None))
    emptied = (*real[:3], [real[3][0], [], *real[3][2:]])
    monkeypatch.setattr(stages, "_tables", lambda info, settings: emptied)
    assert stages.least_staged_budget(info, nested=False) == (
        stages.NO_STAGED_PLAN,
        stages.NO_STAGED_PLAN,
    )
    assert stages._allocate(emptied[3], 2**40, 64) is None


def test_rwkv_trains_exactly_within_its_budget():
    """transformers' RWKV on CPU writes each step of its recurrence into a slice of a buffer
    (NOTE [ A write into a view reaches backward through its base ]): from 16 tokens every
    budget raised ValueError in the stages, and the plain step measured a third above its
    prediction. Now: plain autograd's gradients, the allocator's peak within the budget."""
    import copy

    from transformers import RwkvConfig, RwkvForCausalLM

    from hbp.allocator import allocator_peak

    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=256,
        hidden_size=32,
        attention_hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        context_length=64,
    )
    model = RwkvForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 16))
    plain = copy.deepcopy(model)
    plain(input_ids=ids, labels=ids).loss.backward()
    hc = hbp.HCModule(model, budget=0.6)
    hc(input_ids=ids, labels=ids).loss.backward()
    assert hc.captured.granularity == "op"
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    model.zero_grad(set_to_none=True)
    _, peak = allocator_peak(lambda: hc(input_ids=ids, labels=ids).loss.backward())
    assert peak <= hc.budget_bytes
    assert any(s.recompute for s in hc.plan.segments)


def test_a_decoders_least_peak_at_the_floor_is_had_without_the_dp():
    """NOTE [ A plan at the floor ]: a 4-layer transformers Llama at batch 1, its captured
    step with the loss the outputs it holds: the chain of recomputed layers reaches the floor
    over the first cut set, so its least peak is had without the least-peak DP, and it is
    the DP's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hbp.graph.torch.capture import capture
    from hbp.planner.cuts import cut_choices
    from hbp.planner.dp import least_peak as peaks

    config = LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=344,
        vocab_size=2048, num_hidden_layers=4, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 128))
    graph = capture(LlamaForCausalLM(config), (ids,), {"labels": ids, "use_cache": False}).graph
    graph.held_outputs = sorted(graph.backward_seeds(), key=graph.index)  # as HCModule
    info = GraphInfo.of(graph)
    cuts = cut_choices(info)[0]
    peaks.forget_least_peaks()
    value = peaks.least_peak_value(info, cuts, True)
    assert ("value", tuple(cuts), True) in peaks._remembered(info)  # no DP ran
    assert (tuple(cuts), True) not in peaks._remembered(info)
    peaks.forget_least_peaks()
    assert value == peaks.least_peak_cached(info, cuts, True)[0]
