"""The one-program executors: the plan evaluated in the current trace.

Both walk the resolved segments in order, evaluating plain segments' equations as they are
(JAX's own reverse mode keeps their residuals) and wrapping every recomputed segment (its
children nested inside) so that backward recomputes it instead of keeping its inside:

- `run_fenced` ("fenced"): the segment is a `jax.custom_vjp`; its forward keeps only its
  inputs, its backward recomputes and backpropagates inside a `lax.cond` whose predicate
  XLA cannot fold. Survives any `jax.jit` (see the NOTE below).
- `run_remat` ("remat"): the segment is `jax.checkpoint(prevent_cse=True)`. Composes with
  forward mode too, but on XLA:CPU it needs `compiler_options()` (`hbp.jax.jit`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hbp.graph.jax_capture import Op
from hbp.integrations.jax.segments import SegmentInfo, bind_op, eval_ops

# NOTE [ Recomputation under the caller's jax.jit ]
# A user jits the whole training step, so whatever hbp builds is inlined into one XLA
# program and the compiler decides what is recomputed. `jax.checkpoint(prevent_cse=True)`
# marks a recomputation with optimisation barriers, but XLA:CPU's `cse_barrier_expander`
# pass removes them; CSE then merges the recomputation with the original forward and its
# activations live until backward again: no saving (measured: experiments/bench_jax.py).
# hbp cannot pass compiler options through the caller's `jax.jit`, and a host callback
# (pure_callback running the pieces) would copy every boundary value through the host and
# stop at the first tracer it cannot see through (vmap, higher-order grads).
#
# What survives every pass is a computation boundary XLA cannot see through at compile time.
# Each recomputed segment becomes a `jax.custom_vjp`: forward = the segment's primal
# computation, residuals = its inputs only; backward = `lax.cond(opaque_true(), recompute +
# vjp, zeros)`. The recomputation lives in the conditional's branch computation, which CSE
# does not merge with the forward, and the predicate (`rng_uniform(0, 1) < 2`, true at run
# time) comes from a stateful random op that no pass constant-folds, so the conditional is
# never inlined. The cotangents are operands of the conditional, so it cannot be scheduled
# before backward reaches the segment. (Early JAX lowered `remat` this way, before XLA had
# optimisation barriers.)
#
# Trade-offs: a custom_vjp has no forward-mode rule (`jax.jvp`, `jax.hessian` through it
# fail: use strategy="remat" there); each recomputed segment costs one conditional (a
# predicate read, on GPU a device-to-host sync of one bool); XLA cannot fuse across the
# boundary (a few elementwise ops are not fused with their neighbours); and the memory of the
# inside of one segment is the compiler's (the pieces executor holds the memory model
# exactly, but only when called eagerly).
#
# NOTE [ One program's memory against the plan ]
# What is live at once in the fenced program stays within the plan's peak (XLA's own live
# ranges of the compiled program say so). What the program allocates does not quite: XLA:CPU gives the program one temp buffer sized for its busiest moment, whose pages
# stay resident for the whole call, and separate output buffers. The parameter gradients are
# outputs, written as backward reaches them, after the temp's busiest moment; the planner
# counts them growing while activations are freed, but their pages come on top of the temp's.
# A one-program step therefore holds about temp peak + all gradients, above the plan's peak by
# the gradients not yet made at the plan's peak. The pieces executor, whose pieces each free
# their temp, does not pay this.


def opaque_true():
    """A boolean scalar that is True at run time and that XLA cannot constant-fold."""
    return lax.rng_uniform(jnp.float32(0), jnp.float32(1), ()) < 2


def _cotangent_zeros(x):
    """The zero cotangent of a primal value (float0 for integer and boolean values)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def fenced_segment(info: SegmentInfo):
    """The recomputed segment `info` as `f(diff_in, nondiff_in) -> (diff_out, nondiff_out)`
    that keeps only its inputs for backward and recomputes behind a conditional."""
    body = partial(_fenced_body, info)
    sliced, index_ops = sliced_inputs(info)
    slices = [op for ops in sliced.values() for op in ops]
    kept = [k for k, i in enumerate(info.diff_in) if i not in sliced]

    @jax.custom_vjp
    def segment(diff_in, nondiff_in):
        return body(diff_in, nondiff_in)

    def forward(diff_in, nondiff_in):
        return body(diff_in, nondiff_in), (diff_in, nondiff_in)

    def backward(inputs, cts):
        diff_in, nondiff_in = inputs
        given = dict(zip(info.diff_in, diff_in))
        given.update(zip(info.nondiff_in, nondiff_in))
        eval_ops(index_ops, given)  # the slices' indices: the branch and the pads read them
        indices = {o: given[o] for op in index_ops for o in op.outputs}

        def recompute(diff_in, nondiff_in, diff_cts):
            fixed = dict(zip(info.nondiff_in, nondiff_in))
            fixed.update(indices)

            def of(rest, sliced_values):
                env = dict(fixed)
                env.update((info.diff_in[k], v) for k, v in zip(kept, rest))
                env.update((op.outputs[0], v) for op, v in zip(slices, sliced_values))
                return _run(info, env)

            rest = [diff_in[k] for k in kept]
            inputs = {**fixed, **dict(zip(info.diff_in, diff_in))}
            sliced_values = [bind_op(op, inputs) for op in slices]
            _, vjp_fn, _ = jax.vjp(of, rest, sliced_values, has_aux=True)
            return vjp_fn(diff_cts)

        def skip(diff_in, nondiff_in, diff_cts):
            rest = [jnp.zeros_like(diff_in[k]) for k in kept]
            avals = [op.eqn.outvars[0].aval for op in slices]
            return rest, [jnp.zeros(a.shape, a.dtype) for a in avals]

        rest_cts, slice_cts = lax.cond(opaque_true(), recompute, skip, diff_in, nondiff_in, cts[0])
        in_cts = dict(zip((info.diff_in[k] for k in kept), rest_cts))
        # Each slice's cotangent padded out to its input's shape, outside the conditional
        # (NOTE [ Loops over stacked weights ]).
        for op, ct in zip(slices, slice_cts):
            v = op.inputs[0]
            pad = _slice_transpose(op, given)(ct)
            in_cts[v] = in_cts[v] + pad if v in in_cts else pad
        return [in_cts[i] for i in info.diff_in], [_cotangent_zeros(v) for v in nondiff_in]

    segment.defvjp(forward, backward)
    return segment


