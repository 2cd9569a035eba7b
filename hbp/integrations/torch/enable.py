"""`hbp.enable(model, budget=...)` / `hbp.disable(model)`: hbp turned on in place, the
convention of transformers' `gradient_checkpointing_enable()` and Liger's
`apply_liger_kernel_to_*`.

    hbp.enable(model, budget="50%act")       # returns the model
    trainer = Trainer(model=model, ...)      # or any loop: model(**batch).loss.backward()

NOTE [ Enabled in place ]
The model keeps its class, its parameters, its state_dict keys, its hooks and its methods
(`save_pretrained`, `generate`): only the instance's `forward` changes, to an `EnabledForward`
that has the original forward's signature (`inspect.signature(model.forward)`, which Trainer
reads to keep a batch's columns) and hands training calls to an engine, an HCModule over the
model kept in `model.__dict__` (not a submodule: no state_dict key, no `.modules()` entry).
Calls without grad (`generate`, evaluation under `torch.no_grad()`) run the original forward.
The engine's capture and its module-level executor call the model again; those inner calls
(the engine is `inside`) run the class's forward, inside the layers of a forward set before
(NOTE [ A forward wrapped before enable ] in wrapped_forward.py), and the capture runs without
the model's own forward hooks (they run once, around the enabled forward, as nn.Module calls
them).
`disable` puts back the forward the instance had (none, or one set by another library before).
Enabling an enabled model with the same budget and options does nothing; with another budget,
block_size or planner only, the engine plans its captures again (NOTE [ Options changed after
the first step ] in planning.py); with other options it is replaced.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from hbp.errors import BudgetWarning, ConfigError
from hbp.integrations.torch.compile import dynamo_callback_set
from hbp.integrations.torch.module import DEFAULT_BUDGET, ENGINE_ATTR, HCModule
from hbp.integrations.torch.parallel import inner_model
from hbp.integrations.torch.warn import warn_at_caller
from hbp.integrations.torch.wrapped_forward import ForwardLayers, warned_layers

__all__ = ["EnabledForward", "disable", "enable", "engine_of", "is_enabled"]


class _Engine(HCModule):
    """HCModule over a model whose own `forward` is an `EnabledForward`: the plain call is
    the original forward, train/eval flags are the model's."""

    ROOT_HOOKS_RUN = True

    def __init__(self, model: nn.Module, previous_forward, budget, options: dict):
        super().__init__(model, budget, **options)
        self.previous_forward = previous_forward  # an instance forward set before, or None
        self.options = (budget, options)
        self.inside = False
        self.called_with_grad = False  # NOTE [ Training that goes around forward ]
        # NOTE [ A forward wrapped before enable ] in wrapped_forward.py
        self.layers = ForwardLayers()
        if previous_forward is not None:
            self.layers = warned_layers(previous_forward, model, "hbp.enable")

    def original_forward(self, *args, **kwargs):
        """The forward the instance had before enable: calls without grad."""
        if self.previous_forward is not None:
            return self.previous_forward(*args, **kwargs)
        return self.class_forward(*args, **kwargs)

    def class_forward(self, *args, **kwargs):
        """The class's forward: the engine's own calls, inside the training call's layers."""
        return type(self.module).forward(self.module, *args, **kwargs)

    def _plain(self, *args, **kwargs):
        return self.class_forward(*args, **kwargs)

    def _instance_layers(self) -> ForwardLayers:
        return self.layers  # of the forward the instance had: its own is the enabled one

    def train_call(self, args, kwargs, compiled_segments: bool = False):
        """`enter` inside the layers of the forward the instance had before (NOTE [ A
        forward wrapped before enable ] in wrapped_forward.py)."""
        return self.layers.run(lambda a, k: self.enter(a, k, compiled_segments), args, kwargs)

    @torch.compiler.disable(reason="hbp runs its plan outside Dynamo")
    def enter(self, args, kwargs, compiled_segments: bool = False):
        """The training call; `compiled_segments`: under torch.compile(model), which the plan
        answers with each segment compiled (NOTE [ torch.compile of an HCModule ])."""
        self.training = self.module.training
        self.inside = True
        try:
            return self._step(args, kwargs, compiled_segments=compiled_segments)
        finally:
            self.inside = False

    def _compile(self, *args, **kwargs):
        """Capture and plan without the model's own forward hooks: they run around the
        enabled forward (nn.Module's call) as usual, so the graph must not hold them too."""
        hooks = self.module._forward_hooks, self.module._forward_pre_hooks
        saved = [dict(h) for h in hooks]
        for h in hooks:
            h.clear()
        try:
            return super()._compile(*args, **kwargs)
        finally:
            for h, items in zip(hooks, saved):
                h.update(items)


