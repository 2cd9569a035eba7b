"""The optimum on small graphs: a Checkmate-style integer programme (Jain et al. 2020).

Unlike the planner, which chooses trees of intervals, the programme chooses any
rematerialisation schedule: per stage, which forward values to (re)compute and which to keep
in memory. It is the yardstick for the planner's recompute at a budget. Solved with HiGHS
(highspy); its LP relaxation is a lower bound. A plan of the planner's may start the search
(NOTE [ Starting from the planner's schedule ]).

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
  the run saves them: W[t, i]; a run that does not save them allocates them as scratch, as
  the simulator charges ops run with saving off) and forward scratch. Graph outputs live for
  the whole step; a recomputed output (done only for its saved extras) is a copy freed at once.
Simplification against the simulator: aliases (views, in-place) are folded into their
storage root (their FLOPs are dropped). Everything else a plan without pinned values does is
a schedule here, so on graphs without aliases the optimum is at most the recompute of the
planner's plans without pins. A pinned value (NOTE [ Pinned values ] in
hbp.analysis.simulate) is not: its node re-runs in the recompute pass at no cost (the cached
output) and packs what its backward saves, while here a backward's saved values are packed
only by a computation that costs the node's FLOPs. Objective: FLOPs
of all computations minus one forward: the recompute FLOPs.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import highspy
import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph
from hbp.planner.dp import CostModel
from hbp.planner.plan import Plan


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


class ScheduleOp(NamedTuple):
    """One computation of a schedule's stage (`Schedule.steps`).

    value: the forward value computed (an index into `Schedule.nodes`).
    packs: IR nodes whose backward uses what this run saves (its last run before them).
    frees: values let go right after it (their last use in the stage, not kept).
    A pack lives from its run to its backward: it is this stage's, or kept for a later one.
    """

    value: int
    packs: tuple[int, ...]
    frees: tuple[int, ...]


class StageSteps(NamedTuple):
    """One stage of a schedule: the values and packs held when it starts, its computations."""

    held: tuple[int, ...]
    kept_packs: tuple[int, ...]
    ops: tuple[ScheduleOp, ...]


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


def forward_values(info: GraphInfo) -> list[int]:
    """IR indices of a graph's forward values, the programme's columns: the storage roots
    that are not graph inputs (an alias folds into its root)."""
    return [j for j in range(info.n) if not info.is_input[j] and info.root[j] == j]


class Schedule:
    """The rematerialisation problem of one graph: values, stages, packs and memory terms.

    `mode="node"` (default): a backward's saved values must be those its own node packed when
    it last ran, held in memory since (what torch executors can do: checkpointing re-runs the
    op that saved a tensor; selective checkpointing decides per op). `mode="tensor"`
    (Checkmate's model): any copy of a saved value will do, so a single value can be
    recomputed for a backward without re-running its consumer.
    """

    def __init__(
        self,
        graph: Graph,
        info: GraphInfo | None = None,
        mode: str = "node",
        forward_recompute: bool = True,
    ):
        self.forward_recompute = forward_recompute
        if mode not in ("node", "tensor"):
            raise ValueError(f"mode={mode!r} is not accepted: expected 'node' or 'tensor'")
        self.mode, self.graph = mode, graph
        info = self.info = info or GraphInfo.of(graph)
        n = info.n
        model = CostModel(info, [0, n])
        self.pos_bwd, self.pos_after = model.pos_bwd, model.pos_after
        root = info.root
        out_root = np.zeros(n, dtype=bool)
        out_root[root[info.is_held]] = True
        # forward values: non-input storage roots; aliases fold into their root
        self.nodes = forward_values(info)
        col = {j: k for k, j in enumerate(self.nodes)}
        N = self.N = len(self.nodes)
        self.size = np.array([float(info.storage_bytes[j]) for j in self.nodes])
        self.is_out = np.array([bool(out_root[j]) for j in self.nodes])
        self.flops = np.array([float(info.flops[j]) for j in self.nodes])
        self.transient = np.zeros(N)
        self.deps: list[list[int]] = [[] for _ in range(N)]
        for m in range(n):
            r = int(root[m])
            if r not in col or info.is_input[m]:
                continue
            k = col[r]
            self.transient[k] = max(self.transient[k], info.forward_transient[m])
            ds = {col[int(root[v])] for v in info.inputs[m] if int(root[v]) in col} - {k}
            self.deps[k] = sorted(set(self.deps[k]) | ds)
        self.out_made = np.cumsum(np.where(self.is_out, self.size, 0.0))
        self.stages: list[tuple[str, str, int]] = [
            (f"forward:{info.names[j]}", "f", k) for k, j in enumerate(self.nodes)
        ]
        # packs: what each backward needs from its node's run (saved values, extras)
        self.pack_run: dict[int, int] = {}  # backward node -> the forward value whose run packs
        self.saved_of: dict[int, list[int]] = {}
        self.extra_of: dict[int, float] = {}
        self.stage_of: dict[int, int] = {}
        for j in range(n - 1, -1, -1):
            if not info.has_backward[j]:
                continue
            saved = {int(root[v]) for v in info.saved[j]}
            if info.saves_output[j]:
                saved.add(int(root[j]))
            self.saved_of[j] = sorted(col[r] for r in saved if r in col)
            if int(root[j]) in col:
                self.pack_run[j] = col[int(root[j])]
                self.extra_of[j] = float(info.extra_bytes[j])
            self.stage_of[j] = len(self.stages)
            self.stages.append((f"backward:{info.names[j]}", "b", j))
        self.T = len(self.stages)
        self.packs = [j for j in self.pack_run if self.saved_of[j] or self.extra_of[j]]

    def ops(self, t: int) -> list[int]:
        """Forward values that may be computed in stage t, in order (a recomputed output is
        a copy made only for what its node packs)."""
        _, kind, q = self.stages[t]
        return list(range(q + 1 if kind == "f" else self.N))

    def main_uses(self, t: int) -> set[int]:
        _, kind, j = self.stages[t]
        return {v for v in self.saved_of.get(j, []) if not self.is_out[v]} if kind == "b" else set()

    def main_pack(self, t: int) -> int | None:
        _, kind, j = self.stages[t]
        return j if kind == "b" and j in self.packs else None

    def base(self, t: int, op: int | None) -> float:
        """Plan-independent bytes at op `op` of stage t (None: the stage's main op)."""
        _, kind, idx = self.stages[t]
        if kind == "f":
            made = self.out_made[idx] if op == idx else (self.out_made[idx - 1] if idx else 0.0)
            return float(made)
        return float(self.pos_bwd[idx] if op is None else self.pos_after[idx + 1])

    def copy_bytes(self, t: int, k: int) -> float:
        """A recomputed graph output is a copy (the original lives to the end of the step)."""
        _, kind, q = self.stages[t]
        return float(self.size[k]) if self.is_out[k] and not (kind == "f" and k == q) else 0.0

    def available(self, t: int, v: int) -> bool:
        """Graph outputs are always available once made (their forward stage is v)."""
        return bool(self.is_out[v]) and t > v

    # -- the integer programme ----------------------------------------------------------------
    def solve(
        self,
        budget_bytes: int,
        *,
        time_limit: float = 60.0,
        relax: bool = True,
        start: Sequence[Plan] = (),
    ) -> Optimum:
        """Least recompute FLOPs with every op's memory <= budget_bytes.

        The MILP stops after `time_limit` seconds (wall time); it then reports the best
        schedule found so far and the proven bound (status "time limit"). `relax` also
        solves the LP relaxation (a lower bound, usually far faster than the MILP). `start`:
        plans of the planner's; the search starts from the cheapest of their schedules that
        fits the budget (NOTE [ Starting from the planner's schedule ])."""
        prog = _Program(self, float(budget_bytes))
        recomputed, cheapest = None, np.inf
        for plan in start:
            schedule = self.schedule_of(plan)
            fits = self.evaluate(schedule)
            if fits is not None and fits[0] <= budget_bytes and fits[1] < cheapest:
                recomputed, cheapest = schedule, fits[1]
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

    # -- a given schedule (brute force, tests) ------------------------------------------------
    def schedule_of(self, plan: Plan) -> dict[tuple[int, int], int]:
        """The recomputations (stage, value) of `plan` as executed: each recompute event of
        its simulated step belongs to the stage of the next backward (NOTE [ Starting from the
        planner's schedule ])."""
        col = {j: k for k, j in enumerate(self.nodes)}
        index = {name: j for j, name in enumerate(self.info.names)}
        pending: list[int] = []
        recomputed: dict[tuple[int, int], int] = {}
        for event, _ in simulate(self.graph, plan, info=self.info).timeline:
            phase, _, name = event.partition(":")
            j = index.get(name)
            if phase == "recompute" and int(self.info.root[j]) in col:
                pending.append(col[int(self.info.root[j])])
            elif phase == "backward" and j in self.stage_of:
                for k in pending:
                    recomputed[self.stage_of[j], k] = 1
                pending = []
        return recomputed

    def steps(self, R: dict[tuple[int, int], int]) -> list[StageSteps] | None:
        """What the schedule that computes value i in stage t for every R[(t, i)] = 1 (plus
        each forward stage's own value) does, stage by stage: it packs each backward's needs
        at its node's last run before it, keeps only what is needed later and frees at last
        use. None if something needed is missing. `evaluate` charges these steps; the
        schedule executor (`hbp.runtime.executors.schedule`) runs them."""
        T, N = self.T, self.N
        comp = [[bool(R.get((t, i), 0)) for i in range(N)] for t in range(T)]
        for t, (_, kind, q) in enumerate(self.stages):
            if kind == "f":
                comp[t][q] = True
        hold = [[False] * N for _ in range(T)]  # must be in memory at the start of t
        uses = [[False] * N for _ in range(T)]  # read from memory in t
        pack_made = [set() for _ in range(T)]
        pack_kept = [set() for _ in range(T + 1)]
        for t in range(T):
            for k in self.ops(t):
                if comp[t][k]:
                    for d in self.deps[k]:
                        if not self.available(t, d):
                            uses[t][d] |= not comp[t][d]
            for v in self.main_uses(t):
                uses[t][v] |= not comp[t][v]
            j = self.main_pack(t)
            if j is not None:
                src = max(s for s in range(t + 1) if comp[s][self.pack_run[j]])
                pack_made[src].add(j)
                for s in range(src + 1, t + 1):
                    pack_kept[s].add(j)
                    if self.mode == "node":
                        for v in self.saved_of[j]:
                            if not self.is_out[v]:
                                hold[s][v] = True
        S = [[False] * N for _ in range(T + 1)]
        for v in range(N):
            need = False
            for t in range(T - 1, -1, -1):
                need = hold[t][v] or uses[t][v] or (need and not comp[t][v])
                S[t][v] = need and not self.is_out[v]
        out = []
        for t in range(T):
            have = list(S[t])
            ops = [k for k in self.ops(t) if comp[t][k]]
            for k in ops:
                if any(not (have[d] or self.available(t, d)) for d in self.deps[k]):
                    return None
                have[k] = True
            main = self.main_uses(t)
            if any(not have[v] for v in main):
                return None
            steps = []
            for pos, k in enumerate(ops):
                made = tuple(sorted(j for j in pack_made[t] if self.pack_run[j] == k))
                later = ops[pos + 1 :]
                frees = tuple(
                    v
                    for v in [*self.deps[k], k]
                    if not (self.is_out[v] or v in main or S[t + 1][v])
                    and not any(v in self.deps[u] for u in later)
                )
                steps.append(ScheduleOp(k, made, frees))
            held = tuple(v for v in range(N) if S[t][v])
            out.append(StageSteps(held, tuple(sorted(pack_kept[t])), tuple(steps)))
        return out

    def evaluate(self, R: dict[tuple[int, int], int]) -> tuple[float, float] | None:
        """(peak bytes, recompute FLOPs) of the schedule `steps(R)` describes; None if
        something needed is missing."""
        stages = self.steps(R)
        if stages is None:
            return None
        peak, cost = 0.0, -float(self.flops.sum())
        for t, stage in enumerate(stages):
            mem = sum(self.size[v] for v in stage.held)
            mem += sum(self.extra_of[j] for j in stage.kept_packs)
            for op in stage.ops:
                k = op.value
                cost += self.flops[k]
                mem += (0.0 if self.is_out[k] else self.size[k]) + sum(
                    self.extra_of[j] for j in op.packs
                )
                scratch = self.transient[k] + self.copy_bytes(t, k)
                scratch += sum(  # a run that does not pack allocates the extras transiently
                    self.extra_of[j]
                    for j in self.packs
                    if self.pack_run[j] == k and j not in op.packs
                )
                peak = max(peak, self.base(t, k) + mem + scratch)
                mem -= sum(self.size[v] for v in op.frees)
            if self.stages[t][1] == "b":
                peak = max(peak, self.base(t, None) + mem)
        return peak, cost


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
                at_op[rk] = at_op.get(rk, 0.0) + sch.transient[k] + sch.copy_bytes(t, k)
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


def all_schedules(schedule: Schedule) -> list[tuple[float, float]]:
    """(peak bytes, recompute FLOPs) of every choice of recomputations (stage, value) that
    is executable, with `Schedule.evaluate`'s accounting (tiny graphs only: 2^choices)."""
    choices = [
        (t, i)
        for t in range(schedule.T)
        for i in schedule.ops(t)
        if not (schedule.stages[t][1] == "f" and schedule.stages[t][2] == i)
    ]
    out = []
    for bits in itertools.product((0, 1), repeat=len(choices)):
        result = schedule.evaluate({c: b for c, b in zip(choices, bits) if b})
        if result is not None:
            out.append(result)
    return out


def brute_force(schedule: Schedule, budget_bytes: int, results=None) -> float | None:
    """Least recompute over every schedule (see `all_schedules`) that fits the budget."""
    results = all_schedules(schedule) if results is None else results
    fits = [cost for peak, cost in results if peak <= budget_bytes]
    return min(fits) if fits else None