#: Primitives that read a part of an array (a loop over stacked weights reads each layer's
#: so), and those of them whose cotangent the fenced backward returns at the part's size.
PARTIAL_READS = frozenset({"slice", "dynamic_slice", "gather"})
SLICES = frozenset({"slice", "dynamic_slice"})


def sliced_inputs(info: SegmentInfo) -> tuple[dict[int, list[Op]], list[Op]]:
    """The differentiated inputs of `info` that it reads only through slices whose indices
    are known before it runs, and that no recomputed segment nested in it reads, with those
    slices; and the equations that compute the indices, in order (NOTE [ Loops over stacked
    weights ]).

    An index is known before the segment runs if it is a literal, an input without gradient,
    or made in the segment by integer equations of such (a `fori_loop`'s `W[i]`, unrolled:
    `i` normalised by `lt`/`add`/`select_n`)."""
    nested = {i for child in info.children if child.recompute for i in child.live_in}
    readers: dict[int, list[Op]] = {}
    for op in info.ops:
        for a in op.inputs:
            if isinstance(a, int) and a in info.diff_in and a not in nested:
                readers.setdefault(a, []).append(op)
    known, made_by = _integer_values(info)
    sliced = {
        v: list(dict.fromkeys(ops))
        for v, ops in readers.items()
        if all(_is_slice_of(op, v, known) for op in ops)
    }
    needed: set[int] = set()
    stack = [a for ops in sliced.values() for op in ops for a in op.inputs[1:] if a in made_by]
    while stack:
        k = made_by[stack.pop()]
        if k not in needed:
            needed.add(k)
            stack.extend(a for a in info.ops[k].inputs if isinstance(a, int) and a in made_by)
    return sliced, [info.ops[k] for k in sorted(needed)]


def _integer_values(info: SegmentInfo) -> tuple[set[int], dict[int, int]]:
    """Values known before `info` runs: its inputs without gradient, and the integer and
    boolean outputs of its effect-free equations over those and literals; with the index in
    `info.ops` of the equation that makes each of the latter."""
    known = set(info.nondiff_in)
    made_by: dict[int, int] = {}
    for k, op in enumerate(info.ops):
        if op.eqn.effects or not all(not isinstance(a, int) or a in known for a in op.inputs):
            continue
        if all(
            jnp.issubdtype(v.aval.dtype, jnp.integer) or v.aval.dtype == jnp.bool_
            for v in op.eqn.outvars
        ):
            known.update(op.outputs)
            made_by.update((o, k) for o in op.outputs)
    return known, made_by


