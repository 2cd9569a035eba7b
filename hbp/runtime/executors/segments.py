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

`ModuleCallExecutor` (module granularity, the capture fallback) checkpoints what of the plan's
recomputed segments can be re-run on its own: whole child module calls, and runs of children
of an nn.Sequential (`checkpointed_units`), by patching `forward`s for one forward pass.
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
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hbp.graph.torch.capture import MODULE, CapturedGraph
from hbp.graph.torch.modes import MODES, enter_modes, exit_modes
from hbp.planner.plan import Plan, Segment
from hbp.runtime.executors.schedule import ScheduleExecutor
from hbp.runtime.recompute import (
    ReenterableContext,
    autocast_cache_disabled,
    buffer_owners,
    checkpoint_context_fn,
    getattr_path,
    throwaway_attrs,
)

_PASS = threading.local()
_PINNING = threading.local()  # .segment: the key of the segment whose pin runs now
_PARENTS = threading.local()  # .stack: the _PinParent frames running now, innermost last


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
        if compile_options is None:
            self._collect_pins(plan.segments, 0, self._mutated_roots())
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
                        _FlatCall(_Checkpointed(block), spec),
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
            call = _LeafCall(self, nodes, inputs)
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
                caching, cached = create_selective_checkpoint_contexts(_pin_policy(key))
            elif pinned:
                caching, cached = _nested_pin_contexts(key)
            frame = _PinParent() if parent else None
            return _stacked(
                forward_ctx, caching, _pin_mark(), _parent_frame(frame, False)
            ), ReenterableContext(
                lambda: _stacked(
                    recompute_ctx,
                    cached,
                    throwaway_attrs(frozen),
                    _recompute_pass(stop),
                    _pin_mark(),
                    _parent_frame(frame, True),
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
                graph.call_function(_pin_begin, (pin,))
            copy = graph.node_copy(node, lambda n: env[n])
            if copy.op == "call_module":
                copy.target = "root." + copy.target
            if pin is not None:
                graph.call_function(_pin_end, ())
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


# NOTE [ Running pinned values ]
# A recomputed segment that pins nodes (`Segment.pinned`, NOTE [ Pinned values ] in
# hbp/analysis/simulate.py) runs its checkpoint with `create_selective_checkpoint_contexts`:
# the caching mode asks a policy for every op the forward dispatches, and stores the outputs of
# those it answers MUST_SAVE; the recompute's cached mode answers the same ops, counted per op
# overload in dispatch order, from that storage. The generated code marks the pinned fx node
# while it runs (`_pin_begin(key)` / `_pin_end()` around it, key = (start, stop, depth) of the
# pinning segment, in the forward and in every recompute: plain Python, no dispatched op, so
# the counts match), and the segment's policy (`_pin_policy`) answers MUST_SAVE only for ops
# dispatched under its own mark (nested checkpoints and other segments' pins dispatch under the
# same mode stack) and whose outputs share no storage with their inputs (views, in-place
# results: storing them would keep the input's storage, not the node's). A recompute's early
# stop raises inside a node, between `_pin_begin` and `_pin_end`: every recompute context (and
# a pinning forward) restores the mark on exit (`_pin_mark`), else the next forward would pin
# every op. The storage is made per checkpoint call (context_fn), so a second backward of a
# retained graph finds the cache consumed (torch raises). A pin on a value some node later
# mutates in place (through any view) is dropped: torch refuses a stored tensor whose version
# changed, and recomputing it is always exact. Compiled segments (NOTE [ Compiled segments ])
# run without pins: their ops reach the dispatch modes as one compiled region; the plan then
# keeps less and recomputes more than it predicts.
# Nested pinning segments. Torch recomputes a nested segment C with the frame its checkpoint
# made in the original forward (its saved tensors are packed there), while its parent P's
# recompute pass calls C's checkpoint again, making a new frame whose saves nobody reads. So
# a top-level segment stores its pins in the forward, but a nested one must store them in the
# parent's pass and have them answered by the original frame: the parent's checkpoint calls
# push a `_PinParent` frame while their forward and their recompute run (`_parent_frame`);
# C's call in P's forward stores nothing (policy `_save_nothing`: every op is marked
# "recompute") and registers its cached mode with P's frame; C's call in P's recompute pass
# finds it and its caching mode writes into that same storage (`_nested_pin_contexts`),
# overwriting the pinned ops' entries with their values. Calls of C in an ancestor's pass
# (under a P frame made there) store nothing. A pass of P that stops before C runs leaves the
# storage as the forward made it: C's pass recomputes everything.


def _pin_begin(segment: tuple[int, int, int]) -> None:
    _PINNING.segment = segment


def _pin_end() -> None:
    _PINNING.segment = None


@contextlib.contextmanager
def _pin_mark() -> Iterator[None]:
    """Restore the pinning mark on exit, also when an early stop raised inside a pinned node."""
    before = getattr(_PINNING, "segment", None)
    try:
        yield
    finally:
        _PINNING.segment = before


def _pin_policy(segment: tuple[int, int, int]) -> Callable:
    """The selective-checkpoint policy of the pinning segment with key `segment`."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if getattr(_PINNING, "segment", None) != segment:
            return CheckpointPolicy.PREFER_RECOMPUTE
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(ctx.op_output):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in inputs:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def _save_nothing(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


class _PinParent:
    """One checkpoint call of a segment with pinning children: their key -> (a weak reference
    to) the cached mode of the child's checkpoint made in this call's forward."""

    def __init__(self):
        self.children: dict[tuple[int, int, int], weakref.ref] = {}


@contextlib.contextmanager
def _parent_frame(frame: _PinParent | None, recompute: bool) -> Iterator[None]:
    """While a pinning child's parent runs (its forward, or its recompute pass: `recompute`),
    the child's checkpoint calls find the parent's frame here."""
    if frame is None:
        yield
        return
    if not hasattr(_PARENTS, "stack"):
        _PARENTS.stack = []
    _PARENTS.stack.append((frame, recompute))
    try:
        yield
    finally:
        _PARENTS.stack.pop()


def _nested_pin_contexts(key: tuple[int, int, int]) -> tuple:
    """The selective-checkpoint contexts of a nested pinning segment's checkpoint call.

    Called in its parent's forward (the original one, or inside a recompute pass of an
    ancestor): stores nothing, and registers its cached mode with the parent's frame. Called in
    its parent's recompute pass: stores the pins into the storage of the call made in that
    parent frame's forward, whose cached mode answers them in the segment's own recompute pass
    (if that call's frame is gone, the segment saves nothing: nothing is stored)."""
    frame, recompute = _PARENTS.stack[-1]
    if not recompute:
        caching, cached = create_selective_checkpoint_contexts(_save_nothing)
        frame.children[key] = weakref.ref(cached)
        return caching, cached
    ref = frame.children.get(key)
    target = ref() if ref is not None else None
    if target is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    caching, _ = create_selective_checkpoint_contexts(_pin_policy(key))
    if not hasattr(caching, "storage") or not hasattr(target, "storage"):
        raise RuntimeError(  # pragma: no cover - torch internals changed
            "hbp: torch's selective-checkpoint modes no longer keep a `storage` attribute; "
            "nested pinned segments cannot run (plan with pins only at the top level)"
        )
    caching.storage = target.storage  # this pass's values go to the frame that answers them
    return caching, contextlib.nullcontext()


class _FlatCall:
    """Calls `fn(*args, **kwargs)` with (args, kwargs) rebuilt from flat leaves."""

    def __init__(self, fn, spec):
        self.fn = fn
        self.spec = spec

    def __call__(self, *leaves):
        args, kwargs = pytree.tree_unflatten(list(leaves), self.spec)
        return self.fn(*args, **kwargs)


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


class _LeafCall:
    """A segment without children: generated code, one variant per set of returned values."""

    def __init__(self, executor: PlanExecutor, nodes: list[fx.Node], inputs: list[fx.Node]):
        self.executor = executor
        self.nodes = nodes
        self.inputs = inputs
        self.variants: dict[tuple, fx.GraphModule] = {}

    def __call__(self, values: list, outputs: tuple) -> tuple:
        if self.executor.compile_options is not None:
            return _compiled_leaf_call(self, values, outputs)
        module = self.variants.get(outputs)
        if module is None:
            module = self.executor.segment_module(self.nodes, self.inputs, outputs)
            self.variants[outputs] = module
        return module(values)


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


# NOTE [ Random state of recomputed segments ]
# `checkpoint(..., preserve_rng_state=True)` replays the random number generator's state in
# the recompute, so that dropout draws the forward's masks again. It costs memory: every
# checkpoint call keeps a copy of the state (on CPU the generator's state is a 5 KB CPU tensor;
# CUDA states live in host memory) for as long as its frame lives, and every recompute holds
# one more while it runs (`torch.random.fork_rng` restores the state afterwards). Deeply
# nested plans of small steps hold dozens of them. A segment none of whose nodes draws random
# numbers (`Node.draws_random`, recorded by the capture from the aten ops' tags) consumes no
# random numbers in its forward or its recompute, so the executor replays nothing for it
# (`preserve_rng_state=False`) and it costs nothing. A segment that contains a random node
# replays the state: a parent of such a segment contains it too, so the parent's recompute
# reaches the child's checkpoint with the generator where the forward had it.


def draws_random(captured: CapturedGraph, start: int, stop: int) -> bool:
    """Whether a node in [start, stop) of `captured`'s IR draws random numbers."""
    return any(node.draws_random for node in captured.graph.nodes[start:stop])


@contextlib.contextmanager
def _stacked(*contexts) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


# ---------------------------------------------------------------------------------------
# Module granularity (capture fallback)
# ---------------------------------------------------------------------------------------


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
        self.module = module
        self._context_fn = checkpoint_context_fn(module)
        self.units = checkpointed_units(plan, captured)
        self.checkpointed = {u.key for u in self.units if u.children is None}
        self._random = {  # NOTE [ Random state of recomputed segments ]
            (u.key, u.children): draws_random(captured, u.start, u.stop) for u in self.units
        }
        self.runs: dict[tuple[str, int], dict[int, int]] = {}  # Sequential call -> {i: j}
        for u in self.units:
            if u.children is not None:
                self.runs.setdefault(u.key, {})[u.children[0]] = u.children[1]
        paths = {path for path, _ in (*self.checkpointed, *self.runs)}
        self._modules = {path: module.get_submodule(path) for path in sorted(paths)}

    def __call__(self, *args, **kwargs) -> Any:
        counts: dict[str, int] = {}
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
        with autocast_cache_disabled():
            return checkpoint(
                _FlatCall(fn, spec),
                *leaves,
                use_reentrant=False,
                preserve_rng_state=self._random[unit],
                context_fn=self._context_fn,
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


class _Chain:
    """Calls modules one after the other, as nn.Sequential does."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = modules

    def __call__(self, x: Any) -> Any:
        for m in self.modules:
            x = m(x)
        return x


def make_executor(
    captured: CapturedGraph, plan: Plan, module: nn.Module, compile_options: dict | None = None
):
    """The executor for `captured`'s granularity. `compile_options` (op level only): run each
    leaf segment through `torch.compile(segment, **compile_options)` (NOTE [ Compiled
    segments ])."""
    if captured.granularity == MODULE:
        return ModuleCallExecutor(captured, plan, module)
    if plan.schedule:
        return ScheduleExecutor(captured, plan, module)
    return PlanExecutor(captured, plan, module, compile_options=compile_options)


# ---------------------------------------------------------------------------------------
# Compiled segments (HCModule(..., compile=True), and torch.compile(hc))
# ---------------------------------------------------------------------------------------

# NOTE [ Compiled segments ]
# With `compile_options`, every leaf segment's generated code is compiled on its own
# (`torch.compile(segment, dynamic=False, **options)`); the plan's structure around the
# segments (the executor's environment, nested non-reentrant checkpoints with their
# context_fn, autocast's cache switch) stays eager Python, so memory is still decided by the
# plan: a recomputed segment keeps only its inputs and outputs, whatever its compiled code
# saves inside. One rule makes this exact: a leaf segment always runs the code that returns
# all its forward outputs, also in a recompute pass that needs fewer (the caller drops the
# rest). Eagerly, each variant of the generated code saves the same tensors (autograd saves
# per op); compiled, AOTAutograd's partitioner picks what a graph saves from the graph's
# outputs, so a second variant would save a different number of tensors and non-reentrant
# checkpoint's recompute check would fail. BatchNorm statistics frozen during a recompute
# (`hbp.runtime.recompute`) are buffers swapped on the module: the compiled segment reads
# them as graph inputs, so the swap needs no recompilation. Dropout: the recompute replays the
# RNG state (checkpoint's `preserve_rng_state`); Inductor draws its random numbers from that
# state too, so the recompute's masks are the forward's (the same masks as eager PyTorch
# only with `torch._inductor.config.fallback_random = True`).


def _compiled_leaf_call(leaf: _LeafCall, values: list, outputs: tuple) -> tuple:
    """`leaf(values, outputs)` through the one compiled variant that returns every output of
    the forward pass (the first call is the forward: see NOTE [ Compiled segments ])."""
    if not leaf.variants:
        module = leaf.executor.segment_module(leaf.nodes, leaf.inputs, outputs)
        options = {"dynamic": False, **leaf.executor.compile_options}
        leaf.variants[outputs] = torch.compile(module, **options)
    ((full, module),) = leaf.variants.items()
    if full == outputs:
        return module(values)
    produced = dict(zip(full, module(values)))
    return tuple(produced[n] for n in outputs)
