"""A plan: which intervals of a graph's topological order are recomputed, nested.

The top level of a plan is a list of `Segment`s that tile [0, len(graph)). A segment with
`recompute=False` runs as plain autograd (everything its nodes save is kept). A segment with
`recompute=True` is checkpointed: its forward keeps only its inputs and its outputs, and its
backward first runs it forward again, following `children` (a tiling of the segment's own
interval, which may itself contain recomputed segments: the interval tree). A recomputed
segment without children recomputes its interval as plain autograd.

A recomputed segment may *pin* nodes (`Segment.pinned`): their outputs are kept from the pass
that last ran its forward (the forward at the top level, the parent's recompute pass for a
nested segment) instead of being recomputed (selective checkpointing's MUST_SAVE: NOTE [ Pinned
values ] in `hbp.analysis.simulate`).

On small graphs a plan may instead be an explicit schedule (`Plan.schedule`): its segments are
one plain segment, and each `StageRecompute` says which forward values are recomputed when a
node's backward starts (NOTE [ Explicit schedules ] in `hbp.planner.schedules`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from hbp.units import MIB


@dataclass
class Segment:
    """Nodes [start, stop) of the graph's topological order.

    `first` / `last` name the segment's first and last node (filled in by the planners, for
    printing; empty when unknown). `pinned`: indices of nodes in [start, stop) whose outputs
    a recomputed segment keeps from the pass that last ran its forward, so its recompute pass
    does not run them again (NOTE [ Pinned values ] in `hbp.analysis.simulate`); empty for
    other segments.
    """

    start: int
    stop: int
    recompute: bool = False
    children: list[Segment] = field(default_factory=list)
    first: str = ""
    last: str = ""
    pinned: tuple[int, ...] = ()

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)

    def describe(self, indent: int = 0) -> list[str]:
        """One line per segment of this subtree: node range, mode, node names."""
        names = f"{self.first} .. {self.last}" if self.first else ""
        mode = "recompute" if self.recompute else "plain"
        line = f"{'  ' * indent}[{self.start:>5}, {self.stop:>5})  {mode:<9}  {names}"
        if self.pinned:
            line = f"{line.rstrip()}  pinned {', '.join(map(str, self.pinned))}"
        out = [line.rstrip()]
        for c in self.children:
            out.extend(c.describe(indent + 1))
        return out


@dataclass
class StageRecompute:
    """Forward values an explicit schedule recomputes when the backward of IR node `node`
    starts: `values` are IR indices of storage roots (a view is made with its root), in
    topological order."""

    node: int
    values: tuple[int, ...]


def any_pinned(segments: list[Segment]) -> bool:
    """Whether any segment of these trees pins a node."""
    return any(s.pinned or any_pinned(s.children) for s in segments)


#: What a plan's text adds to the FLOPs of a torch capture: the ops torch's FLOP counter
#: counts (a recompute of elementwise ops alone is 0 FLOPs there; JAX's counts every op).
TORCH_FLOPS = "; torch's FLOP counter counts matmuls, convolutions and attention"


#: `Plan.meta["solved_by"]` of a plan made for another input size of the same step
#: (NOTE [ Plans carried across sizes ] in hbp.planner.carry).
CARRIED = "carried"


@dataclass
class Plan:
    """A plan with its predictions (bytes, FLOPs).

    Attributes:
        segments: top-level tiling of the topological order.
        budget_bytes: the budget the plan was made for.
        predicted_peak_bytes: simulated step peak (above the level before the step).
        predicted_recompute_flops: FLOPs run again in backward.
        naive_peak_bytes / naive_flops: the same graph without recomputation.
        kept_bytes: bytes of segment-boundary values kept across forward.
        meta: planner name, granularity, solve time in seconds, node names at cuts.
        schedule: the recomputations of an explicit schedule, by backward stage (empty for a
            plan of segments; NOTE [ Explicit schedules ] in `hbp.planner.schedules`).
    """

    segments: list[Segment]
    budget_bytes: int = 0
    predicted_peak_bytes: int = 0
    predicted_recompute_flops: float = 0.0
    naive_peak_bytes: int = 0
    naive_flops: float = 0.0
    kept_bytes: int = 0
    meta: dict = field(default_factory=dict)
    schedule: list[StageRecompute] = field(default_factory=list)

    @property
    def predicted_recompute_ratio(self) -> float:
        return self.predicted_recompute_flops / self.naive_flops if self.naive_flops else 0.0

    def metrics(self) -> dict:
        """The plan's figures as the bench's metrics fields (the tiny modes' `describe`)."""
        return {
            "plan_segments": len(self.segments),
            "plan_recomputed_segments": sum(s.recompute for s in self.segments),
            "plan_depth": max((s.depth() for s in self.segments), default=0),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_recompute_flops": self.predicted_recompute_flops,
            "predicted_recompute_ratio": self.predicted_recompute_ratio,
        }

    def __str__(self) -> str:
        """Readable summary: predictions against budget and naive, then the segment tree."""
        planner = self.meta.get("planner", "plan")
        n = self.segments[-1].stop if self.segments else 0
        recomputed = sum(s.recompute for s in self.segments)
        depth = max((s.depth() for s in self.segments), default=0)
        ratio = self.predicted_peak_bytes / self.naive_peak_bytes if self.naive_peak_bytes else 0
        lines = [
            f"Plan ({planner}): {n} nodes, {len(self.segments)} segments "
            f"({recomputed} recomputed), depth {depth}",
            f"  predicted peak {_size(self.predicted_peak_bytes)} (budget "
            f"{_size(self.budget_bytes)}, naive {_size(self.naive_peak_bytes)}, "
            f"{ratio:.2f}x naive)",
            f"  predicted recompute {self.predicted_recompute_flops:.4g} FLOPs "
            f"({100 * self.predicted_recompute_ratio:.1f}% of naive step FLOPs"
            f"{TORCH_FLOPS if self.meta.get('framework') == 'torch' else ''}); "
            f"kept {_size(self.kept_bytes)}",
        ]
        if "solve_time_s" in self.meta:
            lines.append(f"  solved in {self.meta['solve_time_s']:.2f} s")
        if self.meta.get("solved_by") == CARRIED:
            lines.append(
                "  carried: made for another input size of this step, simulated at this one"
            )
        for s in self.segments:
            lines.extend(s.describe(1))
        for stage in self.schedule:
            values = ", ".join(map(str, stage.values))
            lines.append(f"  before the backward of node {stage.node}: recompute {values}")
        return "\n".join(lines)

    def cut_points(self) -> list[int]:
        """Start index of every top-level segment after the first."""
        return [s.start for s in self.segments[1:]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        def seg(x: dict) -> Segment:
            return Segment(
                x["start"],
                x["stop"],
                x["recompute"],
                [seg(c) for c in x.get("children", [])],
                x.get("first", ""),
                x.get("last", ""),
                tuple(x.get("pinned", ())),
            )

        d = dict(d)
        d["segments"] = [seg(s) for s in d["segments"]]
        d["schedule"] = [
            StageRecompute(x["node"], tuple(x["values"])) for x in d.get("schedule", [])
        ]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _size(nbytes: int) -> str:
    """Bytes in MiB, or plain bytes below 0.01 MiB (synthetic graphs)."""
    return f"{nbytes / MIB:.2f} MiB" if nbytes >= MIB / 100 else f"{nbytes} B"
