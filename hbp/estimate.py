"""Will it fit? The memory of a training step before running it: `hbp.estimate`.

    est = hbp.estimate(model, x, loss_fn=lambda out, y: F.cross_entropy(out, y), targets=(y,))
    print(est)                     # naive peak, least reachable peak, budget -> recompute
    est.naive_peak_bytes, est.min_peak_bytes, est.frontier[0].recompute_flops

    python -m hbp.estimate workload=gpt2 profile=small budgets=0.7,0.5,0.3,min

From capture and simulation only, no training step: the module (and the loss, when given) is
captured on fake tensors (`hbp.graph.torch.capture.capture`), each distinct op signature's
kernel workspace is measured once on real tensors (`hbp.graph.torch.calibrate`: one op at a
time, so never more memory than the largest op), and the simulator and the planner give:

- `naive_peak_bytes`: the allocator's peak of the plain step (docs/architecture.md "Metrics": above the
  level before the step, activations, gradients, parameter gradients and kernel workspace
  included; parameters, inputs and optimizer state are not);
- `min_peak_bytes`: the least peak a plan reaches (`budget="min"`; `BudgetError.minimum`);
- `frontier`: for each budget, the plan's predicted peak and recompute FLOPs, and a step-time
  estimate: the step's FLOPs (forward, backward, recompute) at `flops_per_s` (measured with a
  short matmul on the model's device when not given: a rough figure, since memory-bound ops
  run below matmul speed; the ratio between two budgets is the more reliable number).

Without `loss_fn` the estimate is the module's own step (its output's gradient seeded as by
`output.backward(grad)`): the caller's loss adds to the real peak (see `HCModule(loss_fn=)`).
"""

from __future__ import annotations

import sys
import time
import types
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from hbp.analysis.liveness import GraphInfo
from hbp.analysis.simulate import simulate
from hbp.errors import BudgetError, BudgetWarning, ConfigError
from hbp.graph.torch.scratch_store import ScratchStore
from hbp.integrations.torch.module import DEFAULT_BUDGET
from hbp.planner import min_feasible_peak
from hbp.planner import plan as make_plan
from hbp.planner.budget import Budget
from hbp.planner.cache import PlanCache
from hbp.units import MIB

__all__ = ["Estimate", "FrontierPoint", "estimate", "main"]

#: Budgets of the default frontier: fractions of the naive peak and the default budget of
#: `hbp.enable` and `HCModule` ("min" is always added).
DEFAULT_BUDGETS = (1.0, 0.75, 0.5, DEFAULT_BUDGET)


@dataclass
class FrontierPoint:
    """One budget of the frontier (bytes, FLOPs, seconds)."""

    budget: float | int | str
    budget_bytes: int
    predicted_peak_bytes: int
    recompute_flops: float
    step_time_s: float


