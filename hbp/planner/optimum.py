"""The optimum on small graphs: a Checkmate-style integer programme (Jain et al. 2020).

Unlike the planner, which chooses trees of intervals, the programme chooses any
rematerialisation schedule: per stage, which forward values to (re)compute and which to keep
in memory. It is the yardstick for the planner's recompute at a budget. Solved with scipy's
HiGHS `milp`; its LP relaxation is a lower bound.

Model (the simulator's accounting as far as a schedule allows):
- Stages: one per forward node (it runs there first; earlier values may be recomputed
  before it), then one per node with a backward, in reverse order. In a stage, recomputations
  run in topological order before the stage's main operation.
- R[t, i]: forward node i is computed in stage t; S[t, i]: value i is in memory when stage t
  starts; FREE[t, v, k]: v is freed right after op k of stage t (its last use there, and not
  kept for stage t+1). A computed node needs its inputs kept or computed earlier in the stage;
  a backward needs what the node saves; S[t+1, v] <= S[t, v] + R[t, v].
- Memory at each op (must be <= budget): the plan-independent part (activation and parameter
  gradients, backward scratch, graph outputs: exactly the simulator's), the values kept, what
  the stage computed so far minus what it freed, the op's own output, saved extras (only if
  the run saves them: W[t, i]) and forward scratch. Graph outputs live for the whole step; a
  recomputed output (done only for its saved extras) is a copy freed at once.
Simplification against the simulator: aliases (views, in-place) are folded into their
storage root (their FLOPs are dropped). Everything else a plan does is a schedule here, so
on graphs without aliases the optimum is at most the planner's recompute. Objective: FLOPs
of all computations minus one forward: the recompute FLOPs.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from hbp.analysis.liveness import GraphInfo
from hbp.graph.ir import Graph
from hbp.planner.dp import CostModel


@dataclass
class Optimum:
    """The programme's answer at one budget (bytes, FLOPs, seconds).

    Attributes:
        status: "optimal", "infeasible", or HiGHS's message (time limit, ...).
        recompute_flops: optimal recompute FLOPs (None unless optimal).
        lower_bound_flops: the LP relaxation's optimum (a lower bound; None if infeasible).
        solve_time_s / lp_time_s: wall time of the MILP / the LP.
        recomputed: (stage label, node name) of every recomputation in the optimal schedule.
    """

    budget_bytes: int
    status: str
    recompute_flops: float | None
    lower_bound_flops: float | None
    solve_time_s: float
    lp_time_s: float
    variables: int
    recomputed: list[tuple[str, str]] = field(default_factory=list)


class Schedule:
    """The rematerialisation problem of one graph: stages, values, and memory terms."""

    def __init__(self, graph: Graph, info: GraphInfo | None = None):
        info = self.info = info or GraphInfo.of(graph)
        n = info.n
        model = CostModel(info, [0, n])
        self.pos_bwd, self.pos_after = model.pos_bwd, model.pos_after
        root = info.root
        out_root = np.zeros(n, dtype=bool)
        out_root[root[info.is_output]] = True
        # forward values: non-input storage roots
        self.nodes = [j for j in range(n) if not info.is_input[j] and root[j] == j]
        col = {j: k for k, j in enumerate(self.nodes)}
        N = self.N = len(self.nodes)
        self.size = np.array([int(info.storage_bytes[j]) for j in self.nodes], dtype=float)
        self.is_out = np.array([bool(out_root[j]) for j in self.nodes])
        self.flops = np.zeros(N)
        self.transient = np.zeros(N)
        self.extra = np.zeros(N)
        for j in range(n):
            r = int(root[j])
            if r in col and not info.is_input[j]:
                if j == r:
                    self.flops[col[r]] += info.flops[j]
                self.transient[col[r]] = max(self.transient[col[r]], info.forward_transient[j])
                self.extra[col[r]] += info.extra_bytes[j]
        self.deps: list[list[int]] = []
        for j in self.nodes:
            members = [m for m in range(n) if root[m] == j]
            ds = {col[int(root[v])] for m in members for v in info.inputs[m] if int(root[v]) in col}
            self.deps.append(sorted(ds - {col[j]}))
        # which forward value carries each node's saves (alias saves fold into the root)
        self.out_made = np.cumsum(np.where(self.is_out, self.size, 0.0))
        # stages: (label, kind, index): kind "f" = forward of value q, "b" = backward of node j
        self.stages: list[tuple[str, str, int]] = [
            (f"forward:{info.names[j]}", "f", k) for k, j in enumerate(self.nodes)
        ]
        self.saved_of: dict[int, list[int]] = {}
        self.extra_of: dict[int, int] = {}
        for j in range(n - 1, -1, -1):
            if not info.has_backward[j]:
                continue
            saved = {int(root[v]) for v in info.saved[j]}
            if info.saves_output[j]:
                saved.add(int(root[j]))
            self.saved_of[j] = sorted(col[r] for r in saved if r in col)
            if info.extra_bytes[j] and int(root[j]) in col:
                self.extra_of[j] = col[int(root[j])]
            self.stages.append((f"backward:{info.names[j]}", "b", j))
        self.T = len(self.stages)

    # -- the schedule's structure ---------------------------------------------------------
    def ops(self, t: int) -> list[int]:
        """Forward values that may be computed in stage t, in order."""
        label, kind, q = self.stages[t]
        return list(range(q + 1 if kind == "f" else self.N))

    def main_uses(self, t: int) -> set[int]:
        label, kind, j = self.stages[t]
        return set(self.saved_of.get(j, [])) if kind == "b" else set()

    def base(self, t: int, op: int | None) -> float:
        """Plan-independent bytes at op `op` of stage t (None: the stage's main op)."""
        label, kind, idx = self.stages[t]
        if kind == "f":
            q = idx
            made = self.out_made[q] if op == q else (self.out_made[q - 1] if q else 0.0)
            return float(made)
        j = idx
        return float(self.pos_bwd[j] if op is None else self.pos_after[j + 1])

    def available_from(self, i: int) -> int:
        """First stage in which value i may be kept (after its forward stage)."""
        return i + 1

    # -- the integer programme --------------------------------------------------------------
    def solve(
        self, budget_bytes: int, *, time_limit: float = 60.0, relax: bool = True
    ) -> Optimum:
        """Least recompute FLOPs with every op's memory <= budget_bytes."""
        prog = _Program(self, float(budget_bytes))
        t0 = time.perf_counter()
        res = prog.run(integral=True, time_limit=time_limit)
        solve_time = time.perf_counter() - t0
        lp, lp_time = None, 0.0
        if relax:
            t1 = time.perf_counter()
            lres = prog.run(integral=False, time_limit=time_limit)
            lp_time = time.perf_counter() - t1
            if lres.status == 0:
                lp = max(0.0, float(lres.fun) - prog.constant)
        status = {0: "optimal", 2: "infeasible"}.get(res.status, str(res.message))
        value = max(0.0, float(res.fun) - prog.constant) if res.status == 0 else None
        recomputed = prog.recomputations(res.x) if res.status == 0 else []
        return Optimum(
            int(budget_bytes), status, value, lp, solve_time, lp_time, prog.nvar, recomputed
        )

    # -- evaluating a given schedule (for brute force and tests) ------------------------------
    def evaluate(self, R: dict[tuple[int, int], int]) -> tuple[float, float] | None:
        """(peak bytes, recompute FLOPs) of the schedule computing what R says (stage, value)
        -> 1, keeping only what is needed later and freeing at last use; None if a
        computation lacks an input or a backward lacks a saved value."""
        T, N = self.T, self.N
        comp = [[bool(R.get((t, i), 0)) for i in range(N)] for t in range(T)]
        for t, (_, kind, q) in enumerate(self.stages):
            if kind == "f":
                comp[t][q] = True
        # uses[t][v]: stage t reads v from memory (not computed before the use in t)
        uses = [[False] * N for _ in range(T)]
        for t in range(T):
            for k in self.ops(t):
                if comp[t][k]:
                    for d in self.deps[k]:
                        if not self.is_out[d] or self._out_kept(t, d):
                            uses[t][d] |= not comp[t][d]
            for v in self.main_uses(t):
                uses[t][v] |= not comp[t][v]
        S = [[False] * N for _ in range(T + 1)]
        for v in range(N):
            need = False
            for t in range(T - 1, -1, -1):
                # kept at the start of t iff used in t from memory, or needed later and not
                # (re)made in t
                need = uses[t][v] or (need and not comp[t][v])
                S[t][v] = need
        # saved extras: made by the last run of the node before the backward that needs them
        # (that run saves), kept from then to that backward
        save = [[False] * N for _ in range(T)]
        X = [[False] * N for _ in range(T + 1)]
        for b in range(T):
            for v in self._main_extra(b):
                src = max(t for t in range(b + 1) if comp[t][v])
                save[src][v] = True
                for t in range(src + 1, b + 1):
                    X[t][v] = True
        peak, cost = 0.0, -float(self.flops.sum())
        for t in range(T):
            have = [S[t][v] or False for v in range(N)]
            for k in self.ops(t):
                if comp[t][k]:
                    for d in self.deps[k]:
                        if not (have[d] or self._out_kept(t, d)):
                            return None
                    have[k] = True
            for v in self.main_uses(t):
                if not (S[t][v] or comp[t][v] or self._out_kept(t, v)):
                    return None
            _, kind, j = self.stages[t]
            if kind == "b" and j in self.extra_of:
                x = self.extra_of[j]
                if not (X[t][x] or save[t][x]):
                    return None
            mem = sum(self.size[v] for v in range(N) if S[t][v] and not self.is_out[v])
            mem += sum(self.extra[v] for v in range(N) if X[t][v])
            ops = [k for k in self.ops(t) if comp[t][k]]
            for pos, k in enumerate(ops):
                cost += self.flops[k]
                mem += (0.0 if self.is_out[k] else self.size[k]) + self.extra[k] * save[t][k]
                copy = self.size[k] if self.is_out[k] and not (kind == "f" and k == j) else 0.0
                peak = max(peak, self.base(t, k) + mem + self.transient[k] + copy)
                later = set(ops[pos + 1 :])
                for v in [*self.deps[k], k]:
                    if self.is_out[v] or v in self.main_uses(t) or S[t + 1][v]:
                        continue
                    if any(v in self.deps[u] for u in later):
                        continue
                    if v == k or comp[t][v] or S[t][v]:
                        mem -= self.size[v]
                if save[t][k] and not (X[t + 1][k] or k in self._main_extra(t)):
                    mem -= self.extra[k]
            if kind == "b":
                peak = max(peak, self.base(t, None) + mem)
        return peak, cost

    def _out_kept(self, t: int, v: int) -> bool:
        return bool(self.is_out[v]) and t >= self.available_from(v)

    def _main_extra(self, t: int) -> set[int]:
        _, kind, j = self.stages[t]
        return {self.extra_of[j]} if kind == "b" and j in self.extra_of else set()


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

        for t in range(T):
            _, kind, q = sch.stages[t]
            for i in sch.ops(t):
                forced = kind == "f" and i == q
                new(("R", t, i), 1.0 if forced else 0.0, 1.0, sch.flops[i])
                if sch.extra[i]:
                    new(("W", t, i))  # this run saves (allocates the saved extras)
        for t in range(T + 1):
            for v in range(N):
                hi = 1.0 if t >= sch.available_from(v) else 0.0
                if not sch.is_out[v]:
                    new(("S", t, v), 0.0, hi)
                if sch.extra[v]:
                    new(("X", t, v), 0.0, hi)
        rows: list[tuple[dict[int, float], float, float]] = []

        def R(t, i):
            return self.var.get(("R", t, i))

        def W(t, i):
            return self.var.get(("W", t, i))

        for t in range(T):
            ops = sch.ops(t)
            main = sch.main_uses(t)
            kind, q = sch.stages[t][1], sch.stages[t][2]
            # inputs of a computation: kept, or computed earlier in the stage
            for k in ops:
                for d in sch.deps[k]:
                    if sch.is_out[d]:
                        if not sch._out_kept(t, d):
                            rows.append(({R(t, k): 1.0, R(t, d): -1.0}, -np.inf, 0.0))
                        continue
                    rows.append(
                        ({R(t, k): 1.0, R(t, d): -1.0, self.var["S", t, d]: -1.0}, -np.inf, 0.0)
                    )
            for v in main:  # what the backward saved
                if sch.is_out[v]:
                    continue
                row = {self.var["S", t, v]: 1.0}
                if R(t, v) is not None:
                    row[R(t, v)] = 1.0
                rows.append((row, 1.0, np.inf))
            for x in sch._main_extra(t):
                row = {self.var["X", t, x]: 1.0}
                if W(t, x) is not None:
                    row[W(t, x)] = 1.0
                rows.append((row, 1.0, np.inf))
            for k in ops:
                if W(t, k) is not None:
                    rows.append(({W(t, k): 1.0, R(t, k): -1.0}, -np.inf, 0.0))
            # keeping: S[t+1, v] <= S[t, v] + R[t, v]
            for v in range(N):
                kinds = ([] if sch.is_out[v] else ["S"]) + (["X"] if sch.extra[v] else [])
                for kind in kinds:
                    row = {self.var[kind, t + 1, v]: 1.0, self.var[kind, t, v]: -1.0}
                    made = R(t, v) if kind == "S" else W(t, v)
                    if made is not None:
                        row[made] = -1.0
                    rows.append((row, -np.inf, 0.0))
            # frees after op k and memory at every op
            base = {}
            for v in range(N):
                if not sch.is_out[v]:
                    base[self.var["S", t, v]] = sch.size[v]
                if sch.extra[v]:
                    base[self.var["X", t, v]] = sch.extra[v]
            running = dict(base)
            for pos, k in enumerate(ops):
                rk = R(t, k)
                copy = sch.is_out[k] and not (kind == "f" and k == q)
                if not sch.is_out[k]:
                    running[rk] = running.get(rk, 0.0) + sch.size[k]
                if W(t, k) is not None:
                    running[W(t, k)] = running.get(W(t, k), 0.0) + sch.extra[k]
                at_op = dict(running)
                # scratch, and a recomputed output's copy (the original lives on): op only
                at_op[rk] = at_op.get(rk, 0.0) + sch.transient[k] + (sch.size[k] if copy else 0.0)
                rows.append((at_op, -np.inf, budget - sch.base(t, k)))
                later = ops[pos + 1 :]
                for v in [*sch.deps[k], k]:
                    if sch.is_out[v] or v in main:
                        continue
                    fv = new(("FREE", t, v, k))
                    rows.append(({fv: 1.0, rk: -1.0}, -np.inf, 0.0))
                    rows.append(({fv: 1.0, self.var["S", t + 1, v]: 1.0}, -np.inf, 1.0))
                    for u in later:
                        if v in sch.deps[u]:
                            rows.append(({fv: 1.0, R(t, u): 1.0}, -np.inf, 1.0))
                    if v != k:  # freeing needs v present: kept, or computed in the stage
                        row = {fv: 1.0, self.var["S", t, v]: -1.0}
                        if R(t, v) is not None:
                            row[R(t, v)] = -1.0
                        rows.append((row, -np.inf, 0.0))
                    running[fv] = running.get(fv, 0.0) - sch.size[v]
                if sch.extra[k] and k not in sch._main_extra(t):
                    fx = new(("FREEX", t, k))
                    rows.append(({fx: 1.0, W(t, k): -1.0}, -np.inf, 0.0))
                    rows.append(({fx: 1.0, self.var["X", t + 1, k]: 1.0}, -np.inf, 1.0))
                    running[fx] = running.get(fx, 0.0) - sch.extra[k]
            if sch.stages[t][1] == "b":
                rows.append((dict(running), -np.inf, budget - sch.base(t, None)))
        self.nvar = len(lb)
        self.lb, self.ub, self.cost = np.array(lb), np.array(ub), np.array(cost)
        self.constant = float(sch.flops.sum())
        r_idx, c_idx, vals, lo, hi = [], [], [], [], []
        for r, (row, a, b) in enumerate(rows):
            for c, v in row.items():
                r_idx.append(r)
                c_idx.append(c)
                vals.append(v)
            lo.append(a)
            hi.append(b)
        self.A = coo_matrix((vals, (r_idx, c_idx)), shape=(len(rows), self.nvar)).tocsr()
        self.lo, self.hi = np.array(lo), np.array(hi)

    def run(self, integral: bool, time_limit: float):
        integrality = np.ones(self.nvar) if integral else np.zeros(self.nvar)
        return milp(
            self.cost,
            constraints=LinearConstraint(self.A, self.lo, self.hi),
            integrality=integrality,
            bounds=Bounds(self.lb, self.ub),
            options={"time_limit": time_limit, "disp": False},
        )

    def recomputations(self, x) -> list[tuple[str, str]]:
        sch = self.sch
        out = []
        for (kind, *key), idx in self.var.items():
            if kind == "R" and x[idx] > 0.5:
                t, i = key
                if not (sch.stages[t][1] == "f" and sch.stages[t][2] == i):
                    out.append((sch.stages[t][0], sch.info.names[sch.nodes[i]]))
        return out


def brute_force(schedule: Schedule, budget_bytes: int) -> float | None:
    """Least recompute over every choice of recomputations (stage, value), by enumeration
    (tiny graphs only: 2^(choices) schedules), with `Schedule.evaluate`'s accounting."""
    choices = [
        (t, i)
        for t in range(schedule.T)
        for i in schedule.ops(t)
        if not (schedule.stages[t][1] == "f" and schedule.stages[t][2] == i)
    ]
    best = None
    for bits in itertools.product((0, 1), repeat=len(choices)):
        result = schedule.evaluate({c: b for c, b in zip(choices, bits) if b})
        if result and result[0] <= budget_bytes and (best is None or result[1] < best):
            best = result[1]
    return best
