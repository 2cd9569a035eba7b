"""What both checkpointing executors (segments, module calls) share: the flat calling
convention of `torch.utils.checkpoint` and whether a recomputed range replays the RNG state."""

from __future__ import annotations

from torch.utils import _pytree as pytree

from hbp.graph.torch.captured import CapturedGraph


class FlatCall:
    """Calls `fn(*args, **kwargs)` with (args, kwargs) rebuilt from flat leaves."""

    def __init__(self, fn, spec):
        self.fn = fn
        self.spec = spec

    def __call__(self, *leaves):
        args, kwargs = pytree.tree_unflatten(list(leaves), self.spec)
        return self.fn(*args, **kwargs)


# NOTE [ Random state of recomputed segments ]
# `checkpoint(..., preserve_rng_state=True)` replays the random number generator's state in
# the recompute, so that dropout draws the forward's masks again. It costs memory: every
# checkpoint call keeps a copy of the state (on CPU the generator's state is a 5 KB CPU tensor;
# CUDA states live in host memory) for as long as its frame lives, and every recompute holds
# one more while it runs (`torch.random.fork_rng` restores the state afterwards). Deeply
# nested plans of small steps hold dozens of them. A segment none of whose nodes draws random
# numbers (`Node.draws_random`, recorded by the capture from the aten ops' tags) consumes no
# random numbers in its forward or its recompute, so the executor replays nothing for it
# (`preserve_rng_state=False`) and it costs nothing. A segment that contains a random node
# replays the state: a parent of such a segment contains it too, so the parent's recompute
# reaches the child's checkpoint with the generator where the forward had it.


def draws_random(captured: CapturedGraph, start: int, stop: int) -> bool:
    """Whether a node in [start, stop) of `captured`'s IR draws random numbers."""
    return any(node.draws_random for node in captured.graph.nodes[start:stop])
