"""Capture leaves no trace on the caller's model, whatever fails: hooks (the module's own and
torch's global ones), flags and attributes of every submodule, parameters, buffers, RNG state,
grad mode, autocast and the default dtype are as they were; and a library's first-call set-up
happens as it would without hbp (a cold model captures at operator level)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn.modules import module as module_globals

from hbp.errors import CaptureWarning
from hbp.graph.torch.capture import MODULE, OP, capture
from tests.models.capture import SetsUpThenBranches, llava

_GLOBAL_HOOKS = [n for n in dir(module_globals) if n.startswith("_global_") and "hooks" in n]


def fingerprint(model: torch.nn.Module) -> dict:
    """Everything capture must leave as it found it, by identity where identity matters."""
    modules = {}
    for path, m in model.named_modules():
        modules[path] = {
            key: (
                {k: id(v) for k, v in value.items()}
                if isinstance(value, dict)
                else id(value)
                if isinstance(value, torch.Tensor)
                else value
            )
            for key, value in m.__dict__.items()
            if key != "_seen"
        }
    return {
        "modules": modules,
        "parameters": {
            n: (id(p), p.detach().clone(), p.requires_grad, p.grad)
            for n, p in model.named_parameters()
        },
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "global_hooks": {n: dict(getattr(module_globals, n)) for n in _GLOBAL_HOOKS},
        "rng": torch.get_rng_state(),
        "grad": torch.is_grad_enabled(),
        "dtype": torch.get_default_dtype(),
        "autocast": torch.is_autocast_enabled("cpu"),
    }


def assert_same_fingerprint(before: dict, after: dict) -> None:
    assert before["modules"].keys() == after["modules"].keys()
    for path, attrs in before["modules"].items():
        assert attrs == after["modules"][path], f"module {path!r} changed"
    assert before["parameters"].keys() == after["parameters"].keys()
    for name, (ident, value, requires_grad, grad) in before["parameters"].items():
        now = after["parameters"][name]
        assert now[0] == ident and now[2] == requires_grad and now[3] is grad, name
        assert torch.equal(now[1], value), name
    for name, value in before["buffers"].items():
        assert torch.equal(after["buffers"][name], value), name
    assert before["global_hooks"] == after["global_hooks"]
    assert torch.equal(before["rng"], after["rng"])
    assert (before["grad"], before["dtype"], before["autocast"]) == (
        after["grad"],
        after["dtype"],
        after["autocast"],
    )


def test_a_failing_capture_leaves_the_model_and_torch_as_they_were():
    model = SetsUpThenBranches()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 16)
    before = fingerprint(model)
    with pytest.warns(CaptureWarning, match="operator level"):
        captured = capture(model, (x,))
    assert captured.granularity == MODULE
    assert_same_fingerprint(before, fingerprint(model))
    # and the plain model's own first call sets it up as it would have without hbp
    try:
        assert torch.equal(model(x), twin(x))
        hooks = [len(m._forward_hooks) for m in model.layers]
        assert hooks == [len(m._forward_hooks) for m in twin.layers] == [1, 1, 1]
        assert int(model.steps) == int(twin.steps) == 1
    finally:
        model._global_hook.remove()
        twin._global_hook.remove()


@pytest.mark.slow
def test_a_cold_llava_captures_at_operator_level_and_stays_usable():
    torch.manual_seed(0)
    model, inputs = llava()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        captured = capture(model, (), inputs)
    assert captured.granularity == OP
    # The first-call set-up happened once, as a plain first call does it: same hooks, same
    # flags, and the plain model still runs and gives the plain loss.
    assert torch.equal(model(**inputs).loss, twin(**inputs).loss)
    for (path, m), t in zip(model.named_modules(), twin.modules()):
        assert len(m._forward_hooks) == len(t._forward_hooks), path
        flag = "_output_capturing_hooks_installed"
        assert getattr(m, flag, False) == getattr(t, flag, False), path
