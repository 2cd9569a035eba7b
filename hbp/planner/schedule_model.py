"""The rematerialisation problem of one graph as schedules (no solver): stages, forward values,
what each backward needs packed, and the memory of a given schedule.

A schedule chooses, per stage, which forward values to (re)compute and which to keep in
memory; `Schedule.steps` turns a choice of recomputations into the stage-by-stage program
the schedule executor runs (`hbp.runtime.executors.schedule`), and `Schedule.evaluate` its
peak and recompute FLOPs with the simulator's accounting. The integer programme that finds the
best schedule is `hbp.planner.milp` (the runtime never imports it).

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

from typing import NamedTuple

import numpy as np

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.graph.ir import Graph
from hbp.planner.dp import CostModel
from hbp.planner.plan import Plan


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
        self.pos_late = model.pos_late
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
        self.scratch = np.zeros(N)
        self.deps: list[list[int]] = [[] for _ in range(N)]
        for m in range(n):
            r = int(root[m])
            if r not in col or info.is_input[m]:
                continue
            k = col[r]
            self.scratch[k] = max(self.scratch[k], info.forward_scratch_bytes[m])
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
        if op is not None:
            return float(self.pos_after[idx + 1])
        # a late out-of-place sum (into a broadcast gradient, of a parameter's gradient),
        # counted beside the stage's saved values (conservative: `Positional.late`)
        return float(max(self.pos_bwd[idx], self.pos_late[idx]))

    def copy_bytes(self, t: int, k: int) -> float:
        """A recomputed graph output is a copy (the original lives to the end of the step)."""
        _, kind, q = self.stages[t]
        return float(self.size[k]) if self.is_out[k] and not (kind == "f" and k == q) else 0.0

    def available(self, t: int, v: int) -> bool:
        """Graph outputs are always available once made (their forward stage is v)."""
        return bool(self.is_out[v]) and t > v

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
                scratch = self.scratch[k] + self.copy_bytes(t, k)
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


def recomputations(sch: Schedule, plan: Plan) -> dict[tuple[int, int], int]:
    """`plan.schedule` as the programme's (stage, value) -> 1 (what `Schedule.steps` reads)."""
    col = {j: k for k, j in enumerate(sch.nodes)}
    return {(sch.stage_of[s.node], col[v]): 1 for s in plan.schedule for v in s.values}
