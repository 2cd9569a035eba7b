"""The simulator's interpreter: one training step of a graph under a plan, event by event,
with reference-counted storage instances.

`hbp.analysis.simulate.simulate` is the entry point, and its module docstring states the
rules this interpreter follows; the NOTEs cited here ([ Early stop at the last pack ],
[ Recompute at the first unpack ], [ Pinned values ], [ Generator states of checkpoints ])
are in `hbp.analysis.simulate` too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

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
        events: (phase, node index or -1 for the backward start, live bytes) for every event,
            in execution order.
        forward_end_bytes: bytes live when the forward pass ends (outputs and what is kept).
        names: the graph's node names, which `timeline` reads.
    """

    peak_bytes: int
    peak_phase: str
    peak_at: str
    recompute_flops: float
    total_flops: float
    events: list[tuple[str, int, int]] = field(default_factory=list, repr=False)
    forward_end_bytes: int = 0
    names: list[str] = field(default_factory=list, repr=False, compare=False)

    @property
    def timeline(self) -> list[tuple[str, int]]:
        """(event, live bytes) for every event, the event named "phase:node" ("backward" for
        the backward start), in execution order."""
        names = self.names
        return [
            (f"{phase}:{names[j]}" if j >= 0 and names[j] else phase, live)
            for phase, j, live in self.events
        ]


# NOTE [ The event loops inline their helpers ]
# A plan call simulates the whole graph several times (the plain step, each staged candidate),
# and a simulation is a Python loop over tens of thousands of events: `_new`, `_release`,
# `_record` and the release of a node's inputs after its event were a call per event, about a
# fifth of a simulation. `_pass` and `_backward_node`, the loops that run per node, spell
# them out in place (each marked with the helper it spells), with the lists they read bound
# to locals; the helpers remain for the rarer paths. The events are the same.


