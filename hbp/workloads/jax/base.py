"""What a JAX workload is: parameters (a pytree, random init from a seed), a seeded batch and
the step's loss, split the way the torch workloads' `model.blocks` contract splits a model
(hbp/workloads/base.py): an embedding, a chain of blocks, a head that returns the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np


@dataclass
class JaxWorkload:
    """Parameters, batch and loss of one JAX workload.

    Contract:
        `loss(params, *batch)` = `head(params, state, *batch)` where `state` is
        `embed(params, *batch)` passed through `blocks[i](params["blocks"][i], state)` in
        order; `state` is an array or a tuple of arrays. A mode may run consecutive blocks as
        one segment under a transformation (`loss(..., segments=..., wrap=jax.checkpoint)`).

    Attributes:
        name / profile: registry keys ("gpt2", "small").
        params: the parameter pytree (float32); `params["blocks"]` is a list, one per block.
        batch: the loss's arguments after `params` (arrays: inputs and targets).
        embed / blocks / head: the pieces of the loss (pure functions, static structure).
        config: the numbers that define the model and batch (for metrics.json), as the torch
            workload's `config` (`params`, `param_bytes`, `n_blocks`, derived facts).
    """

    name: str
    profile: str
    params: Any
    batch: tuple
    embed: Callable
    blocks: Sequence[Callable]
    head: Callable
    config: dict = field(default_factory=dict)

    def loss(self, params, *batch, segments=None, wrap=None):
        """The scalar loss. With `segments` ([start, stop) bounds tiling the blocks) and
        `wrap` (e.g. `jax.checkpoint`), each segment of blocks runs as one `wrap`ped call."""
        state = self.embed(params, *batch)
        bounds = segments or [(i, i + 1) for i in range(len(self.blocks))]
        for start, stop in bounds:
            run = self._segment(start, stop)
            state = (wrap(run) if wrap is not None else run)(params["blocks"][start:stop], state)
        return self.head(params, state, *batch)

    def loss_and_aux(self, params, *batch, **kwargs):
        """(loss, loss): for `jax.grad(..., has_aux=True)`, so a step returns its loss too."""
        loss = self.loss(params, *batch, **kwargs)
        return loss, loss

    def _segment(self, start: int, stop: int) -> Callable:
        blocks = self.blocks[start:stop]

        def run(block_params, state):
            for block, p in zip(blocks, block_params):
                state = block(p, state)
            return state

        return run


def param_facts(params) -> dict:
    """`params` (element count) and `param_bytes` of a parameter pytree."""
    leaves = jax.tree.leaves(params)
    return {
        "params": int(sum(x.size for x in leaves)),
        "param_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
    }


def params_from_torch(module, *, keep_layout: Sequence[str] = ()) -> dict:
    """The parameters of a torch module as the JAX workloads lay them out: nested dicts by
    the dotted parameter names (numeric parts become list indices), 2-D `Linear` weights
    transposed to [in, out] (the JAX blocks compute `x @ w`), except the names ending in one
    of `keep_layout` (embeddings). Tied weights appear once, under their first name. Used to
    check that a JAX workload computes the same loss as its torch twin."""
    out: dict = {}
    for name, p in module.named_parameters():
        value = p.detach().cpu().numpy()
        is_linear = value.ndim == 2 and not any(name.endswith(k) for k in keep_layout)
        _assign(out, name.split("."), np.ascontiguousarray(value.T if is_linear else value))
    return _lists(out)


def _assign(tree: dict, parts: list[str], value) -> None:
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = jax.numpy.asarray(value)


def _lists(tree):
    """Dicts whose keys are all digits become lists (in index order)."""
    if not isinstance(tree, dict):
        return tree
    if tree and all(k.isdigit() for k in tree):
        return [_lists(tree[k]) for k in sorted(tree, key=int)]
    return {k: _lists(v) for k, v in tree.items()}
