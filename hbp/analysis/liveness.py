"""Liveness facts of a graph that every memory computation shares.

`GraphInfo` turns a `Graph` into index-based arrays once (users, storage roots of aliases,
who receives a gradient, what each node's backward saves), checking the IR's invariants on
the way. The simulator, the frontier analysis and the planners all read these arrays, so the
rules below hold everywhere:

- A value's *storage root* is the first value in its `alias_of` chain; views and in-place
  results share their root's storage and cost nothing themselves. Graph inputs (`is_input`)
  exist before the step: their storage costs nothing and is never freed or recomputed.
- A node *receives a gradient* when it requires grad and is a graph output or an input of a
  node that receives one; a non-input node that receives a gradient *has a backward*. Only
  nodes with a backward save anything (`saved_inputs`, `saves_output`, `saved_extra_bytes`)
  or create parameter gradients: a node whose output never reaches a graph output is dead for
  autograd, as in a traced joint graph.
- A node is a *save event* when it has a backward and saves something: that is what
  torch.utils.checkpoint's non-reentrant early stop counts (see `hbp.analysis.simulate`).

Refinements a capture records on the nodes (`hbp.graph.ir.Node`, all optional):
`forward_scratch_bytes` / `backward_scratch_bytes` (scratch a node holds only while its
forward / backward runs: kernel workspace, intermediates of composite ops), `grad_bytes` (a
gradient's size where it differs from the value's storage) and `grad_passthrough` (inputs
whose gradient *is* the node's output gradient, as for add or views: no new allocation).
Graphs carrying them under the legacy `graph.meta` keys are upgraded first
(`Graph.adopt_legacy_meta`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

from hbp.graph.ir import Graph

# NOTE [ A loss's gradient lives through backward ]
# `loss.backward()` makes the gradient backward starts from (`torch.ones_like(loss)`, in
# `torch.autograd.backward`) and holds it in its own frame until the engine returns, so its
# bytes are live at every backward event, the last one (where a "min" plan often peaks, every
# parameter gradient made) included: 4 bytes for a float32 loss, which the allocator measured
# above a plan that freed it after the loss's own backward. A gradient that reaches a
# non-scalar output through the caller's graph is the engine's, freed once used. A graph
# that says how its caller trains (`Graph.held_outputs` set: HCModule's and `hbp.estimate`'s
# captures) holds a scalar seed's gradient to the end; a graph without (synthetic, JAX) keeps
# the engine's rule for every seed.


# NOTE [ A write into a view reaches backward through its base ]
# `out[:, t] = f(state)` in a loop (transformers' RWKV on CPU) is captured as a view of `out` and
# an in-place `copy_` into it; the ops after the loop read `out` itself, not the write, so by
# users alone the written values have no backward, and nothing the recurrence saves was counted
# (RWKV: the plain step a third above the prediction, a budget missed by 27%). An in-place write
# (`Node.writes_in_place`, with `alias_of`) has a backward where a later node with one reads its
# storage root. Such a write also pins the plan: a recomputed segment that starts after the
# written storage is made and holds the write would clone that storage to run it again
# (`hbp.runtime.executors.segments`), memory no plan counts, so no cut falls between a storage
# made in the graph and its last in-place write (`GraphInfo.no_cut`; buffers, which are graph
# inputs, are not pinned). The loop is then one unit, recomputed whole or kept.


# NOTE [ Event loops read Python lists ]
# The simulator's interpreter reads about ten facts of a node per event, one element at a
# time. An element of a numpy array read from Python is a new numpy scalar on every read, and
# arithmetic on it is numpy's, several times the cost of a list item and an int; so the loops
# that walk a graph event by event read `GraphInfo.lists`, the arrays they need as Python
# lists, made once per GraphInfo. The arrays stay the source: whole-graph arithmetic
# (cumulative sums, masks) is numpy's.


class NodeLists(NamedTuple):
    """`GraphInfo`'s per-node arrays that the event loops read, as Python lists (same names,
    same meaning; NOTE [ Event loops read Python lists ])."""

    is_input: list[bool]
    root: list[int]
    storage_bytes: list[int]
    is_held: list[bool]
    receives_grad: list[bool]
    has_backward: list[bool]
    grad_bytes: list[int]
    saves_output: list[bool]
    extra_bytes: list[int]
    param_grad_bytes: list[int]
    save_event: list[bool]
    flops: list[float]
    forward_scratch_bytes: list[int]
    backward_scratch_bytes: list[int]
    grad_sum_bytes: list[int]
    stop_flops: list[float]
    runs_at_stop: list[bool]
    next_save: list[int]


@dataclass
class GraphInfo:
    """Index-based view of a graph (node i = graph.nodes[i]); sizes in bytes, costs in FLOPs.

    Attributes:
        n: number of nodes.
        names: node names.
        inputs: per node, the distinct indices of the values it reads, in order.
        users: per node, the distinct indices of the nodes that read it, ascending.
        last_user: per node, the largest user index, or -1.
        root: per node, the index of its storage root (itself unless it is an alias).
        storage_bytes: per node, bytes of new storage it allocates (0 for aliases and inputs).
        is_input / is_output: graph inputs / graph outputs.
        grad_seed: outputs whose gradient backward starts with (`Graph.grad_outputs`).
        is_held: outputs the caller holds (`Graph.held_outputs`, and every grad seed): the
            other outputs are freed like any value once nothing needs them.
        seed_let_go: grad seeds the caller lets go of once backward has started (grad seeds
            not in `Graph.held_outputs`, other than a scalar loss): held through the forward
            and the backward-start event, then freed when nothing else holds them.
        seed_grad_held: grad seeds whose gradient lives until backward returns (NOTE
            [ A loss's gradient lives through backward ]).
        receives_grad / has_backward: see the module docstring.
        grad_bytes: per node, bytes of its output gradient (0 unless it receives one).
        saved: per node, the indices of the inputs its backward keeps (empty without backward).
        saves_output: per node, whether its backward keeps its own output.
        extra_bytes: per node, fresh bytes saved only for its backward.
        param_grad_bytes: per node, parameter-gradient bytes its backward creates.
        save_event: per node, has a backward and saves something.
        flops / backward_flops: forward and backward FLOPs (backward defaults to 2x forward).
        forward_scratch_bytes / backward_scratch_bytes: per node, scratch bytes live only during its
            forward / backward event.
        grad_sum_bytes: per node, `Node.grad_sum_bytes`: live twice over (the sum and the
            computed gradient) once its backward has released what it saved and its output
            gradient.
        passthrough: per node, the inputs (indices) that receive its output gradient itself.
        stop_flops: per node, the FLOPs it runs when a recompute pass early-stops at it
            (`Node.flops_after_last_save` do not run).
        runs_at_stop: per node, whether a recompute pass that early-stops at it runs it at
            all (False: its last save is one of its inputs, packed before any of it runs, so
            it makes nothing: `Node.output_after_last_save` and no FLOPs before the save).
        draws_random: per node, whether it draws from the random number generator (a
            recomputed segment that contains one keeps generator states: `Graph.rng_state_bytes`
            bytes each, NOTE [ Generator states of checkpoints ] in `hbp.analysis.simulate`).
        rng_state_bytes: `Graph.rng_state_bytes`.
        next_save: per position t in [0, n], the first save event at or after t (n if none).
        random_before: per position t in [0, n], how many nodes before t draw random numbers.
        no_cut: per position c in [0, n], whether a segment starting at c would write in place
            into a storage made before it (NOTE [ A write into a view reaches backward through
            its base ]): the planners never cut there.
    """

    n: int
    names: list[str]
    inputs: list[tuple[int, ...]]
    users: list[tuple[int, ...]]
    last_user: np.ndarray
    root: np.ndarray
    storage_bytes: np.ndarray
    is_input: np.ndarray
    is_output: np.ndarray
    grad_seed: np.ndarray
    is_held: np.ndarray
    seed_let_go: np.ndarray
    seed_grad_held: np.ndarray
    receives_grad: np.ndarray
    has_backward: np.ndarray
    grad_bytes: np.ndarray
    saved: list[tuple[int, ...]]
    saves_output: np.ndarray
    extra_bytes: np.ndarray
    param_grad_bytes: np.ndarray
    save_event: np.ndarray
    flops: np.ndarray
    backward_flops: np.ndarray
    forward_scratch_bytes: np.ndarray
    backward_scratch_bytes: np.ndarray
    grad_sum_bytes: np.ndarray
    passthrough: list[tuple[int, ...]]
    stop_flops: np.ndarray
    runs_at_stop: np.ndarray
    draws_random: np.ndarray
    rng_state_bytes: int
    next_save: np.ndarray
    random_before: np.ndarray
    no_cut: np.ndarray

    @classmethod
    def of(cls, graph: Graph) -> GraphInfo:
        """Check `graph` against the IR's invariants and index it.

        Raises:
            ValueError: duplicate names, an input that is not an earlier node, an `alias_of`
                or `saved_inputs` entry that is not among the node's inputs, negative sizes,
                or an unknown output name.
        """
        nodes = graph.adopt_legacy_meta().nodes
        n = len(nodes)
        index: dict[str, int] = {}
        for i, node in enumerate(nodes):
            if node.name in index:
                raise ValueError(f"graph: duplicate node name {node.name!r}")
            index[node.name] = i
        inputs: list[tuple[int, ...]] = []
        users: list[list[int]] = [[] for _ in range(n)]
        saved: list[tuple[int, ...]] = []
        roots = list(range(n))
        for i, node in enumerate(nodes):
            ins: list[int] = []
            for name in node.inputs:
                j = index.get(name)
                if j is None or j >= i:
                    raise ValueError(
                        f"graph: node {node.name!r} reads {name!r}, which is not an earlier node "
                        "(nodes must be in topological order)"
                    )
                if j not in ins:
                    ins.append(j)
            inputs.append(tuple(ins))
            for j in ins:
                users[j].append(i)
            if node.alias_of is not None:
                if node.alias_of not in node.inputs:
                    raise ValueError(
                        f"graph: node {node.name!r} has alias_of={node.alias_of!r}, "
                        "which is not one of its inputs"
                    )
                roots[i] = roots[index[node.alias_of]]
            for name in node.saved_inputs:
                if name not in node.inputs:
                    raise ValueError(
                        f"graph: node {node.name!r} saves {name!r}, which is not one of its inputs"
                    )
            sizes = (node.output_bytes, node.saved_extra_bytes, node.param_grad_bytes)
            scratch = (node.forward_scratch_bytes, node.backward_scratch_bytes, node.grad_sum_bytes)
            if min(*sizes, *scratch, node.gradient_bytes) < 0:
                raise ValueError(f"graph: node {node.name!r} has a negative byte count")
            saved.append(tuple(dict.fromkeys(index[s] for s in node.saved_inputs)))
        root = np.array(roots, dtype=np.int64)
        is_output = np.zeros(n, dtype=bool)
        for name in graph.outputs:
            if name not in index:
                raise ValueError(f"graph: output {name!r} is not a node")
            is_output[index[name]] = True

        is_input = np.array([nd.is_input for nd in nodes], dtype=bool)
        seeds = graph.backward_seeds()
        grad_seed = np.array([nd.name in seeds for nd in nodes], dtype=bool)
        is_held = is_output.copy()
        seed_let_go = np.zeros(n, dtype=bool)
        seed_grad_held = np.zeros(n, dtype=bool)
        if graph.held_outputs is not None:
            held_names = set(graph.held_outputs)
            listed = np.array([nd.name in held_names for nd in nodes], dtype=bool)
            is_held &= listed | grad_seed
            # a scalar seed is the loss the caller calls .backward() on: alive until backward
            # returns (CPU mse_loss's 0-dim result holds the elementwise loss's whole storage)
            scalar = np.array([nd.gradient_bytes <= 8 for nd in nodes], dtype=bool)
            seed_let_go = grad_seed & ~listed & ~scalar
            seed_grad_held = grad_seed & scalar  # NOTE [ A loss's gradient lives through backward ]
        # NOTE [ A write into a view reaches backward through its base ]
        writes = np.array(
            [nd.writes_in_place and nd.alias_of is not None for nd in nodes], dtype=bool
        )
        receives, backward = [False] * n, [False] * n
        # by storage root: whether a later node with a backward reads it
        read_later = [False] * n
        seed, writes_at = grad_seed.tolist(), writes.tolist()
        for i in range(n - 1, -1, -1):
            flows = seed[i] or any(backward[u] for u in users[i])
            if not flows and writes_at[i]:
                flows = read_later[roots[i]]
            if nodes[i].requires_grad and flows:
                receives[i] = True
                backward[i] = not nodes[i].is_input
                for j in inputs[i]:
                    read_later[roots[j]] = True
        receives_grad = np.array(receives, dtype=bool)
        has_backward = np.array(backward, dtype=bool)
        for i in range(n):
            if not backward[i]:
                saved[i] = ()
        saves_output = np.array([nd.saves_output for nd in nodes], dtype=bool) & has_backward
        extra = np.array([nd.saved_extra_bytes for nd in nodes], dtype=np.int64) * has_backward
        storage = np.array(
            [0 if (nd.alias_of is not None or nd.is_input) else nd.output_bytes for nd in nodes],
            dtype=np.int64,
        )
        grad_bytes = np.array([nd.gradient_bytes for nd in nodes], dtype=np.int64)
        grad_bytes *= receives_grad
        forward_scratch_bytes = np.array([nd.forward_scratch_bytes for nd in nodes], np.int64)
        backward_scratch_bytes = np.array([nd.backward_scratch_bytes for nd in nodes], np.int64)
        backward_scratch_bytes *= has_backward
        grad_sum_bytes = np.array([nd.grad_sum_bytes for nd in nodes], np.int64) * has_backward
        passthrough = [
            tuple(index[v] for v in nd.grad_passthrough if v in index and v in nd.inputs)
            if has_backward[i]
            else ()
            for i, nd in enumerate(nodes)
        ]
        param_grad = np.array([nd.param_grad_bytes for nd in nodes], dtype=np.int64)
        flops = np.array([0.0 if nd.is_input else nd.flops for nd in nodes], dtype=float)
        bwd = np.array(
            [2.0 * nd.flops if nd.backward_flops is None else nd.backward_flops for nd in nodes],
            dtype=float,
        )
        save_event = has_backward & (
            np.array([len(s) > 0 for s in saved], dtype=bool) | saves_output | (extra > 0)
        )
        last_user = np.array([u[-1] if u else -1 for u in users], dtype=np.int64)
        after_save = np.array([nd.flops_after_last_save for nd in nodes], dtype=float)
        stop_flops = np.clip(flops - after_save, 0.0, None)
        runs_at_stop = ~np.array([nd.output_after_last_save for nd in nodes], dtype=bool)
        runs_at_stop |= stop_flops > 0
        draws_random = np.array([nd.draws_random for nd in nodes], dtype=bool) & ~is_input
        # the least save event at or after each position: a running minimum from the end
        saves_at = np.where(save_event, np.arange(n), n)
        next_save = np.append(np.minimum.accumulate(saves_at[::-1])[::-1], n).astype(np.int64)
        no_cut = np.zeros(n + 1, dtype=bool)
        for i in np.flatnonzero(writes).tolist():
            if not is_input[root[i]]:
                no_cut[root[i] + 1 : i + 1] = True
        return cls(
            n=n,
            names=[nd.name for nd in nodes],
            inputs=inputs,
            users=[tuple(u) for u in users],
            last_user=last_user,
            root=root,
            storage_bytes=storage,
            is_input=is_input,
            is_output=is_output,
            grad_seed=grad_seed,
            is_held=is_held,
            seed_let_go=seed_let_go,
            seed_grad_held=seed_grad_held,
            receives_grad=receives_grad,
            has_backward=has_backward,
            grad_bytes=grad_bytes,
            saved=saved,
            saves_output=saves_output,
            extra_bytes=extra,
            param_grad_bytes=param_grad * has_backward,
            save_event=save_event,
            flops=flops,
            backward_flops=bwd * has_backward,
            forward_scratch_bytes=forward_scratch_bytes * ~is_input,
            backward_scratch_bytes=backward_scratch_bytes,
            grad_sum_bytes=grad_sum_bytes,
            passthrough=passthrough,
            stop_flops=stop_flops,
            runs_at_stop=runs_at_stop,
            draws_random=draws_random,
            rng_state_bytes=int(graph.rng_state_bytes) if draws_random.any() else 0,
            next_save=next_save,
            random_before=np.concatenate([[0], np.cumsum(draws_random)]).astype(np.int64),
            no_cut=no_cut,
        )

    @cached_property
    def lists(self) -> NodeLists:
        """The per-node arrays the event loops read, as Python lists, made once (NOTE
        [ Event loops read Python lists ])."""
        return NodeLists(*(getattr(self, name).tolist() for name in NodeLists._fields))

    def keeps_rng_state(self, start: int, stop: int) -> bool:
        """Whether a recomputed segment [start, stop) keeps copies of the generator's state:
        a node in it draws random numbers and a state costs bytes."""
        return self.rng_state_bytes > 0 and self.random_before[stop] > self.random_before[start]

    def segment_inputs(self, start: int, stop: int) -> list[int]:
        """Values a segment [start, stop) reads that it does not produce itself: values made
        before `start` and graph inputs (which are never recomputed), ascending."""
        is_input = self.lists.is_input
        seen: set[int] = set()
        for j in range(start, stop):
            if is_input[j]:
                continue
            for v in self.inputs[j]:
                if v < start or is_input[v]:
                    seen.add(v)
        return sorted(seen)
