"""The plan executor (hbp.runtime.executors.segments) on hand-made plans: exact outputs and gradients,
recomputation that really happens (and only where planned), memory equal to the simulator's
prediction (measured with the live-storage tracker), BatchNorm statistics and other buffers
updated once, in-place mutation of segment inputs, and the module-level fallback."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hbp.analysis.simulate import simulate
from hbp.errors import CaptureWarning
from hbp.graph.torch.capture import capture
from hbp.planner.plan import Plan, Segment
from hbp.runtime.executors import make_executor
from hbp.runtime.executors.module_calls import ModuleCallExecutor, per_call_plan
from hbp.runtime.executors.segments import PlanExecutor
from hbp.runtime.tracker import MemoryTracker

D, T, NB = 32, 16, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).split(D, dim=-1)
        heads = [t.view(x.shape[0], T, 4, D // 4).transpose(1, 2) for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(x.shape)))
        return x + self.drop(self.mlp(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(NB))
        self.head = nn.Linear(D, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def block_cuts(captured):
    names = [n.name for n in captured.graph.nodes]
    return [names.index(f"blocks_{i}_ln") for i in range(NB)] + [names.index("head")]


def run_step(fn, params):
    """One step under the tracker: (loss, parameter gradients, peak bytes). The output stays
    referenced during backward, as the simulator assumes for graph outputs."""
    for p in params:
        p.grad = None
    torch.manual_seed(7)
    with MemoryTracker(record_timeline=False) as tracker:
        out = fn()
        loss = out if out.dim() == 0 else out.sum()
        loss.backward()
    return loss.detach(), [p.grad for p in params], tracker.peak_bytes


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(16, T, D, requires_grad=True)  # activations well above parameter grads
    return model, x, capture(model, (x,))


def plans_for(captured):
    n = len(captured.graph)
    c = block_cuts(captured)
    return {
        "naive": Plan([Segment(0, n)]),
        "per_block": Plan(
            [Segment(0, c[0])]
            + [Segment(c[i], c[i + 1], True) for i in range(NB)]
            + [Segment(c[NB], n)]
        ),
        "nested": Plan(
            [
                Segment(0, c[0]),
                Segment(c[0], c[2], True, [Segment(c[0], c[1], True), Segment(c[1], c[2], True)]),
                Segment(c[2], c[4], True, [Segment(c[2], c[3]), Segment(c[3], c[4], True)]),
                Segment(c[4], n),
            ]
        ),
    }


@pytest.mark.parametrize("plan_name", ["naive", "per_block", "nested"])
def test_plans_give_bitwise_equal_results_and_the_predicted_peak(stack, plan_name):
    model, x, captured = stack
    params = [x, *model.parameters()]
    loss, grads, plain_peak = run_step(lambda: model(x), params)
    plan = plans_for(captured)[plan_name]
    executor = PlanExecutor(captured, plan, model)
    loss2, grads2, peak = run_step(lambda: executor(x), params)
    assert torch.equal(loss, loss2)  # dropout draws the same masks, recomputed or not
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    # the live-storage tracker counts tensors, not the generator states checkpoints keep
    # (made outside the dispatcher): compared without them
    tensors = replace(captured.graph, rng_state_bytes=0)
    predicted = simulate(tensors, plan).peak_bytes
    assert abs(peak - predicted) <= 0.01 * predicted, (peak, predicted)
    if plan_name == "naive":
        assert peak == plain_peak  # the executor keeps nothing the plain model would not
    else:
        assert peak < 0.6 * plain_peak


def test_recomputation_runs_exactly_the_recomputed_nodes_once_more(stack):
    model, x, captured = stack
    plan = plans_for(captured)["nested"]
    runs: dict[str, int] = {}
    executor = PlanExecutor(
        captured, plan, model, node_hook=lambda name: runs.__setitem__(name, runs.get(name, 0) + 1)
    )
    executor(x).backward()
    c = block_cuts(captured)
    names = [n.name for n in captured.graph.nodes]
    # [c0, c2) = two recomputed children. Its recompute runs block 0 (a nested checkpoint's
    # forward) and stops on entering block 1 (non-reentrant early stop: block 1's inputs were
    # the last thing to save); each child then recomputes itself. Block 0: 3 runs, block 1: 2.
    # [c2, c4) = plain block 2 + recomputed block 3: block 2 runs twice, block 3 twice.
    assert [runs[names[i]] for i in c[:4]] == [3, 2, 2, 2]
    assert runs["head"] == 1 and "x" not in runs  # plain nodes once, graph inputs never


def test_global_module_hooks_see_the_users_modules_and_not_the_generated_code(stack):
    """NOTE [ Calling the generated code ]: a global forward hook fires for the model's own
    modules, as many times as they run (recomputes included), and never for hbp's segments."""
    model, x, captured = stack
    executor = PlanExecutor(captured, plans_for(captured)["nested"], model)
    seen: list[nn.Module] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(m))
    try:
        executor(x).backward()
    finally:
        handle.remove()
    assert seen and all(not isinstance(m, torch.fx.GraphModule) for m in seen)
    assert {id(m) for m in seen} <= {id(m) for m in model.modules()}


