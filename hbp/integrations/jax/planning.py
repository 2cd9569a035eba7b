"""Capture and plan per input signature, cached."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import jax

from hbp.errors import BudgetError, BudgetWarning, ConfigError
from hbp.graph.jax_capture import CapturedFunction, Program, abstractify, capture_program
from hbp.integrations.jax.pieces import PiecesExecutor
from hbp.integrations.jax.remat import PARTIAL_READS, taken_whole
from hbp.integrations.jax.segments import SegmentInfo, check_segments, resolve_segments
from hbp.planner.budget import Budget, BudgetKind
from hbp.planner.plan import Plan
from hbp.runtime.heap import heap_returned_after

STRATEGIES = ("auto", "fenced", "pieces", "remat")
# What "auto" runs when called with concrete arrays (under tracing it runs "fenced").
EAGER_AUTO = "fenced"


@dataclass(eq=False)
class Compiled:
    """Everything cached for one input signature: capture, plan and executors."""

    captured: CapturedFunction
    plan: Plan
    infos: list[SegmentInfo]
    pieces: PiecesExecutor
    program_fns: dict = field(default_factory=dict)  # executor -> its jitted one-program grad

    @property
    def program(self) -> Program:
        return self.captured.program


def make_plan(graph, budget, *, block_size: int = 1, planner: str = "optimal") -> Plan:
    """Plan `graph` under `budget` with hbp's planner (raises BudgetError / ConfigError)."""
    from hbp.planner import plan as hbp_plan

    # hbp.jax runs plans without pins (NOTE [ Pin candidates ]): plan without them
    return hbp_plan(graph, budget, block_size=block_size, planner=planner, pins=False)


def resolve_budget(graph, budget: Budget, *, block_size: int = 1, planner: str = "optimal"):
    """The planner's target for `budget` on `graph`: "min", or bytes (`Budget.resolve`; "fit"
    reads the machine's available memory: XLA:CPU's arrays are host memory)."""
    from hbp.analysis.simulate import simulate
    from hbp.planner import least_peak

    naive = simulate(graph).peak_bytes
    return budget.resolve(naive, lambda: least_peak(graph, block_size=block_size, planner=planner))


def check_options(budget, block_size, strategy, plan) -> None:
    if plan is None:
        Budget.parse(budget)  # every form hbp.HCModule takes; bytes vs naive peak come later
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "a positive int")
    if strategy not in STRATEGIES:
        raise ConfigError("strategy", strategy, f"one of {STRATEGIES}")
    if plan is not None and not isinstance(plan, Plan | list):
        raise ConfigError("plan", type(plan).__name__, "an hbp.planner.Plan or None")


class Planned:
    """Shared machinery: capture + plan per input signature, cached."""

    def __init__(self, fun, budget, block_size, planner, strategy, plan):
        check_options(budget, block_size, strategy, plan)
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
            with heap_returned_after():  # NOTE [ Planning's freed heap ]
                plan = self._make_plan(captured)
            self._plans[key] = plan
        check_segments(plan.segments, 0, len(captured.graph))
        compiled = Compiled(
            captured,
            plan,
            resolve_segments(captured.program, plan.segments),
            PiecesExecutor(captured.program),
        )
        if self.strategy != "pieces":  # the pieces add each cotangent into one running sum
            _warn_on_stacked_weights(compiled, self.strategy, avals)
        if self.strategy in ("auto", "fenced"):
            _warn_on_convolutions_in_conditionals(compiled)
        # Closed-over tracers (fun called inside someone's jit) belong to this trace only.
        if not any(isinstance(c, jax.core.Tracer) for c in captured.program.consts):
            self._cache[key] = compiled
        self.plan = plan
        return compiled

    def _make_plan(self, captured: CapturedFunction) -> Plan:
        fixed = self._fixed_plan
        if fixed is None:
            budget = Budget.parse(self.budget)
            target = resolve_budget(
                captured.graph, budget, block_size=self.block_size, planner=self.planner
            )
            try:
                return make_plan(
                    captured.graph, target, block_size=self.block_size, planner=self.planner
                )
            except BudgetError as err:
                from hbp.analysis.simulate import naive_peak

                way_out = budget.way_out(err.minimum, naive_peak(captured.graph))
                if way_out is None:
                    raise
                fraction = (
                    "a fraction is of hbp's simulated plain step, not of what XLA compiles "
                    "for jax.grad; "
                    if budget.kind is BudgetKind.FRACTION
                    else ""
                )
                raise err.with_detail(fraction + way_out) from err
        return fixed if isinstance(fixed, Plan) else Plan(segments=list(fixed))

    eager_auto = EAGER_AUTO  # what "auto" runs on concrete arrays

    def _executor(self, values) -> str:
        """The executor to run: the strategy, or for "auto" `eager_auto` on concrete arrays
        and "fenced" under tracing."""
        if self.strategy != "auto":
            return self.strategy
        traced = any(isinstance(v, jax.core.Tracer) for v in values)
        return "fenced" if traced else self.eager_auto


