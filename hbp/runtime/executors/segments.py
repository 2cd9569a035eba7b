"""Run a `Plan` on a captured module: keep what the plan keeps, recompute the rest.

`PlanExecutor` (op granularity) splits the captured fx graph at the plan's segment boundaries.
Every leaf segment becomes generated `torch.fx.GraphModule` code (plain Python calling the
module's own submodules and functions: eager speed, no per-op interpreter); a segment with
children becomes a small runner over its children's blocks. A segment with `recompute=True`
runs through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=..., context_fn=...)`: its forward keeps only its inputs and outputs, its
backward first re-runs it (with its own nested plan: non-reentrant checkpoints nest), with the
RNG state replayed (same dropout masks; only for segments that draw random numbers, NOTE
[ Random state of recomputed segments ]) and running statistics frozen (BatchNorm updated
once, `hbp.runtime.recompute`). Plain segments run directly. A recomputed segment (at any
depth) that pins nodes runs with torch's selective-checkpoint contexts (NOTE [ Running pinned
values ]).

Memory discipline (otherwise Python references keep activations alive and the saving is lost):
- a value is dropped from the executor's environment as soon as the last block that reads it
  has been handed it; a segment receives its inputs in a list that it empties on entry, and
  the generated code frees every value right after its last use;
- a segment returns only the values that are read later *in the current pass*: all later
  readers in the forward, but during the recompute of a segment [a, b) only readers before b
  (the recompute pass needs nothing after its segment), so recomputed boundary values die as
  soon as the recompute has used them, as in `hbp.analysis.simulate`.

In-place ops: a recomputed segment that mutates one of its inputs in place would recompute from
the already-mutated value; such an input is cloned on entry to the segment (inside the
checkpoint, so the recompute clones the original again) and the clone replaces the input for
later readers (capture already makes most in-place ops out-of-place, so this is rare). Buffers
other than norm statistics that a recomputed segment updates in place are swapped for
throw-away copies during the recompute, like norm statistics.

Modes: a node the forward ran under `torch.no_grad()` or `torch.autocast(...)` (recorded by the
capture, `MODES`) runs in those modes in the generated code, so a cut inside such a region
changes nothing. Recomputed segments run with autocast's weight-cast cache off (see
`autocast_cache_disabled`).
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

from hbp.graph.torch.capture import CapturedGraph
from hbp.graph.torch.modes import MODES, enter_modes, exit_modes, modes_closed_after
from hbp.graph.torch.running_stats import NORM_STATISTICS
from hbp.planner.plan import Plan, Segment
from hbp.runtime.executors.checkpointing import FlatCall, draws_random
from hbp.runtime.executors.compiled import compiled_leaf_call
from hbp.runtime.executors.pins import (
    PinParent,
    nested_pin_contexts,
    parent_frame,
    pin_begin,
    pin_contexts,
    pin_end,
    pin_mark,
    pin_policy,
)
from hbp.runtime.recompute import (
    ReenterableContext,
    autocast_cache_disabled,
    buffer_owners,
    buffers_kept,
    checkpoint_context_fn,
    getattr_path,
    stacked,
    throwaway_attrs,
)

_PASS = threading.local()


def _pass_end() -> float:
    """End (exclusive node index) of the recompute pass running now; inf in the forward."""
    stack = getattr(_PASS, "ends", None)
    return stack[-1] if stack else math.inf


@contextlib.contextmanager
def _recompute_pass(stop: int) -> Iterator[None]:
    if not hasattr(_PASS, "ends"):
        _PASS.ends = []
    _PASS.ends.append(stop)
    try:
        yield
    finally:
        _PASS.ends.pop()


def _take_all(inputs: list) -> tuple:
    """Move a segment's inputs out of the list its caller passed (so only the segment's own
    locals reference them and the generated code can free each after its last use)."""
    values = tuple(inputs)
    inputs.clear()
    return values


@dataclass
class _Block:
    """One segment, compiled.

    inputs: values (fx nodes) it reads that are produced before it (graph inputs included).
    outputs: values it produces (or rebinds, see `cloned`) read at or after `stop`, with the
        index of their first such reader (`first_reader`).
    release: inputs no later block of the same level reads.
    call: fn(values: list, outputs: tuple of nodes) -> tuple of those outputs' values;
        empties `values`.
    cloned: positions in `inputs` of values the segment mutates in place (recompute only).
    """

    start: int
    stop: int
    recompute: bool
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    first_reader: dict[fx.Node, int]
    call: Callable[[list, tuple], tuple]
    cloned: tuple[int, ...] = ()
    frozen_attrs: list[tuple[nn.Module, str]] = field(default_factory=list)
    release: list[fx.Node] = field(default_factory=list)
    context_fn: Callable | None = None
    pin_key: tuple[int, int, int] | None = None  # its key, if it pins (NOTE [ Running pinned
    # values ])
    draws_random: bool = False  # a node in [start, stop) does: its recompute replays the RNG

    def outputs_before(self, end: float) -> tuple[fx.Node, ...]:
        """The outputs some node before `end` reads (all of them in the forward)."""
        return tuple(o for o in self.outputs if self.first_reader[o] < end)


class PlanExecutor:
    """Runs `plan` on `captured` (op granularity); call it like the module:
    `executor(*args, **kwargs)` returns the module's outputs.

    `node_hook(name)`, if given, is called right after each IR node has run, in the forward
    and in every recompute (for tests and memory timelines; it must not keep tensors)."""

    def __init__(
        self,
        captured: CapturedGraph,
        plan: Plan,
        module: nn.Module,
        node_hook: Callable[[str], None] | None = None,
        compile_options: dict | None = None,
    ):
        if captured.gm is None:
            raise ValueError("PlanExecutor needs an op-level capture; use ModuleCallExecutor")
        self.captured = captured
        self.plan = plan
        self.gm = captured.gm
        self.node_hook = node_hook
        self.compile_options = compile_options  # None: eager; else torch.compile(**options)
        self._norm_context_fn = checkpoint_context_fn(module)
        self._placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self._output = next(n for n in self.gm.graph.nodes if n.op == "output")
        n_ir = len(captured.fx_nodes)
        self._index = {
            n: (-1 if n.op == "placeholder" else i) for i, n in enumerate(captured.fx_nodes)
        }
        self._readers: dict[fx.Node, list[int]] = {n: [] for n in captured.fx_nodes}
        for node in captured.fx_nodes:
            for src in node.all_input_nodes:
                if src in self._readers:
                    self._readers[src].append(captured.ir_index(node))
        for src in self._output.all_input_nodes:
            if src in self._readers:
                self._readers[src].append(n_ir)
        self._graph_outputs = {n for n in self._output.all_input_nodes if n.op != "get_attr"}
        self._output_names = {n: captured.ir_node(n).name for n in self._graph_outputs}
        #: (IR output name, weak reference to the tensor) of the last call's graph outputs:
        #: which of them the caller still holds later (NOTE [ Outputs the caller lets go ]).
        self.returned: list[tuple[str, weakref.ref]] = []
        self._updated_attrs = {t for ts in captured.mutated_attrs.values() for t in ts}
        # Generated code reaches attributes through `root` (the traced module), so swapping an
        # attribute there (frozen buffers) is seen by every generated segment.
        self._holder = nn.Module()
        self._holder.root = self.gm
        # NOTE [ Running pinned values ]: IR index of a pinned node -> its segment's key
        # (start, stop, depth) (compiled segments run without pins: their ops are not
        # dispatched one by one)
        self._pins: dict[int, tuple[int, int, int]] = {}
        if compile_options is None:  # NOTE [ Buffers a recomputed forward writes ]
            self._collect_pins(plan.segments, 0, self._mutated_roots() | self._writes_state())
        self.blocks = self._compile_level(plan.segments)

    # -- running ----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> Any:
        env = dict(zip(self._placeholders, self.captured.placeholder_values(args, kwargs)))
        del args, kwargs
        with autocast_cache_disabled():  # plain blocks too: see autocast_cache_disabled
            self._run_level(self.blocks, env, self._graph_outputs)
        flat = fx.node.map_arg(self._output.args[0], lambda n: self._lookup(env, n))
        self.returned = [
            (self._output_names[n], weakref.ref(env[n]))
            for n in self._graph_outputs
            if isinstance(env[n], torch.Tensor)
        ]
        return self.captured.unflatten_output(flat)

    def _lookup(self, env: dict, node: fx.Node) -> Any:
        if node.op == "get_attr":
            return getattr_path(self.gm, node.target)
        return env[node]

    def _run_level(self, blocks: list[_Block], env: dict, needed: set[fx.Node]) -> None:
        """Run `blocks` (one level of the plan) on `env`, keeping in `env` the values of
        `needed` and dropping every other value once no later block of the level reads it."""
        end = _pass_end()
        for block in blocks:
            args = [env[n] for n in block.inputs]
            for n in block.release:
                if n not in needed:
                    env.pop(n, None)
            outputs = block.outputs_before(end)
            if block.recompute:
                # checkpoint() routes only tensor arguments through its saved-tensor hooks;
                # a container argument (the tuple of `chunk`) would be held by a strong
                # reference until the segment's backward, keeping its tensors alive. So the
                # inputs go in as flat tensors and are rebuilt inside.
                leaves, spec = pytree.tree_flatten((args, {}))
                del args
                with autocast_cache_disabled():
                    outs = checkpoint(
                        FlatCall(_Checkpointed(block), spec),
                        *leaves,
                        use_reentrant=False,
                        preserve_rng_state=block.draws_random,
                        context_fn=block.context_fn,
                    )
                del leaves
            else:
                outs = block.call(args, outputs)
                del args
            env.update(zip(outputs, outs))
            del outs

    # -- compiling --------------------------------------------------------------------------

    def _collect_pins(self, segments: list[Segment], depth: int, mutated: set[str]) -> None:
        for seg in segments:
            if seg.recompute:
                for p in seg.pinned:
                    if self.captured.graph.nodes[p].name not in mutated:
                        self._pins[p] = (seg.start, seg.stop, depth)
            self._collect_pins(seg.children, depth + 1, mutated)

    def _compile_level(self, segments: list[Segment], depth: int = 0) -> list[_Block]:
        blocks = [b for b in (self._compile_segment(s, depth) for s in segments) if b is not None]
        later_reads: set[fx.Node] = set()
        for block in reversed(blocks):
            block.release = [n for n in block.inputs if n not in later_reads]
            later_reads.update(block.inputs)
        return blocks

    def _compile_segment(self, seg: Segment, depth: int) -> _Block | None:
        a, b = seg.start, seg.stop
        nodes = [n for n in self.captured.fx_nodes[a:b] if n.op != "placeholder"]
        if not nodes:
            return None
        inputs: list[fx.Node] = []
        for node in nodes:
            for src in node.all_input_nodes:
                if src.op != "get_attr" and self._index[src] < a and src not in inputs:
                    inputs.append(src)
        cloned = self._mutated_inputs(nodes, inputs, a) if seg.recompute else ()
        first_reader = {}
        for n in [*nodes, *(inputs[i] for i in cloned)]:
            later = [r for r in self._readers[n] if r >= b]
            if later:
                first_reader[n] = min(later)
        outputs = list(first_reader)
        if seg.children:
            children = self._compile_level(seg.children, depth + 1)
            call = _NestedCall(self, children, inputs)
            frozen = [pair for c in children for pair in c.frozen_attrs]
        else:
            call = LeafCall(self, nodes, inputs)
            frozen = self._frozen_attrs(nodes)
        block = _Block(a, b, seg.recompute, inputs, outputs, first_reader, call, cloned, frozen)
        if seg.recompute:
            key = (a, b, depth)
            pinned = any(self._pins.get(i) == key for i in range(a, b))
            # a parent of pinning children marks its frames for them (NOTE [ Running pinned
            # values ])
            parent = any(c.pin_key is not None for c in children) if seg.children else False
            block.pin_key = key if pinned else None
            block.context_fn = self._context_fn(block, depth, pinned, parent)
            block.draws_random = draws_random(self.captured, a, b)
        return block

    def _writes_state(self) -> set[str]:
        """Names of the nodes that write buffers other than norm statistics, or tensors they
        made themselves (not pinned: NOTE [ Buffers a recomputed forward writes ]; an exported
        `aten.batch_norm`, which writes its running statistics, may be: nothing it cached is
        written afterwards)."""
        return {
            name
            for name, targets in self.captured.mutated_attrs.items()
            if any(t.rpartition(".")[2] not in NORM_STATISTICS for t in targets)
        } | set(self.captured.writes_own_intermediates)

    def _mutated_roots(self) -> set[str]:
        """Names of the storage roots of every value some node mutates in place (a pin on one
        is dropped: NOTE [ Running pinned values ])."""
        graph = self.captured.graph
        roots = set()
        for names in self.captured.mutated_inputs.values():
            for name in names:
                while graph.node(name).alias_of:
                    name = graph.node(name).alias_of
                roots.add(name)
        return roots

    def _mutated_inputs(
        self, nodes: list[fx.Node], inputs: list[fx.Node], a: int
    ) -> tuple[int, ...]:
        """Positions in `inputs` of the values the segment starting at `a` mutates in place
        (through any chain of views made inside the segment)."""
        graph = self.captured.graph
        hit: list[int] = []
        for node in nodes:
            for name in self.captured.mutated_inputs.get(node.name, ()):
                src = self.captured.fx_node(name)
                while self._index[src] >= a and graph.node(src.name).alias_of:
                    src = self.captured.fx_node(graph.node(src.name).alias_of)
                if self._index[src] < a and src in inputs:
                    pos = inputs.index(src)
                    if pos not in hit:
                        hit.append(pos)
                        self._check_no_other_alias(src, a)
        return tuple(hit)

    def _check_no_other_alias(self, value: fx.Node, a: int) -> None:
        """Cloning `value` is only exact if no other view of its storage made before the
        segment is read from the segment on."""
        graph = self.captured.graph

        def root(node: fx.Node) -> str:
            name = node.name
            while graph.node(name).alias_of:
                name = graph.node(name).alias_of
            return name

        base = root(value)
        for other in self.captured.fx_nodes:
            if other is value or self._index[other] >= a or root(other) != base:
                continue
            if any(r >= a for r in self._readers[other]):
                raise NotImplementedError(
                    f"a recomputed segment starting at node {a} mutates {value.name!r} in place "
                    f"while {other.name!r}, a view of the same storage, is read later; hbp cannot "
                    "recompute this exactly. Make the in-place op out-of-place."
                )

    def _frozen_attrs(self, nodes: list[fx.Node]) -> list[tuple[nn.Module, str]]:
        """(owner module, attribute) of every buffer the segment updates in place, except norm
        statistics (guarded by `checkpoint_context_fn`)."""
        updated = self.captured.mutated_attrs
        return buffer_owners(self.gm, [t for n in nodes for t in updated.get(n.name, ())])

    def _context_fn(
        self, block: _Block, depth: int, pinned: bool = False, parent: bool = False
    ) -> Callable:
        norm_context_fn = self._norm_context_fn
        frozen, stop, key = block.frozen_attrs, block.stop, block.pin_key

        def context_fn():
            forward_ctx, recompute_ctx = norm_context_fn()
            # NOTE [ Running pinned values ]: one storage per checkpoint call
            caching = cached = contextlib.nullcontext()
            if pinned and depth == 0:
                caching, cached = pin_contexts(pin_policy(key))
            elif pinned:
                caching, cached = nested_pin_contexts(key)
            frame = PinParent() if parent else None
            before: list[torch.Tensor] = []  # NOTE [ Buffers a recomputed forward writes ]
            return stacked(
                forward_ctx,
                buffers_kept(frozen, before),
                caching,
                pin_mark(),
                parent_frame(frame, False),
            ), ReenterableContext(  # fmt: skip
                lambda: stacked(
                    recompute_ctx,
                    cached,
                    throwaway_attrs(frozen, before),
                    _recompute_pass(stop),
                    pin_mark(),
                    parent_frame(frame, True),
                )
            )

        return context_fn

    def segment_module(
        self, nodes: list[fx.Node], inputs: list[fx.Node], outputs
    ) -> fx.GraphModule:
        """Generated code for one leaf segment: forward(inputs: list) -> tuple(outputs)."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        values = graph.call_function(_take_all, (graph.placeholder("inputs"),))
        for i, node in enumerate(inputs):
            env[node] = graph.call_function(operator.getitem, (values, i))
        # A buffer some node updates in place is looked up on the traced module when the
        # segment runs, not copied into the segment at build time (what `get_attr` of a dotted
        # path does): the throw-away copy a recompute swaps in (`_throwaway_attrs`) must be the
        # one the segment updates. Everything else is a `get_attr`.
        root = None
        for node in nodes:
            for src in node.all_input_nodes:
                if src.op != "get_attr" or src in env:
                    continue
                if src.target in self._updated_attrs:
                    root = graph.get_attr("root") if root is None else root
                    env[src] = graph.call_function(getattr_path, (root, src.target))
                else:
                    env[src] = graph.get_attr("root." + src.target)
            modes = node.meta.get(MODES)  # e.g. inside a `with torch.no_grad():` of the forward
            if modes:
                stack = graph.call_function(enter_modes, (modes,))
            pin = self._pins.get(self._index[node])
            if pin is not None:  # NOTE [ Running pinned values ]
                graph.call_function(pin_begin, (pin,))
            copy = graph.node_copy(node, lambda n: env[n])
            if copy.op == "call_module":
                copy.target = "root." + copy.target
            if pin is not None:
                graph.call_function(pin_end, ())
            if modes:
                graph.call_function(exit_modes, (stack,))
            env[node] = copy
            if self.node_hook is not None:
                graph.call_function(self.node_hook, (node.name,))
        graph.output(tuple(env[n] for n in outputs))
        return fx.GraphModule(self._holder, graph, class_name="Segment")

    def describe(self) -> str:
        """One line per top-level block: node range, recompute flag, inputs and outputs."""
        lines = []
        for b in self.blocks:
            kind = "recompute" if b.recompute else "plain"
            lines.append(
                f"[{b.start:4d}, {b.stop:4d}) {kind:9s} in={len(b.inputs)} out={len(b.outputs)}"
            )
        return "\n".join(lines)


