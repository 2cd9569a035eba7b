"""Graph breaks: a model with data-dependent ops (boolean-mask indexing, `nonzero`,
`masked_select`, CTC's loss) is captured at operator level around them, each such op one node
measured on the example's real values (NOTE [ Data-dependent ops ] in
hbp/graph/torch/breaks.py): gradients equal plain autograd's bitwise, the allocator's peak is
the plan's, and a wav2vec2-BERT CTC model goes below transformers' own checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.graph.torch.breaks import GraphBreakGuardError
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


def test_a_data_check_becomes_a_guard_that_raises_when_the_data_fails_it():
    model = _Checked()
    hc = hbp.HCModule(model, budget=1.0)
    x = torch.randn(4, 8)
    hc(x).backward()
    assert hc.captured.granularity == OP
    with pytest.raises(ValueError, match="below 100"):  # the plain forward's own error
        model(x * 1000)
    with pytest.raises(GraphBreakGuardError, match="branches on tensor data"):
        hc(x * 1000)


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
    with pytest.raises(GraphBreakGuardError):
        hc(**{**inputs, "labels": labels})


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
