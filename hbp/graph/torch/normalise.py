"""Normalise stage: in-place ops made out of place where that is exact, and the buffers an
op updates in place.

An in-place op at a segment boundary would have to be recomputed from its already mutated
input (the executor then clones the input: memory the plan did not predict). Where no other
view of the mutated storage is read afterwards (`nn.ReLU(inplace=True)` after BatchNorm,
`x.add_(y)`, `aten.relu_`), the op is made out of place: same values, and an op the IR and the
executor can cut before without cloning. The profile stage calls this right after profiling
an in-place node, and profiles it again out of place."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional as F

from hbp.graph.ir import Node
from hbp.graph.torch.fake import storage_key, tensor_leaves
from hbp.graph.torch.op_profile import OpProfile

_aten = torch.ops.aten

# In-place ops whose out-of-place form is not `x = x.op(...)` (random fills, copies, resizes).
_NOT_FUNCTIONAL = set(
    "bernoulli_ cauchy_ copy_ detach_ exponential_ fill_ geometric_ log_normal_ normal_ "
    "random_ requires_grad_ resize_ resize_as_ set_ share_memory_ uniform_ zero_".split()
)


# Leaf activation/dropout modules with `inplace=True` -> (functional form, its arguments).
_INPLACE_MODULES: dict[type, Callable[[nn.Module], tuple[Callable, dict]]] = {
    nn.ReLU: lambda m: (F.relu, {}),
    nn.ReLU6: lambda m: (F.relu6, {}),
    nn.SiLU: lambda m: (F.silu, {}),
    nn.Mish: lambda m: (F.mish, {}),
    nn.SELU: lambda m: (F.selu, {}),
    nn.Hardswish: lambda m: (F.hardswish, {}),
    nn.Hardsigmoid: lambda m: (F.hardsigmoid, {}),
    nn.LeakyReLU: lambda m: (F.leaky_relu, {"negative_slope": m.negative_slope}),
    nn.ELU: lambda m: (F.elu, {"alpha": m.alpha}),
    nn.CELU: lambda m: (F.celu, {"alpha": m.alpha}),
    nn.Hardtanh: lambda m: (F.hardtanh, {"min_val": m.min_val, "max_val": m.max_val}),
    nn.Threshold: lambda m: (F.threshold, {"threshold": m.threshold, "value": m.value}),
    nn.Dropout: lambda m: (F.dropout, {"p": m.p, "training": m.training}),
    nn.Dropout1d: lambda m: (F.dropout1d, {"p": m.p, "training": m.training}),
    nn.Dropout2d: lambda m: (F.dropout2d, {"p": m.p, "training": m.training}),
    nn.Dropout3d: lambda m: (F.dropout3d, {"p": m.p, "training": m.training}),
    nn.AlphaDropout: lambda m: (F.alpha_dropout, {"p": m.p, "training": m.training}),
}


def mutates_persistent(
    node: fx.Node, profile: OpProfile, values: dict[fx.Node, Any], persistent_keys: set[int]
) -> bool:
    """Whether `node` mutates (a view of) a parameter, buffer or constant in place: such an
    update is the point of the op (`self.running.mul_(0.9).add_(x)`) and must stay in place."""
    mutated = set(profile.mutated_inputs)
    return any(
        storage_key(t) in persistent_keys
        for src in node.all_input_nodes
        if src.name in mutated
        for t in tensor_leaves(values.get(src))
    )


def out_of_place(
    node: fx.Node,
    ir_node: Node,
    profile: OpProfile,
    gm: fx.GraphModule,
    by_name: dict[str, Node],
    earlier: list[fx.Node],
    order: dict[fx.Node, int],
    values: dict[fx.Node, Any],
) -> bool:
    """Make the in-place op `node` out of place where that cannot change any value the
    program reads; return whether it did (the fx graph changed, `node` must run again).

    An in-place op at a segment boundary would have to be recomputed from its already
    mutated input (the executor then clones the input: memory the plan did not predict). Out
    of place, the op allocates its own output, which the IR models exactly; the old value dies
    as soon as nothing reads it (in-place activations after BatchNorm: right away). Only done
    when the op mutates one value, that value is not (a view of) a graph input, and no other
    view of its storage made before the op (`earlier`: the nodes profiled so far, with their
    IR nodes in `by_name`, their fake values in `values`) is read after it; later readers of
    the mutated value are redirected to the op's result."""
    mutated = profile.mutated_inputs
    if len(mutated) != 1 or ir_node.alias_of != mutated[0] or changes_metadata(node):
        return False

    def root(name: str) -> str:
        while by_name[name].alias_of:
            name = by_name[name].alias_of
        return name

    value = next(n for n in node.all_input_nodes if n.name == mutated[0])
    if value.op == "placeholder" or by_name[root(value.name)].is_input:
        return False
    base = root(value.name)
    mutated = _storages(values.get(value))
    for other in earlier:
        if other is value or root(other.name) != base:
            continue
        others = _storages(values.get(other))
        if mutated and others is not None and mutated.isdisjoint(others):
            continue  # NOTE [ Elements of one op's tuple ]
        if any(order[user] > order[node] for user in other.users):
            return False  # another view of the storage is read afterwards: it must see the change
    if not _make_out_of_place(node, gm):
        return False
    for user in list(value.users):
        if user is not node and order[user] > order[node]:
            user.replace_input_with(value, node)
    return True


