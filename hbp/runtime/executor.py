"""Run a `Plan` on a captured module: keep what the plan keeps, recompute the rest.

`PlanExecutor` (op granularity) splits the captured fx graph at the plan's segment boundaries.
Every leaf segment becomes a generated `torch.fx.GraphModule` (plain Python code calling the
module's own submodules and functions: eager speed, no per-op interpreter), every segment with
children becomes a small runner over its children's blocks. A segment with `recompute=True`
runs through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
preserve_rng_state=True, context_fn=...)`: its forward keeps only its inputs and outputs, its
backward first re-runs it (with its own nested plan: non-reentrant checkpoints nest), with the
RNG state replayed (same dropout masks) and running statistics frozen (BatchNorm updated once,
`hbp.runtime.recompute`). Plain segments run directly.

Memory discipline (otherwise Python references keep activations alive and the saving is lost):
a value is dropped from the executor's environment as soon as the last block that reads it has
been handed it, a leaf segment receives its inputs in a list that it empties on entry (the
generated code then frees each input after its last use), and nothing else holds activations.

In-place ops: a recomputed segment that mutates one of its inputs in place would recompute from
the already-mutated value; such an input is cloned on entry to the segment (inside the
checkpoint, so the recompute clones the original again) and the clone replaces the input for
later readers. Buffers other than norm statistics that a recomputed segment updates in place
are swapped for throw-away copies during the recompute, like norm statistics.

`ModuleCallExecutor` (module granularity, the capture fallback) checkpoints the recorded child
module calls that the plan recomputes, one call at a time, by patching their `forward` for the
duration of one forward pass.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint

from hbp.graph.torch_capture import MODULE, CapturedGraph
from hbp.planner.plan import Plan, Segment
from hbp.runtime.recompute import checkpoint_context_fn


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
    outputs: values it produces (or rebinds) that later blocks or the graph output read.
    release: inputs no later block of the same level reads: dropped when it is called.
    call: fn(list of input values) -> tuple of output values (empties the list).
    """

    start: int
    stop: int
    recompute: bool
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    call: Callable[[list], tuple]
    cloned: tuple[int, ...] = ()
    frozen_attrs: list[tuple[nn.Module, str]] = field(default_factory=list)
    release: list[fx.Node] = field(default_factory=list)
    context_fn: Callable | None = None


