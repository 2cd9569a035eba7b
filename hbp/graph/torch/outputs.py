"""A forward's return value as a template: tensors replaced by slots, containers kept.

The captured graph returns a flat tuple of tensors; `map_output` takes the module's real
return value apart into that tuple plus a template, and puts it back together from the
template and the tuple the executor computed, with the module's own container types.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["OutputSlot", "map_output"]


@dataclass(frozen=True)
class OutputSlot:
    """Where the i-th value the captured graph returns goes in the module's return value."""

    index: int


def map_output(value: Any, leaf_type: type, fn: Callable[[Any], Any], objects: bool = True) -> Any:
    """`value` with every `leaf_type` instance in it replaced by `fn(leaf)`, containers
    rebuilt with their own types: tuples, namedtuples, lists, dicts and dict subclasses
    (`OrderedDict`, HuggingFace's `ModelOutput`), dataclasses, and (`objects=True`) any other
    object holding a leaf in its attributes at any depth (transformers' `DynamicCache`: a list
    of layers holding key and value tensors), rebuilt as a shallow copy with those attributes
    replaced. An object reached twice is rebuilt once. With `objects=False` such an object
    raises TypeError."""
    return _Rebuild(leaf_type, fn, objects).rebuild(value)


# NOTE [ No reference cycle through the outputs ]
# The walk is a class, not nested functions: a nested function that calls itself holds
# itself through its closure cell, a reference cycle that lives until the garbage collector
# runs, and `fn` (HCModule's lookup of the graph's flat outputs) would be in it. The module's
# outputs then stayed alive after the caller let them go (the logits through the whole
# backward of `model(**batch).loss.backward()`).


class _Rebuild:
    """One walk of `map_output` (see NOTE [ No reference cycle through the outputs ])."""

    def __init__(self, leaf_type: type, fn: Callable[[Any], Any], objects: bool):
        self.leaf_type, self.fn, self.objects = leaf_type, fn, objects
        self.memo: dict[int, Any] = {}

    def holds_leaf(self, v: Any, seen: set[int]) -> bool:
        if isinstance(v, self.leaf_type):
            return True
        if id(v) in seen or isinstance(v, (str, bytes, int, float, type)) or v is None:
            return False
        seen.add(id(v))
        if isinstance(v, (tuple, list)):
            return any(self.holds_leaf(x, seen) for x in v)
        if isinstance(v, dict):
            return any(self.holds_leaf(x, seen) for x in v.values())
        return any(self.holds_leaf(x, seen) for x in _attributes(v).values())

    def rebuild(self, v: Any) -> Any:
        if isinstance(v, self.leaf_type):
            return self.fn(v)
        if id(v) in self.memo:
            return self.memo[id(v)]
        if isinstance(v, tuple):
            items = [self.rebuild(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        if type(v) is list:
            return [self.rebuild(x) for x in v]
        if type(v) in (dict, OrderedDict):
            return type(v)((k, self.rebuild(x)) for k, x in v.items())
        if isinstance(v, (list, dict)) or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
            return _rebuilt_copy(v, self.rebuild)
        attrs = _attributes(v)
        if not any(self.holds_leaf(x, set()) for x in attrs.values()):
            return v
        if not self.objects:
            raise TypeError(
                f"the forward returns a {type(v).__name__} holding tensors: HCModule can rebuild "
                "tuples, lists, dicts (and subclasses) and dataclasses"
            )
        new = self.memo[id(v)] = copy.copy(v)
        for k, x in attrs.items():
            object.__setattr__(new, k, self.rebuild(x))
        return new


def _attributes(v: Any) -> dict[str, Any]:
    """The instance attributes of a plain Python object ({} for modules and classes)."""
    from torch import nn

    if isinstance(v, (type, nn.Module)) or not hasattr(v, "__dict__"):
        return {}
    return dict(vars(v))


def _rebuilt_copy(v: Any, rebuild: Callable[[Any], Any]) -> Any:
    """A shallow copy of a list/dict subclass or dataclass with its items and fields rebuilt,
    set without calling the class's own `__setitem__`/`__setattr__`/`__post_init__`."""
    new = copy.copy(v)
    if isinstance(v, list):
        list.__init__(new, [rebuild(x) for x in v])
    if isinstance(v, dict):
        for k, x in v.items():
            dict.__setitem__(new, k, rebuild(x))
    if dataclasses.is_dataclass(v):
        for f in dataclasses.fields(v):
            if hasattr(v, f.name):
                object.__setattr__(new, f.name, rebuild(getattr(v, f.name)))
    return new
