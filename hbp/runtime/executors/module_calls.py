"""Run a module-granularity plan (the capture's fallback): `ModuleCallExecutor` checkpoints what
of the plan's recomputed segments can be re-run on its own: whole child module calls, and
runs of children of an nn.Sequential (`checkpointed_units`), by patching `forward`s for one
forward pass.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from hbp.graph.torch.captured import MODULE, CapturedGraph
from hbp.planner.plan import Plan, Segment
from hbp.runtime.executors.checkpointing import FlatCall, draws_random
from hbp.runtime.recompute import (
    ReenterableContext,
    autocast_cache_disabled,
    buffer_owners,
    buffers_kept,
    checkpoint_context_fn,
    stacked,
    throwaway_attrs,
)


def recomputed_ranges(plan: Plan) -> list[tuple[int, int]]:
    """[start, stop) of each outermost recomputed segment (at any depth under plain ones)."""
    out: list[tuple[int, int]] = []

    def visit(segments: list[Segment]) -> None:
        for seg in segments:
            if seg.recompute:
                out.append((seg.start, seg.stop))
            else:
                visit(seg.children)

    visit(plan.segments)
    return out


def recomputed_nodes(plan: Plan) -> set[int]:
    """Indices of the nodes inside a recomputed segment (outermost ones, at any depth)."""
    return {i for a, b in recomputed_ranges(plan) for i in range(a, b)}


@dataclass(frozen=True)
class CallUnit:
    """A range [start, stop) of module-level graph nodes that `ModuleCallExecutor` runs
    through one checkpoint: the call `key` = (module path, occurrence) as a whole, or, when
    `children` = (i, j), the run of that nn.Sequential call's children i..j-1."""

    start: int
    stop: int
    key: tuple[str, int]
    children: tuple[int, int] | None = None


def checkpointed_units(plan: Plan, captured: CapturedGraph) -> list[CallUnit]:
    """What the module-level executor checkpoints for `plan`, left to right. Each recomputed
    segment is covered by whole calls (a top-level child call, or an expanded nn.Sequential
    call inside the segment) and by runs of consecutive children of an expanded Sequential
    that the segment covers in part (a chain with no code in between). Code between
    top-level calls cannot be re-run on its own, so at the top level a segment is
    checkpointed call by call. The graph input (node 0) is never in a unit."""
    groups = captured.module_groups  # inner Sequentials come before the ones around them
    by_range: dict[tuple[int, int], list[int]] = {}
    for index, (_, _, a, b, _) in enumerate(groups):
        by_range.setdefault((a, b), []).append(index)

    def group_at(s: int, e: int, inside: int) -> int | None:
        """The outermost group with nodes [s, e) nested in group `inside` (len: top level)."""
        return max((g for g in by_range.get((s, e), ()) if g < inside), default=None)

    def whole(s: int, e: int, inside: int) -> CallUnit:
        g = group_at(s, e, inside)
        return CallUnit(s, e, groups[g][:2] if g is not None else captured.module_calls[s - 1])

    def level_items(lo: int, hi: int, g: int | None) -> list[tuple[int, int]]:
        if g is not None:  # the children of Sequential call g
            bounds = [*groups[g][4], hi]
            return list(zip(bounds, bounds[1:]))
        items, i = [], lo  # the top level: maximal groups and single calls
        while i < hi:
            stop = max((b for (a, b) in by_range if a == i), default=i + 1)
            items.append((i, stop))
            i = stop
        return items

    def cover(a: int, b: int, lo: int, hi: int, g: int | None) -> list[CallUnit]:
        inside = len(groups) if g is None else g
        units: list[CallUnit] = []
        run: list[tuple[int, int, int]] = []  # (position, start, stop) of whole children

        def flush() -> None:
            if run and g is not None:
                key, children = groups[g][:2], (run[0][0], run[-1][0] + 1)
                units.append(CallUnit(run[0][1], run[-1][2], key, children))
            else:
                units.extend(whole(s, e, inside) for _, s, e in run)
            run.clear()

        for k, (s, e) in enumerate(level_items(lo, hi, g)):
            if e <= a or s >= b:
                continue
            if a <= s and e <= b:
                run.append((k, s, e))
                continue
            flush()  # [s, e) is a Sequential call the segment covers in part
            units.extend(cover(a, b, s, e, group_at(s, e, inside)))
        flush()
        return units

    n = len(captured.graph)
    return [u for a, b in recomputed_ranges(plan) for u in cover(max(a, 1), b, 1, n, None)]


def per_call_plan(plan: Plan, captured: CapturedGraph) -> Plan:
    """The plan `ModuleCallExecutor` really runs: every checkpointed unit
    (`checkpointed_units`) is a recomputed segment of its own (no nesting), the rest plain.
    Predictions are left to the caller to redo."""
    names = [n.name for n in captured.graph.nodes]
    segments: list[Segment] = []

    def add(start: int, stop: int, recompute: bool) -> None:
        segments.append(Segment(start, stop, recompute, first=names[start], last=names[stop - 1]))

    i = 0
    for unit in checkpointed_units(plan, captured):
        if i < unit.start:
            add(i, unit.start, False)
        add(unit.start, unit.stop, True)
        i = unit.stop
    if i < len(names):
        add(i, len(names), False)
    return Plan(
        segments,
        budget_bytes=plan.budget_bytes,
        naive_peak_bytes=plan.naive_peak_bytes,
        naive_flops=plan.naive_flops,
        meta=dict(plan.meta, granularity=MODULE),
    )


