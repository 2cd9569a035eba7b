"""Planning per input signature: capture, plan and executor, made on the first call of a
signature and cached (`Compiled`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hbp.allocator import foreign_profiler_running
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, BudgetWarning, CaptureError, ConfigError
from hbp.graph.torch.capture import MODULE, CapturedGraph, capture
from hbp.graph.torch.scratch_store import ScratchStore
from hbp.graph.torch.trace import hooked_submodules
from hbp.integrations.torch.closed_loop import step_device
from hbp.integrations.torch.parallel import FSDP2_ROOT, is_fsdp2, refuse_parallel_wrappers
from hbp.integrations.torch.signature import signature, state_changes, without_python_state
from hbp.integrations.torch.warn import warn_at_caller
from hbp.planner.budget import Budget, BudgetKind
from hbp.planner.cache import graph_fingerprint
from hbp.planner.carry import CARRIED, Donor, carried_plan, donor_floor_gap, structure_key
from hbp.planner.module_level import module_level_plan
from hbp.planner.plan import Plan
from hbp.runtime.executors import make_executor
from hbp.runtime.executors.module_calls import per_call_plan
from hbp.runtime.heap import heap_returned_after

#: Distinct input signatures after which HCModule warns that it keeps re-planning.
MANY_SIGNATURES = 8

#: Calls of an input signature run by carried plans, after which its next call plans its own
#: (NOTE [ A carried plan until its signature is frequent ]).
OWN_PLAN_AFTER = 50


@dataclass
class Compiled:
    """What HCModule caches per input signature.

    `budget_bytes`: the budget this signature must meet (the plan's own `budget_bytes` is
    lowered when the closed loop plans again); `planned_for`: the options the plan was made
    for; `measured_peak_bytes`: the allocator's peak of the last measured step of its plan
    (None before); `last_measured_peak_bytes`: of this signature's last measured step,
    whatever plan ran it; `measurements`: steps measured so far; `settled`: a measured step met the
    budget (or the loop gave up), so later steps are not measured; `last_measurement`: the
    next measured step is recorded and ends the loop (a plan at the least, which no new plan
    can improve on)."""

    captured: CapturedGraph
    plan: Plan
    executor: Any
    naive_peak_bytes: int
    capture_time_s: float
    plan_time_s: float
    root: nn.Module | None = None
    budget_bytes: int = 0
    measured_peak_bytes: int | None = None
    last_measured_peak_bytes: int | None = None
    others_inside: bool = False  # NOTE [ Other engines in the step ]: in the last measured step
    measurements: int = 0
    settled: bool = False
    last_measurement: bool = False  # the next measured step is the last: the plan is the least
    segments_compiled: Any = None  # the executor with compiled segments, made on first use
    outputs_watched: bool = False  # a step showed which outputs the caller keeps
    outputs_seen: set[str] | None = None  # outputs alive when the last backward ended
    output_paths: dict[str, str] | None = None  # graph output -> where the caller finds it
    scratch_measured: bool = True  # False: captured under a running profiler (no workspace)
    pins: bool = True  # plans may pin values (False: its segments run compiled)
    device: Any = None  # where the step runs
    planned_for: tuple = ()  # HCModule's `_plan_options()` when `plan` was made
    unseen_bytes: int = 0  # what a measured step held above its plan's prediction (closed loop)
    # the caller's loss outside the module, per byte of the outputs backward starts from, as
    # a measured step showed it (NOTE [ The loss outside the module, at a new size ])
    outside_per_output_byte: float = 0.0
    cache_fingerprint: str | None = None  # the graph's, as first planned (`plan_cache`)
    structure: str | None = None  # `structure_key` of an op-level capture (carried plans)
    least: list | None = None  # its least-peak plan's segments, once a carried plan asked
    least_over_floor: float = 1.0  # its least peak over the floor under it (carried plans)
    carried_calls: int = 0  # calls run by carried plans (`_own_plan_due`)

    def measure_again(self, last: bool = False) -> None:
        """The closed loop measures the next step, that of a new plan; with `last`, that
        step ends the loop (a plan at the least: no plan it could make does better)."""
        self.settled, self.measurements, self.last_measurement = False, 0, last


# NOTE [ Captured under a profiler ]
# Kernel workspace is measured at capture by the CPU allocator's profiler events, and CPU
# profiler sessions do not nest: a first step run inside `torch.profiler.profile(...)` (or
# any allocator measurement) plans without workspace, so its plan under-counts attention
# scores and convolution buffers. HCModule warns, and the first call of that signature outside
# a profiler captures and plans it again with the workspace measured. Steps still inside the
# profiler keep the first plan (there is nothing better to plan with there).


def plan_summary(compiled: Compiled) -> str:
    """The capture in one line, then the plan (`str(Plan)`: predictions and segment tree)."""
    captured = compiled.captured
    head = (
        f"HCModule: {captured.granularity}-level capture, {len(captured.graph)} nodes, "
        f"captured in {compiled.capture_time_s:.2f} s, planned in {compiled.plan_time_s:.2f} s"
    )
    if captured.fallback_reason:
        head += f" (op-level capture failed: {captured.fallback_reason})"
    if compiled.plan is None:  # its planning raised: a BudgetError names the least budget
        return f"{head}\nnot planned: no plan fits the budget"
    return f"{head}\n{compiled.plan}"


class Planning:
    """Capture, plan and executor per input signature (a mixin of `HCModule`)."""

    #: Whether the wrapped module's own forward hooks run around each call: not for an
    #: HCModule, which runs the captured graph; yes where the model is enabled in place
    #: (`hbp.enable`: nn.Module's call runs them around the enabled forward).
    ROOT_HOOKS_RUN = False

    def _plans_for(self, args, kwargs) -> bool:
        if not torch.is_grad_enabled():
            return False
        differentiable, swapped, backward_hooks = _walked(self.module)
        if (
            backward_hooks
            or nn.modules.module._global_backward_hooks
            or nn.modules.module._global_backward_pre_hooks
        ):
            hooked = [
                name or type(m).__name__
                for name, m in self.module.named_modules()
                if m._backward_hooks or m._backward_pre_hooks
            ]
            self._warn_once(
                "backward-hooks",
                "HCModule: module backward hooks (register_full_backward_hook, "
                f"register_full_backward_pre_hook) on {', '.join(hooked[:3]) or 'every module'}"
                f"{' and others' if len(hooked) > 3 else ''} are not run by a planned step, whose "
                "graph has no module boundaries: calls with them run the plain module and the "
                "budget is not enforced (NOTE [ Module backward hooks ]). Tensor hooks on "
                "parameters (register_hook, register_post_accumulate_grad_hook) run as usual.",
                BudgetWarning,
            )
            return False
        if swapped:
            self._warn_once(
                "swapped-parameters",
                "HCModule: the module's parameters are replaced by other tensors for this call "
                "(torch.func.functional_call, a stateless reparametrisation): a recompute in "
                "backward would read the module's own parameters, which are back in place by "
                "then, so such calls run the plain module and the budget is not enforced for "
                "them (NOTE [ Parameters swapped for one call ]).",
                BudgetWarning,
            )
            return False
        if not differentiable:
            leaves, _ = tree_flatten((args, kwargs))
            differentiable = any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
        if differentiable and not (self.training or self.plan_in_eval):
            self._warn_once(
                "eval",
                "HCModule in eval mode with grad enabled runs the plain module: the budget is "
                "not enforced. Use torch.no_grad() to evaluate, or HCModule(..., "
                "plan_in_eval=True) to train in eval mode within the budget.",
                BudgetWarning,
            )
            return False
        return differentiable

    # NOTE [ Module backward hooks ]
    # A module's full backward hooks are attached by nn.Module's call around that module's
    # inputs and outputs (an identity autograd Function each side). A captured step is one
    # graph of ops without module boundaries, so they never ran: a hook that scales a layer's
    # input gradient left a Pegasus's gradients silently unscaled (a new-user trial; Opacus
    # computes per-sample gradients this way). A call of a module that has any runs the plain
    # module, with a warning; running them within a plan would need the capture to keep the
    # hooked modules' boundaries.

    # NOTE [ Parameters swapped for one call ]
    # `torch.func.functional_call(model, weights, ...)` puts `weights` in the modules' places
    # for the call's forward and puts the Parameters back when it returns (MAML's fast weights,
    # an ensemble's stacked states). The executor reads parameters from the modules when a
    # segment runs, so a recompute in backward ran on the Parameters, not on the weights of
    # the forward: the loss was right and 41 of 42 gradients of a RoBERTa were not, with no
    # warning (a new-user trial). Each call was also a new signature (new tensors), captured
    # again. Until a segment keeps the tensors its forward read for its recompute, a call
    # whose parameters are not the module's Parameters runs the plain module, with a warning.

    def _prepare(
        self,
        args,
        kwargs,
        root: nn.Module | None = None,
        tag: Any = None,
        compiled_segments: bool = False,
    ) -> Compiled:
        """The capture, plan and executor of this call's signature (made on first use);
        `compiled_segments`: the call runs its segments compiled (torch.compile(hc))."""
        key = (tag, self._signature(args, kwargs))
        stateless = (tag, without_python_state(key[1]))  # NOTE [ Module calls fix no Python state ]
        if key in self._uncaptured or stateless in self._uncaptured:
            # NOTE [ A step no capture reaches ] in capture.py
            raise self._uncaptured.get(key) or self._uncaptured[stateless]
        compiled = self._compiled.get(key) or self._module_calls.get(stateless)
        if (
            compiled is not None
            and not compiled.scratch_measured
            and not foreign_profiler_running()
        ):
            compiled = None  # NOTE [ Captured under a profiler ]
        own_plan_due = compiled is not None and self._own_plan_due(compiled)
        if own_plan_due:
            compiled.planned_for = ()  # planned again below, by the DP
        if compiled is not None and compiled.planned_for == self._plan_options():
            self._current = compiled
            return compiled
        with heap_returned_after():  # NOTE [ Planning's freed heap ]
            if compiled is None:
                self._say_what_changed(key)
                try:
                    compiled = self._compile(args, kwargs, root, compiled_segments)
                except CaptureError as err:
                    self._uncaptured[key] = self._uncaptured[stateless] = err
                    raise
                self._compiled[key] = compiled
                if compiled.captured.granularity == MODULE:
                    self._module_calls[stateless] = compiled
                # NOTE [ What the capture fixed ]: a forward that set its own attributes while
                # it was traced (a cache's length) finds its capture under the state it left
                self._compiled.setdefault((tag, self._signature(args, kwargs)), compiled)
                if len(self._captures()) == MANY_SIGNATURES + 1:
                    self._warn_once(
                        "signatures",
                        f"HCModule has planned for {len(self._compiled)} different input "
                        "signatures: every new shape/dtype/requires_grad pattern is captured "
                        "again, and planned again unless the plan of another size fits it. "
                        "Pad or bucket inputs to a few shapes.",
                    )
            self._current = compiled  # `hc.captured` shows the capture, a BudgetError or not
            # its first plan, or NOTE [ Options changed after the first step ]
            measured = self._stop_probe() if compiled.plan is not None else None
            if measured is not None:  # the last step, run by the plan made for the old options
                measured[0].last_measured_peak_bytes = measured[1]
            first = compiled.plan is None
            carried = compiled.plan if own_plan_due else None
            try:
                self._plan_capture(compiled)  # a BudgetError keeps the capture for other options
            except BudgetError as err:
                if own_plan_due:  # the DP's cuts do not reach what the carried plan does
                    compiled.planned_for = self._plan_options()
                    return compiled
                if not first:  # a new budget for a signature planned before
                    raise
                raise self._budget_error_at_these_inputs(err, args, kwargs) from err
            if carried is not None and _recomputes_less(carried, compiled.plan):
                self._use_plan(compiled, carried)  # the DP's cuts held no better plan
        return compiled

    def _captures(self) -> list[Compiled]:
        """Each capture made once (a capture can be kept under two signatures: NOTE [ What
        the capture fixed ])."""
        return list({id(c): c for c in self._compiled.values()}.values())

    def _budget_error_at_these_inputs(self, err: BudgetError, args, kwargs) -> BudgetError:
        """`err`, naming this call's input shapes where other signatures were planned before
        (variable-length batches: a longer one can need more than the budget gives)."""
        others = len(self._captures()) - 1
        if others < 1:
            return err
        named = [*((f"args[{i}]", a) for i, a in enumerate(args)), *kwargs.items()]
        shapes = ", ".join(
            f"{name} {'x'.join(map(str, value.shape))}"
            for name, value in named
            if isinstance(value, torch.Tensor)
        )
        return err.with_detail(
            f"at this call's inputs ({shapes}), a new input signature after {others} planned before"
        )

    def _signature(self, args, kwargs) -> tuple:
        return signature(self.module, self.training, args, kwargs)

    def _say_what_changed(self, key: tuple) -> None:
        """Warn once per set of names where a new signature differs from a planned one in the
        modules' Python state alone (NOTE [ What the capture fixed ])."""
        found = [
            state_changes(known, key[1], self.module)
            for tag, known in self._compiled
            if tag == key[0]
        ]
        nearest = min((c for c in found if c), key=len, default=None)  # a planned step's
        if nearest is not None:
            changes = nearest
            names = ",".join(sorted(c.split(" ")[0] for c in changes))
            self._warn_once(
                f"state:{names}",
                f"HCModule: {'; '.join(changes[:4])} since a planned step: the forward is "
                "captured and planned again for it (a capture fixes the Python state its "
                "forward reads). An attribute the forward does not read is not followed "
                "under a name with a leading underscore.",
            )

    def _compile(
        self, args, kwargs, root: nn.Module | None = None, compiled_segments: bool = False
    ) -> Compiled:
        """Capture this call (`_plan_capture` plans it)."""
        root = self.module if root is None else root
        refuse_parallel_wrappers(self.module)  # sharded since? NOTE [ Data-parallel wrappers ]
        if is_fsdp2(self.module):
            self._warn_once("fsdp2-root", f"HCModule: {FSDP2_ROOT}.", BudgetWarning)
        lazy = [
            name
            for name, p in self.module.named_parameters()
            if isinstance(p, nn.parameter.UninitializedParameter)
        ]
        if lazy:
            raise ConfigError(
                "module",
                type(self.module).__name__,
                f"a module whose parameters are initialised ({', '.join(lazy[:3])} are lazy): "
                "call it once on a batch before wrapping it in HCModule",
            )
        cache = self.plan_cache
        store = None if cache is None else ScratchStore.of_plan_cache(cache.directory)
        captured = capture(root, args, kwargs, calibrate=True, scratch_store=store)
        scratch_measured = captured.scratch_measured
        graph = captured.graph
        if captured.granularity == MODULE and not captured.tracer:
            captured.tracer = "module"  # every op-level tracer failed
        elif self.keeps_outputs is False:
            graph.held_outputs = []  # the outputs backward starts from are held regardless
        elif self.keeps_outputs is None:  # NOTE [ Outputs the caller lets go ]
            graph.held_outputs = sorted(graph.backward_seeds(), key=graph.index)
        else:  # all of them, said (NOTE [ A loss's gradient lives through backward ])
            graph.held_outputs = list(graph.outputs)
        naive = simulate(graph).peak_bytes
        # compiled segments run without pins (NOTE [ Running pinned values ]) or explicit
        # schedules (NOTE [ Explicit schedules ]): `pins` stands for both
        pins = not (compiled_segments or self.compile is not False)
        compiled = Compiled(
            captured, None, None, naive, captured.capture_time_s, 0.0, root=root, pins=pins
        )
        compiled.device = step_device(root, args, kwargs)
        compiled.scratch_measured = scratch_measured
        if captured.granularity != MODULE:
            compiled.structure = structure_key(graph)
        if not scratch_measured:
            warn_at_caller(
                "HCModule: planned under a running profiler, which the measurement of kernel "
                "workspace cannot nest in: this plan counts tensors only and may exceed the "
                "budget. hbp measures and plans again at the first call outside the profiler.",
                BudgetWarning,
            )
        return compiled

    def _plan_capture(self, compiled: Compiled) -> None:
        """Plan `compiled`'s capture for the current options (budget, block_size, planner)
        and make its executor; the closed loop starts again (NOTE [ Options changed after
        the first step ])."""
        start = time.perf_counter()
        captured, pins = compiled.captured, compiled.pins
        settled = self._settled_plan(compiled)  # NOTE [ Plans the measurements settled on ]
        cached = settled[0] if settled is not None else self._cached_plan(captured, pins)
        plan = cached if cached is not None else self._new_plan(compiled)
        if cached is None and plan.meta.get("solved_by") == CARRIED:
            compiled.carried_calls += 1  # this call's
        elif cached is None:  # a carried plan is not this size's own
            self._cache_plan(captured, pins, plan)
        self._use_plan(compiled, plan)
        compiled.budget_bytes = self._held_to(plan) if settled is None else settled[1]
        if settled is None:  # NOTE [ The loss outside the module, at a new size ]
            self._room_for_the_loss_outside(compiled)
        compiled.plan_time_s = time.perf_counter() - start
        self._warn_about(captured, compiled.executor)
        compiled.planned_for = self._plan_options()
        compiled.measured_peak_bytes = None
        compiled.measure_again()
        if self.verbose:
            print(plan_summary(compiled))

    def _new_plan(self, compiled: Compiled) -> Plan:
        """A plan of `compiled`'s capture for the budget: carried from another size where one
        fits (NOTE [ Plans carried across sizes ] in hbp.planner.carry), else planned."""
        from hbp.planner import plan as make_plan  # the planner is pure: import on use

        budget = self._budget
        carried = self._carried_plan(compiled)
        if carried is not None:
            return carried
        captured, naive = compiled.captured, compiled.naive_peak_bytes
        if captured.granularity == MODULE:
            target = self._target(captured, naive, compiled.device)
            try:
                return self._module_level_plan(captured, naive, target)
            except BudgetError as err:
                way_out = budget.way_out(err.minimum, naive)
                raise (err.with_detail(way_out) if way_out else err) from err
        graph = captured.graph
        try:
            relative = budget.kind is BudgetKind.ACTIVATIONS  # resolved by `plan`
            return make_plan(
                graph,
                budget if relative else self._target(captured, naive, compiled.device),
                block_size=self.block_size,
                planner=self.planner,
                pins=compiled.pins,
            )
        except BudgetError as err:
            if budget.kind is BudgetKind.BYTES and type(budget.given) is int and budget.value == 1:
                raise BudgetError(
                    err.budget,
                    err.minimum,
                    "budget=1 is an int, i.e. 1 byte; the whole naive step peak is budget=1.0",
                ) from err
            said = self._budget_error_without_outputs(graph, err)
            way_out = budget.way_out(said.minimum, naive)
            if way_out is not None:
                said = said.with_detail(way_out)
            raise said from err

    # NOTE [ Options changed after the first step ]
    # `hc.budget = 0.3` (or a new block_size or planner) between steps plans every signature
    # seen so far again at its next call, from the capture already made: capture and scratch
    # calibration depend on the module and the inputs, not on these options, and they are
    # most of a first step's cost. The new plan starts its own closed loop (measured from its
    # first step, as a first plan is); a step of the old plan still being measured counts
    # for `measured_peak_bytes` only. What is learned of the caller stays: the outputs it
    # keeps (NOTE [ Outputs the caller lets go ]) are a fact of its loop, not of a plan.

    def _held_to(self, plan: Plan) -> int:
        """The bytes a measured step of `plan` is held to: its budget, or a byte budget as
        given where the plan's was lowered to the plain step's simulated peak (NOTE [ A byte
        budget above the plain step ])."""
        if self._budget.kind is BudgetKind.BYTES:
            return max(plan.budget_bytes, int(self._budget.value))
        return plan.budget_bytes

    # NOTE [ A byte budget above the plain step ]
    # The planner plans below the plain step's simulated peak, so a byte budget above it is
    # planned as that peak (nothing recomputed). The measured step, which holds what the plan
    # does not see (an mse_loss outside the module), was then held to the simulated peak: 64
    # MiB given, a plain step of 9.50 MiB measured against "the budget of 9.00 MiB", warned
    # about and planned again to recompute, where nothing needed to be. The step is held to
    # the bytes given, and `budget_bytes` says them.

    def _own_plan_due(self, compiled: Compiled) -> bool:
        """Whether this call of a signature run by a carried plan is the one from which it
        runs its own (NOTE [ A carried plan until its signature is frequent ])."""
        if compiled.plan is None or compiled.plan.meta.get("solved_by") != CARRIED:
            return False
        due = compiled.carried_calls == OWN_PLAN_AFTER  # once: then the count is past it
        compiled.carried_calls += 1
        return due

    # NOTE [ A carried plan until its signature is frequent ]
    # A carried plan may recompute more than the signature's own (a few percent of the step's
    # FLOPs on the models tried, docs/results.md), on every step it runs; its own plan costs
    # the planner's seconds once. Dynamic padding meets most lengths a few times, where
    # carrying saves the most; a job that buckets its lengths meets each thousands of times,
    # where the recompute would add up. So the call of a signature after OWN_PLAN_AFTER calls
    # run by carried plans plans it as a first call would without carrying, from the capture
    # made; its first step is measured, as any new plan's is. Where the DP finds no plan (a
    # byte budget that only the carried plan's cuts reach), or only one that recomputes more
    # (the other size's candidate cuts held a better plan than this size's own: a GPTNeoX's
    # 4.54% of the step against the DP's 5.38%), the carried plan stays.

    def _carried_plan(self, compiled: Compiled, budget: Budget | None = None) -> Plan | None:
        """A plan of another input signature of the same structure that fits this one's
        budget (`budget`: instead of HCModule's; NOTE [ Plans carried across sizes ] in
        hbp.planner.carry), or None: carrying is off, the capture is module-level, no
        signature of its structure was planned by the DP for these options, or none of their
        plans fits."""
        budget = self._budget if budget is None else budget
        if (
            not self.carry_plans
            or compiled.structure is None
            or self.planner == "uniform"
            or compiled.carried_calls >= OWN_PLAN_AFTER
            or budget.kind in (BudgetKind.MIN, BudgetKind.FIT)  # never carried
        ):
            return None
        options = self._plan_options()
        donors = [
            c
            for c in self._captures()
            if c is not compiled
            and c.plan is not None
            and c.structure == compiled.structure
            and c.pins == compiled.pins
            and c.planned_for == options
            and c.plan.meta.get("solved_by") != CARRIED
        ]
        if not donors:
            return None
        if budget.kind is BudgetKind.ACTIVATIONS:
            for donor in donors:  # each one's least-peak plan, made once
                if donor.least is None:
                    self._find_least(donor)
        return carried_plan(
            compiled.captured.graph,
            budget,
            [Donor(c.captured.graph, c.plan, c.least, c.least_over_floor) for c in donors],
            block_size=self.block_size,
            nested=self.planner != "one_level",
        )

    def _find_least(self, compiled: Compiled) -> None:
        """`compiled.least`: the top-level segments of its capture's least-peak plan, and
        `least_over_floor`: its least peak over the floor under it (NOTE [ What a carried plan
        must meet ] in hbp.planner.carry); the least peak "N%act" is resolved against where
        planned (NOTE [ Relative budgets resolved where they are planned ] in hbp.planner)."""
        from hbp.planner import min_feasible_peak

        graph, nested = compiled.captured.graph, self.planner != "one_level"
        least, compiled.least = min_feasible_peak(graph, block_size=self.block_size, nested=nested)
        compiled.least_over_floor = donor_floor_gap(graph, least, self.block_size, nested)

    def _plan_options(self) -> tuple:
        """What a plan is made for, besides its capture: changed, the capture is planned
        again at the next call (NOTE [ Options changed after the first step ])."""
        budget = self._budget  # by what it means: "8MiB" and 8388608 are one budget
        return (budget.kind, budget.value, self.block_size, self.planner)

    def _budget_error_without_outputs(self, graph, err: BudgetError) -> BudgetError:
        """`err`, saying so when the budget fits once the caller lets go of the outputs
        backward starts from once backward has started (NOTE [ Outputs the caller lets go ])."""
        from hbp.planner import plan as make_plan

        if self.keeps_outputs is not None or graph.held_outputs == []:
            return err
        if err.budget < err.minimum - _held_output_bytes(graph):
            return err  # NOTE [ Letting go of the outputs cannot reach the budget ]
        held, graph.held_outputs = graph.held_outputs, []
        try:
            make_plan(graph, err.budget, block_size=self.block_size, planner=self.planner)
        except BudgetError:
            return err
        finally:
            graph.held_outputs = held
        return BudgetError(
            err.budget,
            err.minimum,
            "counting the outputs backward starts from as kept until backward ends (they stand "
            "for the memory of a loss computed outside the module, which the plan does not see); "
            "it fits with keeps_outputs=False, which counts none of that memory (the backward of "
            "mse_loss or cross_entropy holds temporaries about the outputs' size, which a step "
            "then measures above the budget); a loss passed as loss_fn= is planned with its own "
            "memory",
        )

    # NOTE [ Plans kept on disk ]
    # With `plan_cache`, the plan of a capture is kept under the captured graph's fingerprint,
    # the budget as the caller gave it (not the bytes it resolves to: resolving "50%act" takes
    # the least peak, the costly half of planning) and the planner options; "fit" depends on
    # the memory free at the time and is never read back. A plan read from the cache is the
    # one the same capture would get (`hbp.planner.cache`, NOTE [ What the fingerprint reads ]).

    def _plan_cache_key(self, pins: bool) -> tuple[str, dict] | None:
        if self.plan_cache is None or self._budget.kind is BudgetKind.FIT:
            return None
        options = {
            "block_size": self.block_size,
            "planner": self.planner,
            "pins": pins,
            "keeps_outputs": self.keeps_outputs,
        }
        return f"HCModule:{self._budget.given!r}", options

    def _cached_plan(self, captured: CapturedGraph, pins: bool) -> Plan | None:
        key = self._plan_cache_key(pins)
        if key is None:
            return None
        plan = self.plan_cache.get(captured.graph, key[0], key[1])
        if plan is not None:
            plan.meta["from_cache"] = True
        return plan

    def _cache_plan(self, captured: CapturedGraph, pins: bool, plan: Plan) -> None:
        key = self._plan_cache_key(pins)
        if key is not None:
            self.plan_cache.put(captured.graph, key[0], plan, key[1])

    # NOTE [ Plans the measurements settled on ]
    # A plan made again after the first step, from what the steps measured (the closed loop's
    # memory outside the plan, the outputs the caller keeps), is kept in `plan_cache` too,
    # with what it was made from (the outputs counted as held, the unseen bytes, the budget's
    # bytes), under the fingerprint of the graph as first planned: a restarted job reads it
    # before the first plan and starts from where the last one settled, instead of going
    # over the budget at its first step again and planning again. Its first step is still
    # measured: a caller whose loop changed gets the loop's correction again.

    def _settled_plan(self, compiled: Compiled) -> tuple[Plan, int] | None:
        """(plan, budget bytes) the measurements of an earlier run settled on for this
        capture, with the graph's held outputs and the unseen bytes put back, or None."""
        key = self._plan_cache_key(compiled.pins)
        graph = compiled.captured.graph
        compiled.cache_fingerprint = None if key is None else graph_fingerprint(graph)
        if key is None:
            return None
        found = self.plan_cache.get_settled(compiled.cache_fingerprint, graph, key[0], key[1])
        if found is None:
            return None
        plan, state = found
        try:
            positions = state["held_outputs"]
            held = None if positions is None else [graph.nodes[int(i)].name for i in positions]
            budget_bytes, unseen, naive = (
                int(state[k]) for k in ("budget_bytes", "unseen_bytes", "naive_peak_bytes")
            )
        except (KeyError, TypeError, ValueError, IndexError):
            return None
        graph.held_outputs = held
        compiled.unseen_bytes, compiled.naive_peak_bytes = unseen, naive
        plan.meta["from_cache"] = True
        return plan, budget_bytes

    def _keep_settled(self, compiled: Compiled, plan: Plan) -> None:
        """Keep `plan`, made again from measured steps, for a restarted job (NOTE [ Plans the
        measurements settled on ])."""
        key = self._plan_cache_key(compiled.pins)
        if key is None or compiled.cache_fingerprint is None:
            return
        graph = compiled.captured.graph
        index = {node.name: i for i, node in enumerate(graph.nodes)}
        held = graph.held_outputs
        state = {
            "held_outputs": None if held is None else [index[name] for name in held],
            "unseen_bytes": compiled.unseen_bytes,
            "budget_bytes": compiled.budget_bytes,
            "naive_peak_bytes": compiled.naive_peak_bytes,
        }
        self.plan_cache.put_settled(compiled.cache_fingerprint, key[0], key[1], plan, state)

    def _target(self, captured: CapturedGraph, naive: int, device=None) -> int | str:
        """The planner's target for this capture: "min", or bytes at most `naive` (a budget
        at or above the plain step's peak is met by the plain step, not an error: the same
        budget can be below the naive peak of another input signature)."""
        return self._budget.resolve(naive, lambda: self._least_peak(captured, naive), device)

    def _least_peak(self, captured: CapturedGraph, naive: int) -> int:
        """The least peak a plan of this capture reaches ("min")."""
        from hbp.planner import least_peak

        if captured.granularity == MODULE:
            return self._module_level_plan(captured, naive, "min").predicted_peak_bytes
        return least_peak(captured.graph, block_size=self.block_size, planner=self.planner)

    def _module_level_plan(self, captured: CapturedGraph, naive: int, target: int | str) -> Plan:
        """The executable module-level plan for `target` (NOTE [ Module-level plans ] in
        hbp/planner/module_level.py)."""
        return module_level_plan(
            captured,
            naive,
            None if target == "min" else int(target),
            executable=per_call_plan,
            block_size=self.block_size,
            planner=self.planner,
        )

    def _warn_about(self, captured: CapturedGraph, executor) -> None:
        if captured.inlined_checkpoints:
            self._warn_once(
                "checkpoint",
                f"{type(self.module).__name__} calls torch.utils.checkpoint "
                f"({captured.inlined_checkpoints}x); HCModule traces through those calls and its "
                "plan decides what is recomputed instead: a fraction or 'N%act' (the default) is "
                "relative to the step without that checkpointing, so the plan may keep more "
                "than the model's own checkpointing did; budget='min' keeps the least, or give "
                "bytes",
            )
        hooked = hooked_submodules(self.module)
        listed = f"{', '.join(hooked[:3])}{'...' if len(hooked) > 3 else ''}"
        if hooked and _recomputes_hooked(captured, executor.plan, hooked, self.module):
            self._warn_once(
                "hooks",
                f"forward hooks on {listed} run again when HCModule recomputes their modules "
                "during backward",
            )
        root = self.module
        if (
            not self.ROOT_HOOKS_RUN
            and captured.granularity != MODULE
            and (root._forward_hooks or root._forward_pre_hooks)
        ):
            self._warn_once(
                "root-hooks",
                f"forward hooks registered on the wrapped {type(root).__name__} itself do not "
                "run: HCModule executes its captured graph; register them on the HCModule",
            )
        placeholders = {n.name for n in captured.graph.nodes if n.is_input}
        for block in getattr(executor, "blocks", []):
            if any(block.inputs[i].name in placeholders for i in block.cloned):
                self._warn_once(
                    "input-mutation",
                    "the module mutates one of its inputs in place inside a recomputed segment; "
                    "HCModule works on a copy there, so the caller's tensor is left unchanged",
                )

    def _replan(self, compiled, target_bytes: int | str) -> None:
        from hbp.planner import plan as make_plan

        captured = compiled.captured
        carried = None
        if compiled.plan.meta.get("solved_by") == CARRIED and target_bytes != "min":
            # a new size's plan made again from its measured step: carried again, if one fits
            carried = self._carried_plan(compiled, Budget.parse(int(target_bytes)))
        if carried is not None:
            plan = carried
        elif captured.granularity == MODULE:
            plan = self._module_level_plan(captured, compiled.naive_peak_bytes, target_bytes)
        else:
            target = target_bytes if target_bytes == "min" else int(target_bytes)
            plan = make_plan(
                captured.graph,
                target,
                block_size=self.block_size,
                planner=self.planner,
                pins=compiled.pins,
            )
        self._use_plan(compiled, plan)
        if carried is None:  # a carried plan is not this size's own
            self._keep_settled(compiled, plan)

    def _use_plan(self, compiled, plan: Plan) -> None:
        """`plan` is what `compiled` runs from its next step: its executor made, the one with
        compiled segments (made on first use) dropped."""
        compiled.plan = plan
        compiled.executor = make_executor(compiled.captured, plan, compiled.root or self.module)
        compiled.segments_compiled = None

    def _warn_once(self, key: str, message: str, category: type[Warning] = UserWarning) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn_at_caller(message, category)


