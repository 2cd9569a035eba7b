"""Capture a PyTorch module's training step into hbp's IR (`hbp.graph.ir.Graph`).

`capture(module, args, kwargs, calibrate=False) -> CapturedGraph` runs the stages in
sequence, one file each:
1. trace to an op-level fx graph specialised to the input signature: torch.fx symbolic
   tracing (`trace`), or, where that fails, the forward's Python run on fake tensors by
   non-strict torch.export (`export`);
2. normalise in-place ops (`normalise`) and
3. profile every node on fake tensors into the IR (`profile`; one op call: `op_profile`),
   then check which gradients pass through in the layouts they arrive in
   (`gradient_layouts`);
4. if every tracer fails, fall back to module-level cut points (`fallback`), with a
   `hbp.errors.CaptureWarning` that says why;
5. with `calibrate=True`, measure each op's kernel workspace with the allocator on real
   tensors (`calibrate`).
Shared pieces: what an attempt must put back (`state`), fake values (`fake`), the tracer's
proxies that carry them (`proxy`), output containers (`outputs`), grad/autocast modes
(`modes`), FLOP formulas (`flops`), running-statistics norms (`running_stats`), the result
type (`captured`).

Capturing leaves no trace on the module, whatever fails: every attempt runs between a snapshot
of the model's Python state and torch's global state (`state.ModelState`: attributes,
hooks, parameters' flags, global hooks, grad mode, autocast, default dtype) and its
restoration; buffer values and the RNG state are put back; parameters are only read. The one
exception is a forward that sets itself up on its first call: it is called once for real, as
the caller's first call would be, and its set-up is kept when capture then succeeds
(NOTE [ One-time initialisation in forward ]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from hbp.errors import CaptureError, CaptureWarning
from hbp.graph.torch.calibrate import calibrate_scratch
from hbp.graph.torch.captured import MODULE, OP, CapturedGraph
from hbp.graph.torch.export import eager_shortcuts, export_trace
from hbp.graph.torch.fake import MISSING, Faker, HostRandom, rng_preserved
from hbp.graph.torch.fallback import buffers_restored, capture_modules
from hbp.graph.torch.modes import MODES, ambient_modes, enter_modes, exit_modes
from hbp.graph.torch.outputs import OutputSlot, map_output
from hbp.graph.torch.profile import profile_graph
from hbp.graph.torch.proxy import InputAttributeRead
from hbp.graph.torch.scratch_store import ScratchStore
from hbp.graph.torch.state import ForwardSideEffect, ModelState, ModuleState, same_value
from hbp.graph.torch.trace import (
    checkpoints_inlined,
    fake_failures_quiet,
    hooked_submodules,
    trace_module,
)

__all__ = [
    "MODES",
    "MODULE",
    "OP",
    "CapturedGraph",
    "OutputSlot",
    "ambient_modes",
    "capture",
    "enter_modes",
    "exit_modes",
    "map_output",
]


def module_name(module: nn.Module) -> str:
    """The class name a message gives `module`: a wrapper of hbp's that says so
    (`wraps_module = True`, the step with its loss) gives the module it wraps."""
    while getattr(type(module), "wraps_module", False):
        module = module.module
    return type(module).__name__


def capture(
    module: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    calibrate: bool = False,
    scratch_store: ScratchStore | None = None,
) -> CapturedGraph:
    """Capture `module(*args, **kwargs)` (training step: grad enabled, current train/eval
    flags) into hbp's IR. Falls back to module-level cut points, with a `CaptureWarning`,
    where op-level capture fails. Whatever fails, the module's state (attributes, hooks,
    parameters, buffers, train flags) and torch's (RNG, global hooks, grad mode, autocast,
    default dtype) are as they were, but for a first-call set-up the forward does when called
    for real (NOTE [ One-time initialisation in forward ]).

    `calibrate=True` also measures each op's kernel workspace with the allocator, on real
    tensors (the scratch calibration stage, `hbp.graph.torch.calibrate`), into the nodes'
    scratch fields; `CapturedGraph.scratch_measured` says whether it could. `scratch_store`
    (`hbp.graph.torch.scratch_store.ScratchStore`) keeps those measurements across processes."""
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    signature = inspect.signature(module.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    # Dispatch modes the caller has active (a memory tracker, a FLOP counter) must not see
    # the capture's fake computations.
    with (
        _disable_current_modes(),
        rng_preserved(module, bound.arguments),
        buffers_restored(module),
        torch.enable_grad(),
        eager_shortcuts(bound.arguments),
        fake_failures_quiet(),
    ):
        failures: list[str] = []
        captured = _op_level(module, bound, signature, args, kwargs, failures)
        if captured is None:
            state = ModelState(module)
            try:
                captured = capture_modules(
                    module, bound, signature, "; ".join(failures), args, kwargs
                )
            except Exception as err:  # noqa: BLE001 - NOTE [ A step no capture reaches ]
                reason = f"module-level cut points: {_failure_reason(err)}"
                raise CaptureError(module_name(module), [*failures, reason]) from None
            finally:
                state.restore()
            warnings.warn(
                f"hbp could not capture {module_name(module)} at operator level "
                f"({'; '.join(failures)}); falling back to module-level cut points (child "
                "module calls): the plan is coarser and its memory prediction approximate.",
                CaptureWarning,
                stacklevel=3,
            )
    _seed_backward_at_the_loss(captured)
    captured.graph.rng_state_bytes = _rng_state_bytes(module, bound.arguments)
    captured.capture_time_s = time.perf_counter() - start
    captured.graph.meta["capture_time_s"] = captured.capture_time_s
    if calibrate:
        captured.scratch_measured = (
            calibrate_scratch(captured, args, kwargs, scratch_store) is not None
        )
    return captured


# NOTE [ A step no capture reaches ]
# Where every op-level tracer fails and the module-level fallback fails too (a child call
# whose recorded inputs the rest of the forward changed: a transformers key/value cache
# object that later layers append to, so the call does not run again alone), hbp has no
# graph to plan. The capture raises `CaptureError` with every attempt's reason; HCModule
# (and `hbp.enable`) run that input signature as the plain module, with a CaptureWarning
# that says the budget is not enforced, instead of failing a step the plain model runs
# (docs/architecture.md "Errors"). `hc.prepare` and `hbp.estimate`, asked for a plan or a
# prediction, raise it.


def _failure_reason(err: Exception) -> str:
    """One line saying why a tracer failed."""
    return f"{type(err).__name__}: {err}".strip().splitlines()[0][:300]


def _rng_state_bytes(module: nn.Module, arguments: dict) -> int:
    """`Graph.rng_state_bytes` for a step of `module` on these arguments: the CPU generator's
    state (what `torch.utils.checkpoint` copies, a CPU tensor) when the step runs on the CPU;
    0 on CUDA, where the peak is the device's and the states are in host memory."""
    leaves = (*pytree.tree_leaves(dict(arguments)), *module.parameters())
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in leaves):
        return 0
    return int(torch.get_rng_state().nbytes)