def taken_whole(infos: list[SegmentInfo]) -> set[int]:
    """Differentiated inputs that a recomputed segment reads in part (`PARTIAL_READS`) but
    takes whole: a gather, or slices a recomputed segment nested in it reads too; its backward
    returns their full-size cotangent (NOTE [ Loops over stacked weights ])."""
    out: set[int] = set()
    for info in infos:
        if info.recompute and info.diff_in and info.diff_out:
            hoisted, _ = sliced_inputs(info)
            for op in info.ops:
                v = op.inputs[0] if op.inputs else None
                if (
                    op.eqn.primitive.name in PARTIAL_READS
                    and v in info.diff_in
                    and v not in hoisted
                ):
                    out.add(v)
        out |= taken_whole(info.children)
    return out


def _is_slice_of(op: Op, v: int, known: set[int]) -> bool:
    if op.eqn.primitive.name not in SLICES or op.inputs[0] != v:
        return False
    return all(not isinstance(a, int) or a in known for a in op.inputs[1:])


def _slice_transpose(op: Op, env: dict):
    """The transpose of slicing `op.inputs[0]` (its other operands fixed): a pad."""
    operand = env[op.inputs[0]]
    aval = jax.ShapeDtypeStruct(operand.shape, operand.dtype)
    transpose = jax.linear_transpose(lambda x: bind_op(op, {**env, op.inputs[0]: x}), aval)
    return lambda ct: transpose(ct)[0]


def _fenced_body(info: SegmentInfo, diff_in: list, nondiff_in: list):
    env = dict(zip(info.diff_in, diff_in))
    env.update(zip(info.nondiff_in, nondiff_in))
    return _run(info, env)


def _run(info: SegmentInfo, env: dict):
    """`info`'s outputs from `env`: its inputs, or, for an input read only through slices,
    those slices (an equation whose outputs `env` already holds is not run again)."""
    if info.children:
        run_fenced(info.children, env)
    else:
        eval_ops(info.ops, env)
    return [env[o] for o in info.diff_out], [env[o] for o in info.nondiff_out]


def run_fenced(infos: list[SegmentInfo], env: dict) -> None:
    """The "fenced" executor: evaluate segments in the current trace, each recomputed segment
    that backward reaches as a `fenced_segment` (children nested inside)."""
    for info in infos:
        if not (info.recompute and info.diff_in and info.diff_out):
            if info.children:
                run_fenced(info.children, env)
            else:
                eval_ops(info.ops, env)
            continue
        diff_in = [env[i] for i in info.diff_in]
        nondiff_in = [env[i] for i in info.nondiff_in]
        diff_out, nondiff_out = fenced_segment(info)(diff_in, nondiff_in)
        env.update(zip(info.diff_out, diff_out))
        env.update(zip(info.nondiff_out, nondiff_out))


def run_remat(infos: list[SegmentInfo], env: dict) -> None:
    """The "remat" executor: evaluate segments in the current trace, each recomputed segment
    under `jax.checkpoint` (its children nested inside)."""
    for info in infos:
        if not info.recompute:
            eval_ops(info.ops, env)
            continue
        inputs = [env[i] for i in info.live_in]
        outs = jax.checkpoint(partial(_remat_body, info), prevent_cse=True)(inputs)
        env.update(zip(info.live_out, outs))


def _remat_body(info: SegmentInfo, inputs: list) -> list:
    env = dict(zip(info.live_in, inputs))
    if info.children:
        run_remat(info.children, env)
    else:
        eval_ops(info.ops, env)
    return [env[o] for o in info.live_out]


RUNNERS = {"fenced": run_fenced, "remat": run_remat}

# XLA:CPU's `cse_barrier_expander` pass strips the optimisation barriers `jax.checkpoint`
# (prevent_cse=True) puts around a recomputation (NOTE [ Recomputation under the caller's
# jax.jit ]). Without that pass the barriers survive and the recomputation is real.
CPU_REMAT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compiler_options() -> dict[str, str]:
    """XLA compiler options that make `jax.checkpoint` really recompute on this backend
    (empty where XLA already keeps its barriers)."""
    return dict(CPU_REMAT_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


def jit(fun, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` with `compiler_options()` merged in: jit a function that
    contains `jax.checkpoint` segments (e.g. a `height_compressed_grad(...,
    strategy="remat")` function) without XLA:CPU undoing the recomputation. Options given in
    `jit_kwargs` take precedence. Not needed for the default "fenced" strategy."""
    options = {**compiler_options(), **(jit_kwargs.pop("compiler_options", None) or {})}
    return jax.jit(fun, compiler_options=options or None, **jit_kwargs)