class ModuleCallExecutor:
    """Runs a module-granularity plan: each checkpointed unit (`checkpointed_units`: a whole
    recorded call, or a run of an nn.Sequential's children) runs through
    `torch.utils.checkpoint`, by patching the `forward` of the modules involved for the
    duration of one forward pass (the recompute in backward runs the original code)."""

    def __init__(self, captured: CapturedGraph, plan: Plan, module: nn.Module):
        self.captured = captured
        self.plan = plan
        self.returned: list[tuple[str, weakref.ref]] = []  # outputs are not tracked (`Executor`)
        self.module = module
        self._context_fn = checkpoint_context_fn(module)
        self.units = checkpointed_units(plan, captured)
        self.checkpointed = {u.key for u in self.units if u.children is None}
        self._random = {  # NOTE [ Random state of recomputed segments ]
            (u.key, u.children): draws_random(captured, u.start, u.stop) for u in self.units
        }
        # NOTE [ Buffers a recomputed forward writes ] in hbp.runtime.recompute
        names = [n.name for n in captured.graph.nodes]
        self._written = {
            (u.key, u.children): buffer_owners(
                module,
                [
                    t
                    for i in range(u.start, u.stop)
                    for t in captured.mutated_attrs.get(names[i], ())
                ],
            )
            for u in self.units
        }
        self.runs: dict[tuple[str, int], dict[int, int]] = {}  # Sequential call -> {i: j}
        for u in self.units:
            if u.children is not None:
                self.runs.setdefault(u.key, {})[u.children[0]] = u.children[1]
        paths = {path for path, _ in (*self.checkpointed, *self.runs)}
        self._modules = {path: module.get_submodule(path) for path in sorted(paths)}
        # NOTE [ Calls the captured step did not make ]
        self.recorded = set(captured.module_calls)
        self.unplanned: list[str] = []  # this step's calls outside `recorded`, in order
        seen = {id(m) for m in self._modules.values()}
        expanded = {  # the ancestors of recorded calls: their children are recorded instead
            ".".join(parts[:k])
            for path, _ in self.recorded
            for parts in [path.split(".")]
            for k in range(len(parts))
        }
        for parent in sorted({path.rpartition(".")[0] for path, _ in self.recorded}):
            owner = module.get_submodule(parent) if parent else module
            for name, child in owner.named_children():
                path = f"{parent}.{name}" if parent else name
                if path not in expanded and id(child) not in seen:
                    seen.add(id(child))
                    self._modules[path] = child

    def __call__(self, *args, **kwargs) -> Any:
        counts: dict[str, int] = {}
        self.unplanned = []
        patched = []
        for path, mod in self._modules.items():
            had_own = "forward" in mod.__dict__
            original = mod.forward
            mod.forward = self._patched(path, mod, original, counts)
            patched.append((mod, had_own, original))
        try:
            with autocast_cache_disabled():  # plain calls too: see autocast_cache_disabled
                return self.module(*args, **kwargs)
        finally:
            for mod, had_own, original in patched:
                if had_own:
                    mod.forward = original
                else:
                    del mod.forward

    def _checkpoint(self, unit: tuple, fn: Callable, *args, **kwargs) -> Any:
        # Flat tensors in (see PlanExecutor._run_level): checkpoint would hold containers and
        # keyword arguments by strong reference until the call's backward.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        del args, kwargs
        written = self._written[unit]
        context_fn = self._context_fn
        if written:  # NOTE [ Buffers a recomputed forward writes ] in hbp.runtime.recompute

            def context_fn():
                forward_ctx, recompute_ctx = self._context_fn()
                before: list = []
                return stacked(forward_ctx, buffers_kept(written, before)), ReenterableContext(
                    lambda: stacked(recompute_ctx, throwaway_attrs(written, before))
                )

        with autocast_cache_disabled():
            return checkpoint(
                FlatCall(fn, spec),
                *leaves,
                use_reentrant=False,
                preserve_rng_state=self._random[unit],
                context_fn=context_fn,
            )

    def _patched(
        self, path: str, mod: nn.Module, original: Callable, counts: dict[str, int]
    ) -> Callable:
        def forward(*args, **kwargs):
            occurrence = counts.get(path, 0)
            counts[path] = occurrence + 1
            key = (path, occurrence)
            if key in self.checkpointed:
                return self._checkpoint((key, None), original, *args, **kwargs)
            if key in self.runs:
                return self._run_sequential(key, list(mod), self.runs[key], *args)
            if key not in self.recorded:
                self.unplanned.append(path)
            return original(*args, **kwargs)

        return forward

    def _run_sequential(
        self, key: tuple[str, int], children: list[nn.Module], runs: dict[int, int], x: Any
    ) -> Any:
        """nn.Sequential.forward with the runs i..j-1 in `runs` checkpointed as one function."""
        k = 0
        while k < len(children):
            j = runs.get(k)
            if j is None:
                x = children[k](x)
                k += 1
            else:
                x = self._checkpoint((key, (k, j)), _Chain(children[k:j]), x)
                k = j
        return x


# NOTE [ Calls the captured step did not make ]
# The module-level plan is made from the child calls of the captured step. A forward that calls
# other children from step to step (a LayerDrop drawn with `torch.rand` and an `if`: HuBERT and
# wav2vec2 train with one by default; a data-dependent branch) makes, on a later step, calls
# the plan never saw, which run plainly, outside it: a HuBERT whose captured step dropped two
# layers measured 1.31x its budget on the steps that kept them, silently. The executor watches
# the children of every parent of a recorded call (the siblings a skipped layer is among) and
# lists, per step, the calls outside the recorded ones (`unplanned`); HCModule warns once
# (`BudgetWarning`) with their paths.


class _Chain:
    """Calls modules one after the other, as nn.Sequential does."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def __call__(self, x: Any) -> Any:
        for m in self.modules:
            x = m(x)
        return x
