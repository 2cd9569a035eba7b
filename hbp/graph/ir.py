"""hbp's framework-neutral graph IR.

A `Graph` is the forward computation of one training step as a list of `Node`s in a
topological order (the order the forward runs them). Each node describes one value-producing
operation with what the memory model needs: the bytes of the new storage it creates, its
forward FLOPs, which values its backward keeps alive (saved tensors), and the parameter
gradients its backward creates. Nothing here imports torch or jax: torch capture
(`hbp.graph.torch.capture`) and jaxpr capture fill the same structure, and the planner and
the analysis work on it alone.

Units: bytes for every size, FLOPs (multiply-add = 2 FLOPs) for every cost.

Execution semantics the simulator (`hbp.analysis.simulate`) and the executors share:

Forward, plain (not inside a recomputed segment): node i allocates `output_bytes` (0 if its
output aliases an input: views, in-place results) and, if `requires_grad`, `saved_extra_bytes`
(fresh tensors only backward uses: dropout masks, norm statistics). A value's storage is
freed once no later forward user needs it, no backward keeps it (`saved_inputs` of a user,
`saves_output` of its producer) and it is not a graph output. Aliases keep their base alive.

Forward inside a recomputed (checkpointed) segment: nothing is saved for backward; the
segment's inputs (values produced before it) are held until the segment's backward is done;
its internal values are freed as soon as their last forward user inside it has run; values
it produces for later segments or outputs stay.

Backward runs nodes in reverse order. Before a recomputed segment's nodes are backpropagated,
the segment is run forward again (with its own nested plan), which re-allocates what its
nodes save. At node i's backward: the gradient of its output (`grad_bytes`) is live; the
node allocates the gradients of its inputs that require grad (accumulating into an existing
gradient costs nothing new), allocates `param_grad_bytes` (parameter gradients, never freed
within the step), then frees what it saved and its output gradient.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass
class Node:
    """One operation of the forward graph.

    Attributes:
        name: unique name of the value this node produces.
        op: readable operation label ("aten.mm", "Linear", "jax:dot_general", "input").
        inputs: names of the nodes whose values this node reads (graph inputs included;
            parameters and constants are not nodes).
        output_bytes: bytes of new storage the output occupies (0 for a view or an
            in-place result, see `alias_of`).
        flops: forward FLOPs of the operation.
        backward_flops: FLOPs of its backward; None where unknown (then estimated as 2x
            `flops`). A measured 0 is 0: an op that forms its gradients in its forward
            (`hbp.ops.chunked_cross_entropy`) does its work there.
        requires_grad: whether the output takes part in backward.
        saved_inputs: names (subset of `inputs`) whose values this node's backward keeps.
        saves_output: whether this node's backward keeps its own output.
        saved_extra_bytes: bytes of fresh tensors saved only for backward.
        param_grad_bytes: bytes of parameter gradients this node's backward creates first
            (a parameter used by several nodes is charged to the last one in forward order).
        alias_of: name of the input whose storage the output shares, or None.
        is_input: a graph input (placeholder): allocated before the step, never recomputed.
        module: dotted path of the nn.Module (or scope) that produced it, for reports.

    Memory facts a capture measures beyond the fields above (defaults: none):
        grad_bytes: bytes of the gradient of this node's output during backward; None: the
            output's storage (`output_bytes`). Differs for views and in-place results (no
            new storage, a full-size gradient) and for CPU losses that return a view of an
            unreduced buffer. Use `gradient_bytes` to read it.
        grad_passthrough: inputs whose gradient *is* this node's output gradient (add,
            views): its backward allocates nothing for them.
        forward_scratch_bytes: bytes the node holds only while its forward runs, beyond
            its output and saved extras: kernel workspace, a composite op's intermediates.
        backward_scratch_bytes: the same while its backward runs, beyond the input and
            parameter gradients it creates (cross-entropy's log-softmax gradient, a
            convolution's im2col buffers).
        grad_sum_bytes: bytes of a new sum autograd makes when it adds the parameter gradient
            this node's backward computes to one it holds already (a parameter read by
            several nodes whose held gradient cannot take it in place: NOTE [ Gradients of a
            parameter used twice ] in hbp/graph/torch/profile.py). The engine adds once the
            node's backward has released its saved tensors and its output gradient; the
            computed gradient (the same size) is live beside the sum until then.
        flops_after_last_save: FLOPs that do not run when a recompute pass early-stops at
            this node (torch saves an op's inputs before the op runs, its outputs after).
        output_after_last_save: whether its output is allocated after its last save (a
            Linear that saves only its input: the matmul and its output).
        draws_random: the op draws from the random number generator (dropout, `torch.rand`):
            a recomputed segment that contains it must replay the generator's state, which
            costs memory (NOTE [ Random state of recomputed segments ] in
            hbp/runtime/executors/checkpointing.py); segments without such ops replay nothing.
        writes_in_place: the op writes into the storage of an input in place (`x.add_(y)`,
            `out[:, t] = v`): with `alias_of`, a write its storage's later readers see (NOTE
            [ A write into a view reaches backward through its base ] in hbp/analysis/liveness.py).
    """

    name: str
    op: str
    inputs: tuple[str, ...] = ()
    output_bytes: int = 0
    flops: float = 0.0
    backward_flops: float | None = None
    requires_grad: bool = True
    saved_inputs: tuple[str, ...] = ()
    saves_output: bool = False
    saved_extra_bytes: int = 0
    param_grad_bytes: int = 0
    alias_of: str | None = None
    is_input: bool = False
    module: str = ""
    grad_bytes: int | None = None
    grad_passthrough: tuple[str, ...] = ()
    forward_scratch_bytes: int = 0
    backward_scratch_bytes: int = 0
    grad_sum_bytes: int = 0
    flops_after_last_save: float = 0.0
    output_after_last_save: bool = False
    draws_random: bool = False
    writes_in_place: bool = False

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the gradient of this node's output during backward (0 without grad)."""
        if not self.requires_grad:
            return 0
        return self.output_bytes if self.grad_bytes is None else self.grad_bytes


