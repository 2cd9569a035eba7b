"""`hbp.HCModule`: a drop-in wrapper that makes a module's training step fit a memory budget.

    model = hbp.HCModule(model, budget=0.3)      # 30% of the naive step's peak
    loss = loss_fn(model(x), y); loss.backward()  # same outputs and gradients as before
    print(model.plan)                              # what is kept, what is recomputed

On the first call for an input signature (shapes, dtypes, devices, requires_grad, None-ness
and values of non-tensor arguments, train/eval flags, grad and autocast modes, the
parameters' identity, dtype, device and requires_grad) the module is captured
(`hbp.graph.torch_capture.capture`), the least-recompute plan that fits the budget is made
(`hbp.planner.plan`), and an executor is built (`hbp.runtime.executor`); all three are cached
per signature. Under `torch.no_grad()` / `torch.inference_mode()`, or when nothing requires
grad, the wrapped module just runs. In eval mode it also just runs (as HuggingFace's gradient
checkpointing does), unless `plan_in_eval=True`: set it to fine-tune in eval mode (frozen
BatchNorm statistics, no dropout) within the budget; a one-time warning says when an eval-mode
call with grad enabled runs without the budget.

Budget: float in (0, 1] = fraction of the step's naive peak, as simulated on the captured
graph (activations, saved tensors, activation and parameter gradients; not the parameters
themselves nor the inputs); int = bytes; str such as "64MiB" (a byte budget above the naive peak
is met by the naive step: nothing is recomputed); "min" = the least the planner can reach.
No plan fits -> `hbp.BudgetError` with `.minimum` (bytes).

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

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, ConfigError
from hbp.graph.torch_capture import MODULE, CapturedGraph, ambient_modes, capture
from hbp.planner import PLANNERS
from hbp.planner.budget import parse_budget
from hbp.planner.plan import Plan, Segment
from hbp.runtime.executor import make_executor, per_call_plan

#: Distinct input signatures after which HCModule warns that it keeps re-planning.
MANY_SIGNATURES = 8


@dataclass
class Compiled:
    """What HCModule caches per input signature."""

    captured: CapturedGraph
    plan: Plan
    executor: Any
    naive_peak_bytes: int
    capture_time_s: float
    plan_time_s: float
    segments_compiled: Any = None  # the executor with compiled segments, made on first use


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
        compile: run each segment of the plan through `torch.compile`: True, or a dict of
            `torch.compile` keyword arguments (`{"backend": "aot_eager"}`, `{"mode": ...}`).
            `torch.compile(hc)` does the same with the default options (NOTE [ torch.compile
            of an HCModule ]).

    Attributes:
        plan: the plan of the most recent training call (None before the first).
        captured: its captured graph (`CapturedGraph`, `.graph` is hbp's IR).
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
        compile: bool | dict = False,
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
        if not isinstance(compile, (bool, dict)):
            raise ConfigError("compile", compile, "True, False or a dict of torch.compile options")
        self.compile = compile
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
    def compiled(self) -> Compiled | None:
        """Capture, plan, executor and timings of the most recent training call."""
        return self._current

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # NOTE [ torch.compile of an HCModule ]
            return self._forward_with_compiled_segments(*args, **kwargs)
        if not self._plans_for(args, kwargs):
            return self.module(*args, **kwargs)
        compiled = self._prepare(args, kwargs)
        if self.compile is not False:
            return self._segments_compiled(compiled)(*args, **kwargs)
        return compiled.executor(*args, **kwargs)

    # NOTE [ torch.compile of an HCModule ]
    # Dynamo cannot trace the plan as one graph and keep its memory: the executor's nested
    # non-reentrant checkpoints need a context_fn that swaps BatchNorm statistics and buffers
    # during the recompute and switch autocast's cache off (Dynamo's checkpoint higher-order
    # op accepts neither), and inside one graph AOTAutograd's partitioner and Inductor's
    # scheduler, not the plan, would decide what is saved and when it is freed (nested
    # recomputation flattened to one level). So torch.compile(hc) stops at HCModule's forward
    # (a graph break, `torch.compiler.disable`), and the forward runs the plan with each
    # segment compiled on its own (`hbp.runtime.executor`, NOTE [ Compiled segments ]), as
    # HCModule(..., compile=True) does. Code around the call (a compiled function that calls
    # hc and computes the loss) is compiled as usual.

    @torch.compiler.disable(
        reason="HCModule runs its plan outside Dynamo and compiles each segment itself "
        "(torch.compile(hc) cannot use fullgraph=True; use HCModule(model, compile=True))"
    )
    def _forward_with_compiled_segments(self, *args, **kwargs):
        if not self._plans_for(args, kwargs):
            return self.module(*args, **kwargs)
        return self._segments_compiled(self._prepare(args, kwargs))(*args, **kwargs)

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
                    compiled.captured, compiled.plan, self.module, compile_options=options
                )
        return compiled.segments_compiled

    def prepare(self, *args, **kwargs) -> Plan:
        """Capture and plan for these inputs as a training step (grad enabled, current
        train/eval flags) without running the step; return the plan. Later calls with the
        same signature reuse it."""
        with torch.enable_grad():
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

    def _prepare(self, args, kwargs) -> Compiled:
        key = self._signature(args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(args, kwargs)
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

    def _compile(self, args, kwargs) -> Compiled:
        from hbp.planner import plan as make_plan  # the planner is pure: import on use

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
        captured = capture(self.module, args, kwargs)
        graph = captured.graph
        naive = simulate(graph).peak_bytes
        start = time.perf_counter()
        if captured.granularity == MODULE:
            plan = self._module_level_plan(captured, naive)
        else:
            try:
                plan = make_plan(
                    graph, self._budget_for(naive), block_size=self.block_size, planner=self.planner
                )
            except BudgetError as err:
                if self.budget == 1 and isinstance(self.budget, int):  # not 1.0 (nor True)
                    raise BudgetError(
                        err.budget,
                        err.minimum,
                        "budget=1 is an int, i.e. 1 byte; the whole naive step peak is budget=1.0",
                    ) from err
                raise
        plan_time_s = time.perf_counter() - start
        executor = make_executor(captured, plan, self.module)
        self._warn_about(captured, executor)
        compiled = Compiled(captured, plan, executor, naive, captured.capture_time_s, plan_time_s)
        if self.verbose:
            print(plan_summary(compiled))
        return compiled

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

    def _module_level_plan(self, captured: CapturedGraph, naive: int) -> Plan:
        """The plan at module level, chosen among those the module-level executor runs as
        planned (NOTE [ Module-level plans ])."""
        from hbp.planner import plan as make_plan  # the planner is pure: import on use

        graph = captured.graph
        info = GraphInfo.of(graph)
        n = len(graph)

        def executed(segments: list[Segment]) -> tuple[Plan, Any]:
            plan = per_call_plan(Plan(segments), captured)
            return plan, simulate(graph, plan, info=info)

        def calls(recomputed: list[int]) -> list[Segment]:
            """Call i checkpointed alone for each i in `recomputed`, the rest plain."""
            marks = set(recomputed)
            return [Segment(0, 1)] + [Segment(i, i + 1, i in marks) for i in range(1, n)]

        def planned(budget: int | str) -> tuple[Plan, Any] | None:
            """The planner's plan for `budget`, as executed; None if it has none."""
            try:
                return executed(
                    make_plan(
                        graph, budget, block_size=self.block_size, planner=self.planner
                    ).segments
                )
            except BudgetError:
                return None

        least = min(
            [executed(calls(list(range(1, n)))), *filter(None, [planned("min")])],
            key=lambda option: option[1].peak_bytes,
        )
        if self.budget == "min":
            chosen, budget_bytes = least, least[1].peak_bytes
        else:
            budget_bytes = parse_budget(self._budget_for(naive), naive)
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
                if option is None:
                    break
                if option[1].peak_bytes <= budget_bytes:
                    options.append(option)
                    break
                target -= option[1].peak_bytes - budget_bytes
            recomputed = list(range(1, n))  # every call alone, then plain while it fits
            for i in sorted(recomputed, key=lambda i: -info.flops[i]):
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
        hooked = [
            name
            for name, m in self.module.named_modules()
            if name and (m._forward_hooks or m._forward_pre_hooks)
        ]
        if hooked and any(s.recompute for s in executor.plan.segments):
            self._warn_once(
                "hooks",
                f"forward hooks on {', '.join(hooked[:3])}{'...' if len(hooked) > 3 else ''} "
                "run again when HCModule recomputes their modules during backward",
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

    def _warn_once(self, key: str, message: str, stacklevel: int = 4) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=stacklevel)


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
