"""Capture and plan per input signature, cached."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from hbp.errors import ConfigError
from hbp.graph.jax_capture import CapturedFunction, Program, abstractify, capture_program
from hbp.integrations.jax.pieces import PiecesExecutor
from hbp.integrations.jax.segments import SegmentInfo, check_segments, resolve_segments
from hbp.planner.budget import Budget
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
        # Closed-over tracers (fun called inside someone's jit) belong to this trace only.
        if not any(isinstance(c, jax.core.Tracer) for c in captured.program.consts):
            self._cache[key] = compiled
        self.plan = plan
        return compiled

    def _make_plan(self, captured: CapturedFunction) -> Plan:
        fixed = self._fixed_plan
        if fixed is None:
            target = resolve_budget(
                captured.graph,
                Budget.parse(self.budget),
                block_size=self.block_size,
                planner=self.planner,
            )
            return make_plan(
                captured.graph, target, block_size=self.block_size, planner=self.planner
            )
        return fixed if isinstance(fixed, Plan) else Plan(segments=list(fixed))

    eager_auto = EAGER_AUTO  # what "auto" runs on concrete arrays

    def _executor(self, values) -> str:
        """The executor to run: the strategy, or for "auto" `eager_auto` on concrete arrays
        and "fenced" under tracing."""
        if self.strategy != "auto":
            return self.strategy
        traced = any(isinstance(v, jax.core.Tracer) for v in values)
        return "fenced" if traced else self.eager_auto