@dataclass
class Estimate:
    """What `estimate` predicts for one training step (bytes, FLOPs, seconds).

    naive_peak_bytes: the plain step's peak; min_peak_bytes: the least a plan reaches.
    step_flops: forward + backward FLOPs of the plain step.
    flops_per_s: the throughput the step times assume.
    frontier: one `FrontierPoint` per budget, largest budget first; budgets below the
        minimum are left out of it.
    below_minimum: those budgets (as given), with their bytes: no plan fits them.
    nodes, granularity: the captured graph's size and level ("op" or "module").
    capture_time_s, estimate_time_s: capture (with scratch calibration) and the whole call.
    """

    naive_peak_bytes: int
    min_peak_bytes: int
    step_flops: float
    flops_per_s: float
    frontier: list[FrontierPoint] = field(default_factory=list)
    below_minimum: list[tuple[object, int]] = field(default_factory=list)
    nodes: int = 0
    granularity: str = "op"
    capture_time_s: float = 0.0
    estimate_time_s: float = 0.0

    def fits(self, budget) -> bool:
        """Whether a plan fits `budget` (any form of `hbp.Budget`)."""
        target = Budget.parse(budget).resolve(self.naive_peak_bytes, lambda: self.min_peak_bytes)
        return target == "min" or target >= self.min_peak_bytes

    def __str__(self) -> str:
        naive_time = self.step_flops / self.flops_per_s
        lines = [
            f"hbp.estimate: {self.nodes} nodes ({self.granularity} level), "
            f"estimated in {self.estimate_time_s:.1f} s",
            f"  naive peak      {self.naive_peak_bytes / MIB:10.2f} MiB   "
            f"step {self.step_flops:.3g} FLOPs, ~{naive_time * 1e3:.1f} ms at "
            f"{self.flops_per_s / 1e9:.1f} GFLOP/s",
            f"  least reachable {self.min_peak_bytes / MIB:10.2f} MiB   "
            f"({self.min_peak_bytes / self.naive_peak_bytes:.2f}x naive)",
            f"  {'budget':>10} {'MiB':>9} {'predicted MiB':>14} {'recompute':>10} {'step ms':>8}",
        ]
        for p in self.frontier:
            lines.append(
                f"  {str(p.budget):>10} {p.budget_bytes / MIB:9.2f} "
                f"{p.predicted_peak_bytes / MIB:14.2f} "
                f"{p.recompute_flops / self.step_flops:9.1%} {p.step_time_s * 1e3:8.1f}"
            )
        for budget, nbytes in self.below_minimum:
            lines.append(
                f"  {str(budget):>10} {nbytes / MIB:9.2f}   does not fit (below the least)"
            )
        if any(str(p.budget) == DEFAULT_BUDGET for p in self.frontier):
            lines.append(f"  ({DEFAULT_BUDGET}: the default budget of hbp.enable and HCModule)")
        return "\n".join(lines)


def _budget_list(budgets) -> list | None:
    """`budgets` as a list: one budget (a number, a string, a `Budget`) is a list of one;
    each is validated where it is planned."""
    if budgets is None:
        return None
    if isinstance(budgets, (int, float, str, Budget)):
        return [budgets]
    if not isinstance(budgets, (list, tuple)):
        raise ConfigError("budgets", budgets, "a budget or a list of budgets")
    return list(budgets)


