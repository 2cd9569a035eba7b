"""The seeded random layered DAG of hbp/workloads/synthetic_dag.py in plain JAX: the same
`SyntheticDAGConfig`, profiles and graph (`random_layered_dag`: edges and hidden sizes from
`graph_seed`), the same block structure (one block per layer; the state between blocks is the
frontier tuple of node outputs still read later) and the same loss (MSE to a random target).

A node sums its inputs h and returns LayerNorm(h + fc2(gelu(fc1(h)))); weights are drawn (NumPy generator) as
torch's `nn.Linear` draws them (uniform in +-1/sqrt(fan_in), biases too), LayerNorm gains one.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hbp.workloads.jax.base import JaxWorkload, param_facts
from hbp.workloads.jax.gpt2 import layer_norm, linear
from hbp.workloads.synthetic_dag import (
    LayeredDAG,
    SyntheticDAGConfig,
    derived_facts,
    random_layered_dag,
)

__all__ = ["SyntheticDAGConfig", "make_workload"]


@dataclasses.dataclass(frozen=True)
class LayerSlots:
    """One layer's wiring, as the torch `Layer`: `input_slots[k]` are the positions in the
    incoming state of node k's inputs; `output_slots` the positions in (incoming state + this
    layer's outputs) of the outgoing state."""

    input_slots: tuple[tuple[int, ...], ...]
    output_slots: tuple[int, ...]


def layer_slots(graph: LayeredDAG) -> list[LayerSlots]:
    """The wiring of every layer (the same as `hbp.workloads.synthetic_dag.SyntheticDAG`)."""
    layers, incoming = [], [-1]  # node ids of the state; -1 is the model input
    for layer in range(graph.depth):
        node_ids = graph.layer_nodes(layer)
        slots = tuple(
            tuple(incoming.index(src) for src in (graph.inputs(n) or [-1])) for n in node_ids
        )
        outgoing = graph.frontier(layer)
        pool = incoming + node_ids
        layers.append(LayerSlots(slots, tuple(pool.index(n) for n in outgoing)))
        incoming = outgoing
    return layers


def node(p: dict, inputs: list):
    """Sum of the inputs h [B, d] -> LayerNorm(h + fc2(gelu(fc1(h)))) [B, d]."""
    h = inputs[0]
    for x in inputs[1:]:
        h = h + x
    return layer_norm(p["norm"], h + linear(p["fc2"], jax.nn.gelu(linear(p["fc1"], h), False)))


def layer(slots: LayerSlots, p: dict, state: tuple) -> tuple:
    """Frontier tuple before the layer -> frontier tuple after it."""
    outputs = [
        node(node_p, [state[i] for i in ins]) for node_p, ins in zip(p["nodes"], slots.input_slots)
    ]
    pool = (*state, *outputs)
    return tuple(pool[i] for i in slots.output_slots)


def embed(params, x, target) -> tuple:
    return (x,)


def head(params, state: tuple, x, target):
    """Sum of the last layer's node outputs; mean squared error to `target`."""
    out = state[0]
    for y in state[1:]:
        out = out + y
    return jnp.mean(jnp.square(out - target))


def init_params(cfg: SyntheticDAGConfig, graph: LayeredDAG, rng: np.random.Generator) -> dict:
    def lin(n_in, n_out):
        bound = 1.0 / math.sqrt(n_in)

        def uniform(shape):
            return rng.uniform(-bound, bound, shape).astype(np.float32)

        return {"weight": uniform((n_in, n_out)), "bias": uniform((n_out,))}

    def one_node(n: int) -> dict:
        hidden = graph.hidden[n]
        return {
            "fc1": lin(cfg.d_model, hidden),
            "fc2": lin(hidden, cfg.d_model),
            "norm": {
                "weight": np.ones(cfg.d_model, np.float32),
                "bias": np.zeros(cfg.d_model, np.float32),
            },
        }

    return {
        "blocks": [{"nodes": [one_node(n) for n in graph.layer_nodes(i)]} for i in range(cfg.depth)]
    }


def make_batch(cfg: SyntheticDAGConfig, rng: np.random.Generator) -> tuple:
    """(x, target): standard-normal inputs and regression targets, [batch_size, d_model]."""
    shape = (cfg.batch_size, cfg.d_model)
    x = rng.standard_normal(shape, dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


def make_workload(cfg: SyntheticDAGConfig, profile: str, params_rng, batch_rng) -> JaxWorkload:
    graph = random_layered_dag(cfg)
    params = init_params(cfg, graph, params_rng)
    facts = dataclasses.asdict(cfg)
    facts.update(param_facts(params))
    facts["n_blocks"] = cfg.depth
    facts.update(derived_facts(cfg))
    return JaxWorkload(
        name="synthetic_dag",
        profile=profile,
        params=params,
        batch=make_batch(cfg, batch_rng),
        embed=embed,
        blocks=[partial(layer, slots) for slots in layer_slots(graph)],
        head=head,
        config=facts,
    )
