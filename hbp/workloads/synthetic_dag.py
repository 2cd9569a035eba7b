"""A seeded random layered DAG of MLP nodes: the workload for theory and planner experiments.

`depth` layers of `width` nodes; node ids are `layer * width + position`. Every node of layer
l > 0 reads every node of layer l - 1, and each node two or more layers back with probability
`skip_prob` (a long skip); layer 0 reads the input. A node sums its inputs h and returns
LayerNorm(h + W2 gelu(W1 h)), with its own hidden size hidden x (1 + hidden_jitter x U(-1, 1)),
so per-node memory and cost vary. The output is the sum of the last layer's nodes; the loss
is the MSE to a random target.

width=1, skip_prob=0 is a chain; skip_prob=1 keeps every node alive until the end (frontier
growing linearly with depth). The graph depends only on `graph_seed`, the weights only on the
build seed. `blocks` has one block per layer; the state between blocks is the frontier: the
tuple of node outputs that later layers (or the readout) still read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hbp.workloads import require
from hbp.workloads.base import Batch


@dataclass(frozen=True)
class SyntheticDAGConfig:
    """depth layers x width nodes, long-skip probability skip_prob, per-node hidden size
    hidden +- hidden_jitter (fraction), node outputs of d_model features, batch_size rows;
    graph_seed picks the edges and hidden sizes."""

    depth: int = 8
    width: int = 2
    skip_prob: float = 0.2
    hidden: int = 128
    hidden_jitter: float = 0.5
    d_model: int = 64
    batch_size: int = 512
    graph_seed: int = 0

    def validate(self) -> None:
        for name in ("depth", "width", "hidden", "d_model", "batch_size"):
            value = getattr(self, name)
            require(value >= 1, name, value, "an integer >= 1")
        require(0.0 <= self.skip_prob <= 1.0, "skip_prob", self.skip_prob, "a number in [0, 1]")
        require(
            0.0 <= self.hidden_jitter < 1.0,
            "hidden_jitter",
            self.hidden_jitter,
            "a number in [0, 1)",
        )


PROFILES = {
    # Test-sized: 8 nodes, a step in a few thousandths of a second.
    "tiny": SyntheticDAGConfig(depth=4, hidden=32, d_model=16, batch_size=32),
    # 16 nodes, ~0.05 s per step on one CPU thread; activations ~10x the parameter gradients.
    "small": SyntheticDAGConfig(),
    # 96 nodes, 25M parameters; activations ~8x the parameter gradients.
    "medium": SyntheticDAGConfig(
        depth=32, width=3, skip_prob=0.1, hidden=512, d_model=256, batch_size=1024
    ),
    # 256 nodes, 67M parameters.
    "large": SyntheticDAGConfig(
        depth=64, width=4, skip_prob=0.05, hidden=512, d_model=256, batch_size=2048
    ),
}


@dataclass(frozen=True)
class LayeredDAG:
    """The graph: `edges` (src, dst) sorted by dst then src, `hidden[node]` sizes."""

    depth: int
    width: int
    edges: tuple[tuple[int, int], ...]
    hidden: tuple[int, ...]

    def layer(self, node: int) -> int:
        return node // self.width

    def layer_nodes(self, layer: int) -> list[int]:
        return list(range(layer * self.width, (layer + 1) * self.width))

    def inputs(self, node: int) -> list[int]:
        """Source nodes of `node` (empty for layer 0, which reads the model input)."""
        return [src for src, dst in self.edges if dst == node]

    def frontier(self, layer: int) -> list[int]:
        """Nodes of layers <= `layer` read after it: by a later layer, or by the readout
        when `layer` is the last. Sorted by node id."""
        if layer == self.depth - 1:
            return self.layer_nodes(layer)
        last_reader = {}
        for src, dst in self.edges:
            last_reader[src] = max(last_reader.get(src, -1), self.layer(dst))
        return sorted(n for n, reader in last_reader.items() if self.layer(n) <= layer < reader)


def random_layered_dag(cfg: SyntheticDAGConfig) -> LayeredDAG:
    """Edges and hidden sizes drawn from `random.Random(cfg.graph_seed)`."""
    rng = random.Random(cfg.graph_seed)
    width = cfg.width
    edges = []
    for layer in range(1, cfg.depth):
        for dst in range(layer * width, (layer + 1) * width):
            for src in range(layer * width):
                if src >= (layer - 1) * width or rng.random() < cfg.skip_prob:
                    edges.append((src, dst))
    hidden = tuple(
        max(1, round(cfg.hidden * (1.0 + cfg.hidden_jitter * rng.uniform(-1.0, 1.0))))
        for _ in range(cfg.depth * width)
    )
    return LayeredDAG(cfg.depth, width, tuple(edges), hidden)


class Node(nn.Module):
    """Sum of the inputs h [B, d_model] -> LayerNorm(h + fc2(gelu(fc1(h)))) [B, d_model]."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        h = inputs[0]
        for x in inputs[1:]:
            h = h + x
        return self.norm(h + self.fc2(F.gelu(self.fc1(h))))


