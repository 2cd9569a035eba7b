"""Run an explicit schedule (`Plan.schedule`) on a captured module.

A plan of segments runs through checkpoints; a schedule (NOTE [ Explicit schedules ] in
`hbp.planner.schedules`) recomputes values at the start of chosen backward stages, which
checkpoints cannot express. `ScheduleExecutor` runs it on autograd's own graph:

- the forward runs the captured fx graph node by node, once, under `saved_tensors_hooks`: what
  a node saves for its backward is kept when that node's backward uses this run's tensors, and
  replaced by a handle when a later run of the node (a recomputation) packs them instead;
- each node whose backward starts a stage gets a pre-hook on its output's `grad_fn`. When the
  engine reaches it, the executor runs the stage's steps (`Schedule.steps`, the accounting the
  plan's prediction comes from): it lets go of what the stage no longer holds, recomputes the
  stage's values in order (with grad where the run packs for a backward, its saved tensors
  collected by position, as non-reentrant checkpoint matches them), and frees each value
  after its last use;
- the handles unpack to the recomputed tensors.

Gradients are autograd's own: the backward graph is the forward's, so parameter and input
gradients, hooks and accumulation are those of the plain module. Autograd runs the ready node
created last first, which on a graph recorded in topological order is the programme's reverse
order of stages. Recomputations replay the random state of ops that draw random numbers and
leave norm statistics and updated buffers untouched (`hbp.runtime.recompute`). The executor
refuses captures that mutate inputs in place (a recomputation would read the mutated value).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from hbp.graph.torch.capture import MODES, CapturedGraph, enter_modes, exit_modes
from hbp.planner.plan import Plan
from hbp.planner.schedule_model import Schedule, StageSteps, recomputations
from hbp.runtime.recompute import (
    autocast_cache_disabled,
    buffer_owners,
    frozen_running_stats,
    getattr_path,
    stat_tracking_norms,
    throwaway_attrs,
)

_RUNNING = threading.local()  # .node: IR index of the node whose op runs now


class _Handle(NamedTuple):
    """What a forward pack leaves in autograd's graph when a recomputation packs instead."""

    node: int
    position: int


