"""What HCModule captures: models that used to trace badly are captured at operator level
(nn.TransformerEncoder traced through, a tensor unpacked into q, k, v, a model's own
torch.utils.checkpoint calls, wav2vec2's CTC loss), and models no tracer captures (data-dependent
control flow, Python attributes assigned in forward) fall back to module calls with a warning;
either way the step has the plain model's results."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers.compare import (
    assert_all_same,
    assert_within_budget,
    compare,
    run_step,
    step_holding_outputs,
)
from helpers.step import Case, assert_same_step, train_step
from models.cases import CASE, images
from models.real import wav2vec2_ctc
from models.toy import CausalAttention, D, EncoderViT
from models.traits import (
    CountingCalls,
    DataDependentMLP,
    DataDependentNet,
    HostRandomLayerDrop,
    ReshapesInPlace,
    ReshapesInPlaceExported,
    SharedLogNet,
    TorchRandLayerDrop,
)

import hbp
from hbp.errors import BudgetError, CaptureError, CaptureWarning
from hbp.integrations.torch import planning


def test_vit_built_from_nn_transformer_encoder_is_traced_through():
    """torch.nn's TransformerEncoder used to be one leaf node: nothing to cut, the minimum
    budget was the naive peak. Now its layers are traced (33 nodes) and 0.5 fits."""
    hc, plain, got = compare(EncoderViT, (images(),), budget=0.5, block_size=2)
    assert hc.captured.granularity == "op" and len(hc.captured.graph) > 30
    assert_within_budget(hc, got, plain)


def test_causal_sdpa_einsum_and_unpacking_a_tensor_trace_at_op_level():
    """`q, k, v = qkv(x).view(..).permute(..)` iterates a tensor: it used to fail tracing
    (fx Proxy cannot be iterated) and fall back to module level."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        hc, plain, got = compare(CausalAttention, (torch.randn(4, 64, 64),), budget=0.7)
    assert hc.captured.granularity == "op"
    assert_within_budget(hc, got, plain, recomputes=False)
    assert any(s.recompute for s in hc.plan.segments)


def test_a_model_that_checkpoints_itself_is_planned_as_a_whole():
    """Its torch.utils.checkpoint calls are traced through, with a warning; with the plain
    model's own peak as the budget, HCModule fits it with less recompute."""
    torch.manual_seed(0)
    case = CASE["self_checkpointed"]
    model = case.make_model()
    reference = copy.deepcopy(model)
    (x,), _ = case.make_inputs()
    inputs = (x.detach().requires_grad_(),)
    expected = train_step(reference, reference, case, inputs, {}, keep_outputs=True)
    hc = hbp.HCModule(model, budget=expected.peak_bytes, calibrate=False)
    with pytest.warns(UserWarning, match=r"calls torch.utils.checkpoint \(4x\); HCModule traces"):
        got = train_step(hc, model, case, (x,), {}, keep_outputs=True)
    assert_same_step(expected, got)
    assert got.peak_bytes <= expected.peak_bytes
    assert got.flops <= expected.flops


def test_data_dependent_model_falls_back_to_module_level_with_a_warning():
    torch.manual_seed(0)
    model = DataDependentMLP()
    x = torch.randn(256, D, requires_grad=True)
    params = [x, *model.parameters()]
    expected = step_holding_outputs(model, params, x)
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    with pytest.warns(CaptureWarning, match="module-level"):
        got = step_holding_outputs(hc, params, x)
    assert hc.captured.granularity == "module"
    assert_all_same(expected[0], got[0])
    assert_all_same(expected[1], got[1])
    assert got[3] > expected[3]  # child calls were recomputed


