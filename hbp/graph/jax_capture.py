"""Capture a JAX function as hbp's IR: one node per jaxpr equation.

`capture_jaxpr(fun, *args)` traces `fun` with `jax.make_jaxpr` (concrete arrays, tracers and
`jax.ShapeDtypeStruct`s all work: only shapes and dtypes are read) and returns the
framework-neutral `Graph` the planner works on, plus the `ClosedJaxpr`. The executor in
`hbp.integrations.jax` runs the same equations through a `Program`: the flattened equation
list with integer value ids that `capture_program` builds alongside the graph.

Granularity (a choice, made here):
- `jit`/`pjit`/`closed_call`/`core_call` equations are inlined: their bodies become ordinary
  equations, so cut points can fall inside a jitted helper (jnp functions are often jitted).
- `custom_jvp_call`, `custom_vjp_call` and `remat` (a user's own `jax.checkpoint`) stay one
  node each: inlining them would drop their custom differentiation rule or policy.
- `scan` (and `fori_loop` with static bounds, which is a scan) is unrolled into its
  iterations when that makes at most `MAX_UNROLLED_EQUATIONS` equations, so the planner can
  cut between the layers of a scanned model. Longer scans, `while` and `cond` are one node
  each; the residuals their backward keeps (a scan's: every iteration's) count as
  `saved_extra_bytes`.

Graph nodes, in this order: one `is_input` node per argument leaf that is not differentiated
(data: allocated before the step, never recomputed, no gradient), then one node per
equation. Differentiated argument leaves ("parameters") and closed-over constants are not
nodes; the gradient of each differentiated leaf is charged as `param_grad_bytes` to the last
equation that reads it.

The memory model of backward (`saved_inputs`, `saves_output`) is derived from JAX itself:
for each equation that needs a gradient, the residuals of `jax.vjp` of that single equation
(what JAX's linearisation keeps) are traced back to the primal values they are computed from:
the equation's inputs or its output (`1 - tanh(x)**2` counts as the output, a relu mask as
the input). hbp's pieces executor saves exactly those primal values (`jax.checkpoint` with a
`save_only_these_names` policy), recomputing such cheap functions of them in backward, so the
model is what it stores; inside one XLA program the compiler may do better (or worse), so
for the other executor it is a model, not a measurement. If the derivation fails for an
equation, a table (`_FALLBACK_SAVES`) decides, defaulting to "saves
its inputs that need a gradient". FLOPs: `dot_general` and `conv_general_dilated` exact
(multiply-add = 2), elementwise ops = output size, reductions = input size, pure data movement
(reshape, transpose, broadcast, slicing, dtype conversion) = 0, nested jaxprs = the sum of
their equations (`scan`: times its length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from hbp.graph.ir import Graph, Node

INLINED_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# Outputs that are a bitcast of their input inside XLA: no new storage.
ALIASING = frozenset({"reshape", "squeeze", "expand_dims"})
DATA_MOVEMENT = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "broadcast_in_dim",
        "convert_element_type",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "rev",
        "gather",
        "copy",
        "copy_p",
        "iota",
        "stop_gradient",
        "select_and_gather_add",
        "bitcast_convert_type",
    }
)
NOT_DIFFERENTIABLE = frozenset({"stop_gradient"})
LOOPS_AND_BRANCHES = frozenset({"scan", "while", "cond"})
# Fallback of the backward memory model, used only where deriving it from jax.vjp failed.
_FALLBACK_SAVES = {
    "add": "nothing",
    "sub": "nothing",
    "neg": "nothing",
    "reduce_sum": "nothing",
    "tanh": "output",
    "exp": "output",
    "logistic": "output",
    "sqrt": "output",
    "rsqrt": "output",
}


@dataclass(frozen=True)
class Op:
    """One equation of the flattened program.

    Attributes:
        eqn: the jaxpr equation (primitive, params, source info).
        inputs: for each `eqn.invars` entry, the value id it reads or the `Literal`.
        outputs: for each `eqn.outvars` entry, the value id it writes (dropped outputs too).
    """

    eqn: JaxprEqn
    inputs: tuple[int | Literal, ...]
    outputs: tuple[int, ...]


@dataclass
class Program:
    """A jaxpr flattened into equations over integer value ids (calls inlined).

    Attributes:
        ops: the equations in forward order; graph node `n_inputs + k` is `ops[k]`.
        invars: value ids of the flat arguments, in `jax.tree.leaves(args)` order.
        constvars / consts: value ids and values of the closed-over constants.
        outvars: value ids (or `Literal`s) of the flat outputs.
        avals: every value id's abstract value (shape, dtype).
        needs_grad: value ids whose gradient backward computes (inexact, depend on a
            differentiated argument, not behind `stop_gradient`).
        diff_mask: per flat argument, whether it is differentiated.
        n_inputs: how many graph nodes are input nodes (the non-differentiated arguments).
        input_node_vars: value ids of those input nodes.
        saved_values: per op index, the value ids its backward keeps (the memory model).
        in_tree / out_tree: pytree structures of the arguments (a tuple) and the outputs.
    """

    ops: list[Op]
    invars: list[int]
    constvars: list[int]
    consts: list[Any]
    outvars: list[int | Literal]
    avals: dict[int, Any]
    needs_grad: set[int]
    diff_mask: tuple[bool, ...]
    n_inputs: int
    in_tree: Any = None
    out_tree: Any = None
    input_node_vars: list[int] = field(default_factory=list)
    saved_values: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def ops_of_nodes(self, start: int, stop: int) -> list[Op]:
        """The equations of graph nodes [start, stop) (input nodes have none)."""
        return self.ops[max(start - self.n_inputs, 0) : max(stop - self.n_inputs, 0)]


@dataclass
class CapturedFunction:
    """What `capture_program` returns: the IR, the executable program, the jaxpr."""

    graph: Graph
    program: Program
    closed_jaxpr: ClosedJaxpr


def abstractify(tree):
    """Replace every leaf (array, tracer, Python scalar) by its `jax.ShapeDtypeStruct`."""

    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        aval = jax.typeof(x)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

    return jax.tree.map(one, tree)


def capture_jaxpr(fun, *args, argnums: int | tuple[int, ...] | None = None):
    """Trace `fun(*args)` and return `(Graph, ClosedJaxpr)`.

    Args:
        fun: a JAX-traceable function of `args` (pytrees of arrays).
        args: concrete arrays, tracers or `jax.ShapeDtypeStruct`s (only avals are read).
        argnums: which positional arguments are differentiated (their leaves become
            parameters: no nodes, gradient bytes charged to their last user). None: every
            argument with an inexact (floating/complex) dtype.
    """
    captured = capture_program(fun, args, argnums=argnums)
    return captured.graph, captured.closed_jaxpr


def capture_program(fun, args: tuple, *, argnums=None, diff_mask=None) -> CapturedFunction:
    """Trace `fun(*args)` into a `Graph` and an executable `Program`.

    `diff_mask` (one bool per flat argument leaf) overrides `argnums` when given.
    """
    flat_avals, in_tree = jax.tree.flatten(abstractify(tuple(args)))
    if diff_mask is None:
        diff_mask = _diff_mask_from_argnums(args, argnums, flat_avals)
    diff_mask = tuple(bool(d) for d in diff_mask)

    def flat_fun(*leaves):
        return fun(*jax.tree.unflatten(in_tree, leaves))

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*flat_avals)
    out_tree = jax.tree.structure(out_shape)
    program = _flatten_jaxpr(closed, diff_mask)
    program.in_tree, program.out_tree = in_tree, out_tree
    graph = _build_graph(program)
    return CapturedFunction(graph, program, closed)


def _diff_mask_from_argnums(args, argnums, flat_avals) -> tuple[bool, ...]:
    if argnums is None:
        return tuple(jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) for a in flat_avals)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    mask = []
    for i, a in enumerate(args):
        mask += [i in nums] * len(jax.tree.leaves(a))
    return tuple(mask)


# ----------------------------------------------------------------------------- flattening


def _flatten_jaxpr(closed: ClosedJaxpr, diff_mask: tuple[bool, ...]) -> Program:
    avals: dict[int, Any] = {}
    ops: list[Op] = []
    consts_ids: list[int] = []
    consts: list[Any] = []
    counter = iter(range(1 << 62))

    def new_id(aval) -> int:
        i = next(counter)
        avals[i] = aval
        return i

    def add_consts(jaxpr: Jaxpr, values, env):
        for v, c in zip(jaxpr.constvars, values):
            env[v] = new_id(v.aval)
            consts_ids.append(env[v])
            consts.append(c)

    def inline(jaxpr: Jaxpr, env: dict) -> None:
        def read(a):
            return a if isinstance(a, Literal) else env[a]

        def inline_call(eqn: JaxprEqn, sub_closed: ClosedJaxpr) -> None:
            sub_env: dict = {}
            add_consts(sub_closed.jaxpr, sub_closed.consts, sub_env)
            for v, a in zip(sub_closed.jaxpr.invars, eqn.invars):
                sub_env[v] = read(a)
            inline(sub_closed.jaxpr, sub_env)
            for outer, inner in zip(eqn.outvars, sub_closed.jaxpr.outvars):
                if isinstance(outer, Var) and not _is_dropvar(outer):
                    env[outer] = inner if isinstance(inner, Literal) else sub_env[inner]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in INLINED_CALLS and not eqn.effects:
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inline_call(eqn, sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, ()))
                continue
            if name == "scan" and _should_unroll(eqn):
                inline_call(eqn, _unrolled_scan(eqn))
                continue
            ins = tuple(read(a) for a in eqn.invars)
            outs = []
            for v in eqn.outvars:
                i = new_id(v.aval)
                if not _is_dropvar(v):
                    env[v] = i
                outs.append(i)
            ops.append(Op(eqn, ins, tuple(outs)))

    env: dict = {}
    add_consts(closed.jaxpr, closed.consts, env)
    invars = []
    for v in closed.jaxpr.invars:
        env[v] = new_id(v.aval)
        invars.append(env[v])
    inline(closed.jaxpr, env)
    outvars = [a if isinstance(a, Literal) else env[a] for a in closed.jaxpr.outvars]

    needs_grad = {i for i, d in zip(invars, diff_mask) if d and _inexact(avals[i])}
    for op in ops:
        if op.eqn.primitive.name in NOT_DIFFERENTIABLE:
            continue
        if any(isinstance(a, int) and a in needs_grad for a in op.inputs):
            needs_grad.update(o for o in op.outputs if _inexact(avals[o]))
    input_node_vars = [i for i, d in zip(invars, diff_mask) if not d]
    return Program(
        ops=ops,
        invars=invars,
        constvars=consts_ids,
        consts=consts,
        outvars=outvars,
        avals=avals,
        needs_grad=needs_grad,
        diff_mask=diff_mask,
        n_inputs=len(input_node_vars),
        input_node_vars=input_node_vars,
    )


# A `scan` (also what `fori_loop` with static bounds becomes) is unrolled into its iterations
# when the result has at most this many equations: scanning over layers is the common way to
# write a deep model, and unrolled, the planner can cut between layers. Longer scans stay one
# node (whose backward keeps every iteration's residuals: see `backward_residuals`).
MAX_UNROLLED_EQUATIONS = 4096


def _should_unroll(eqn: JaxprEqn) -> bool:
    body = eqn.params["jaxpr"].jaxpr
    return not eqn.effects and eqn.params["length"] * _count_eqns(body) <= MAX_UNROLLED_EQUATIONS


def _count_eqns(jaxpr: Jaxpr) -> int:
    return sum(
        1 + sum(_count_eqns(sub) for sub in jax.extend.core.jaxprs_in_params(e.params))
        for e in jaxpr.eqns
    )


def _unrolled_scan(eqn: JaxprEqn) -> ClosedJaxpr:
    """The `scan` equation as a jaxpr of its iterations one after the other: the body
    evaluated on the carry and a slice of each scanned input; the per-iteration outputs
    stacked."""
    p = eqn.params
    body, length, reverse = p["jaxpr"], p["length"], p["reverse"]
    n_consts, n_carry = p["num_consts"], p["num_carry"]

    def unrolled(*args):
        consts, carry = args[:n_consts], list(args[n_consts : n_consts + n_carry])
        xs = args[n_consts + n_carry :]
        ys = []
        for i in reversed(range(length)) if reverse else range(length):
            x_i = [jax.lax.index_in_dim(x, i, keepdims=False) for x in xs]
            out = jax.extend.core.jaxpr_as_fun(body)(*consts, *carry, *x_i)
            carry, y = list(out[:n_carry]), out[n_carry:]
            ys.append(y)
        if reverse:
            ys.reverse()
        if not ys:  # length 0
            empty = eqn.outvars[n_carry:]
            return [*carry, *(jax.numpy.zeros(v.aval.shape, v.aval.dtype) for v in empty)]
        return [*carry, *(jax.numpy.stack(list(y)) for y in zip(*ys))]

    avals = [
        jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type)
        for a in eqn.invars
    ]
    return jax.make_jaxpr(unrolled)(*avals)


def _is_dropvar(v) -> bool:
    return type(v).__name__ == "DropVar"


def _inexact(aval) -> bool:
    return hasattr(aval, "dtype") and jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def aval_bytes(aval) -> int:
    """Bytes of one array of this abstract value (shape x dtype itemsize). A typed PRNG key
    (`jax.random.key`, and the `random_wrap` of a legacy uint32 key inside `jax.random`'s
    functions) has an extended dtype that numpy cannot read: its bytes are its key data's."""
    if not hasattr(aval, "shape"):
        return 0
    dtype = aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(math.prod(aval.shape)) * _extended_itemsize(dtype)
    return int(math.prod(aval.shape)) * np.dtype(dtype).itemsize


