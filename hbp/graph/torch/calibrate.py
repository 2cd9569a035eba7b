"""Kernel workspace per op, measured by the allocator: the capture's last stage, before planning.

Fake tensors tell the capture what every op's tensors cost, not what its kernels allocate and
free inside (a convolution's im2col buffers, a matmul's packing, attention's blocks): memory no
tensor holds, which the allocator sees and which decides out-of-memory. This stage runs each
distinct op signature of a captured graph once on real tensors, forward and backward, under
the allocator (`hbp.allocator.allocator_peaks`), and raises the node's
`forward_scratch_bytes` / `backward_scratch_bytes` to what the allocator needed beyond the
bytes the IR already models at that event:

- forward: `output_bytes + saved_extra_bytes + forward_scratch_bytes` (the simulator charges
  exactly these at the node's forward event);
- backward: `param_grad_bytes` + the gradients of its inputs that are not passed through +
  `backward_scratch_bytes`.

    captured = capture(module, args, kwargs, calibrate=True)
    # or, on a capture made without it (the call the capture was made for):
    calibrate_scratch(captured, args, kwargs)

An op signature is the op (function, method, or the module's class and `repr`, which holds
its hyper-parameters), the shapes, dtypes, strides and `requires_grad` of its tensor arguments,
the values of the others and the layout of its output gradient (a slice of a `torch.cat`'s
gradient, the output's own layout, or the strides its users' backwards hand it: NOTE [ The
layout of an output's gradient ]): measured once per process (`_CACHE`), so a model of
repeated blocks costs one measurement per distinct layer, and once in all where a
`ScratchStore` keeps the measurements on disk (`calibrate_scratch(..., store=)`).

Values are produced by running the graph on the real inputs (once, and once more per step of
a gradient layout's way back where one differs) under `no_grad` (each value dropped after its
last user); the module's state is kept: buffers (BatchNorm statistics) are put back and the
RNG state restored. Skipped: views and in-place results (no storage of their own; views are
run for the layouts of gradients), ops that mutate an input or a buffer, and ops that fail to
run alone. The allocator is read with no dispatch mode
active; under a profiler other than hbp's own measurements (CPU) nothing is measured, since
profiler sessions do not nest (`calibrate_scratch` returns None: measure again outside it),
and on CUDA the peak statistics are reset (do not calibrate inside a step measured with
`max_memory_allocated`).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from hbp.allocator import foreign_profiler_running
from hbp.graph.ir import Node
from hbp.graph.torch.breaks import REAL_RESULTS, guard
from hbp.graph.torch.captured import CapturedGraph
from hbp.graph.torch.fallback import buffers_restored
from hbp.graph.torch.measure_op import Strides, fetch_attr, measure_op, run_node, without_hooks
from hbp.graph.torch.normalise import changes_metadata
from hbp.graph.torch.op_profile import PROFILED_LIKE
from hbp.graph.torch.op_signature import graph_key, signature
from hbp.graph.torch.scratch_store import ScratchStore

__all__ = ["calibrate_scratch", "clear_cache"]

#: (op signature, cat dim, output gradient's strides or None) -> (forward allocator peak,
#: backward allocator peak, bytes; the strides of the gradient each input got, or None)
_CACHE: dict[tuple, tuple[int, int, tuple[Strides | None, ...]]] = {}
#: How many more passes follow a gradient layout back through the graph (NOTE [ The layout
#: of an output's gradient ]); one per op it goes through.
MAX_LAYOUT_PASSES = 8


def calibrate_scratch(
    captured: CapturedGraph,
    args: tuple = (),
    kwargs: dict | None = None,
    store: ScratchStore | None = None,
) -> int | None:
    """Raise the scratch fields of `captured.graph`'s nodes to what the allocator measures.

    Args:
        captured: an op-level capture (`hbp.graph.torch.capture.capture`); a module-level one
            is left as it is.
        args, kwargs: the call the capture was made for (`module(*args, **kwargs)`).
        store: where measurements are also read from and written to, across processes
            (`hbp.graph.torch.scratch_store`); None: this process's only.

    Returns:
        The number of nodes whose scratch fields were raised; None when nothing could be
        measured because a profiler outside hbp is running (CPU).
    """
    gm = captured.gm
    if gm is None:
        return 0
    arguments = captured.placeholder_values(args, kwargs or {})
    memo = device = None
    if store is not None:  # NOTE [ A calibrated graph kept whole ]
        memo, device = graph_key(captured, arguments), _device((arguments, [*gm.parameters()]), {})
    if memo is not None and device is not None:
        kept = store.get_calibrated(memo, device)  # read under a profiler too: nothing runs
        if kept is not None and len(kept[1]) == len(captured.graph.nodes):
            for node, (forward, backward) in zip(captured.graph.nodes, kept[1]):
                node.forward_scratch_bytes, node.backward_scratch_bytes = forward, backward
            return kept[0]
    if _on_cpu(arguments, gm) and foreign_profiler_running():  # profilers cannot nest
        return None
    with _disable_current_modes(), _state_kept(gm), torch.no_grad():
        layouts, run = _Layouts(), _Pass(captured, store)
        raised = _calibrate_pass(run, arguments, layouts)
        for _ in range(MAX_LAYOUT_PASSES):  # NOTE [ The layout of an output's gradient ]
            pending = layouts.take_pending()
            if not pending:
                break
            raised += _calibrate_pass(run, arguments, layouts, only=pending)
    if memo is not None and device is not None:
        fields = [(n.forward_scratch_bytes, n.backward_scratch_bytes) for n in captured.graph.nodes]
        store.put_calibrated(memo, device, raised, fields)
    return raised


class _Layouts:
    """The gradient layouts found for each value and not yet measured with (NOTE [ The layout
    of an output's gradient ])."""

    def __init__(self) -> None:
        self.done: set[tuple[fx.Node, Strides]] = set()
        self.pending: dict[fx.Node, set[Strides]] = {}

    def add(self, node: fx.Node, strides: Strides) -> None:
        if (node, strides) not in self.done:
            self.done.add((node, strides))
            self.pending.setdefault(node, set()).add(strides)

    def take_pending(self) -> dict[fx.Node, set[Strides]]:
        pending, self.pending = self.pending, {}
        return pending


class _NodeFacts(NamedTuple):
    """What every pass learns of an fx node from its inputs' values: its op signature, and
    per tensor leaf of its (args, kwargs) `_leaf_sources` and that value's own strides."""

    signature: tuple
    sources: list[fx.Node | None]
    strides: list[Strides | None]


class _Pass:
    """What the passes over one graph share: its fx nodes by name, each node's `_NodeFacts`
    (NOTE [ Layout passes run only what they measure ])."""

    def __init__(self, captured: CapturedGraph, store: ScratchStore | None = None):
        self.captured, self.store = captured, store
        self.by_name = {n.name: n for n in captured.gm.graph.nodes}
        self.facts: dict[fx.Node, _NodeFacts] = {}


def _calibrate_pass(
    run: _Pass,
    arguments: list[Any],
    layouts: _Layouts,
    only: dict[fx.Node, set[Strides]] | None = None,
) -> int:
    """Measure every measurable op with its output's own gradient layout, or (`only`) the ops
    given with each of their gradient layouts given, and raise their scratch fields. Each
    measured backward adds to `layouts` the inputs' values whose gradient came back in another
    layout than the value's own. With `only`, views are measured too (backward only): a
    gradient's layout comes back through them, and they copy one they cannot view back."""
    captured, raised, gm = run.captured, 0, run.captured.gm
    steps = (
        _run_graph(gm, captured, arguments) if only is None else _known_first(run, arguments, only)
    )
    for node, values in steps:
        ir_node = _measurable(captured, node)
        view = _view(captured, node) if ir_node is None else None
        if ir_node is None and view is None:
            continue
        args = kwargs = None
        if values is not None:
            args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), values.prepare)
            if node not in run.facts:
                run.facts[node] = _node_facts(gm, node, values, args, kwargs)
        if ir_node is None and only is None:
            continue  # a view: its facts are kept for the layout passes
        seeds = [None] if only is None else sorted(only[node])
        cat_dim = _cat_dim(node) if only is None else None
        facts = run.facts[node]
        for strides in seeds:
            key = (facts.signature, cat_dim, strides)
            if key not in _CACHE and not _stored(run, key, args, kwargs):
                takes = view is None and values is not None and values.takes_measured
                value = [] if takes else None
                measured = measure_op(gm, node, args, kwargs, cat_dim, strides, value)
                if measured is None:
                    continue
                if value:  # NOTE [ A measured op's output is its value ] in measure_op.py
                    values.env.setdefault(node, value[0])
                _CACHE[key] = measured
                if run.store is not None:  # measured: it has a tensor argument
                    run.store.put(key, _device(args, kwargs), measured)
            forward, backward, grad_strides = _CACHE[key]
            if view is None:
                raised += _raise_fields(captured, ir_node, forward, backward, only is None)
            else:  # a view's backward copies a gradient that cannot be viewed back
                raised += _raise_fields(captured, view, 0, backward)
            _record_layouts(run, facts, grad_strides, layouts)
    return raised