def _symbolic_trace(
    module: nn.Module, bound: inspect.BoundArguments, signature: inspect.Signature, args, kwargs
) -> CapturedGraph:
    """Op level by torch.fx symbolic tracing, specialised to this call (module docstring)."""
    faker = Faker()
    gm, input_names, tracer = trace_module(module, bound.arguments, signature, faker)
    captured = profile_graph(gm, module, bound.arguments, input_names, signature, faker)
    captured.output_template = tracer.output_template
    captured.inlined_checkpoints = tracer.inlined_checkpoints
    captured.tracer = "fx"
    return captured


def _export_trace(
    module: nn.Module, bound: inspect.BoundArguments, signature: inspect.Signature, args, kwargs
) -> CapturedGraph:
    """Op level by running the forward on fake tensors (`hbp.graph.torch.export`)."""
    hooked = hooked_submodules(module)
    if hooked:  # NOTE [ A module with forward hooks is one node ] in trace.py
        raise RuntimeError(
            f"forward hooks on {', '.join(hooked[:3])} would run once, on the tracer's fake "
            "tensors, and never again: a hook that stores an output would keep a fake tensor"
        )
    assigned: list[str] = []
    checkpoints: list[int] = []  # one entry per torch.utils.checkpoint call traced through
    state = ModuleState(module)
    try:
        with (
            buffers_restored(module),
            _python_assignments_recorded(module, assigned),
            checkpoints_inlined(lambda: checkpoints.append(1)),
        ):
            exported = export_trace(module, args, kwargs, ambient_modes())
    finally:
        changed = state.restore()
    python_state = [name for name, value in changed if not isinstance(value, torch.Tensor)]
    python_state += [name for name in assigned if name not in python_state]
    if python_state:
        raise ForwardSideEffect(
            f"forward assigns Python attribute(s) {', '.join(python_state[:3])}: a traced "
            "graph would not repeat that side effect on later calls"
        )
    faker = Faker()
    inputs = exported.inputs
    captured = profile_graph(exported.gm, module, inputs, list(inputs), signature, faker)
    captured.output_template = exported.output_template
    captured.in_spec = exported.in_spec
    captured.inlined_checkpoints = len(checkpoints)
    captured.tracer = "export"
    return captured