def test_recomputed_values_die_as_soon_as_the_recompute_has_used_them():
    """A long recomputed segment followed by a plain one: during the recompute, values the
    segment hands to later segments must not be kept (the recompute pass needs none)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])
    x = torch.randn(32, 64, requires_grad=True)
    captured = capture(model, (x,))
    n = len(captured.graph)
    for cut in range(3, n - 1, 4):
        plan = Plan([Segment(0, cut, True), Segment(cut, n)])
        executor = PlanExecutor(captured, plan, model)
        _, _, peak = run_step(lambda ex=executor: ex(x), [x, *model.parameters()])
        assert peak == simulate(captured.graph, plan).peak_bytes + 8, cut  # + loss, its grad


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        )
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True)
        )
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.body(h)
        return self.fc(h.mean((2, 3)))


def test_batchnorm_statistics_update_once_per_step_with_recompute():
    torch.manual_seed(0)
    model, reference = ConvBN(), ConvBN()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 8, 8)
    captured = capture(model, (x,))
    n = len(captured.graph)
    plan = Plan([Segment(0, n // 2, True), Segment(n // 2, n - 1, True), Segment(n - 1, n)])
    out = PlanExecutor(captured, plan, model)(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()
    assert torch.equal(out, expected)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name  # running_mean/var and num_batches_tracked: once
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


class Counter(nn.Module):
    """Updates a buffer in place in its own forward code (not a norm layer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.tanh(self.fc(x))


def test_other_buffers_updated_in_place_are_not_updated_again_by_the_recompute():
    model = nn.Sequential(Counter(), Counter())
    x = torch.randn(3, D, requires_grad=True)
    captured = capture(model, (x,))
    assert set(captured.mutated_attrs) == {"add_", "add__1"}
    plan = Plan([Segment(0, len(captured.graph), True)])
    PlanExecutor(captured, plan, model)(x).sum().backward()
    assert [m.calls.item() for m in model] == [1.0, 1.0]


class MutatesView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.fc1(x)
        alias = h[:1]  # another view of h, read after the in-place op: it must stay in place
        h.mul_(2.0)
        return self.fc2(h).sum() + alias.sum()


class MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        x.mul_(2.0)  # a graph input: never made out of place
        return self.fc2(torch.tanh(self.fc1(x))).sum()


def test_segment_input_mutated_in_place_is_recomputed_from_its_original_value():
    torch.manual_seed(0)
    model = MutatesInput()
    x = torch.randn(3, D)
    captured = capture(model, (x,))
    assert captured.mutated_inputs == {"mul_": ("x",)}
    plan = Plan([Segment(0, 1), Segment(1, len(captured.graph), True)])
    executor = PlanExecutor(captured, plan, model)
    assert executor.blocks[0].cloned == (0,)  # cloned inside the checkpoint
    params = list(model.parameters())
    got = run_step(lambda: executor(x), params)
    assert torch.equal(x, x)  # (the caller's tensor is left as it was: the clone was mutated)
    expected = run_step(lambda: model(x.clone()), params)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))