def _stored(run: _Pass, key: tuple, args, kwargs) -> bool:
    """Whether `run.store` has a measurement for `key` (then in `_CACHE` too)."""
    device = None if run.store is None or args is None else _device(args, kwargs)
    if device is None:
        return False
    measured = run.store.get(key, device)
    if measured is not None:
        _CACHE[key] = measured
    return measured is not None


def _device(args, kwargs) -> torch.device | None:
    """The device of an op's first tensor argument (`measure_op` runs on it), or None."""
    leaves = tree_leaves((args, kwargs))
    return next((t.device for t in leaves if isinstance(t, torch.Tensor)), None)


def _node_facts(gm: fx.GraphModule, node: fx.Node, values: _Values, args, kwargs) -> _NodeFacts:
    sources = _leaf_sources(node, values)
    strides = [None if source is None else values.strides(source) for source in sources]
    return _NodeFacts(signature(gm, node, args, kwargs), sources, strides)


def _known_first(run: _Pass, arguments: list[Any], only):
    """(fx node, values or None) for each node of `only` that can be measured, in graph order:
    None where its facts and each measurement it needs are known, else its inputs' values
    (NOTE [ Layout passes run only what they measure ])."""
    captured, gm = run.captured, run.captured.gm
    steps = _run_graph(gm, captured, arguments)  # lazy: runs as far as it is consumed
    for node in gm.graph.nodes:
        if node not in only or node.op in ("placeholder", "get_attr", "output"):
            continue
        if _measurable(captured, node) is None and _view(captured, node) is None:
            continue
        facts = run.facts.get(node)
        if facts is not None and all((facts.signature, None, s) in _CACHE for s in only[node]):
            yield node, None
            continue
        for ran, values in steps:
            if ran is node:
                yield node, values
                break


