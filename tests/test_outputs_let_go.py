"""Outputs the caller lets go (NOTE [ Outputs the caller lets go ] in
hbp/integrations/torch/outputs.py): a module returning its loss and its logits, trained with
`model(x).loss.backward()`, frees the logits before backward; HCModule must not keep them
alive, and plans without them from the first step, with no flag. A caller that keeps them is
counted from the next step, with one warning."""

from __future__ import annotations

import dataclasses
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import hbp
from hbp.allocator import allocator_peak
from hbp.errors import ConfigError
from tests.models.real import gpt2
from tests.models.toy import TinyLM, TinyLMOutput

VOCAB, WIDTH, TOKENS = 2048, 64, 256


def _batch():
    torch.manual_seed(0)
    return torch.randint(0, VOCAB, (TOKENS,)), torch.randint(0, VOCAB, (TOKENS,))


def _drop(module, ids, labels):
    module(ids, labels).loss.backward()


def _keep(module, ids, labels):
    out = module(ids, labels)
    out.loss.backward()
    return out


def _measured(module, step, *batch) -> int:
    module.zero_grad(set_to_none=True)
    return allocator_peak(lambda: step(module, *batch))[1]


def test_outputs_the_caller_drops_are_planned_without_from_the_first_step():
    torch.manual_seed(0)
    model, batch = TinyLM(), _batch()
    hc = hbp.HCModule(model, budget="min")
    first = _measured(hc, _drop, *batch)
    graph = hc.captured.graph
    assert graph.held_outputs == [graph.outputs[0]]  # the loss, not the logits
    assert abs(hc.plan.predicted_peak_bytes - first) <= 0.03 * first
    kept = hbp.HCModule(TinyLM(), budget="min", keeps_outputs=True)
    kept.prepare(*batch)
    logits = 4 * TOKENS * VOCAB
    assert hc.plan.predicted_peak_bytes <= kept.plan.predicted_peak_bytes - logits // 2
    second = _measured(hc, _drop, *batch)  # nothing planned again
    assert abs(second - first) <= 0.03 * first
    # the same gradients as plain autograd
    model.zero_grad(set_to_none=True)
    _drop(model, *batch)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _drop(hc, *batch)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0)


def test_no_reference_cycle_keeps_the_outputs_alive():
    """The caller's `model(x).loss`: the logits die before backward, with the garbage
    collector off (a reference cycle through the outputs kept them to the next collection)."""
    torch.manual_seed(0)
    hc = hbp.HCModule(TinyLM(), budget=1.0)
    batch = _batch()
    _drop(hc, *batch)
    gc.collect()
    gc.disable()
    try:
        out = hc(*batch)
        logits = weakref.ref(out.logits)
        loss = out.loss
        del out
        assert logits() is None
        loss.backward()
    finally:
        gc.enable()


def test_a_caller_that_keeps_the_outputs_is_counted_from_the_next_step():
    torch.manual_seed(0)
    hc = hbp.HCModule(TinyLM(), budget="min")
    batch = _batch()
    _drop(hc, *batch)
    _drop(hc, *batch)
    low = hc.plan.predicted_peak_bytes
    _keep(hc, *batch)
    # named where the caller holds it, with its graph name
    with pytest.warns(
        hbp.BudgetWarning, match=r"the caller keeps output\.logits \(head\) alive until"
    ):
        _keep(hc, *batch)
    assert hc.captured.graph.held_outputs is None or len(hc.captured.graph.held_outputs) == 2
    kept = _measured(hc, _keep, *batch)
    assert hc.plan.predicted_peak_bytes > low
    assert abs(hc.plan.predicted_peak_bytes - kept) <= 0.03 * kept


def test_kept_outputs_are_planned_for_when_the_measured_peak_is_read_between_steps():
    """NOTE [ A measured step read before the next call ]: `hc.measured_peak_bytes` read
    after a step whose caller kept the logits plans for them, with the warning that names
    them; not a warning that blames unseen memory and plans below the budget."""
    torch.manual_seed(0)
    hc = hbp.HCModule(TinyLM(), budget="9MiB")  # above the plain step that drops the logits
    batch = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _keep(hc, *batch)
            measured = hc.measured_peak_bytes
    said = [str(w.message) for w in caught]
    assert any("the caller keeps output.logits (head) alive" in m for m in said), said
    assert not any("did not see" in m or "outside the module" in m for m in said), said
    assert hc.budget_bytes == hc.plan.budget_bytes == 9 * 2**20
    assert measured <= hc.budget_bytes


