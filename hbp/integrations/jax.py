"""JAX integration: `height_compressed`, `height_compressed_grad`, `jit` and `measure`.

A function is captured as a jaxpr (`hbp.graph.jax_capture`), planned with hbp's planner on the
framework-neutral graph, and executed segment by segment following the plan. Two executors:

- "remat" (one program): the equations are evaluated in the current trace; every
  `recompute=True` segment is wrapped in `jax.checkpoint(prevent_cse=True)`, nested for its
  children. Pure JAX: composes with `jax.jit`, `jax.vmap`, `jax.jvp`, higher-order grads.
  Measured on XLA:CPU (jax 0.10): under a plain `jax.jit` this saves *nothing*: the CPU
  pipeline's `cse_barrier_expander` pass strips the optimisation barriers that
  `prevent_cse` adds, CSE then merges the recomputation back into the forward, and the
  compiled temp memory is the same as or higher than plain `jax.grad`'s. Compiled with
  `compiler_options()` (that pass disabled; `hbp.jax.jit` does it) the barriers survive and
  the saving is real. `height_compressed_grad(strategy="remat")` called eagerly compiles its
  one program that way.
- "pieces" (separately compiled pieces): every segment runs as its own `jax.jit` program
  driven from Python. Forward: a plain segment runs `jax.vjp` keeping exactly the primal
  values the memory model says (checkpoint names + `save_only_these_names`), a recomputed
  segment runs its forward only and keeps its inputs. Backward, in reverse: a plain
  segment's piece applies the stored vjp; a recomputed segment's piece recomputes and
  backpropagates in one program (with children it recurses: children forward, then
  children backward). The last segment of each level runs forward and backward in one piece.
  Arrays are dropped as soon as no later piece needs them, so the step's peak is the largest
  (live arrays + the running piece's temp and output bytes), whatever the compiler's passes:
  it follows the planner's model closely. Needs concrete arrays (eager calls).

`strategy="auto"` (the default) runs "pieces" when called with concrete arrays: the saving
does not depend on an XLA debug option and its peak matches the plan's prediction; when
traced (under `jax.jit`, `jax.vmap`, higher-order differentiation) it runs "remat" in the
caller's trace: use `hbp.jax.jit` instead of `jax.jit` on CPU to keep the recomputation.

Memory (DESIGN.md "Metrics"): `measure(fn, *args)` reports the memory analysis of the compiled
programs that ran (per program, with the live array bytes when it started) and the process
max-RSS growth of the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Literal

from hbp.errors import ConfigError
from hbp.graph.jax_capture import CapturedFunction, Op, Program, abstractify, capture_program
from hbp.planner.plan import Plan, Segment

STRATEGIES = ("auto", "pieces", "remat")


# ----------------------------------------------------------------------------- segments


@dataclass(eq=False)
class SegmentInfo:
    """A plan segment resolved against a `Program`.

    Attributes:
        segment: the plan's segment (node indices).
        ops: its equations.
        live_in: value ids it reads that are made before it (arguments, constants included).
        live_out: value ids it makes that something after it, or the outputs, read.
        diff_in / nondiff_in: `live_in` split by whether backward needs their gradient.
        diff_out / nondiff_out: `live_out` split the same way.
        first_op: index of its first equation in `Program.ops`.
        children: the nested plan of a recomputed segment.
    """

    segment: Segment
    ops: list[Op]
    live_in: tuple[int, ...]
    live_out: tuple[int, ...]
    diff_in: tuple[int, ...]
    nondiff_in: tuple[int, ...]
    diff_out: tuple[int, ...]
    nondiff_out: tuple[int, ...]
    first_op: int = 0
    children: list[SegmentInfo] = field(default_factory=list)

    @property
    def recompute(self) -> bool:
        return self.segment.recompute

    @property
    def label(self) -> str:
        kind = "recompute" if self.recompute else "plain"
        return f"{kind}[{self.segment.start}:{self.segment.stop}]"


def resolve_segments(program: Program, segments: list[Segment]) -> list[SegmentInfo]:
    """Resolve a tiling of the graph's nodes into `SegmentInfo`s (recursively)."""
    last_reader: dict[int, int] = {}
    for k, op in enumerate(program.ops):
        for a in op.inputs:
            if isinstance(a, int):
                last_reader[a] = k
    outputs = {o for o in program.outvars if isinstance(o, int)}

    def resolve(seg: Segment) -> SegmentInfo:
        lo = max(seg.start - program.n_inputs, 0)
        hi = max(seg.stop - program.n_inputs, 0)
        ops = program.ops[lo:hi]
        made = {o for op in ops for o in op.outputs}
        reads = dict.fromkeys(a for op in ops for a in op.inputs if isinstance(a, int))
        live_in = tuple(a for a in reads if a not in made)
        live_out = tuple(
            o for op in ops for o in op.outputs if o in outputs or last_reader.get(o, -1) >= hi
        )
        g = program.needs_grad
        return SegmentInfo(
            segment=seg,
            ops=ops,
            live_in=live_in,
            live_out=live_out,
            diff_in=tuple(i for i in live_in if i in g),
            nondiff_in=tuple(i for i in live_in if i not in g),
            diff_out=tuple(o for o in live_out if o in g),
            nondiff_out=tuple(o for o in live_out if o not in g),
            first_op=lo,
            children=[resolve(c) for c in seg.children] if seg.recompute else [],
        )

    return [resolve(s) for s in segments]