def _walked(module: nn.Module) -> tuple[bool, bool, bool]:
    """Whether any parameter of `module` requires grad, whether any is not an nn.Parameter
    (swapped for the call: NOTE [ Parameters swapped for one call ]), and whether any module
    has backward hooks (NOTE [ Module backward hooks ]): one walk at every call, over the
    module dicts directly (`modules()` builds a memo set as it goes, at twice the cost)."""
    differentiable = swapped = backward_hooks = False
    stack = [module]
    while stack:
        m = stack.pop()
        if m is None:  # a submodule slot set to None
            continue
        if m._backward_hooks or m._backward_pre_hooks:
            backward_hooks = True
        for p in m._parameters.values():
            if p is not None:
                if p.requires_grad:
                    differentiable = True
                if not isinstance(p, nn.Parameter):
                    swapped = True
        stack.extend(m._modules.values())
    return differentiable, swapped, backward_hooks


def _recomputes_hooked(captured: CapturedGraph, plan: Plan, hooked: list[str], module) -> bool:
    """Whether `plan` recomputes a call of a module with the user's forward hooks (`hooked`,
    paths in `module`): at op level, where such a call's node (NOTE [ A module with forward
    hooks is one node ] in hbp/graph/torch/trace.py) lies in a recomputed segment; at module
    level, where any segment is recomputed."""
    if captured.granularity == MODULE:
        return any(s.recompute for s in plan.segments)
    modules = {id(module.get_submodule(path)) for path in hooked}
    gm = captured.gm
    calls = [
        i
        for i, n in enumerate(captured.fx_nodes)
        if n.op == "call_module" and id(gm.get_submodule(n.target)) in modules
    ]

    def recomputed(segments, i: int) -> bool:
        return any(
            s.start <= i < s.stop and (s.recompute or recomputed(s.children, i)) for s in segments
        )

    return any(recomputed(plan.segments, i) for i in calls)


def _held_output_bytes(graph) -> int:
    """Bytes of the distinct storage of the outputs the caller is counted to hold."""
    info = GraphInfo.of(graph)
    index = {name: j for j, name in enumerate(info.names)}
    roots = {int(info.root[index[name]]) for name in graph.held_outputs or () if name in index}
    return int(sum(int(info.storage_bytes[r]) for r in roots))


# NOTE [ Letting go of the outputs cannot reach the budget ]
# A BudgetError at the default `keeps_outputs` plans again without the held outputs to say
# whether letting go of them would fit (a second plan of the whole graph). Holding a value
# longer adds at most its bytes at any moment, so a plan's peak without the held outputs is
# at least its peak with them less their bytes: a budget below the minimum less those bytes
# cannot fit without them either, and the error is raised without that second plan. (The
# candidate cuts of the two graphs can differ a little, as their frontiers do: the bound
# then holds for the plans both search, which is what the hint is about.)


def _recomputes_less(carried: Plan, own: Plan) -> bool:
    """Whether `carried` recomputes less than `own` within `own`'s budget."""
    return (
        carried.predicted_recompute_flops < own.predicted_recompute_flops
        and carried.predicted_peak_bytes <= own.budget_bytes
    )
