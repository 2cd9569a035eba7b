"""The memory simulator: what one training step of a graph under a plan allocates, and when.

This is the ground truth the planners are tested against. It interprets a `Plan` over a
`Graph` event by event, with the execution semantics stated in `hbp.graph.ir` and made
precise here the way nested `torch.utils.checkpoint(use_reentrant=False)` runs them:

Forward (the original pass) runs every node once. Each run of a node is one event: its new
storage is allocated (nothing for aliases and graph inputs), then, if it runs with saving
on and has a backward, its saved inputs, its output (`saves_output`) and `saved_extra_bytes`
are held until its backward. The live bytes are recorded, then the node's inputs whose last
use in the pass this was are released. Storage is freed when nothing holds it any more:
pending forward uses in the current pass, a backward that saved it, a recomputed segment that
holds it as an input, or being a graph output the caller holds (`Graph.held_outputs`: held
for the whole step). Aliases share their root's storage, so any hold on an alias holds the
root.

Plain segments run with saving on. Entering a recomputed segment holds its inputs (values made
before it, and graph inputs, that its nodes read) until its backward is done; its nodes run
with saving off, and nested children change nothing in that pass.

Backward processes the top-level segments in reverse. A plain segment backpropagates its
nodes in reverse. A recomputed segment first backpropagates its *tail*, the nodes after its
last save event (they save nothing, so their backward needs no recompute: NOTE [ Recompute at
the first unpack ]); then runs a recompute pass over its children (a plain child saves; a
recomputed child is entered and runs with saving off), whose values are new storage; then it
processes its children in reverse the same way (recursively, the tail being done); then it
releases its inputs. A recompute pass follows torch's non-reentrant *early stop*: it ends right
after the pass's last save event (a node of a plain child that saves something, or entering a
recomputed child that has inputs); the nodes after it do not run, nor does that node itself
when it saves only inputs (NOTE [ Early stop at the last pack ]), and values the pass made
that are not held are freed when it stops. A segment without save events has no pass at all.

At node j's backward (only nodes with a backward, see `hbp.analysis.liveness`): the gradient
of j's output is live; j allocates the gradients of its inputs that receive one and do not
have one yet and its parameter gradients (kept to the end of the
step); the event is recorded; then j releases what it saved and frees its output gradient.
Gradients of graph inputs are kept to the end of the step. Graph outputs' gradients are
allocated when backward starts. An input that j passes its gradient through
(`grad_passthrough`) and that has no gradient yet takes j's output gradient itself (shared
storage, nothing new). Accumulating into an input's gradient is in place (the gradient j
computes for it is live during j's event and added after it: scratch of the event; a
passed-through one is j's own) unless that gradient's storage is also another value's
gradient (shared by passthrough; j's own output gradient, which j lets go of before autograd
accumulates, does not count): then, like autograd's input buffer, the sum is new storage and
the input lets go of the shared one; or unless that gradient is a broadcast (NOTE [ A
broadcast gradient is added out of place ]). A parameter gradient added out of place
(`Node.grad_sum_bytes`) is added after j has released what it saved and its output gradient:
the event's bytes are the higher of those during j's backward and those then.
Scratch bytes a capture recorded (`Node.forward_scratch_bytes`,
`Node.backward_scratch_bytes`) are live during the node's forward (every run of it) / backward
event only. A node that runs with saving off still allocates its `saved_extra_bytes` (a
dropout mask, an attention logsumexp: the op makes them, the checkpoint's pack hook drops
them): they are scratch of that event. Checkpoints of segments that draw random numbers keep
copies of the generator's state (NOTE [ Generator states of checkpoints ]). A recomputed
segment's pinned nodes keep their outputs from the pass that last ran its forward (the
original forward, or its parent's recompute pass) for its own recompute pass (NOTE [ Pinned
values ]).

The peak is the largest recorded live-byte count, above the level before the step.

This module states the rules (here and in its NOTEs) and is the entry point; the event
interpreter is `hbp.analysis.interpreter`, the plan protocols and their checks (tiling, pins)
`hbp.analysis.plan_shape`.
"""

from __future__ import annotations