# Graph.meta keys under which captures before the typed fields recorded the same facts, by
# node name (graph.json files written then still load): key -> Node field.
LEGACY_META_FIELDS = {
    "grad_bytes": "grad_bytes",
    "grad_passthrough": "grad_passthrough",
    "forward_transient_bytes": "forward_scratch_bytes",
    "backward_transient_bytes": "backward_scratch_bytes",
    "flops_after_last_save": "flops_after_last_save",
    "output_after_last_save": "output_after_last_save",
}
_TUPLE_FIELDS = ("inputs", "saved_inputs", "grad_passthrough")


@dataclass
class Graph:
    """A forward graph in topological order.

    Attributes:
        nodes: the nodes, in the order forward runs them (inputs first).
        outputs: names of the values the graph returns.
        grad_outputs: the outputs backward starts from (their gradients are allocated when
            backward starts); None: every output that requires grad. A HuggingFace-style
            output with a scalar `loss` is trained through the loss alone: its logits are an
            output, but their gradient comes only through the loss (NOTE [ Where backward
            starts ] in hbp/graph/torch/capture.py).
        held_outputs: the outputs the caller keeps alive until the step's backward ends;
            None: all of them (the safe assumption, `out = model(x); loss_fn(out,
            y).backward()`). An output not listed is freed once nothing in the step needs it
            (`model(**batch).loss.backward()` drops the logits before backward), or, if
            backward starts from it, once backward has started (`loss_fn(model(x),
            y).backward()`): NOTE [ Outputs the caller lets go ] in
            hbp/integrations/torch/outputs.py.
        rng_state_bytes: bytes of one copy of the random number generator's state, counted
            in the memory the step's peak is measured in: a recomputed segment that draws
            random numbers keeps copies of it (NOTE [ Random state of recomputed segments ]
            in hbp/runtime/executors/checkpointing.py). The torch capture records the CPU generator's state
            size for a step on the CPU and 0 on CUDA (the states live in host memory); 0 for
            JAX (random keys are values of the graph).
        meta: provenance of the capture (framework, granularity, timings, warnings); memory
            facts are `Node` fields. Graphs built with the legacy per-node meta keys
            (`LEGACY_META_FIELDS`) have them moved onto the nodes by `adopt_legacy_meta`,
            which `from_dict` and `hbp.analysis.liveness.GraphInfo.of` call.
    """

    nodes: list[Node]
    outputs: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    grad_outputs: list[str] | None = None
    held_outputs: list[str] | None = None
    rng_state_bytes: int = 0

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def adopt_legacy_meta(self) -> Graph:
        """Move memory facts recorded under legacy `meta` keys onto the nodes' fields (a
        no-op when there are none); returns self."""
        for key, attr in LEGACY_META_FIELDS.items():
            by_name = self.meta.pop(key, None)
            if not by_name:
                continue
            if attr == "output_after_last_save":  # a list of node names
                by_name = {name: True for name in by_name}
            for name, value in by_name.items():
                if name in self._index:
                    node = self.nodes[self._index[name]]
                    setattr(node, attr, tuple(value) if attr in _TUPLE_FIELDS else value)
        return self

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, name: str) -> int:
        """Position of the node called `name` in the topological order."""
        return self._index[name]

    def node(self, name: str) -> Node:
        return self.nodes[self._index[name]]

    def backward_seeds(self) -> set[str]:
        """The outputs backward starts from: those that require grad, of `grad_outputs` when
        it is set, else of all outputs."""
        listed = self.outputs if self.grad_outputs is None else set(self.grad_outputs)
        return {o for o in self.outputs if o in listed and self.node(o).requires_grad}

    def users(self) -> dict[str, list[str]]:
        """For every node name, the names of the nodes that read its value, in order."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return out

    @property
    def total_flops(self) -> float:
        return float(sum(n.flops for n in self.nodes))

    def to_dict(self) -> dict:
        """Plain data (JSON-ready): nodes as dicts, outputs, meta."""
        return {
            "nodes": [asdict(n) for n in self.nodes],
            "outputs": list(self.outputs),
            "grad_outputs": None if self.grad_outputs is None else list(self.grad_outputs),
            "held_outputs": None if self.held_outputs is None else list(self.held_outputs),
            "rng_state_bytes": int(self.rng_state_bytes),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Graph:
        names = {f.name for f in fields(Node)}
        nodes = []
        for raw in d["nodes"]:
            kw = {k: v for k, v in raw.items() if k in names}
            for name in _TUPLE_FIELDS:
                kw[name] = tuple(kw.get(name, ()))
            nodes.append(Node(**kw))
        graph = cls(nodes, list(d.get("outputs", [])), dict(d.get("meta", {})))
        if d.get("grad_outputs") is not None:
            graph.grad_outputs = list(d["grad_outputs"])
        if d.get("held_outputs") is not None:
            graph.held_outputs = list(d["held_outputs"])
        graph.rng_state_bytes = int(d.get("rng_state_bytes", 0))
        return graph.adopt_legacy_meta()

    def to_json(self, path: str | Path | None = None) -> str:
        """The graph as JSON text; also written to `path` if given."""
        text = json.dumps(self.to_dict(), indent=1, default=str)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> Graph:
        """A graph from JSON text or from the path of a file holding it."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        return cls.from_dict(json.loads(text))
