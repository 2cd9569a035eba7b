"""The optimum on small graphs: a Checkmate-style integer programme (Jain et al. 2020).

Unlike the planner, which chooses trees of intervals, the programme chooses any
rematerialisation schedule: per stage, which forward values to (re)compute and which to keep
in memory. It is the yardstick for the planner's recompute at a budget. Solved with HiGHS
(highspy); its LP relaxation is a lower bound. A plan of the planner's may start the search
(NOTE [ Starting from the planner's schedule ]).

The model (stages, values, packs, memory terms) is `hbp.planner.schedule_model.Schedule`;
this module adds the solver: `solve(schedule, budget_bytes)`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import highspy
import numpy as np

from hbp.planner.plan import Plan
from hbp.planner.schedule_model import Schedule

__all__ = ["Optimum", "solve"]


@dataclass
class Optimum:
    """The programme's answer at one budget (bytes, FLOPs, seconds).

    Attributes:
        status: "optimal", "infeasible", "time limit", or HiGHS's message.
        recompute_flops: optimal recompute FLOPs (None unless optimal).
        best_found_flops: the best schedule's recompute when the solve stopped: the optimum
            when optimal, the incumbent (an upper bound on the optimum) at a time limit,
            None when none was found.
        lower_bound_flops: the LP relaxation's optimum (a lower bound; None if infeasible or
            not solved).
        proven_bound_flops: the best proven lower bound on the optimum: the optimum itself
            when optimal, else the larger of the LP bound and the MILP's dual bound at the
            time limit (None if infeasible or nothing was proven).
        solve_time_s / lp_time_s: wall time of the MILP / the LP.
        recomputed: (stage label, node name) of every recomputation in the best schedule.
        schedule: the best schedule's recomputations as `Schedule.steps` reads them: (stage,
            value) -> 1 (empty when none was found).
    """

    budget_bytes: int
    status: str
    recompute_flops: float | None
    lower_bound_flops: float | None
    solve_time_s: float
    lp_time_s: float
    variables: int
    recomputed: list[tuple[str, str]] = field(default_factory=list)
    best_found_flops: float | None = None
    proven_bound_flops: float | None = None
    schedule: dict[tuple[int, int], int] = field(default_factory=dict)


class _Result(NamedTuple):
    """One HiGHS solve: status (0 optimal, 1 time limit, 2 infeasible, 4 other), message,
    objective and solution (None when no feasible point was found), the MILP's dual bound."""

    status: int
    message: str
    fun: float | None
    x: np.ndarray | None
    mip_dual_bound: float | None


# NOTE [ Starting from the planner's schedule ]
# On workload graphs the MILP rarely finishes in a minute, and its best schedule at the time
# limit can be worse than the planner's. A plan is a schedule too: its simulated step runs
# each recomputation before some backward, so every recompute event belongs to the stage of
# the next backward event (R[t, i] = 1). `solve(start=plans)` checks each plan's schedule
# with `evaluate` and hands HiGHS every R of the cheapest that fits as a partial solution;
# HiGHS completes the other variables (what is kept, freed, packed) and starts its search
# from there, so the best schedule found is never worse than that schedule, and the bracket
# [proven bound, best found] closes from above. A pinned value's cached rerun is not a
# schedule's (NOTE [ Pinned values ] in hbp.analysis.simulate): here it re-runs at its FLOPs,
# so a plan with pins is a dearer schedule than its prediction, and the plan without pins at
# the same budget is passed beside it (`hbp.optimum.compare`).


def solve(
    schedule: Schedule,
    budget_bytes: int,
    *,
    time_limit: float = 60.0,
    relax: bool = True,
    start: Sequence[Plan] = (),
) -> Optimum:
    """Least recompute FLOPs of `schedule`'s problem with every op's memory <= budget_bytes.

    The MILP stops after `time_limit` seconds (wall time); it then reports the best
    schedule found so far and the proven bound (status "time limit"). `relax` also
    solves the LP relaxation (a lower bound, usually far faster than the MILP). `start`:
    plans of the planner's; the search starts from the cheapest of their schedules that
    fits the budget (NOTE [ Starting from the planner's schedule ])."""
    prog = _Program(schedule, float(budget_bytes))
    recomputed, cheapest = None, np.inf
    for plan in start:
        recomputations = schedule.schedule_of(plan)
        fits = schedule.evaluate(recomputations)
        if fits is not None and fits[0] <= budget_bytes and fits[1] < cheapest:
            recomputed, cheapest = recomputations, fits[1]
    t0 = time.perf_counter()
    res = prog.run(integral=True, time_limit=time_limit, start=recomputed)
    solve_time = time.perf_counter() - t0
    lp, lp_time = None, 0.0
    if relax:
        t1 = time.perf_counter()
        lres = prog.run(integral=False, time_limit=time_limit)
        lp_time = time.perf_counter() - t1
        if lres.status == 0:
            lp = prog.flops(lres.fun)
    status = {0: "optimal", 1: "time limit", 2: "infeasible"}.get(res.status, str(res.message))
    found = res.x is not None and res.status in (0, 1)
    best = prog.flops(res.fun) if found else None
    if res.status == 0:
        bound = best
    else:
        dual = getattr(res, "mip_dual_bound", None)
        proven = [b for b in (lp, None if dual is None else prog.flops(dual)) if b is not None]
        bound = max(proven) if proven and res.status != 2 else None
        bound = None if bound is None or not np.isfinite(bound) else bound
    return Optimum(
        int(budget_bytes),
        status,
        best if res.status == 0 else None,
        lp,
        solve_time,
        lp_time,
        prog.nvar,
        prog.recomputations(res.x) if found else [],
        best,
        bound,
        prog.schedule(res.x) if found else {},
    )