from hbp.analysis.interpreter import BACKWARD, FORWARD, RECOMPUTE, Simulation, StepInterpreter
from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_shape import (
    PlanLike,
    SegmentLike,
    Whole,
    check_pins,
    check_tiling,
    pins_of,
)
from hbp.graph.ir import Graph

__all__ = [
    "BACKWARD",
    "FORWARD",
    "RECOMPUTE",
    "PlanLike",
    "SegmentLike",
    "Simulation",
    "check_pins",
    "check_tiling",
    "naive_peak",
    "pins_of",
    "simulate",
]

# NOTE [ Early stop at the last pack ]
# Non-reentrant checkpoint's early stop raises in the pack hook of the last tensor the
# forward saved. Autograd packs an op's saved inputs before the op runs and its saved outputs
# after, so a recompute pass that stops at a node spends only the FLOPs before its last save
# (`Node.flops_after_last_save`, measured at capture: a Linear that saves only its input
# runs none of its matmul), and when nothing of the node runs before that save
# (`GraphInfo.runs_at_stop` False) the node makes nothing: its saved inputs are held, its
# output and scratch are never allocated. Otherwise its event is counted whole (its output
# may in fact come after the save: a conservative bound). Graphs without these capture facts
# run the node whole. The DP's pass costs (`CostModel.interval`: `until_run`,
# `flops_until`) count the same.

# NOTE [ Recompute at the first unpack ]
# torch.utils.checkpoint(use_reentrant=False) recomputes a segment inside the unpack hook of
# its saved tensors: at the first backward that unpacks one, not when backward reaches the
# segment. Autograd runs backward nodes in reverse creation order, so the nodes after the
# segment's last save event t (views, permute, unbind, adds: nothing saved) run their backward
# first, with nothing of the recompute live, and the recompute pass runs at t's backward, with
# the gradients those nodes made (unbind's stacked gradient, say) already live. The same holds
# for every nested segment: its pass runs at its own last save event, after its parent's pass
# when that is the parent's last save event too (outermost first). A child after its parent's
# last save event has had its backward by the time the parent's pass enters it; entering it
# then holds nothing (torch keeps a recomputed tensor only for a saved tensor still alive).
# Modelled here as: the trigger of a recomputed segment is its last save-event node. (Torch
# reaches a nested segment's pass through the input-saving node of each enclosing segment, so
# a segment without inputs inside it would recompute on its own; segments whose nodes read
# nothing from before them are rare and the planner's DP uses the same rule.) The planner's
# cost model (`hbp.planner.dp`, `CostModel.pass_pos` and `CostModel.tail_need`) follows this
# order: a level's pass sees the positional bytes after its tail's backward, and the tail's
# backward is charged where the segment's backward starts, without the pass's values.


# NOTE [ Pinned values ]
# A recomputed segment S, at any depth, may pin nodes (`Segment.pinned`): its checkpoint runs
# with `context_fn` = torch's selective-checkpoint contexts (`create_selective_checkpoint_contexts`)
# whose policy answers MUST_SAVE for the ops of a pinned node (NOTE [ Running pinned values ]
# in hbp/runtime/executors/pins.py). A pin is stored by the pass that runs S's forward last before
# S's own recompute pass: the original forward for a top-level S, the recompute pass of S's
# parent for a nested one (the *storing pass*). What torch does with them
# (torch/utils/checkpoint.py, `_CachingTorchDispatchMode` and `_CachedTorchDispatchMode`),
# and so the simulator:
# - storing pass: the pinned node p runs as usual (saving off); the caching mode stores a
#   detached alias of each of its outputs (its output and the extras it makes, which would
#   otherwise be scratch) in the storage of S's checkpoint (of its frame made in the original
#   forward, which the one S's parent's pass makes writes into): p's storage stays live past
#   its last use in that pass. A storing pass that stops before S's forward runs (its last
#   save event is before S, or is entering S) stores nothing;
# - S's recompute pass: every op re-runs except p's, which the cached mode answers from the
#   storage and then forgets (`_CONSUMED`): p allocates nothing, runs no FLOPs and no scratch;
#   the stored value is the pass's value of p from then on (freed like one), its extras are
#   what p saves if the pass saves for it, else freed at once. Autograd still records p and
#   packs its saves, so the early stop (NOTE [ Early stop at the last pack ]) is unchanged.
#   Nothing stored: p runs as without the pin;
# - a pass that stops before p runs (p after S's last save event, or p the stop node that
#   runs nothing) leaves the stored values in the storage, which S's frame holds (through its
#   recompute function) until the frame goes: after the backward of S's first save event, or,
#   when S saves nothing, when S's forward ends (top level; a nested S that saves nothing has
#   no frame left when its parent's pass runs, and stores nothing).
# Pins of different segments are independent: each segment's policy answers only for its own
# pins, and a node is pinned by one segment at most (`check_pins`). The planner's DP
# (`hbp.planner.dp`) charges a pin as a value kept from the child's forward in the storing
# pass through the child's backward: an upper bound of the above.