def test_the_budget_read_after_a_measured_step_is_the_one_its_measurement_gives():
    """`hc.budget_bytes` read after a measured step's backward reads that measurement first,
    as `hc.measured_peak_bytes` does: the same budget whichever is read first (the least peak
    rises once the kept logits are planned for). Read between the forward and the backward,
    it leaves the step's measurement alone."""
    torch.manual_seed(0)
    batch = _batch()
    budgets = {}
    for order in ("budget first", "peak first"):
        hc = hbp.HCModule(TinyLM(), budget="min")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hbp.BudgetWarning)
            out = hc(*batch)
            during = hc.budget_bytes  # before backward: the measurement goes on
            out.loss.backward()
            if order == "budget first":
                budgets[order] = (hc.budget_bytes, hc.measured_peak_bytes, hc.budget_bytes)
            else:
                peak = hc.measured_peak_bytes
                budgets[order] = (hc.budget_bytes, peak, hc.budget_bytes)
        assert budgets[order][1] is not None  # the first step was measured
    assert budgets["budget first"] == budgets["peak first"]
    assert budgets["budget first"][0] > during  # planned again for the kept logits


def test_keeps_outputs_fixes_the_assumption():
    torch.manual_seed(0)
    batch = _batch()
    dropped = hbp.HCModule(TinyLM(), budget="min", keeps_outputs=False)
    measured = _measured(dropped, _drop, *batch)
    assert abs(dropped.plan.predicted_peak_bytes - measured) <= 0.03 * measured
    kept = hbp.HCModule(TinyLM(), budget="min", keeps_outputs=True)
    for _ in range(2):
        _drop(kept, *batch)
    graph = kept.captured.graph
    assert graph.held_outputs == graph.outputs  # every output held, as None says
    assert kept.plan.predicted_peak_bytes > dropped.plan.predicted_peak_bytes
    with pytest.raises(ConfigError, match="keeps_outputs"):
        hbp.HCModule(TinyLM(), keeps_outputs="no")


@pytest.mark.slow
def test_transformers_gpt2_trained_through_its_loss_plans_without_the_logits():
    """`model(**batch).loss.backward()` on a real transformers model: from the first step the
    prediction is the allocator's peak within 3%, below the plan that counts the logits."""
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hc = hbp.HCModule(model, budget="min")

        def step(module):
            module(**kwargs).loss.backward()

        measured = _measured(hc, step)
        kept = hbp.HCModule(model, budget="min", keeps_outputs=True)
        kept.prepare(**kwargs)
    assert hc.captured.granularity == "op"
    assert hc.plan.predicted_peak_bytes < kept.plan.predicted_peak_bytes
    assert abs(hc.plan.predicted_peak_bytes - measured) <= 0.03 * measured


def test_estimate_without_the_outputs_is_the_plain_step_that_drops_them():
    torch.manual_seed(0)
    model, batch = TinyLM(), _batch()
    kept = hbp.estimate(model, *batch, budgets=[], keeps_outputs=True)
    dropped = hbp.estimate(model, *batch, budgets=[], keeps_outputs=False)
    _drop(model, *batch)
    measured = _measured(model, _drop, *batch)
    assert dropped.naive_peak_bytes < kept.naive_peak_bytes
    assert abs(dropped.naive_peak_bytes - measured) <= 0.03 * measured


def test_the_default_estimate_is_what_the_default_wrapper_plans():
    """`hbp.estimate` with no flag assumes what HCModule's first plan does (only the loss is
    kept through backward): its least peak is the "min" budget HCModule plans for."""
    torch.manual_seed(0)
    model, batch = TinyLM(), _batch()
    est = hbp.estimate(model, *batch, budgets=["min"])
    hc = hbp.HCModule(model, budget="min")
    hc.prepare(*batch)
    assert est.min_peak_bytes == hc.plan.budget_bytes
    assert est.min_peak_bytes < hbp.estimate(model, *batch, keeps_outputs=True).min_peak_bytes


def test_a_budget_that_fits_only_without_the_outputs_plans_with_no_flag():
    torch.manual_seed(0)
    batch = _batch()
    dropped = hbp.HCModule(TinyLM(), budget="min", keeps_outputs=False)
    dropped.prepare(*batch)
    budget = dropped.plan.predicted_peak_bytes
    with pytest.raises(hbp.BudgetError, match="smallest feasible budget"):
        hbp.HCModule(TinyLM(), budget=budget, keeps_outputs=True).prepare(*batch)
    fits = hbp.HCModule(TinyLM(), budget=budget)
    measured = _measured(fits, _drop, *batch)
    assert measured <= 1.05 * budget


