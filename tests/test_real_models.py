"""HCModule on real architectures (tests/models/real.py): transformers GPT-2, Llama, BERT, T5
and ViT, diffusers' conditional UNet, and the timm / torchvision patterns that used to crash,
trained the way their users train them: the step backpropagates the model's own loss and lets go of the outputs before backward
(tests/helpers/step.py), with HCModule's defaults (no `keeps_outputs`) but its closed loop
off (`calibrate=False`: a CPU profiler over each model's first step; tests/test_step_budget.py
tests the loop).

- Captured at operator level (decorated forwards, `**kwargs`, `torch.is_tensor` checks,
  attention-mask construction and output dataclasses need the export trace), with outputs,
  gradients and BatchNorm statistics equal to the plain model's (same seed, dropout on).
- Within the budget (0.5, or "min" where parameter gradients dominate): the tracker-measured
  peak stays within 1.05x the plan's budget, with no more recompute than predicted.
- No crash in the module-level fallback either; its "min" runs, and a budget below it is a
  BudgetError whose minimum is that plan's peak.
- At the library's own checkpointing peak HCModule fits with no more recompute, and its
  minimum is lower.
- The fallback cuts between the repeated blocks and calls forward with the caller's own
  arguments; its "min" and BudgetError.minimum are the plan that runs.
- A caller that holds the outputs through backward is counted from the next step, with one
  warning.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from helpers.step import assert_same_step, train_step
from models.real import REAL_CASE, REAL_CASES, own_checkpointing

import hbp
from hbp.analysis import simulate
from hbp.errors import BudgetError, CaptureWarning
from hbp.graph.torch import capture as capture_stage
from hbp.planner import optimal_plan
from hbp.planner.plan import Segment

pytest.importorskip("transformers")
pytest.importorskip("diffusers")


def _cases(names=None):
    return [c.name for c in REAL_CASES if names is None or c.name in names]


def _build(name: str):
    torch.manual_seed(0)
    model, args, kwargs = REAL_CASE[name].build()
    return model.train(), args, kwargs


def _compare(name: str, budget, model=None, inputs=None, hc=None):
    """Plain step vs HCModule(budget) step on copies with the same weights, inputs and seed.
    `hc`: an HCModule that has run these inputs, planned again for `budget` from its capture
    (`hc.budget = budget`), against a plain copy of its model as it is now."""
    case = REAL_CASE[name]
    if hc is not None:
        model = hc.module
    elif model is None:
        model, *inputs = _build(name)
    args, kwargs = inputs
    reference = copy.deepcopy(model)
    expected = train_step(reference, reference, None, args, kwargs, loss_fn=case.loss)
    if hc is None:
        hc = hbp.HCModule(model, budget=budget, calibrate=False)
    else:
        hc.budget = budget
    got = train_step(hc, model, None, args, kwargs, loss_fn=case.loss)
    assert_same_step(expected, got, case.exact)
    return hc, expected, got


@pytest.mark.parametrize("name", _cases())
def test_real_model_at_operator_level_same_step_within_budget(name):
    model, *inputs = _build(name)
    hc = hbp.HCModule(model, budget=0.5, calibrate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)  # no fallback
        try:
            hc.prepare(*inputs[0], **inputs[1])
        except BudgetError as err:  # parameter gradients dominate: "min" then
            assert err.minimum > err.budget
            hc.budget = "min"
        hc, expected, got = _compare(name, hc.budget, inputs=inputs, hc=hc)
    assert hc.captured.granularity == "op"
    assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes
    assert hc.plan.schedule or any(s.recompute for s in hc.plan.segments)
    assert expected.flops < got.flops <= expected.flops + hc.plan.predicted_recompute_flops
    assert got.peak_bytes < expected.peak_bytes


def _module_level(monkeypatch):
    """Every op-level tracer fails: the capture falls back to module-level cut points."""

    def unavailable(*args, **kwargs):
        raise RuntimeError("op-level capture switched off by the test")

    monkeypatch.setattr(capture_stage, "_TRACERS", (unavailable,))


@pytest.mark.parametrize(
    "name", _cases(["gpt2", "alias_then_inplace", "flatten_then_inplace_dropout"])
)
def test_real_model_in_the_module_level_fallback_never_crashes(monkeypatch, name):
    """At "min", and at a budget below it (BudgetError, whose minimum is what "min" runs)."""
    _module_level(monkeypatch)
    with pytest.warns(CaptureWarning, match="op-level capture switched off"):
        hc, expected, got = _compare(name, "min")
    assert hc.captured.granularity == "module"
    if name == "gpt2":  # blocks that save more than their input: checkpointing them pays
        assert got.peak_bytes < expected.peak_bytes
        assert got.flops > expected.flops
    model, args, kwargs = _build(name)
    with pytest.warns(CaptureWarning), pytest.raises(BudgetError) as info:
        hbp.HCModule(model, budget=hc.plan.predicted_peak_bytes - 1)(*args, **kwargs)
    assert info.value.minimum == hc.plan.predicted_peak_bytes


def test_fallback_cuts_between_repeated_blocks_with_the_callers_arguments(monkeypatch):
    """GPT-2's decoder stack is one child of the model: the fallback looks inside it, down to
    the blocks `transformer.h.i` (the libraries' own cut points). Wrapping the inner stack
    calls its decorated forward with the caller's arguments (re-bound defaults would reach
    `**kwargs` twice)."""
    _module_level(monkeypatch)
    model, _, kwargs = _build("gpt2")
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    with pytest.warns(CaptureWarning):
        hc(**kwargs).loss.backward()
    paths = [path for path, _ in hc.captured.module_calls]
    assert {"transformer.h.0", "transformer.h.1", "lm_head"} <= set(paths)
    assert "transformer" not in paths

    inner = hbp.HCModule(model.transformer, budget="min", calibrate=False)
    with pytest.warns(CaptureWarning):
        out = inner(input_ids=kwargs["input_ids"], use_cache=False)
    out.last_hidden_state.sum().backward()
    assert inner.captured.granularity == "module"


@pytest.mark.parametrize(
    "name", ["gpt2", "bert", "t5", pytest.param("unet_cond", marks=pytest.mark.slow)]
)
def test_hcmodule_beats_the_librarys_own_checkpointing(name):
    """At the library's own checkpointing peak (in bytes), HCModule fits with no more
    recompute FLOPs, and its least reachable peak is lower than that peak."""
    case = REAL_CASE[name]
    model, args, kwargs = _build(name)
    plain = copy.deepcopy(model)
    naive = train_step(plain, plain, None, args, kwargs, loss_fn=case.loss)
    own_checkpointing(plain, case)
    library = train_step(plain, plain, None, args, kwargs, loss_fn=case.loss)
    assert library.peak_bytes < naive.peak_bytes  # the library's checkpointing is on

    hc, _, got = _compare(name, library.peak_bytes, copy.deepcopy(model), (args, kwargs))
    assert hc.captured.granularity == "op"
    assert got.peak_bytes <= 1.05 * library.peak_bytes
    assert got.flops - naive.flops <= library.flops - naive.flops

    hc_min, _, least = _compare(name, "min", inputs=(args, kwargs), hc=hc)
    assert least.peak_bytes < library.peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_backward_starts_at_the_models_own_loss_and_the_prediction_holds(name):
    """The logits beside `output.loss` get no gradient of their own (NOTE [ Where backward
    starts ]): the predicted peak is the measured one, where seeding every output would add
    the logits' gradient."""
    model, args, kwargs = _build(name)
    case = REAL_CASE[name]
    hc = hbp.HCModule(model, budget=1.0, calibrate=False)
    got = train_step(hc, model, None, args, kwargs, loss_fn=case.loss)
    graph = hc.captured.graph
    assert graph.grad_outputs is not None and len(graph.grad_outputs) == 1
    assert graph.node(graph.grad_outputs[0]).output_bytes <= 16  # the scalar loss
    assert got.peak_bytes == pytest.approx(hc.plan.predicted_peak_bytes, rel=0.03)


