"""The shape of a plan as the simulator reads it: the segment and plan protocols, and the
checks that the segments tile the graph and pin only nodes that can be pinned.

`hbp.planner.plan.Segment` and `hbp.planner.plan.Plan` satisfy these protocols: the planner
imports the simulator, never the reverse. Pins follow NOTE [ Pinned values ] in
`hbp.analysis.simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hbp.analysis.liveness import GraphInfo


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
class Whole:
    """The whole graph as one plain segment (plain autograd)."""

    start: int
    stop: int
    recompute: bool = False
    children: list = field(default_factory=list)