def check_segments(segments: list[Segment], start: int, stop: int, where: str = "plan") -> None:
    """Raise ConfigError unless `segments` tile [start, stop) in order (recursively)."""
    pos = start
    for k, seg in enumerate(segments):
        if seg.start != pos or seg.stop <= seg.start:
            raise ConfigError(
                f"{where}.segments[{k}]",
                (seg.start, seg.stop),
                f"a non-empty interval starting at {pos}: segments tile [{start}, {stop})",
            )
        if seg.children:
            check_segments(seg.children, seg.start, seg.stop, f"{where}.segments[{k}].children")
        pos = seg.stop
    if pos != stop:
        raise ConfigError(f"{where}.segments", f"ending at {pos}", f"a tiling ending at {stop}")


# ----------------------------------------------------------------------------- evaluation


def _read(env: dict, a):
    return a.val if isinstance(a, Literal) else env[a]


def eval_ops(ops: list[Op], env: dict, names: dict[int, str] | None = None) -> None:
    """Run `ops` in the current trace, reading and writing `env` (value id -> value).
    Outputs listed in `names` are tagged with `checkpoint_name` (for a remat policy)."""
    for op in ops:
        eqn = op.eqn
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*[_read(env, a) for a in op.inputs], **params)
        outs = out if eqn.primitive.multiple_results else (out,)
        if names:
            outs = [
                checkpoint_name(v, names[o]) if o in names else v for o, v in zip(op.outputs, outs)
            ]
        env.update(zip(op.outputs, outs))


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


def _segment_fn(info: SegmentInfo, diff_in: list, nondiff_in: list, names=None):
    """The segment as a function: (diff outputs, non-diff outputs) from its inputs."""
    env = dict(zip(info.diff_in, diff_in))
    env.update(zip(info.nondiff_in, nondiff_in))
    eval_ops(info.ops, env, names)
    return [env[o] for o in info.diff_out], [env[o] for o in info.nondiff_out]


@dataclass(frozen=True)
class SavePolicy:
    """A `jax.checkpoint` policy that saves exactly the primal values the memory model keeps.

    Values a node's backward keeps as an *input* are tagged with `checkpoint_name` and saved
    by name. A node that keeps its *output* (tanh, exp, ...) is saved by matching its
    equation (primitive, input avals, params): its own derivative rule reads the raw output,
    not a named copy, so naming it would save the same array twice."""

    names: frozenset[str]
    equations: frozenset

    def __call__(self, prim, *avals, **params):
        if prim.name == "name":
            return params.get("name") in self.names
        return _equation_key(prim, avals, params) in self.equations


def _equation_key(prim, avals, params):
    try:
        items = tuple(sorted(params.items()))
        hash(items)
    except TypeError:
        items = None
    return (prim, tuple((a.shape, str(a.dtype)) for a in avals), items)


def _save_policy(program: Program, info: SegmentInfo) -> tuple[dict[int, str], SavePolicy]:
    """(value id -> checkpoint name, policy) for the values made inside `info` that its
    nodes' backward keeps (the memory model's `saved_inputs` / `saves_output`)."""
    made = {o for op in info.ops for o in op.outputs}
    by_output = set()  # values saved because their producer keeps its output
    equations = set()
    named = set()
    for k, op in enumerate(info.ops, start=info.first_op):
        saved = program.saved_values.get(k, ())
        if op.outputs and op.outputs[0] in saved:  # saves_output
            by_output.update(op.outputs)
            avals = [program.avals[a] if isinstance(a, int) else a.aval for a in op.inputs]
            equations.add(_equation_key(op.eqn.primitive, avals, op.eqn.params))
        named.update(v for v in saved if v in made)
    names = {v: f"hbp_v{v}" for v in sorted(named - by_output)}
    return names, SavePolicy(frozenset(names.values()), frozenset(equations))


def _fill_zeros(cts, ids, program: Program) -> list:
    """Cotangents with None replaced by zeros of the value's shape and dtype."""
    return [
        jnp.zeros(program.avals[i].shape, program.avals[i].dtype) if c is None else c
        for c, i in zip(cts, ids)
    ]


# ----------------------------------------------------------------------------- XLA options

# XLA:CPU's `cse_barrier_expander` pass strips the optimisation barriers `jax.checkpoint`
# (prevent_cse=True) puts around a recomputation; CSE then merges the recomputation with the
# original forward, so the saved memory comes back. Without that pass the barriers survive
# and the recomputation is real (measured: experiments/bench_jax.py).
CPU_REMAT_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}


def compiler_options() -> dict[str, str]:
    """XLA compiler options that make `jax.checkpoint` really recompute on this backend
    (empty where XLA already keeps its barriers)."""
    return dict(CPU_REMAT_COMPILER_OPTIONS) if jax.default_backend() == "cpu" else {}


def jit(fun, **jit_kwargs):
    """`jax.jit(fun, **jit_kwargs)` with `compiler_options()` merged in: jit a function that
    contains `jax.checkpoint` segments (e.g. a `height_compressed_grad` function) without
    XLA:CPU undoing the recomputation. Options given in `jit_kwargs` take precedence."""
    options = {**compiler_options(), **(jit_kwargs.pop("compiler_options", None) or {})}
    return jax.jit(fun, compiler_options=options or None, **jit_kwargs)