def _extended_itemsize(dtype) -> int:
    """Bytes per element of an extended dtype (a PRNG key: its implementation's key data)."""
    impl = getattr(dtype, "_impl", None)
    shape = getattr(impl, "key_shape", None)
    if shape is not None:
        return int(math.prod(shape)) * 4  # key data is uint32
    return int(getattr(dtype, "itemsize", 0) or 0)


# ----------------------------------------------------------------------------- IR


def _build_graph(p: Program) -> Graph:
    node_of_value: dict[int, str] = {}
    nodes: list[Node] = []
    for k, vid in enumerate(p.input_node_vars):
        name = f"in{k}"
        node_of_value[vid] = name
        nodes.append(
            Node(
                name=name,
                op="input",
                output_bytes=aval_bytes(p.avals[vid]),
                requires_grad=False,
                is_input=True,
            )
        )
    param_ids = {i for i, d in zip(p.invars, p.diff_mask) if d}
    last_reader: dict[int, int] = {}
    for k, op in enumerate(p.ops):
        for a in op.inputs:
            if isinstance(a, int) and a in param_ids:
                last_reader[a] = k
    param_grad = [0] * len(p.ops)
    for vid, k in last_reader.items():
        if vid in p.needs_grad:
            param_grad[k] += aval_bytes(p.avals[vid])

    for k, op in enumerate(p.ops):
        name = f"e{k}"
        for o in op.outputs:
            node_of_value[o] = name
        prim = op.eqn.primitive.name
        input_nodes = tuple(dict.fromkeys(node_of_value[a] for a in _value_inputs(op, p)))
        requires_grad = any(o in p.needs_grad for o in op.outputs)
        out_bytes = sum(aval_bytes(p.avals[o]) for o in op.outputs)
        alias = None
        if prim in ALIASING and isinstance(op.inputs[0], int) and op.inputs[0] in node_of_value:
            alias, out_bytes = node_of_value[op.inputs[0]], 0
        saved_inputs: tuple[str, ...] = ()
        saves_output, extra_bytes = False, 0
        if requires_grad:
            saved_idx, saves_output, extra_bytes = backward_residuals(op, p)
            kept = [op.inputs[j] for j in saved_idx if isinstance(op.inputs[j], int)]
            p.saved_values[k] = tuple(kept) + (op.outputs if saves_output else ())
            saved_inputs = tuple(
                dict.fromkeys(node_of_value[v] for v in kept if v in node_of_value)
            )
        flops = float(eqn_flops(op.eqn))
        nodes.append(
            Node(
                name=name,
                op=f"jax:{prim}",
                inputs=input_nodes,
                output_bytes=out_bytes,
                flops=flops,
                backward_flops=2.0 * flops if requires_grad else 0.0,
                requires_grad=requires_grad,
                saved_inputs=saved_inputs,
                saves_output=saves_output,
                saved_extra_bytes=extra_bytes,
                param_grad_bytes=param_grad[k],
                alias_of=alias,
                module=str(op.eqn.source_info.name_stack),
            )
        )
    outputs = [node_of_value[o] for o in p.outvars if isinstance(o, int) and o in node_of_value]
    meta = {
        "framework": "jax",
        "granularity": "jaxpr equation",
        "param_bytes": sum(aval_bytes(p.avals[i]) for i in param_ids),
        "const_bytes": sum(aval_bytes(p.avals[i]) for i in p.constvars),
    }
    return Graph(nodes=nodes, outputs=list(dict.fromkeys(outputs)), meta=meta)


