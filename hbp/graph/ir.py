"""hbp's framework-neutral graph IR.

A `Graph` is the forward computation of one training step as a list of `Node`s in a
topological order (the order the forward runs them). Each node describes one value-producing
operation with what the memory model needs: the bytes of the new storage it creates, its
forward FLOPs, which values its backward keeps alive (saved tensors), and the parameter
gradients its backward creates. Nothing here imports torch or jax: torch capture
(`hbp.graph.torch_capture`) and jaxpr capture fill the same structure, and the planner and
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
        backward_flops: FLOPs of its backward (0 if unknown; default estimate 2x flops).
        requires_grad: whether the output takes part in backward.
        saved_inputs: names (subset of `inputs`) whose values this node's backward keeps.
        saves_output: whether this node's backward keeps its own output.
        saved_extra_bytes: bytes of fresh tensors saved only for backward.
        param_grad_bytes: bytes of parameter gradients this node's backward creates first
            (a parameter used by several nodes is charged to the last one in forward order).
        alias_of: name of the input whose storage the output shares, or None.
        is_input: a graph input (placeholder): allocated before the step, never recomputed.
        module: dotted path of the nn.Module (or scope) that produced it, for reports.
    """

    name: str
    op: str
    inputs: tuple[str, ...] = ()
    output_bytes: int = 0
    flops: float = 0.0
    backward_flops: float = 0.0
    requires_grad: bool = True
    saved_inputs: tuple[str, ...] = ()
    saves_output: bool = False
    saved_extra_bytes: int = 0
    param_grad_bytes: int = 0
    alias_of: str | None = None
    is_input: bool = False
    module: str = ""

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient of this node's output during backward."""
        return self.output_bytes if self.requires_grad else 0


@dataclass
class Graph:
    """A forward graph in topological order.

    Attributes:
        nodes: the nodes, in the order forward runs them (inputs first).
        outputs: names of the values the graph returns.
        meta: free-form facts about the capture (framework, granularity, warnings).
    """

    nodes: list[Node]
    outputs: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, name: str) -> int:
        """Position of the node called `name` in the topological order."""
        return self._index[name]

    def node(self, name: str) -> Node:
        return self.nodes[self._index[name]]

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
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Graph:
        names = {f.name for f in fields(Node)}
        nodes = []
        for raw in d["nodes"]:
            kw = {k: v for k, v in raw.items() if k in names}
            kw["inputs"] = tuple(kw.get("inputs", ()))
            kw["saved_inputs"] = tuple(kw.get("saved_inputs", ()))
            nodes.append(Node(**kw))
        return cls(nodes, list(d.get("outputs", [])), dict(d.get("meta", {})))

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