# NOTE [ Layout passes run only what they measure ]
# A layout pass (NOTE [ The layout of an output's gradient ]) needs of an op its signature and
# its inputs' strides, which the first pass learnt (`_NodeFacts`), and its real inputs only
# where a measurement is not cached: in a model of repeated blocks, the graph is run only as
# far as the first block, whose ops are measured; the later blocks' hit the cache.


def _record_layouts(
    run: _Pass,
    facts: _NodeFacts,
    grad_strides: tuple[Strides | None, ...],
    layouts: _Layouts,
) -> None:
    """Add to `layouts` each input value of a node whose gradient came back in strides other
    than its own (and the op whose storage it aliases with its shape and strides)."""
    for source, own, strides in zip(facts.sources, facts.strides, grad_strides):
        if strides is None or source is None:
            continue
        if own is None or own == strides:
            continue
        layouts.add(source, strides)
        root = _same_layout_root(run, source)
        if root is not None:
            layouts.add(root, strides)


def _view(captured: CapturedGraph, node: fx.Node) -> Node | None:
    """`node`'s IR node if it is a view of another value (not an input, mutating nothing)."""
    try:
        ir_node = captured.ir_node(node)
    except KeyError:
        return None
    if ir_node.alias_of is None or ir_node.is_input:
        return None
    if ir_node.name in captured.mutated_inputs or ir_node.name in captured.mutated_attrs:
        return None
    return ir_node


