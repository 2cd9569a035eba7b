"""HCModule takes and returns what the module does: keyword arguments and flags, inputs
with and without grad, outputs in the module's own containers (dicts, ModelOutput,
dataclasses, lists, non-tensors). A plan belongs to an input signature (shapes, dtypes,
requires_grad, autocast, keyword values): a step of a known signature reuses its plan, a new
one is captured and planned again."""

from __future__ import annotations

import copy
import itertools
from collections import OrderedDict

import pytest
import torch
from helpers.compare import (
    assert_all_same,
    assert_within_budget,
    compare,
    run_step,
    step_holding_outputs,
)
from helpers.step import assert_same_step, train_step
from models.cases import CASE, tokens
from models.toy import CausalAttention, D, DropoutMLP, HFStyleLM, MLPNet, TransformerBlock
from models.traits import Containers, DictWithAuxLoss, KeywordFlag, ShapeBranches

import hbp


def test_transformer_block_with_kwargs_and_dict_outputs():
    torch.manual_seed(0)
    model = TransformerBlock()
    x = torch.randn(16, 64, D, requires_grad=True)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    params = [x, *model.parameters()]
    hc = hbp.HCModule(model, budget=0.8, calibrate=False)  # one block: little to gain, but some
    out = hc(x, attn_mask=mask, return_attn_input=True)
    assert set(out) == {"hidden", "norms", "attn_input"} and isinstance(out["norms"], tuple)
    expected = step_holding_outputs(model, params, x, attn_mask=mask, return_attn_input=True)
    got = step_holding_outputs(hc, params, x, attn_mask=mask, return_attn_input=True)
    assert_all_same(expected[0], got[0])
    assert_all_same(expected[1], got[1])
    assert any(s.recompute for s in hc.plan.segments)


def test_keyword_arguments_and_a_boolean_flag_are_part_of_the_signature(count_captures):
    captures = count_captures()
    x, mask = torch.randn(256, 64), torch.rand(256, 128)
    for use_extra in (True, False):
        kwargs = {"scale": 0.5, "use_extra": use_extra, "mask": mask}
        hc, plain, got = compare(KeywordFlag, (x,), kwargs, budget=0.85)
        assert_within_budget(hc, got, plain, recomputes=False)
    assert len(captures) == 2


def test_plans_once_per_signature_and_runs_plainly_in_eval_or_no_grad(count_captures):
    model = DropoutMLP(depth=2)
    captures = count_captures()
    hc = hbp.HCModule(model, budget=1.0, calibrate=False)
    x = torch.randn(16, D)
    hc(x).sum().backward()
    hc(x).sum().backward()
    assert len(captures) == 1  # same signature: cached
    first = hc.plan
    hc(torch.randn(32, D)).sum().backward()
    assert len(captures) == 2 and hc.plan is not first  # new shape: planned again
    hc(x.requires_grad_()).sum().backward()
    assert len(captures) == 3  # requires_grad is part of the signature
    with torch.no_grad():
        hc(x)
    hc.eval()
    hc(x)
    assert len(captures) == 3
    assert not model.training  # .eval() passes through
    assert set(hc.state_dict()) == set(model.state_dict())  # the plain model's keys


def test_a_new_batch_size_is_planned_again(count_captures):
    torch.manual_seed(0)
    case = CASE["causal_buffer"]
    model = case.make_model()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.7, block_size=4, calibrate=False)
    captures = count_captures()
    budgets = []
    for batch, seq in ((4, 40), (2, 40), (2, 24), (4, 40)):
        args = (tokens(batch, seq, 96), tokens(batch, seq, 96))
        got = train_step(hc, model, case, args, {})
        assert_same_step(train_step(reference, reference, case, args, {}), got)
        assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes
        budgets.append(hc.plan.budget_bytes)
    assert len(captures) == 3  # the last shape was planned already
    assert budgets[0] > budgets[1] > budgets[2] and budgets[3] == budgets[0]