class _RandomState(NamedTuple):
    """The generators' states before a node that draws random numbers ran in the forward."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor]

    @classmethod
    def now(cls) -> _RandomState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return cls(torch.get_rng_state(), cuda)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        devices = list(range(len(self.cuda)))
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(devices, self.cuda):
                torch.cuda.set_rng_state(state, device)
            yield


class ScheduleExecutor:
    """Runs `plan` (an explicit schedule) on `captured` (op granularity); call it like the
    module: `executor(*args, **kwargs)` returns the module's outputs."""

    def __init__(self, captured: CapturedGraph, plan: Plan, module: nn.Module):
        if captured.gm is None:
            raise ValueError("ScheduleExecutor needs an op-level capture")
        if captured.mutated_inputs:
            raise ValueError(
                "an explicit schedule cannot run on a graph that mutates values in place "
                f"({', '.join(sorted(captured.mutated_inputs)[:3])}): plan without schedules"
            )
        self.captured, self.plan, self.gm = captured, plan, captured.gm
        self.returned: list[tuple[str, weakref.ref]] = []  # outputs are not tracked (`Executor`)
        graph, self.schedule = captured.graph, Schedule(captured.graph, forward_recompute=False)
        sch = self.schedule
        steps = sch.steps(recomputations(sch, plan))
        if steps is None:
            raise ValueError("the plan's schedule misses a value it needs")
        self.steps: list[StageSteps] = steps
        info = sch.info
        #: IR nodes of each forward value: its storage root, then its views, in order
        self.members: list[list[int]] = [[] for _ in range(sch.N)]
        self._col = {j: k for k, j in enumerate(sch.nodes)}
        for m in range(info.n):
            if not info.is_input[m] and int(info.root[m]) in self._col:
                self.members[self._col[int(info.root[m])]].append(m)
        self.first_backward = sch.N  # stages [0, N) are the forward's
        #: nodes whose backward uses a recomputation's pack (the forward's run packs for the
        #: others)
        self.repacked = {j for stage in steps[sch.N :] for op in stage.ops for j in op.packs}
        self.held_from_forward = set(steps[sch.N].held) if len(steps) > sch.N else set()
        self.stage_of = sch.stage_of
        self.random = {i for i, node in enumerate(graph.nodes) if node.draws_random}
        self.norms = stat_tracking_norms(module)
        self.updated_attrs = buffer_owners(
            self.gm, [t for targets in captured.mutated_attrs.values() for t in targets]
        )
        self._fx_nodes = list(self.gm.graph.nodes)
        self._ir = {n: i for i, n in enumerate(captured.fx_nodes)}
        self._last_reader: dict[fx.Node, int] = {}
        for pos, node in enumerate(self._fx_nodes):
            for src in node.all_input_nodes:
                self._last_reader[src] = pos

    # -- the forward --------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> Any:
        values = self.captured.placeholder_values(args, kwargs)
        del args, kwargs
        grad = torch.is_grad_enabled()
        step = _Step(self)
        env: dict[fx.Node, Any] = {}
        placeholders = iter(values)
        del values
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack)
            if grad
            else contextlib.nullcontext()
        )
        with autocast_cache_disabled(), hooks:
            for pos, node in enumerate(self._fx_nodes):
                j = self._ir.get(node)
                if node.op == "get_attr":
                    env[node] = getattr_path(self.gm, node.target)
                elif node.op == "output":
                    flat = fx.node.map_arg(node.args[0], env.__getitem__)
                else:
                    if node.op == "placeholder":
                        env[node] = next(placeholders)
                    else:
                        if j in self.random:
                            step.random[j] = _RandomState.now()
                        env[node] = self.run_node(node, env, j)
                    if grad and j is not None:
                        step.forward_ran(j, env[node])
                for src in node.all_input_nodes:
                    i = self._ir.get(src)
                    if i is not None and self._last_reader[src] == pos:
                        value = env.pop(src)
                        if grad and self.held_into_backward(i):
                            step.env[i] = _detached(value)
                        del value
        step.constants = {
            n: v for n, v in env.items() if n.op not in ("get_attr", "output") and n not in self._ir
        }
        return self.captured.unflatten_output(flat)

    def held_into_backward(self, j: int) -> bool:
        """Whether IR node j's value is held from the forward into the backward: what the
        schedule holds, graph outputs (they live for the whole step) and views of graph
        inputs (they cost nothing)."""
        k = self.value_of(j)
        return k is None or k in self.held_from_forward or bool(self.schedule.is_out[k])

    def value_of(self, j: int) -> int | None:
        """The programme's forward value of IR node j (None for graph inputs and their
        views)."""
        return self._col.get(int(self.schedule.info.root[j]))

    def run_node(self, node: fx.Node, env: dict, j: int | None) -> Any:
        """Run one fx node on `env`'s values, in the modes the forward recorded for it."""
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        modes = node.meta.get(MODES)
        stack = enter_modes(modes) if modes else None
        previous = getattr(_RUNNING, "node", None)
        _RUNNING.node = j
        try:
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return self.gm.get_submodule(node.target)(*args, **kwargs)
        finally:
            _RUNNING.node = previous
            if stack is not None:
                exit_modes(stack)

    def describe(self) -> str:
        lines = [f"ScheduleExecutor: {len(self.plan.schedule)} recomputing stages"]
        names = self.captured.graph.names
        for stage in self.plan.schedule:
            values = ", ".join(names[v] for v in stage.values)
            lines.append(f"  before the backward of {names[stage.node]}: recompute {values}")
        return "\n".join(lines)