def estimate(
    model: nn.Module,
    *inputs,
    loss_fn=None,
    targets=(),
    budgets=None,
    block_size: int = 1,
    planner: str = "optimal",
    flops_per_s: float | None = None,
    keeps_outputs: bool = False,
    plan_cache=None,
    **kwargs,
) -> Estimate:
    """Estimate the memory of one training step of `model(*inputs, **kwargs)`.

    Args:
        model: the nn.Module (train/eval flags as they are; nothing in it changes).
        inputs, kwargs: its inputs, as for a call (tensors with real values: each op is run
            once on them to measure its kernel workspace).
        loss_fn: `loss_fn(output, *targets)`, the step's loss (as `HCModule(loss_fn=)`).
        targets: a tensor or a tuple of tensors for `loss_fn`.
        budgets: the frontier's budgets (fractions, bytes, sizes, "min"), or one of them;
            default `DEFAULT_BUDGETS` and "min".
        block_size, planner: as for `HCModule`.
        flops_per_s: the device's throughput for the step-time estimates (default: measured
            with a short matmul).
        keeps_outputs: whether the caller keeps the outputs until backward ends. False, the
            default, is what `HCModule` plans its first step for, and what
            `model(**batch).loss.backward()` and Trainer do: only the loss is kept. True: a
            caller that holds the outputs (logits it logs) through backward.
        plan_cache: a directory (as `HCModule`'s): the measured workspaces and the
            frontier's plans are read from it and kept there, so that estimating the same
            model and shapes again measures and plans nothing.

    Returns:
        An `Estimate`; `print` it for a table.
    """
    from hbp.graph.torch.capture import capture

    # one definition of "the step with its loss", and of a training step's keyword arguments
    from hbp.integrations.torch.loss import WithLoss, training_kwargs

    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "an nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError("loss_fn", loss_fn, "a callable loss_fn(output, *targets) or None")
    budgets = _budget_list(budgets)
    start = time.perf_counter()
    targets = tuple(targets) if isinstance(targets, (tuple, list)) else (targets,)
    kwargs = training_kwargs(model, kwargs)
    root = model if loss_fn is None else WithLoss(model, loss_fn, len(inputs))
    args = inputs if loss_fn is None else (*inputs, *targets)
    cache = PlanCache.of(plan_cache)
    store = None if cache is None else ScratchStore.of_plan_cache(cache.directory)
    with torch.enable_grad():
        captured = capture(root, args, kwargs, calibrate=True, scratch_store=store)
        if not captured.scratch_measured:
            warnings.warn(
                "hbp.estimate: a profiler is running, which the measurement of kernel "
                "workspace cannot nest in; the estimate counts tensors only (call it outside "
                "the profiler)",
                BudgetWarning,
                stacklevel=2,
            )
    capture_time = time.perf_counter() - start
    graph = captured.graph
    module_level = _ModuleLevel(captured, block_size, planner)
    if not module_level.active:  # []: only those backward starts from, held regardless
        graph.held_outputs = list(graph.outputs) if keeps_outputs else []
    info = GraphInfo.of(graph)
    naive = simulate(graph, info=info)
    step_flops = float(info.flops.sum() + info.backward_flops.sum())
    if not module_level.active:
        minimum, _ = min_feasible_peak(graph, block_size=block_size, info=info)
    else:  # the fallback's executable plans, as HCModule chooses them
        minimum = module_level.minimum(naive.peak_bytes)
    rate = flops_per_s or _matmul_flops_per_s(_device(model, args))
    result = Estimate(
        naive_peak_bytes=int(naive.peak_bytes),
        min_peak_bytes=int(minimum),
        step_flops=step_flops,
        flops_per_s=rate,
        nodes=len(graph),
        granularity=captured.granularity,
        capture_time_s=capture_time,
    )
    for budget in budgets if budgets is not None else (*DEFAULT_BUDGETS, "min"):
        point = _frontier_point(
            graph, budget, naive, minimum, block_size, planner, module_level, cache
        )
        if point is not None:
            point.step_time_s = (step_flops + point.recompute_flops) / rate
            result.frontier.append(point)
        else:
            nbytes = Budget.parse(budget).resolve(naive.peak_bytes, lambda: minimum)
            result.below_minimum.append((budget, minimum if nbytes == "min" else int(nbytes)))
    result.frontier.sort(key=lambda p: -p.budget_bytes)
    result.estimate_time_s = time.perf_counter() - start
    return result


def _frontier_point(
    graph,
    budget,
    naive,
    minimum: int,
    block_size: int,
    planner: str,
    module_level=None,
    cache: PlanCache | None = None,
):
    """The plan at `budget` as a FrontierPoint (step time left 0); None below the minimum.
    The naive step needs no plan; "min" is planned at the minimum already found."""
    resolved = Budget.parse(budget).resolve(naive.peak_bytes, lambda: minimum)
    target = minimum if resolved == "min" else resolved
    if resolved != "min":
        if resolved >= naive.peak_bytes:
            return FrontierPoint(budget, int(naive.peak_bytes), int(naive.peak_bytes), 0.0, 0.0)
        if resolved < minimum:
            return None
    try:
        if module_level is not None and module_level.active:
            plan = module_level.plan(naive.peak_bytes, None if resolved == "min" else resolved)
        else:
            plan = make_plan(graph, target, block_size=block_size, planner=planner, cache=cache)
    except BudgetError:
        return None
    return FrontierPoint(
        budget=budget,
        budget_bytes=int(plan.budget_bytes),
        predicted_peak_bytes=int(plan.predicted_peak_bytes),
        recompute_flops=float(plan.predicted_recompute_flops or 0.0),
        step_time_s=0.0,
    )


