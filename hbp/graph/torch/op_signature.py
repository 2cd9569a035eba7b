"""Op signatures: what a measured kernel workspace is keyed by, in this process and in a
`ScratchStore` across processes. `signature` names one op call (the op, the layouts of its
tensor arguments, the values of the others, the ambient modes); `graph_key` names a whole
capture's calibration (its code, ops, input, parameter and buffer layouts and IR). Functions
and modules are named by module, qualified name and a digest of their code, never by an
address (NOTE [ What a workspace depends on ] in scratch_store.py)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from hbp.graph.torch.breaks import REAL_RESULTS, guard
from hbp.graph.torch.captured import CapturedGraph
from hbp.graph.torch.modes import MODES

__all__ = ["code_of", "describe", "graph_key", "op_name", "signature"]


def signature(gm: fx.GraphModule, node: fx.Node, args, kwargs) -> tuple:
    """The op signature of `node` called on (`args`, `kwargs`): the op (a module by its class,
    code digest, `repr`, train flag and parameters' layouts; a function by `op_name` and code
    digest), the ambient modes, and `describe` of each leaf of the arguments."""
    op = _op(gm, node)
    if node.op == "call_module":
        op += (tuple(describe(p) for p in gm.get_submodule(node.target).parameters()),)
    leaves = tuple(describe(v) for v in tree_leaves((args, kwargs)))
    return (op, node.meta.get(MODES), leaves)


def _op(gm: fx.GraphModule, node: fx.Node) -> tuple:
    """The op `node` calls: a module by its class, code digest, `repr` and train flag; a
    function or method by `op_name` and code digest."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        kind = type(module)
        name = f"{kind.__module__}.{kind.__qualname__}"
        return ("module", name, code_of(kind.forward), repr(module), module.training)
    return (node.op, op_name(node.target), code_of(node.target))


# NOTE [ A calibrated graph kept whole ]
# The per-op measurements a `ScratchStore` keeps spare a restarted job the measuring, not the
# graph's forward run that reads each op's signature off its real inputs (for GPT-2 124M at
# 8 x 1024 tokens on a CPU, the first block and the LM head: most of a restart's first
# step). The calibration's outcome is a function of the graph's code, its ops, the layouts of
# its inputs, parameters and buffers, and the environment of each measurement: every value's
# layout follows from them, and the measurements from the layouts. So the calibrated scratch
# fields of the whole graph are kept too, under all of that (`graph_key`), and read back
# without running anything. A graph that branches on data (graph breaks' real results,
# guards) is not kept whole: its layouts can follow the values.


def graph_key(captured: CapturedGraph, arguments: list[Any]) -> tuple | None:
    """What the calibration of `captured` on `arguments` depends on besides the environment
    (NOTE [ A calibrated graph kept whole ]), or None where the graph branches on data."""
    gm = captured.gm
    nodes = list(gm.graph.nodes)
    if any(n.meta.get(REAL_RESULTS) or n.target is guard for n in nodes):
        return None
    calls = ("call_module", "call_function", "call_method")
    ops = [(_op(gm, n), n.meta.get(MODES)) for n in nodes if n.op in calls]
    tensors = [*gm.named_parameters(), *gm.named_buffers()]
    state = [(name, describe(t)) for name, t in tensors]
    inputs = [describe(v) for v in tree_leaves(arguments)]
    ir = [dataclasses.astuple(n) for n in captured.graph.nodes]
    return ("graph", gm.code, tuple(ops), tuple(state), tuple(inputs), repr(ir))


def describe(v: Any) -> Any:
    """What an op signature reads of a value: a tensor's layout, a plain value itself."""
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device), v.requires_grad)
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return v
    return repr(v)


def code_of(function: Any) -> str | None:
    """A digest of a Python function's compiled code (None for a builtin): a function edited
    between two runs is another op to a `ScratchStore` (NOTE [ What a workspace depends on ])."""
    code = getattr(function, "__code__", None)
    return None if code is None else _code_digest(code)


@functools.cache
def _code_digest(code: types.CodeType) -> str:
    digest = hashlib.sha256()
    for part in _code_parts(code):  # not marshal: its back-references follow refcounts
        digest.update(part if isinstance(part, bytes) else part.encode())
    return digest.hexdigest()[:16]


def _code_parts(code: types.CodeType):
    """The bytecode, names and constants of `code` and of the code objects it holds, each in
    a form that is the same in every process (a frozenset's order follows string hashes)."""
    yield code.co_code
    yield repr(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_parts(const)
        elif isinstance(const, frozenset):
            yield repr(sorted(map(repr, const)))
        else:
            yield repr(const)


def op_name(target: Any) -> str:
    """`target` named as it is in any process where that can be said: a function by its
    module and qualified name, not by the address in its `str` (a closure keeps the address:
    NOTE [ What a workspace depends on ])."""
    name = str(target)
    if " at 0x" not in name:
        return name
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return name
    return f"{module}.{qualname}"
