"""Plans saved and loaded: a directory of plans keyed by the graph's structure, the budget and
the planner's options, so that a sweep or a restarted job does not plan again.

    cache = PlanCache("~/.cache/hbp/plans")
    plan(graph, 0.5, cache=cache)          # planned once, then read back
    save_plan(p, "plan.json", graph)       # one plan, tied to its graph's fingerprint
    p = load_plan("plan.json", graph)      # ConfigError if the graph differs

A plan depends on the graph only through what `hbp.analysis.liveness.GraphInfo` reads: the
nodes' memory and FLOP facts and their wiring by position (NOTE [ What the fingerprint
reads ]). Node names and module paths are labels: a loaded plan gets the names of the graph
it is loaded for. An infeasible budget is cached too: its BudgetError is raised again without
planning.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from pathlib import Path

from hbp.errors import BudgetError, ConfigError
from hbp.files import kept_or_warned, write_text
from hbp.graph.ir import Graph, Node
from hbp.planner.plan import Plan

__all__ = [
    "PLAN_FORMAT",
    "PlanCache",
    "graph_digest",
    "graph_fingerprint",
    "load_plan",
    "plan_key",
    "save_plan",
]

#: Bumped whenever the planner may choose differently for the same inputs: entries written
#: under another format are not read.
PLAN_FORMAT = 1

# NOTE [ What the fingerprint reads ]
# Every Node field but `name` and `module` (labels), with inputs, saved inputs, gradient
# passthroughs and aliases as positions rather than names; the graph's outputs, grad outputs
# and held outputs as positions; the generator state size. Two graphs with equal
# fingerprints have equal GraphInfo arrays, hence equal plans (positions, predictions); the
# names a plan prints are filled in from the graph it is used with.
_LABELS = ("name", "module")
_NAMED = ("inputs", "saved_inputs", "grad_passthrough")


def graph_fingerprint(graph: Graph) -> str:
    """A hex digest of everything the planner reads of `graph` (NOTE [ What the fingerprint
    reads ])."""
    names = [f.name for f in fields(Node) if f.name not in _LABELS]

    def row(node: Node, position) -> list:
        out = []
        for name in names:
            value = getattr(node, name)
            if name in _NAMED:
                value = [position(v) for v in value]
            elif name == "alias_of" and value is not None:
                value = position(value)
            out.append(value)
        return out

    return graph_digest(graph, row, head=(names,), tail=(int(graph.rng_state_bytes),))


def graph_digest(graph: Graph, row, head: tuple = (), tail: tuple = ()) -> str:
    """A hex digest of `head`, `row(node, position)` of every node (`position`: a node's
    name to its index), the graph's outputs, gradient outputs and held outputs by position,
    and `tail` (JSON)."""
    index = {node.name: i for i, node in enumerate(graph.nodes)}

    def position(name):
        return index.get(name, name)

    def positions(names):
        return None if names is None else [position(v) for v in names]

    text = json.dumps(
        [
            *head,
            [row(node, position) for node in graph.nodes],
            positions(graph.outputs),
            positions(graph.grad_outputs),
            positions(graph.held_outputs),
            *tail,
        ],
        default=str,
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).hexdigest()


def plan_key(fingerprint: str, budget, options: dict) -> str:
    """The cache key of a plan: graph fingerprint, budget (as given: 0.5, "min", bytes) and
    planner options."""
    text = json.dumps(
        [PLAN_FORMAT, fingerprint, repr(budget), sorted((k, repr(v)) for k, v in options.items())],
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).hexdigest()


class PlanCache:
    """Plans (and BudgetErrors) on disk, one JSON file per key under `directory`.

    `get` returns the plan for (graph, budget, options), renamed for `graph`, or None; it
    raises the cached BudgetError for a budget known to be infeasible. `put` stores a plan or
    a BudgetError. Writes are atomic (a temporary file renamed), so concurrent jobs sharing a
    directory read whole entries or none; an unreadable entry is a miss.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()

    @classmethod
    def of(cls, plan_cache) -> PlanCache | None:
        """`plan_cache` as the `plan_cache=` option takes it (a directory, a PlanCache or
        None), as a PlanCache or None; ConfigError for anything else, an empty path too."""
        if plan_cache is None or isinstance(plan_cache, PlanCache):
            return plan_cache
        if not isinstance(plan_cache, (str, os.PathLike)) or not str(plan_cache):
            raise ConfigError(
                "plan_cache", plan_cache, "a directory (a non-empty path), a PlanCache or None"
            )
        return cls(plan_cache)

    def path(self, graph: Graph | str, budget, options: dict | None = None) -> Path:
        """The entry's file; `graph` or its fingerprint."""
        fingerprint = graph if isinstance(graph, str) else graph_fingerprint(graph)
        return self.directory / f"{plan_key(fingerprint, budget, options or {})}.json"

    def get(self, graph: Graph, budget, options: dict | None = None) -> Plan | None:
        path = self.path(graph, budget, options)
        try:
            entry = json.loads(path.read_text())
            if "budget_error" in entry:
                err = entry["budget_error"]
                budget_error = BudgetError(
                    int(err["budget"]), int(err["minimum"]), str(err.get("detail", ""))
                )
            else:
                budget_error, plan = None, Plan.from_dict(entry["plan"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable, or not an entry this module wrote: a miss
        if budget_error is not None:
            raise budget_error
        if not _covers(plan.segments, 0, len(graph.nodes)):
            return None
        return _named_for(graph, plan)

    def get_settled(
        self, fingerprint: str, graph: Graph, budget, options: dict
    ) -> tuple[Plan, dict] | None:
        """The plan a step's measurements settled on for the capture of `fingerprint` (the
        graph as it was planned first) and the state it was made in (`put_settled`), or
        None."""
        try:
            entry = json.loads(self.path(fingerprint, budget, _settled(options)).read_text())
            plan, state = Plan.from_dict(entry["plan"]), dict(entry["state"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if not _covers(plan.segments, 0, len(graph.nodes)):
            return None
        return _named_for(graph, plan), state

    def put_settled(self, fingerprint: str, budget, options: dict, plan: Plan, state: dict) -> None:
        """Keep `plan`, made after the first one from what steps measured (the closed loop,
        the outputs the caller keeps), with `state`: what it was made from (JSON)."""
        path = self.path(fingerprint, budget, _settled(options))
        text = json.dumps({"plan": plan.to_dict(), "state": state}, default=str)
        kept_or_warned(self.directory, lambda: write_text(path, text, make_parents=True))

    def put(self, graph: Graph, budget, result: Plan | BudgetError, options: dict | None = None):
        """Store `result` (a plan, or the BudgetError planning raised) for the key."""
        if isinstance(result, BudgetError):
            entry = {
                "budget_error": {
                    "budget": int(result.budget),
                    "minimum": int(result.minimum),
                    "detail": result.detail,
                }
            }
        else:
            entry = {"plan": result.to_dict()}
        path = self.path(graph, budget, options)
        kept_or_warned(
            self.directory,
            lambda: write_text(path, json.dumps(entry, default=str), make_parents=True),
        )


def save_plan(plan: Plan, path: str | os.PathLike, graph: Graph) -> Path:
    """Write `plan` to `path` (JSON) with the fingerprint of the graph it was made for."""
    path = Path(path).expanduser()
    entry = {"format": PLAN_FORMAT, "fingerprint": graph_fingerprint(graph), "plan": plan.to_dict()}
    write_text(path, json.dumps(entry, indent=1, default=str), make_parents=True)
    return path


def load_plan(path: str | os.PathLike, graph: Graph) -> Plan:
    """The plan saved at `path` (`save_plan`), for `graph`.

    Raises:
        ConfigError: the file was saved for a graph of another structure (another model,
            input shape or capture), or by another plan format.
    """
    entry = json.loads(Path(path).expanduser().read_text())
    if entry.get("format") != PLAN_FORMAT:
        raise ConfigError("plan file", str(path), f"a plan saved with plan format {PLAN_FORMAT}")
    if entry.get("fingerprint") != graph_fingerprint(graph):
        raise ConfigError(
            "plan file",
            str(path),
            "a plan saved for this graph (same model, input shapes and capture): its "
            "fingerprint differs",
        )
    return _named_for(graph, Plan.from_dict(entry["plan"]))


def _settled(options: dict) -> dict:
    return {**options, "settled": True}


def _covers(segments, start: int, stop: int) -> bool:
    """Whether `segments` (and each one's children, its own span) tile [start, stop) in
    order: a plan an executor can run on a graph of that many nodes."""
    at = start
    for segment in segments:
        if not (isinstance(segment.start, int) and isinstance(segment.stop, int)):
            return False
        if segment.start != at or segment.stop <= segment.start:
            return False
        if segment.children and not _covers(segment.children, segment.start, segment.stop):
            return False
        at = segment.stop
    return at == stop


def _named_for(graph: Graph, plan: Plan) -> Plan:
    """`plan` with its segment and cut names taken from `graph` (names are labels)."""
    from hbp.analysis.liveness import GraphInfo
    from hbp.planner.tree import name_segments

    info = GraphInfo.of(graph)
    name_segments(info, plan.segments)
    if "cuts" in plan.meta:
        plan.meta["cuts"] = [info.names[s.start] for s in plan.segments[1:]]
    return plan