def test_a_new_sequence_length_is_planned_again(count_captures):
    captures = count_captures()
    torch.manual_seed(0)
    model = CausalAttention()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.7, calibrate=False)
    budgets = []
    for seq in (64, 32, 64):
        x = torch.randn(4, seq, 64)
        got = run_step(hc, model, (x,))
        assert_same_step(run_step(reference, reference, (x,)), got, exact=False)
        assert got.peak_bytes <= 1.05 * hc.plan.budget_bytes
        budgets.append(hc.plan.budget_bytes)
    assert len(captures) == 2 and budgets[0] == budgets[2] > 1.5 * budgets[1]


def test_python_control_flow_on_shapes_plans_per_shape(count_captures):
    captures = count_captures()
    for batch in (256, 64):
        hc, plain, got = compare(ShapeBranches, (torch.randn(batch, 64),), budget=0.85)
        assert_within_budget(hc, got, plain, recomputes=False)
        used = {n.module for n in hc.captured.graph.nodes if n.module}
        assert ("big" in used) == (batch > 100) and ("small" in used) == (batch <= 100)
    assert len(captures) == 2


def test_autocast_is_part_of_the_input_signature(count_captures):
    torch.manual_seed(0)
    model = MLPNet()
    captures = count_captures()
    hc = hbp.HCModule(model, budget=0.5, calibrate=False)
    x = torch.randn(512, 64)
    hc(x).sum().backward()
    float32 = hc.plan
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hc(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and len(captures) == 2
    assert hc.plan.naive_peak_bytes < 0.7 * float32.naive_peak_bytes  # half-size activations


def test_outputs_keep_the_modules_own_container_types():
    torch.manual_seed(0)
    case = CASE["hf_modeloutput"]
    args, kwargs = case.make_inputs()
    for dataclass_output in (False, True):
        model = HFStyleLM(dataclass_output=dataclass_output)
        hc = hbp.HCModule(model, budget=0.6, block_size=4, calibrate=False)
        out, expected = hc(*args, **kwargs), model(*args, **kwargs)
        assert type(out) is type(expected)
        assert out.loss.requires_grad and len(out.hidden_states) == 4  # attribute access
        if dataclass_output:
            assert (out.num_layers, out.note) == (3, "ok")
        else:
            assert list(out) == ["loss", "logits", "hidden_states"]
        out.loss.backward()
    hc = hbp.HCModule(Containers(), budget=1.0, calibrate=False)
    out = hc(torch.randn(4, 16, requires_grad=True))
    assert type(out) is tuple and type(out[0]) is list and type(out[0][1]) is dict
    assert type(out[1]) is OrderedDict and out[2] == 4 and out[0][1]["n"] == 3
    out[0].append("mutable")  # a real list, not fx's immutable_list
    out[0][1]["new"] = 1


def test_dict_output_with_an_aux_loss():
    args = (torch.randn(256, 64), torch.randint(0, 10, (256,)))
    hc, plain, got = compare(DictWithAuxLoss, args, budget=0.5, loss_fn=lambda out: out["loss"])
    assert_within_budget(hc, got, plain, recomputes=False)
    out = hc(*args)
    assert list(out) == ["logits", "loss", "aux"] and out["aux"].requires_grad


def test_a_budget_set_between_steps_plans_the_capture_again(count_captures):
    """`hc.budget = ...` after a step: the next call plans its signature again from the
    capture already made (no second capture), for the new budget, with the plain model's
    results and the allocator's peak within it; the closed loop measures the new plan."""
    torch.manual_seed(0)
    model = CausalAttention()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 64, 64)
    hc = hbp.HCModule(model, budget=1.0)
    captures = count_captures()
    run_step(hc, model, (x,))
    captured, naive = hc.captured, hc.compiled.naive_peak_bytes
    assert hc.plan.budget_bytes == naive
    hc.budget = 0.6
    assert hc.budget == 0.6 and "budget=0.6" in repr(hc)
    got = run_step(hc, model, (x,))
    assert_same_step(run_step(reference, reference, (x,)), got, exact=False)
    assert len(captures) == 1 and hc.captured is captured
    assert hc.plan.budget_bytes == int(0.6 * naive) and hc.plan.predicted_peak_bytes < naive
    measured = hc.measured_peak_bytes
    assert measured <= 1.05 * hc.plan.budget_bytes, (measured, hc.compiled.measurements)
    assert hc.compiled.measurements == 1  # the new plan's own first step
    hc.budget = "min"
    run_step(hc, model, (x,))
    assert len(captures) == 1 and hc.plan.predicted_peak_bytes < int(0.6 * naive)
    least, planned = hc.plan.budget_bytes, hc.plan
    hc.budget = least  # the same bytes as "min" resolved to, another form: planned again
    hc.budget = f"{least}B"  # ... and the same budget as the line above: not planned again
    hc.prepare(x)
    assert hc.plan is not planned and hc.plan.budget_bytes == least
    replanned = hc.plan
    hc.budget = least
    hc.prepare(x)
    assert hc.plan is replanned


