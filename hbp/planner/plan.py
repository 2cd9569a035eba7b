"""A plan: which intervals of a graph's topological order are recomputed, nested.

The top level of a plan is a list of `Segment`s that tile [0, len(graph)). A segment with
`recompute=False` runs as plain autograd (everything its nodes save is kept). A segment with
`recompute=True` is checkpointed: its forward keeps only its inputs and its outputs, and its
backward first runs it forward again, following `children` (a tiling of the segment's own
interval, which may itself contain recomputed segments: the interval tree). A recomputed
segment without children recomputes its interval as plain autograd.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MIB = 1024 * 1024


@dataclass
class Segment:
    """Nodes [start, stop) of the graph's topological order."""

    start: int
    stop: int
    recompute: bool = False
    children: list[Segment] = field(default_factory=list)

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)


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
    """

    segments: list[Segment]
    budget_bytes: int = 0
    predicted_peak_bytes: int = 0
    predicted_recompute_flops: float = 0.0
    naive_peak_bytes: int = 0
    naive_flops: float = 0.0
    kept_bytes: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def predicted_recompute_ratio(self) -> float:
        return self.predicted_recompute_flops / self.naive_flops if self.naive_flops else 0.0

    def cut_points(self) -> list[int]:
        """Start index of every top-level segment after the first."""
        return [s.start for s in self.segments[1:]]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        def seg(x: dict) -> Segment:
            return Segment(x["start"], x["stop"], x["recompute"], [seg(c) for c in x["children"]])

        d = dict(d)
        d["segments"] = [seg(s) for s in d["segments"]]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