class RegressionLoss(nn.Module):
    """Returns CPU `mse_loss`, whose 0-dim result holds the whole elementwise loss's storage."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x, y):
        return nn.functional.mse_loss(self.body(x), y)


def test_the_loss_backward_runs_on_stays_counted_with_keeps_outputs_false():
    """`hc(x, y).backward()` keeps the loss alive until backward returns: letting it go at
    backward's start would under-count mse_loss's storage (WIDTH x TOKENS x 8 x 4 bytes)."""
    torch.manual_seed(0)
    model = RegressionLoss()
    x, y = torch.randn(8 * TOKENS, WIDTH), torch.randn(8 * TOKENS, WIDTH)
    assert nn.functional.mse_loss(x, y).untyped_storage().nbytes() == x.nbytes
    kept = hbp.estimate(model, x, y, keeps_outputs=True)
    dropped = hbp.estimate(model, x, y, keeps_outputs=False)
    assert dropped.naive_peak_bytes == kept.naive_peak_bytes
    hc = hbp.HCModule(model, "min", keeps_outputs=False)
    plan = hc.prepare(x, y)
    model.zero_grad(set_to_none=True)
    _, measured = allocator_peak(lambda: hc(x, y).backward())
    assert measured <= 1.02 * plan.budget_bytes


class LogitsLM(TinyLM):
    """TinyLM returning its logits: the caller's loss starts backward from them, so by default
    they are counted as held until backward ends."""

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_budget_error_says_when_letting_go_of_the_outputs_fits_and_plans_once_when_it_cannot(
    monkeypatch,
):
    """Between the least peaks with and without the held logits the error says to pass
    keeps_outputs=False; far below both it is raised after one plan (NOTE [ Letting go of the
    outputs cannot reach the budget ])."""
    import hbp.planner

    torch.manual_seed(0)
    ids = _batch()[0]
    model = LogitsLM()
    held = hbp.HCModule(model, budget="min").prepare(ids).predicted_peak_bytes
    let_go = hbp.HCModule(model, budget="min", keeps_outputs=False).prepare(ids)
    assert let_go.predicted_peak_bytes < held
    with pytest.raises(hbp.BudgetError, match="keeps_outputs=False"):
        hbp.HCModule(model, budget=(let_go.predicted_peak_bytes + held) // 2).prepare(ids)
    plans = []
    plan = hbp.planner.plan
    monkeypatch.setattr(hbp.planner, "plan", lambda *a, **k: plans.append(a) or plan(*a, **k))
    with pytest.raises(hbp.BudgetError) as err:
        hbp.HCModule(model, budget=let_go.predicted_peak_bytes // 4).prepare(ids)
    assert "keeps_outputs" not in str(err.value) and len(plans) == 1


def test_a_warning_names_each_output_where_the_caller_finds_it():
    """Graph outputs are named as code reaches them in what the module returned: dataclass
    and dict fields, tuple items and a plain object's attributes (transformers' key/value
    cache), with a hint where that cache is among them; an output found nowhere keeps its
    graph name."""
    from hbp.integrations.torch.outputs import _cache_hint, _described, output_paths

    class Layer:
        def __init__(self, keys, values):
            self.keys, self.values, self._private = keys, values, keys

    k, v, logits, lost = (torch.zeros(1) for _ in range(4))
    output = {"logits": logits, "cache": type("Cache", (), {})()}
    output["cache"].layers = [Layer(k, v)]
    returned = [(n, weakref.ref(t)) for n, t in (("head", logits), ("cat", k), ("cat_1", v))]
    returned.append(("view", weakref.ref(lost)))
    paths = output_paths(TinyLMOutput(torch.zeros(()), (output, 3)), returned)
    assert paths == {
        "head": ".logits[0].logits",
        "cat": ".logits[0].cache.layers[0].keys",
        "cat_1": ".logits[0].cache.layers[0].values",
    }
    assert _described(["head", "view"], paths) == "output.logits[0].logits (head), view"

    @dataclasses.dataclass(slots=True)
    class Slotted:  # no __dict__: its fields are read as a dataclass's
        keys: torch.Tensor

    assert output_paths((Slotted(k),), returned[1:2]) == {"cat": "[0].keys"}
    assert "use_cache=False" in _cache_hint(["cat"], paths)
    assert _cache_hint(["head"], paths) == ""


def test_a_training_step_fills_no_key_value_cache_unless_the_caller_asks():
    """NOTE [ A training step keeps no key/value cache ]: a transformers model whose config
    turns the cache on trains without it (as its own gradient checkpointing does), within
    the budget; `use_cache=True` passed keeps the cache, and a call without grad is the
    plain model's."""
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    assert model.config.use_cache
    hc = hbp.HCModule(model, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hc(**kwargs)
        assert getattr(out, "cache", None) is None
        out.loss.backward()
        del out
        model.zero_grad(set_to_none=True)
        _, peak = allocator_peak(lambda: hc(**kwargs).loss.backward())
        assert peak <= hc.budget_bytes
        model.zero_grad(set_to_none=True)
        out = hc(**kwargs, use_cache=True)
        assert out.cache is not None
        out.loss.backward()
        with torch.no_grad():
            assert hc(**kwargs).cache is not None


def test_an_enabled_decoder_whose_parent_hands_on_use_cache_none_fills_no_cache():
    """`hbp.enable(model.model)`: the parent passes `use_cache=None` (the config's choice,
    not the caller's) to the decoder, whose caches require grad; they were planned as outputs
    backward may start from, held until it ended. The decoder now trains without them."""
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    assert model.config.use_cache
    hbp.enable(model.transformer, budget="min")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(**kwargs).loss.backward()
    graph = hbp.engine_of(model.transformer).captured.graph
    assert len(graph.outputs) == 1 and graph.held_outputs == graph.outputs  # the hidden states


def test_a_peft_model_trains_without_its_base_models_key_value_cache():
    """A PEFT model's forward takes `**kwargs` and hands them to its base model, which takes
    `use_cache`: the training step passes it there too."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model, _, kwargs = gpt2()
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    lora = peft.get_peft_model(model, config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hbp.enable(lora, budget="min")
        out = lora(**kwargs)
    assert getattr(out, "cache", None) is None
    out.loss.backward()


def test_measured_peak_is_the_least_plans_own_once_kept_outputs_leave_no_other():
    """A caller keeping a transformers GPT-2's outputs (key/value cache, logits) at 0.4: the
    first step is measured over the budget, no plan fits with the outputs kept, and the plan
    for the least is taken. `measured_peak_bytes` then held the first step's peak for good
    (the loop had stopped); the least plan's next step is measured once, as the allocator
    measures it."""
    torch.manual_seed(0)
    model, args, kwargs = gpt2()
    kwargs = {**kwargs, "use_cache": True}  # NOTE [ A training step keeps no key/value cache ]
    hc = hbp.HCModule(model, budget=0.4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            out = hc(*args, **kwargs)
            out.loss.backward()
            del out
    assert any("planned for the least" in str(w.message) for w in caught)

    def step():
        out = hc(*args, **kwargs)
        out.loss.backward()
        return out

    model.zero_grad(set_to_none=True)
    _, peak = allocator_peak(step)
    assert hc.measured_peak_bytes == peak
    assert peak <= hc.plan.predicted_peak_bytes * 1.001

    hc.budget = 1.0  # a new plan: its closed loop starts afresh, not at its last measurement
    model.zero_grad(set_to_none=True)
    step()
    (compiled,) = hc._compiled.values()
    assert not compiled.last_measurement


def test_kept_outputs_found_after_unseen_memory_are_planned_within_the_budget():
    """Accelerate's mixed precision: the forward under autocast, its outputs converted to
    float32 outside the module (memory the plan cannot see), the caller keeping the output
    (its key/value cache). The first step is over the budget and the closed loop learns by how
    much; the next step shows the kept outputs, and their plan keeps what was learned (NOTE
    [ Kept outputs after unseen memory ]): it is within the budget, not over it a second time."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(vocab_size=512, n_embd=96, n_layer=3, n_head=4, n_positions=256)
    torch.manual_seed(0)
    model = GPTBigCodeForCausalLM(config)
    hbp.enable(model, budget=0.5)
    engine, ids = hbp.engine_of(model), torch.randint(0, 512, (2, 96))
    ratios = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids, use_cache=True)
            out.logits = out.logits.float()  # accelerate's convert_outputs_to_fp32
            out.loss.float().backward()
            model.zero_grad(set_to_none=True)
            ratios.append(engine.measured_peak_bytes / engine.compiled.budget_bytes)
    assert ratios[0] > 1.01  # the float32 logits the plan cannot see
    assert any("the caller keeps output.cache" in str(w.message) for w in caught)
    assert ratios[1] <= 1.01 and ratios[2] <= 1.01, ratios


def test_what_stays_unseen_beyond_the_budget_leaves_a_budget_no_plan_fits():
    """NOTE [ Kept outputs after unseen memory ]: where what the closed loop did not see is the
    whole budget or more (a teacher's forward inside the measured step), the budget left is a
    byte, which no plan fits, so the caller takes the least plan; it was negative, and its
    ConfigError ended the step."""
    from types import SimpleNamespace

    from hbp.integrations.torch.outputs import _less_what_stays_unseen

    compiled = SimpleNamespace(unseen_bytes=5000)
    graph = SimpleNamespace(node=lambda name: SimpleNamespace(output_bytes=100))
    assert _less_what_stays_unseen(1000, compiled, graph, ["logits"]) == 1
    assert _less_what_stays_unseen(10_000, compiled, graph, ["logits"]) == 5100
    assert _less_what_stays_unseen("min", compiled, graph, ["logits"]) == "min"
