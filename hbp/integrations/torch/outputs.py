"""Outputs the caller lets go: which of the module's outputs the caller keeps until backward
ends, seen when backward ends (NOTE [ Outputs the caller lets go ])."""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten

from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError

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


def grad_leaves(executor, output) -> list[torch.Tensor]:
    """The output tensors that require grad: the graph outputs the executor returned (in any
    container, dataclasses included), else the pytree leaves of `output`."""
    returned = getattr(executor, "returned", None)
    if returned:
        tensors = [t for t in (ref() for _, ref in returned) if t is not None]
    else:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return [t for t in tensors if t.requires_grad]


class WatchedOutputs:
    """Output watching (a mixin of `HCModule`)."""

    def _watch_outputs(self, compiled, executor, output) -> None:
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
        leaves = grad_leaves(executor, output)
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

    def _outputs_observed(self, compiled) -> None:
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
        if not self._budget.is_min:  # a budget above the new naive peak is that peak
            target = min(compiled.plan.budget_bytes, simulate(graph).peak_bytes)
        try:
            self._replan(compiled, target)
        except BudgetError:  # cannot happen when outputs are let go; keep the plan otherwise
            return
        if self._budget.is_min:
            compiled.budget_bytes = compiled.plan.budget_bytes
        # the new plan spends what the outputs held on less recompute: memory the plan does
        # not see (the caller's loss) may now cross the budget, so the closed loop (on CUDA,
        # or with calibrate=True) measures the next step again
        compiled.settled, compiled.measurements = False, 0