def _op_level(
    module: nn.Module,
    bound: inspect.BoundArguments,
    signature: inspect.Signature,
    args: tuple,
    kwargs: dict,
    failures: list[str],
) -> CapturedGraph | None:
    """The first op-level tracer's capture, each attempt leaving the model as it found it;
    None if every one fails (why: appended to `failures`). A forward that sets itself up on
    its first call is called once for real first (NOTE [ One-time initialisation in
    forward ])."""
    pristine = ModelState(module)
    captured, set_up = _first_tracer(module, bound, signature, args, kwargs, failures)
    if captured is not None or not set_up:
        return captured
    try:
        _first_call(module, args, kwargs)
    except Exception as err:  # noqa: BLE001 - then the set-up is not what failed
        failures.append(f"first call: {_failure_reason(err)}")
        pristine.restore()
        return None
    retried: list[str] = []
    captured, _ = _first_tracer(module, bound, signature, args, kwargs, retried)
    failures += [f"{f} (after one plain call)" for f in retried]
    if captured is None:
        pristine.restore()  # the first call's set-up too: capture failed, the model is as it was
    return captured


def _first_tracer(
    module: nn.Module,
    bound: inspect.BoundArguments,
    signature: inspect.Signature,
    args: tuple,
    kwargs: dict,
    failures: list[str],
) -> tuple[CapturedGraph | None, bool]:
    """The first tracer's capture (None if every one fails), and whether an attempt changed
    the model's Python state (a forward side effect, perhaps a first-call set-up). Whatever
    an attempt changed is put back."""
    side_effects = False
    for tracer in _TRACERS:
        name = tracer.__name__.strip("_")
        state = ModelState(module)
        host = HostRandom()
        captured = None
        try:
            captured = tracer(module, bound, signature, args, kwargs)
        except Exception as err:  # noqa: BLE001 - any tracing failure means "try the next"
            failures.append(f"{name}: {_failure_reason(err)}")
            side_effects = side_effects or isinstance(err, ForwardSideEffect)
            if isinstance(err, InputAttributeRead):  # no tracer can: module level
                return None, side_effects  # (the model is put back by `finally`)
        finally:
            changed = state.restore()
            drawn = host.drawn()
            host.restore()
        if drawn:  # NOTE [ Random numbers drawn on the host ] in hbp.graph.torch.fake
            failures.append(
                f"{name}: forward draws from {' and '.join(drawn)}: a traced graph would "
                "repeat this call's draw every step"
            )
            return None, side_effects  # no tracer can: module level
        # Attributes: the tracer judged them (leaf modules may cache their own); hooks and
        # torch's global state it did not look at.
        unrepeated = [c for c in changed if "hooks" in c or c.startswith("torch")]
        if captured is not None and unrepeated:
            failures.append(
                f"{name}: forward changes {', '.join(unrepeated[:3])}: a traced graph would "
                "not repeat that on later calls"
            )
            captured = None
        side_effects = side_effects or (captured is None and bool(changed))
        if captured is not None:
            return captured, side_effects
    return None, side_effects