def test_mutating_a_value_another_live_view_shares_is_refused():
    model = MutatesView()
    captured = capture(model, (torch.randn(3, D, requires_grad=True),))
    assert "mul_" in captured.mutated_inputs  # not made out of place: `alias` sees the change
    cut = [n.name for n in captured.graph.nodes].index("mul_")
    plan = Plan([Segment(0, cut), Segment(cut, len(captured.graph), True)])
    with pytest.raises(NotImplementedError, match="view of the same storage"):
        PlanExecutor(captured, plan, model)


class KwargsDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)

    def forward(self, x, *, mask=None, scale=1.0):
        h = torch.relu(self.fc(x)) * scale
        if mask is not None:
            h = h * mask
        return {"out": self.gate(h), "aux": (h.mean(), [h.amax()])}


def test_kwargs_and_nested_dict_outputs():
    torch.manual_seed(0)
    model = KwargsDict()
    x, mask = torch.randn(4, D, requires_grad=True), torch.rand(4, D)
    captured = capture(model, (x,), {"mask": mask, "scale": 0.5})
    n = len(captured.graph)
    executor = PlanExecutor(captured, Plan([Segment(0, n // 2, True), Segment(n // 2, n)]), model)
    got, expected = executor(x, mask=mask, scale=0.5), model(x, mask=mask, scale=0.5)
    assert set(got) == {"out", "aux"} and isinstance(got["aux"][1], list)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    ):
        assert torch.equal(a, b)


class CountingTanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return torch.tanh(x)


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Sequential(nn.Linear(D, D), CountingTanh()) for _ in range(3))

    def forward(self, x):
        h = self.a(x)
        if h.mean() > 10:  # data-dependent
            h = h * 0
        return self.c(self.b(h)).sum()


def test_module_level_fallback_checkpoints_the_planned_child_calls():
    torch.manual_seed(0)
    model = Gated()
    x = torch.randn(8, D, requires_grad=True)
    with pytest.warns(CaptureWarning):
        captured = capture(model, (x,))
    assert captured.module_calls == [(f"{m}.{i}", 0) for m in "abc" for i in (0, 1)]
    assert [g[:4] for g in captured.module_groups] == [
        ("a", 0, 1, 3),
        ("b", 0, 3, 5),
        ("c", 0, 5, 7),
    ]
    # [1, 6) covers the Sequential calls a and b (checkpointed as wholes) and c's first child
    plan = per_call_plan(Plan([Segment(0, 1), Segment(1, 6, True), Segment(6, 7)]), captured)
    assert [(s.start, s.stop, s.recompute) for s in plan.segments] == [
        (0, 1, False), (1, 3, True), (3, 5, True), (5, 6, True), (6, 7, False)
    ]  # fmt: skip
    executor = make_executor(captured, plan, model)
    assert isinstance(executor, ModuleCallExecutor)
    assert [(u.key, u.children) for u in executor.units] == [
        (("a", 0), None), (("b", 0), None), (("c", 0), (0, 1))
    ]  # fmt: skip
    params = [x, *model.parameters()]
    expected = run_step(lambda: model(x), params)
    for m in (model.a, model.b, model.c):
        m[1].runs = 0
    got = run_step(lambda: executor(x), params)
    # a and b ran again in backward (their tanh saves its output: it runs again); c's run of
    # one Linear saves only its input, which non-reentrant checkpoint's early stop recovers
    # before running the matmul again, and c's tanh is not checkpointed.
    assert [model.a[1].runs, model.b[1].runs, model.c[1].runs] == [2, 2, 1]
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    assert "forward" not in model.b.__dict__ and "forward" not in model.c.__dict__  # unpatched


def test_module_level_fallback_checkpoints_runs_inside_nested_sequentials():
    """A segment that covers parts of two nested Sequential calls is checkpointed as two runs
    of children (no code runs between a Sequential's children), and the step matches."""
    torch.manual_seed(0)
    body = nn.Sequential(
        *[nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(3)]
    )

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x):
            return self.body(-x if x.sum() > 0 else x)  # data-dependent: module level

    net = Net()
    x = torch.randn(16, D, requires_grad=True)
    with pytest.warns(CaptureWarning):
        captured = capture(net, (x,))
    assert len(captured.graph) == 10
    plan = per_call_plan(Plan([Segment(0, 2), Segment(2, 6, True), Segment(6, 10)]), captured)
    assert [(s.start, s.stop, s.recompute) for s in plan.segments] == [
        (0, 2, False), (2, 4, True), (4, 6, True), (6, 10, False)
    ]  # fmt: skip
    executor = make_executor(captured, plan, net)
    assert [(u.key, u.children) for u in executor.units] == [
        (("body.0", 0), (1, 3)), (("body.1", 0), (0, 2))
    ]  # fmt: skip
    params = [x, *net.parameters()]
    expected = run_step(lambda: net(x), params)
    got = run_step(lambda: executor(x), params)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
    # The module-level graph knows the child calls, not the glue code around them (`-x`, an
    # input-sized tensor alive during the step): predicted up to that, + the loss and its grad.
    assert got[2] == simulate(captured.graph, plan).peak_bytes + x.numel() * 4 + 8


class RandomNet(nn.Module):
    """Attention without dropout (dropout_p 0: no random numbers), Linear + tanh + dropout."""

    def __init__(self, p):
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.p = p

    def forward(self, x):
        q = k = v = x.view(4, 2, T, D)
        x = x + F.scaled_dot_product_attention(q, k, v).view(x.shape)
        for lin in self.lin:
            x = F.dropout(torch.tanh(lin(x)), self.p, self.training)
        return x.square().mean()


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_only_segments_that_draw_random_numbers_keep_a_random_state(p):
    """NOTE [ Random state of recomputed segments ]: the capture marks the nodes that draw
    random numbers; a recomputed segment without one keeps no copy of the generator's state
    (on CPU a 5 KB tensor per checkpoint), one with dropout replays the same masks."""
    from hbp.allocator import allocator_peak

    random = p > 0
    torch.manual_seed(0)
    model, x = RandomNet(p), torch.randn(8, T, D)
    captured = capture(model, (x,))
    flagged = {n.name for n in captured.graph.nodes if n.draws_random}
    assert flagged == ({f"dropout{s}" for s in ("", "_1", "_2", "_3")} if random else set())
    n = len(captured.graph)
    nested = Segment(1, n - 1, True, [Segment(1, n // 2, True), Segment(n // 2, n - 1)])
    executor = PlanExecutor(captured, Plan([Segment(0, 1), nested, Segment(n - 1, n)]), model)
    assert [b.draws_random for b in executor.blocks] == [random, False]
    params = list(model.parameters())
    loss, grads, _ = run_step(lambda: model(x), params)
    loss2, grads2, _ = run_step(lambda: executor(x), params)
    assert torch.equal(loss, loss2) and all(map(torch.equal, grads, grads2))
    torch.manual_seed(7)
    for q in params:
        q.grad = None
    _, peak = allocator_peak(lambda: executor(x).backward())
    predicted = simulate(captured.graph, executor.plan).peak_bytes
    # the step holds the simulated bytes (to a scalar's few bytes), the generator states the
    # checkpoint of the random segment keeps included
    assert captured.graph.rng_state_bytes == torch.get_rng_state().numel()
    assert 0 <= peak - predicted <= 8, (peak, predicted)
    without_states = simulate(replace(captured.graph, rng_state_bytes=0), executor.plan)
    assert (without_states.peak_bytes < predicted) == random
