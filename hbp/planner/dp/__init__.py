"""The optimal planner: a dynamic programme over cut points, nested (a tree of intervals).

Problem. Given a graph and a budget, find the plan (a tiling of the topological order into
plain and recomputed segments, recomputed segments again tiled by children, recursively)
with the least recompute FLOPs whose simulated peak (`hbp.analysis.simulate`) fits. Cuts are
restricted to a candidate set (`hbp.planner.cuts.candidate_cuts`); over that set the DP is
exact for the simulator's memory accounting (proved by the brute-force tests in
tests/test_planner.py), which decomposes over segments.

Read in this order, one file per concern:

- `modes`: the vocabulary (`ChildMode`, `PassExtent`, `RestSaves`).
- `cost_model`: the decomposition of the simulator's accounting over segments
  (`CostModel`), and `profile`: what one child adds (`ChildProfile`, `ChildArrays`).
- `recursion`: the options of a level's first child and the plan walk, shared by
- `solver`: the least-recompute tables over memory slots (`Solver`), and
- `peak`: the least-peak tables in exact bytes (`PeakSolver`: BudgetError's minimum, and the
  fallback when slot rounding rejects a feasible budget).
- `least_peak`: the least peak over the candidate cut sets, remembered per graph structure.
- `held_sets`: the bound on the DP's states its entry points plan within (fewer, evenly
  spread cuts where the held sets explode).
- `entry`: `optimal_plan`, `min_feasible_peak`, `finish_plan`.

Memory is discretised into slots of the budget (exact when every byte count is a multiple
of the slot: the slot is the gcd of the graph's byte counts when that gives at most
max(mem_slots, 1024) slots; otherwise `mem_slots` equal slots with conservative rounding: a
plan the DP accepts always fits).

Stages. `CostModel(info, cuts, bounds)` confines every level to one stage between two bounds,
and `Solver(..., end=b, need_offset=...)` runs the top level of one stage [a, b) on the
stage's own memory axis, with one table row per end requirement (`end_slots`: slots the
stage must leave free at b) and, beside each top table, the bytes kept by the plan it chose
(`top_kept`). `hbp.planner.stages` combines the stages; `optimal_plan` takes its plan on
large graphs when it recomputes less than the whole-graph DP's.
"""

from hbp.planner.cuts import WORK_LIMIT, candidate_cuts, frontier_bytes, window_cuts
from hbp.planner.dp.cost_model import CostModel
from hbp.planner.dp.entry import (
    STAGED,
    absorb_inputs,
    finish_plan,
    kept_bytes,
    min_feasible_peak,
    optimal_plan,
)
from hbp.planner.dp.modes import INF, ChildMode, PassExtent, RestSaves
from hbp.planner.dp.peak import PeakSolver
from hbp.planner.dp.recursion import planning, simplify
from hbp.planner.dp.solver import SlotArrays, Solver

__all__ = [
    "INF",
    "STAGED",
    "WORK_LIMIT",
    "ChildMode",
    "CostModel",
    "PassExtent",
    "PeakSolver",
    "RestSaves",
    "SlotArrays",
    "Solver",
    "absorb_inputs",
    "candidate_cuts",
    "finish_plan",
    "frontier_bytes",
    "kept_bytes",
    "min_feasible_peak",
    "optimal_plan",
    "planning",
    "simplify",
    "window_cuts",
]
