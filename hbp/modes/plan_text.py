"""The three lines the bench prints about a tiny plan (torch and JAX alike): what was captured
and planned, the predicted peak within the budget, the predicted recompute. The whole plan is
the run's plan.json. The budget is a fraction of the step as the mode runs it; the bench's one
naive, which the summary compares against, is mode=naive's model (NOTE [ One naive per run ]
in hbp.analysis.collect), so these lines do not call anything naive."""

from __future__ import annotations

from hbp.planner.plan import Plan
from hbp.units import MIB


def plan_lines(plan: Plan, *, budget, planner: str, captured: str, chunked_loss: bool) -> str:
    """`captured`: e.g. "op-level capture, 105 nodes (2.8 s)"."""
    recomputed = sum(s.recompute for s in plan.segments)
    depth = max((s.depth() for s in plan.segments), default=0)
    solve = plan.meta.get("solve_time_s")
    solved = f", solved in {solve:.1f} s" if isinstance(solve, (int, float)) else ""
    if plan.meta.get("from_cache"):  # its solve time is the run's that made it
        solved = ", read from the plan cache"
    # the planned model's own plain step: with the chunked loss where tiny built it, so not
    # the bench's naive (the summary's recompute and peak / naive are against that one)
    model = "this model's plain step" + (", with the chunked loss" if chunked_loss else "")
    what = f"budget {budget:g} of {model}" if isinstance(budget, float) else f"budget {budget}"
    return "\n".join(
        [
            f"tiny: {captured}; plan ({planner}{solved}): {len(plan.segments)} segments, "
            f"{recomputed} recomputed, depth {depth} (the whole plan: plan.json)",
            f"  predicted peak {plan.predicted_peak_bytes / MIB:.2f} MiB within "
            f"{plan.budget_bytes / MIB:.2f} MiB ({what})",
            f"  predicted recompute {100 * plan.predicted_recompute_ratio:.1f}% of the FLOPs of {model}",
        ]
    )
