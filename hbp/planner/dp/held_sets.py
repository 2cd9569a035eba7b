"""A bound on the DP's states: where the held sets of a cut set grow past what a plan call
can afford, the planner's entry points plan again over fewer, evenly spread cuts (NOTE [ Cuts
that many values cross ])."""

from __future__ import annotations

import functools
import warnings

from hbp.analysis.liveness import GraphInfo
from hbp.graph.ir import Graph
from hbp.planner.cuts import coarse_cuts, current_coarse_cuts
from hbp.planner.dp.least_peak import remember_coarse_cuts, remembered_coarse_cuts
from hbp.planner.dp.profile import TooManyHeldSets
from hbp.planner.plan import Plan

__all__ = ["COARSE_CUTS", "held_sets_bounded"]


# NOTE [ Cuts that many values cross ]
# The DP's states at a cut are the held sets: which of the storage groups crossing the cut
# the level holds there. On real graphs they follow the order in which the values are made
# and first used, a few dozen at most (NOTE [ Crossing counts are local ] in
# hbp.planner.cuts), and the work limit counts them so. A loop that keeps each step's output
# for after it (an unrolled LSTMCell whose hidden states are stacked at the end, teacher
# forcing, a list of per-layer features) breaks that: each output's holding is decided by
# the child its step falls in, so a cut after t candidate cuts of the loop has 2^t held
# sets. Two stacked LSTMCells unrolled 12 steps planned in 3 s, 16 steps in 52 s and 2 GiB,
# 24 steps ran past 15 minutes and 14 GB. A cost model's DP therefore gives up once it has
# made `MAX_PROFILES` child profiles (hbp.planner.dp.profile: seven times the most a
# `check_plans` graph makes), and `optimal_plan` and `min_feasible_peak` plan again over
# `COARSE_CUTS` candidate cuts spread evenly (`coarse_cuts`: the best position of each of
# k equal runs of the graph, and one window cut per region in stages): the outputs of the
# steps between two cuts are held together, so the states are 2^k at most, and the plan
# still checkpoints the loop every few steps, as by hand. The first count that plans is
# remembered for the graph's structure, so that its next plans start there, and a warning
# says so once. Graphs that stay under the limit plan as before.

#: Counts of evenly spread cuts tried, in order, where the DP over the usual cuts gives up.
COARSE_CUTS = (8, 4, 2)


def held_sets_bounded(function):
    """`function(graph, ..., info=...)`, planned again over fewer, evenly spread cuts where
    its DP meets too many held sets (NOTE [ Cuts that many values cross ])."""

    @functools.wraps(function)
    def bounded(graph: Graph, *args, info: GraphInfo | None = None, **kwargs):
        info = info or GraphInfo.of(graph)
        if current_coarse_cuts() is not None:  # an outer call bounds it
            return function(graph, *args, info=info, **kwargs)
        start = remembered_coarse_cuts(info)
        counts = [start, *(k for k in COARSE_CUTS if start is None or k < start)]
        for k in counts:
            try:
                with coarse_cuts(k):
                    result = function(graph, *args, info=info, **kwargs)
            except TooManyHeldSets as err:
                if k == counts[-1]:
                    raise
                gave_up = err
                continue
            if k is not None and start is None:
                remember_coarse_cuts(info, k)
                warnings.warn(
                    f"hbp: planning over the usual candidate cuts gave up ({gave_up}): values "
                    "that many cuts cross, such as a loop's outputs kept for after it, make its "
                    f"states exponential; planned over {k} cuts spread evenly, so the plan may "
                    "recompute more than the best one",
                    stacklevel=3,
                )
            if isinstance(result, Plan) and k is not None:
                result.meta["coarse_cuts"] = k
            return result
        raise AssertionError("unreachable")

    return bounded
