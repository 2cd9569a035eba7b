"""Trace stage for eager-only Python: a module's forward captured by running it on fake tensors.

`export_trace(module, args, kwargs) -> ExportedTrace` is the capture's second way to get an
op-level fx graph, used where `torch.fx` symbolic tracing fails (hbp.graph.torch.capture
tries that first). Real models are written for eager PyTorch: decorated forwards
(`functools.wraps`), `**kwargs`, `torch.is_tensor(x)` / `isinstance` / `len(x.shape)` on
arguments, output dataclasses, attention-mask construction. A symbolic proxy cannot answer
those questions; running the forward's Python on fake tensors can. That is non-strict
`torch.export` (`strict=False`): the forward runs as plain Python, every tensor op is recorded
at the pre-dispatch ATen level (`aten.linear`, `aten.layer_norm`, `aten.dropout`,
`aten.scaled_dot_product_attention`, `aten.batch_norm`: the ops eager runs, not their
decompositions), and the result is specialised to the input signature, as hbp's plans are.

The exported program is unlifted (`ExportedProgram.module()`): parameters and buffers are
`get_attr` nodes on the *module's own* tensor objects (gradients reach the user's
parameters; in-place buffer updates such as BatchNorm's running statistics hit the real
buffers). Then it is normalised into the shape the rest of the capture expects
(`_normalise`, see NOTE [ Exported graphs ]).

# NOTE [ Exported graphs ]
What differs from a symbolic-traced graph, and what `_normalise` does about it:
- Inputs: placeholders are the pytree leaves of `(args, kwargs)` (`ExportedTrace.in_spec`),
  not forward parameters.
- Outputs: the forward's return value may hold objects pytree does not know (transformers'
  `DynamicCache` when `use_cache` is on). The module is exported through `_FlatOutputs`,
  which returns the tensors of the output as a flat tuple and keeps the rest as a template
  (`OutputSlot`s where tensors were; objects rebuilt by `hbp.graph.torch.outputs.map_output`).
- `with torch.no_grad()` / `torch.autocast(...)` regions become higher-order ops around
  submodules: they are inlined, each node recording its modes in `MODES` as the symbolic
  tracer does, so a plan can cut inside them.
- Export's own guard call and metadata asserts are dropped (the plan cache keys on the
  input signature already).
- In-place ATen ops (`relu_`, `dropout_`, `add_`) stay; the profile stage makes them out of
  place where that is exact, as for symbolic graphs.
- Export-only paths: libraries ask `torch.compiler.is_exporting()` to build a program that
  holds for every input, where eager takes a shortcut that depends only on the call's
  signature. transformers' attention masks are the case that costs memory: with no
  `attention_mask` passed, eager SDPA runs with `is_causal=True` or no mask at all, while
  under export it builds the full `[batch, 1, q, k]` mask, which SDPA on CPU turns into a
  float mask and saves for backward in every layer (memory the plain step does not use).
  hbp's graph is specialised to the signature and runs
  eagerly, so the trace takes eager's path (`_eager_paths`): transformers' mask helpers see
  "not exporting". Shortcuts that read mask *values* still see fake tensors (transformers'
  `is_tracing`) and keep the mask: a plan never depends on the values of an input. One
  value check reads no input: transformers' packed-sequence check
  (`find_packed_sequence_indices`) reads the position ids, which a model without
  `position_ids` / `cache_position` arguments makes from `torch.arange` over the sequence
  length, one sequence per row; eager finds no packing and lets SDPA run causal without a
  mask, while any trace (fx proxies, fake tensors) builds the full mask, and grouped-query
  attention then repeats the keys and values per head instead of SDPA's `enable_gqa`
  (Qwen3 at budget 1.0: 8.4% above the plain step). Where the call passes neither argument,
  both tracers answer as eager does (`eager_shortcuts`); where it passes either, the values
  are the caller's and the mask stays.

Capturing does not change the module: parameters and buffers are fakes during the trace,
Python attributes the forward assigns are put back by the caller (`hbp.graph.torch.capture`), and the
caller restores the RNG state.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from hbp.graph.torch.modes import MODES
from hbp.graph.torch.outputs import OutputSlot, map_output
from hbp.graph.torch.trace import function_apply_replaced

__all__ = ["ExportedTrace", "eager_shortcuts", "export_trace", "OUTPUT_ROOT"]

#: Attribute path of the user's module inside the exported graph module (see `_FlatOutputs`).
OUTPUT_ROOT = "inner"

_aten = torch.ops.aten
_higher_order = torch.ops.higher_order

# Nodes that only check what the plan cache already guarantees (shapes, dtypes, devices).
_ASSERTS = {
    _aten._assert_tensor_metadata.default,
    _aten._assert_scalar.default,
    _aten._assert_async.msg,
    _aten.sym_constrain_range_for_size.default,
    _aten.sym_constrain_range.default,
}


@dataclass
class ExportedTrace:
    """An op-level fx graph of one forward, ready for the profile stage.

    Attributes:
        gm: the graph module; its parameters and buffers are the module's own tensors (under
            `OUTPUT_ROOT.`); placeholders are the leaves of `(args, kwargs)`.
        in_spec: the pytree spec of `(args, kwargs)` the placeholders flatten.
        inputs: placeholder name -> the real leaf value of this call.
        output_template: the forward's return value with `OutputSlot(i)` for the i-th tensor
            the graph returns.
    """

    gm: fx.GraphModule
    in_spec: pytree.TreeSpec
    inputs: dict[str, Any]
    output_template: Any


def export_trace(module: nn.Module, args: tuple, kwargs: dict, modes: tuple) -> ExportedTrace:
    """Trace `module(*args, **kwargs)` with non-strict `torch.export` and normalise the graph.

    `modes` is `ambient_modes()` of the call: the base the inlined no-grad and
    autocast regions record their differences from. Raises whatever export raises (the
    capture then falls back)."""
    flat_module = _FlatOutputs(module)
    with _eager_paths(), _custom_functions_refused(), _quiet_failures():
        exported = torch.export.export(flat_module, tuple(args), dict(kwargs), strict=False)
    gm = exported.module()
    leaves, in_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    _normalise(gm, modes)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise RuntimeError(
            f"the exported graph has {len(placeholders)} inputs for {len(leaves)} argument leaves"
        )
    return ExportedTrace(gm, in_spec, dict(zip(placeholders, leaves)), flat_module.template)


@contextlib.contextmanager
def _custom_functions_refused():
    """Within: applying a custom `torch.autograd.Function` to a tensor that requires grad
    raises. Export records the ops of its forward and drops its backward, so the graph's
    gradient would be autograd's derivative of the forward, not the Function's (a
    straight-through estimator's identity would become round()'s zero); the capture falls
    back instead (NOTE [ Custom autograd Functions ] in hbp.graph.torch.trace says how the symbolic
    trace keeps them). Torch's own Functions pass: the ones torch.library generates for a
    custom op's registered autograd (transformers' `grouped_mm_fallback` for mixture-of-experts
    layers) run below the op, which the graph records as one node whose autograd kernel is
    the Function."""

    def apply(real_apply, cls, *args, **kwargs):
        leaves = pytree.tree_leaves((args, kwargs))
        if (
            cls.__module__.split(".")[0] != "torch"
            and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves)
        ):
            raise NotImplementedError(
                f"custom autograd Function {cls.__qualname__}: torch.export records its "
                "forward's ops and drops its backward"
            )
        return real_apply(*args, **kwargs)

    with function_apply_replaced(apply):
        yield


#: (module name, attribute) of library functions that say "torch.export is running" and whose
#: callers take an eager shortcut otherwise (see NOTE [ Exported graphs ], export-only paths).
_EXPORTING_CHECKS = (("transformers.masking_utils", "is_torchdynamo_exporting"),)


@contextlib.contextmanager
def _quiet_failures():
    """Within: what export writes to stderr is held back and written after it, less what it
    writes only because it failed. On a data-dependent value export prints the partial graph
    it traced (thousands of lines on a transformers model) and the symbolic-shapes logger
    warns that it cannot find the user code; the capture falls back and its CaptureWarning
    says why."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except Exception as err:
        partial = getattr(err, "partial_fx_graph", None)
        text = held.getvalue()
        held = io.StringIO(text.replace(f"{partial}\n", "") if partial else text)
        raise
    finally:
        logger.setLevel(level)
        sys.stderr.write(held.getvalue())