# ----------------------------------------------------------------------------- recording


@dataclass
class PieceRecord:
    """One compiled piece that ran: its memory analysis (bytes; `alias_bytes`: outputs that
    reuse donated arguments) and the bytes of live JAX arrays, above the level before the
    step, when it started."""

    name: str
    live_bytes: int
    temp_bytes: int
    output_bytes: int
    argument_bytes: int
    alias_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Live arrays + the piece's temp + its new outputs (outputs written into donated
        arguments are not new)."""
        return self.live_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


class PieceRecorder:
    """Collects a `PieceRecord` for every piece run while it is active (`record_pieces`)."""

    def __init__(self):
        self.records: list[PieceRecord] = []
        self.baseline = live_array_bytes()
        self._stats: dict = {}

    def before(self, name: str, fn, args) -> None:
        key = (id(fn), jax.tree.structure(args), tuple(map(_sig, jax.tree.leaves(args))))
        if key not in self._stats:
            m = fn.lower(*args).compile().memory_analysis()
            self._stats[key] = (
                int(m.temp_size_in_bytes),
                int(m.output_size_in_bytes),
                int(m.argument_size_in_bytes),
                int(m.alias_size_in_bytes),
            )
        live = live_array_bytes() - self.baseline
        self.records.append(PieceRecord(name, live, *self._stats[key]))


_RECORDER: contextvars.ContextVar[PieceRecorder | None] = contextvars.ContextVar(
    "hbp_jax_recorder", default=None
)


@contextlib.contextmanager
def record_pieces():
    """Inside: every separately compiled piece hbp runs is recorded (see `PieceRecorder`)."""
    recorder = PieceRecorder()
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def run_compiled(name: str, fn, *args):
    """Call the jitted `fn`, recording it first if a `record_pieces` recorder is active."""
    recorder = _RECORDER.get()
    with warnings.catch_warnings():
        # Donated arguments no output can reuse are simply freed; no need to warn.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        if recorder is not None:
            recorder.before(name, fn, args)
        return fn(*args)


def live_array_bytes() -> int:
    """Bytes of all live JAX arrays (each device buffer counted once)."""
    seen, total = set(), 0
    for a in jax.live_arrays():
        try:
            ptr = a.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - deleted or non-addressable: count it once
            ptr = id(a)
        if ptr not in seen:
            seen.add(ptr)
            total += a.nbytes
    return total


def _sig(x):
    return (getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))))


# ----------------------------------------------------------------------------- pieces


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


@jax.tree_util.register_pytree_node_class
class _Tape:
    """What a forward piece leaves for backward: a vjp (plain) or the inputs (recomputed)."""

    def __init__(self, info: SegmentInfo, vjp=None, inputs=None):
        self.info, self.vjp, self.inputs = info, vjp, inputs

    def tree_flatten(self):
        return (self.vjp, self.inputs), self.info

    @classmethod
    def tree_unflatten(cls, info, children):
        return cls(info, *children)


class PiecesExecutor:
    """The "pieces" executor for one `Program`: each segment a separately compiled program.

    Python references are the memory manager: a value is dropped from `env` after its last
    reader, a tape is dropped once its backward ran, and cotangents and dead activations are
    donated to the piece that consumes them (XLA writes its results into them)."""

    def __init__(self, program: Program):
        self.program = program
        self._fns: dict = {}
        self._add = jax.jit(jnp.add, donate_argnums=(0, 1))

    # jitted pieces, built once per segment ------------------------------------------------
    def _piece(self, kind: str, info: SegmentInfo, extra=()):
        key = (kind, id(info), extra)
        if key not in self._fns:
            self._fns[key] = getattr(self, f"_build_{kind}")(info, *extra)
        return self._fns[key]

    def _build_forward(self, info: SegmentInfo):
        return jax.jit(partial(_segment_fn, info))

    def _build_forward_vjp(self, info: SegmentInfo):
        """Forward with vjp, saving exactly the primal values the memory model keeps
        (`SavePolicy`); what else backward needs is recomputed from them in the backward
        piece. The piece returns only residuals that are not its inputs or outputs (XLA would
        copy those), and the vjp is rebuilt from the parts."""
        names, policy = _save_policy(self.program, info)
        holder: dict = {}

        def flat(diff_in, nondiff_in):
            seg = jax.checkpoint(lambda d: _segment_fn(info, d, nondiff_in, names), policy=policy)
            outs, vjp_fn, aux = jax.vjp(seg, diff_in, has_aux=True)
            leaves, holder["treedef"] = jax.tree.flatten(vjp_fn)
            return [*outs, *aux], leaves

        in_avals = [self._aval(i) for i in info.diff_in], [self._aval(i) for i in info.nondiff_in]
        jaxpr = jax.make_jaxpr(flat)(*in_avals).jaxpr
        n_out = len(info.live_out)
        outvars, resvars = jaxpr.outvars[:n_out], jaxpr.outvars[n_out:]
        sources, computed = [], []  # per residual: ("in", k) | ("out", k) | ("new", k)
        for r in resvars:
            if not isinstance(r, Literal) and r in jaxpr.invars:
                sources.append(("in", jaxpr.invars.index(r)))
            elif any(r is o for o in outvars):
                sources.append(("out", next(k for k, o in enumerate(outvars) if r is o)))
            else:
                sources.append(("new", len(computed)))
                computed.append(len(sources) - 1)
        treedef = holder["treedef"]

        @jax.jit
        def forward_vjp(diff_in, nondiff_in):
            outs, leaves = flat(diff_in, nondiff_in)
            return outs, [leaves[k] for k in computed]

        def run(diff_in, nondiff_in):
            outs, new = self._call(f"forward+save {info.label}", forward_vjp, diff_in, nondiff_in)
            flat_in = [*diff_in, *nondiff_in]
            leaves = [
                flat_in[k] if src == "in" else outs[k] if src == "out" else new[k]
                for src, k in sources
            ]
            n = len(info.diff_out)
            return outs[:n], outs[n:], jax.tree.unflatten(treedef, leaves)

        return run

    def _build_apply_vjp(self, info: SegmentInfo):
        program = self.program

        @partial(jax.jit, donate_argnums=1)  # the cotangents are dead after this piece
        def apply_vjp(vjp_fn, cts):
            return vjp_fn(_fill_zeros(cts, info.diff_out, program))[0]

        return apply_vjp

    def _build_fused(self, info: SegmentInfo, keep: tuple[int, ...], dead: tuple[bool, ...]):
        """Forward (or recompute) and backward of a childless segment in one program;
        returns the outputs listed in `keep` and the cotangents of the diff inputs. Diff
        inputs flagged `dead` (nothing else refers to them) and the cotangents are donated,
        so XLA can write the results into them."""
        program = self.program

        @partial(jax.jit, donate_argnums=(0, 3))
        def fused(dead_in, live_in, nondiff_in, cts):
            dead_it, live_it = iter(dead_in), iter(live_in)
            diff_in = [next(dead_it) if d else next(live_it) for d in dead]
            outs, vjp_fn, aux = jax.vjp(
                lambda d: _segment_fn(info, d, nondiff_in), diff_in, has_aux=True
            )
            values = dict(zip(info.diff_out, outs))
            values.update(zip(info.nondiff_out, aux))
            in_cts = vjp_fn(_fill_zeros(cts, info.diff_out, program))[0]
            return [values[o] for o in keep], in_cts

        return fused

    def _run_fused(self, name, info, keep, diff_in: list, nondiff_in: list, cts: list):
        # An array only `diff_in` refers to (list entry + getrefcount's argument) is dead
        # after this piece: donate it.
        dead = tuple(sys.getrefcount(diff_in[k]) <= 2 for k in range(len(diff_in)))
        dead_in = [v for v, d in zip(diff_in, dead) if d]
        live_in = [v for v, d in zip(diff_in, dead) if not d]
        diff_in.clear()
        fused = self._piece("fused", info, (keep, dead))
        return self._call(name, fused, dead_in, live_in, nondiff_in, cts)

    def _aval(self, i: int):
        a = self.program.avals[i]
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))

    def _call(self, name: str, fn, *args):
        return run_compiled(name, fn, *args)

    # passes -------------------------------------------------------------------------------
    def forward(self, infos: list[SegmentInfo], env: dict, keep: set[int]) -> list[_Tape]:
        """Run `infos` forward, leaving in `env` the values in `keep` or read by a later
        segment; returns one tape per segment for `backward`."""
        last_use = {i: s for s, info in enumerate(infos) for i in info.live_in}
        tapes = []
        for s, info in enumerate(infos):
            diff_in = [env[i] for i in info.diff_in]
            nondiff_in = [env[i] for i in info.nondiff_in]
            needs_backward = bool(info.diff_in and info.diff_out)
            if info.recompute or not needs_backward:
                name = f"forward {info.label}"
                douts, nouts = self._call(name, self._piece("forward", info), diff_in, nondiff_in)
                if needs_backward:
                    tapes.append(_Tape(info, inputs=(diff_in, nondiff_in)))
            else:
                douts, nouts, vjp_fn = self._piece("forward_vjp", info)(diff_in, nondiff_in)
                tapes.append(_Tape(info, vjp=vjp_fn))
                del vjp_fn
            del diff_in, nondiff_in
            for o, v in zip(info.diff_out + info.nondiff_out, [*douts, *nouts]):
                if o in keep or last_use.get(o, -1) > s:
                    env[o] = v
            del douts, nouts
            for i in info.live_in:
                if last_use[i] == s and i not in keep:
                    env.pop(i, None)
        return tapes

    def backward(self, tapes: list[_Tape], ct: dict) -> None:
        """Backpropagate through `tapes` in reverse, consuming them; `ct` maps value ids to
        cotangents: those of the segments' outputs are consumed, those of their inputs
        accumulated."""
        while tapes:
            tape = tapes.pop()
            info = tape.info
            cts = [ct.pop(o, None) for o in info.diff_out]
            if not info.diff_in or all(c is None for c in cts):
                continue
            if tape.vjp is not None:
                name = f"backward {info.label}"
                in_cts = self._call(name, self._piece("apply_vjp", info), tape.vjp, cts)
            elif not info.children:
                diff_in, nondiff_in = tape.inputs
                del tape
                name = f"recompute+backward {info.label}"
                _, in_cts = self._run_fused(name, info, (), diff_in, nondiff_in, cts)
                del diff_in, nondiff_in, cts
                self._accumulate(ct, info.diff_in, in_cts)
                del in_cts  # else this frame keeps them alive through the next recursion
                continue
            else:
                diff_in, nondiff_in = tape.inputs
                env = dict(zip(info.diff_in, diff_in))
                env.update(zip(info.nondiff_in, nondiff_in))
                ct.update((o, c) for o, c in zip(info.diff_out, cts) if c is not None)
                del tape, cts, diff_in, nondiff_in
                self.run_with_backward(info.children, env, ct, keep=set())
                continue
            del tape, cts
            self._accumulate(ct, info.diff_in, in_cts)
            del in_cts

    def run_with_backward(
        self, infos: list[SegmentInfo], env: dict, ct: dict, keep: set[int]
    ) -> None:
        """Forward through `infos`, then backward: the last segment runs forward and backward
        in one piece. Values in `keep` are left in `env`; `ct` as in `backward`."""
        *head, last = infos
        tapes = self.forward(head, env, keep | set(last.live_in))
        if last.children:
            sub_env = {i: env[i] for i in last.live_in}
            for i in last.live_in:
                if i not in keep:
                    env.pop(i, None)
            self.run_with_backward(last.children, sub_env, ct, keep)
            env.update((i, sub_env[i]) for i in keep if i in sub_env)
            del sub_env
        else:
            cts = [ct.pop(o, None) for o in last.diff_out]
            out_keep = tuple(o for o in last.live_out if o in keep)
            diff_in = [env[i] for i in last.diff_in]
            nondiff_in = [env[i] for i in last.nondiff_in]
            for i in last.live_in:
                if i not in keep:
                    env.pop(i, None)
            name = f"forward+backward {last.label}"
            outs, in_cts = self._run_fused(name, last, out_keep, diff_in, nondiff_in, cts)
            del diff_in, nondiff_in, cts
            env.update(zip(out_keep, outs))
            self._accumulate(ct, last.diff_in, in_cts)
            del outs, in_cts  # else they stay alive while `backward` below recurses
        self.backward(tapes, ct)

    def _accumulate(self, ct: dict, ids, values) -> None:
        for i, v in zip(ids, values):
            if i in ct:
                ct[i] = self._call("accumulate", self._add, ct[i], v)
            else:
                ct[i] = v


# ----------------------------------------------------------------------------- planning


@dataclass(eq=False)
class Compiled:
    """Everything cached for one input signature: capture, plan and executors."""

    captured: CapturedFunction
    plan: Plan
    infos: list[SegmentInfo]
    pieces: PiecesExecutor
    program_fn: Any = None  # the jitted one-program grad ("remat", eager), built on first use

    @property
    def program(self) -> Program:
        return self.captured.program


def make_plan(graph, budget, *, block_size: int = 1, planner: str = "optimal") -> Plan:
    """Plan `graph` under `budget` with hbp's planner (raises BudgetError / ConfigError)."""
    from hbp.planner import plan as hbp_plan

    return hbp_plan(graph, budget, block_size=block_size, planner=planner)


