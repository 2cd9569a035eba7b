"""A custom `torch.autograd.Function` in a captured forward keeps its own backward
(NOTE [ Custom autograd Functions ] in hbp/graph/torch/trace.py).

Found on BLOOM (`python experiments/real_models/run.py bloom`): BLOOM's MLP applies
`GeLUFunction`; the symbolic trace went into its forward, which `apply` runs with grad mode
off, so the MLP's first Linear and the norm before it got no gradient at all, silently (and
the memory of that branch was not counted: 1.066x the budget at "min"). Under torch.export,
a Function's forward ops are recorded and its backward dropped: a straight-through estimator
got round()'s zero gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import CaptureWarning


class _StraightThrough(torch.autograd.Function):
    """Quantise in the forward, pass the gradient through unchanged in the backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _SavingGelu(torch.autograd.Function):
    """A sigmoid GELU that saves its input for a hand-written backward (as BLOOM's)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(1.702 * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(1.702 * x)
        return grad * (s + 1.702 * x * s * (1 - s))


class _Net(nn.Module):
    def __init__(self, d=64, n=4):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(n))
        self.down = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(n))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            x = x + down(_StraightThrough.apply(_SavingGelu.apply(up(x))))
        return x


class _NetTensorCheck(_Net):
    """`torch.is_tensor` on an argument: symbolic tracing fails, the export path runs."""

    def forward(self, x):
        if not torch.is_tensor(x):
            raise TypeError("x must be a tensor")
        return super().forward(x)


def _step(model, runner, x):
    model.zero_grad(set_to_none=True)
    runner(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_symbolic_trace_runs_the_function_and_its_backward():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(128, 64)
    expected = _step(model, model, x)
    hc = hbp.HCModule(model, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        _step(model, hc, x)
    _, peak = allocator_peak(lambda: _step(model, hc, x))
    got = _step(model, hc, x)

    assert hc.captured.tracer == "fx" and hc.captured.granularity == "op"
    ops = [n.op for n in hc.captured.graph.nodes]
    assert ops.count("_StraightThrough_apply") == 4 and ops.count("_SavingGelu_apply") == 4
    _assert_same(got, expected)
    assert peak <= hc.plan.budget_bytes * 1.01, (peak, hc.plan.budget_bytes)


def test_export_refuses_a_function_and_the_fallback_keeps_its_backward():
    torch.manual_seed(0)
    model, x = _NetTensorCheck(), torch.randn(128, 64)
    expected = _step(model, model, x)
    hc = hbp.HCModule(model, budget="min")
    with pytest.warns(CaptureWarning, match="custom autograd Function _SavingGelu"):
        _step(model, hc, x)
    got = _step(model, hc, x)

    assert hc.captured.granularity == "module"
    _assert_same(got, expected)


def test_bloom_gelu_function_gets_every_gradient():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BloomConfig(
        vocab_size=128, hidden_size=32, n_layer=2, n_head=2, hidden_dropout=0.0
    )
    model = transformers.BloomForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 16))

    def step(runner):
        model.zero_grad(set_to_none=True)
        runner(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected = step(model)
    hc = hbp.HCModule(model, budget="min")
    step(hc)
    got = step(hc)

    assert hc.captured.granularity == "op"
    assert "transformer.h.0.mlp.dense_h_to_4h.weight" in got
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


@torch.library.custom_op("hbp_test::straight_through", mutates_args=())
def _straight_through_op(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 4) / 4


@_straight_through_op.register_fake
def _(x):
    return torch.empty_like(x)


_straight_through_op.register_autograd(lambda ctx, grad: grad)


class _NetCustomOp(_NetTensorCheck):
    def forward(self, x):
        if not torch.is_tensor(x):
            raise TypeError("x must be a tensor")
        for up, down in zip(self.up, self.down):
            x = x + down(_straight_through_op(torch.relu(up(x))))
        return x


def test_export_keeps_a_custom_op_whose_autograd_torch_library_generates():
    torch.manual_seed(0)
    model, x = _NetCustomOp(), torch.randn(128, 64)
    expected = _step(model, model, x)
    hc = hbp.HCModule(model, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        _step(model, hc, x)
    got = _step(model, hc, x)

    assert hc.captured.tracer == "export" and hc.captured.granularity == "op"
    _assert_same(got, expected)
