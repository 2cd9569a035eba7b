"""A graph-break guard that fails: the step runs the plain forward (NOTE [ A failed guard ])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hbp.graph.torch.breaks import GraphBreakGuardError

# NOTE [ A failed guard ]
# A Python branch on tensor data whose other side raises (an input check) is captured as the
# example took it, with a `guard` node (NOTE [ Data-dependent ops ] in hbp/graph/torch/
# breaks.py). A step whose data takes the other branch cannot follow the graph. As Dynamo does
# when a guard fails, that step does not use the graph: the module's own forward runs instead,
# so what the caller sees is the model's behaviour (its own exception, or the other branch's
# result where the model catches it), with a warning once; the plan stays for the steps whose
# data keeps the guard. The executor may have run part of the forward before the guard: the
# random number generators and the module's buffers (running statistics) are put back first,
# so the plain step draws the same dropout masks and updates the statistics once, as a plain
# step from the same state would. A step of a graph without guards keeps nothing.


def has_guards(captured) -> bool:
    """Whether a captured graph holds a guard node."""
    return any(node.op == "guard" for node in captured.graph.nodes)


def run_or_plain(
    run: Callable[[], Any],
    plain: Callable[[], Any],
    root: nn.Module,
    devices: list[int],
    warn: Callable[[str], None],
) -> Any:
    """`run()`; where a guard fails in it, `plain()` from the state before `run()` (the CPU
    and CUDA `devices` generators, `root`'s buffers) with `warn(message)`."""
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    cpu_state = torch.get_rng_state()
    cuda_states = [(d, torch.cuda.get_rng_state(d)) for d in devices]
    try:
        return run()
    except GraphBreakGuardError as err:
        message = str(err)
    torch.set_rng_state(cpu_state)
    for d, state in cuda_states:
        torch.cuda.set_rng_state(state, d)
    with torch.no_grad():
        for b, value in buffers:
            b.copy_(value)
    warn(
        f"HCModule: {message}. This step runs the module's own forward (no plan); the plan "
        "stays for inputs that keep the captured branch."
    )
    return plain()