def _value_inputs(op: Op, p: Program) -> list[int]:
    """Value ids `op` reads that are graph nodes (not parameters, constants, literals)."""
    skip = set(p.constvars) | {i for i, d in zip(p.invars, p.diff_mask) if d}
    return [a for a in op.inputs if isinstance(a, int) and a not in skip]


# ----------------------------------------------------------------------------- backward model

_RESIDUAL_CACHE: dict = {}


def backward_residuals(op: Op, p: Program) -> tuple[list[int], bool, int]:
    """The primal values `op`'s backward needs, w.r.t. its inputs that need a gradient:
    (indices into `op.inputs` of the inputs it keeps, whether it keeps its output, bytes of
    fresh residuals made inside a loop or branch: `scan`, `while`, `cond`).

    Derived from JAX: the residuals of `jax.vjp` of the single equation, each traced back to
    the equation's inputs and output it is computed from (a fresh residual such as
    `1 - tanh(x)**2` or a relu mask counts as its sources: hbp's executor saves the primal
    values and lets the backward piece recompute such cheap functions of them). A residual
    made by a loop or branch (a scan that is not unrolled keeps every iteration's) counts as
    its own bytes: recomputing it means rerunning the loop."""
    diff = tuple(isinstance(a, int) and a in p.needs_grad for a in op.inputs)
    key = _residual_key(op, diff)
    if key is not None and key in _RESIDUAL_CACHE:
        return _RESIDUAL_CACHE[key]
    try:
        result = _derive_residuals(op, diff)
    except Exception:  # noqa: BLE001 - any tracing failure falls back to the table
        result = _fallback_residuals(op, diff)
    if key is not None:
        _RESIDUAL_CACHE[key] = result
    return result


