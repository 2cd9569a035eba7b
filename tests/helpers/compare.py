"""Plain model vs HCModule: one training step of each on copies with the same weights,
inputs and seed (tests/helpers/step.py), the results compared, and what the wrapper's step
measured against its plan.

The wrapper's closed loop (calibrate=) is off in these comparisons: it measures a step with
the CPU profiler and can only change the plans of later steps, which they do not take;
tests/test_step_budget.py tests it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._pytree import tree_leaves

import hbp
from hbp.errors import BudgetError
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.runtime.tracker import MemoryTracker
from helpers.step import Case, StepResult, assert_same_step, train_step


def minimum_budget(case: Case) -> int:
    """The smallest feasible budget in bytes, from the BudgetError of a 1-byte budget (once
    per case and process)."""
    if case.name not in _MINIMUM:
        _MINIMUM[case.name] = _minimum_budget(case)
    return _MINIMUM[case.name]


_MINIMUM: dict[str, int] = {}


def _minimum_budget(case: Case) -> int:
    torch.manual_seed(0)
    model, (args, kwargs) = case.make_model(), case.make_inputs()
    hc = hbp.HCModule(model, budget=1, block_size=case.block_size)
    with pytest.raises(BudgetError, match=r"smallest feasible budget is [0-9.]+ MiB") as info:
        with case.autocast_context(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            hc.prepare(*args, **kwargs)
    assert info.value.budget == 1 and info.value.minimum > 1
    return info.value.minimum


def compare_with_plain(case: Case, budget) -> dict:
    """Plain model vs HCModule(budget) on fresh copies with the same weights, inputs and
    seed: assert the same results; return a row of measurements."""
    torch.manual_seed(0)
    model = case.make_model()
    reference = copy.deepcopy(model)
    args, kwargs = case.make_inputs()
    ref_args, ref_kwargs = copy.deepcopy((args, kwargs))
    keep = not case.own_loss
    expected = train_step(reference, reference, case, ref_args, ref_kwargs, keep_outputs=keep)
    hc = hbp.HCModule(model, budget=budget, block_size=case.block_size, calibrate=False)
    got = train_step(hc, model, case, args, kwargs, keep_outputs=keep)
    assert_same_step(expected, got, case.exact)
    plan = hc.plan
    return dict(
        model=case.name,
        budget=budget,
        granularity=hc.captured.granularity,
        plain_peak=expected.peak_bytes,
        peak=got.peak_bytes,
        budget_bytes=plan.budget_bytes,
        predicted=plan.predicted_peak_bytes,
        recomputed_segments=sum(s.recompute for s in plan.segments),
        # FLOPs run on top of one forward and one backward of the captured graph
        extra_flops=got.flops - plan.naive_flops,
        predicted_extra_flops=plan.predicted_recompute_flops,
        plain_flops=expected.flops,
    )


def run_step(
    module, model, args, kwargs=None, *, loss_fn=None, seed=0, keep_outputs=False
) -> StepResult:
    """One training step of `module` (`model` or its HCModule), the way users train: loss =
    `loss_fn(out)` or the sum of every output that requires grad, the outputs let go before
    backward unless `keep_outputs`."""
    return train_step(
        module, model, None, args, kwargs or {}, seed, loss_fn, keep_outputs=keep_outputs
    )


def compare(make_model, args, kwargs=None, *, budget, loss_fn=None, exact=False, **options):
    """Plain model vs HCModule(budget, **options) on copies with the same weights: same
    results (bitwise if `exact`). Returns (hc, plain step, hc step)."""
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    ref_args, ref_kwargs = copy.deepcopy((args, kwargs))
    expected = run_step(reference, reference, ref_args, ref_kwargs, loss_fn=loss_fn)
    hc = hbp.HCModule(model, budget=budget, calibrate=False, **options)
    got = run_step(hc, model, args, kwargs, loss_fn=loss_fn)
    assert_same_step(expected, got, exact)
    return hc, expected, got


def assert_within_budget(
    hc, got: StepResult, plain: StepResult, *, recomputes: bool = True
) -> None:
    """The step's measured peak within 1.05 x the plan's budget; with `recomputes`, the plan
    recomputes and the step peaks below 0.8 x the plain step."""
    plan = hc.plan
    assert got.peak_bytes <= 1.05 * plan.budget_bytes, (got.peak_bytes, plan.budget_bytes)
    if recomputes:
        assert any(s.recompute for s in plan.segments)
        assert got.peak_bytes < 0.8 * plain.peak_bytes


def step_holding_outputs(module, params, *inputs, seed=0, **kwargs):
    """One training step that holds the outputs through backward, loss = the sum of those
    that require grad: (outputs detached, `params`' grads, peak bytes, FLOPs)."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    with TotalFlopCounterMode() as fc, MemoryTracker(record_timeline=False) as tracker:
        out = module(*inputs, **kwargs)
        loss = sum(t.float().sum() for t in tree_leaves(out) if t.requires_grad)
        loss.backward()
    outs = [t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return outs, [p.grad for p in params], tracker.peak_bytes, fc.get_total_flops()


def assert_all_same(a, b, exact=True):
    """Two lists of tensors (or None) equal: bitwise if `exact`, else within 1e-5."""
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        elif exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def masked_lm_step(model, runner, ids, labels) -> dict[str, torch.Tensor]:
    """One step of a transformers masked LM through `runner` (the model or its wrapper):
    its parameters' gradients."""
    model.zero_grad(set_to_none=True)
    runner(input_ids=ids, labels=labels).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def causal_lm_step(model, runner, **batch) -> dict[str, torch.Tensor]:
    """One step of a transformers causal LM through `runner`, the inputs as labels: its
    parameters' gradients."""
    model.zero_grad(set_to_none=True)
    runner(**batch, labels=batch["input_ids"], use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sdpa_input_counts(hc) -> list[int]:
    """How many inputs each captured scaled_dot_product_attention takes (3: no mask)."""
    return [len(n.inputs) for n in hc.captured.graph.nodes if n.op.startswith("scaled_dot")]
