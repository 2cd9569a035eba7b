"""`hbp.HCModule`: the wrapper form. `HCModule(model, budget=...)` makes the module's training
step fit a memory budget with the least recompute; `hbp.enable(model, ...)` does the same in
place (enable.py). What happens at a call: NOTE [ A call of HCModule ] below."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hbp.errors import BudgetWarning, CaptureError, CaptureWarning, ConfigError
from hbp.graph.torch.capture import CapturedGraph
from hbp.integrations.torch.closed_loop import ClosedLoop, StepPeakProbe
from hbp.integrations.torch.compile import CompiledSegments, dynamo_callback_set
from hbp.integrations.torch.guards import has_guards, run_or_plain
from hbp.integrations.torch.loss import training_kwargs, with_loss
from hbp.integrations.torch.outputs import WatchedOutputs
from hbp.integrations.torch.parallel import refuse_parallel_wrappers
from hbp.integrations.torch.planning import Compiled, Planning, plan_summary
from hbp.integrations.torch.wrapped_forward import ForwardLayers, warned_layers
from hbp.planner import PLANNERS
from hbp.planner.budget import Budget
from hbp.planner.cache import PlanCache, save_plan
from hbp.planner.plan import Plan

#: The budget of `HCModule(model)` and `hbp.enable(model)` when none is given.
DEFAULT_BUDGET = "50%act"

# NOTE [ A call of HCModule ]
# On the first training call for an input signature (shapes, dtypes, devices, requires_grad,
# None-ness and values of non-tensor arguments, train/eval flags, grad and autocast modes, the
# parameters' identity, dtype, device and requires_grad) the module is captured
# (`hbp.graph.torch.capture.capture`), the least-recompute plan that fits the budget is made
# (`hbp.planner.plan`), and an executor is built (`hbp.runtime.executors.segments`); all three are cached
# per signature (planning.py). Under `torch.no_grad()` / `torch.inference_mode()`, or when
# nothing requires grad, the wrapped module just runs; in eval mode too, unless
# `plan_in_eval=True`. Like `torch.utils.checkpoint`, recomputation re-runs forward code during
# backward: forward hooks of submodules fire again, and the RNG state is replayed (dropout
# masks are those of the original forward). What the forward does is kept: `torch.no_grad()` /
# `torch.autocast` blocks inside it; outputs come back in the module's own containers
# (ModelOutput, dataclasses, namedtuples...). `torch.utils.checkpoint` calls inside the module
# are traced through: the plan decides what is recomputed.


class _Forward:
    """`hc.forward`: HCModule's step, with the wrapped module's forward's signature and name
    (`inspect.signature(hc.forward)`: what transformers' Trainer reads to keep a batch's
    columns)."""

    def __get__(self, hc, owner=None):
        if hc is None:
            return owner._forward
        if torch.compiler.is_compiling():  # Dynamo traces the plain method
            return hc._forward
        step = functools.partial(owner._forward, hc)
        module = hc.__dict__.get("_modules", {}).get("module")
        if module is not None:
            wrapped = module.forward
            functools.update_wrapper(step, wrapped, assigned=("__doc__", "__name__"), updated=())
        return step


#: Where `hbp.enable` keeps its engine in an enabled model's `__dict__` (not a submodule).
ENGINE_ATTR = "_hbp_engine"

# NOTE [ One engine per step ]
# An engine captures its module's forward op by op and runs the plan in its place. A submodule
# enabled on its own runs an engine of its own inside that forward: the outer capture traced
# into the inner engine's (its fake tensors met the inner capture's), fell back to module
# level with internal warnings, and planned less. HCModule (and so `hbp.enable`) refuses a
# module with an enabled submodule or an HCModule inside, and says which and what to do.


class HCModule(Planning, ClosedLoop, WatchedOutputs, CompiledSegments, nn.Module):
    """Wraps `module` so its training step stays within `budget` with the least recompute.

    Args:
        module: any nn.Module; it becomes the submodule `.module` (so `.parameters()`,
            `.train()`, `.to()` pass through). The wrapper is transparent: `hc.forward` has
            the module's forward's signature, attributes HCModule does not define are the
            module's (`hc.config`, `hc.generate`, `hc.save_pretrained`), and `state_dict()`
            keys are the module's own (`load_state_dict` takes them with or without the
            "module." prefix).
        budget: any form of `hbp.Budget` (hbp/planner/budget.py's table): a float in
            (0, 1] (fraction of the naive step peak), "N%act" (of what checkpointing can
            save), bytes (int or "64MiB"), "min" or "fit".
        block_size: granularity of the interval tree's leaves, in graph nodes (planner).
        planner: planner name, see `hbp.planner.plan` ("optimal", ...).
        verbose: print the plan summary whenever a new signature is planned.
        plan_in_eval: also plan (and enforce the budget) in eval mode when grad is enabled
            (eval-mode fine-tuning); by default eval mode runs the plain module.
        loss_fn: the step's loss, `loss_fn(output, *targets)`. Then `hc(*inputs,
            targets=y)` (or a tuple of targets) returns the loss, and the plan covers the
            whole step: the loss, its backward and the gradients flowing back into the module
            (see NOTE [ The step around the module ]). `hc(*inputs)` still returns the output.
        calibrate: measure the first training step of each signature with the allocator
            and plan again if it is above the budget (the closed loop, closed_loop.py). None
            (default) or True: on, on CUDA (at no cost) and on CPU (profiler memory events:
            slower, once per signature; off inside torch.compile(hc) on CPU, NOTE [ No CPU
            measurement inside torch.compile(hc) ]). False: off on CPU.
        compile: run each segment of the plan through `torch.compile`: True, or a dict of
            `torch.compile` keyword arguments (`{"backend": "aot_eager"}`, `{"mode": ...}`).
            `torch.compile(hc)` does the same with the default options (NOTE [ torch.compile
            of an HCModule ]).
        keeps_outputs: whether the caller keeps the module's outputs alive until backward
            ends. None (default): assume it lets go of those backward does not start from
            (`model(**batch).loss.backward()`, Trainer, `loss_fn(hc(x), y).backward()`), see
            when backward ends which it keeps, and plan again from the next step if it keeps
            more (one warning; NOTE [ Outputs the caller lets go ]). True: count every output
            until backward ends. False: outputs backward starts from too are let go once
            backward has started; the memory of a loss computed outside the module (its
            backward's temporaries, about the outputs' size for mse_loss) is then not counted
            (pass it as `loss_fn` to have it planned).
        plan_cache: a directory (or `hbp.planner.cache.PlanCache`) where plans are kept by
            the captured graph's structure, the budget and the options, and the ops' measured
            workspaces (in its `scratch` folder) by op signature: a restarted job or another
            run of a sweep reads them there instead of planning and measuring again.
        carry_plans: a new input signature of the same structure as one planned before
            (another sequence length or batch size) first tries the plans made for the
            others: the one that recomputes least of those the simulator puts within its
            budget runs, in milliseconds instead of the planner's seconds, at the cost of
            possibly more recompute than its own plan (NOTE [ Plans carried across sizes ] in
            hbp.planner.carry). False: every signature gets its own plan.

    Attributes:
        plan: the plan of the most recent training call (None before the first).
        captured: its captured graph (`CapturedGraph`, `.graph` is hbp's IR).
        measured_peak_bytes: the allocator's peak (above the level before the step, the
            caller's loss and backward included) of the most recent call's input signature,
            as last measured (each signature's first step is), or None.
    """

    def __init__(
        self,
        module: nn.Module,
        budget: float | int | str | Budget = DEFAULT_BUDGET,
        *,
        block_size: int = 1,
        planner: str = "optimal",
        verbose: bool = False,
        plan_in_eval: bool = False,
        loss_fn=None,
        calibrate: bool | None = None,
        compile: bool | dict = False,
        keeps_outputs: bool | None = None,
        plan_cache=None,
        carry_plans: bool = True,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"HCModule wraps an nn.Module, got {type(module).__name__}")
        refuse_parallel_wrappers(module)  # NOTE [ Data-parallel wrappers ] in parallel.py
        inner = [
            name
            for name, m in module.named_modules()
            if name and (ENGINE_ATTR in m.__dict__ or isinstance(m, HCModule))
        ]
        if inner:  # NOTE [ One engine per step ]
            raise ConfigError(
                "module",
                type(module).__name__,
                f"a module with no hbp inside it, but {', '.join(inner[:3])} "
                f"{'is' if len(inner) == 1 else 'are'} already enabled (or an HCModule): "
                "one plan covers the whole step, so call hbp.disable on that submodule (or "
                "unwrap it) first, or enable only the submodule",
            )
        # malformed options fail here, not at a step; set later, they plan the captures
        # again (NOTE [ Options changed after the first step ] in planning.py)
        self.budget = budget
        self.block_size = block_size
        self.planner = planner
        self.module = module
        self.verbose = verbose
        self.plan_in_eval = bool(plan_in_eval)
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError("loss_fn", loss_fn, "a callable loss_fn(output, *targets) or None")
        self.loss_fn = loss_fn
        if calibrate not in (None, True, False):
            raise ConfigError("calibrate", calibrate, "None, True or False")
        self.calibrate = calibrate
        self._probe: tuple[StepPeakProbe, Compiled] | None = None
        self._awaiting_backward = None  # NOTE [ Calls before the previous call's backward ]
        if not isinstance(compile, (bool, dict)):
            raise ConfigError("compile", compile, "True, False or a dict of torch.compile options")
        self.compile = compile
        if keeps_outputs not in (None, True, False):
            raise ConfigError("keeps_outputs", keeps_outputs, "None, True or False")
        self.keeps_outputs = keeps_outputs
        self.plan_cache = plan_cache
        self.carry_plans = carry_plans
        self._compiled: dict[tuple, Compiled] = {}
        self._uncaptured: dict[tuple, CaptureError] = {}  # signatures no capture reaches
        #: module-level captures by signature less the Python state (NOTE [ Module calls fix
        #: no Python state ] in signature.py)
        self._module_calls: dict[tuple, Compiled] = {}
        self._current: Compiled | None = None
        self._warned: set[str] = set()
        self.register_load_state_dict_pre_hook(_accept_unwrapped_keys)

    # -- public -----------------------------------------------------------------------------

    @property
    def budget(self):
        """The budget as given (`hbp.Budget`'s forms). Set between steps, every input
        signature is planned again at its next call from the capture already made (until
        then `plan` is the one the last call ran)."""
        return self._budget_given

    @budget.setter
    def budget(self, budget) -> None:
        self._budget = Budget.parse(budget)
        self._budget_given = budget

    @property
    def block_size(self) -> int:
        """At most one cut per this many consecutive nodes (set: as `budget`)."""
        return self._block_size

    @block_size.setter
    def block_size(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ConfigError("block_size", block_size, "an int >= 1")
        self._block_size = block_size

    @property
    def plan_cache(self) -> PlanCache | None:
        """Where plans and measured workspaces are kept across runs (set: a directory, a
        `PlanCache` or None; the captures and plans made are kept)."""
        return self._plan_cache

    @plan_cache.setter
    def plan_cache(self, plan_cache) -> None:
        self._plan_cache = PlanCache.of(plan_cache)

    @property
    def carry_plans(self) -> bool:
        """Whether a new input signature first tries the plans of others of its structure
        (set: for the signatures planned from then on)."""
        return self._carry_plans

    @carry_plans.setter
    def carry_plans(self, carry_plans: bool) -> None:
        if not isinstance(carry_plans, bool):
            raise ConfigError("carry_plans", carry_plans, "True or False")
        self._carry_plans = carry_plans

    @property
    def planner(self) -> str:
        """One of `hbp.planner.PLANNERS` (set: as `budget`)."""
        return self._planner

    @planner.setter
    def planner(self, planner: str) -> None:
        if planner not in PLANNERS:
            raise ConfigError("planner", planner, " or ".join(repr(p) for p in PLANNERS))
        self._planner = planner

    @property
    def plan(self) -> Plan | None:
        return self._current.plan if self._current else None

    @property
    def budget_bytes(self) -> int | None:
        """The budget, in bytes, the most recent call's input signature must meet: the one
        to compare a measured peak with. `plan.budget_bytes` is what its plan was made for,
        lower where the first step's measurement planned again below the budget for memory
        the plan did not see. Read after a measured step's backward, that measurement is read
        first, as `measured_peak_bytes` reads it (the budget of "min" rises with kept
        outputs)."""
        self._finish_ended_probe()
        return self._current.budget_bytes if self._current else None

    @property
    def captured(self) -> CapturedGraph | None:
        return self._current.captured if self._current else None

    @property
    def measured_peak_bytes(self) -> int | None:
        """The allocator's peak, in bytes, of the most recent call's input signature as its
        plan last measured it; where that plan is not measured yet, of the signature's last
        measured step under an earlier plan; None where the signature has no measured step
        (never another signature's figure)."""
        self._finish_probe()
        current = self._current
        if current is None:
            return None
        if current.measured_peak_bytes is not None:
            return current.measured_peak_bytes
        return current.last_measured_peak_bytes

    @property
    def compiled(self) -> Compiled | None:
        """Capture, plan, executor and timings of the most recent training call."""
        return self._current

    forward = _Forward()

    def _forward(self, *args, **kwargs):
        # NOTE [ torch.compile of an HCModule ]
        if torch.compiler.is_compiling() or dynamo_callback_set():
            return self._forward_with_compiled_segments(*args, **kwargs)
        # NOTE [ A forward wrapped before enable ] in wrapped_forward.py
        return self._instance_layers().run(
            lambda a, k: self._step(a, k, compiled_segments=False), args, kwargs
        )

    def _instance_layers(self) -> ForwardLayers:
        """The layers of a forward set on the wrapped module's instance (accelerate's mixed
        precision), read once per such forward."""
        forward = self.module.__dict__.get("forward")
        if forward is None:
            return ForwardLayers()
        known = self.__dict__.get("_instance_forward")
        if known is None or known[0] is not forward:
            layers = warned_layers(forward, self.module, "HCModule")
            known = self.__dict__["_instance_forward"] = (forward, layers)
        return known[1]

    def _step(self, args, kwargs, compiled_segments: bool):
        """The call as a training step: captured, planned (once per signature) and run by the
        executor (`compiled_segments`: a torch.compile(hc) call, its segments compiled)."""
        if self.loss_fn is not None and "targets" in kwargs:
            return self._forward_with_loss(args, kwargs, compiled_segments)
        if not self._plans_for(args, kwargs):
            return self._plain(*args, **kwargs)
        kwargs = training_kwargs(self.module, kwargs)
        try:
            compiled = self._prepare(args, kwargs, compiled_segments=compiled_segments)
        except CaptureError as err:  # NOTE [ A step no capture reaches ] in capture.py
            self._warn_running_plain(err)
            return self._plain(*args, **kwargs)
        return self._run(compiled, args, kwargs, compiled_segments)

    def _plain(self, *args, **kwargs):
        """The module's own call, without a plan."""
        return self.module(*args, **kwargs)

    def prepare(self, *args, **kwargs) -> Plan:
        """Capture and plan for these inputs as a training step (grad enabled, current
        train/eval flags) without running the step; return the plan. Later calls with the
        same signature reuse it. With `loss_fn`, pass `targets=` to plan the whole step."""
        kwargs = training_kwargs(self.module, kwargs)
        with torch.enable_grad():
            if self.loss_fn is not None and "targets" in kwargs:
                args, kwargs, root, tag = with_loss(self.module, self.loss_fn, args, kwargs)
                return self._prepare(args, kwargs, root, tag).plan
            return self._prepare(args, kwargs).plan

    def save_plan(self, path) -> None:
        """Write the current plan to `path` (JSON), tied to its captured graph's structure:
        `hbp.planner.cache.load_plan(path, graph)` reads it back for the same graph. To
        reuse plans across runs, pass `plan_cache=` a directory instead."""
        if self._current is None or self._current.plan is None:
            raise RuntimeError(
                "HCModule.save_plan: nothing is planned yet; run a training step (or "
                ".prepare(*inputs)) that plans first"
            )
        save_plan(self._current.plan, path, self._current.captured.graph)

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
        state["_uncaptured"], state["_module_calls"] = {}, {}
        state["_probe"] = None  # a measurement in flight (a profiler) stays with the original
        state["_awaiting_backward"] = None  # (weak references to the last call's outputs)
        return state

    # -- planning ---------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)  # hc.config, hc.generate, hc.save_pretrained, ...

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state dict: its own keys, no "module." prefix."""
        return self.module.state_dict(
            *args, destination=destination, prefix=prefix, keep_vars=keep_vars
        )

    # -- the step around the module (NOTE [ The step around the module ] in loss.py) ------

    def _forward_with_loss(self, args, kwargs, compiled_segments: bool = False):
        step_args, step_kwargs, root, tag = with_loss(self.module, self.loss_fn, args, kwargs)
        if not self._plans_for(args, step_kwargs):
            return root(*step_args, **step_kwargs)
        step_kwargs = training_kwargs(self.module, step_kwargs)
        try:
            compiled = self._prepare(step_args, step_kwargs, root, tag, compiled_segments)
        except CaptureError as err:  # NOTE [ A step no capture reaches ] in capture.py
            self._warn_running_plain(err)
            return root(*step_args, **step_kwargs)
        return self._run(compiled, step_args, step_kwargs, compiled_segments, root)

    def _warn_running_plain(self, err: CaptureError) -> None:
        self._warn_once(
            f"uncaptured:{err}",
            f"{err}. hbp runs this input signature as the plain module: nothing is "
            "checkpointed and the budget is not enforced.",
            CaptureWarning,
        )

    def _run(self, compiled, args, kwargs, compiled_segments: bool = False, root=None):
        """Run the executor (`compiled_segments`: a torch.compile(hc) call); measure the step
        with the allocator while the closed loop is open (NOTE [ The step around the
        module ]); see which outputs the caller keeps (NOTE [ Outputs the caller lets go ]).
        Where a guard of the graph fails, run `root` (the module, or the module with its
        loss) plainly instead (NOTE [ A failed guard ])."""
        self._warn_if_called_before_backward()
        self._read_step(compiled, self._stop_probe())
        if compiled_segments and compiled.pins:
            self._plan_without_pins(compiled)
        executor = self._executor(compiled, compiled_segments)
        if not has_guards(compiled.captured):
            output = self._run_measured(compiled, executor, args, kwargs, compiled_segments)
            self._watch_outputs(compiled, executor, output)
            self._warn_about_unplanned_calls(executor)
            return output
        ran: list = []

        def run():
            output = self._run_measured(compiled, executor, args, kwargs, compiled_segments)
            ran.append(True)
            return output

        def plain():
            return root(*args, **kwargs) if root is not None else self._plain(*args, **kwargs)

        output = run_or_plain(
            run,
            plain,
            self.module if root is None else root,
            sorted({d.index or 0 for d in _cuda_devices(args, kwargs, self.module)}),
            lambda message: self._warn_once("graph-break-guard", message),
        )
        if ran:
            self._watch_outputs(compiled, executor, output)
            self._warn_about_unplanned_calls(executor)
        return output

    def _warn_about_unplanned_calls(self, executor) -> None:
        """NOTE [ Calls the captured step did not make ] in
        hbp.runtime.executors.module_calls."""
        unplanned = getattr(executor, "unplanned", None)
        if unplanned:
            shown = ", ".join(dict.fromkeys(unplanned[:4]))
            self._warn_once(
                "unplanned calls",
                f"HCModule: this step called {shown}{' and more' if len(unplanned) > 4 else ''}, "
                "which the captured step did not (a random layer drop, a data-dependent "
                "branch): such calls run plainly, outside the module-level plan, and the "
                "step's memory can exceed the budget. Turn the layer drop off while training "
                "with hbp (transformers: layerdrop=0.0), or leave room in the budget.",
                BudgetWarning,
            )


def _cuda_devices(args, kwargs, module) -> list[torch.device]:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return [t.device for t in (*tensors, *module.parameters()) if t.is_cuda]


def _accept_unwrapped_keys(module, state_dict, prefix, *args) -> None:
    """`load_state_dict` pre-hook: a state dict of the unwrapped module (no key under
    `prefix` starts with "module.", e.g. a checkpoint saved before wrapping) is loaded into
    `.module`."""
    own = [k for k in state_dict if k.startswith(prefix)]
    if own and not any(k.startswith(prefix + "module.") for k in own):
        for k in own:
            state_dict[prefix + "module." + k[len(prefix) :]] = state_dict.pop(k)
