"""A `forward` another library set on the model instance before `hbp.enable`, read into the
layers it puts around the class's forward, so that the engine's training calls run inside the
same layers (NOTE [ A forward wrapped before enable ]).

    layers = warned_layers(model.__dict__["forward"], model, "hbp.enable")
    out = layers.run(engine_step, args, kwargs)  # engine_step(args, kwargs) inside them
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["ForwardLayers", "layers_of", "warned_layers"]

#: How deep a chain of wrappers is followed before it counts as not understood.
MAX_LAYERS = 16


class ForwardLayers(NamedTuple):
    """The layers an instance forward adds around the class's forward, outermost first: each
    one wraps a callable the way that layer wraps the class's forward."""

    rewraps: tuple[Callable[[Callable], Callable], ...] = ()
    #: the first layer that is not understood (its name); None where every one is
    unknown: str | None = None

    def run(self, step: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """`step(args, kwargs)` inside the same layers."""
        if not self.rewraps:
            return step(args, kwargs)

        def call(*args, **kwargs):
            return step(args, kwargs)

        for rewrap in reversed(self.rewraps):
            call = rewrap(call)
        return call(*args, **kwargs)


def layers_of(forward: Any, model: torch.nn.Module) -> ForwardLayers:
    """The layers of `forward` (an instance forward of `model`) down to `type(model).forward`:
    `torch.autocast` used as a decorator (accelerate's mixed precision), accelerate's cast of
    the outputs back to fp32 and the function that calls it; any other layer is `unknown`."""
    base, rewraps, layer = type(model).forward, [], forward
    for _ in range(MAX_LAYERS):
        if isinstance(layer, types.MethodType) and layer.__self__ is model:
            layer = layer.__func__  # bound to the model: the function it binds
        elif layer is base:
            return ForwardLayers(tuple(rewraps))
        elif (autocast := _autocast_of(layer)) is not None:
            rewraps.append(autocast)  # `autocast(fn)`: the same context around `fn`
            layer = layer.__wrapped__
        elif _is_fp32_outputs(layer):
            rewraps.append(type(layer))  # `ConvertOutputsToFp32(fn)`: the same cast after `fn`
            layer = layer.model_forward
        elif _qualname(layer) == "convert_outputs_to_fp32.<locals>.forward":
            layer = layer.__wrapped__  # calls the converter it wraps, nothing else
        else:
            return ForwardLayers(unknown=_name(layer))
    return ForwardLayers(unknown=_name(forward))


def warned_layers(forward: Any, model: torch.nn.Module, who: str) -> ForwardLayers:
    """`layers_of(forward, model)`, with a warning that names a layer hbp does not know
    (`who`: the caller, as the warning names it)."""
    layers = layers_of(forward, model)
    if layers.unknown is not None:
        warnings.warn(
            f"{who}: {type(model).__name__}'s forward was replaced by {layers.unknown} before "
            "hbp saw it; its training steps run the class's forward without that wrapper "
            "(calls without grad still run it). Enable hbp (or wrap the model) before the "
            "library that set it.",
            UserWarning,
            stacklevel=4,
        )
    return layers


# NOTE [ A forward wrapped before enable ]
# Accelerate's `prepare` with mixed precision sets the model instance's `forward` to the
# class's forward inside `torch.autocast`, its outputs cast back to fp32. `hbp.enable` after
# it keeps that forward for calls without grad, but the engine's training call captures and
# runs the class's forward (fx traces `type(model).forward`): the step ran in fp32, silently.
# The layers such a forward adds are read once, at enable, and the engine's training call
# runs inside the same layers: the autocast is then the call's own, which the capture and
# the executor honour as they do a caller's `with torch.autocast(...)`. A layer hbp does not
# know (another library's wrapper, a user's decorator) may do anything around the forward, so
# it is not guessed at: `enable` warns that training calls run without it, and says to enable
# before the library that set it.


def _autocast_of(layer: Any) -> Callable[[Callable], Callable] | None:
    """The `torch.autocast` whose decorator made `layer`, or None."""
    if _qualname(layer) != "autocast_decorator.<locals>.decorate_autocast":
        return None
    if not hasattr(layer, "__wrapped__"):
        return None
    for cell in layer.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.autocast):
            return value
    return None


def _is_fp32_outputs(layer: Any) -> bool:
    return type(layer).__name__ == "ConvertOutputsToFp32" and callable(
        getattr(layer, "model_forward", None)
    )


def _qualname(layer: Any) -> str:
    """The qualified name of a function's code (`functools.wraps` rewrites its
    `__qualname__` to the wrapped function's, not its code's)."""
    if not isinstance(layer, types.FunctionType):
        return ""
    code = layer.__code__
    return getattr(code, "co_qualname", code.co_name)


def _name(layer: Any) -> str:
    module = getattr(layer, "__module__", None) or type(layer).__module__
    name = getattr(layer, "__qualname__", None) or type(layer).__qualname__
    return f"{module}.{name}"