class Layer(nn.Module):
    """One DAG layer: frontier tuple before it -> frontier tuple after it.

    `input_slots[k]` are the positions in the incoming state of node k's inputs;
    `output_slots` are positions in (incoming state + this layer's outputs) of the outgoing
    state. Both are fixed Python lists, so the forward traces to a static graph.
    """

    def __init__(self, nodes: list[Node], input_slots: list[list[int]], output_slots: list[int]):
        super().__init__()
        self.nodes = nn.ModuleList(nodes)
        self.input_slots = input_slots
        self.output_slots = output_slots

    def forward(self, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        outputs = [
            node([state[i] for i in slots]) for node, slots in zip(self.nodes, self.input_slots)
        ]
        pool = (*state, *outputs)
        return tuple(pool[i] for i in self.output_slots)


class SyntheticDAG(nn.Module):
    """x [B, d_model] -> sum of the last layer's node outputs [B, d_model]."""

    def __init__(self, cfg: SyntheticDAGConfig):
        super().__init__()
        self.graph = random_layered_dag(cfg)
        layers = []
        incoming: list[int] = [-1]  # node ids of the state; -1 is the model input
        for layer in range(cfg.depth):
            node_ids = self.graph.layer_nodes(layer)
            slots = [
                [incoming.index(src) for src in (self.graph.inputs(n) or [-1])] for n in node_ids
            ]
            outgoing = self.graph.frontier(layer)
            pool = incoming + node_ids
            nodes = [Node(cfg.d_model, self.graph.hidden[n]) for n in node_ids]
            layers.append(Layer(nodes, slots, [pool.index(n) for n in outgoing]))
            incoming = outgoing
        self.blocks = nn.ModuleList(layers)

    @property
    def edges(self) -> list[tuple[int, int]]:
        """(src, dst) node-id pairs; layer-0 nodes read the input, which is not a node."""
        return list(self.graph.edges)

    def frontier_sizes(self) -> list[int]:
        """Number of node outputs in the state after each block (one entry per layer)."""
        return [len(self.graph.frontier(layer)) for layer in range(self.graph.depth)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = (x,)
        for block in self.blocks:
            state = block(state)
        out = state[0]
        for y in state[1:]:
            out = out + y
        return out


def make_model(cfg: SyntheticDAGConfig) -> SyntheticDAG:
    return SyntheticDAG(cfg)


def make_batch(cfg: SyntheticDAGConfig, seed: int) -> Batch:
    """Standard-normal inputs and regression targets, [batch_size, d_model] each."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch_size, cfg.d_model, generator=generator)
    target = torch.randn(cfg.batch_size, cfg.d_model, generator=generator)
    return Batch(args=(x,), targets=target)


def loss_fn(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.mse_loss(output, batch.targets)


def derived_facts(cfg: SyntheticDAGConfig) -> dict:
    graph = random_layered_dag(cfg)
    return {
        "samples_per_batch": cfg.batch_size,
        "n_nodes": cfg.depth * cfg.width,
        "n_edges": len(graph.edges),
        "max_frontier": max(len(graph.frontier(layer)) for layer in range(cfg.depth)),
    }