class PlanExecutor:
    """Runs `plan` on `captured` (op granularity); call it like the module:
    `executor(*args, **kwargs)` returns the module's outputs."""

    def __init__(self, captured: CapturedGraph, plan: Plan, module: nn.Module):
        if captured.gm is None:
            raise ValueError("PlanExecutor needs an op-level capture; use ModuleCallExecutor")
        self.captured = captured
        self.plan = plan
        self.gm = captured.gm
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
        self._graph_outputs = [n for n in self._output.all_input_nodes if n.op != "get_attr"]
        self.blocks = self._compile_level(plan.segments, self._graph_outputs)

    # -- running ----------------------------------------------------------------------------

    def __call__(self, *args, **kwargs) -> Any:
        bound = self.captured.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        env = {
            ph: bound.arguments[name]
            for ph, name in zip(self._placeholders, self.captured.input_names)
        }
        del bound, args, kwargs
        self._run_level(self.blocks, env)
        return fx.node.map_arg(self._output.args[0], lambda n: self._lookup(env, n))

    def _lookup(self, env: dict, node: fx.Node) -> Any:
        if node.op == "get_attr":
            return getattr_path(self.gm, node.target)
        return env[node]

    def _run_level(self, blocks: list[_Block], env: dict) -> None:
        for block in blocks:
            args = [env[n] for n in block.inputs]
            for n in block.release:
                del env[n]
            if block.recompute:
                outs = checkpoint(
                    _ListCall(block),
                    *args,
                    use_reentrant=False,
                    preserve_rng_state=True,
                    context_fn=block.context_fn,
                )
            else:
                outs = block.call(args)
            del args
            env.update(zip(block.outputs, outs))
            del outs

    # -- compiling --------------------------------------------------------------------------

    def _compile_level(self, segments: list[Segment], needed_after: list[fx.Node]) -> list[_Block]:
        blocks = [b for b in (self._compile_segment(s) for s in segments) if b is not None]
        later_reads: set[fx.Node] = set(needed_after)
        for block in reversed(blocks):
            block.release = [n for n in block.inputs if n not in later_reads]
            later_reads.update(block.inputs)
        return blocks

    def _compile_segment(self, seg: Segment) -> _Block | None:
        a, b = seg.start, seg.stop
        nodes = [n for n in self.captured.fx_nodes[a:b] if n.op != "placeholder"]
        if not nodes:
            return None
        inputs: list[fx.Node] = []
        for node in nodes:
            for src in node.all_input_nodes:
                if src.op != "get_attr" and self._index[src] < a and src not in inputs:
                    inputs.append(src)
        outputs = [n for n in nodes if any(r >= b for r in self._readers[n])]
        cloned = self._mutated_inputs(nodes, inputs, a, b) if seg.recompute else ()
        outputs += [inputs[i] for i in cloned if any(r >= b for r in self._readers[inputs[i]])]
        if seg.children:
            children = self._compile_level(seg.children, outputs)
            call = _NestedCall(self, children, inputs, outputs)
            frozen = [pair for c in children for pair in c.frozen_attrs]
        else:
            seg_gm = _segment_module(self.gm, nodes, inputs, outputs)
            call = seg_gm
            frozen = self._frozen_attrs(nodes, seg_gm)
        block = _Block(a, b, seg.recompute, inputs, outputs, call, cloned, frozen)
        if seg.recompute:
            block.context_fn = self._context_fn(block)
        return block

    def _mutated_inputs(
        self, nodes: list[fx.Node], inputs: list[fx.Node], a: int, b: int
    ) -> tuple[int, ...]:
        """Positions in `inputs` of the values the segment [a, b) mutates in place (through
        any chain of views made inside the segment)."""
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

    def _frozen_attrs(
        self, nodes: list[fx.Node], seg_gm: fx.GraphModule
    ) -> list[tuple[nn.Module, str]]:
        """(owner module, attribute) of every buffer the segment updates in place, except norm
        statistics (guarded by `checkpoint_context_fn`)."""
        pairs = []
        for node in nodes:
            for target in self.captured.mutated_attrs.get(node.name, ()):
                owner_path, _, attr = target.rpartition(".")
                owner = getattr_path(seg_gm, owner_path) if owner_path else seg_gm
                pairs.append((owner, attr))
        return pairs

    def _context_fn(self, block: _Block) -> Callable:
        norm_context_fn = self._norm_context_fn
        frozen = block.frozen_attrs
        if not frozen:
            return norm_context_fn

        def context_fn():
            forward_ctx, recompute_ctx = norm_context_fn()
            return forward_ctx, _stacked(recompute_ctx, _throwaway_attrs(frozen))

        return context_fn

    def describe(self) -> str:
        """One line per top-level block: node range, recompute flag, inputs and outputs."""
        lines = []
        for b in self.blocks:
            kind = "recompute" if b.recompute else "plain"
            lines.append(
                f"[{b.start:4d}, {b.stop:4d}) {kind:9s} in={len(b.inputs)} out={len(b.outputs)}"
            )
        return "\n".join(lines)


class _ListCall:
    """Adapts a block to checkpoint's calling convention: fn(*inputs) -> outputs. Inputs the
    block mutates in place are cloned first (inside the checkpoint: recompute clones again)."""

    def __init__(self, block: _Block):
        self.block = block

    def __call__(self, *args) -> tuple:
        values = list(args)
        del args
        for i in self.block.cloned:
            values[i] = values[i].clone()
        return self.block.call(values)


class _NestedCall:
    """A segment with children: runs its children blocks (checkpointing the recomputed ones)."""

    def __init__(self, executor: PlanExecutor, children: list[_Block], inputs, outputs):
        self.executor = executor
        self.children = children
        self.inputs = inputs
        self.outputs = outputs

    def __call__(self, values: list) -> tuple:
        env = dict(zip(self.inputs, values))
        values.clear()
        self.executor._run_level(self.children, env)
        return tuple(env[n] for n in self.outputs)