@pytest.mark.parametrize("numpy", [False, True], ids=["random", "numpy.random"])
def test_a_forward_drawing_host_random_numbers_trains_as_the_plain_model(numpy):
    """NOTE [ Random numbers drawn on the host ]: a layer drop drawn from Python's `random`
    (or numpy's) was traced once and kept that draw every step; it now falls back to
    module level, draws anew each step as the plain model does, and the capture leaves the
    caller's streams where they were."""
    import random

    import numpy as np

    torch.manual_seed(0)
    model = HostRandomLayerDrop(numpy=numpy)
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, calibrate=False)
    x = torch.randn(64, D)
    losses = []
    for step in range(4):
        pair = []
        for m in (reference, hc):
            random.seed(step)
            np.random.seed(step)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = m(x)
                loss.backward()
            pair.append((loss.item(), random.random(), np.random.rand()))
        assert pair[0] == pair[1], (step, pair)
        losses.append(pair[0][0])
        if step == 0:
            assert any("draws from" in str(w.message) for w in caught)
    assert len(set(losses)) > 1  # the draws differ from step to step
    assert hc.captured.granularity == "module"
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_a_module_level_step_that_calls_layers_the_captured_step_skipped_is_warned():
    """NOTE [ Calls the captured step did not make ]: with a `torch.rand` layer drop the
    module-level plan covers the captured step's layers; a later step that runs others runs
    them outside the plan, with one BudgetWarning naming them. A module-level model whose
    calls repeat (no layer drop) is not warned."""
    torch.manual_seed(1)
    model = TorchRandLayerDrop()
    hc = hbp.HCModule(model, calibrate=False)
    x = torch.randn(64, D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            hc(x).backward()
    said = [str(w.message) for w in caught if issubclass(w.category, hbp.BudgetWarning)]
    assert len([m for m in said if "which the captured step did not" in m]) == 1, said
    assert "layers." in next(m for m in said if "captured step did not" in m)
    model = DataDependentNet()
    hc = hbp.HCModule(model, calibrate=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            hc(torch.randn(64, 64)).sum().backward()
    assert hc.captured.granularity == "module"
    assert not [w for w in caught if "captured step did not" in str(w.message)]


def test_data_dependent_control_flow_falls_back_to_module_calls_with_a_warning():
    torch.manual_seed(0)
    model = DataDependentNet()
    reference = copy.deepcopy(model)
    x = torch.randn(512, 64, requires_grad=True)
    case = Case("data_dependent", DataDependentNet, None)
    expected = train_step(reference, reference, case, (x,), {})
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    with pytest.warns(CaptureWarning, match=r"could not capture DataDependentNet .*module-level"):
        got = train_step(hc, model, case, (x,), {})
    assert hc.captured.granularity == "module"
    assert "fell back" in hc.summary() or "op-level capture failed" in hc.summary()
    assert_same_step(expected, got)
    assert any(s.recompute for s in hc.plan.segments)  # child calls are recomputed
    # (each stops before its matmul: NOTE [ Early stop at the last pack ])
    assert got.flops <= expected.flops + hc.plan.predicted_recompute_flops
    assert got.peak_bytes < expected.peak_bytes
    # "min" is the plan that runs: its prediction bounds what was measured, and a budget below
    # it is refused with it as the minimum. Known gap: this plan (GELU and Linear calls
    # checkpointed alone, each recompute stopping before its matmul) measured 2261256 B for a
    # predicted 2392320 B (5.8% over: one Linear output); not analysed yet.
    assert got.peak_bytes <= 1.02 * hc.plan.predicted_peak_bytes
    with pytest.raises(BudgetError) as info:
        hbp.HCModule(model, budget=hc.plan.predicted_peak_bytes - 4096, calibrate=False)(x)
    assert info.value.minimum == hc.plan.predicted_peak_bytes


@pytest.mark.parametrize("model_class", [ReshapesInPlace, ReshapesInPlaceExported])
def test_an_in_place_view_op_is_captured_at_operator_level(model_class):
    """NOTE [ In-place view ops stay in place ]: `unsqueeze_` on an activation ran twice in
    the profile, the broadcast after it failed in both tracers, and the model fell back to
    module level (its step 2.4x over the budget). Op level now, by fx and by export: the
    plain model's gradients, the measured step within the budget."""
    torch.manual_seed(0)
    model = model_class()
    reference = copy.deepcopy(model)
    x = torch.randn(256, 64)
    reference(x).square().sum().backward()
    hc = hbp.HCModule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        hc(x).square().sum().backward()
    assert hc.captured.granularity == "op"
    assert hc.captured.tracer == ("fx" if model_class is ReshapesInPlace else "export")
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    model.zero_grad()
    hc(x).square().sum().backward()
    assert hc.measured_peak_bytes <= hc.budget_bytes


def test_a_step_no_capture_reaches_runs_the_plain_module_with_one_warning(monkeypatch):
    """Op-level tracers and the module-level fallback all fail (NOTE [ A step no capture
    reaches ]): the step is the plain module's, said once; the signature is not captured
    again; a plan or a prediction asked for raises CaptureError with every attempt's reason."""
    torch.manual_seed(0)
    model = SharedLogNet()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    reference(x).square().sum().backward()
    captures = []
    real_capture = planning.capture
    monkeypatch.setattr(
        planning, "capture", lambda *a, **k: captures.append(1) or real_capture(*a, **k)
    )
    hc = hbp.HCModule(model, budget=0.5)
    message = (
        r"could not capture SharedLogNet: .*module-level cut points: AssertionError: a block "
        r"runs after the ones before it, once\. hbp runs this input signature as the "
        r"plain module: nothing is checkpointed and the budget is not enforced"
    )
    with pytest.warns(CaptureWarning, match=message):
        hc(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hc(x).square().sum().backward()  # said once, not captured again
    assert captures == [1] and hc.captured is None
    with pytest.raises(CaptureError) as info:
        hc.prepare(x)
    assert len(info.value.reasons) == 3 and info.value.reasons[-1].startswith("module-level")
    with pytest.raises(CaptureError, match="could not capture SharedLogNet"):
        hbp.estimate(model, x)


def test_python_attribute_assigned_in_forward_falls_back_with_a_warning():
    x = torch.randn(256, 64)
    torch.manual_seed(0)
    model = CountingCalls()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.5, calibrate=False)
    with pytest.warns(CaptureWarning, match=r"forward assigns Python attribute\(s\) calls"):
        got = run_step(hc, model, (x,))
    assert hc.captured.granularity == "module"
    expected = run_step(reference, reference, (x,))
    assert_same_step(expected, got, exact=False)
    assert model.calls == 1 and model.count.item() == 1  # capturing changed nothing
    assert any(s.recompute for s in hc.plan.segments)
    for _ in range(2):
        assert_same_step(
            run_step(reference, reference, (x,)), run_step(hc, model, (x,)), exact=False
        )
    assert model.calls == reference.calls == 3


def test_wav2vec2_for_ctc_with_labels_is_captured_at_operator_level():
    """The labels check becomes a guard, `masked_select` and CTC's loss graph breaks
    (NOTE [ Data-dependent ops ])."""
    pytest.importorskip("transformers")
    model = wav2vec2_ctc()
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        hc(input_values=torch.randn(2, 2000), labels=torch.randint(1, 32, (2, 10)))
    assert hc.captured.granularity == "op"
