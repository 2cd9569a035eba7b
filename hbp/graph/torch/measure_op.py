"""One op measured alone by the allocator: its forward and its backward in one profiler
window, its output gradient laid out as the step's will be (the scratch calibration's unit,
`hbp.graph.torch.calibrate`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves, tree_map

from hbp.allocator import allocator_peaks
from hbp.graph.torch.modes import MODES, enter_modes

__all__ = ["Strides", "fetch_attr", "measure_op", "run_node", "without_hooks"]

#: A gradient layout: the strides of a dense gradient, or its strides followed by its storage
#: offset and its storage's length in elements (a view into a larger gradient: a slice of a
#: `torch.cat`'s, through the views before it); None for the output's own layout.
Strides = tuple[int, ...]


def measure_op(
    gm: fx.GraphModule,
    node: fx.Node,
    args,
    kwargs,
    cat_dim: int | None = None,
    strides: Strides | None = None,
    value: list | None = None,
) -> tuple[int, int, tuple[Strides | None, ...]] | None:
    """(forward, backward, grad_strides) of one run of `node` on `args`: the allocator peaks
    above the level before each, bytes, and for each tensor leaf of (args, kwargs) the
    strides of the gradient the backward returned for it (None: none, or one that is not
    dense); None when the op cannot run alone. `strides`: the output gradient's (else the
    output's own layout, or a slice of a `torch.cat`'s gradient). `value`: where given, the
    forward's output, detached, is appended to it (NOTE [ A measured op's output is its
    value ]); nothing where the op cannot run alone."""
    leaves = tree_leaves((args, kwargs))
    device = next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)
    if device is None:
        return None
    grad_inputs = [t for t in leaves if _is_grad_leaf(t)]
    swapped = contextlib.nullcontext()
    if node.op == "call_module":  # NOTE [ The measured run leaves the caller's hooks alone ]
        module = gm.get_submodule(node.target)
        alias_of: dict[int, torch.Tensor] = {}  # one alias per parameter: tied names share it
        aliases = {
            name: alias_of.setdefault(id(p), without_hooks(p))
            for name, p in module.named_parameters(remove_duplicate=False)
        }
        swapped = _reparametrize_module(module, aliases)
        grad_inputs += [p for p in alias_of.values() if p.requires_grad]
    grad_inputs = list({id(t): t for t in grad_inputs}.values())
    seed_bytes: list[int] = []
    state: dict[str, Any] = {}

    def run_forward() -> None:
        with torch.enable_grad(), swapped:
            out = run_node(gm, node, args, kwargs)
        state["outputs"] = [
            t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ]
        if value is not None:  # NOTE [ A measured op's output is its value ]
            state["value"] = tree_map(_detached, out)
        if not state["outputs"] or not grad_inputs:
            state["out"] = out

    def set_up() -> None:  # between the two measured calls
        outputs = state.get("outputs")
        if not outputs or not grad_inputs:
            return

        def seeds() -> list[torch.Tensor]:
            made = [_seed_like(t, cat_dim, strides) for t in outputs]
            seed_bytes.extend(t.untyped_storage().nbytes() for t in made)
            return made

        with torch.enable_grad():
            anchor = _SeededGradients.apply(seeds, *outputs)
        state["anchor"] = anchor
        state["one"] = torch.ones_like(anchor)  # as the step's loss gradient
        state.pop("outputs")  # the anchor's graph holds what the backward needs

    def run_backward():
        if "anchor" not in state:
            return None
        anchor, one = state.pop("anchor"), state.pop("one")
        return torch.autograd.grad(anchor, grad_inputs, one, allow_unused=True)

    try:
        # one allocator window, so that the frees of what the forward saved count in the backward (a composite op's backward
        # frees its saved intermediates as it goes: math attention's probabilities)
        (_, _, grads), (forward, _, backward) = allocator_peaks(
            run_forward, set_up, run_backward, device=device
        )
        if grads is None:
            # an op that returns its input itself (`.to` its own dtype) hands its gradient on
            same = {id(t) for t in tree_leaves(state["out"]) if isinstance(t, torch.Tensor)}
            return forward, 0, tuple(strides if id(t) in same else None for t in leaves)
        backward = max(0, backward - sum(seed_bytes))  # the step holds its gradient already
    except Exception:  # noqa: BLE001 - an op that cannot run alone keeps the fake estimate
        return None
    if value is not None:
        value.append(state["value"])
    by_id = {id(t): g for t, g in zip(grad_inputs, grads)}
    return forward, backward, tuple(_layout(by_id.get(id(t))) for t in leaves)


# NOTE [ The measured run leaves the caller's hooks alone ]
# An op measured alone ran on the parameters themselves (an op's parameter argument, a module
# the graph calls as one node), and its measured backward computed their gradients: a hook of
# the caller's on a parameter (`p.register_hook`: gradient-norm logging) ran on them, twice
# before the step's own call in a new-user trial (norms 67.9 and 1617.0, then the step's
# 0.0028). The measured run takes aliases of the parameters (the same storage, without their
# hooks): as arguments (`without_hooks`, from `_Values.prepare` in calibrate.py), and swapped
# into a module node's module for its forward, its backward asking for their gradients.


def without_hooks(value: Any) -> Any:
    """An alias of a tensor that requires grad (its storage, without its autograd hooks);
    anything else as it is (NOTE [ The measured run leaves the caller's hooks alone ])."""
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return value.detach().requires_grad_(True)
    return value


# NOTE [ A measured op's output is its value ]
# The calibration runs the graph forward to hand each op its inputs, and measures each new op
# signature by running it again, forward and backward, under the allocator: a measured op ran
# twice, and on a large model the ops measured are its largest (GPT-2's LM head and its loss,
# a sixth of the calibration). The measured forward's output is the value the graph run
# needs, so the run takes it (`measure_op(..., value=)`), detached. Holding it from the end of
# the forward changes nothing measured: the output gradients' maker (`_SeededGradients`,
# through its closure) holds the outputs through the backward already, and the output's
# other tensors (indices) would be freed at the end of the forward, after its peak; held,
# they raise the backward's starting level and each point after it by the same bytes.


def _detached(t: Any) -> Any:
    return t.detach() if isinstance(t, torch.Tensor) else t


class _SeededGradients(torch.autograd.Function):
    """A scalar whose backward hands the op's outputs the gradients `make()` creates. The
    engine then owns them alone and frees each once the autograd node that reads it is done,
    as in the step, where a gradient passed to `torch.autograd.grad` would stay referenced
    through the whole backward: an op run as several autograd nodes (a batched matmul's
    reshape, then its bmm) would be charged its incoming gradient beside a copy of it that
    replaces it in the step."""

    @staticmethod
    def forward(ctx, make, *outputs):
        ctx.make = make
        return torch.zeros((), device=outputs[0].device)

    @staticmethod
    def backward(ctx, _):
        return (None, *ctx.make())


def _layout(t: torch.Tensor | None) -> Strides | None:
    """`t`'s layout (`Strides`) where its elements do not overlap: its strides where they are
    dense (no gaps), else its strides, offset and storage length; else None."""
    if t is None or t.is_sparse:
        return None
    expected, dense = 1, True  # the dims by stride must cover distinct elements
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride < expected:
            return None
        dense = dense and stride == expected
        expected = stride * size
    if dense:  # a whole gradient, or a dense part of one: measured as a whole one
        return tuple(t.stride())
    length = t.untyped_storage().nbytes() // t.element_size()
    return (*t.stride(), t.storage_offset(), length)


def run_node(gm: fx.GraphModule, node: fx.Node, args, kwargs) -> Any:
    modes = node.meta.get(MODES)
    with enter_modes(modes) if modes else contextlib.nullcontext():
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            obj, *rest = args
            return getattr(obj, node.target)(*rest, **kwargs)
        # `forward`, not `__call__`: the module's hooks must not see the calibration
        return gm.get_submodule(node.target).forward(*args, **kwargs)


def fetch_attr(root: nn.Module, target: str) -> Any:
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _seed_like(
    t: torch.Tensor, cat_dim: int | None, strides: Strides | None = None
) -> torch.Tensor:
    """The output gradient for a measured backward, laid out as the step's will be: `strides`
    where a user's backward hands them back (NOTE [ The layout of an output's gradient ]); a
    value whose only user is `torch.cat` gets a slice of the cat's gradient (non-contiguous
    across channels: a convolution's backward copies it, which is workspace too); else one of
    the output's layout."""
    if strides is not None and len(strides) == t.dim():
        seed = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
        return seed.fill_(1)
    if strides is not None and len(strides) == t.dim() + 2:  # a view into a larger gradient
        *view, offset, length = strides
        storage = torch.ones(length, dtype=t.dtype, device=t.device)
        return storage.as_strided(t.shape, view, offset)
    if cat_dim is None or t.dim() == 0:
        return torch.ones_like(t)
    dim = cat_dim % t.dim()
    shape = list(t.shape)
    shape[dim] *= 2
    return torch.ones(shape, dtype=t.dtype, device=t.device).narrow(dim, 0, t.shape[dim])


def _is_grad_leaf(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None