class _Checkpointed:
    """A recomputed block in checkpoint's calling convention: fn(*inputs) -> outputs. In the
    forward it returns what later readers need; in its own recompute pass nothing (the pass
    only regenerates saved tensors). Inputs it mutates in place are cloned first (inside the
    checkpoint, so the recompute clones the original again)."""

    def __init__(self, block: _Block):
        self.block = block

    def __call__(self, *args) -> tuple:
        values = list(args)
        del args
        for i in self.block.cloned:
            values[i] = values[i].clone()
        return self.block.call(values, self.block.outputs_before(_pass_end()))


# NOTE [ Calling the generated code ]
# A segment's generated code is an `fx.GraphModule`, called through its `forward`, not
# `__call__`: `GraphModule.__call__` wraps every call in a handler that, on any exception, walks
# the traceback to print the generated code when the error was raised there; each early stop
# of a recompute (torch raises inside a node to end the pass) paid that walk, a few hundred
# microseconds of host time per recomputed segment per step, which a GPU step cannot hide.
# `nn.Module.__call__` adds global module hooks, which would fire on hbp's internal modules
# as if they were the user's; the user's own submodules inside the code still run theirs.


class LeafCall:
    """A segment without children: generated code, one variant per set of returned values."""

    def __init__(self, executor: PlanExecutor, nodes: list[fx.Node], inputs: list[fx.Node]):
        self.executor = executor
        self.nodes = nodes
        self.inputs = inputs
        self.variants: dict[tuple, fx.GraphModule] = {}

    def __call__(self, values: list, outputs: tuple) -> tuple:
        options = self.executor.compile_options
        with modes_closed_after():  # NOTE [ Modes left open by an early stop ]
            if options is not None:
                return compiled_leaf_call(self.variants, self.build, options, values, outputs)
            module = self.variants.get(outputs)
            if module is None:
                module = self.variants[outputs] = self.build(outputs)
            return module.forward(values)  # NOTE [ Calling the generated code ]

    def build(self, outputs: tuple) -> fx.GraphModule:
        """The segment's generated code, returning `outputs`."""
        return self.executor.segment_module(self.nodes, self.inputs, outputs)


class _NestedCall:
    """A segment with children: runs its children blocks (checkpointing the recomputed ones)."""

    def __init__(self, executor: PlanExecutor, children: list[_Block], inputs: list[fx.Node]):
        self.executor = executor
        self.children = children
        self.inputs = inputs

    def __call__(self, values: list, outputs: tuple) -> tuple:
        env = dict(zip(self.inputs, values))
        values.clear()
        self.executor._run_level(self.children, env, set(outputs))
        return tuple(env[n] for n in outputs)