def _check_options(budget, block_size, strategy, plan) -> None:
    from hbp.planner.budget import parse_budget

    if plan is None and not (isinstance(budget, str) and budget == "min"):
        parse_budget(budget, 1 << 62)  # type and range checks; bytes vs naive peak come later
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "a positive int")
    if strategy not in STRATEGIES:
        raise ConfigError("strategy", strategy, f"one of {STRATEGIES}")
    if plan is not None and not isinstance(plan, Plan | list):
        raise ConfigError("plan", type(plan).__name__, "an hbp.planner.Plan or None")


class _Planned:
    """Shared machinery: capture + plan per input signature, cached."""

    def __init__(self, fun, budget, block_size, planner, strategy, plan):
        _check_options(budget, block_size, strategy, plan)
        self.fun = fun
        self.budget = budget
        self.block_size = block_size
        self.planner = planner
        self.strategy = strategy
        self._fixed_plan = plan
        self._cache: dict = {}
        self._plans: dict = {}
        self.plan: Plan | None = None  # the plan of the most recent call

    def _compiled(self, fun, args: tuple, diff_mask, static_key=None, check=None) -> Compiled:
        """Capture and plan (cached per signature); `check(program)` runs before planning."""
        avals = abstractify(args)
        leaves, treedef = jax.tree.flatten(avals)
        key = (
            treedef,
            tuple((a.shape, a.dtype, a.weak_type) for a in leaves),
            diff_mask,
            static_key,
        )
        if key in self._cache:
            self.plan = self._cache[key].plan
            return self._cache[key]
        captured = capture_program(fun, avals, diff_mask=diff_mask)
        if check is not None:
            check(captured.program)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(captured)
            self._plans[key] = plan
        check_segments(plan.segments, 0, len(captured.graph))
        compiled = Compiled(
            captured,
            plan,
            resolve_segments(captured.program, plan.segments),
            PiecesExecutor(captured.program),
        )
        # Closed-over tracers (fun called inside someone's jit) belong to this trace only.
        if not any(isinstance(c, jax.core.Tracer) for c in captured.program.consts):
            self._cache[key] = compiled
        self.plan = plan
        return compiled

    def _make_plan(self, captured: CapturedFunction) -> Plan:
        fixed = self._fixed_plan
        if fixed is None:
            return make_plan(
                captured.graph, self.budget, block_size=self.block_size, planner=self.planner
            )
        return fixed if isinstance(fixed, Plan) else Plan(segments=list(fixed))

    def _use_pieces(self, values) -> bool:
        if self.strategy == "remat":
            return False
        if self.strategy == "pieces":
            return True
        return not any(isinstance(v, jax.core.Tracer) for v in values)