@contextlib.contextmanager
def _eager_paths():
    """Make the library checks in `_EXPORTING_CHECKS` answer "not exporting" (the modules
    already imported; nothing is imported here)."""
    patched = []
    try:
        for module_name, attribute in _EXPORTING_CHECKS:
            library = sys.modules.get(module_name)
            if library is not None and callable(getattr(library, attribute, None)):
                patched.append((library, attribute, getattr(library, attribute)))
                setattr(library, attribute, _not_exporting)
        yield
    finally:
        for library, attribute, original in reversed(patched):
            setattr(library, attribute, original)


def _not_exporting() -> bool:
    return False


#: Arguments through which a caller gives transformers models their token positions: where
#: the call passes none, the model makes them from the sequence length.
_POSITION_ARGUMENTS = ("position_ids", "cache_position")


@contextlib.contextmanager
def eager_shortcuts(arguments: dict[str, Any]):
    """Within: transformers' packed-sequence check finds no packing, as eager does, where the
    call (`arguments`: the forward's bound arguments) passes no token positions (see NOTE
    [ Exported graphs ], export-only paths). For both tracers."""
    extra = arguments.get("kwargs")
    extra = extra if isinstance(extra, dict) else {}
    passed = any(
        arguments.get(name) is not None or extra.get(name) is not None
        for name in _POSITION_ARGUMENTS
    )
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if passed or not callable(original):
        yield
        return
    masking.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    return None