def _residual_key(op: Op, diff):
    eqn = op.eqn
    try:
        params = tuple(sorted(eqn.params.items()))
        hash(params)
    except TypeError:
        return None
    ins = tuple(
        ("lit", repr(a.val)) if isinstance(a, Literal) else (v.aval.shape, str(v.aval.dtype))
        for a, v in zip(op.inputs, eqn.invars)
    )
    return (eqn.primitive, params, ins, diff)


def _derive_residuals(op: Op, diff) -> tuple[list[int], bool, int]:
    eqn = op.eqn
    var_pos = [j for j, a in enumerate(op.inputs) if not isinstance(a, Literal)]
    params = eqn.primitive.get_bind_params(eqn.params)

    def bind(*vals):
        full = [a.val if isinstance(a, Literal) else None for a in op.inputs]
        for j, v in zip(var_pos, vals):
            full[j] = v
        out = eqn.primitive.bind(*full, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    def vjp_residuals(*vals):
        diff_pos = [k for k, j in enumerate(var_pos) if diff[j]]

        def of_diff(*d):
            full = list(vals)
            for k, x in zip(diff_pos, d):
                full[k] = x
            return bind(*full)

        outs, vjp_fn = jax.vjp(of_diff, *[vals[k] for k in diff_pos])
        return outs, jax.tree.leaves(vjp_fn)

    in_avals = [eqn.invars[j].aval for j in var_pos]
    closed = jax.make_jaxpr(vjp_residuals)(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in in_avals]
    )
    jaxpr = closed.jaxpr
    n_out = len(eqn.outvars)
    out_vars = jaxpr.outvars[:n_out]
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    saved, saves_output, seen, extra_bytes = set(), False, set(), 0
    stack = [r for r in jaxpr.outvars[n_out:] if not isinstance(r, Literal)]
    while stack:  # trace every residual back to the primal values it is computed from
        r = stack.pop()
        if r in seen or r in jaxpr.constvars:
            continue
        seen.add(r)
        if any(r is o for o in out_vars):
            saves_output = True
        elif r in jaxpr.invars:
            saved.add(var_pos[jaxpr.invars.index(r)])
        elif r in producer and producer[r].primitive.name in LOOPS_AND_BRANCHES:
            extra_bytes += aval_bytes(r.aval)  # e.g. every iteration's residuals, stacked
        elif r in producer:
            stack.extend(a for a in producer[r].invars if not isinstance(a, Literal))
    return sorted(saved), saves_output, extra_bytes


