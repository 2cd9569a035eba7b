"""HCModule's step has the plain model's results: outputs and every parameter's and input's
gradient equal those of plain autograd on a copy with the same weights, inputs and seed
(bitwise where the ops are deterministic), dropout masks replayed by the recompute, tied and
frozen parameters, inputs without grad, retain_graph and double backward, bfloat16 weights,
and several optimizer steps in a row."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.compare import (
    assert_all_same,
    assert_within_budget,
    causal_lm_step,
    compare,
    minimum_budget,
    run_step,
    sdpa_input_counts,
    step_holding_outputs,
)
from helpers.step import assert_same_step
from models.cases import CASE, images
from models.real import qwen3_lm
from models.toy import (
    BatchNormMLP,
    ConvNeXt,
    D,
    DropoutMLP,
    EncoderViT,
    Mixer,
    TinyMobileNetV2,
)
from models.traits import RandomOps, SharedBlock, TiedFrozenLM

import hbp


def test_dropout_mlp_same_results_and_masks_less_memory_more_flops():
    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(256, D, requires_grad=True)
    params = [x, *model.parameters()]
    masks = {"plain": [], "hc": []}
    key = ["plain"]
    # the masks as bytes, not tensors: tensors kept by the hook would count in the peak
    model.layers[2][2].register_forward_hook(
        lambda m, i, o: masks[key[0]].append(bytes((o == 0).numpy()))
    )
    plain = step_holding_outputs(model, params, x)
    hc = hbp.HCModule(model, budget=0.4, calibrate=False)
    key[0] = "hc"
    with pytest.warns(UserWarning, match="forward hooks on layers.2.2 run again"):
        got = step_holding_outputs(hc, params, x)
    assert_all_same(plain[0], got[0])
    assert_all_same(plain[1], got[1])
    assert len(masks["hc"]) > 1  # the forward's dropout mask and the recomputes'...
    assert all(masks["plain"][0] == m for m in masks["hc"])  # ...are the plain step's
    plan = hc.plan
    assert any(s.recompute for s in plan.segments)
    assert got[2] <= 1.05 * plan.budget_bytes  # measured peak within the budget
    assert got[2] < 0.6 * plain[2]
    # Recomputation really happens and costs at most the predicted FLOPs (non-reentrant
    # checkpoint's early stop can skip the last op of a recompute pass: its inputs, the only
    # thing it saves, are packed before it runs).
    assert 0 < got[3] - plain[3] <= plan.predicted_recompute_flops


def test_tied_weights_frozen_parameters_and_integer_inputs():
    torch.manual_seed(0)
    model = TiedFrozenLM()
    idx, targets = torch.randint(0, 50, (16, 24)), torch.randint(0, 50, (16, 24))
    params = list(model.parameters())
    expected = step_holding_outputs(model, params, idx, targets)
    hc = hbp.HCModule(model, budget=0.7, calibrate=False)
    got = step_holding_outputs(hc, params, idx, targets)
    assert_all_same(expected[0], got[0])
    assert_all_same(expected[1], got[1])
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    assert model.emb.weight.grad is not None  # tied: embedding + head contributions summed


def test_input_that_does_not_require_grad_and_one_that_does():
    torch.manual_seed(0)
    model = DropoutMLP(depth=3)
    x = torch.randn(256, D)
    hc = hbp.HCModule(model, budget=0.6, calibrate=False)
    expected = step_holding_outputs(model, list(model.parameters()), x)
    got = step_holding_outputs(hc, list(model.parameters()), x)
    assert_all_same(expected[1], got[1])
    assert hc.captured.graph.nodes[0].requires_grad is False
    y = torch.randn(256, D, requires_grad=True)
    expected = step_holding_outputs(model, [y], y)
    got = step_holding_outputs(hc, [y], y)
    assert_all_same(expected[1], got[1])


@pytest.mark.parametrize(
    "make_model, budget", [(Mixer, 0.5), (ConvNeXt, 0.4)], ids=["mixer", "convnext"]
)
def test_mlp_mixer_and_convnext_blocks(make_model, budget):
    hc, plain, got = compare(make_model, (images(),), budget=budget, block_size=2)
    assert_within_budget(hc, got, plain)


@pytest.mark.parametrize(
    "make_model, make_input, budget, exact",
    [
        (SharedBlock, lambda: torch.randn(256, 64, requires_grad=True), 0.5, False),
        (RandomOps, lambda: torch.randn(256, 64), 0.7, True),
    ],
    ids=["module_called_three_times", "random_ops_replay_the_same_draws"],
)
def test_shared_weights_and_random_ops_match_plain(make_model, make_input, budget, exact):
    """A module called three times shares its weights' gradients; dropout, rand_like and
    randn replay the plain step's draws (bitwise equal results)."""
    hc, plain, got = compare(make_model, (make_input(),), budget=budget, exact=exact)
    assert_within_budget(hc, got, plain, recomputes=False)
    assert any(s.recompute for s in hc.plan.segments)