class _Step:
    """One forward and its backward: what the schedule holds, the packs, the stages run."""

    def __init__(self, executor: ScheduleExecutor):
        self.ex = executor
        self.env: dict[int, Any] = {}  # IR index -> value held for the backward
        self.packs: dict[int, list[torch.Tensor]] = {}
        self.random: dict[int, _RandomState] = {}
        self.requires_grad: set[int] = set()
        self.constants: dict[fx.Node, Any] = {}
        self.next_stage = executor.first_backward
        self._positions: dict[int, itertools.count] = {}
        # NOTE [ Buffers a recomputed forward writes ] in hbp.runtime.recompute: what the
        # buffers the forward writes held before it, for the recomputations to start from
        self.buffers_before = [
            getattr(m, name).detach().clone() for m, name in executor.updated_attrs
        ]

    # -- the forward's packs -----------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        j = getattr(_RUNNING, "node", None)
        if j is None or j not in self.ex.repacked:
            return tensor.detach()
        position = next(self._positions.setdefault(j, itertools.count()))
        return _Handle(j, position)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        tensors = self.packs.get(packed.node)
        if tensors is None or packed.position >= len(tensors):
            name = self.ex.captured.graph.names[packed.node]
            raise RuntimeError(
                f"hbp: the schedule's recomputation of {name!r} did not save what its forward "
                f"saved (tensor {packed.position}); was the step run twice through the graph?"
            )
        return tensors[packed.position]

    def forward_ran(self, j: int, out: Any) -> None:
        """Note whether IR node j's output needs grad (its recomputations must save what it
        saved), and hook its backward if that starts a stage. The graph holds the hook, the
        hook the step: both live until the backward (the step holds no graph)."""
        tensor = _first_tensor(out)
        if tensor is None or not tensor.requires_grad:
            return
        self.requires_grad.add(j)
        stage = self.ex.stage_of.get(j)
        if stage is not None and tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(functools.partial(_run_until, self, stage))

    # -- the backward's stages ---------------------------------------------------------------

    def run_until(self, stage: int) -> None:
        """Run the steps of every stage up to `stage` not run yet."""
        while self.next_stage <= stage:
            t = self.next_stage
            self.next_stage += 1
            self._run_stage(t)

    def _run_stage(self, t: int) -> None:
        ex, steps = self.ex, self.ex.steps[t]
        held = set(steps.held)
        for j in list(self.env):
            k = ex.value_of(j)
            if k is not None and k not in held:
                del self.env[j]
        for j in list(self.packs):
            if ex.stage_of[j] < t:  # its backward has run
                del self.packs[j]
        for op in steps.ops:
            self._compute(op.value, op.packs)
            for v in op.frees:
                for m in ex.members[v]:
                    self.env.pop(m, None)

    def _compute(self, k: int, packs: tuple[int, ...]) -> None:
        """Recompute forward value k (its root and views), packing for `packs`' backwards."""
        ex = self.ex
        fx_nodes = ex.captured.fx_nodes
        env: dict[fx.Node, Any] = dict(self.constants)
        env.update((fx_nodes[j], value) for j, value in self.env.items())
        collected: dict[int, list[torch.Tensor]] = {j: [] for j in packs}
        previous = {j: self.env[j] for j in ex.members[k] if j in self.env}

        def collect(tensor: torch.Tensor) -> None:
            j = getattr(_RUNNING, "node", None)
            if j in collected:
                collected[j].append(tensor.detach())

        recompute = contextlib.ExitStack()
        recompute.enter_context(frozen_running_stats(ex.norms))
        recompute.enter_context(throwaway_attrs(ex.updated_attrs, self.buffers_before))
        recompute.enter_context(autocast_cache_disabled())
        if packs:
            recompute.enter_context(torch.enable_grad())
            recompute.enter_context(torch.autograd.graph.saved_tensors_hooks(collect, _no_unpack))
        else:
            recompute.enter_context(torch.no_grad())
        with recompute:
            for j in ex.members[k]:
                node = fx_nodes[j]
                for src in node.all_input_nodes:  # looked up now: buffers may be throw-away
                    if src.op == "get_attr":
                        env[src] = getattr_path(ex.gm, src.target)
                if packs:
                    for src in node.all_input_nodes:
                        i = ex._ir.get(src)
                        if i is not None and isinstance(env[src], torch.Tensor):
                            env[src] = env[src].detach().requires_grad_(i in self.requires_grad)
                random = self.random.get(j)
                with random.replayed() if random is not None else contextlib.nullcontext():
                    out = ex.run_node(node, env, j)
                env[node] = out
                if not ex.schedule.is_out[k]:  # a graph output's copy only packs
                    self.env[j] = _detached(out)
        # NOTE [ Recomputing a value still held ]
        for j in ex.members[k]:
            held = previous.get(j)
            if isinstance(held, torch.Tensor) and j in self.env:
                made = self.env[j].untyped_storage().data_ptr()
                self.env[j] = held
                for tensors in collected.values():
                    tensors[:] = [_onto(t, made, held) for t in tensors]
        self.packs.update(collected)


def _run_until(step: _Step, stage: int, grads: Any) -> None:
    """A `grad_fn` pre-hook: the stages up to `stage` run before the node's backward."""
    step.run_until(stage)


def _no_unpack(_: Any) -> None:
    raise RuntimeError("hbp: a recomputation's own graph is never run backward")


# NOTE [ Recomputing a value still held ]
# A schedule may run a node again while its value is still in memory, to make the node's
# pack again (what its backward saves) after the last one was let go. The run makes a second
# copy of the value; the programme counts both while the stage runs and one after it. If the
# old copy were dropped for the new one, a pack that saved the old copy (another node's,
# kept since its run) would still hold it, and both copies would live on. So the held copy
# stays: the new pack's tensors that are the new copy (or views of it) are remade as views of
# the held one, and the new copy dies with the stage's computation. A recomputation is the
# forward's computation again, so both copies hold the same values.


def _onto(tensor: torch.Tensor, storage: int, held: torch.Tensor) -> torch.Tensor:
    """`tensor` as a view of `held` if it lives in the storage at address `storage`."""
    if tensor.untyped_storage().data_ptr() != storage:
        return tensor
    return held.as_strided(tensor.size(), tensor.stride(), tensor.storage_offset())


def _first_tensor(value: Any) -> torch.Tensor | None:
    return next((v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)), None)


def _detached(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, value)