def changes_metadata(node: fx.Node) -> bool:
    """Whether `node` is an in-place view op (`unsqueeze_`, `transpose_`, `t_`, ...: ATen's
    `inplace_view` tag), which changes its input's shape or strides rather than its values
    (NOTE [ In-place view ops stay in place ])."""
    if node.op == "call_method" and isinstance(node.target, str):
        packet = getattr(torch.ops.aten, node.target, None)
        op = getattr(packet, "default", None)
    elif node.op == "call_function":
        op = node.target
        if not isinstance(op, torch._ops.OpOverload):
            packet = getattr(torch.ops.aten, getattr(op, "__name__", ""), None)
            op = getattr(packet, "default", None)
    else:
        return False
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.inplace_view in op.tags


# NOTE [ In-place view ops stay in place ]
# An in-place op made out of place is run again, on the value it already ran on. A value op
# (`add_`) wrote into the fake input's data, which fake tensors do not have; an in-place view
# op changed the input's shape or strides, which the second run then saw: BigBird-Pegasus'
# `unsqueeze_` ran twice, gave a (2, 1, 1, 12, 16, 48) tensor where the forward has (2, 1, 12,
# 16, 48), a later `add_` failed to broadcast, and the whole model fell back to module level.
# Such ops stay in place: every holder of the tensor sees the new shape, as in the forward.


def _storages(value: Any) -> set[int] | None:
    """The storages of `value`'s tensors; None where one cannot be told."""
    keys = {storage_key(t) for t in tensor_leaves(value)}
    return None if None in keys else keys


# NOTE [ Elements of one op's tuple ]
# The IR makes the elements of an op's tuple (`topk`'s values and indices, `var_mean`'s two
# results) aliases of the op's node, which owns their bytes, so two elements share a root as
# two views of one tensor do. Two views of one storage must keep an in-place op on one of
# them in place (the other must see the change); two elements of a tuple are separate
# storages and need not. Mixtral's and Qwen2-MoE's routers divide the top-k weights in place
# (`routing_weights /= routing_weights.sum(...)`) and read the top-k indices after: the
# division stayed in place, and a recomputed segment starting between the two could not
# clone the weights exactly (the executor refused the "min" plan at its first step). The fake
# values tell the storages apart: where the mutated value's storages and the other's are
# disjoint, the other is no view of it.


# ATen norms that update running statistics in place without saying so in their schema (they
# are composite): op -> (positions of running mean and var, position of the training flag).
_RUNNING_STATS_ARGS = {
    _aten.batch_norm.default: ((3, 4), 5),
    _aten.instance_norm.default: ((3, 4), 5),
}


def updated_running_stats(node: fx.Node) -> list[str]:
    """`get_attr` targets of the running statistics an ATen norm node updates (exported
    graphs: BatchNorm is `aten.batch_norm` on the module's buffers, not a module call)."""
    spec = _RUNNING_STATS_ARGS.get(node.target) if node.op == "call_function" else None
    if spec is None:
        return []
    positions, training = spec
    if len(node.args) <= training or not node.args[training]:
        return []
    stats = [node.args[i] for i in positions]
    return [a.target for a in stats if isinstance(a, fx.Node) and a.op == "get_attr"]


def _functional_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """`aten.relu.default` for `aten.relu_.default`: the out-of-place twin of an ATen op that
    writes its first argument only and returns it, with the same other arguments."""
    schema = op._schema
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__") or name in _NOT_FUNCTIONAL:
        return None
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if len(written) != 1 or written[0] is not schema.arguments[0]:
        return None
    packet = getattr(_aten, name[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None:
        return None
    same = [a.name for a in twin._schema.arguments] == [a.name for a in schema.arguments]
    return twin if same and not twin._schema.is_mutable else None


def _make_out_of_place(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_method":
        name = node.target
        functional = name[:-1]
        if name.endswith("__") or not name.endswith("_") or name in _NOT_FUNCTIONAL:
            return False
        if not callable(getattr(torch.Tensor, functional, None)):
            return False
        node.target = functional
        return True
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        make = _INPLACE_MODULES.get(type(module))
        if make is None or not getattr(module, "inplace", False):
            return False
        fn, kwargs = make(module)
        node.meta["hbp_module"] = node.target
        node.op, node.target = "call_function", fn
        node.kwargs = {**node.kwargs, **kwargs}
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        twin = _functional_overload(node.target)
        if twin is None:
            return False
        node.target = twin
        return True
    if node.op == "call_function":
        fn = node.target
        name = getattr(fn, "__name__", "")
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "inplace" in params:
            bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
            if bound.arguments.get("inplace") is not True:
                return False
            bound.arguments["inplace"] = False
            node.args, node.kwargs = bound.args, bound.kwargs
            return True
        functional = getattr(torch, name[:-1], None) if name.endswith("_") else None
        if functional is None or name in _NOT_FUNCTIONAL or fn is not getattr(torch, name, None):
            return False
        node.target = functional
        return True
    return False