def test_retain_graph_and_double_backward_through_recomputed_segments():
    """Non-reentrant checkpoint enters the recompute context once per recompute; a
    `@contextmanager` object cannot be entered twice (AttributeError on the second backward
    before the fix). BatchNorm statistics are still updated once."""
    torch.manual_seed(0)
    model = BatchNormMLP()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.5, calibrate=False)
    x = torch.randn(128, 64, requires_grad=True)

    def twice(module, inp):
        torch.manual_seed(0)
        out = module(inp)
        (grad_x,) = torch.autograd.grad(out.square().sum(), inp, create_graph=True)
        loss = out.sum() + grad_x.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return out.detach()

    x_ref = x.detach().clone().requires_grad_()
    torch.testing.assert_close(twice(hc, x), twice(reference, x_ref))
    assert any(s.recompute for s in hc.plan.segments)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(a, b), name
    assert model.layers[1].num_batches_tracked.item() == 1


def test_bfloat16_weights_after_wrapping():
    torch.manual_seed(0)
    model = ConvNeXt()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    hc = hbp.HCModule(model, budget=0.5, block_size=2, calibrate=False).to(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = images().bfloat16()
    expected = run_step(reference, reference, (x,))
    got = run_step(hc, model, (x,))
    assert_same_step(expected, got, exact=True)
    assert_within_budget(hc, got, expected)


def test_repeated_optimizer_steps_match_the_plain_model(count_captures):
    """Three SGD steps with dropout and BatchNorm: same weights and running statistics after
    every step; one capture for the three."""
    torch.manual_seed(0)
    model = TinyMobileNetV2()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(
        model, budget=minimum_budget(CASE["mobilenetv2"]), block_size=2, calibrate=False
    )
    captures = count_captures()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    target = torch.randint(0, 10, (8,))
    for step in range(3):
        x = torch.randn(8, 3, 32, 32)
        for module, optimizer in ((hc, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            torch.manual_seed(step)
            F.cross_entropy(module(x), target).backward()
            optimizer.step()
        for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    assert captures == [1]
    assert model.features[1].num_batches_tracked.item() == 3


@pytest.mark.slow
def test_adamw_three_steps_match_plain_training(count_captures):
    torch.manual_seed(0)
    model = EncoderViT()
    reference = copy.deepcopy(model)
    hc = hbp.HCModule(model, budget=0.5, block_size=2, calibrate=False)
    captures = count_captures()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for step in range(3):
        x, y = images(), torch.randint(0, 10, (4,))
        for module, optimizer in zip((hc, reference), optimizers):
            optimizer.zero_grad()
            torch.manual_seed(step)
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
        for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    assert captures == [1]


def test_packed_position_ids_passed_keep_the_mask():
    """Position ids the caller passes are values the plan cannot depend on: the mask stays,
    and two sequences packed per row attend within their own sequence."""
    pytest.importorskip("transformers")
    model = qwen3_lm()
    ids = torch.randint(0, 256, (2, 64))
    positions = torch.arange(32).repeat(2).expand(2, -1)  # two sequences of 32 per row
    plain = copy.deepcopy(model)
    expected = causal_lm_step(plain, plain, input_ids=ids, position_ids=positions)
    hc = hbp.HCModule(model, budget=0.5, calibrate=False)
    got = causal_lm_step(model, hc, input_ids=ids, position_ids=positions)
    assert sdpa_input_counts(hc) == [4, 4]  # q, k, v and the mask
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


def _blocks() -> torch.nn.Sequential:
    """Six (Linear, Tanh) blocks, each a module a hook can go on."""
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(6)]
    )


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())]
    )


def test_module_backward_hooks_run_as_in_the_plain_model():
    """A full backward hook that scales a layer's input gradient, and a pre-hook: a planned
    step has no module boundaries to run them at, so such calls run the plain module, with a
    warning (NOTE [ Module backward hooks ]); the gradients were silently unscaled before."""
    x = torch.randn(32, 64)
    for register in ("register_full_backward_hook", "register_full_backward_pre_hook"):
        grads, calls = [], []
        for wrap in (False, True):
            model = _mlp()

            def hook(module, *grads_in_or_out, wrap=wrap, calls=calls):
                calls.append(wrap)
                return tuple(None if g is None else 3.0 * g for g in grads_in_or_out[0])

            getattr(model[6], register)(hook)
            run = hbp.HCModule(model, budget="min") if wrap else model
            if wrap:
                with pytest.warns(hbp.BudgetWarning, match="backward hooks .* on 6 are not run"):
                    run(x).square().mean().backward()
            else:
                run(x).square().mean().backward()
            grads.append([p.grad for p in model.parameters()])
        assert calls == [False, True]
        for a, b in zip(*grads):
            assert torch.equal(a, b)