def test_planning_options_are_checked_when_set():
    hc = hbp.HCModule(MLPNet(), budget=0.5)
    for name, bad in (("budget", -1), ("budget", "lots"), ("block_size", 0), ("planner", "x")):
        before = getattr(hc, name)
        with pytest.raises(hbp.ConfigError, match=name):
            setattr(hc, name, bad)
        assert getattr(hc, name) == before  # the old value stays


def test_a_block_size_set_between_steps_plans_as_a_new_wrapper_would(count_captures):
    torch.manual_seed(0)
    model = MLPNet()
    x = torch.randn(2048, D)
    hc = hbp.HCModule(model, budget=0.5, calibrate=False)
    run_step(hc, model, (x,))
    captures = count_captures()
    hc.block_size = 4
    run_step(hc, model, (x,))
    assert not captures and hc.plan.meta["block_size"] == 4  # planned from the capture
    fresh = hbp.HCModule(model, budget=0.5, block_size=4, calibrate=False).prepare(x)
    assert len(captures) == 1  # the fresh wrapper's own
    assert hc.plan.segments == fresh.segments
    assert hc.plan.predicted_peak_bytes == fresh.predicted_peak_bytes


def test_a_budget_error_keeps_the_capture_for_the_next_budget(count_captures, tmp_path):
    """The first step's BudgetError, then `hc.budget = err.minimum`: planned from the capture
    the failed step made, at the minimum the error named."""
    torch.manual_seed(0)
    model = CausalAttention()
    x = torch.randn(4, 64, 64)
    hc = hbp.HCModule(model, budget="1KiB")
    captures = count_captures()
    with pytest.raises(hbp.BudgetError) as err:
        run_step(hc, model, (x,))
    captured = hc.captured  # the failed step's capture, to look at
    assert captured is not None and hc.plan is None
    assert "no plan fits the budget" in hc.summary()
    with pytest.raises(RuntimeError, match="nothing is planned yet"):
        hc.save_plan(tmp_path / "plan.json")
    with pytest.raises(hbp.BudgetError):  # planned again, not captured again
        hc.prepare(x)
    hc.budget = err.value.minimum
    run_step(hc, model, (x,))
    assert len(captures) == 1 and hc.plan.predicted_peak_bytes <= err.value.minimum
    assert hc.captured is captured
    assert hc.measured_peak_bytes <= 1.05 * err.value.minimum


