"""The DP's vocabulary: how a child runs, how much of it a recompute pass runs, and whether
the rest of a level has a save event."""

from __future__ import annotations

import math
from enum import IntEnum

INF = math.inf


class ChildMode(IntEnum):
    """How a child of a level runs: plain autograd, or recomputed (checkpointed)."""

    PLAIN = 0
    RECOMPUTE = 1


class PassExtent(IntEnum):
    """How much of a child a recompute pass runs (torch's early stop: a pass ends at its
    last save event)."""

    FULL = 0  # all of it: the rest of the level has a save event
    UNTIL_SAVE = 1  # up to its own last save event: nothing after it saves
    NOT_RUN = 2  # none of it: no save event from here to the level's end


class RestSaves(IntEnum):
    """The flag of a nested table tail(d, e, H, flag): whether the children [e, d) of the
    level include a save event (where the level's recompute pass stops)."""

    NO = 0
    YES = 1


PLAIN, REC = ChildMode.PLAIN, ChildMode.RECOMPUTE
FULL, UNTIL_SAVE, NOT_RUN = PassExtent.FULL, PassExtent.UNTIL_SAVE, PassExtent.NOT_RUN
