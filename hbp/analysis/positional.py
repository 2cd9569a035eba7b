"""Bytes live in backward whatever the plan: gradients, parameter gradients, the outputs the
caller holds, and each node's backward scratch.

These are the terms of the simulator's accounting that no plan changes (the simulator,
`hbp.analysis.simulate`, counts them event by event with the same rules); the planner's cost
model (`hbp.planner.dp`) and the lower bound (`hbp.analysis.frontier`) read them from here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_call import kept_for_plan_call


class Positional(NamedTuple):
    """Plan-independent bytes of one training step.

    Attributes:
        at_backward: per node j, the bytes live at j's backward event (0 without one):
            gradients, parameter gradients, held outputs, j's backward scratch.
        late: per node j, the same bytes once j has released its output gradient, where j
            then sums a gradient out of place, into a broadcast one (NOTE [ A broadcast
            gradient is added out of place ] in hbp.analysis.simulate) or a parameter's
            (`Node.grad_sum_bytes`): the computed gradients and the sums beside them; -inf
            where j sums none. What j saved is released by then: a planner adds the saved
            bytes held after j's, not j's own.
        after: per position d in [0, n], the bytes live once the backward of the nodes
            >= d is done (after[n]: at the backward-start event).
        held_output_bytes: storage of the groups holding an output the caller keeps.
        seeds_let_go_bytes: storage of the grad seeds the caller lets go of once backward
            starts and that no node reads or saves (else counted as held: conservative).
    """

    at_backward: np.ndarray
    late: np.ndarray
    after: np.ndarray
    held_output_bytes: int
    seeds_let_go_bytes: int


def positional_bytes(info: GraphInfo) -> Positional:
    """The plan-independent bytes of `info`'s step (see `Positional`), made once per plan call
    (NOTE [ Facts kept for one plan call ] in hbp.analysis.plan_call: the cost model of every
    cut set and the lower bound read them; the arrays are shared and read-only)."""
    return kept_for_plan_call(info, "positional bytes", lambda: _positional_bytes(info))


def _positional_bytes(info: GraphInfo) -> Positional:
    facts = info.lists  # NOTE [ Event loops read Python lists ] in hbp.analysis.liveness
    root, storage_bytes = facts.root, facts.storage_bytes
    group_size: dict[int, int] = {
        j: storage_bytes[j] for j in range(info.n) if root[j] == j and storage_bytes[j]
    }
    held = set()  # groups with an output the caller holds
    held_to_end = set()  # ... that is not a seed let go
    used = set()  # groups a node reads or saves
    seed_let_go = info.seed_let_go.tolist()
    for j in range(info.n):
        r = root[j]
        if r in group_size:
            if facts.is_held[j]:
                held.add(r)
                if not seed_let_go[j]:
                    held_to_end.add(r)
            if facts.saves_output[j]:
                used.add(r)
        if facts.is_input[j]:
            continue
        used.update(root[v] for v in info.inputs[j])
        used.update(root[v] for v in info.saved[j])
    held_output_bytes = sum(group_size[r] for r in held)
    let_go = sum(group_size[r] for r in held - held_to_end - used)
    at_backward, late, after = _backward_terms(info, held_output_bytes, let_go)
    return Positional(at_backward, late, after, held_output_bytes, let_go)


def _backward_terms(info: GraphInfo, live: int, let_go: int) -> tuple[np.ndarray, ...]:
    """Gradients, parameter gradients, outputs and backward scratch live at each backward
    event, at its late sums and when the backward of nodes >= d is done. Same rules as the
    simulator."""
    n = info.n
    facts = info.lists
    grad_bytes = facts.grad_bytes
    size: list[int] = []
    refs: list[int] = []
    grad = [-1] * n

    def new(nbytes: int) -> int:
        size.append(nbytes)
        refs.append(1)
        return len(size) - 1

    seed_grad_held = info.seed_grad_held.tolist()
    for j in np.flatnonzero(info.grad_seed).tolist():
        grad[j] = new(grad_bytes[j])
        live += grad_bytes[j]
        if seed_grad_held[j]:  # NOTE [ A loss's gradient lives through backward ]
            refs[grad[j]] += 1
    at_backward = [0] * n
    late = [-math.inf] * n
    after = [0] * (n + 1)
    after[n] = live
    live -= let_go  # after the backward-start event, as the simulator
    for j in range(n - 1, -1, -1):
        if facts.has_backward[j]:
            scratch = facts.backward_scratch_bytes[j]
            broadcast = []  # NOTE [ A broadcast gradient is added out of place ]
            for v in info.inputs[j]:
                if not facts.receives_grad[v]:
                    continue
                passed = grad[j] >= 0 and v in info.passthrough[j]
                if grad[v] < 0:
                    if passed:
                        grad[v] = grad[j]
                        refs[grad[j]] += 1
                    else:
                        grad[v] = new(grad_bytes[v])
                        live += grad_bytes[v]
                    continue
                if refs[grad[v]] - (grad[v] == grad[j]) > 1:  # see the simulator
                    refs[grad[v]] -= 1
                    grad[v] = new(grad_bytes[v])
                    live += grad_bytes[v]
                    continue
                if size[grad[v]] < grad_bytes[v]:
                    broadcast.append(v)
                if not passed:  # the computed gradient, until added
                    scratch += grad_bytes[v]
            live += facts.param_grad_bytes[j]
            at_backward[j] = live + scratch
            if grad[j] >= 0:
                refs[grad[j]] -= 1
                if refs[grad[j]] == 0:
                    live -= size[grad[j]]
                grad[j] = -1
            if broadcast:  # summed out of place after the releases (see the simulator)
                late[j] = live + 2 * sum(grad_bytes[v] for v in broadcast)
                for v in broadcast:
                    held, grad[v] = grad[v], new(grad_bytes[v])
                    live += grad_bytes[v]
                    refs[held] -= 1
                    if refs[held] == 0:
                        live -= size[held]
            if facts.grad_sum_bytes[j]:  # added after the releases (see the simulator)
                late[j] = max(late[j], live + 2 * facts.grad_sum_bytes[j])
        after[j] = live
    return (
        np.array(at_backward, dtype=np.int64),
        np.array(late, dtype=float),
        np.array(after, dtype=np.int64),
    )