def test_parameters_swapped_by_functional_call_give_the_plain_gradients():
    """`torch.func.functional_call` with fast weights (p * 0.99, as MAML's): a recompute in
    backward read the module's own parameters, back in place by then (NOTE [ Parameters
    swapped for one call ]); such calls run the plain module, with a warning."""
    x = torch.randn(32, 64)
    grads = []
    for wrap in (False, True):
        model = _mlp()
        run = hbp.HCModule(model, budget="min") if wrap else model
        fast = {f"module.{n}" if wrap else n: p * 0.99 for n, p in model.named_parameters()}
        if wrap:
            with pytest.warns(hbp.BudgetWarning, match="functional_call"):
                torch.func.functional_call(run, fast, (x,)).square().mean().backward()
        else:
            torch.func.functional_call(run, fast, (x,)).square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_a_parameter_hook_sees_the_steps_gradient_once():
    """The calibration measured ops on the parameters themselves (an op's argument, a module
    node's own), and a hook of the caller's on one saw those gradients before the step's own
    (NOTE [ The measured run leaves the caller's hooks alone ])."""

    class AddMM(torch.nn.Module):  # its weight an argument of the op (as GPT-2's Conv1D)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(64, 64) / 8)

        def forward(self, x):
            return torch.addmm(x, x, self.weight).tanh()

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[AddMM() for _ in range(4)], *_mlp())
    model[6].register_forward_hook(lambda *_: None)  # a module node (NOTE [ A module with
    # forward hooks is one node ] in hbp/graph/torch/trace.py)
    hooked = (model[1].weight, model[6].weight)
    seen = [[] for _ in hooked]
    for p, got in zip(hooked, seen):
        p.register_hook(lambda g, got=got: got.append(g.clone()))
    hc = hbp.HCModule(model, budget="min")
    x = torch.randn(512, 64)
    for step in range(2):
        hc(x).square().mean().backward()
        for p, got in zip(hooked, seen):  # the step's gradient, once, accumulated into .grad
            assert len(got) == step + 1
            assert torch.equal(p.grad, got[0] if step == 0 else got[0] + got[1])


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_forward_hook_that_stores_an_activation_sees_every_steps_tensor(tracer, monkeypatch):
    """A hook that stores a block's output for an auxiliary loss (feature distillation).
    Traced through by fx, it stored the tracer's value at the first step and nothing later;
    the module is now one node, called with its hooks at every step (NOTE [ A module with
    forward hooks is one node ]). Where only the export tracer reaches the step (a diffusers
    UNet2DModel given a tensor timestep), it ran on export's fake tensors: the caller's loss
    and the parameters' .grad were fake tensors; the step now falls back to module level,
    whose calls run the hooks on real tensors."""
    from hbp.graph.torch import capture as capture_stage

    if tracer == "export":
        monkeypatch.setattr(capture_stage, "_TRACERS", (capture_stage._export_trace,))
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = _blocks()
        stored = {}
        model[2].register_forward_hook(lambda m, i, o, stored=stored: stored.update(h=o))
        run = hbp.HCModule(model, budget="min") if wrap else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's CaptureWarning, the closed loop's
            for step in range(3):
                x = torch.randn(512, 64, generator=torch.Generator().manual_seed(step))
                loss = run(x).square().mean() + stored.pop("h").square().mean()
                loss.backward()
                assert all(type(p.grad) is torch.Tensor for p in model.parameters())
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
        results.append((losses, [p.detach() for p in model.parameters()]))
        if wrap:
            assert run.captured.granularity == ("op" if tracer == "fx" else "module")
            assert tracer == "export" or any(s.recompute for s in run.plan.segments)
    assert all(map(torch.equal, results[0][0], results[1][0]))
    assert all(map(torch.equal, results[0][1], results[1][1]))


@pytest.mark.parametrize("hooked", [0, 2, 5])
def test_the_recomputed_hooks_warning_is_said_where_a_hook_runs_again(hooked):
    """ "forward hooks on ... run again" was said wherever the plan recomputed anything; it is
    said where a hooked module's call is recomputed, that is where the hook runs more than
    once a step."""
    torch.manual_seed(0)
    model = _blocks()
    calls = []
    model[hooked].register_forward_hook(lambda *_: calls.append(1))
    hc = hbp.HCModule(model, budget="min", calibrate=False)
    x = torch.randn(512, 64)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        hc(x).square().mean().backward()
    calls.clear()
    hc(x).square().mean().backward()
    warned = any("run again when HCModule recomputes" in str(w.message) for w in said)
    assert any(s.recompute for s in hc.plan.segments)
    assert warned == (len(calls) > 1), (len(calls), warned)
