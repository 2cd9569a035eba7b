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
the input lets go of the shared one. A parameter gradient added out of place
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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from hbp.analysis.liveness import GraphInfo
from hbp.graph.ir import Graph


class SegmentLike(Protocol):
    """What the simulator reads of a plan's segment (`hbp.planner.plan.Segment`: the planner
    imports the simulator, never the reverse)."""

    start: int
    stop: int
    recompute: bool
    children: list
    pinned: tuple  # optional (read with `pins_of`)


class PlanLike(Protocol):
    """What the simulator reads of a plan (`hbp.planner.plan.Plan`)."""

    segments: list


FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"

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


@dataclass
class Simulation:
    """What one simulated training step does.

    Attributes:
        peak_bytes: the most bytes live at any event, above the level before the step.
        peak_phase: "forward", "recompute" or "backward": the phase of the peak event.
        peak_at: name of the node whose event holds the peak ("" for the backward start).
        recompute_flops: FLOPs of the nodes run again in recompute passes.
        total_flops: forward + backward + recompute FLOPs of the whole step.
        timeline: (event, live bytes) for every event, "phase:node" in execution order.
        forward_end_bytes: bytes live when the forward pass ends (outputs and what is kept).
    """

    peak_bytes: int
    peak_phase: str
    peak_at: str
    recompute_flops: float
    total_flops: float
    timeline: list[tuple[str, int]] = field(default_factory=list, repr=False)
    forward_end_bytes: int = 0


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
        segments = [_Whole(0, info.n)] if info.n else []
    else:  # a Plan, or a list of Segments (duck-typed: start, stop, recompute, children)
        segments = list(getattr(plan, "segments", plan))
    check_tiling(segments, 0, info.n)
    check_pins(info, segments)
    return _Run(info, check).step(segments)


def pins_of(seg: SegmentLike) -> tuple[int, ...]:
    """The nodes `seg` pins (NOTE [ Pinned values ]); () for segments without the field."""
    return tuple(getattr(seg, "pinned", ()) or ())


def check_pins(info: GraphInfo, segments: list[SegmentLike]) -> None:
    """Raise ValueError unless every pin is a node with its own storage (not a graph input, not
    an alias, not drawing random numbers) inside the recomputed segment that pins it, at any
    depth, and no node is pinned twice (NOTE [ Pinned values ])."""
    seen: dict[int, str] = {}

    def visit(segs: list[SegmentLike], where: str) -> None:
        for k, seg in enumerate(segs):
            at = f"{where}[{k}]"
            visit(seg.children, f"{at}.children")
            pins = pins_of(seg)
            if pins and not seg.recompute:
                raise ValueError(f"{at} [{seg.start}, {seg.stop}) pins nodes but is not recomputed")
            for p in pins:
                if not seg.start <= p < seg.stop:
                    raise ValueError(f"{at} [{seg.start}, {seg.stop}) pins node {p}, outside it")
                if info.is_input[p] or info.root[p] != p:
                    raise ValueError(
                        f"{at} pins node {p} ({info.names[p]!r}), a graph input or a "
                        "view/in-place result: only nodes with their own storage can be pinned"
                    )
                if info.draws_random[p]:
                    raise ValueError(
                        f"{at} pins node {p} ({info.names[p]!r}), which draws random "
                        "numbers: skipped in the recompute, it would not advance the generator "
                        "the ops after it replay"
                    )
                if p in seen:
                    raise ValueError(
                        f"{at} pins node {p} ({info.names[p]!r}), which {seen[p]} pins too: "
                        "a node is pinned by one segment at most"
                    )
                seen[p] = at

    visit(segments, "plan.segments")