class ScaledBlocks(torch.nn.Module):
    """Residual MLP blocks whose forward reads a plain attribute (`scale`), a config flag
    (`config.skip_last`) and counts its calls on a cache-like attribute, as a rotary
    embedding grows its cached length."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D)
            )
            for _ in range(4)
        )
        self.scale = 1.0
        self.config = type("Config", (), {})()
        self.config.skip_last = False
        self.longest_seen = 0

    def forward(self, x):
        self.longest_seen = max(self.longest_seen, x.shape[0])  # set while traced
        blocks = self.blocks[:-1] if self.config.skip_last else self.blocks
        for block in blocks:
            x = x + self.scale * block(x)
        return x


def test_hooks_and_attributes_changed_after_the_first_step_are_captured_anew(count_captures):
    """What the capture fixed of the forward's Python (NOTE [ What the capture fixed ]): a
    submodule's hook added or removed after the first step, a plain attribute, a config flag
    and `nn.Dropout.p` changed between steps give the plain model's step (they were silently
    the first step's before); a change back finds the first capture, and an attribute the
    forward sets while traced costs no second capture."""
    torch.manual_seed(0)
    model = ScaledBlocks()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    x = torch.randn(256, D)
    captures = count_captures()

    def same_step() -> None:
        got, expected = run_step(hc, model, (x,)), run_step(reference, reference, (x,))
        assert_same_step(expected, got)

    same_step()
    same_step()
    assert len(captures) == 1
    handles = [
        m.blocks[1].register_forward_hook(lambda mod, i, out: out + 1.0) for m in (model, reference)
    ]
    same_step()
    for handle in handles:
        handle.remove()
    same_step()
    for m in (model, reference):
        m.scale = 0.5
    with pytest.warns(UserWarning, match=r"scale 1\.0 -> 0\.5 since a planned step") as said:
        same_step()
    assert said[0].filename.endswith("step.py") and "site-packages" not in said[0].filename
    # (it points at the caller's line: here the test helper that calls hc)
    for m in (model, reference):
        m.config.skip_last = True
    with pytest.warns(UserWarning, match=r"config\.skip_last False -> True"):
        same_step()
    for m in (model, reference):
        m.scale, m.config.skip_last = 1.0, False
    same_step()
    assert len(captures) == 4  # the hook, the scale, the flag; then the first state again


def test_a_first_call_budget_error_names_no_earlier_signature():
    """A forward that sets an attribute while traced has its one capture under two keys
    (NOTE [ What the capture fixed ]); a BudgetError at its first call is not "a new input
    signature after 1 planned before"."""
    torch.manual_seed(0)
    hc = hbp.HCModule(ScaledBlocks(), budget=4096, calibrate=False)
    with pytest.raises(hbp.BudgetError) as info:
        hc(torch.randn(256, D))
    assert "input signature" not in str(info.value)
    assert len(hc._compiled) == 2  # the keys before and after the traced call


class FunctionalDropout(torch.nn.Module):
    """Hands its `nn.Dropout`'s rate to a functional call, as transformers' attention does
    (`dropout_p=self.dropout.p` into scaled_dot_product_attention)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(4))
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.dropout(layer(x).tanh(), self.dropout.p, self.training)
        return x


def test_a_dropout_rate_changed_between_steps_is_the_one_the_step_uses():
    torch.manual_seed(0)
    model = FunctionalDropout()
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    x = torch.randn(64, D)
    hc(x).sum().backward()
    model.dropout.p = 0.0
    out = hc(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # no mask drawn


_SEEDS = itertools.count(1)


class _SeededBlock(torch.nn.Module):
    """Writes a fresh seed on itself at every call, as Reformer's layers do (theirs from
    `torch.seed()`)."""

    def __init__(self):
        super().__init__()
        self.lin, self.seed = torch.nn.Linear(D, D), None

    def forward(self, x):
        self.seed = next(_SEEDS)
        return torch.tanh(self.lin(x))


class _SeededNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_SeededBlock() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x if x.sum() > 0 else -x  # both sides run: no tracer captures it


def test_a_module_level_capture_is_not_captured_again_for_the_state_its_forward_writes(
    count_captures,
):
    """NOTE [ Module calls fix no Python state ]: a module-level capture runs the modules' own
    forwards at every step, so an attribute a forward writes at every call (a fresh seed) is
    no new signature: one capture for every step, each the plain model's step."""
    torch.manual_seed(0)
    model = _SeededNet()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    x = torch.randn(64, D)
    captures = count_captures()
    with pytest.warns(hbp.CaptureWarning, match="operator level"):
        for _ in range(4):
            torch.manual_seed(1)
            got = run_step(hc, model, (x,))
            torch.manual_seed(1)
            assert_same_step(run_step(reference, reference, (x,)), got)
    assert hc.captured.granularity == "module" and len(captures) == 1
