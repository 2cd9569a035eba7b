"""What a capture produces: hbp's IR plus what the executor needs to run it (`CapturedGraph`),
at operator granularity (`OP`: an fx graph) or module granularity (`MODULE`: the fallback's
chain of child-module calls)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
import torch.fx._pytree as fx_pytree

from hbp.graph.ir import Graph, Node
from hbp.graph.torch.outputs import OutputSlot, map_output

OP = "op"


MODULE = "module"


@dataclass
class CapturedGraph:
    """A captured module: hbp's IR plus what the executor needs to run it.

    Attributes:
        graph: the IR (one node per value-producing fx node, in fx order; at module
            granularity an input node followed by one node per child module call).
        gm: the traced `torch.fx.GraphModule` (op granularity; None at module granularity).
            Its parameters and submodules are the module's own objects.
        granularity: "op" (fx graph) or "module" (fallback: child module calls).
        fx_nodes: at op granularity, `fx_nodes[i]` is the fx node of IR node i.
        input_names: forward parameter bound to each placeholder, in placeholder order.
        signature: `inspect.signature(module.forward)`.
        mutated_inputs: IR node name -> names of its input nodes it mutates in place.
        mutated_attrs: IR node name -> `get_attr` targets (buffers) it mutates in place.
        writes_own_intermediates: IR node names whose call writes in place into a tensor it
            made itself (not pinned: NOTE [ Buffers a recomputed forward writes ]).
        module_calls: at module granularity, (module path, occurrence) of IR node i + 1.
        module_groups: at module granularity, (path, occurrence, start, stop, child_starts)
            of each nn.Sequential call expanded into its children: IR nodes [start, stop) are
            the calls of its children (its i-th child's from child_starts[i]), a chain any
            run of which can be checkpointed as one function.
        fallback_reason: why op-level capture failed ("" at op granularity).
        capture_time_s: wall time of the capture in seconds.
        output_template: at op granularity, the forward's return value with `OutputSlot(i)`
            for the i-th value the graph returns (its output node returns a flat tuple).
        inlined_checkpoints: `torch.utils.checkpoint` calls in the forward, traced through.
        tracer: how the op-level graph was made: "fx" (symbolic tracing) or "export"
            (non-strict torch.export, `hbp.graph.torch.export`); "" at module granularity.
        in_spec: for "export" graphs, the pytree spec of `(args, kwargs)` whose leaves the
            placeholders are (None: placeholders are forward parameters, `input_names`).
        scratch_measured: whether the scratch fields of `graph`'s nodes hold the kernel
            workspace the allocator measured (`capture(..., calibrate=True)`, NOTE [ Captured
            under a profiler ]); False without calibration or when a profiler outside hbp
            kept it from measuring (the fields then count tensors only).
    """

    graph: Graph
    gm: fx.GraphModule | None
    granularity: str
    fx_nodes: list[fx.Node] = field(default_factory=list)
    input_names: list[str] = field(default_factory=list)
    signature: inspect.Signature | None = None
    mutated_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    mutated_attrs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    writes_own_intermediates: frozenset[str] = frozenset()
    module_calls: list[tuple[str, int]] = field(default_factory=list)
    module_groups: list[tuple[str, int, int, int, tuple[int, ...]]] = field(default_factory=list)
    fallback_reason: str = ""
    capture_time_s: float = 0.0
    output_template: Any = None
    inlined_checkpoints: int = 0
    tracer: str = ""
    in_spec: Any = None
    scratch_measured: bool = False

    def __post_init__(self) -> None:
        self._fx_index = {n: i for i, n in enumerate(self.fx_nodes)}

    def unflatten_output(self, flat: tuple) -> Any:
        """The module's return value, in its own containers, from the graph's flat outputs."""
        return map_output(self.output_template, OutputSlot, lambda slot: flat[slot.index])

    def placeholder_values(self, args: tuple, kwargs: dict) -> list[Any]:
        """The values of the graph's placeholders for a call `module(*args, **kwargs)`."""
        if self.in_spec is not None:
            return fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), self.in_spec)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return [bound.arguments[name] for name in self.input_names]

    def fx_node(self, name: str) -> fx.Node:
        """The fx node of the IR node called `name` (op granularity)."""
        return self.fx_nodes[self.graph.index(name)]

    def ir_index(self, node: fx.Node) -> int:
        """Position in the IR's topological order of the IR node made from fx `node`."""
        return self._fx_index[node]

    def ir_node(self, node: fx.Node) -> Node:
        return self.graph.nodes[self._fx_index[node]]
