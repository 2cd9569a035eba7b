"""`hbp.HCModule`: a drop-in wrapper that makes a module's training step fit a memory budget.

    model = hbp.HCModule(model, budget=0.3)      # 30% of the naive step's peak
    loss = loss_fn(model(x), y); loss.backward()  # same outputs and gradients as before
    print(model.plan)                              # what is kept, what is recomputed

On the first call for an input signature (shapes, dtypes, devices, requires_grad, None-ness
and values of non-tensor arguments, train/eval flags, grad and autocast modes, the
parameters' identity, dtype, device and requires_grad) the module is captured
(`hbp.graph.torch.capture.capture`), the least-recompute plan that fits the budget is made
(`hbp.planner.plan`), and an executor is built (`hbp.runtime.executors.segments`); all three are cached
per signature. Under `torch.no_grad()` / `torch.inference_mode()`, or when nothing requires
grad, the wrapped module just runs. In eval mode it also just runs (as HuggingFace's gradient
checkpointing does), unless `plan_in_eval=True`: set it to fine-tune in eval mode (frozen
BatchNorm statistics, no dropout) within the budget; a one-time warning says when an eval-mode
call with grad enabled runs without the budget.

Budget: float in (0, 1] = fraction of the step's naive peak, as simulated on the captured
graph (activations, saved tensors, activation and parameter gradients; not the parameters
themselves nor the inputs); int = bytes; str such as "64MiB" (a byte budget above the naive peak
is met by the naive step: nothing is recomputed); "min" = the least the planner can reach.
No plan fits -> `hbp.BudgetError` with `.minimum` (bytes). Kernel workspace counts: each op
signature's is measured by the allocator at capture (`hbp.graph.torch.calibrate`).

The step around the module (NOTE [ The step around the module ]): with `loss_fn`, `hc(x,
targets=y)` returns `loss_fn(module(x), y)` and the plan covers the whole step; without it,
the first step of a signature is measured by the allocator (CUDA always; CPU with
`calibrate=True`, and by default with `compile=`) and planned again, with a warning, if the
caller's loss took it above the budget (`hc.measured_peak_bytes`).

Like `torch.utils.checkpoint`, recomputation re-runs forward code during backward: forward
hooks of submodules fire again, Python side effects in forward happen again, and the RNG state
is replayed (dropout masks are those of the original forward). Global state read in forward
must not change between forward and backward.

What the forward does is kept: `with torch.no_grad():` / `with torch.autocast(...):` blocks
inside it (the capture records each op's modes); outputs come back in the module's own
containers (tuples, namedtuples, lists, dicts and dict subclasses such as HuggingFace's
ModelOutput, dataclasses; non-tensor fields as returned at capture). `torch.utils.checkpoint`
calls inside the module are traced through: the plan decides what is recomputed (a warning
says so), and a fractional budget is a fraction of the peak *without* that checkpointing.
`state_dict()` keys carry the "module." prefix (load `hc.module.state_dict()` into an
unwrapped model); `load_state_dict` also accepts the unwrapped module's keys.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hbp.allocator import foreign_profiler_running, profiler_peak_bytes, release_results
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph.torch.capture import MODULE, CapturedGraph, ambient_modes, capture
from hbp.planner import PLANNERS
from hbp.planner.budget import parse_budget
from hbp.planner.plan import MIB, Plan, Segment, any_pinned
from hbp.runtime.executors import make_executor
from hbp.runtime.executors.module_calls import per_call_plan
from hbp.runtime.heap import return_freed_heap

#: Distinct input signatures after which HCModule warns that it keeps re-planning.
MANY_SIGNATURES = 8


@dataclass
class Compiled:
    """What HCModule caches per input signature.

    `budget_bytes`: the budget this signature must meet (the plan's own `budget_bytes` is
    lowered when the closed loop plans again); `measured_peak_bytes`: the allocator's peak of
    the last measured step (None before); `measurements`: steps measured so far; `settled`:
    a measured step met the budget (or the loop gave up), so later steps are not measured."""

    captured: CapturedGraph
    plan: Plan
    executor: Any
    naive_peak_bytes: int
    capture_time_s: float
    plan_time_s: float
    root: nn.Module | None = None
    budget_bytes: int = 0
    measured_peak_bytes: int | None = None
    measurements: int = 0
    settled: bool = False
    segments_compiled: Any = None  # the executor with compiled segments, made on first use
    outputs_watched: bool = False  # a step showed which outputs the caller keeps
    outputs_seen: set[str] | None = None  # outputs alive when the last backward ended
    scratch_measured: bool = True  # False: captured under a running profiler (no workspace)
    pins: bool = True  # plans may pin values (False: its segments run compiled)


class HCModule(nn.Module):
    """Wraps `module` so its training step stays within `budget` with the least recompute.

    Args:
        module: any nn.Module; it becomes the submodule `.module` (so `.parameters()`,
            `.state_dict()` (keys prefixed "module."), `.train()`, `.to()` pass through).
        budget: float in (0, 1] (fraction of the naive step peak), int bytes, a size
            string ("64MiB"), or "min" (the least memory the planner can reach).
        block_size: granularity of the interval tree's leaves, in graph nodes (planner).
        planner: planner name, see `hbp.planner.plan` ("optimal", ...).
        verbose: print the plan summary whenever a new signature is planned.
        plan_in_eval: also plan (and enforce the budget) in eval mode when grad is enabled
            (eval-mode fine-tuning); by default eval mode runs the plain module.
        loss_fn: the step's loss, `loss_fn(output, *targets)`. Then `hc(*inputs,
            targets=y)` (or a tuple of targets) returns the loss, and the plan covers the
            whole step: the loss, its backward and the gradients flowing back into the module
            (see NOTE [ The step around the module ]). `hc(*inputs)` still returns the output.
        calibrate: on CPU, measure the first training step of each signature with the
            allocator (profiler memory events: slower, once) and plan again if it is above
            the budget. None (default): only where `compile` is set, whose compiled kernels
            allocate otherwise than the plan's eager cost model (never on CPU inside
            torch.compile(hc): NOTE [ No CPU measurement inside torch.compile(hc) ]). On
            CUDA the first step is always measured (it costs nothing).
        compile: run each segment of the plan through `torch.compile`: True, or a dict of
            `torch.compile` keyword arguments (`{"backend": "aot_eager"}`, `{"mode": ...}`).
            `torch.compile(hc)` does the same with the default options (NOTE [ torch.compile
            of an HCModule ]).
        keeps_outputs: whether the caller keeps the module's outputs alive until backward
            ends. None (default): assume so for the first step, see which outputs the caller
            let go when its backward ends, and plan again for the next steps without them
            (NOTE [ Outputs the caller lets go ]). True: always assume so. False: the caller
            keeps none of them once backward has started (`loss_fn(hc(x), y).backward()`),
            and keeps no output backward does not start from at all (a HuggingFace output's
            logits in `model(**batch).loss.backward()`, transformers' Trainer); a caller that
            keeps them needs that much more.

    Attributes:
        plan: the plan of the most recent training call (None before the first).
        captured: its captured graph (`CapturedGraph`, `.graph` is hbp's IR).
        measured_peak_bytes: the allocator's peak of the last measured step (above the level
            before it, the caller's loss and backward included), or None.
    """

    def __init__(
        self,
        module: nn.Module,
        budget: float | int | str = 0.3,
        *,
        block_size: int = 1,
        planner: str = "optimal",
        verbose: bool = False,
        plan_in_eval: bool = False,
        loss_fn=None,
        calibrate: bool | None = None,
        compile: bool | dict = False,
        keeps_outputs: bool | None = None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"HCModule wraps an nn.Module, got {type(module).__name__}")
        if budget != "min":  # "min": the least memory the planner can reach
            parse_budget(budget, 2**62)  # reject malformed budgets now, not at the first step
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError("block_size", block_size, "an int >= 1")
        if planner not in PLANNERS:
            raise ConfigError("planner", planner, " or ".join(repr(p) for p in PLANNERS))
        self.module = module
        self.budget = budget
        self.block_size = block_size
        self.planner = planner
        self.verbose = verbose
        self.plan_in_eval = bool(plan_in_eval)
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError("loss_fn", loss_fn, "a callable loss_fn(output, *targets) or None")
        self.loss_fn = loss_fn
        if calibrate not in (None, True, False):
            raise ConfigError("calibrate", calibrate, "None, True or False")
        self.calibrate = calibrate
        self._measured_peak_bytes: int | None = None
        self._probe: tuple[_StepPeakProbe, Compiled] | None = None
        if not isinstance(compile, (bool, dict)):
            raise ConfigError("compile", compile, "True, False or a dict of torch.compile options")
        self.compile = compile
        if keeps_outputs not in (None, True, False):
            raise ConfigError("keeps_outputs", keeps_outputs, "None, True or False")
        self.keeps_outputs = keeps_outputs
        self._compiled: dict[tuple, Compiled] = {}
        self._current: Compiled | None = None
        self._warned: set[str] = set()
        self.register_load_state_dict_pre_hook(_accept_unwrapped_keys)

    # -- public -----------------------------------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        return self._current.plan if self._current else None

    @property
    def captured(self) -> CapturedGraph | None:
        return self._current.captured if self._current else None

    @property
    def measured_peak_bytes(self) -> int | None:
        """The allocator's peak of the last measured step, in bytes (None before one)."""
        self._finish_probe()
        return self._measured_peak_bytes

    @property
    def compiled(self) -> Compiled | None:
        """Capture, plan, executor and timings of the most recent training call."""
        return self._current

    def forward(self, *args, **kwargs):
        # NOTE [ torch.compile of an HCModule ]
        if torch.compiler.is_compiling() or _dynamo_callback_set():
            return self._forward_with_compiled_segments(*args, **kwargs)
        return self._step(args, kwargs, compiled_segments=False)

    def _step(self, args, kwargs, compiled_segments: bool):
        """The call as a training step: captured, planned (once per signature) and run by the
        executor (`compiled_segments`: a torch.compile(hc) call, its segments compiled)."""
        if self.loss_fn is not None and "targets" in kwargs:
            return self._forward_with_loss(args, kwargs, compiled_segments)
        if not self._plans_for(args, kwargs):
            return self.module(*args, **kwargs)
        compiled = self._prepare(args, kwargs, compiled_segments=compiled_segments)
        return self._run(compiled, args, kwargs, compiled_segments)

    # NOTE [ torch.compile of an HCModule ]
    # Dynamo cannot trace the plan as one graph and keep its memory: the executor's nested
    # non-reentrant checkpoints need a context_fn that swaps BatchNorm statistics and buffers
    # during the recompute and switch autocast's cache off (Dynamo's checkpoint higher-order
    # op accepts neither), and inside one graph AOTAutograd's partitioner and Inductor's
    # scheduler, not the plan, would decide what is saved and when it is freed (nested
    # recomputation flattened to one level). So torch.compile(hc) stops at HCModule's forward
    # (a graph break, `torch.compiler.disable`), and the forward runs the plan with each
    # segment compiled on its own (`hbp.runtime.executors.segments`, NOTE [ Compiled segments ]), as
    # HCModule(..., compile=True) does. Code around the call (a compiled function that calls
    # hc and computes the loss) is compiled as usual.
    # Dynamo does not always trace forward: a frame entered under a dispatch mode (a FLOP
    # counter, a memory tracker, the profiler) is skipped, and Dynamo then skips that code
    # object for good, in every HCModule of the process. Such a forward runs as plain Python
    # (`is_compiling()` is False) while Dynamo's frame callback stays set for the frames it
    # calls, which would have Dynamo trace hbp's capture and planner one frame at a time
    # (slow, and failing on numpy's stride tricks). So forward also takes the compiled path
    # when that callback is set (`_dynamo_callback_set`): the plan runs outside Dynamo with
    # its segments compiled, as if forward had been traced.

    @torch.compiler.disable(
        reason="HCModule runs its plan outside Dynamo and compiles each segment itself "
        "(torch.compile(hc) cannot use fullgraph=True; use HCModule(model, compile=True))"
    )
    def _forward_with_compiled_segments(self, *args, **kwargs):
        return self._step(args, kwargs, compiled_segments=True)

    def _executor(self, compiled: Compiled, compiled_segments: bool = False):
        """The executor a call runs: with compiled segments if `compile` is set or the call
        is a torch.compile(hc) one (`compiled_segments`)."""
        if self.compile is False and not compiled_segments:
            return compiled.executor
        return self._segments_compiled(compiled)

    def _segments_compiled(self, compiled: Compiled):
        """The executor of `compiled` with every segment run through torch.compile."""
        if compiled.segments_compiled is None:
            options = self.compile if isinstance(self.compile, dict) else {}
            if compiled.captured.granularity == MODULE:
                self._warn_once(
                    "compile-module-level",
                    "HCModule compiles the segments of op-level captures only; this module "
                    f"fell back to module level ({compiled.captured.fallback_reason}) and runs "
                    "eagerly",
                )
                compiled.segments_compiled = compiled.executor
            else:
                compiled.segments_compiled = make_executor(
                    compiled.captured,
                    compiled.plan,
                    compiled.root or self.module,
                    compile_options=options,
                )
        return compiled.segments_compiled

    def prepare(self, *args, **kwargs) -> Plan:
        """Capture and plan for these inputs as a training step (grad enabled, current
        train/eval flags) without running the step; return the plan. Later calls with the
        same signature reuse it. With `loss_fn`, pass `targets=` to plan the whole step."""
        with torch.enable_grad():
            if self.loss_fn is not None and "targets" in kwargs:
                args, kwargs, root, tag = self._with_loss(args, kwargs)
                return self._prepare(args, kwargs, root, tag).plan
            return self._prepare(args, kwargs).plan

    def summary(self) -> str:
        """The current plan in words (segments, kept bytes, predicted peak and recompute)."""
        if self._current is None:
            return "HCModule: not planned yet (call it, or .prepare(*inputs), in training mode)"
        return plan_summary(self._current)

    def extra_repr(self) -> str:
        extra = ", plan_in_eval=True" if self.plan_in_eval else ""
        extra += f", compile={self.compile!r}" if self.compile is not False else ""
        return (
            f"budget={self.budget!r}, block_size={self.block_size}, planner={self.planner!r}"
            + extra
        )

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_compiled"], state["_current"] = {}, None  # rebuilt on the next call
        state["_probe"] = None  # a measurement in flight (a profiler) stays with the original
        return state

    # -- planning ---------------------------------------------------------------------------

    def _plans_for(self, args, kwargs) -> bool:
        if not torch.is_grad_enabled():
            return False
        differentiable = any(p.requires_grad for p in self.module.parameters())
        if not differentiable:
            leaves, _ = tree_flatten((args, kwargs))
            differentiable = any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
        if differentiable and not (self.training or self.plan_in_eval):
            self._warn_once(
                "eval",
                "HCModule in eval mode with grad enabled runs the plain module: the budget is "
                "not enforced. Use torch.no_grad() to evaluate, or HCModule(..., "
                "plan_in_eval=True) to train in eval mode within the budget.",
                stacklevel=6,  # the caller of hc(...), past nn.Module's call wrappers
            )
            return False
        return differentiable

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
        compiled = self._compiled.get(key)
        if (
            compiled is not None
            and not compiled.scratch_measured
            and not foreign_profiler_running()
        ):
            compiled = None  # NOTE [ Captured under a profiler ]
        if compiled is None:
            compiled = self._compile(args, kwargs, root, compiled_segments)
            self._compiled[key] = compiled
            if len(self._compiled) == MANY_SIGNATURES + 1:
                self._warn_once(
                    "signatures",
                    f"HCModule has planned for {len(self._compiled)} different input signatures: "
                    "every new shape/dtype/requires_grad pattern is captured and planned again. "
                    "Pad or bucket inputs to a few shapes.",
                )
        self._current = compiled
        return compiled

    def _signature(self, args, kwargs) -> tuple:
        leaves, spec = tree_flatten((args, dict(sorted(kwargs.items()))))
        parts: list[Any] = [str(spec), self.training, ambient_modes()]  # grad and autocast
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append(
                    (tuple(x.shape), x.dtype, x.device, x.requires_grad, x.is_contiguous())
                )
            elif x is None or isinstance(x, (bool, int, float, str)):
                parts.append((type(x).__name__, x))
            else:
                parts.append((type(x).__name__, id(x)))
        # .to()/.half() keep the Parameter objects and change their dtype/device.
        parts.append(
            tuple((id(p), p.requires_grad, p.dtype, p.device) for p in self.module.parameters())
        )
        parts.append(tuple((id(b), b.dtype, b.device) for b in self.module.buffers()))
        parts.append(tuple(m.training for m in self.module.modules()))
        return tuple(parts)

    def _compile(
        self, args, kwargs, root: nn.Module | None = None, compiled_segments: bool = False
    ) -> Compiled:
        from hbp.planner import plan as make_plan  # the planner is pure: import on use

        root = self.module if root is None else root
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
        captured = capture(root, args, kwargs)
        scratch_measured = _calibrate_scratch(captured, root, args, kwargs)
        graph = captured.graph
        if self.keeps_outputs is False and captured.granularity != MODULE:
            graph.held_outputs = []  # the outputs backward starts from are held regardless
        naive = simulate(graph).peak_bytes
        start = time.perf_counter()
        # compiled segments run without pins (NOTE [ Running pinned values ]) or explicit
        # schedules (NOTE [ Explicit schedules ]): `pins` stands for both
        pins = not (compiled_segments or self.compile is not False)
        if captured.granularity == MODULE:
            plan = self._module_level_plan(captured, naive)
        else:
            try:
                plan = make_plan(
                    graph,
                    self._budget_for(naive),
                    block_size=self.block_size,
                    planner=self.planner,
                    pins=pins,
                )
            except BudgetError as err:
                if self.budget == 1 and isinstance(self.budget, int):  # not 1.0 (nor True)
                    raise BudgetError(
                        err.budget,
                        err.minimum,
                        "budget=1 is an int, i.e. 1 byte; the whole naive step peak is budget=1.0",
                    ) from err
                raise self._budget_error_without_outputs(graph, err) from err
        plan_time_s = time.perf_counter() - start
        return_freed_heap()  # NOTE [ Planning's freed heap ]
        executor = make_executor(captured, plan, root)
        self._warn_about(captured, executor)
        compiled = Compiled(captured, plan, executor, naive, captured.capture_time_s, plan_time_s)
        compiled.root, compiled.budget_bytes = root, plan.budget_bytes
        compiled.scratch_measured, compiled.pins = scratch_measured, pins
        if not scratch_measured:
            warnings.warn(
                "HCModule: planned under a running profiler, which the measurement of kernel "
                "workspace cannot nest in: this plan counts tensors only and may exceed the "
                "budget. hbp measures and plans again at the first call outside the profiler.",
                UserWarning,
                stacklevel=6,
            )
        if self.verbose:
            print(plan_summary(compiled))
        return compiled

    def _budget_error_without_outputs(self, graph, err: BudgetError) -> BudgetError:
        """`err`, saying so when the budget fits once the caller lets go of the outputs
        backward does not start from (NOTE [ Outputs the caller lets go ])."""
        from hbp.planner import plan as make_plan

        if self.keeps_outputs is not None or graph.held_outputs is not None:
            return err
        graph.held_outputs = []
        try:
            make_plan(graph, err.budget, block_size=self.block_size, planner=self.planner)
        except BudgetError:
            return err
        finally:
            graph.held_outputs = None
        return BudgetError(
            err.budget,
            err.minimum,
            "counting the outputs as kept by the caller until backward ends; it fits if the "
            "caller lets go of them before backward (`model(**batch).loss.backward()`): "
            "pass keeps_outputs=False",
        )

    def _budget_for(self, naive_peak_bytes: int) -> float | int | str:
        """The budget to plan for. A byte budget ("64MiB", 2**26) above the naive step's
        peak is met without recomputing anything: the naive peak, not an error (the same
        budget can be below the naive peak of another input signature)."""
        if self.budget == "min":
            return self.budget
        try:
            parse_budget(self.budget, naive_peak_bytes)
        except ConfigError:
            if parse_budget(self.budget, 2**62) > naive_peak_bytes:  # bytes, not a fraction
                return naive_peak_bytes
            raise
        return self.budget

    def _module_level_plan(
        self, captured: CapturedGraph, naive: int, target_bytes: int | None = None
    ) -> Plan:
        """The plan at module level, chosen among those the module-level executor runs as
        planned (NOTE [ Module-level plans ]); for `target_bytes`, else for `self.budget`."""
        from hbp.planner import plan as make_plan  # the planner is pure: import on use

        graph = captured.graph
        info = GraphInfo.of(graph)
        n = len(graph)

        # A call that overwrites its input in place cannot start a checkpoint: the saved input
        # would be the overwritten one at recompute.
        overwrites = {graph.index(name) for name in captured.mutated_inputs}

        def executed(segments: list[Segment]) -> tuple[Plan, Any] | None:
            plan = per_call_plan(Plan(segments), captured)
            if any(s.recompute and s.start in overwrites for s in plan.segments):
                return None
            return plan, simulate(graph, plan, info=info)

        def calls(recomputed: list[int]) -> list[Segment]:
            """Call i checkpointed alone for each i in `recomputed`, the rest plain."""
            marks = set(recomputed)
            return [Segment(0, 1)] + [Segment(i, i + 1, i in marks) for i in range(1, n)]

        def planned(budget: int | str) -> tuple[Plan, Any] | None:
            """The planner's plan for `budget`, as executed; None if it has none."""
            try:
                segments = make_plan(
                    graph, budget, block_size=self.block_size, planner=self.planner
                ).segments
            except BudgetError:
                return None
            return executed(segments)

        alone = [i for i in range(1, n) if i not in overwrites]
        candidates = [executed(calls(alone)), planned("min")]
        lowest = candidates[-1][1].peak_bytes if candidates[-1] else naive
        step = (naive - lowest) / 8  # the planner's plans across the range, as executed
        candidates += [planned(int(lowest + k * step)) for k in range(1, 8)]
        least = min(filter(None, candidates), key=lambda option: option[1].peak_bytes)
        if target_bytes is None and self.budget == "min":
            chosen, budget_bytes = least, least[1].peak_bytes
        else:
            budget_bytes = target_bytes or parse_budget(self._budget_for(naive), naive)
            if least[1].peak_bytes > budget_bytes:
                raise BudgetError(
                    budget_bytes,
                    least[1].peak_bytes,
                    f"module-level fallback ({captured.fallback_reason}): what it can "
                    "checkpoint (whole child calls) peaks there at the least",
                )
            options = [least]
            target = budget_bytes
            for _ in range(6):  # the planner's plan, lowered while its execution is over
                option = planned(target)
                if option is None:  # no plan, or not executable
                    break
                if option[1].peak_bytes <= budget_bytes:
                    options.append(option)
                    break
                target -= option[1].peak_bytes - budget_bytes
            recomputed = alone  # every call alone, then plain while it fits
            for i in sorted(alone, key=lambda i: -info.flops[i]):
                trial = [j for j in recomputed if j != i]
                if executed(calls(trial))[1].peak_bytes <= budget_bytes:
                    recomputed = trial
            options.append(executed(calls(recomputed)))
            fitting = [o for o in options if o[1].peak_bytes <= budget_bytes]
            chosen = min(fitting, key=lambda option: option[1].recompute_flops)
        plan, sim = chosen
        plan.budget_bytes = budget_bytes
        plan.predicted_peak_bytes = sim.peak_bytes
        plan.predicted_recompute_flops = sim.recompute_flops
        plan.naive_peak_bytes = naive
        plan.naive_flops = graph.total_flops
        plan.meta.update(planner="module-level (executable plans)")
        return plan

    # NOTE [ Module-level plans ]
    # Where op-level capture fails, the graph is the chain of recorded child-module calls
    # (repeated blocks at any depth). The executor can only checkpoint whole calls, or runs of
    # an nn.Sequential's children: code between the calls cannot be re-run on its own, so
    # nested plans and segments spanning such code are not executable. The plan is therefore
    # chosen among the executable ones. The least memory the fallback reaches is the lesser of every call checkpointed alone and the planner's least
    # plan as executed (budget="min", and BudgetError.minimum below it, are that plan's
    # peak). For a budget: the planner's plan (planned again for a budget lowered by the
    # excess while its execution is over), and every call checkpointed alone then run plainly,
    # the most expensive first, while the simulated peak stays within the budget; the one of
    # these that fits with the least recompute runs.

    def _warn_about(self, captured: CapturedGraph, executor) -> None:
        if captured.inlined_checkpoints:
            self._warn_once(
                "checkpoint",
                f"{type(self.module).__name__} calls torch.utils.checkpoint "
                f"({captured.inlined_checkpoints}x); HCModule traces through those calls and its "
                "plan decides what is recomputed (a fractional budget is relative to the peak "
                "without that checkpointing)",
            )
        hooked = [name for name, m in self.module.named_modules() if name and _user_hooks(m)]
        listed = f"{', '.join(hooked[:3])}{'...' if len(hooked) > 3 else ''}"
        if hooked and captured.tracer == "export":
            self._warn_once(
                "hooks",
                f"forward hooks on {listed} were traced into the captured graph: what they "
                "compute is kept, their Python side effects (storing tensors, logging) do not "
                "happen again on later steps",
            )
        elif hooked and any(s.recompute for s in executor.plan.segments):
            self._warn_once(
                "hooks",
                f"forward hooks on {listed} run again when HCModule recomputes their modules "
                "during backward",
            )
        root = self.module
        if captured.granularity != MODULE and (root._forward_hooks or root._forward_pre_hooks):
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

    # -- the step around the module (NOTE [ The step around the module ]) -------------------

    def _with_loss(self, args, kwargs) -> tuple[tuple, dict, nn.Module, tuple]:
        """(args, kwargs, root, tag) of the whole step: the module and `loss_fn` as one
        module taking the inputs followed by the targets."""
        kwargs = dict(kwargs)
        targets = kwargs.pop("targets")
        targets = tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)
        root = _WithLoss(self.module, self.loss_fn, len(args))
        return (*args, *targets), kwargs, root, ("loss", len(args), id(self.loss_fn))

    def _forward_with_loss(self, args, kwargs, compiled_segments: bool = False):
        step_args, step_kwargs, root, tag = self._with_loss(args, kwargs)
        if not self._plans_for(args, step_kwargs):
            return root(*step_args, **step_kwargs)
        compiled = self._prepare(step_args, step_kwargs, root, tag, compiled_segments)
        return self._run(compiled, step_args, step_kwargs, compiled_segments)

    def _run(self, compiled: Compiled, args, kwargs, compiled_segments: bool = False):
        """Run the executor (`compiled_segments`: a torch.compile(hc) call); measure the step
        with the allocator while the closed loop is open (NOTE [ The step around the
        module ]); see which outputs the caller keeps (NOTE [ Outputs the caller lets go ])."""
        self._finish_probe()
        self._outputs_observed(compiled)
        if compiled_segments and compiled.pins:
            self._plan_without_pins(compiled)
        executor = self._executor(compiled, compiled_segments)
        output = self._run_measured(compiled, executor, args, kwargs, compiled_segments)
        self._watch_outputs(compiled, executor, output)
        return output

    def _plan_without_pins(self, compiled: Compiled) -> None:
        """A signature planned for the eager executor, now called through torch.compile(hc):
        compiled segments run without pins (NOTE [ Running pinned values ]), so a plan with
        pins is made again without them."""
        compiled.pins = False
        plan = compiled.plan
        if compiled.captured.granularity == MODULE or not (
            any_pinned(plan.segments) or plan.schedule
        ):
            return
        budget = "min" if self.budget == "min" else compiled.plan.budget_bytes
        try:
            self._replan(compiled, budget)
        except BudgetError as err:  # only pins reached it
            self._replan(compiled, "min")
            warnings.warn(
                f"HCModule: compiled segments run without pinned values, and without them no "
                f"plan fits {budget / MIB:.2f} MiB (the least is {err.minimum / MIB:.2f} MiB): "
                "planned for the least instead.",
                UserWarning,
                stacklevel=5,
            )
        compiled.settled, compiled.measurements = False, 0

    def _run_measured(self, compiled: Compiled, executor, args, kwargs, in_compiled_region):
        device = _step_device(compiled.root, args, kwargs)
        calibrate = self.calibrate
        if calibrate is None:  # measure where the segments run compiled
            calibrate = executor is not compiled.executor
        if device.type == "cpu" and in_compiled_region and calibrate:
            # NOTE [ No CPU measurement inside torch.compile(hc) ]
            self._warn_once(
                "compiled-region-cpu",
                "HCModule: a torch.compile(hc) step on CPU cannot be measured by the allocator "
                "(a profiler started inside the compiled caller's region corrupts its "
                "results), so the closed loop is off and compiled kernels' buffers may take "
                "the step above the budget; HCModule(model, budget, compile=True) compiles the "
                "same segments and keeps the loop.",
            )
            calibrate = False
        if compiled.settled or not (device.type == "cuda" or calibrate):
            return executor(*args, **kwargs)
        if device.type == "cpu" and foreign_profiler_running():
            return executor(*args, **kwargs)  # a profiler is running: cannot nest
        probe = _StepPeakProbe(device)
        try:
            output = executor(*args, **kwargs)
        except BaseException:
            probe.cancel()
            raise
        leaves = _grad_leaves(executor, output)
        if not leaves:
            probe.cancel()
            return output
        self._probe = (probe, compiled)
        queued = []

        def on_grad(grad):
            if not queued:  # the first output gradient: the rest of backward follows
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(probe.end)
            return grad

        for t in leaves:
            t.register_hook(on_grad)
        return output

    def _finish_probe(self) -> None:
        """Read a measured step whose backward has ended (see `_StepPeakProbe`); drop one
        whose backward never ran."""
        if self._probe is None:
            return
        (probe, compiled), self._probe = self._probe, None
        peak = probe.stop()
        if peak is not None:
            self._step_measured(compiled, peak)

    def _step_measured(self, compiled: Compiled, peak: int) -> None:
        """A measured step peaked at `peak` bytes; above the budget, plan again for the
        budget less what the plan did not see (at most `_MAX_REPLANS` times).

        What it did not see is the measured peak less the plan's predicted one, not the
        excess over the budget: a plan predicted below its budget, re-planned for the budget
        less the excess, may fit that target as it is and be chosen again (an MLP whose caller
        holds its output and an mse_loss: 1.042x its budget, then 1.042x again)."""
        compiled.measured_peak_bytes = self._measured_peak_bytes = peak
        compiled.measurements += 1
        excess = peak - compiled.budget_bytes
        if excess <= 0 or compiled.measurements > _MAX_REPLANS:
            compiled.settled = True
            return
        unseen = peak - compiled.plan.predicted_peak_bytes
        target = min(compiled.budget_bytes - unseen, compiled.plan.budget_bytes - excess)
        message = (
            f"HCModule: the measured step peaked at {peak / MIB:.2f} MiB (allocator), "
            f"{excess / MIB:.2f} MiB above the budget of {compiled.budget_bytes / MIB:.2f} MiB: "
            "memory outside the module (the caller's loss and its backward), kernel "
            "workspace or compiled kernels' buffers the plan did not see. "
        )
        try:
            self._replan(compiled, target)
        except BudgetError as err:
            compiled.settled = True
            warnings.warn(
                message + f"No plan fits {target / MIB:.2f} MiB (the least is "
                f"{err.minimum / MIB:.2f} MiB): the budget cannot be met this way; pass "
                "loss_fn= so that hbp plans the loss too, or raise the budget.",
                UserWarning,
                stacklevel=4,
            )
            return
        warnings.warn(
            message + f"Planned again for {target / MIB:.2f} MiB; the next steps keep the budget "
            "(hc.measured_peak_bytes holds the measured figure).",
            UserWarning,
            stacklevel=4,
        )

    # NOTE [ Outputs the caller lets go ]
    # The first step counts the module's outputs as alive until backward ends: the caller may keep
    # them (`out = model(x); loss_fn(out, y).backward()`). Often it does not. With
    # `model(**batch).loss.backward()` (transformers' Trainer too) the logits are gone before
    # backward starts; with `loss_fn(hc(x), y).backward()` the output goes once backward has passed
    # the loss. Counting them anyway costs their size in every segment's backward (README "Outputs
    # the caller lets go"). Which it is shows when backward ends: the module's own references are
    # gone by then, so an output still alive is the caller's. HCModule then plans again with
    # `Graph.held_outputs` = the outputs still alive, each other output counted until nothing in the
    # step needs it. Outputs backward starts from stay counted: the caller computed its loss from
    # them, and that loss's memory (which the plan does not see) is there while they are; letting
    # them go would hand their room to recompute savings and put the caller's loss over the budget
    # (tests/test_step_budget.py's tied LM). It keeps watching; an output the caller keeps again is
    # counted again from the next step, with a warning (that step may have been over the budget by
    # its size). keeps_outputs=True/False fixes the assumption instead (False: from the first step,
    # outputs backward starts from too, counted until backward has started: with loss_fn, or when
    # the caller's loss is small).

    def _watch_outputs(self, compiled: Compiled, executor, output) -> None:
        """After this step's backward (run by `executor`), note which outputs are still
        alive."""
        graph = compiled.captured.graph
        returned = getattr(executor, "returned", None)
        if self.keeps_outputs is not None or not returned:
            return
        if compiled.outputs_watched and graph.held_outputs is None:
            return  # the caller kept them all
        if set(graph.outputs) <= graph.backward_seeds():
            return  # nothing to let go
        leaves = _grad_leaves(executor, output)
        refs, queued = list(returned), []

        def backward_ended() -> None:
            compiled.outputs_seen = {name for name, ref in refs if ref() is not None}

        def on_grad(grad):
            if not queued:  # backward has started: look when it ends
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(backward_ended)
            return grad

        for t in leaves:
            t.register_hook(on_grad)

    def _outputs_observed(self, compiled: Compiled) -> None:
        """Plan again when the last step showed outputs the plan counts wrongly."""
        seen, compiled.outputs_seen = compiled.outputs_seen, None
        if seen is None:
            return
        compiled.outputs_watched = True
        graph = compiled.captured.graph
        held = set(graph.outputs) if graph.held_outputs is None else set(graph.held_outputs)
        kept = (seen | graph.backward_seeds()) & set(graph.outputs)
        if graph.held_outputs is None and kept >= set(graph.outputs):
            return  # the caller keeps them all: the plan is right
        if graph.held_outputs is not None and kept <= held:
            return
        again = graph.held_outputs is not None
        graph.held_outputs = [o for o in graph.outputs if o in kept]
        if again:
            warnings.warn(
                f"HCModule: the caller now keeps outputs it let go before "
                f"({', '.join(sorted(kept - held))}); the last step may have been above the "
                "budget by their size. Planned again with them; pass keeps_outputs=True to "
                "always count them.",
                UserWarning,
                stacklevel=5,
            )
        target = "min"
        if self.budget != "min":  # a budget above the new naive peak is that peak
            target = min(compiled.plan.budget_bytes, simulate(graph).peak_bytes)
        try:
            self._replan(compiled, target)
        except BudgetError:  # cannot happen when outputs are let go; keep the plan otherwise
            return
        if self.budget == "min":
            compiled.budget_bytes = compiled.plan.budget_bytes
        # the new plan spends what the outputs held on less recompute: memory the plan does
        # not see (the caller's loss) may now cross the budget, so the closed loop (on CUDA,
        # or with calibrate=True) measures the next step again
        compiled.settled, compiled.measurements = False, 0

    def _replan(self, compiled: Compiled, target_bytes: int | str) -> None:
        from hbp.planner import plan as make_plan

        captured = compiled.captured
        if captured.granularity == MODULE:
            plan = self._module_level_plan(captured, compiled.naive_peak_bytes, int(target_bytes))
        else:
            target = target_bytes if target_bytes == "min" else int(target_bytes)
            plan = make_plan(
                captured.graph,
                target,
                block_size=self.block_size,
                planner=self.planner,
                pins=compiled.pins,
            )
        compiled.plan = plan
        compiled.executor = make_executor(captured, plan, compiled.root or self.module)
        compiled.segments_compiled = None

    def _warn_once(self, key: str, message: str, stacklevel: int = 4) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=stacklevel)


#: Libraries whose own forward hooks are part of their models (transformers collects
#: hidden states and attentions with them): no warning is about them.
_LIBRARY_HOOKS = ("transformers.", "diffusers.", "timm.", "torchvision.")


def _dynamo_callback_set() -> bool:
    """Whether this frame runs under a torch.compile'd caller that Dynamo does not trace it for
    (NOTE [ torch.compile of an HCModule ]): Dynamo's frame callback is set."""
    get = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)
    return get is not None and get() not in (None, False)


def _grad_leaves(executor, output) -> list[torch.Tensor]:
    """The output tensors that require grad: the graph outputs the executor returned (in any
    container, dataclasses included), else the pytree leaves of `output`."""
    returned = getattr(executor, "returned", None)
    if returned:
        tensors = [t for t in (ref() for _, ref in returned) if t is not None]
    else:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return [t for t in tensors if t.requires_grad]


def _user_hooks(module: nn.Module) -> list:
    """The forward (pre-)hooks on `module` that its library did not install itself."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [h for h in hooks if not getattr(h, "__module__", "").startswith(_LIBRARY_HOOKS)]


#: Times the closed loop plans again for one signature before it stops measuring.
_MAX_REPLANS = 3

# NOTE [ The step around the module ]
# A budget is a promise on the whole training step: the module's forward, the caller's loss,
# the loss's backward and the module's backward. The loss runs while everything the module
# saved for backward is alive, and its backward allocates the gradient of the module's outputs
# (e.g. the logits' gradient) at that moment, so it adds to the peak the plan was made for.
# Two ways to keep the promise:
# - `loss_fn`: hbp captures the module and the loss as one graph (`_WithLoss`), so the plan
#   sees the loss and its gradients, and can even recompute around them.
# - The closed loop, when hbp cannot see the loss: the first training step of a signature is
#   measured by the allocator (CUDA: `max_memory_allocated`, always, at no cost; CPU: profiler
#   memory events, with `calibrate=True`), from the start of the forward to the end of the
#   backward (an autograd engine callback queued by a hook on the outputs). If that peak is
#   above the budget, the signature is planned again for the budget minus the excess, with a
#   warning, and the next step is measured again (at most `_MAX_REPLANS` times).
# - Compiled segments (`compile=`): the plan's cost model is eager autograd's, and Inductor's
#   kernels save and allocate otherwise (a compiled region frees its saved tensors when its
#   whole backward ends), so the closed loop is on by default there on CPU too
#   (`calibrate=None`; not inside torch.compile(hc), see the next note).
# NOTE [ No CPU measurement inside torch.compile(hc) ]
# Under torch.compile(hc) the step runs inside the compiled caller's frame, whose profiler
# range ("Torch-Compiled Region") opened before the measurement's profiler started. A CPU
# profiler session started there records results that crash the process when they are freed
# (a bad free in kineto's Result / MemoryTraceLogger destructors, seen after the closed loop
# planned such a step again). So on CPU the loop is off for torch.compile(hc) calls (a warning
# says so and points to `compile=True`, which compiles the same segments from outside any
# compiled region); CUDA's measurement needs no profiler and stays on.


class _WithLoss(nn.Module):
    """`loss_fn(module(*inputs, **kwargs), *targets)` as one module: the first `n_inputs`
    positional arguments are the module's, the rest the targets."""

    def __init__(self, module: nn.Module, loss_fn, n_inputs: int):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.n_inputs = n_inputs

    def forward(self, *args, **kwargs):
        output = self.module(*args[: self.n_inputs], **kwargs)
        return self.loss_fn(output, *args[self.n_inputs :])


class _StepPeakProbe:
    """The allocator's peak from `__init__` to `end()`, above the level at `__init__`.

    CUDA: max_memory_allocated, read in `end()`. CPU: a profiler with memory events
    (`hbp.allocator.profiler_peak_bytes`); `end()` runs inside the autograd engine (a
    queued callback), where a profiler cannot be stopped for good (the engine restores the
    thread's profiler state when backward returns), so it marks the end with a 1-byte
    allocation and `stop()`, called at the module's next call or when
    `HCModule.measured_peak_bytes` is read, stops the profiler and reads the window."""

    def __init__(self, device: torch.device):
        self.device = device
        self._profiler = None
        self._peak: int | None = None
        self._end_ptr: int | None = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base = torch.cuda.memory_allocated(device)
            return
        from hbp.allocator import close_open_windows, hold_open

        close_open_windows()  # another module's measurement still recording: CPU profilers
        self._profiler = torch.profiler.profile(  # do not nest
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self._profiler.start()
        hold_open(self)
        marker = torch.empty(1, dtype=torch.uint8)
        self._marker_ptr = marker.data_ptr()
        del marker

    def end(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._peak = int(torch.cuda.max_memory_allocated(self.device) - self._base)
        elif self._end_ptr is None:
            marker = torch.empty(1, dtype=torch.uint8)
            self._end_ptr = marker.data_ptr()
            del marker

    def stop(self) -> int | None:
        """The measured peak (None if the step's backward never ended); stops the profiler."""
        if self._profiler is None:
            return self._peak
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if self._end_ptr is not None:
            self._peak = profiler_peak_bytes(profiler, self._marker_ptr, self._end_ptr)
        release_results(profiler)
        return self._peak

    def cancel(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.stop()
            release_results(profiler)


def _step_device(root: nn.Module | None, args, kwargs) -> torch.device:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor):
            return t.device
    for p in root.parameters() if root is not None else ():
        return p.device
    return torch.device("cpu")


def _calibrate_scratch(captured: CapturedGraph, root: nn.Module, args, kwargs) -> bool:
    """Kernel workspace per op, measured by the allocator (`hbp.graph.torch.calibrate`);
    False when it could not be measured (a profiler is running)."""
    from hbp.graph.torch.calibrate import calibrate_scratch

    return calibrate_scratch(captured, args, kwargs) is not None


# NOTE [ Captured under a profiler ]
# Kernel workspace is measured at capture by the CPU allocator's profiler events, and CPU
# profiler sessions do not nest: a first step run inside `torch.profiler.profile(...)` (or
# any allocator measurement) plans without workspace, so its plan under-counts attention
# scores and convolution buffers. HCModule warns, and the first call of that signature outside
# a profiler captures and plans it again with the workspace measured. Steps still inside the
# profiler keep the first plan (there is nothing better to plan with there).


def _accept_unwrapped_keys(module, state_dict, prefix, *args) -> None:
    """`load_state_dict` pre-hook: a state dict of the unwrapped module (no key under
    `prefix` starts with "module.", e.g. a checkpoint saved before wrapping) is loaded into
    `.module`."""
    own = [k for k in state_dict if k.startswith(prefix)]
    if own and not any(k.startswith(prefix + "module.") for k in own):
        for k in own:
            state_dict[prefix + "module." + k[len(prefix) :]] = state_dict.pop(k)


def plan_summary(compiled: Compiled) -> str:
    """The capture in one line, then the plan (`str(Plan)`: predictions and segment tree)."""
    captured = compiled.captured
    head = (
        f"HCModule: {captured.granularity}-level capture, {len(captured.graph)} nodes, "
        f"captured in {compiled.capture_time_s:.2f} s, planned in {compiled.plan_time_s:.2f} s"
    )
    if captured.fallback_reason:
        head += f" (op-level capture failed: {captured.fallback_reason})"
    return f"{head}\n{compiled.plan}"
