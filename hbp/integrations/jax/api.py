"""`height_compressed` and `height_compressed_grad`."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Literal

from hbp.errors import ConfigError
from hbp.graph.jax_capture import Program, abstractify
from hbp.integrations.jax.arguments import argnums_mask, bind_static, check_argnums, program_env
from hbp.integrations.jax.planning import Compiled, Planned
from hbp.integrations.jax.recording import run_compiled
from hbp.integrations.jax.remat import RUNNERS, jit
from hbp.integrations.jax.segments import read_value
from hbp.planner.plan import Plan
from hbp.runtime.heap import heap_returned_after


@jax.tree_util.register_pytree_node_class
class _Residuals:
    """custom_vjp residuals: the arrays as leaves, which executor made them as static data."""

    def __init__(self, kind: str, compiled, payload):
        self.kind, self.compiled, self.payload = kind, compiled, payload

    def tree_flatten(self):
        return (self.payload,), (self.kind, self.compiled)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*static, *children)


class HeightCompressed(Planned):
    """`height_compressed(fun, ...)`: callable like `fun`; see `height_compressed`."""

    def __init__(self, fun, budget, argnums, block_size, planner, strategy, plan):
        super().__init__(fun, budget, block_size, planner, strategy, plan)
        self.argnums = None if argnums is None else check_argnums(argnums)

    # Called eagerly under jax.grad, the custom_vjp's forward sees concrete arrays: the
    # pieces run them (a one-program executor would run op by op there).
    eager_auto = "pieces"

    def get_plan(self, *args, **kwargs) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s)."""
        fun, call_args, key = self._bind(args, kwargs)
        return self._compiled(fun, call_args, self._default_mask(call_args, args), key).plan

    def _bind(self, args: tuple, kwargs: dict):
        """(function of the traced leaves, its arguments, static key): non-array leaves and
        kwargs bound as in `height_compressed_grad`."""
        bound = bind_static(self.fun, args, kwargs)
        if bound is None:
            return self.fun, args, None
        return bound.fun, bound.args, bound.key

    def _default_mask(self, call_args: tuple, args: tuple) -> tuple[bool, ...]:
        """Per flat leaf of `call_args` (`args` as bound): whether it is differentiated."""
        if self.argnums is None:
            avals = jax.tree.leaves(abstractify(call_args))
            return tuple(jnp.issubdtype(a.dtype, jnp.inexact) for a in avals)
        per_arg = argnums_mask(args, self.argnums)  # range checks against the caller's args
        if call_args is args:
            return per_arg
        nums = {n % len(args) for n in self._argnums_tuple()}
        mask: list[bool] = []
        for k, leaves in enumerate(call_args):  # bound: one list of leaves per argument
            mask += [k in nums] * len(leaves)  # (the last list: kwargs, never in argnums)
        return tuple(mask)

    def _argnums_tuple(self) -> tuple[int, ...]:
        return (self.argnums,) if isinstance(self.argnums, int) else self.argnums

    def __call__(self, *args, **kwargs):
        fun, call_args, key = self._bind(args, kwargs)
        leaves, in_tree = jax.tree.flatten(call_args)
        if self.strategy in RUNNERS:
            mask = self._default_mask(call_args, args)
            compiled = self._compiled(fun, call_args, mask, key)
            env = program_env(compiled.program, leaves)
            RUNNERS[self.strategy](compiled.infos, env)
            outs = [read_value(env, o) for o in compiled.program.outvars]
            return jax.tree.unflatten(compiled.program.out_tree, outs)
        out_tree_box: dict = {}
        flat = self._custom_vjp(fun, args, key, in_tree, out_tree_box)
        outs = flat(*leaves)
        return jax.tree.unflatten(out_tree_box["out_tree"], outs)

    def _custom_vjp(self, fun, args: tuple, key, in_tree, box: dict):
        """`fun` over flat leaves as a custom_vjp whose rules run the plan."""

        def unflat(leaves):
            return jax.tree.unflatten(in_tree, leaves)

        @jax.custom_vjp
        def flat(*leaves):
            outs, out_tree = jax.tree.flatten(fun(*unflat(leaves)))
            box["out_tree"] = out_tree
            return outs

        def fwd(*primals):
            values = [p.value for p in primals]
            call_args = unflat(values)
            mask = self._default_mask(call_args, call_args if key is None else args)
            for k, p in enumerate(primals):
                if p.perturbed and not mask[k]:
                    raise ConfigError(
                        "argnums",
                        self.argnums,
                        f"to include every differentiated argument (flat leaf {k} is "
                        "differentiated)",
                    )
            compiled = self._compiled(fun, call_args, mask, key)
            program = compiled.program
            box["out_tree"] = program.out_tree
            executor = self._executor([*values, *program.consts])
            if executor == "pieces":
                env = program_env(program, values)
                keep = {o for o in program.outvars if isinstance(o, int)}
                tapes = compiled.pieces.forward(compiled.infos, env, keep)
                outs = [read_value(env, o) for o in program.outvars]
                return outs, _Residuals("pieces", compiled, tapes)
            diff_pos = [k for k, m in enumerate(mask) if m]

            def of_diff(*diff_leaves):
                full = list(values)
                for k, v in zip(diff_pos, diff_leaves):
                    full[k] = v
                env = program_env(program, full)
                RUNNERS[executor](compiled.infos, env)
                return [read_value(env, o) for o in program.outvars]

            outs, vjp_fn = jax.vjp(of_diff, *[values[k] for k in diff_pos])
            return outs, _Residuals("one program", compiled, vjp_fn)

        def bwd(res, cts):
            kind, compiled, payload = res.kind, res.compiled, res.payload
            program = compiled.program
            cts = [None if isinstance(c, SymbolicZero) else c for c in cts]
            mask = program.diff_mask
            if kind == "one program":
                filled = [
                    jnp.zeros_like(o) if c is None else c
                    for c, o in zip(cts, _out_avals_zeros(program))
                ]
                grads = iter(payload(filled))
                return tuple(next(grads) if m else None for m in mask)
            ct: dict = {}
            for o, c in zip(program.outvars, cts):
                if c is None or not isinstance(o, int) or o not in program.needs_grad:
                    continue
                # A copy: the pieces donate cotangents, and this one belongs to the caller.
                ct[o] = jnp.array(c, copy=True) if o not in ct else ct[o] + c
            compiled.pieces.backward(payload, ct)
            return tuple(
                _grad_or_zeros(ct, i, program) if m else None for i, m in zip(program.invars, mask)
            )

        flat.defvjp(fwd, bwd, symbolic_zeros=True)
        return flat