# NOTE [ A broadcast gradient is added out of place ]
# The backward of a reduction (`sum`, `mean`) passes its output gradient on as an expanded
# view: the input's gradient is the reduction's small storage, broadcast (stride 0), and is
# recorded as a pass-through whose storage is smaller than the input's gradient
# (`Node.gradient_bytes`). Autograd's input buffer adds into a held gradient in place only
# where that gradient is dense, so a second gradient for such an input is summed out of
# place: after j's backward has released what it saved, the computed gradient and the
# full-size sum are live together, then the broadcast storage goes and the sum is the input's
# gradient. Measured against the allocator: a residual MLP whose forward ends in `x.sum(-1)`
# was planned one activation (256 KiB of 1.1 MiB) under its measured peak at "min" before
# this rule, and to the byte after it. `hbp.analysis.positional` applies the same rule.

# NOTE [ Generator states of checkpoints ]
# A recomputed segment with a node that draws random numbers runs through
# `checkpoint(..., preserve_rng_state=True)` (NOTE [ Random state of recomputed segments ] in
# hbp/runtime/executors/checkpointing.py), and every such checkpoint call copies the CPU generator's state
# (`GraphInfo.rng_state_bytes` bytes, a CPU tensor: counted on a CPU step, 0 on CUDA). The
# copy lives in the checkpoint's frame, which the tensors its segment saved hold (and the
# frames of the checkpoints nested in it, through their saved inputs). So, per random
# segment, at any depth:
# - in the forward, its checkpoint copies the state when the segment starts; the copy lives
#   until the backward of the segment's first save event (at any depth) has run, or, if the
#   segment has none, until its forward ends (nothing holds the frame);
# - its recompute pass (`torch.random.fork_rng`) holds one more copy while it runs;
# - a recompute pass that runs the checkpoint of a random segment nested in it (entering a
#   child, or a child's nested segment) makes a new frame with a new copy, freed when the pass
#   ends (or, if that segment saves nothing, when its checkpoint returns).
# Measured against the allocator on a six-level nested dropout MLP, to the byte. The DP
# (`hbp.planner.dp`) charges a random child's own copy (its forward, its kept bytes, its
# pass's fork), not the copies that segments nested in it keep from the forward: those make a
# child's kept bytes depend on its nested plan, which the DP's decomposition cannot see, so
# `optimal_plan` plans again below the budget when the simulated plan is above it.


def naive_peak(graph: Graph) -> int:
    """Peak bytes of plain autograd (no recomputation) on `graph`."""
    return simulate(graph).peak_bytes


def simulate(
    graph: Graph,
    plan: PlanLike | list[SegmentLike] | None = None,
    *,
    info: GraphInfo | None = None,
    check: bool = False,
) -> Simulation:
    """Simulate one training step of `graph` under `plan` (None: plain autograd).

    `plan` may also be a bare list of top-level segments. `info` is `GraphInfo.of(graph)`, for
    callers that simulate the same graph many times. `check`: verify at every forward and
    recompute event that each value the node reads is live (stored or recomputed).

    Raises:
        ValueError: the graph breaks the IR's invariants, the segments do not tile it, or
            (with `check`) a node would read a value that was freed.
    """
    info = info or GraphInfo.of(graph)
    if plan is None:
        segments = [Whole(0, info.n)] if info.n else []
    else:  # a Plan, or a list of Segments (duck-typed: start, stop, recompute, children)
        segments = list(getattr(plan, "segments", plan))
    check_tiling(segments, 0, info.n)
    check_pins(info, segments)
    return StepInterpreter(info, check).step(segments)
