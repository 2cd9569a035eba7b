"""The simulator's interpreter: one training step of a graph under a plan, event by event,
with reference-counted storage instances.

`hbp.analysis.simulate.simulate` is the entry point, and its module docstring states the
rules this interpreter follows; the NOTEs cited here ([ Early stop at the last pack ],
[ Recompute at the first unpack ], [ Pinned values ], [ Generator states of checkpoints ])
are in `hbp.analysis.simulate` too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.plan_shape import SegmentLike, Whole, pins_of

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"


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


class StepInterpreter:
    """One simulated step: reference-counted storage instances and recorded events (the rules
    are the module docstring of `hbp.analysis.simulate`)."""

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
        for child in seg.children or [Whole(seg.start, seg.stop)]:
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
        broadcast: list[int] = []  # NOTE [ A broadcast gradient is added out of place ]
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
                continue
            if self.size[self.grad[v]] < info.grad_bytes[v]:
                broadcast.append(v)
            if not passed:  # the gradient j computes, live until added
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
        # out-of-place sums, after the releases, beside the gradients j computed (one event,
        # at the highest of the moments): into broadcast gradients, then a parameter's
        added = 0
        if broadcast:
            added = self.live + 2 * sum(int(info.grad_bytes[v]) for v in broadcast)
            for v in broadcast:
                held, self.grad[v] = self.grad[v], self._new(info.grad_bytes[v])
                self._release(held)
        if info.grad_sum_bytes[j]:
            added = max(added, self.live + 2 * int(info.grad_sum_bytes[j]))
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
            # the pass runs at its trigger's backward (NOTE [ Recompute at the first unpack ])
            trigger = self._trigger(seg)
            for j in range(top, trigger, -1):  # the tail: save-free nodes, before the pass
                self._backward_node(j)
            if trigger >= seg.start:
                children = seg.children or [Whole(seg.start, seg.stop)]
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
        held_seeds = []  # NOTE [ A loss's gradient lives through backward ]
        for j in range(info.n):
            if info.grad_seed[j]:
                self.grad[j] = self._new(info.grad_bytes[j])
                if info.seed_grad_held[j]:
                    held_seeds.append(self.grad[j])
                    self._hold(self.grad[j])
        self._record(BACKWARD, None)
        for j in info.seed_let_go.nonzero()[0]:  # the caller's hold ends once backward started
            self._release(self.current[j])
        self._backward(segments)
        for inst in held_seeds:
            self._release(inst)
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