def _warn_on_stacked_weights(compiled: Compiled, executor: str, args) -> None:
    """Warn once when a recomputed segment's backward returns the full-size gradient of an
    argument that two or more slices read (NOTE [ Loops over stacked weights ]), naming where
    it sits in `args` (the call's arguments)."""
    program = compiled.program
    sliced: dict[int, int] = {}
    for op in program.ops:
        if op.eqn.primitive.name in PARTIAL_READS and isinstance(op.inputs[0], int):
            sliced[op.inputs[0]] = sliced.get(op.inputs[0], 0) + 1
    if executor == "remat":
        whole = {v for info in compiled.infos if info.recompute for v in info.diff_in}
    else:
        whole = taken_whole(compiled.infos)
    paths = jax.tree_util.tree_leaves_with_path(args)
    found = [
        f"{f'args{jax.tree_util.keystr(paths[k][0])}' if k < len(paths) else 'an argument'} "
        f"(shape {tuple(program.avals[v].shape)}, sliced {sliced[v]} times)"
        for k, v in enumerate(program.invars)
        if v in program.needs_grad and sliced.get(v, 0) >= 2 and v in whole
    ]
    if found:
        listed = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        warnings.warn(
            f"hbp.jax: {listed} {'is' if len(found) == 1 else 'are'} sliced in a lax.scan or "
            "loop over stacked weights and read whole by nested recomputed segments, whose "
            "backward returns a gradient of its full size: under jax.jit the compiled step "
            "can exceed the plan. Keep per-layer weights in a list or pytree of layers "
            "(docs/jax.md).",
            BudgetWarning,
            stacklevel=5,  # the caller of the gradient function, when called as is
        )


#: Primitives XLA:CPU runs on a slow path inside a conditional (NOTE [ Convolutions inside
#: a conditional on XLA:CPU ]).
SLOW_IN_CONDITIONALS = ("conv_general_dilated",)


def _warn_on_convolutions_in_conditionals(compiled: Compiled) -> None:
    """Warn once where the fenced executor would recompute a convolution on XLA:CPU."""
    if jax.default_backend() != "cpu":
        return
    recomputed = [
        op.eqn.primitive.name
        for info in compiled.infos
        if info.recompute
        for op in info.ops
        if op.eqn.primitive.name in SLOW_IN_CONDITIONALS
    ]
    if recomputed:
        warnings.warn(
            f"hbp.jax: {len(recomputed)} convolution(s) are recomputed, and with their "
            "gradients run inside the conditional the fenced executor recomputes in, where "
            "XLA:CPU runs convolutions several times slower than in plain jax.grad. On CPU, "
            'strategy="remat" under hbp.jax.jit keeps them on the fast path (docs/jax.md).',
            UserWarning,
            stacklevel=5,
        )


# NOTE [ Convolutions inside a conditional on XLA:CPU ]
# The fenced executor recomputes each segment, and runs its backward, inside a `lax.cond`
# (NOTE [ Recomputation under the caller's jax.jit ]). XLA:CPU rewrites a convolution into its
# fast layout outside a conditional's branches only: inside one, the convolutions of a
# recomputed segment and their gradients run several times slower than in plain `jax.grad`,
# and a conv net's step can compile to more memory than plain (docs/jax.md gives the
# figures). `strategy="remat"` under `hbp.jax.jit` has no conditional. hbp says so once per
# signature on CPU; other backends are not known to do this.


# NOTE [ Loops over stacked weights ]
# A lax.scan (or fori_loop) over weights stacked as W[L, ...] reads one slice per layer; once
# unrolled and cut into segments, every recomputed segment that reads a slice takes W as an
# input. Were its custom_vjp's backward to return W's cotangent, that would be of W's full
# size (the slice's gradient padded out) and made inside the conditional, where XLA cannot
# add it into the running sum in place: several are alive at once, which the plan does not
# count. A new-user trial measured, at 12 layers of 256 x 256 (batch 256), 22.25 MiB compiled
# at budget 0.5 against 13.25 for plain jax.grad and a plan of 5.50.
#
# So the fenced backward (`fenced_segment`) recomputes the slices of such an input inside the
# conditional, differentiates the segment with respect to the slices, returns slice-sized
# cotangents from the conditional and pads them out after it, where XLA fuses the pad into
# the running sum. That case now compiles to 7.25 MiB. It applies where every read of the
# input in the segment is a slice whose indices are known before the segment runs (literals,
# inputs, or integer equations of those in the segment: an unrolled `fori_loop`'s `W[i]`,
# whose `i` the segment normalises; such a loop over 8 stacked layers at batch 64 and 0.7
# compiled to 32.25 MiB before, 15.35 now, plain jax.grad 19.90) and no recomputed
# segment nested inside it reads the input; a nested one would need the slices as its own
# inputs, held from its forward to its backward, which measured worse ("min" with ten nested
# levels: 19.0 against 16.0 MiB at batch 1024). Such deeply nested "min" plans still compile
# above the plan (14.63 MiB at batch 64 against a plan of 3.50 and plain 5.75), so the first
# plan of such a signature warns (`taken_whole`), as it does under strategy="remat", whose
# `jax.checkpoint` returns the full-size cotangent. `strategy="pieces"`, whose pieces add
# each cotangent into one running sum in place, matches its plan (tests/test_jax_memory.py).
