"""The trace stage's proxy: an fx Proxy that carries its node's fake value, so that shape
queries, Python attributes and branches on one-element tensors are answered as the real run
would answer them (`hbp.graph.torch.trace` makes them)."""

from __future__ import annotations

import builtins
import sys
from typing import Any

import torch
import torch.fx as fx

from hbp.graph.torch.breaks import guard, other_branch_raises
from hbp.graph.torch.fake import MISSING

__all__ = ["InputAttributeRead", "ValueProxy"]


class InputAttributeRead(Exception):
    """The forward reads a Python attribute of an input tensor (`getattr(x, "scale", 1.0)`,
    `x.scale = 3.0` set by the caller). No tracer can capture that: fx's graph would hold the
    attribute's value at capture, and export's fake inputs do not have it, so its graph took
    the default, silently. The capture falls back to module level, which runs the forward
    itself (NOTE [ Attributes a tensor does not have ])."""


_CONCRETE_TYPES = (bool, int, float, str, torch.Size, torch.dtype, torch.device, torch.layout)


class ValueProxy(fx.Proxy):
    """An fx Proxy that knows its node's fake value: shape queries return concrete values."""

    def _value(self) -> Any:
        return self.tracer.values.get(self.node, MISSING)

    def _tensor(self) -> torch.Tensor | None:
        v = self._value()
        return v if isinstance(v, torch.Tensor) else None

    def _symbolic(self, method: str, *args):
        return self.tracer.create_proxy("call_method", method, (self, *args), {})

    def size(self, dim=None):
        t = self._tensor()
        if t is None:
            return self._symbolic("size") if dim is None else self._symbolic("size", dim)
        return t.size() if dim is None else t.size(dim)

    def dim(self):
        t = self._tensor()
        return self._symbolic("dim") if t is None else t.dim()

    def numel(self):
        t = self._tensor()
        return self._symbolic("numel") if t is None else t.numel()

    @property
    def shape(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "shape") if t is None else t.shape

    @property
    def ndim(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "ndim") if t is None else t.ndim

    @property
    def dtype(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "dtype") if t is None else t.dtype

    @property
    def device(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "device") if t is None else t.device

    @property
    def is_cuda(self):
        t = self._tensor()
        return fx.proxy.Attribute(self, "is_cuda") if t is None else t.is_cuda

    def __len__(self):
        v = self._value()
        if v is MISSING or not hasattr(v, "__len__"):
            return super().__len__()
        return len(v)

    def __iter__(self):
        v = self._value()
        if isinstance(v, (tuple, list)):
            return iter([self[i] for i in range(len(v))])
        if isinstance(v, torch.Tensor) and v.dim() > 0:  # `q, k, v = qkv`: eager unbinds dim 0
            parts = self._symbolic("unbind", 0)
            return iter([parts[i] for i in range(v.shape[0])])
        return super().__iter__()

    def keys(self):
        v = self._value()
        return v.keys() if isinstance(v, dict) else super().keys()

    def __bool__(self):
        v = self._value()
        if isinstance(v, (bool, int, float)):  # a specialised Python value, not a tensor
            return bool(v)
        frame = sys._getframe(1)  # NOTE [ Data-dependent ops ]: a real run if a side raises
        if isinstance(v, torch.Tensor) and v.numel() == 1 and other_branch_raises(frame, None):
            taken = bool(self.tracer.real(self.node))
            if other_branch_raises(frame, taken):
                self.tracer.create_proxy("call_function", guard, (self, taken), {})
                return taken
        return super().__bool__()

    def __getattr__(self, k: str):
        # Tensor methods stay lazy (`x.view(...)` becomes one call_method node). Plain
        # attributes specialise: Python values (`x.requires_grad`, `x.is_leaf`) are returned
        # as they are, tensors (`x.T`, `x.mT`) become getattr nodes that carry their value.
        if k.startswith("__") or callable(getattr(torch.Tensor, k, None)):
            return super().__getattr__(k)
        v = self._value()
        if isinstance(v, torch.Tensor):
            try:
                attr = getattr(v, k)
            except AttributeError:
                if not self.tracer.may_have_attribute(self.node, k):
                    raise  # NOTE [ Attributes a tensor does not have ]
                if self.node.op == "placeholder":
                    raise InputAttributeRead(
                        f"forward reads the Python attribute {k!r} of the input tensor "
                        f"{self.node.target!r}: a traced graph would keep the value it has now"
                    ) from None
                attr = MISSING
            except Exception:  # noqa: BLE001
                attr = MISSING
            if attr is None or isinstance(attr, _CONCRETE_TYPES):
                return attr
        return self.tracer.create_proxy("call_function", builtins.getattr, (self, k), {})


# NOTE [ Attributes a tensor does not have ]
# Code asks tensors for attributes they may not have: transformers' `is_tracing(x)` reads
# `hasattr(x, "jax")` to detect torchax. A proxy answers every attribute with a new node, so
# `hasattr` was True, the next line called `x.jax()`, and the fake run of that node failed:
# every transformers model fell from this tracer to the export tracer, after a whole trace.
# An attribute the node's fake value lacks raises AttributeError, as the real tensor would,
# where the fake value speaks for the real one: computed values (their fake run made them
# as the real run would). A placeholder's or a parameter's real tensor may carry Python
# attributes its fake copy lacks (quantisation state, a library's hook data): there the
# real value is asked. Where an input tensor has the attribute, no op-level graph is made
# (`InputAttributeRead`): fx would keep the value it has at capture, and export's fake inputs
# lack it (the forward took its default, silently); module level runs the forward itself.
