"""Outputs the caller lets go: which of the module's outputs the caller keeps until backward
ends, seen when backward ends (NOTE [ Outputs the caller lets go ])."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_flatten

from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, BudgetWarning
from hbp.integrations.torch.warn import warn_at_caller
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


def output_paths(output, returned) -> dict[str, str]:
    """Graph output name -> where the caller finds that tensor in `output`, written as code
    would reach it (`.logits`, `.past_key_values.layers[0].keys`, `[1]`): the names a
    warning can give the caller. Containers, dataclasses and plain objects' attributes are
    searched a few levels deep; an output found nowhere keeps its graph name only."""
    wanted = {id(t): name for name, t in ((n, ref()) for n, ref in returned) if t is not None}
    found: dict[str, str] = {}
    seen: set[int] = set()

    def walk(x, path: str, depth: int) -> None:
        if len(found) == len(wanted):
            return
        if isinstance(x, torch.Tensor):
            name = wanted.get(id(x))
            if name is not None:
                found.setdefault(name, path)
            return
        if depth == 0 or id(x) in seen or isinstance(x, (str, bytes, int, float, torch.nn.Module)):
            return
        seen.add(id(x))
        if isinstance(x, Mapping):  # transformers' ModelOutput too: `.logits`
            for key, value in x.items():
                walk(
                    value,
                    f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]",
                    depth - 1,
                )
        elif isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            for i, value in enumerate(x):
                walk(value, f"{path}[{i}]", depth - 1)
        else:
            if hasattr(x, "_fields"):  # a named tuple
                attrs = x._asdict()
            elif dataclasses.is_dataclass(x):  # with __slots__ too
                attrs = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
            else:
                attrs = getattr(x, "__dict__", {})
            for key, value in attrs.items():
                if not key.startswith("_"):
                    walk(value, f"{path}.{key}", depth - 1)

    walk(output, "", 6)
    return found


def _described(names, paths: dict[str, str] | None) -> str:
    """`output.logits (lm_head), ...`: where the caller holds each graph output, with its name."""
    paths = paths or {}
    return ", ".join(f"output{paths[n]} ({n})" if n in paths else n for n in names)


def _cache_hint(names, paths: dict[str, str] | None) -> str:
    """A hint where a transformers output's key/value cache is among `names`."""
    if any(
        part in {"cache", "past_key_values"}
        for n in names
        for part in re.split(r"[.\[]", (paths or {}).get(n, ""))
    ):
        return " (transformers: use_cache=False while training drops the key/value cache)"
    return ""


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
        if compiled.output_paths is None:
            compiled.output_paths = output_paths(output, refs)

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
            warn_at_caller(
                f"HCModule: the caller keeps {_described(more, compiled.output_paths)} alive "
                "until backward ends; the last step counted them as let go and may have been "
                "above the budget by their size. Planned again with them; keeps_outputs=True "
                "counts them from the start; letting them go before backward saves their "
                f"bytes{_cache_hint(more, compiled.output_paths)}.",
                BudgetWarning,
            )
        naive = simulate(graph).peak_bytes
        compiled.naive_peak_bytes = naive
        budget = self._target(compiled.captured, naive, compiled.device)
        try:
            self._replan(compiled, _less_what_stays_unseen(budget, compiled, graph, more))
        except BudgetError as err:
            self._replan(compiled, "min")
            # the loop cannot do better than the least plan; its next step is measured so
            # that `measured_peak_bytes` is this plan's, not the step before it
            compiled.measure_again(last=True)
            warn_at_caller(
                f"HCModule: with {_described(more, compiled.output_paths)} kept by the caller "
                "until backward ends, no "
                f"plan fits {err.budget / MIB:.2f} MiB (the least is {err.minimum / MIB:.2f} "
                "MiB): planned for the least. Let them go before backward, or raise the budget"
                f"{_cache_hint(more, compiled.output_paths)}.",
                BudgetWarning,
            )
            return True
        compiled.budget_bytes = budget if budget != "min" else compiled.plan.budget_bytes
        self._keep_settled(compiled, compiled.plan)  # with the budget it is now measured against
        # the new plan spends what the outputs held on less recompute: memory the plan does
        # not see (the caller's loss) may now cross the budget, so the closed loop measures
        # the next step again
        compiled.measure_again()
        return True


# NOTE [ Kept outputs after unseen memory ]
# The closed loop learns from a measured step what its plan did not see (the measured peak
# less the prediction: a loss computed outside the module, Accelerate's conversion of the
# outputs to float32) and plans for the budget less that. When a later step shows outputs the
# caller keeps, the capture is planned again with them counted; planned for the whole budget,
# that plan would cross it again by what stays unseen, and the loop would need another
# over-budget step to learn it a second time. So it is planned for the budget less what the
# last measurement did not see, net of the newly kept outputs (held until backward ends, they
# were in that measured peak and are now in the plan).


def _less_what_stays_unseen(budget, compiled, graph, kept: list[str]):
    """`budget` (bytes or "min") less what the closed loop's last measurement saw above its
    plan, net of the outputs `kept` now counted (NOTE [ Kept outputs after unseen memory ])."""
    if budget == "min" or not compiled.unseen_bytes:
        return budget
    counted = sum(graph.node(name).output_bytes for name in kept)
    # at least a byte: what stays unseen can be the whole budget or more (a teacher's forward
    # inside the measured step), and no plan fits a byte, so the caller takes the least plan
    return max(int(budget) - max(compiled.unseen_bytes - counted, 0), 1)