class EnabledForward:
    """The `forward` of an enabled model: training calls go to its engine, the rest to the
    original forward (NOTE [ Enabled in place ])."""

    __name__ = "forward"

    def __init__(self, engine: _Engine):
        self.engine = engine

    @property
    def __wrapped__(self):  # inspect.signature(model.forward): the original's
        engine = self.engine
        if engine.previous_forward is not None:
            return engine.previous_forward
        return types.MethodType(type(engine.module).forward, engine.module)

    @property
    def __doc__(self):  # noqa: D105
        return type(self.engine.module).forward.__doc__

    def __call__(self, *args, **kwargs):
        engine = self.engine
        if engine.inside:
            return engine.class_forward(*args, **kwargs)
        if not torch.is_grad_enabled():
            return engine.original_forward(*args, **kwargs)
        engine.called_with_grad = True  # NOTE [ Training that goes around forward ]
        # asked here: inside `enter`, which Dynamo does not trace, torch.compile is not seen
        compiling = torch.compiler.is_compiling() or dynamo_callback_set()
        return engine.train_call(args, kwargs, compiling)


def enable(model: nn.Module, budget: Any = DEFAULT_BUDGET, **options) -> nn.Module:
    """Make `model`'s training steps fit `budget` with the least recompute, in place.

    Args:
        model: any nn.Module (a whole model, or a submodule such as `model.model`).
        budget: any form of `hbp.Budget` (fraction, "N%act", bytes, size, "min", "fit").
        options: HCModule's keyword options (planner, block_size, plan_cache,
            keeps_outputs, calibrate, compile, loss_fn, plan_in_eval, verbose).

    Returns:
        `model` itself, with `forward` replaced (NOTE [ Enabled in place ]); a DDP or
        DataParallel wrapper with its `.module`'s (NOTE [ Data-parallel wrappers ]).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "an nn.Module")
    if inner_model(model) is not model:  # NOTE [ Data-parallel wrappers ] in parallel.py
        enable(inner_model(model), budget, **options)
        return model
    engine = model.__dict__.get(ENGINE_ATTR)
    if engine is not None:
        if _without_plan_options(engine.options[1]) == _without_plan_options(options):
            _set_plan_options(engine, budget, options)  # the captures are kept (or nothing new)
            return model
        disable(model)
    previous = model.__dict__.get("forward")
    engine = _Engine(model, previous, budget, options)
    model.__dict__[ENGINE_ATTR] = engine
    model.__dict__["forward"] = EnabledForward(engine)
    _watch_training_around(engine, model)
    return model


def _watch_training_around(engine: _Engine, model: nn.Module) -> None:
    """Warn once where a backward reaches `model`'s parameters before any call of its
    forward with grad (NOTE [ Training that goes around forward ])."""
    param = next((p for p in model.parameters() if p.requires_grad), None)
    if param is None:
        return
    handles = []

    def reached(_param) -> None:
        handles.pop().remove()
        if engine.called_with_grad or model.__dict__.get(ENGINE_ATTR) is not engine:
            return
        warn_at_caller(
            f"hbp.enable({type(model).__name__}): a backward reached its parameters, but "
            "its forward was not called with grad: training through other methods (a VAE's "
            "encode and decode) runs them plainly, with no budget. Enable the modules they "
            "call (hbp.enable(model.encoder)), or train through forward.",
            BudgetWarning,
        )

    handles.append(param.register_post_accumulate_grad_hook(reached))


# NOTE [ Training that goes around forward ]
# `enable` replaces `forward`; a model trained through other methods (diffusers' AutoencoderKL
# through `encode` and `decode`) never calls it, and its steps ran plainly, with no word (a
# new user's VAE "enabled" at the default budget measured the plain step). The first time a
# gradient is accumulated into one of the model's parameters, `enable` checks that its forward
# was called with grad, and warns once if not. The hook goes with its first call; copies and
# pickles of the model do not carry it.


#: HCModule's options that change its plans only (NOTE [ Options changed after the first
#: step ] in planning.py), or where they are kept (`plan_cache`), with their defaults
#: (HCModule's own): enabled again with other values, the captures are kept.
PLAN_OPTIONS = {
    name: inspect.signature(HCModule.__init__).parameters[name].default
    for name in ("block_size", "planner", "plan_cache", "carry_plans")
}


def _without_plan_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in PLAN_OPTIONS}


def _set_plan_options(engine: _Engine, budget, options: dict) -> None:
    """`engine` planning for `budget` and `options`' plan options from its next call, on
    the captures it has made (the same options as its own: nothing changes). All of them or,
    where one is malformed, none (ConfigError)."""
    names = ("budget", *PLAN_OPTIONS)
    before = [getattr(engine, name) for name in names]
    try:
        engine.budget = budget
        for name, default in PLAN_OPTIONS.items():
            setattr(engine, name, options.get(name, default))
    except ConfigError:
        for name, value in zip(names, before):
            setattr(engine, name, value)
        raise
    engine.options = (budget, options)


def disable(model: nn.Module) -> nn.Module:
    """Undo `enable`: the model's forward is the one it had before; on a model that is not
    enabled itself, on every enabled module inside it (a PEFT model whose base model was
    enabled). Returns `model`."""
    if inner_model(model) is not model:
        disable(inner_model(model))
        return model
    engine = model.__dict__.pop(ENGINE_ATTR, None)
    if engine is None:
        for inside in _enabled_inside(model):
            disable(inside)
        return model
    if engine.previous_forward is not None:
        model.__dict__["forward"] = engine.previous_forward
    else:
        model.__dict__.pop("forward", None)
    return model


def is_enabled(model: nn.Module) -> bool:
    """Whether `hbp.enable` is on for `model` (inside a DDP / DataParallel wrapper)."""
    return ENGINE_ATTR in inner_model(model).__dict__


def engine_of(model: nn.Module) -> HCModule | None:
    """The HCModule that runs an enabled model's training steps (`.plan`, `.summary()`,
    `.measured_peak_bytes`): an HCModule itself, the engine `enable` attached, or, for a model
    that is not enabled itself (a PEFT model whose base model was enabled, a wrapper), the
    engine of the one enabled module inside it; None where there is none, or several."""
    if isinstance(model, HCModule):
        return model
    engine = inner_model(model).__dict__.get(ENGINE_ATTR)
    if engine is not None:
        return engine
    inside = _enabled_inside(inner_model(model))
    return inside[0].__dict__[ENGINE_ATTR] if len(inside) == 1 else None


def _enabled_inside(model: nn.Module) -> list[nn.Module]:
    """The enabled modules inside `model` (itself excluded), outermost first; not those
    inside an enabled one (an engine runs its whole module)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and ENGINE_ATTR in module.__dict__:
            if not any(name.startswith(f"{outer}.") for outer, _ in found):
                found.append((name, module))
    return [module for _, module in found]
