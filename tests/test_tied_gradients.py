"""A parameter used twice (a tied output head and input embedding) gets two gradient
contributions, summed before `.grad` is set: the prediction follows autograd's in-place or
out-of-place sum (NOTE [ Gradients of a parameter used twice ] in hbp/graph/torch/profile.py)
and matches the allocator, for the plain step and for a plan that recomputes."""

from __future__ import annotations

import pytest
import torch

import hbp
from hbp.allocator import allocator_peak
from hbp.analysis import simulate
from hbp.graph.torch.capture import OP, capture
from tests.models.capture import TiedLM, moonshine


def _step(module, model, kwargs, loss_of):
    def step():
        for p in model.parameters():
            p.grad = None
        loss_of(module(**kwargs)).backward()

    step()  # capture, plan, first-call set-up
    for p in model.parameters():
        p.grad = None
    return allocator_peak(step)[1]


@pytest.mark.parametrize("head_first", [False, True], ids=["sum-out-of-place", "sum-in-place"])
def test_a_tied_heads_plain_step_is_predicted_to_the_allocators_bytes(head_first):
    torch.manual_seed(0)
    model = TiedLM(head_first=head_first)
    kwargs = {"ids": torch.randint(0, 2048, (2, 8)), "labels": torch.randint(0, 2048, (2, 8))}
    captured = capture(model, (), kwargs)
    assert captured.granularity == OP
    predicted = simulate(captured.graph).peak_bytes
    measured = _step(model, model, kwargs, lambda loss: loss)
    assert predicted == pytest.approx(measured, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1.0, "min"])
def test_a_tied_head_encoder_decoder_is_predicted_within_one_percent(budget):
    """Moonshine (tied `proj_out` and decoder embedding): naive and planned peaks."""
    torch.manual_seed(0)
    model, inputs = moonshine()
    assert model.proj_out.weight is model.model.decoder.embed_tokens.weight
    hc = hbp.HCModule(model, budget=budget)
    measured = _step(hc, model, inputs, lambda out: out.loss)
    assert hc.captured.granularity == OP
    assert hc.plan.predicted_peak_bytes == pytest.approx(measured, rel=0.01)