def _first_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Call `module` once for real, as the caller's first call would (grad mode on), keeping
    nothing for backward (saved tensors dropped as they are packed); buffers and RNG are put
    back by the caller (`capture`)."""
    with torch.autograd.graph.saved_tensors_hooks(_drop, _never_unpacked):
        module(*args, **kwargs)


def _drop(tensor: torch.Tensor) -> None:
    return None


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("hbp's first plain call keeps nothing for backward")


# NOTE [ One-time initialisation in forward ]
# Some forwards set up state on their first call and never again: transformers installs its
# output-capturing hooks on a sub-model's first call and sets `_output_capturing_hooks_installed`.
# Traced, that set-up would happen on proxies or fake tensors, and every attempt puts the
# model's Python state back (`ModelState`), flag and hooks together: half of it kept (the flag
# without the hooks) breaks the plain model. A tracer that sees the forward change the model's
# state cannot tell a one-time set-up from a per-call side effect (`self.calls += 1`), so the
# model is called once for real, as the caller's first call would call it (grad mode on,
# nothing kept for backward, buffers and RNG put back), and the tracers run again: if none
# sees a change now, the set-up is done, as it would be without hbp, and the graph is the
# forward of every later call. If capture still fails, everything the first call set up is
# put back too, and the module-level fallback (which runs the forward itself) leaves the set-up
# to the caller's first step.


@contextlib.contextmanager
def _python_assignments_recorded(module: nn.Module, out: list[str]) -> Iterator[None]:
    """Within: the qualified name of each Python (non-tensor) value the forward assigns to
    `module` or a submodule, where it changes the attribute, is appended to `out`
    (torch.export puts module attributes back after tracing, so comparing the state before
    and after cannot see them)."""
    paths = {id(m): p for p, m in module.named_modules()}
    original = nn.Module.__setattr__

    def recording(mod: nn.Module, name: str, value: Any) -> None:
        path = paths.get(id(mod))
        before = mod.__dict__.get(name, MISSING)
        if (
            path is not None
            and not isinstance(value, (torch.Tensor, nn.Module))
            and not same_value(before, value)
        ):
            out.append(f"{path}.{name}" if path else name)
        original(mod, name, value)

    nn.Module.__setattr__ = recording
    try:
        yield
    finally:
        nn.Module.__setattr__ = original


# NOTE [ Where backward starts ]
# The simulator allocates, when backward starts, a gradient for every graph output that
# requires grad: right for a module whose outputs all feed the caller's loss. A model that
# returns its own loss (HuggingFace: `labels=` given, `output.loss`) is trained through that
# loss alone: `output.loss.backward()`, while the logits beside it (the largest tensor of a
# language model) are returned for the caller to look at, and their gradient only ever comes
# through the loss. So for an output mapping or dataclass with a scalar `loss`, backward
# starts at the loss (`Graph.grad_outputs`); every other output gets no gradient of its own
# (whether the caller holds it: NOTE [ Outputs the caller lets go ]).


def _seed_backward_at_the_loss(captured: CapturedGraph) -> None:
    """Set `graph.grad_outputs` to the model's own loss, if it returns one (see the NOTE)."""
    template = captured.output_template
    if captured.gm is None:
        return
    if isinstance(template, Mapping):
        slot = template.get("loss")
    elif dataclasses.is_dataclass(template) and not isinstance(template, type):
        slot = getattr(template, "loss", None)
    else:
        return
    if not isinstance(slot, OutputSlot):
        return
    output = next(n for n in captured.gm.graph.nodes if n.op == "output")
    flat = output.args[0]
    loss = flat[slot.index] if isinstance(flat, (tuple, list)) else None
    if loss is None or loss.name not in captured.graph.outputs:
        return
    node = captured.graph.node(loss.name)
    if node.requires_grad and node.output_bytes <= 16:  # a scalar (0-dim) loss
        captured.graph.grad_outputs = [loss.name]


#: Op-level tracers, tried in order; module-level cut points if every one fails.
_TRACERS = (_symbolic_trace, _export_trace)