def check_tiling(segments: list[SegmentLike], start: int, stop: int, where: str = "plan") -> None:
    """Raise ValueError unless `segments` tile [start, stop) in order, recursively."""
    pos = start
    for k, seg in enumerate(segments):
        if seg.start != pos or seg.stop <= seg.start:
            raise ValueError(
                f"{where}: segment {k} is [{seg.start}, {seg.stop}) but must start at {pos} "
                f"and be non-empty (segments must tile [{start}, {stop}) in order)"
            )
        pos = seg.stop
        if seg.children:
            if not seg.recompute:
                raise ValueError(
                    f"{where}: segment {k} [{seg.start}, {seg.stop}) has children but is not "
                    "recomputed (only recomputed segments are re-run with a nested plan)"
                )
            check_tiling(seg.children, seg.start, seg.stop, f"{where}.segments[{k}].children")
    if pos != stop:
        raise ValueError(f"{where}: segments end at {pos}, expected {stop}")


@dataclass
class _Whole:
    """The whole graph as one plain segment (plain autograd)."""

    start: int
    stop: int
    recompute: bool = False
    children: list = field(default_factory=list)


class _Run:
    """One simulated step: reference-counted storage instances and recorded events."""

    def __init__(self, info: GraphInfo, check: bool = False):
        self.info = info
        self.check = check
        self.size: list[int] = []  # bytes per storage instance
        self.refs: list[int] = []  # holds per storage instance
        self.live = 0
        self.timeline: list[tuple[str, int]] = []
        self.peak = (0, FORWARD, "")
        self.recompute_flops = 0.0
        self.current = [-1] * info.n  # value -> its current storage instance
        self.saved_holds: list[list[int]] = [[] for _ in range(info.n)]
        self.segment_holds: dict[int, list[int]] = {}  # id(segment) -> held instances
        # node -> generator states freed after its backward (NOTE [ Generator states of
        # checkpoints ])
        self.frame_states: defaultdict[int, list[int]] = defaultdict(list)
        self.grad: list[int] = [-1] * info.n  # value -> gradient instance (or -1)
        # NOTE [ Pinned values ]: pinned node -> id of its segment (whose pass answers it) and
        # of its storing pass (id of the parent segment; None: the forward); the instances the
        # checkpoint's storage holds (output, extras); node -> pins released after its backward
        self.pin_owner: dict[int, int] = {}
        self.pin_store: dict[int, int | None] = {}
        self.stored: dict[int, list[int]] = {}
        self.frame_pins: defaultdict[int, list[int]] = defaultdict(list)
        for i in range(info.n):
            if info.is_input[i]:
                self.current[i] = self._new(0)

    # storage -------------------------------------------------------------------------------
    def _new(self, nbytes: int) -> int:
        """A new storage instance held once (by its creator, who must release it)."""
        self.size.append(int(nbytes))
        self.refs.append(1)
        self.live += int(nbytes)
        return len(self.size) - 1

    def _hold(self, inst: int) -> None:
        self.refs[inst] += 1

    def _release(self, inst: int) -> None:
        self.refs[inst] -= 1
        if self.refs[inst] == 0:
            self.live -= self.size[inst]

    def _record(self, phase: str, j: int | None, live: int | None = None) -> None:
        live = self.live if live is None else live
        name = self.info.names[j] if j is not None else ""
        self.timeline.append((f"{phase}:{name}" if name else phase, live))
        if live > self.peak[0]:
            self.peak = (live, phase, name)

    # passes --------------------------------------------------------------------------------
    def _items(self, children: list[SegmentLike], early_stop: bool) -> list[tuple]:
        """The run items of a pass over `children`: ("node", j, save), ("enter", segment)
        and ("pack", j), cut after the last save event when `early_stop` (a last save event of
        which nothing runs becomes ("pack", j): NOTE [ Early stop at the last pack ]). Inside a
        recomputed child, ("state", segment) and ("state_end", segment) mark where the
        checkpoint of it or of a segment nested in it copies the generator's state and, when
        it saves nothing, lets go of it (NOTE [ Generator states of checkpoints ])."""
        info = self.info
        items: list[tuple] = []
        last_event = -1
        for seg in children:
            if seg.recompute:
                items.append(("enter", seg))
                if info.segment_inputs(seg.start, seg.stop):
                    last_event = len(items) - 1
                self._inside(seg, items)
                if pins_of(seg) and info.next_save[seg.start] >= seg.stop:
                    items.append(("unpin", seg))  # nothing saved: the frame goes with S's end
            else:
                for j in range(seg.start, seg.stop):
                    items.append(("node", j, True))
                    if info.save_event[j]:
                        last_event = len(items) - 1
        if not early_stop:
            return items
        items = items[: last_event + 1]
        if items and items[-1][0] == "node" and not self.info.runs_at_stop[items[-1][1]]:
            items[-1] = ("pack", items[-1][1])
        return items

    def _inside(self, seg: SegmentLike, items: list[tuple]) -> None:
        """Append the items of a recomputed segment's nodes, run with saving off (its nested
        segments change nothing in the pass but the generator states their checkpoints copy)."""
        info = self.info
        random = info.keeps_rng_state(seg.start, seg.stop)
        if random:
            items.append(("state", seg))
        for child in seg.children or [_Whole(seg.start, seg.stop)]:
            if child.recompute:
                self._inside(child, items)
            else:
                items.extend(("node", j, False) for j in range(child.start, child.stop))
        if random and info.next_save[seg.start] >= seg.stop:
            items.append(("state_end", seg))

    def _pass(
        self,
        children: list[SegmentLike],
        scope: tuple[int, int] | None,
        trigger: int = -1,
        owner: int | None = None,
    ) -> None:
        """Run a forward pass over `children`. scope=None: the original pass (all users
        count, outputs are held for the step); else a recompute pass of [start, stop) that
        runs at the backward of node `trigger` (children after it have had their backward:
        entering them holds nothing), of the segment whose id is `owner`."""
        info = self.info
        phase = FORWARD if scope is None else RECOMPUTE
        items = self._items(children, early_stop=scope is not None)
        # the node a recompute pass stops at runs only up to its last save
        stop_at = items[-1][1] if scope is not None and items and items[-1][0] == "node" else -1
        pending: dict[int, int] = {}  # value made in this pass -> its uses left
        states: dict[int, int] = {}  # id(segment) -> the generator state its checkpoint copied
        for item in items:
            if item[0] == "state":  # NOTE [ Generator states of checkpoints ]
                seg = item[1]
                inst = states[id(seg)] = self._new(info.rng_state_bytes)
                if scope is None and info.next_save[seg.start] < seg.stop:
                    # the checkpoint's frame holds it until its first saved tensor is freed
                    self.frame_states[info.next_save[seg.start]].append(states.pop(id(seg)))
                continue
            if item[0] == "state_end":  # its checkpoint saved nothing: the frame is gone
                self._release(states.pop(id(item[1])))
                continue
            if item[0] == "unpin":
                self._unpin(pins_of(item[1]))
                continue
            if item[0] == "enter":
                seg = item[1]
                if scope is not None and seg.start > trigger:
                    continue  # its backward is done (NOTE [ Recompute at the first unpack ])
                holds = [self.current[v] for v in info.segment_inputs(seg.start, seg.stop)]
                for inst in holds:
                    self._hold(inst)
                self.segment_holds[id(seg)] = holds
                continue
            if item[0] == "pack":  # the pass stops in j's pack hook, before j runs
                j = item[1]
                held = [self.current[v] for v in info.saved[j]]
                for h in held:
                    self._hold(h)
                self.saved_holds[j] = held
                continue
            _, j, save = item
            if info.is_input[j]:
                continue
            if self.check:
                for v in info.inputs[j]:
                    if self.refs[self.current[v]] <= 0:
                        raise ValueError(
                            f"plan: {phase} of {info.names[j]!r} reads {info.names[v]!r}, "
                            "which is neither stored nor recomputed at that point"
                        )
            alias = info.root[j] != j
            # NOTE [ Pinned values ]: the pinned node's own pass answers it from the storage
            cached = (
                self.stored.pop(j, None)
                if owner is not None and self.pin_owner.get(j) == owner
                else None
            )
            if cached is not None:
                inst = cached[0]  # the storage's hold becomes the creator's
            elif alias:
                inst = self.current[info.root[j]]
                self._hold(inst)  # the creator's hold, released at the end of the event
            else:
                inst = self._new(info.storage_bytes[j])
            self.current[j] = inst
            uses = len(info.users[j]) if scope is None else _count_in(info.users[j], scope)
            if uses:
                pending[j] = uses
                self._hold(inst)
            if scope is None and info.is_held[j]:
                self._hold(inst)
            extras = cached[1:] if cached is not None else []
            if save and info.has_backward[j]:
                held = [self.current[v] for v in info.saved[j]]
                if info.saves_output[j]:
                    held.append(inst)
                for h in held:
                    self._hold(h)
                if info.extra_bytes[j]:
                    held.append(extras.pop() if extras else self._new(info.extra_bytes[j]))
                self.saved_holds[j] = held
            for h in extras:  # made in the forward, not saved by this pass
                self._release(h)
            if cached is not None:  # nothing of the op runs
                self._record(phase, j)
                self._after_event(j, inst, pending)
                continue
            if scope is not None:
                self.recompute_flops += info.stop_flops[j] if j == stop_at else info.flops[j]
            scratch = int(info.forward_scratch_bytes[j])
            if j in self.pin_store and self.pin_store[j] == owner:  # its storing pass: the
                # storage keeps it and its extras
                self._hold(inst)
                self.stored[j] = [inst]
                if info.extra_bytes[j] and not save:
                    self.stored[j].append(self._new(info.extra_bytes[j]))
            elif not save:  # the op still makes what it would save; the pack hook drops it
                scratch += int(info.extra_bytes[j])
            self.live += scratch
            self._record(phase, j)
            self.live -= scratch
            self._after_event(j, inst, pending)
        for v in pending:  # early stop: the pass's remaining references go
            self._release(self.current[v])
        for inst in states.values():  # checkpoints entered in a recompute pass end with it
            self._release(inst)

    def _after_event(self, j: int, inst: int, pending: dict[int, int]) -> None:
        """Release j's inputs whose last use in the pass this was, and j's creator hold."""
        for v in self.info.inputs[j]:
            left = pending.get(v)
            if left is not None:
                if left == 1:
                    del pending[v]
                    self._release(self.current[v])
                else:
                    pending[v] = left - 1
        self._release(inst)

    def _unpin(self, pins) -> None:
        """The checkpoint's frame goes: what its storage still holds is freed."""
        for p in pins:
            for inst in self.stored.pop(p, ()):
                self._release(inst)

    # backward ------------------------------------------------------------------------------
    def _backward_node(self, j: int) -> None:
        info = self.info
        if not info.has_backward[j]:
            return
        scratch = int(info.backward_scratch_bytes[j])
        for v in info.inputs[j]:
            if not info.receives_grad[v]:
                continue
            passed = v in info.passthrough[j] and self.grad[j] >= 0
            if self.grad[v] < 0:
                if passed:
                    self.grad[v] = self.grad[j]
                    self._hold(self.grad[j])
                else:
                    self.grad[v] = self._new(info.grad_bytes[v])
                continue
            if self.refs[self.grad[v]] - (self.grad[v] == self.grad[j]) > 1:
                # shared with another value's gradient: accumulated out of place
                self._release(self.grad[v])
                self.grad[v] = self._new(info.grad_bytes[v])
            elif not passed:  # the gradient j computes, live until added in place
                scratch += int(info.grad_bytes[v])
        if info.param_grad_bytes[j]:
            self._new(info.param_grad_bytes[j])  # kept to the end of the step
        during = self.live + scratch
        for inst in self.saved_holds[j]:
            self._release(inst)
        self.saved_holds[j] = []
        for inst in self.frame_states.pop(j, ()):
            self._release(inst)
        self._unpin(self.frame_pins.pop(j, ()))
        if self.grad[j] >= 0:
            self._release(self.grad[j])
            self.grad[j] = -1
        # an out-of-place parameter-gradient sum: added after the releases, beside the
        # gradient j computed (one event, at the higher of the two moments)
        added = self.live + 2 * int(info.grad_sum_bytes[j]) if info.grad_sum_bytes[j] else 0
        self._record(BACKWARD, j, max(during, added))

    def _backward(self, segments: list[SegmentLike], upto: int | None = None) -> None:
        """Backpropagate a level's `segments` over the nodes at or below `upto` (all of them
        when None; the nodes above it have had their backward already)."""
        for seg in reversed(segments):
            top = seg.stop - 1 if upto is None else min(seg.stop - 1, upto)
            if top < seg.start:
                continue  # the whole segment is in a recomputed parent's tail: done
            if not seg.recompute:
                for j in range(top, seg.start - 1, -1):
                    self._backward_node(j)
                continue
            # NOTE [ Recompute at the first unpack ]
            trigger = self._trigger(seg)
            for j in range(top, trigger, -1):  # the tail: save-free nodes, before the pass
                self._backward_node(j)
            if trigger >= seg.start:
                children = seg.children or [_Whole(seg.start, seg.stop)]
                # the pass restores the generator afterwards: one more copy while it runs
                forked = self.info.keeps_rng_state(seg.start, seg.stop)
                if forked:
                    fork = self._new(self.info.rng_state_bytes)
                self._pass(children, (seg.start, seg.stop), trigger, id(seg))
                if forked:
                    self._release(fork)
                self._backward(children, trigger)
            for inst in self.segment_holds.pop(id(seg), []):
                self._release(inst)

    def _register_pins(self, segments: list[SegmentLike], parent: SegmentLike | None) -> None:
        """Record every pin's segment, storing pass and frame (NOTE [ Pinned values ])."""
        info = self.info
        for seg in segments:
            self._register_pins(seg.children, seg)
            saves = info.next_save[seg.start] < seg.stop
            if parent is not None and not saves:
                continue  # no frame left when the parent's pass runs: nothing is stored
            for p in pins_of(seg):
                self.pin_owner[p] = id(seg)
                self.pin_store[p] = None if parent is None else id(parent)
                if saves:
                    self.frame_pins[int(info.next_save[seg.start])].append(p)

    def _trigger(self, seg: SegmentLike) -> int:
        """The last save event in `seg` (seg.start - 1 if it has none): the node whose backward
        first unpacks what the segment saved."""
        save_event = self.info.save_event
        for j in range(seg.stop - 1, seg.start - 1, -1):
            if save_event[j]:
                return j
        return seg.start - 1

    def step(self, segments: list[SegmentLike]) -> Simulation:
        info = self.info
        self._register_pins(segments, None)
        self._pass(segments, None)
        forward_end = self.live
        for j in range(info.n):
            if info.grad_seed[j]:
                self.grad[j] = self._new(info.grad_bytes[j])
        self._record(BACKWARD, None)
        for j in info.seed_let_go.nonzero()[0]:  # the caller's hold ends once backward started
            self._release(self.current[j])
        self._backward(segments)
        fwd = float(info.flops.sum())
        bwd = float(info.backward_flops.sum())
        return Simulation(
            peak_bytes=int(self.peak[0]),
            peak_phase=self.peak[1],
            peak_at=self.peak[2],
            recompute_flops=float(self.recompute_flops),
            total_flops=fwd + bwd + float(self.recompute_flops),
            timeline=self.timeline,
            forward_end_bytes=int(forward_end),
        )


def _count_in(users: tuple[int, ...], scope: tuple[int, int]) -> int:
    start, stop = scope
    return sum(1 for u in users if start <= u < stop)