def _fallback_residuals(op: Op, diff) -> tuple[list[int], bool, int]:
    kind = _FALLBACK_SAVES.get(op.eqn.primitive.name, "inputs")
    if kind == "nothing":
        return [], False, 0
    if kind == "output":
        return [], True, 0
    return [j for j, d in enumerate(diff) if d], False, 0


# ----------------------------------------------------------------------------- FLOPs


def eqn_flops(eqn: JaxprEqn) -> float:
    """Forward FLOPs of one equation (multiply-add = 2)."""
    name = eqn.primitive.name
    out_size = sum(_size(v.aval) for v in eqn.outvars)
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        contract = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * out_size * contract
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, spatial...)
        per_output = rhs[spec[1]] * math.prod(rhs[d] for d in spec[2:])
        return 2.0 * out_size * per_output
    subs = list(jax.extend.core.jaxprs_in_params(eqn.params))
    if subs:
        inner = sum(eqn_flops(e) for j in subs for e in j.eqns)
        if name == "scan":
            inner *= eqn.params.get("length", 1)
        return inner
    if name in DATA_MOVEMENT:
        return 0.0
    if name.startswith("reduce_") or name in {"argmax", "argmin", "cumsum", "cumprod"}:
        return float(sum(_size(v.aval) for v in eqn.invars if not isinstance(v, Literal)))
    return float(out_size)


def _size(aval) -> int:
    return int(math.prod(aval.shape)) if hasattr(aval, "shape") else 0
