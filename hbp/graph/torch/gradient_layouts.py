"""The capture stage after the profile: which pass-through gradients stay the node's output
gradient, given the layouts the gradients arrive in (NOTE [ Gradients in the layout they
arrive in ])."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from hbp.graph.ir import Node
from hbp.graph.torch.fake import Faker, run_fx_node, storage_key, tensor_layout
from hbp.graph.torch.modes import MODES

__all__ = ["check_pass_through"]

# NOTE [ Gradients in the layout they arrive in ]
# The profile runs each op's backward alone, on a fresh dense output gradient, and a node whose
# backward hands that gradient (or a view of it) to an input is recorded as passing it
# through (`Node.grad_passthrough`): no new storage. But the gradient a node receives in the
# step is the one its consumers' backwards made, and a view's backward can only stay a view of
# a gradient whose strides allow it: attention's backward hands the query's head split
# (`view(b, s, h, d).transpose(1, 2)`) a contiguous gradient, `transpose`'s backward
# transposes it, and the `view`'s backward (a `reshape`) then has to copy it: a new gradient
# the size of the projection's output (96 such views at 32 Llama layers). The predicted peaks
# of the Llamas and the attention block tried did not change, and the allocator agreed with
# them before and after; the IR now says where the storage is new. So, in backward order,
# each node that can change a gradient's layout or be given one it has not been profiled with
# (a view, an op that changes the shape, a node whose output gradient arrives as a view) is
# run again on fake tensors with the gradient it would be given: the first gradient to arrive
# at its output, where that was not a fresh dense one. An input whose gradient is then new
# storage no longer passes through; an input whose gradient is a view not in dense layout gets
# that gradient as its first one. The first gradient to arrive at a value is its last
# consumer's, in forward order, as the simulator has it.


def check_pass_through(
    nodes: list[Node], fx_nodes: list[fx.Node], values: dict[fx.Node, Any], gm, faker: Faker
) -> int:
    """Drop from each node's `grad_passthrough` the inputs whose gradient its backward copies
    when given the gradient it receives in the step; return how many it dropped."""
    arriving: dict[str, tuple] = {}  # the first gradient's layout of a value, if not dense
    reached: set[str] = set()  # values some gradient has reached
    known: dict[tuple, list] = {}  # `_input_gradients` by `_signature`
    dropped = 0
    for ir, node in zip(reversed(nodes), reversed(fx_nodes)):
        given = arriving.get(ir.name)
        out = values.get(node)
        passing = set(ir.grad_passthrough)
        if passing and _worth_a_run(ir, node, out, given, values):
            key = _signature(node, gm, values, passing, given)
            found = known.get(key) if key is not None else None
            if found is None:
                found = _input_gradients(node, gm, faker, values, out, given, passing)
                if key is not None:
                    known[key] = found
            for name, (shared, layout) in zip(_passing_inputs(node, passing), found):
                if shared is None:
                    continue
                if not shared:
                    ir.grad_passthrough = tuple(v for v in ir.grad_passthrough if v != name)
                    dropped += 1
                elif name not in reached and layout is not None:
                    arriving[name] = layout
        reached.update(ir.inputs)
    return dropped


def _signature(node: fx.Node, gm, values, passing: set[str], given) -> tuple | None:
    """What `_input_gradients` depends on, for nodes alike (the layers of a stack): the op,
    its arguments (values by layout, which of them pass a gradient on) and the gradient
    given; None where an argument is not a plain constant."""
    if node.op == "call_module":
        sub = gm.get_submodule(node.target)
        op: Any = (type(sub), repr(sub))
    else:
        op = (node.op, node.target)
    described: list = []
    flat, _ = tree_flatten((node.args, node.kwargs))
    for a in flat:
        if isinstance(a, fx.Node):
            v = values.get(a)
            if not isinstance(v, torch.Tensor):
                return None
            described.append((a.name in passing, tensor_layout(v)))
        elif a is None or isinstance(a, (bool, int, float, str, torch.dtype)):
            described.append(a)
        else:
            return None
    return (op, tuple(described), given)


def _worth_a_run(ir: Node, node: fx.Node, out: Any, given, values) -> bool:
    """Whether the node can change a gradient's layout or is given one its profile did not
    see: a view, a change of shape, or an output gradient that arrives as a view."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if not isinstance(out, torch.Tensor) or node.meta.get(MODES):
        return False
    if given is not None or ir.alias_of is not None:
        return True
    shapes = {
        tuple(v.shape)
        for n in node.all_input_nodes
        if n.name in ir.grad_passthrough and isinstance(v := values.get(n), torch.Tensor)
    }
    return shapes != {tuple(out.shape)}


def _passing_inputs(node: fx.Node, passing: set[str]) -> list[str]:
    """The names of the node's arguments that pass a gradient on, in argument order."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    names = [a.name for a in flat if isinstance(a, fx.Node) and a.name in passing]
    return list(dict.fromkeys(names))


def _input_gradients(node, gm, faker, values, out, given, passing) -> list:
    """Per `_passing_inputs` name, (whether the gradient the node's backward gives it shares
    the output gradient's storage, its layout where it is not dense), or (None, None) where
    it gets none, for an output gradient laid out as `given` (None: a fresh dense one), on
    fake tensors; [] where the node cannot run."""
    leaves: dict[str, torch.Tensor] = {}

    def leaf(n: fx.Node):
        value = values[n]
        if n.name in passing and isinstance(value, torch.Tensor) and value.requires_grad:
            leaves.setdefault(n.name, value.detach().requires_grad_(True))
            return leaves[n.name]
        return value

    with faker.mode:
        seed = (
            torch.empty(out.shape, dtype=out.dtype, device=out.device)
            if given is None
            else _made(given, out)
        )
        args, kwargs = fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: leaf(a) if isinstance(a, fx.Node) else a
        )
        if not leaves:
            return []
        try:
            result = run_fx_node(node, gm, faker, args, kwargs)
            if not isinstance(result, torch.Tensor) or result.shape != seed.shape:
                return []
            grads = torch.autograd.grad(result, list(leaves.values()), seed, allow_unused=True)
        except (RuntimeError, NotImplementedError, TypeError):
            return []
    by_name = dict(zip(leaves, grads))
    return [
        (None, None)
        if (g := by_name.get(name)) is None
        else (storage_key(g) == storage_key(seed), None if _dense(g) else _layout(g))
        for name in _passing_inputs(node, passing)
    ]


def _layout(t: torch.Tensor) -> tuple:
    """(shape, strides, storage offset, storage length in elements) of `t`."""
    return (
        tuple(t.shape),
        tuple(t.stride()),
        t.storage_offset(),
        t.untyped_storage().nbytes() // t.element_size(),
    )


def _made(layout: tuple, like: torch.Tensor) -> torch.Tensor:
    """A tensor of `layout` (`_layout`) and `like`'s dtype and device, on a storage of its own."""
    shape, stride, offset, length = layout
    storage = torch.empty(length, dtype=like.dtype, device=like.device)
    return storage.as_strided(shape, stride, offset)


def _dense(t: torch.Tensor) -> bool:
    """A fresh gradient's layout: contiguous, from offset 0, the whole of its storage."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