def _same_layout_root(run: _Pass, node: fx.Node) -> fx.Node | None:
    """The op whose storage `node` aliases, when `node` has that value's shape and strides
    (exported graphs put `broadcast_tensors` and `getitem` between an output and
    `mse_loss`): the gradient the alias gets back is the root's, in the same layout. None
    otherwise, or where the graph records no fake values."""
    captured, by_name = run.captured, run.by_name
    root = node
    for _ in range(len(by_name)):
        try:
            alias = captured.ir_node(root).alias_of
        except KeyError:
            return None
        if alias is None or alias not in by_name:
            break
        root = by_name[alias]
    if root is node:
        return None
    mine, theirs = node.meta.get("val"), root.meta.get("val")
    if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)):
        return None
    if mine.shape != theirs.shape or mine.stride() != theirs.stride():
        return None
    return root


def clear_cache() -> None:
    """Forget every measured op signature (e.g. after a change of allocator settings)."""
    _CACHE.clear()


# ---------------------------------------------------------------------------------------
# Running the graph on real values
# ---------------------------------------------------------------------------------------


class _Values:
    """The real values of the fx nodes run so far, and their measurement copies."""

    def __init__(self, gm: fx.GraphModule, captured: CapturedGraph, takes_measured: bool):
        self.gm, self.captured = gm, captured
        self.env: dict[fx.Node, Any] = {}
        #: whether an op measured on these values hands the run its output (NOTE [ A measured
        #: op's output is its value ] in measure_op.py): where no value decides a branch
        self.takes_measured = takes_measured

    def prepare(self, arg: Any) -> Any:
        """An argument for a measured run: a node's value with its tensors detached and
        requiring grad as in the training step (parameters too: NOTE [ The measured run
        leaves the caller's hooks alone ] in measure_op.py)."""
        if not isinstance(arg, fx.Node):
            return arg
        if arg.op == "get_attr":
            return tree_map(without_hooks, fetch_attr(self.gm, arg.target))
        requires_grad = self._requires_grad(arg)

        def fresh(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            if requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            return t

        return tree_map(fresh, self.env[arg])

    def strides(self, arg: fx.Node) -> Strides | None:
        """The strides of `arg`'s value where it is one tensor, else None."""
        value = self.env.get(arg)
        return tuple(value.stride()) if isinstance(value, torch.Tensor) else None

    def _requires_grad(self, arg: fx.Node) -> bool:
        try:
            return self.captured.ir_node(arg).requires_grad
        except KeyError:  # an fx node that is no IR node (e.g. an unused value)
            return False


def _run_graph(gm: fx.GraphModule, captured: CapturedGraph, arguments: list[Any], until=None):
    """Yield (fx node, values) for every op node, its inputs' values available, running the
    graph on the real inputs (no grad) as it goes and dropping each value after its last
    user; with `until` (fx nodes), only as far as the last of them. A node profiled like an
    earlier one takes that one's value instead of running (NOTE [ Calibration runs one
    block ])."""
    nodes = list(gm.graph.nodes)
    if until is not None:
        nodes = nodes[: max((i for i, n in enumerate(nodes) if n in until), default=-1) + 1]
    branches = _branches_on_data(nodes)  # values matter: none stands in, none is handed on
    values = _Values(gm, captured, takes_measured=not branches)
    env = values.env
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for arg in node.all_input_nodes:
            last_use[arg] = i
    like = {} if branches else _stand_ins(captured, nodes)
    last_stand_in = {first: i for i, node in enumerate(nodes) if (first := like.get(node))}
    kept: dict[fx.Node, Any] = {}  # values that stand in for later nodes'
    placeholders = iter(arguments)
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "get_attr":
            env[node] = fetch_attr(gm, node.target)
        else:
            yield node, values
            first = like.get(node)
            if first in kept:
                env[node] = kept[first]
            else:
                if node not in env:  # else the caller's measurement of it ran it
                    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                    env[node] = run_node(gm, node, args, kwargs)
                if node in last_stand_in and _floating(env[node]):
                    kept[node] = env[node]
            if first is not None and last_stand_in.get(first) == i:
                kept.pop(first, None)
        for arg in node.all_input_nodes:
            if last_use.get(arg) == i:
                env.pop(arg, None)


# NOTE [ Calibration runs one block ]
# The first calibration pass runs the graph forward on real values to hand each op real inputs
# (`_run_graph`), and a model of repeated blocks repeats its ops' signatures: every op of the
# later blocks hits the measurement cache, but running them was most of a forward (on CPU, half
# of a GPT-2's calibration). A node that profiling replayed from an earlier node's profile
# (`ProfileCache`: the same op on values of the same layout, storages alike) has a value of
# that node's layout, so it takes that value instead of running: the ops after it get inputs
# of the layouts they are measured with, and values matter to no measurement. Only new
# floating-point values stand in (a view must alias its own input; integer values index
# things); not in a graph that branches on data (a graph break's sizes and a guard's check
# depend on the values themselves).


def _stand_ins(captured: CapturedGraph, nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """fx node -> the earlier fx node whose value stands in for its own (in a graph that does
    not branch on data)."""
    by_name = {n.name: n for n in nodes}
    # a value an in-place view op reshapes is one tensor per node: its stand-in would be
    # reshaped twice (NOTE [ In-place view ops stay in place ] in normalise.py)
    reshaped = {n.args[0] for n in nodes if n.args and changes_metadata(n)}
    out = {}
    for node in nodes:
        first = by_name.get(node.meta.get(PROFILED_LIKE, ""))
        if first is None or _measurable(captured, node) is None:
            continue  # a view, an in-place op, or no IR node
        if node in reshaped or first in reshaped:
            continue
        out[node] = first
    return out


def _branches_on_data(nodes: list[fx.Node]) -> bool:
    """Whether the graph depends on its values, not only their layouts: a graph break's
    sizes or a guard's check."""
    return any(n.meta.get(REAL_RESULTS) or n.target is guard for n in nodes)


def _floating(value: Any) -> bool:
    leaves = tree_leaves(value)
    return bool(leaves) and all(
        isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in leaves
    )


@contextlib.contextmanager
def _state_kept(gm: fx.GraphModule):
    """Put buffers (BatchNorm statistics, counters) and the RNG state back afterwards."""
    devices = [b.device for b in gm.buffers() if b.device.type == "cuda"]
    with torch.random.fork_rng(devices=list(dict.fromkeys(devices))), buffers_restored(gm):
        yield


def _on_cpu(arguments: list[Any], gm: fx.GraphModule) -> bool:
    tensors = [t for t in tree_leaves(arguments) if isinstance(t, torch.Tensor)]
    tensors += list(gm.parameters())
    return not tensors or tensors[0].device.type == "cpu"


# ---------------------------------------------------------------------------------------
# Measuring one op
# ---------------------------------------------------------------------------------------


def _measurable(captured: CapturedGraph, node: fx.Node) -> Node | None:
    """The IR node of `node` if its scratch can be measured alone, else None."""
    try:
        ir_node = captured.ir_node(node)
    except KeyError:
        return None
    if ir_node.is_input or ir_node.alias_of is not None:
        return None
    if ir_node.name in captured.mutated_inputs or ir_node.name in captured.mutated_attrs:
        return None
    return ir_node


def _cat_dim(node: fx.Node) -> int | None:
    """The dimension of the `torch.cat` that is the only user of `node`, else None."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _CATS:
        cat = users[0]
        dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
        return dim if isinstance(dim, int) else None
    return None


# NOTE [ The layout of an output's gradient ]
# An op's backward workspace depends on the layout of the gradient it receives: a convolution
# whose input is channels-last (in diffusers' decoders, after attention's (B, HW, C) result is
# reshaped back to an image) runs its backward channels-last and copies a row-major output
# gradient; a convolution whose output is permuted to (B, T, C) for linear layers (Whisper's
# front end, SD3's patch embedding) gets its gradient transposed and copies it contiguous: a
# copy as big as the output either way. The layout is decided by the backwards of the op's
# users and of everything after them (a GroupNorm's backward returns a row-major gradient;
# a linear's returns one for its permuted input, which the permute's backward hands on
# transposed, and an elementwise op's backward keeps that layout), which one op run alone
# cannot see. So the layout is followed back through the graph, one op per pass: the first
# pass measures each op with a gradient of its output's own layout, and each measured backward
# records the strides of the gradient each input got; a value whose gradient came back in
# other strides than its own is measured again with a gradient of those strides in the next
# pass (views too: the layout comes back through them, and a view's backward copies a
# gradient it cannot view back, a reshape's of a permuted one), which records
# where that layout goes next, until no new layout is found (at most MAX_LAYOUT_PASSES more
# passes, each re-running the graph's forward). Each op is charged the largest workspace over
# the layouts it gets. A view with its root's shape and strides (exported graphs'
# `broadcast_tensors` before `mse_loss`) hands the layout on to its root directly. Where a
# value has several users, each user's layout is measured (autograd sums them; the first
# one's layout is what the sum usually keeps). A gradient that is not dense, a slice of a
# `torch.cat`'s passed back through views (a ViT's class token concatenated onto its
# transposed patch embedding: the convolution's gradient is a strided slice of the cat's),
# is followed too, as its strides, offset and storage length (`measure_op.Strides`): measured
# with a dense gradient, the convolution's backward copy of it (the conv output's size) was
# missing from the estimate.


def _leaf_sources(node: fx.Node, values: _Values) -> list[fx.Node | None]:
    """For each tensor leaf of `node`'s prepared (args, kwargs), the fx node it is the value
    of (None for constants and attributes), in `tree_leaves` order."""

    def sources(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        if arg.op == "get_attr":
            return tree_map(lambda _: None, fetch_attr(values.gm, arg.target))
        return tree_map(lambda _: arg, values.env[arg])

    tree = fx.node.map_aggregate((node.args, node.kwargs), sources)
    return [leaf if isinstance(leaf, fx.Node) else None for leaf in tree_leaves(tree)]


# torch.fx graphs call the Python functions; exported graphs the ATen ops.
_CATS = (
    torch.cat,
    torch.concat,
    torch.concatenate,
    torch.ops.aten.cat.default,
    torch.ops.aten.concat.default,
    torch.ops.aten.concatenate.default,
)


def _raise_fields(
    captured: CapturedGraph, node: Node, forward: int, backward: int, settle: bool = False
) -> int:
    """Raise `node`'s scratch fields so its modelled events cover the measured peaks.
    `settle` (the measurement with the output's own gradient layout): the backward's scratch
    becomes what the allocator measured, lower than the fake estimate too (NOTE [ Fake
    frees follow Python objects ])."""
    graph = captured.graph
    raised = 0
    modelled = node.output_bytes + (node.saved_extra_bytes if node.requires_grad else 0)
    if forward - modelled > node.forward_scratch_bytes:
        node.forward_scratch_bytes = forward - modelled
        raised = 1
    passthrough = set(node.grad_passthrough)
    grads = sum(
        graph.node(name).gradient_bytes
        for name in dict.fromkeys(node.inputs)
        if name not in passthrough
    )
    measured = max(0, backward - node.param_grad_bytes - grads)
    over = node.backward_scratch_bytes - measured
    if measured > node.backward_scratch_bytes or (settle and backward > 0 and over > _NOISE):
        raised = 1
        node.backward_scratch_bytes = measured
    return raised


#: Bytes by which the fake profile's backward scratch may exceed the allocator's before the
#: calibration lowers it (NOTE [ Fake frees follow Python objects ]).
_NOISE = 4096


# NOTE [ Fake frees follow Python objects ]
# The capture's fake profile (`op_profile._FakeLiveBytes`) sees a storage freed when the last
# Python tensor on it dies. In a composite op's backward that is sometimes an autograd node
# later than the allocator's free: math attention on transposed (non-contiguous) q, k, v with
# dropout keeps its probabilities' storage counted one node longer, so a whole (B, H, T, T)
# gradient is charged beside them (a BERT layer's backward, 0.75 MiB over at batch 4, 128
# tokens). The allocator, measuring the op's forward and backward in one window so that the
# frees of what the forward saved count, is the reference: with the output's own gradient
# layout it sets the backward's scratch, lower than the fake estimate too when that is more
# than `_NOISE` bytes over (a scalar a fake kernel makes is left, so that a capture that could
# not be calibrated, under another profiler, plans as a calibrated one does); other layouts
# only raise it.
