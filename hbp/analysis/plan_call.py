"""Facts of a graph kept for the length of one plan call: pure functions of a `GraphInfo` and
their arguments that the stages of one `plan` call ask for again and again (NOTE [ Facts kept
for one plan call ]).

    with plan_call_scope(info):
        cuts = kept_for_plan_call(info, ("candidate cuts", 1, 64), lambda: make_cuts(info))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

from hbp.analysis.liveness import GraphInfo

__all__ = ["kept_for_plan_call", "plan_call_scope"]

T = TypeVar("T")

# NOTE [ Facts kept for one plan call ]
# One `plan` call asks for the same facts of its graph many times: "min" and the plan at the
# least budget both want the candidate cuts (at three sizes: NOTE [ Least peak over other cut
# choices ] in hbp.planner.cuts), the frontier they are ranked by, the floor under the least
# peak, a cost model per cut set, the plan-independent backward bytes each cost model and the
# lower bound read (`hbp.analysis.positional`) and each staged candidate, and each is a pass
# over the whole graph. Inside a plan call's scope
# (`plan_call_scope`, which `hbp.planner.stages.stage_tables_kept` opens) each is made once
# per key and kept on the GraphInfo; the outermost scope's exit drops them all, so nothing
# outlives the call and a graph changed between calls is never answered from before. Outside
# a scope every call makes its fact anew. What is kept must not be changed by its users:
# lists are handed out as copies by their callers.


@contextlib.contextmanager
def plan_call_scope(info: GraphInfo) -> Iterator[bool]:
    """Inside, `kept_for_plan_call(info, ...)` keeps what it makes; the outermost exit drops
    it. Yields whether this is the outermost scope (a caller keeping caches of its own on
    `info` drops them with it)."""
    depth = info.__dict__.get("_plan_call_depth", 0)
    info.__dict__["_plan_call_depth"] = depth + 1
    try:
        yield depth == 0
    finally:
        info.__dict__["_plan_call_depth"] = depth
        if depth == 0:
            info.__dict__.pop("_plan_call_kept", None)
            info.__dict__.pop("_plan_call_depth", None)


def kept_for_plan_call(info: GraphInfo, key: Hashable, make: Callable[[], T]) -> T:
    """`make()`, made once per `key` inside a plan call's scope on `info` (NOTE [ Facts kept
    for one plan call ]), and anew outside one."""
    if not info.__dict__.get("_plan_call_depth"):
        return make()
    kept: dict[Hashable, Any] = info.__dict__.setdefault("_plan_call_kept", {})
    if key not in kept:
        kept[key] = make()
    return kept[key]
