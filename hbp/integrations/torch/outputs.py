"""Outputs the caller lets go: which of the module's outputs the caller keeps until backward
ends, seen when backward ends (NOTE [ Outputs the caller lets go ])."""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten

from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError
from hbp.units import MIB

# NOTE [ Outputs the caller lets go ]
# Whether the caller keeps the module's outputs until backward ends changes the step's peak by
# their size in every segment's backward. The usual step lets them go: with
# `model(**batch).loss.backward()` (transformers' Trainer too) the logits are gone before
# backward starts; with `loss_fn(hc(x), y).backward()` the output goes once backward has passed
# the loss. So the first step of a signature is planned that way (keeps_outputs=None, the
# default): `Graph.held_outputs` = the outputs backward starts from, each other output counted
# until nothing in the step needs it. Outputs backward starts from stay counted until backward
# ends: the caller computed its loss from them, and that loss's memory (which the plan does not
# see) is there while they are (tests/test_step_budget.py's tied LM). Which outputs the caller
# keeps shows when backward ends: the module's own references are gone by then, so an output
# still alive is the caller's (`out = model(x); out.loss.backward(); log(out.logits)`). HCModule
# then plans again counting them, from the next step, with one warning (that step may have
# been above the budget by their size); where no plan fits with them, it plans the least and
# the warning names the way out. keeps_outputs=True/False fixes the assumption instead (True:
# every output counted until backward ends; False: outputs backward starts from too are let go
# once backward has started: with loss_fn, or when the caller's loss is small).


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

    def _outputs_observed(self, compiled) -> bool:
        """Plan again when the last step showed outputs the plan counts wrongly; whether it
        did."""
        seen, compiled.outputs_seen = compiled.outputs_seen, None
        if seen is None:
            return False
        compiled.outputs_watched = True
        graph = compiled.captured.graph
        held = set(graph.outputs) if graph.held_outputs is None else set(graph.held_outputs)
        kept = (seen | graph.backward_seeds()) & set(graph.outputs)
        if graph.held_outputs is None and kept >= set(graph.outputs):
            return False  # the caller keeps them all: the plan is right
        if graph.held_outputs is not None and kept <= held:
            return False
        more = sorted(kept - held)
        previous, graph.held_outputs = graph.held_outputs, [o for o in graph.outputs if o in kept]
        if previous is not None:
            warnings.warn(
                f"HCModule: the caller keeps {', '.join(more)} alive until backward ends; the "
                "last step counted them as let go and may have been above the budget by their "
                "size. Planned again with them; keeps_outputs=True counts them from the start.",
                UserWarning,
                stacklevel=5,
            )
        naive = simulate(graph).peak_bytes
        compiled.naive_peak_bytes = naive
        try:
            self._replan(compiled, self._target(compiled.captured, naive, compiled.device))
        except BudgetError as err:
            self._replan(compiled, "min")
            compiled.settled = True  # the loop cannot do better than the least plan
            warnings.warn(
                f"HCModule: with {', '.join(more)} kept by the caller until backward ends, no "
                f"plan fits {err.budget / MIB:.2f} MiB (the least is {err.minimum / MIB:.2f} "
                "MiB): planned for the least. Let them go before backward, or raise the budget.",
                UserWarning,
                stacklevel=5,
            )
            return True
        compiled.budget_bytes = compiled.plan.budget_bytes
        # the new plan spends what the outputs held on less recompute: memory the plan does
        # not see (the caller's loss) may now cross the budget, so the closed loop measures
        # the next step again
        compiled.settled, compiled.measurements = False, 0
        return True
