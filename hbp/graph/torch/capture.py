"""Capture a PyTorch module's training step into hbp's IR (`hbp.graph.ir.Graph`).

`capture(module, args, kwargs) -> CapturedGraph` runs the stages in sequence, one file each:
1. trace to an op-level fx graph specialised to the input signature: torch.fx symbolic
   tracing (`trace`), or, where that fails, the forward's Python run on fake tensors by
   non-strict torch.export (`export`);
2. normalise in-place ops (`normalise`) and
3. profile every node on fake tensors into the IR (`profile`);
4. if every tracer fails, fall back to module-level cut points (`fallback`), with a
   `hbp.errors.CaptureWarning` that says why.
Shared pieces: fake values (`fake`), output containers (`outputs`), grad/autocast
modes (`modes`), FLOP formulas (`flops`), running-statistics norms (`running_stats`),
the result type (`captured`).

Capturing does not change the module: parameters and buffers are only read (fake copies are
updated instead; a real no-grad run of the fallback puts buffer values back), attributes the
forward assigns while traced are put back, train/eval flags are untouched, and the RNG state
is restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from hbp.errors import CaptureWarning
from hbp.graph.torch.captured import MODULE, OP, CapturedGraph
from hbp.graph.torch.export import eager_shortcuts, export_trace
from hbp.graph.torch.fake import _MISSING, _Faker, _rng_preserved
from hbp.graph.torch.fallback import _buffers_restored, _capture_modules
from hbp.graph.torch.modes import MODES, ambient_modes, enter_modes, exit_modes
from hbp.graph.torch.outputs import OutputSlot, map_output
from hbp.graph.torch.profile import _profile_graph
from hbp.graph.torch.trace import _ModuleState, _same, _trace

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


def capture(module: nn.Module, args: tuple = (), kwargs: dict | None = None) -> CapturedGraph:
    """Capture `module(*args, **kwargs)` (training step: grad enabled, current train/eval
    flags) into hbp's IR. Falls back to module-level cut points, with a `CaptureWarning`,
    where op-level capture fails. The module's state (parameters, buffers, train flags, RNG)
    is unchanged afterwards."""
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    signature = inspect.signature(module.forward)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    # Dispatch modes the caller has active (a memory tracker, a FLOP counter) must not see
    # the capture's fake computations.
    with (
        _disable_current_modes(),
        _rng_preserved(module, bound.arguments),
        torch.enable_grad(),
        eager_shortcuts(bound.arguments),
    ):
        failures = []
        captured = None
        for tracer in _TRACERS:
            try:
                captured = tracer(module, bound, signature, args, kwargs)
                break
            except Exception as err:  # noqa: BLE001 - any tracing failure means "try the next"
                reason = _failure_reason(err)
                failures.append(f"{tracer.__name__.strip('_')}: {reason}")
        if captured is None:
            reason = "; ".join(failures)
            warnings.warn(
                f"hbp could not capture {type(module).__name__} at operator level ({reason}); "
                "falling back to module-level cut points (child module calls): the plan is "
                "coarser and its memory prediction approximate.",
                CaptureWarning,
                stacklevel=3,
            )
            captured = _capture_modules(module, bound, signature, reason, args, kwargs)
    _seed_backward_at_the_loss(captured)
    captured.graph.rng_state_bytes = _rng_state_bytes(module, bound.arguments)
    captured.capture_time_s = time.perf_counter() - start
    captured.graph.meta["capture_time_s"] = captured.capture_time_s
    return captured


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
    faker = _Faker()
    gm, input_names, tracer = _trace(module, bound.arguments, signature, faker)
    captured = _profile_graph(gm, module, bound.arguments, input_names, signature, faker)
    captured.output_template = tracer.output_template
    captured.inlined_checkpoints = tracer.inlined_checkpoints
    captured.tracer = "fx"
    return captured


def _export_trace(
    module: nn.Module, bound: inspect.BoundArguments, signature: inspect.Signature, args, kwargs
) -> CapturedGraph:
    """Op level by running the forward on fake tensors (`hbp.graph.torch.export`); see
    NOTE [ One-time initialisation in forward ]."""
    kept: list[_Assignment] = []
    for attempt in range(2):
        assigned: list[_Assignment] = []
        state = _ModuleState(module)
        try:
            with _buffers_restored(module), _python_assignments_recorded(module, assigned):
                exported = export_trace(module, args, kwargs, ambient_modes())
        except Exception:
            _undo(kept)
            raise
        finally:
            changed = state.restore()
        python_state = [name for name, value in changed if not isinstance(value, torch.Tensor)]
        python_state += [a.name for a in assigned if a.name not in python_state]
        if not python_state:
            break
        if attempt == 1 or not assigned:
            _undo(kept)
            raise TypeError(
                f"forward assigns Python attribute(s) {', '.join(python_state[:3])}: a traced "
                "graph would not repeat that side effect on later calls"
            )
        for a in assigned:  # keep them as the first plain call would, and trace again
            a.apply()
        kept = assigned
    faker = _Faker()
    inputs = exported.inputs
    captured = _profile_graph(exported.gm, module, inputs, list(inputs), signature, faker)
    captured.output_template = exported.output_template
    captured.in_spec = exported.in_spec
    captured.tracer = "export"
    return captured


# NOTE [ One-time initialisation in forward ]
# Some forwards set up state on their first call and never again: transformers installs its
# output-capturing hooks and sets `_output_capturing_hooks_installed = True`. Putting the flag
# back after tracing while the hooks stay would install them twice on the next call (and
# capture every output twice), and refusing the trace would lose operator level for no reason.
# So when a trace assigns Python attributes, they are kept, as the first plain call would keep
# them, and the forward is traced again: if that second trace assigns nothing, the first one's
# assignments were a one-time initialisation and the second graph is the forward of every later
# call. If it assigns again (`self.calls += 1`), the forward has a side effect a graph cannot
# repeat: the kept values are put back and capture falls back to module level.


@dataclass
class _Assignment:
    """A Python value the forward assigned to a module attribute, and the value before."""

    module: nn.Module
    name: str
    attribute: str
    value: Any
    before: Any

    def apply(self) -> None:
        nn.Module.__setattr__(self.module, self.attribute, self.value)

    def undo(self) -> None:
        if self.before is _MISSING:
            self.module.__dict__.pop(self.attribute, None)
        else:
            nn.Module.__setattr__(self.module, self.attribute, self.before)


def _undo(assignments: list[_Assignment]) -> None:
    for a in reversed(assignments):
        a.undo()


@contextlib.contextmanager
def _python_assignments_recorded(module: nn.Module, out: list[_Assignment]) -> Iterator[None]:
    """Within: each Python (non-tensor) value the forward assigns to `module` or a submodule,
    where it changes the attribute, is appended to `out` (torch.export puts module attributes
    back after tracing, so comparing the state before and after cannot see them)."""
    paths = {id(m): p for p, m in module.named_modules()}
    original = nn.Module.__setattr__

    def recording(mod: nn.Module, name: str, value: Any) -> None:
        path = paths.get(id(mod))
        before = mod.__dict__.get(name, _MISSING)
        if (
            path is not None
            and not isinstance(value, (torch.Tensor, nn.Module))
            and not _same(before, value)
        ):
            qualified = f"{path}.{name}" if path else name
            out.append(_Assignment(mod, qualified, name, value, before))
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