class _Program:
    """Variables, constraints and objective of the MILP for one budget."""

    def __init__(self, sch: Schedule, budget: float):
        self.sch = sch
        T, N = sch.T, sch.N
        self.var: dict[tuple, int] = {}
        lb, ub, cost = [], [], []

        def new(key, lo=0.0, hi=1.0, c=0.0):
            self.var[key] = len(lb)
            lb.append(lo)
            ub.append(hi)
            cost.append(c)
            return self.var[key]

        runs_of: dict[int, list[int]] = {}
        for j in sch.packs:
            runs_of.setdefault(sch.pack_run[j], []).append(j)
        for t in range(T):
            _, kind, q = sch.stages[t]
            for i in sch.ops(t):
                forced = kind == "f" and i == q
                hi = 0.0 if kind == "f" and not forced and not sch.forward_recompute else 1.0
                new(("R", t, i), 1.0 if forced else 0.0, hi, sch.flops[i])
                for j in runs_of.get(i, []):
                    if t <= sch.stage_of[j]:
                        new(("W", t, j))  # this run of i packs for j's backward
        for t in range(T + 1):
            for v in range(N):
                if not sch.is_out[v]:
                    new(("S", t, v), 0.0, 1.0 if t > v else 0.0)
            for j in sch.packs:
                new(("Z", t, j), 0.0, 1.0 if sch.pack_run[j] < t <= sch.stage_of[j] else 0.0)
        rows: list[tuple[dict[int, float], float, float]] = []
        V = self.var

        def R(t, i):
            return V.get(("R", t, i))

        def W(t, j):
            return V.get(("W", t, j))

        def add(row, lo, hi):
            rows.append(({k: c for k, c in row.items() if k is not None}, lo, hi))

        for t in range(T):
            ops = sch.ops(t)
            main = sch.main_uses(t)
            mp = sch.main_pack(t)
            for k in ops:  # inputs: kept, or computed earlier in the stage
                for d in sch.deps[k]:
                    if sch.available(t, d):
                        continue
                    if sch.is_out[d]:
                        add({R(t, k): 1.0, R(t, d): -1.0}, -np.inf, 0.0)
                    else:
                        add({R(t, k): 1.0, R(t, d): -1.0, V["S", t, d]: -1.0}, -np.inf, 0.0)
                for j in runs_of.get(k, []):
                    add({W(t, j): 1.0, R(t, k): -1.0}, -np.inf, 0.0)
            for v in main:  # the backward's saved values are present
                add({V["S", t, v]: 1.0, R(t, v): 1.0}, 1.0, np.inf)
            if mp is not None:  # ... and its node's pack (extras, and in node mode the values)
                add({V["Z", t, mp]: 1.0, W(t, mp): 1.0}, 1.0, np.inf)
            for v in range(N):  # keeping
                if not sch.is_out[v]:
                    add({V["S", t + 1, v]: 1.0, V["S", t, v]: -1.0, R(t, v): -1.0}, -np.inf, 0.0)
            for j in sch.packs:
                add({V["Z", t + 1, j]: 1.0, V["Z", t, j]: -1.0, W(t, j): -1.0}, -np.inf, 0.0)
                if sch.mode == "node":
                    for v in sch.saved_of[j]:
                        if not sch.is_out[v]:
                            add({V["Z", t, j]: 1.0, V["S", t, v]: -1.0}, -np.inf, 0.0)
            # memory at every op, and frees after each
            running: dict[int, float] = {}
            for v in range(N):
                if not sch.is_out[v]:
                    running[V["S", t, v]] = sch.size[v]
            for j in sch.packs:
                running[V["Z", t, j]] = sch.extra_of[j]
            for pos, k in enumerate(ops):
                rk = R(t, k)
                if not sch.is_out[k]:
                    running[rk] = running.get(rk, 0.0) + sch.size[k]
                for j in runs_of.get(k, []):
                    if W(t, j) is not None:
                        running[W(t, j)] = running.get(W(t, j), 0.0) + sch.extra_of[j]
                at_op = dict(running)
                at_op[rk] = at_op.get(rk, 0.0) + sch.scratch[k] + sch.copy_bytes(t, k)
                for j in runs_of.get(k, []):  # a run that does not pack: extras are scratch
                    at_op[rk] += sch.extra_of[j]
                    if W(t, j) is not None:
                        at_op[W(t, j)] = at_op.get(W(t, j), 0.0) - sch.extra_of[j]
                add(at_op, -np.inf, budget - sch.base(t, k))
                later = ops[pos + 1 :]
                for v in [*sch.deps[k], k]:
                    if sch.is_out[v] or v in main:
                        continue
                    fv = new(("FREE", t, v, k))
                    add({fv: 1.0, rk: -1.0}, -np.inf, 0.0)
                    add({fv: 1.0, V["S", t + 1, v]: 1.0}, -np.inf, 1.0)
                    for u in later:
                        if v in sch.deps[u]:
                            add({fv: 1.0, R(t, u): 1.0}, -np.inf, 1.0)
                    if v != k:  # freeing needs v present: kept, or computed in the stage
                        add({fv: 1.0, V["S", t, v]: -1.0, R(t, v): -1.0}, -np.inf, 0.0)
                    running[fv] = running.get(fv, 0.0) - sch.size[v]
                for j in runs_of.get(k, []):
                    if W(t, j) is None or j == mp or not sch.extra_of[j]:
                        continue
                    fx = new(("FREEX", t, j))
                    add({fx: 1.0, W(t, j): -1.0}, -np.inf, 0.0)
                    add({fx: 1.0, V["Z", t + 1, j]: 1.0}, -np.inf, 1.0)
                    running[fx] = running.get(fx, 0.0) - sch.extra_of[j]
            if sch.stages[t][1] == "b":
                add(dict(running), -np.inf, budget - sch.base(t, None))
        self.nvar = len(lb)
        self.lb, self.ub, self.cost = np.array(lb), np.array(ub), np.array(cost)
        self.constant = float(sch.flops.sum())
        starts, cols, vals, lo, hi = [0], [], [], [], []
        for row, a, b in rows:
            for c in sorted(row):
                cols.append(c)
                vals.append(row[c])
            starts.append(len(cols))
            lo.append(a)
            hi.append(b)
        # row-wise sparse: row r's columns are cols[starts[r]:starts[r + 1]]
        self.A = (np.array(starts, np.int32), np.array(cols, np.int32), np.array(vals))
        self.lo, self.hi = np.array(lo), np.array(hi)

    def flops(self, objective: float) -> float:
        """Recompute FLOPs from an objective value (all computations' FLOPs), without the
        solver's round-off: objectives within 1e-9 of one forward count as no recompute."""
        value = max(0.0, float(objective) - self.constant)
        return 0.0 if value <= 1e-9 * max(1.0, self.constant) else value

    def run(self, integral: bool, time_limit: float, start: dict | None = None) -> _Result:
        """Solve with HiGHS (the MILP, or its LP relaxation), `start`'s recomputations (stage,
        value) given as a partial solution: every R fixed, HiGHS completes the rest."""
        h = _quiet_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("time_limit", float(time_limit))
        h.passModel(self._model(integral))
        if integral and start is not None:
            index, value = [], []
            for (kind, *key), i in self.var.items():
                if kind == "R":
                    index.append(i)
                    value.append(float(start.get(tuple(key), 0) or self.lb[i]))
            h.setSolution(len(index), np.array(index, np.int32), np.array(value))
        h.run()
        status = h.getModelStatus()
        info = h.getInfo()
        found = info.primal_solution_status == 2  # kSolutionStatusFeasible
        code = {
            highspy.HighsModelStatus.kOptimal: 0,
            highspy.HighsModelStatus.kTimeLimit: 1,
            highspy.HighsModelStatus.kInfeasible: 2,
        }.get(status, 4)
        dual = info.mip_dual_bound if integral else None
        return _Result(
            code,
            h.modelStatusToString(status),
            info.objective_function_value if found else None,
            np.array(h.getSolution().col_value) if found else None,
            dual if dual is not None and np.isfinite(dual) else None,
        )

    def _model(self, integral: bool) -> highspy.HighsLp:
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.nvar, len(self.lo)
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = self.cost, self.lb, self.ub
        lp.row_lower_, lp.row_upper_ = self.lo, self.hi
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = self.A
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = self.nvar, len(self.lo)
        if integral:
            lp.integrality_ = [highspy.HighsVarType.kInteger] * self.nvar
        return lp

    def schedule(self, x) -> dict[tuple[int, int], int]:
        """(stage, value) -> 1 for every computation of solution x but the forward's own."""
        sch = self.sch
        out = {}
        for (kind, *key), idx in self.var.items():
            if kind == "R" and x[idx] > 0.5:
                t, i = key
                if not (sch.stages[t][1] == "f" and sch.stages[t][2] == i):
                    out[t, i] = 1
        return out

    def recomputations(self, x) -> list[tuple[str, str]]:
        """(stage label, node name) of every computation of solution x but the forward's own."""
        sch = self.sch
        return [(sch.stages[t][0], sch.info.names[sch.nodes[i]]) for t, i in self.schedule(x)]


def _quiet_highs() -> highspy.Highs:
    """A HiGHS instance, without the banner its constructor prints to the process's stdout
    (before any option can turn output off): planning a small graph inside a user's step
    solves the programme, and must not write to their stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
            ctypes.CDLL(None).fflush(None)  # C stdio's buffer, before stdout is back
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h