class StepInterpreter:
    """One simulated step: reference-counted storage instances and recorded events (the rules
    are the module docstring of `hbp.analysis.simulate`). Node facts are read from
    `GraphInfo.lists` (NOTE [ Event loops read Python lists ] in hbp.analysis.liveness)."""

    def __init__(self, info: GraphInfo, check: bool = False):
        self.info = info
        self.facts = info.lists
        self.check = check
        self.size: list[int] = []  # bytes per storage instance
        self.refs: list[int] = []  # holds per storage instance
        self.live = 0
        self.events: list[tuple[str, int, int]] = []  # (phase, node or -1, live bytes)
        self.peak = (0, FORWARD, -1)  # (live bytes, phase, node or -1) of the first highest
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
        for i, is_input in enumerate(self.facts.is_input):
            if is_input:
                self.current[i] = self._new(0)

    # storage -------------------------------------------------------------------------------
    def _new(self, nbytes: int) -> int:
        """A new storage instance held once (by its creator, who must release it)."""
        self.size.append(nbytes)
        self.refs.append(1)
        self.live += nbytes
        return len(self.size) - 1

    def _release(self, inst: int) -> None:
        refs = self.refs
        refs[inst] -= 1
        if refs[inst] == 0:
            self.live -= self.size[inst]

    def _record(self, phase: str, j: int, live: int) -> None:
        """Record an event of node j (-1: the backward start) with `live` bytes."""
        self.events.append((phase, j, live))
        if live > self.peak[0]:
            self.peak = (live, phase, j)

    # passes --------------------------------------------------------------------------------
    def _items(self, children: list[SegmentLike], early_stop: bool) -> list[tuple]:
        """The run items of a pass over `children`: ("node", j, save), ("enter", segment)
        and ("pack", j), cut after the last save event when `early_stop` (a last save event of
        which nothing runs becomes ("pack", j): NOTE [ Early stop at the last pack ]). Inside a
        recomputed child, ("state", segment) and ("state_end", segment) mark where the
        checkpoint of it or of a segment nested in it copies the generator's state and, when
        it saves nothing, lets go of it (NOTE [ Generator states of checkpoints ])."""
        info, facts = self.info, self.facts
        items: list[tuple] = []
        last_event = -1
        for seg in children:
            if seg.recompute:
                items.append(("enter", seg))
                if info.segment_inputs(seg.start, seg.stop):
                    last_event = len(items) - 1
                self._inside(seg, items)
                if pins_of(seg) and facts.next_save[seg.start] >= seg.stop:
                    items.append(("unpin", seg))  # nothing saved: the frame goes with S's end
            else:
                save_event = facts.save_event
                for j in range(seg.start, seg.stop):
                    items.append(("node", j, True))
                    if save_event[j]:
                        last_event = len(items) - 1
        if not early_stop:
            return items
        items = items[: last_event + 1]
        if items and items[-1][0] == "node" and not facts.runs_at_stop[items[-1][1]]:
            items[-1] = ("pack", items[-1][1])
        return items

    def _inside(self, seg: SegmentLike, items: list[tuple]) -> None:
        """Append the items of a recomputed segment's nodes, run with saving off (its nested
        segments change nothing in the pass but the generator states their checkpoints copy)."""
        random = self.info.keeps_rng_state(seg.start, seg.stop)
        if random:
            items.append(("state", seg))
        for child in seg.children or [Whole(seg.start, seg.stop)]:
            if child.recompute:
                self._inside(child, items)
            else:
                items.extend(("node", j, False) for j in range(child.start, child.stop))
        if random and self.facts.next_save[seg.start] >= seg.stop:
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
        info, facts = self.info, self.facts
        refs, current = self.refs, self.current
        phase = FORWARD if scope is None else RECOMPUTE
        items = self._items(children, early_stop=scope is not None)
        # the node a recompute pass stops at runs only up to its last save
        stop_at = items[-1][1] if scope is not None and items and items[-1][0] == "node" else -1
        pending: dict[int, int] = {}  # value made in this pass -> its uses left
        states: dict[int, int] = {}  # id(segment) -> the generator state its checkpoint copied
        # NOTE [ The event loops inline their helpers ]
        size, events = self.size, self.events
        inputs, users, saved = info.inputs, info.users, info.saved
        is_input, roots, is_held = facts.is_input, facts.root, facts.is_held
        has_backward, saves_output = facts.has_backward, facts.saves_output
        extra_of, scratch_of = facts.extra_bytes, facts.forward_scratch_bytes
        storage_of, check = facts.storage_bytes, self.check
        pin_owner, pin_store = self.pin_owner, self.pin_store
        top = self.peak[0]
        for item in items:
            if item[0] != "node":
                self._mark(item, scope, trigger, states)
                continue
            _, j, save = item
            if is_input[j]:
                continue
            if check:
                self._check_reads(phase, j)
            # NOTE [ Pinned values ]: the pinned node's own pass answers it from the storage
            cached = (
                self.stored.pop(j, None)
                if owner is not None and pin_owner.get(j) == owner
                else None
            )
            root = roots[j]
            if cached is not None:
                inst = cached[0]  # the storage's hold becomes the creator's
            elif root != j:
                inst = current[root]
                refs[inst] += 1  # the creator's hold, released at the end of the event
            else:  # `_new`
                inst, nbytes = len(size), storage_of[j]
                size.append(nbytes)
                refs.append(1)
                self.live += nbytes
            current[j] = inst
            # a recompute pass's users of j are those before the scope's stop (all after j)
            uses = len(users[j]) if scope is None else bisect_left(users[j], scope[1])
            if uses:
                pending[j] = uses
                refs[inst] += 1
            if scope is None and is_held[j]:
                refs[inst] += 1
            extras = cached[1:] if cached is not None else []
            extra_bytes = extra_of[j]
            if save and has_backward[j]:
                held = [current[v] for v in saved[j]]
                if saves_output[j]:
                    held.append(inst)
                for h in held:
                    refs[h] += 1
                if extra_bytes:
                    held.append(extras.pop() if extras else self._new(extra_bytes))
                self.saved_holds[j] = held
            for h in extras:  # made in the forward, not saved by this pass
                self._release(h)
            if cached is not None:  # nothing of the op runs
                live = self.live
            else:
                if scope is not None:
                    self.recompute_flops += facts.stop_flops[j] if j == stop_at else facts.flops[j]
                scratch = scratch_of[j]
                if j in pin_store and pin_store[j] == owner:  # its storing pass: the storage
                    # keeps it and its extras
                    refs[inst] += 1
                    self.stored[j] = [inst]
                    if extra_bytes and not save:
                        self.stored[j].append(self._new(extra_bytes))
                elif not save:  # the op still makes what it would save; the pack hook drops it
                    scratch += extra_bytes
                live = self.live + scratch
            events.append((phase, j, live))  # `_record`
            if live > top:
                top = live
                self.peak = (live, phase, j)
            for v in inputs[j]:  # `_after_event`
                left = pending.get(v)
                if left is not None:
                    if left == 1:
                        del pending[v]
                        x = current[v]
                        refs[x] -= 1
                        if not refs[x]:
                            self.live -= size[x]
                    else:
                        pending[v] = left - 1
            refs[inst] -= 1
            if not refs[inst]:
                self.live -= size[inst]
        for v in pending:  # early stop: the pass's remaining references go
            self._release(current[v])
        for inst in states.values():  # checkpoints entered in a recompute pass end with it
            self._release(inst)

    def _mark(self, item: tuple, scope: tuple[int, int] | None, trigger: int, states) -> None:
        """Run a pass's item other than a node's run: a generator state copied or let go of,
        a frame's pins freed, a recomputed segment entered, or the pass's last pack."""
        info, kind = self.info, item[0]
        if kind == "state":  # NOTE [ Generator states of checkpoints ]
            seg = item[1]
            states[id(seg)] = self._new(info.rng_state_bytes)
            if scope is None and self.facts.next_save[seg.start] < seg.stop:
                # the checkpoint's frame holds it until its first saved tensor is freed
                self.frame_states[self.facts.next_save[seg.start]].append(states.pop(id(seg)))
        elif kind == "state_end":  # its checkpoint saved nothing: the frame is gone
            self._release(states.pop(id(item[1])))
        elif kind == "unpin":
            self._unpin(pins_of(item[1]))
        elif kind == "enter":
            seg = item[1]
            if scope is not None and seg.start > trigger:
                return  # its backward is done (NOTE [ Recompute at the first unpack ])
            holds = [self.current[v] for v in info.segment_inputs(seg.start, seg.stop)]
            for inst in holds:
                self.refs[inst] += 1
            self.segment_holds[id(seg)] = holds
        else:  # "pack": the pass stops in j's pack hook, before j runs
            j = item[1]
            held = [self.current[v] for v in info.saved[j]]
            for inst in held:
                self.refs[inst] += 1
            self.saved_holds[j] = held

    def _check_reads(self, phase: str, j: int) -> None:
        """Raise unless every value node j reads is live (`simulate(..., check=True)`)."""
        info = self.info
        for v in info.inputs[j]:
            if self.refs[self.current[v]] <= 0:
                raise ValueError(
                    f"plan: {phase} of {info.names[j]!r} reads {info.names[v]!r}, "
                    "which is neither stored nor recomputed at that point"
                )

    def _unpin(self, pins) -> None:
        """The checkpoint's frame goes: what its storage still holds is freed."""
        for p in pins:
            for inst in self.stored.pop(p, ()):
                self._release(inst)

    # backward ------------------------------------------------------------------------------
    def _backward_node(self, j: int) -> None:
        facts = self.facts
        if not facts.has_backward[j]:
            return
        # NOTE [ The event loops inline their helpers ]
        refs, size, grad, grad_bytes = self.refs, self.size, self.grad, facts.grad_bytes
        receives_grad, passthrough = facts.receives_grad, self.info.passthrough[j]
        scratch = facts.backward_scratch_bytes[j]
        broadcast: list[int] = []  # NOTE [ A broadcast gradient is added out of place ]
        for v in self.info.inputs[j]:
            if not receives_grad[v]:
                continue
            passed = grad[j] >= 0 and v in passthrough
            if grad[v] < 0:
                if passed:
                    grad[v] = grad[j]
                    refs[grad[j]] += 1
                else:  # `_new`
                    grad[v] = len(size)
                    size.append(grad_bytes[v])
                    refs.append(1)
                    self.live += grad_bytes[v]
                continue
            if refs[grad[v]] - (grad[v] == grad[j]) > 1:
                # shared with another value's gradient: accumulated out of place
                self._release(grad[v])
                grad[v] = self._new(grad_bytes[v])
                continue
            if size[grad[v]] < grad_bytes[v]:
                broadcast.append(v)
            if not passed:  # the gradient j computes, live until added
                scratch += grad_bytes[v]
        if facts.param_grad_bytes[j]:
            self._new(facts.param_grad_bytes[j])  # kept to the end of the step
        during = self.live + scratch
        saved_holds = self.saved_holds
        if saved_holds[j]:
            for inst in saved_holds[j]:  # `_release`
                refs[inst] -= 1
                if not refs[inst]:
                    self.live -= size[inst]
            saved_holds[j] = []
        if self.frame_states:
            for inst in self.frame_states.pop(j, ()):
                self._release(inst)
        if self.frame_pins:
            pins = self.frame_pins.pop(j, None)
            if pins:
                self._unpin(pins)
        g = grad[j]
        if g >= 0:  # `_release`
            refs[g] -= 1
            if not refs[g]:
                self.live -= size[g]
            grad[j] = -1
        # out-of-place sums, after the releases, beside the gradients j computed (one event,
        # at the highest of the moments): into broadcast gradients, then a parameter's
        added = 0
        if broadcast:
            added = self.live + 2 * sum(grad_bytes[v] for v in broadcast)
            for v in broadcast:
                held, grad[v] = grad[v], self._new(grad_bytes[v])
                self._release(held)
        if facts.grad_sum_bytes[j]:
            added = max(added, self.live + 2 * facts.grad_sum_bytes[j])
        live = during if during > added else added
        self.events.append((BACKWARD, j, live))  # `_record`
        if live > self.peak[0]:
            self.peak = (live, BACKWARD, j)

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
        next_save = self.facts.next_save
        for seg in segments:
            self._register_pins(seg.children, seg)
            saves = next_save[seg.start] < seg.stop
            if parent is not None and not saves:
                continue  # no frame left when the parent's pass runs: nothing is stored
            for p in pins_of(seg):
                self.pin_owner[p] = id(seg)
                self.pin_store[p] = None if parent is None else id(parent)
                if saves:
                    self.frame_pins[next_save[seg.start]].append(p)

    def _trigger(self, seg: SegmentLike) -> int:
        """The last save event in `seg` (seg.start - 1 if it has none): the node whose backward
        first unpacks what the segment saved."""
        save_event = self.facts.save_event
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
        for j in np.flatnonzero(info.grad_seed).tolist():
            self.grad[j] = self._new(self.facts.grad_bytes[j])
            if info.seed_grad_held[j]:
                held_seeds.append(self.grad[j])
                self.refs[self.grad[j]] += 1
        self._record(BACKWARD, -1, self.live)
        for j in np.flatnonzero(info.seed_let_go).tolist():
            self._release(self.current[j])  # the caller's hold ends once backward started
        self._backward(segments)
        for inst in held_seeds:
            self._release(inst)
        live, phase, at = self.peak
        return Simulation(
            peak_bytes=live,
            peak_phase=phase,
            peak_at=info.names[at] if at >= 0 else "",
            recompute_flops=self.recompute_flops,
            total_flops=float(info.flops.sum())
            + float(info.backward_flops.sum())
            + self.recompute_flops,
            events=self.events,
            forward_end_bytes=forward_end,
            names=info.names,
        )