def _check_argnums(argnums):
    """`argnums` as an int or a non-empty tuple of ints (a list becomes a tuple, as in
    `jax.grad`); anything else raises ConfigError."""
    if isinstance(argnums, list):
        argnums = tuple(argnums)
    ok = isinstance(argnums, int) or (
        isinstance(argnums, tuple)
        and len(argnums) > 0
        and all(isinstance(n, int) and not isinstance(n, bool) for n in argnums)
    )
    if isinstance(argnums, bool) or not ok:
        raise ConfigError("argnums", argnums, "an int or a non-empty tuple of ints")
    return argnums


def _argnums_mask(args, argnums) -> tuple[bool, ...]:
    """Per flat leaf of `args`: whether it belongs to an argument in `argnums`."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    for n in nums:
        if not -len(args) <= n < len(args):
            raise ConfigError(
                "argnums",
                argnums,
                f"indices of the {len(args)} positional arguments passed, in "
                f"[{-len(args)}, {len(args)})",
            )
    nums = {n % len(args) for n in nums}
    mask: list[bool] = []
    for k, a in enumerate(args):
        mask += [k in nums] * len(jax.tree.leaves(a))
    return tuple(mask)


@dataclass(frozen=True)
class _Bound:
    """`fun(*args, **kwargs)` split like `jax.grad` splits it: array leaves (arrays, tracers,
    Python numbers) are traced, everything else (strings, callables, kwargs' non-array
    values) is static, part of the cache key and closed over.

    `args` are the traced positional arguments, one list of array leaves per positional
    argument (kwargs' array leaves as one more, never differentiated); `key` identifies the
    static part; `treedefs` rebuild each positional argument from its leaves."""

    fun: Any
    args: tuple
    key: Any
    treedefs: tuple


def _is_array_leaf(x) -> bool:
    """Whether `jax.jit` would trace this leaf (Python numbers included)."""
    array_types = jax.Array | jax.core.Tracer | np.ndarray | np.generic | jax.ShapeDtypeStruct
    return isinstance(x, array_types | int | float | complex)


def _bind(fun, args: tuple, kwargs: dict, argnums=None) -> _Bound | None:
    """None when every leaf is an array and there are no kwargs (nothing to bind)."""
    flat = [jax.tree.flatten(a) for a in args]
    kw_leaves, kw_tree = jax.tree.flatten(kwargs)
    if not kwargs and all(_is_array_leaf(x) for leaves, _ in flat for x in leaves):
        return None
    nums = set()
    if argnums is not None:
        nums = {n % len(args) for n in ((argnums,) if isinstance(argnums, int) else argnums)}
    statics = []
    for i, (leaves, _) in enumerate(flat):
        for k, x in enumerate(leaves):
            if not _is_array_leaf(x):
                if i in nums:
                    raise TypeError(
                        f"Argument {x!r} of type {type(x)} is not a valid JAX type (argument "
                        f"{i} is differentiated: argnums={argnums})"
                    )
                statics.append((i, k, x))
    kw_static = tuple((k, x) for k, x in enumerate(kw_leaves) if not _is_array_leaf(x))
    treedefs = tuple(t for _, t in flat)
    key = (treedefs, tuple(statics), kw_tree, kw_static)
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            "height_compressed: non-array arguments (here "
            f"{[type(x).__name__ for *_, x in statics + list(kw_static)]}) are static: they "
            "must be hashable (they key the cached plan)"
        ) from None
    dyn = tuple([x for x in leaves if _is_array_leaf(x)] for leaves, _ in flat)
    kw_dyn = [x for x in kw_leaves if _is_array_leaf(x)]

    def merge(dyn_leaves, static_leaves: dict, n: int) -> list:
        it = iter(dyn_leaves)
        return [static_leaves[k] if k in static_leaves else next(it) for k in range(n)]

    def bound(*dyn_args):
        full = []
        for i, ((leaves, treedef), d) in enumerate(zip(flat, dyn_args)):
            st = {k: x for j, k, x in statics if j == i}
            full.append(jax.tree.unflatten(treedef, merge(d, st, len(leaves))))
        kw_full = merge(dyn_args[len(flat)], dict(kw_static), len(kw_leaves))
        kw = jax.tree.unflatten(kw_tree, kw_full)
        return fun(*full, **kw)

    return _Bound(bound, (*dyn, kw_dyn), key, treedefs)


def _env(program: Program, leaves) -> dict:
    env = dict(zip(program.invars, leaves))
    env.update(zip(program.constvars, program.consts))
    return env


# ----------------------------------------------------------------------------- public API


class HeightCompressed(_Planned):
    """`height_compressed(fun, ...)`: callable like `fun`; see `height_compressed`."""

    def __init__(self, fun, budget, argnums, block_size, planner, strategy, plan):
        super().__init__(fun, budget, block_size, planner, strategy, plan)
        self.argnums = None if argnums is None else _check_argnums(argnums)

    def get_plan(self, *args) -> Plan:
        """The plan for these arguments (arrays or `jax.ShapeDtypeStruct`s)."""
        return self._compiled(self.fun, args, self._default_mask(args)).plan

    def _default_mask(self, args) -> tuple[bool, ...]:
        if self.argnums is None:
            return tuple(
                jnp.issubdtype(a.dtype, jnp.inexact) for a in jax.tree.leaves(abstractify(args))
            )
        return _argnums_mask(args, self.argnums)

    def __call__(self, *args):
        leaves, in_tree = jax.tree.flatten(args)
        if self.strategy == "remat":
            compiled = self._compiled(self.fun, args, self._default_mask(args))
            env = _env(compiled.program, leaves)
            run_remat(compiled.infos, env)
            outs = [_read(env, o) for o in compiled.program.outvars]
            return jax.tree.unflatten(compiled.program.out_tree, outs)
        out_tree_box: dict = {}
        flat = self._custom_vjp(in_tree, out_tree_box)
        outs = flat(*leaves)
        return jax.tree.unflatten(out_tree_box["out_tree"], outs)

    def _custom_vjp(self, in_tree, box: dict):
        """`fun` over flat leaves as a custom_vjp whose rules run the plan."""

        def unflat(leaves):
            return jax.tree.unflatten(in_tree, leaves)

        @jax.custom_vjp
        def flat(*leaves):
            outs, out_tree = jax.tree.flatten(self.fun(*unflat(leaves)))
            box["out_tree"] = out_tree
            return outs

        def fwd(*primals):
            values = [p.value for p in primals]
            mask = self._default_mask(unflat(values))
            for k, p in enumerate(primals):
                if p.perturbed and not mask[k]:
                    raise ConfigError(
                        "argnums",
                        self.argnums,
                        f"to include every differentiated argument (flat leaf {k} is "
                        "differentiated)",
                    )
            compiled = self._compiled(self.fun, unflat(values), mask)
            program = compiled.program
            box["out_tree"] = program.out_tree
            if self._use_pieces([*values, *program.consts]):
                env = _env(program, values)
                keep = {o for o in program.outvars if isinstance(o, int)}
                tapes = compiled.pieces.forward(compiled.infos, env, keep)
                outs = [_read(env, o) for o in program.outvars]
                return outs, _Residuals("pieces", compiled, tapes)
            diff_pos = [k for k, m in enumerate(mask) if m]

            def of_diff(*diff_leaves):
                full = list(values)
                for k, v in zip(diff_pos, diff_leaves):
                    full[k] = v
                env = _env(program, full)
                run_remat(compiled.infos, env)
                return [_read(env, o) for o in program.outvars]

            outs, vjp_fn = jax.vjp(of_diff, *[values[k] for k in diff_pos])
            return outs, _Residuals("remat", compiled, vjp_fn)

        def bwd(res, cts):
            kind, compiled, payload = res.kind, res.compiled, res.payload
            program = compiled.program
            cts = [None if isinstance(c, SymbolicZero) else c for c in cts]
            mask = program.diff_mask
            if kind == "remat":
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


class HeightCompressedGrad(_Planned):
    """`height_compressed_grad(fun, ...)`: like `jax.grad(fun, ...)`; see there."""

    def __init__(self, fun, budget, argnums, has_aux, block_size, planner, strategy, plan):
        super().__init__(fun, budget, block_size, planner, strategy, plan)
        self.argnums = _check_argnums(argnums)
        self.has_aux = bool(has_aux)

    def _mask(self, args, argnums) -> tuple[bool, ...]:
        mask = _argnums_mask(args, argnums)
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
        _argnums_mask(args, self.argnums)  # range check against the caller's arguments
        nums = (self.argnums,) if isinstance(self.argnums, int) else self.argnums
        argnums = tuple(n % len(args) for n in nums)
        fun, traced, static_key, treedefs = self._loss_fun(), args, None, None
        bound = _bind(fun, args, kwargs, argnums)
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
        traced = any(isinstance(v, jax.core.Tracer) for v in [*leaves, *program.consts])
        if self.strategy == "remat" or (self.strategy == "auto" and traced):
            grads, aux = self._remat_grad(compiled, traced_args, argnums, traced)
        else:
            grads, aux = self._pieces_grad(compiled, leaves, argnums)
        if treedefs is not None:
            grads = tuple(jax.tree.unflatten(treedefs[n], g) for n, g in zip(argnums, grads))
        result = grads[0] if isinstance(self.argnums, int) else grads
        return (result, aux) if self.has_aux else result

    def _pieces_grad(self, compiled: Compiled, leaves: list, argnums: tuple):
        """The "pieces" executor: (gradients per argnum, aux or None)."""
        program = compiled.program
        loss = program.outvars[0]
        env = _env(program, leaves)
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
        outs = jax.tree.unflatten(program.out_tree, [_read(env, o) for o in program.outvars])
        return tuple(per_arg[n] for n in argnums), (outs[1] if self.has_aux else None)

    def _remat_grad(self, compiled: Compiled, args, argnums: tuple, traced: bool):
        """The "remat" executor: (gradients per argnum, aux or None). Traced: evaluated in
        the caller's trace. Eager: one jitted program, compiled with `compiler_options()`
        so XLA:CPU keeps the recomputation."""
        program = compiled.program

        def run(*a):
            env = _env(program, jax.tree.leaves(a))
            run_remat(compiled.infos, env)
            return jax.tree.unflatten(program.out_tree, [_read(env, o) for o in program.outvars])

        grad = jax.grad(run, argnums=argnums, has_aux=self.has_aux)
        if traced:
            out = grad(*args)
        else:
            if compiled.program_fn is None:
                compiled.program_fn = jit(grad)
            out = run_compiled("one program (remat)", compiled.program_fn, *args)
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
    budget: float | int | str = 0.3,
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
        budget: float in (0, 1] = fraction of the simulated naive peak; int = bytes; str like
            "64MiB". Infeasible -> `hbp.BudgetError` (with `.minimum`); malformed ->
            `hbp.ConfigError`.
        block_size: granularity of the plan's leaves (planner option).
        planner: planner name (see `hbp.planner.plan`).
        strategy: "auto" (default: separately compiled pieces when called eagerly, remat
            under tracing), "pieces" or "remat" (see the module docstring). "auto"/"pieces"
            define a `jax.custom_vjp`, so forward-mode (`jax.jvp`) is not available; "remat"
            composes with everything.
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
    budget: float | int | str = 0.3,
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
    for the least memory the planner can reach. Works eagerly (where
    "auto" runs separately compiled pieces: the memory saving is real on XLA:CPU) and under
    `jax.jit` (planning happens at trace time from the avals; execution is one program with
    `jax.checkpoint` segments). Other arguments as in `height_compressed`.
    """
    return HeightCompressedGrad(fun, budget, argnums, has_aux, block_size, planner, strategy, plan)


# ----------------------------------------------------------------------------- measurement


@dataclass
class MemoryReport:
    """Memory of one call of a JAX function (bytes).

    Attributes:
        strategy: what ran: "pieces" (hbp's separately compiled pieces), "remat" (hbp's one
            jitted program with `compiler_options()`), or "one program" (`fn` is not an
            hbp function running eagerly: measured as `jax.jit(fn)`).
        peak_bytes: max over the compiled programs that ran of: live array bytes when it
            started (above the level before the call) + its temp + its output bytes. For
            "one program": temp + output (its arguments exist before the call).
        temp_bytes / output_bytes / argument_bytes: of the program (pieces: of the piece at
            the peak).
        n_pieces: compiled programs that ran.
        rss_growth_bytes: process max-RSS during the measured run minus RSS before it (-1
            when the high-water mark could not be reset: then it is a lower bound only).
        wall_s: seconds of the measured run.
        pieces: the per-piece records (pieces strategy).
    """

    strategy: str
    peak_bytes: int
    temp_bytes: int
    output_bytes: int
    argument_bytes: int
    n_pieces: int
    rss_growth_bytes: int
    wall_s: float
    pieces: list[PieceRecord] = field(default_factory=list, repr=False)


def measure(fn, *args) -> MemoryReport:
    """Measure one call of `fn(*args)` (after a warm-up call that compiles everything).

    If `fn` runs hbp's compiled programs eagerly (a `height_compressed_grad` function, or
    `jax.grad` of a `height_compressed` one), the programs that ran are reported; otherwise
    `fn` is measured as one `jax.jit(fn)` program (wrap it in `hbp.jax.jit` first to measure
    it with `compiler_options()`). RSS: `/proc/self/clear_refs` resets the high-water mark right
    before the run (Linux); freed memory that the allocator keeps can hide growth, so run in
    a fresh process with `MALLOC_MMAP_THRESHOLD_` set (as `experiments/bench_jax.py` does) for
    a sharp number.
    """
    with record_pieces() as warm:
        jax.block_until_ready(fn(*args))
    if warm.records:
        run, analysis = fn, None
    else:
        run = jax.jit(fn)
        analysis = run.lower(*args).compile().memory_analysis()
        jax.block_until_ready(run(*args))
    gc.collect()
    with record_pieces() as rec:
        rss_before, reset = _current_rss(), _reset_rss_peak()
        start = time.perf_counter()
        out = run(*args)
        jax.block_until_ready(out)
        wall = time.perf_counter() - start
        growth = _max_rss() - rss_before if reset else -1
        del out
    if analysis is not None:
        temp, outb = int(analysis.temp_size_in_bytes), int(analysis.output_size_in_bytes)
        return MemoryReport(
            "one program",
            temp + outb,
            temp,
            outb,
            int(analysis.argument_size_in_bytes),
            1,
            growth,
            wall,
        )
    top = max(rec.records, key=lambda r: r.peak_bytes)
    one_program = any(r.name.startswith("one program") for r in rec.records)
    return MemoryReport(
        "remat" if one_program else "pieces",
        top.peak_bytes,
        top.temp_bytes,
        top.output_bytes,
        top.argument_bytes,
        len(rec.records),
        growth,
        wall,
        rec.records,
    )


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


__all__ = [
    "STRATEGIES",
    "HeightCompressed",
    "HeightCompressedGrad",
    "MemoryReport",
    "PieceRecord",
    "height_compressed",
    "height_compressed_grad",
    "compiler_options",
    "jit",
    "measure",
    "record_pieces",
]