class _FlatOutputs(nn.Module):
    """`module` returning the tensors of its output as one flat tuple; the rest of the output
    (containers, caches, non-tensor fields) is kept as a template (see NOTE [ Exported graphs ]).

    The template goes to a closure, not a module attribute: export puts module attributes
    back (and may copy the module) after tracing; a function is never copied."""

    def __init__(self, module: nn.Module):
        super().__init__()
        setattr(self, OUTPUT_ROOT, module)
        templates: list[Any] = []

        def record(template: Any = None) -> Any:
            if template is not None:
                templates.append(template)
            return templates[-1] if templates else None

        self.__dict__["_record"] = record

    @property
    def template(self) -> Any:
        return self.__dict__["_record"]()

    def forward(self, *args, **kwargs):
        tensors: list[torch.Tensor] = []

        def slot(t: torch.Tensor) -> OutputSlot:
            tensors.append(t)
            return OutputSlot(len(tensors) - 1)

        out = getattr(self, OUTPUT_ROOT)(*args, **kwargs)
        self.__dict__["_record"](map_output(out, torch.Tensor, slot, objects=True))
        return tuple(tensors)


def _normalise(gm: fx.GraphModule, modes: tuple) -> None:
    """Drop export's guards and asserts, inline no-grad/autocast regions with their modes."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target.startswith("_guards"):
            graph.erase_node(node)
        elif node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    while _inline_first_region(gm, modes):
        pass
    graph.eliminate_dead_code()
    graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _inline_first_region(gm: fx.GraphModule, base: tuple) -> bool:
    """Inline the first `wrap_with_set_grad_enabled` / `wrap_with_autocast` node of `gm`; its
    nodes run in the region's modes (`MODES`). Returns whether there was one."""
    for node in gm.graph.nodes:
        region = _region_modes(node, base) if node.op == "call_function" else None
        if region is not None:
            _inline(gm, node, region, base)
            return True
    return False


def _region_modes(node: fx.Node, base: tuple) -> tuple | None:
    """The modes inside a no-grad / autocast region node (None for any other node)."""
    outer = node.meta.get(MODES, base)
    grad, cpu, cuda = outer
    if node.target is _higher_order.wrap_with_set_grad_enabled:
        return (bool(node.args[0]), cpu, cuda)
    if node.target is _higher_order.wrap_with_autocast:
        device, dtype, enabled = node.args[:3]
        state = (bool(enabled), dtype if dtype is not None else torch.get_autocast_dtype(device))
        return (grad, state, cuda) if device == "cpu" else (grad, cpu, state)
    return None


def _inline(gm: fx.GraphModule, node: fx.Node, region: tuple, base: tuple) -> None:
    """Replace the region `node` by a copy of its submodule's nodes, run in `region` modes."""
    graph = gm.graph
    first = 1 if node.target is _higher_order.wrap_with_set_grad_enabled else 4
    sub_node, operands = node.args[first], iter(node.args[first + 1 :])
    sub = getattr(gm, sub_node.target)
    env: dict[fx.Node, Any] = {}
    results: Any = ()
    with graph.inserting_before(node):
        for inner in sub.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(operands)
            elif inner.op == "output":
                results = fx.node.map_arg(inner.args[0], env.__getitem__)
            elif inner.op == "get_attr":
                env[inner] = _lift_attr(gm, sub, inner.target, graph)
            else:
                copy = graph.node_copy(inner, env.__getitem__)
                copy.meta = dict(inner.meta)
                if region != base:
                    copy.meta.setdefault(MODES, region)
                env[inner] = copy
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
    if node.users:
        raise RuntimeError(f"cannot inline {node.format_node()}: its tuple is used whole")
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)


def _lift_attr(gm: fx.GraphModule, sub: nn.Module, target: str, graph: fx.Graph) -> fx.Node:
    """A `get_attr` inside an inlined region, re-registered on `gm` (constants of the region)."""
    value = sub
    for part in target.split("."):
        value = getattr(value, part)
    name = f"_inlined_{target.replace('.', '_')}"
    suffix = 0
    while (
        hasattr(gm, f"{name}{suffix or ''}") and getattr(gm, f"{name}{suffix or ''}") is not value
    ):
        suffix += 1
    name = f"{name}{suffix or ''}"
    if isinstance(value, nn.Parameter):
        gm.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        gm.register_buffer(name, value)
    else:
        setattr(gm, name, value)
    return graph.get_attr(name)
