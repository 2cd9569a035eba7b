"""Plan segments resolved against a captured `Program`, and evaluating their equations."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Literal

from hbp.errors import ConfigError
from hbp.graph.jax_capture import Op, Program
from hbp.planner.plan import Segment


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


def read_value(env: dict, a):
    return a.val if isinstance(a, Literal) else env[a]


def bind_op(op: Op, env: dict):
    """`op`'s equation bound in the current trace on its inputs read from `env` (its result:
    a list where the primitive has multiple results)."""
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        return eqn.primitive.bind(*[read_value(env, a) for a in op.inputs], **params)


def eval_ops(ops: list[Op], env: dict, names: dict[int, str] | None = None) -> None:
    """Run `ops` in the current trace, reading and writing `env` (value id -> value).
    Outputs listed in `names` are tagged with `checkpoint_name` (for a remat policy)."""
    for op in ops:
        if op.outputs and all(o in env for o in op.outputs):
            continue  # given: a slice the fenced backward took as an input
        out = bind_op(op, env)
        outs = out if op.eqn.primitive.multiple_results else (out,)
        if names:
            outs = [
                checkpoint_name(v, names[o]) if o in names else v for o, v in zip(op.outputs, outs)
            ]
        env.update(zip(op.outputs, outs))


def segment_fn(info: SegmentInfo, diff_in: list, nondiff_in: list, names=None):
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
        return equation_key(prim, avals, params) in self.equations


def equation_key(prim, avals, params):
    try:
        items = tuple(sorted(params.items()))
        hash(items)
    except TypeError:
        items = None
    return (prim, tuple((a.shape, str(a.dtype)) for a in avals), items)


def save_policy(program: Program, info: SegmentInfo) -> tuple[dict[int, str], SavePolicy]:
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
            equations.add(equation_key(op.eqn.primitive, avals, op.eqn.params))
        named.update(v for v in saved if v in made)
    names = {v: f"hbp_v{v}" for v in sorted(named - by_output)}
    return names, SavePolicy(frozenset(names.values()), frozenset(equations))


def fill_zeros(cts, ids, program: Program) -> list:
    """Cotangents with None replaced by zeros of the value's shape and dtype."""
    return [
        jnp.zeros(program.avals[i].shape, program.avals[i].dtype) if c is None else c
        for c, i in zip(cts, ids)
    ]