def _out_avals_zeros(program: Program):
    out = []
    for o in program.outvars:
        aval = o.aval if isinstance(o, Literal) else program.avals[o]
        out.append(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    return out


def _grad_or_zeros(ct: dict, i: int, program: Program):
    g = ct.pop(i, None)
    if g is None:
        aval = program.avals[i]
        g = jnp.zeros(aval.shape, aval.dtype)
    return g


class HeightCompressedGrad(Planned):
    """`height_compressed_grad(fun, ...)`: like `jax.grad(fun, ...)`; see there."""

    def __init__(self, fun, budget, argnums, has_aux, block_size, planner, strategy, plan):
        super().__init__(fun, budget, block_size, planner, strategy, plan)
        self.argnums = check_argnums(argnums)
        self.has_aux = bool(has_aux)

    def _mask(self, args, argnums) -> tuple[bool, ...]:
        mask = argnums_mask(args, argnums)
        for leaf, m in zip(jax.tree.leaves(abstractify(args)), mask):
            if m and not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise TypeError(
                    "height_compressed_grad requires real- or complex-valued inputs "
                    f"(an inexact dtype) for argnums, but got {leaf.dtype}"
                )
        return mask

    def _loss_fun(self):
        fun, has_aux = self.fun, self.has_aux
        if not has_aux:
            return fun

        def with_aux(*args, **kwargs):
            out = fun(*args, **kwargs)
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise TypeError(
                    "with has_aux=True, fun must return a pair (loss, aux), got "
                    f"{type(out).__name__}"
                )
            return tuple(out)

        return with_aux

    def _prepare(self, args: tuple, kwargs: dict):
        """(compiled, traced args, argnums into them, treedefs or None). Raises TypeError
        like `jax.grad` for a loss that is not a real scalar, before planning."""
        argnums_mask(args, self.argnums)  # range check against the caller's arguments
        nums = (self.argnums,) if isinstance(self.argnums, int) else self.argnums
        argnums = tuple(n % len(args) for n in nums)
        fun, traced, static_key, treedefs = self._loss_fun(), args, None, None
        bound = bind_static(fun, args, kwargs, argnums)
        if bound is not None:
            fun, traced, static_key, treedefs = bound.fun, bound.args, bound.key, bound.treedefs
        mask = self._mask(traced, argnums)
        compiled = self._compiled(
            fun, traced, mask, static_key, check=partial(_check_loss, has_aux=self.has_aux)
        )
        return compiled, traced, argnums, treedefs

    def get_plan(self, *args, **kwargs) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s)."""
        return self._prepare(args, kwargs)[0].plan

    def __call__(self, *args, **kwargs):
        compiled, traced_args, argnums, treedefs = self._prepare(args, kwargs)
        program = compiled.program
        leaves = jax.tree.leaves(traced_args)
        values = [*leaves, *program.consts]
        traced = any(isinstance(v, jax.core.Tracer) for v in values)
        executor = self._executor(values)
        if executor == "pieces":  # (traced, its pieces are inlined into the caller's trace)
            grads, aux = self._pieces_grad(compiled, leaves, argnums)
        else:
            grads, aux = self._program_grad(executor, compiled, traced_args, argnums, traced)
        if treedefs is not None:
            grads = tuple(jax.tree.unflatten(treedefs[n], g) for n, g in zip(argnums, grads))
        result = grads[0] if isinstance(self.argnums, int) else grads
        return (result, aux) if self.has_aux else result

    def _pieces_grad(self, compiled: Compiled, leaves: list, argnums: tuple):
        """The "pieces" executor: (gradients per argnum, aux or None)."""
        program = compiled.program
        loss = program.outvars[0]
        env = program_env(program, leaves)
        ct: dict = {}
        if isinstance(loss, int):
            ct[loss] = jnp.ones((), program.avals[loss].dtype)
        keep = {o for o in program.outvars if isinstance(o, int)}
        compiled.pieces.run_with_backward(compiled.infos, env, ct, keep)
        grads = [
            _grad_or_zeros(ct, i, program) if m else None
            for i, m in zip(program.invars, program.diff_mask)
        ]
        per_arg = jax.tree.unflatten(program.in_tree, grads)
        outs = jax.tree.unflatten(program.out_tree, [read_value(env, o) for o in program.outvars])
        return tuple(per_arg[n] for n in argnums), (outs[1] if self.has_aux else None)

    def _program_grad(self, executor: str, compiled: Compiled, args, argnums, traced: bool):
        """A one-program executor ("fenced" or "remat"): (gradients per argnum, aux or None).
        Traced: evaluated in the caller's trace. Eager: one jitted program, cached ("remat"
        compiled with `compiler_options()` so XLA:CPU keeps the recomputation)."""
        program = compiled.program

        def run(*a):
            env = program_env(program, jax.tree.leaves(a))
            RUNNERS[executor](compiled.infos, env)
            return jax.tree.unflatten(
                program.out_tree, [read_value(env, o) for o in program.outvars]
            )

        grad = jax.grad(run, argnums=argnums, has_aux=self.has_aux)
        if traced:
            out = grad(*args)
        else:
            fn = compiled.program_fns.get(executor)
            if fn is None:
                fn = compiled.program_fns[executor] = (
                    jit(grad) if executor == "remat" else jax.jit(grad)
                )
                with heap_returned_after():  # NOTE [ Planning's freed heap ]
                    fn.lower(*args).compile()  # (cached for the call below)
            out = run_compiled(f"one program ({executor})", fn, *args)
        return out if self.has_aux else (out, None)


def _check_loss(program: Program, has_aux: bool) -> None:
    """Raise `jax.grad`'s TypeError unless the loss (the output, or the first of the pair
    with `has_aux`) is one real scalar."""
    tree = program.out_tree
    loss_tree = jax.tree_util.treedef_children(tree)[0] if has_aux else tree
    if not jax.tree_util.treedef_is_leaf(loss_tree):
        raise TypeError(
            "Gradient only defined for scalar-output functions. Output was a pytree "
            f"{loss_tree}" + ("" if has_aux else " (return (loss, aux) with has_aux=True)")
        )
    loss = program.outvars[0]
    aval = loss.aval if isinstance(loss, Literal) else program.avals[loss]
    if aval.shape != ():
        raise TypeError(
            f"Gradient only defined for scalar-output functions. Output had shape: {aval.shape}."
        )
    if not jnp.issubdtype(aval.dtype, jnp.floating):
        raise TypeError(
            "grad requires real-valued outputs (output dtype that is a sub-dtype of "
            f"np.floating), but got {aval.dtype.name}. For holomorphic differentiation, "
            "use jax.grad(..., holomorphic=True): hbp does not support it."
        )


def height_compressed(
    fun,
    budget: float | int | str = "50%act",
    *,
    argnums: int | tuple[int, ...] | None = None,
    block_size: int = 1,
    planner: str = "optimal",
    strategy: str = "auto",
    plan: Plan | None = None,
) -> HeightCompressed:
    """`fun` with height-compressed reverse mode: same outputs, smaller backward memory.

    The returned callable takes the same arguments as `fun` (pytrees of arrays) and returns
    the same outputs; `jax.grad`/`jax.vjp` of it follow hbp's plan for the step. It captures
    and plans on the first call per input signature (pytree structure, shapes, dtypes and
    which inputs are differentiated) and caches; `.plan` is the plan of the last call and
    `.get_plan(*args)` plans without running (accepts `jax.ShapeDtypeStruct`s).

    Args:
        fun: a JAX-traceable function.
        budget: any form of `hbp.Budget`, as `hbp.HCModule` takes it: a float in (0, 1]
            (fraction of the simulated naive peak), "N%act" (the least peak plus N% of what
            checkpointing can save; the default, which always has a plan), bytes (int or
            "64MiB"), "min" or "fit". Infeasible -> `hbp.BudgetError` (with `.minimum`);
            malformed -> `hbp.ConfigError`.
        block_size: granularity of the plan's leaves (planner option).
        planner: planner name (see `hbp.planner.plan`).
        strategy: "auto" (default), "fenced", "pieces" or "remat" (see the
            `hbp.integrations.jax` docstring). "auto": `jax.grad` of the result called
            eagerly runs the pieces, under `jax.jit`/`jax.vmap` the fenced segments. All but
            "remat" use `jax.custom_vjp`, so forward mode (`jax.jvp`) is not available;
            "remat" composes with everything but needs `hbp.jax.jit` on XLA:CPU.
        argnums: the arguments whose leaves are differentiated (parameters in the plan's
            memory model). None (default): every leaf with an inexact dtype. Differentiating
            an argument outside `argnums` raises ConfigError; one inside it that is not
            differentiated only costs an unused gradient.
        plan: a fixed `Plan` (or list of `Segment`s) to use instead of planning; its node
            indices refer to `capture_jaxpr(fun, *args, argnums=argnums)`'s graph.

    Closed-over arrays are treated as constants: pass values you differentiate as arguments.
    """
    return HeightCompressed(fun, budget, argnums, block_size, planner, strategy, plan)


def height_compressed_grad(
    fun,
    budget: float | int | str = "50%act",
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    block_size: int = 1,
    planner: str = "optimal",
    strategy: str = "auto",
    plan: Plan | None = None,
) -> HeightCompressedGrad:
    """Like `jax.grad(fun, argnums, has_aux)`, with backward memory held to `budget`.

    `fun` must return a real scalar (or `(scalar, aux)` with `has_aux`; otherwise TypeError,
    as `jax.grad`, raised before planning). As with `jax.grad`, keyword arguments are passed
    through undifferentiated and non-array leaves (strings, callables) are static: each
    static value gets its own capture and plan (they must be hashable). budget="min" plans
    for the least memory the planner can reach. Works eagerly and under the caller's
    `jax.jit`/`jax.vmap` (planning happens at trace time from the avals): "auto" runs the
    "fenced" executor, one program whose recomputation XLA cannot merge back into the
    forward, so the saving is real in both cases (NOTE [ Recomputation under the caller's
    jax.jit ]); called eagerly it is compiled once per input signature. Other arguments as
    in `height_compressed`; here `strategy="pieces"` runs every segment as its own program
    (the peak then follows the planner's model closely, but only when called eagerly).

    .. warning::
        `argnums` naming one argument twice raises (a TypeError and `hbp.ConfigError`), as
        `jax.grad` does.
    """
    return HeightCompressedGrad(fun, budget, argnums, has_aux, block_size, planner, strategy, plan)
