"""Graph breaks: a model with data-dependent ops (boolean-mask indexing, `nonzero`,
`masked_select`, CTC's loss) is captured at operator level around them, each such op one node
measured on the example's real values (NOTE [ Data-dependent ops ] in
hbp/graph/torch/breaks.py): gradients equal plain autograd's bitwise, the allocator's peak is
the plan's, and a wav2vec2-BERT CTC model goes below transformers' own checkpointing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.graph.torch.capture import OP, capture
from tests.models.capture import MaskedMiddle, wav2vec2_bert_ctc


def _step(module, model, kwargs, loss_of):
    """(allocator peak, parameter gradients) of one step after a warm-up step (capture,
    plan, first-call set-up); the measured step's RNG seeded."""

    def step():
        for p in model.parameters():
            p.grad = None
        loss_of(module(**kwargs)).backward()

    step()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    peak = allocator_peak(step)[1]
    return peak, {n: p.grad for n, p in model.named_parameters()}


def _assert_same(grads, plain):
    assert grads.keys() == plain.keys()
    for name, g in plain.items():
        assert g is not None and torch.equal(grads[name], g), name


def test_a_boolean_mask_and_nonzero_are_captured_at_operator_level():
    torch.manual_seed(0)
    captured = capture(MaskedMiddle(), (torch.randn(512, 64),))
    assert captured.granularity == OP
    ops = [n.op for n in captured.graph.nodes]
    assert "getitem" in ops and "nonzero" in ops
    # the mask keeps a data-dependent number of rows: the node's size is the example's
    x = torch.randn(512, 64)
    model = MaskedMiddle()
    kept = int((model.first(x).sum(-1) > 0).sum())
    captured = capture(model, (x,))
    mask = next(n for n in captured.graph.nodes if n.op == "getitem")
    assert mask.output_bytes == kept * 64 * 4


@pytest.mark.parametrize("budget", [1.0, 0.6, "min"])
def test_a_model_with_a_graph_break_is_planned_within_its_budget(budget):
    torch.manual_seed(0)
    model = MaskedMiddle()
    inputs = {"x": torch.randn(512, 64)}
    twin = copy.deepcopy(model)
    _, plain = _step(twin, twin, inputs, lambda loss: loss)
    hc = hbp.HCModule(model, budget=budget)
    peak, grads = _step(hc, model, inputs, lambda loss: loss)
    assert hc.captured.granularity == OP
    _assert_same(grads, plain)
    assert peak <= hc.plan.budget_bytes * 1.01
    assert hc.plan.predicted_peak_bytes == pytest.approx(peak, rel=0.01)


class _Checked(nn.Module):
    """An input check on data (`if ...: raise`), as transformers' CTC heads check labels."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        if (x.abs() > 100).any():
            raise ValueError("inputs must be below 100")
        return self.body(x).sum()


def test_a_data_check_becomes_a_guard_and_a_failed_guard_runs_the_plain_forward():
    """As Dynamo on a failed guard: the step that fails it runs the module's own forward, so
    the caller sees the model's own error, with a warning once; the plan stays."""
    model = _Checked()
    hc = hbp.HCModule(model, budget=1.0)
    x = torch.randn(4, 8)
    hc(x).backward()
    assert hc.captured.granularity == OP
    assert "guard" in {n.op for n in hc.captured.graph.nodes}
    plan = hc.plan
    with pytest.warns(UserWarning, match="branches on tensor data"):
        with pytest.raises(ValueError, match="below 100"):  # the plain forward's own error
            hc(x * 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        with pytest.raises(ValueError, match="below 100"):
            hc(x * 1000)
        hc(x).backward()  # data that keeps the guard: the plan, as before
    assert hc.plan is plan


class _Clamped(nn.Module):
    """A check whose error the model catches itself: the other branch computes."""

    def __init__(self):
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Tanh())
        self.norm = nn.BatchNorm1d(8)
        self.last = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.norm(self.first(x))
        try:
            if (h.abs() > 0.5).any():
                raise ValueError("out of range")
        except ValueError:
            h = h.clamp(-0.5, 0.5)
        return self.last(h).square().sum()


def test_a_step_that_fails_a_guard_has_plain_autograd_gradients_and_statistics():
    torch.manual_seed(0)
    model = _Clamped().train()
    small = torch.full((16, 8), 1e-4)  # keeps every |h| below 0.5: the example's branch
    with torch.no_grad():
        model.norm.weight.fill_(0.1)
    twin = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget="min")
    hc(small).backward()
    assert "guard" in {n.op for n in hc.captured.graph.nodes}
    with torch.no_grad():
        model.norm.weight.fill_(2.0)
        twin.norm.weight.fill_(2.0)
    x = torch.randn(16, 8) * 10
    for m in (model, twin):
        m.zero_grad(set_to_none=True)
    twin.load_state_dict(model.state_dict())
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="own forward"):
        hc(x).backward()  # the guard fails: the plain forward, from the same RNG state
    torch.manual_seed(3)
    twin(x).backward()
    _assert_same(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in twin.named_parameters()},
    )
    for (name, a), b in zip(model.named_buffers(), twin.buffers()):
        assert torch.equal(a, b), name  # running statistics updated once


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x):
        h = self.body(x)
        if h.sum() > 0:  # both sides run: no guard can stand in for the branch
            h = h * 2
        return h.sum()


def test_a_branch_on_data_that_does_not_raise_is_not_guarded():
    with pytest.warns(hbp.errors.CaptureWarning, match="module-level"):
        captured = capture(_Branchy(), (torch.randn(4, 8),))
    assert captured.granularity != OP


def _checkpointing_peak(model, inputs) -> int:
    model = copy.deepcopy(model)
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    return _step(model, model, inputs, lambda out: out.loss)[0]


@pytest.mark.slow
def test_a_ctc_model_is_captured_around_its_data_dependent_ops_below_transformers_peak():
    torch.manual_seed(0)
    model, inputs = wav2vec2_bert_ctc()
    model.train()
    twin = copy.deepcopy(model)
    _, plain = _step(twin, twin, inputs, lambda out: out.loss)
    library = _checkpointing_peak(model, inputs)
    hc = hbp.HCModule(model, budget="min")
    peak, grads = _step(hc, model, inputs, lambda out: out.loss)
    assert hc.captured.granularity == OP
    ops = {n.op for n in hc.captured.graph.nodes}
    assert {"Tensor.masked_select", "ctc_loss", "guard"} <= ops, ops
    _assert_same(grads, plain)
    assert peak < library
    assert hc.plan.predicted_peak_bytes == pytest.approx(peak, rel=0.01)
    labels = inputs["labels"].clone()
    labels[0, 0] = 10_000  # out of the vocabulary: the library's check fails
    with pytest.warns(UserWarning, match="own forward"), pytest.raises(ValueError):
        hc(**{**inputs, "labels": labels})  # the plain forward's own error


class _InPlaceOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x):
        x.neg_()  # the caller's tensor, changed once per call; the mask reads the change
        return self.body(x[x.sum(-1) > 0]).sum()


def test_the_real_run_of_a_graph_break_follows_in_place_ops_and_leaves_the_inputs_alone():
    x = torch.ones(16, 8)
    x[:3] = -1  # negated: 3 rows kept (13 before)
    before = x.clone()
    captured = capture(_InPlaceOnInput(), (x,))
    assert captured.granularity == OP
    assert torch.equal(x, before)
    mask = next(n for n in captured.graph.nodes if n.op == "getitem")
    assert mask.output_bytes == 3 * 8 * 4