def _segment_module(
    gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
) -> fx.GraphModule:
    """Generated code for one leaf segment: forward(inputs: list) -> tuple(outputs)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    packed = graph.placeholder("inputs")
    values = graph.call_function(_take_all, (packed,))
    for i, node in enumerate(inputs):
        env[node] = graph.call_function(operator.getitem, (values, i))
    for node in nodes:
        for src in node.all_input_nodes:
            if src.op == "get_attr" and src not in env:
                env[src] = graph.node_copy(src)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, graph, class_name="Segment")


def getattr_path(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


@contextlib.contextmanager
def _stacked(*contexts) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


@contextlib.contextmanager
def _throwaway_attrs(pairs: list[tuple[nn.Module, str]]) -> Iterator[None]:
    """Inside: each (module, name) buffer is a copy; the real one is put back on exit."""
    real = [(m, name, getattr(m, name)) for m, name in pairs]
    for m, name, buf in real:
        setattr(m, name, buf.clone())
    try:
        yield
    finally:
        for m, name, buf in real:
            setattr(m, name, buf)


# ---------------------------------------------------------------------------------------
# Module granularity (capture fallback)
# ---------------------------------------------------------------------------------------


def recomputed_nodes(plan: Plan) -> set[int]:
    """Indices of the nodes inside a recomputed segment (outermost ones, at any depth)."""
    out: set[int] = set()

    def visit(segments: list[Segment]) -> None:
        for seg in segments:
            if seg.recompute:
                out.update(range(seg.start, seg.stop))
            else:
                visit(seg.children)

    visit(plan.segments)
    return out


def per_call_plan(plan: Plan, n_nodes: int) -> Plan:
    """The plan `ModuleCallExecutor` really runs: every node of a recomputed segment becomes
    its own recomputed segment (no nesting). Predictions are left to the caller to redo."""
    recomputed = recomputed_nodes(plan)
    segments: list[Segment] = []
    for i in range(n_nodes):
        if i in recomputed:
            segments.append(Segment(i, i + 1, True))
        elif segments and not segments[-1].recompute:
            segments[-1].stop = i + 1
        else:
            segments.append(Segment(i, i + 1, False))
    return Plan(
        segments,
        budget_bytes=plan.budget_bytes,
        naive_peak_bytes=plan.naive_peak_bytes,
        naive_flops=plan.naive_flops,
        meta=dict(plan.meta, granularity=MODULE),
    )


class ModuleCallExecutor:
    """Runs a module-granularity plan: the recorded child calls in recomputed segments are
    each checkpointed (their `forward` is patched during one forward pass)."""

    def __init__(self, captured: CapturedGraph, plan: Plan, module: nn.Module):
        self.captured = captured
        self.plan = plan
        self.module = module
        self._context_fn = checkpoint_context_fn(module)
        self.checkpointed = {captured.module_calls[i - 1] for i in recomputed_nodes(plan) if i >= 1}
        self._modules = {path: module.get_submodule(path) for path, _ in captured.module_calls}

    def __call__(self, *args, **kwargs) -> Any:
        counts: dict[str, int] = {}
        patched = []
        for path, mod in self._modules.items():
            had_own = "forward" in mod.__dict__
            original = mod.forward
            mod.forward = self._patched(path, original, counts)
            patched.append((mod, had_own, original))
        try:
            return self.module(*args, **kwargs)
        finally:
            for mod, had_own, original in patched:
                if had_own:
                    mod.forward = original
                else:
                    del mod.forward

    def _patched(self, path: str, original: Callable, counts: dict[str, int]) -> Callable:
        def forward(*args, **kwargs):
            occurrence = counts.get(path, 0)
            counts[path] = occurrence + 1
            if (path, occurrence) not in self.checkpointed:
                return original(*args, **kwargs)
            return checkpoint(
                original,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=self._context_fn,
                **kwargs,
            )

        return forward


def make_executor(captured: CapturedGraph, plan: Plan, module: nn.Module):
    """The executor for `captured`'s granularity."""
    if captured.granularity == MODULE:
        return ModuleCallExecutor(captured, plan, module)
    return PlanExecutor(captured, plan, module)