def test_a_caller_that_holds_the_outputs_is_counted_from_the_next_step():
    """The step that keeps the outputs until backward ends (a caller that logs its logits):
    the first plan counted them as let go, as `model(**batch).loss.backward()` does, and the
    measured peak is above its prediction; the next call warns once and re-plans, and from
    then on the prediction is the measured peak (NOTE [ Outputs the caller lets go ])."""
    model, args, kwargs = _build("gpt2")
    case = REAL_CASE["gpt2"]
    hc = hbp.HCModule(model, budget=1.0, calibrate=False)

    def step():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train_step(hc, model, None, args, kwargs, loss_fn=case.loss, keep_outputs=True)
        return got, [str(w.message) for w in caught if "alive until backward" in str(w.message)]

    first, warned = step()
    assert not warned and first.peak_bytes > hc.plan.predicted_peak_bytes
    second, warned = step()
    assert len(warned) == 1 and "the caller keeps" in warned[0]
    assert second.peak_bytes == pytest.approx(hc.plan.predicted_peak_bytes, rel=0.03)
    third, warned = step()
    assert not warned
    assert third.peak_bytes == pytest.approx(hc.plan.predicted_peak_bytes, rel=0.03)


def _library_plan(graph) -> list[Segment]:
    """The plan of transformers' own checkpointing on hbp's graph: each decoder layer
    (`...h.<i>.` / `...layers.<i>.` modules, contiguous in the order) one recomputed segment,
    everything else plain."""
    layers: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        found = re.search(r"\.(h|layers)\.(\d+)(\.|$)", node.module)
        if found:
            layers.setdefault(int(found.group(2)), []).append(i)
    segments, pos = [], 0
    for index in sorted(layers):
        start, stop = layers[index][0], layers[index][-1] + 1
        assert stop - start == len(layers[index]), "a layer's nodes are not contiguous"
        if start > pos:
            segments.append(Segment(pos, start))
        segments.append(Segment(start, stop, True))
        pos = stop
    return [*segments, Segment(pos, len(graph.nodes))]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_librarys_plan_is_predicted_exactly_and_the_planner_recomputes_less(name):
    """transformers' checkpointing as an hbp plan: its predicted recompute is the library's
    measured one (each layer's recompute stops inside its last Linear, before the matmul:
    NOTE [ Early stop at the last pack ]), and at that plan's predicted peak the planner
    recomputes less (the layer boundary before the final norm is a candidate cut: NOTE [ Both
    ends of a flat frontier minimum ])."""
    case = REAL_CASE[name]
    model, args, kwargs = _build(name)
    plain = copy.deepcopy(model)
    naive = train_step(plain, plain, None, args, kwargs, loss_fn=case.loss)
    own_checkpointing(plain, case)
    library = train_step(plain, plain, None, args, kwargs, loss_fn=case.loss)
    hc = hbp.HCModule(model, budget=1.0, calibrate=False)
    hc.prepare(*args, **kwargs)
    graph = hc.captured.graph
    segments = _library_plan(graph)
    assert sum(s.recompute for s in segments) == 2  # the two layers
    predicted = simulate(graph, segments)
    assert predicted.recompute_flops == pytest.approx(library.flops - naive.flops, rel=1e-9)
    ours = optimal_plan(graph, predicted.peak_bytes)
    assert ours.predicted_peak_bytes <= predicted.peak_bytes
    assert ours.predicted_recompute_flops < predicted.recompute_flops