class _ModuleLevel:
    """Where the capture fell back to module level, the plans HCModule runs there: chosen
    among the executable ones (NOTE [ Module-level plans ] in hbp/planner/module_level.py),
    so `min_peak_bytes` is HCModule's `budget="min"` and `BudgetError.minimum`, not the
    planner's least plan over the module graph (which the fallback cannot execute).
    `active` is False for op-level captures."""

    def __init__(self, captured, block_size: int, planner: str):
        from hbp.graph.torch.capture import MODULE

        self.captured, self.block_size, self.planner = captured, block_size, planner
        self.active = captured.granularity == MODULE

    def minimum(self, naive_peak_bytes: int) -> int:
        return int(self.plan(naive_peak_bytes, None).predicted_peak_bytes)

    def plan(self, naive_peak_bytes: int, budget_bytes: int | None):
        """The module-level plan for `budget_bytes` (None: the least)."""
        from hbp.planner.module_level import module_level_plan
        from hbp.runtime.executors.module_calls import per_call_plan

        return module_level_plan(
            self.captured,
            int(naive_peak_bytes),
            budget_bytes,
            executable=per_call_plan,
            block_size=self.block_size,
            planner=self.planner,
        )


def _device(model: nn.Module, args) -> torch.device:
    for t in (*args, *model.parameters()):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _matmul_flops_per_s(device: torch.device, n: int = 512, repeats: int = 3) -> float:
    """FLOP/s of an n x n float32 matmul on `device` (best of `repeats`)."""
    a = torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / max(best, 1e-9)


# ---------------------------------------------------------------------------------------
# python -m hbp.estimate workload=gpt2 profile=small budgets=0.5,min
# ---------------------------------------------------------------------------------------

USAGE = (
    "python -m hbp.estimate workload=NAME [profile=small] [budgets=0.8,0.5,min] "
    "[block_size=1] [threads=N] [plan_cache=DIR] [workload.FIELD=VALUE ...]"
)


def main(argv: list[str] | None = None) -> int:
    """Estimate a registered workload's step (model and loss) and print the table. Bad
    arguments: one line on stderr and exit status 2, as `run.py`'s."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {USAGE}")
        return 0
    try:
        return _main(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    from hbp.workloads import build

    args = dict(a.split("=", 1) for a in argv if "=" in a)
    known = {"workload", "profile", "budgets", "block_size", "threads", "plan_cache"}
    overrides = {
        k.split(".", 1)[1]: _value(v) for k, v in args.items() if k.startswith("workload.")
    }
    unknown = sorted(k for k in args if k not in known and not k.startswith("workload."))
    unknown += [a for a in argv if "=" not in a]
    if unknown or "workload" not in args:
        raise ConfigError("argument", unknown or argv, USAGE)
    threads = _value(args.get("threads", str(max(1, torch.get_num_threads()))))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError("threads", args.get("threads"), "an int >= 1")
    torch.set_num_threads(threads)
    wl = build(args["workload"], args.get("profile", "small"), seed=0, **overrides)
    batch = wl.make_batch(0)
    budgets = None
    if "budgets" in args:
        budgets = [_value(b) for b in args["budgets"].split(",")]
    est = estimate(
        wl.model,
        *batch.args,
        loss_fn=lambda output: wl.loss_fn(output, batch),
        budgets=budgets,
        block_size=int(args.get("block_size", 1)),
        plan_cache=args.get("plan_cache"),
        **batch.kwargs,
    )
    print(f"workload={wl.name} profile={wl.profile}")
    if wl.config.get("chunked_loss") is False and "chunked_loss" not in overrides:
        print(
            "the model as the bench's modes build it (the full LM head); "
            "workload.chunked_loss=true: with hbp.ops.chunked_cross_entropy"
        )
    print(est)
    return 0


def _value(text: str):
    """A budget or override from the command line: int, float, None, bool or the string."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


# NOTE [ hbp.estimate is a function and a module ]
# `hbp.estimate(model, ...)` is the public function and `python -m hbp.estimate` the command;
# importing this module makes `hbp.estimate` the module object, so the module is callable and
# calls the function: both spellings work whichever was used first.
class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> Estimate:
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
