"""Mode "tiny": hbp's planner. The workload's model is wrapped in `hbp.HCModule`, which
captures the training step's graph, plans the least recompute whose simulated peak fits
`budget` (nested checkpoints where one level is not enough) and executes that plan exactly
(same outputs, gradients, dropout masks and BatchNorm statistics as the plain model)."""

from __future__ import annotations

from torch import nn

from hbp.errors import ConfigError
from hbp.integrations.torch import HCModule
from hbp.modes.base import check_planner_options
from hbp.workloads.base import Batch, Workload


class TinyMode:
    """`HCModule(model, budget, block_size=..., planner=..., plan_cache=...)`, planned on the
    bench's batch.

    `chunked_loss` is recorded; the bench builds the workload with it where the workload
    takes that option. `plan_cache`: a directory where plans are kept by captured graph,
    budget and options (`hbp.planner.cache.PlanCache`): a rerun, or another run of a sweep on
    the same graph and budget, reads its plan there (`plan_from_cache` in the metrics; its
    `plan_time_s` is then the read's)."""

    name = "tiny"

    def __init__(
        self,
        budget: float | int | str = "min",
        block_size: int = 1,
        planner: str = "optimal",
        chunked_loss: bool = False,
        plan_cache: str | None = None,
    ):
        check_planner_options(budget, block_size, planner)
        self.budget = budget
        self.block_size = block_size
        self.planner = planner
        self.chunked_loss = bool(chunked_loss)
        if plan_cache is not None and (not isinstance(plan_cache, str) or not plan_cache):
            raise ConfigError("mode.plan_cache", plan_cache, "a directory, or null")
        self.plan_cache = plan_cache
        self.module: HCModule | None = None
        self.built_with_chunked_loss = False  # the workload has the option and was built with it

    def apply(self, workload: Workload, batch: Batch) -> nn.Module:
        """Wrap the model in HCModule and plan for the batch's training signature (raises
        `hbp.BudgetError` when no plan fits)."""
        workload.model.train()
        self.built_with_chunked_loss = bool(dict(workload.config).get("chunked_loss", False))
        self.module = HCModule(
            workload.model,
            self.budget,
            block_size=self.block_size,
            planner=self.planner,
            plan_cache=self.plan_cache,
        )
        self.module.prepare(*batch.args, **batch.kwargs)
        return self.module

    def describe(self) -> dict:
        out = {
            "name": self.name,
            "budget": self.budget,
            "block_size": self.block_size,
            "planner": self.planner,
            "chunked_loss": self.chunked_loss,
            "plan_cache": self.plan_cache,
        }
        compiled = self.module.compiled if self.module is not None else None
        if compiled is None:
            return out
        plan = compiled.plan
        out.update(
            {
                **plan.metrics(),
                "naive_predicted_peak_bytes": compiled.naive_peak_bytes,
                "plan_time_s": compiled.plan_time_s,
                "plan_from_cache": bool(plan.meta.get("from_cache", False)),
                "capture_time_s": compiled.capture_time_s,
                "capture_granularity": compiled.captured.granularity,
                "graph_nodes": len(compiled.captured.graph),
            }
        )
        return out

    def summary(self) -> str:
        """The plan in three lines (`hbp.modes.plan_text`), printed by the bench before it
        measures; the whole plan is the run's plan.json."""
        if self.module is None or self.module.plan is None:
            return "tiny: not planned yet"
        from hbp.modes.plan_text import plan_lines

        compiled = self.module.compiled
        captured = (
            f"{compiled.captured.granularity}-level capture, {len(compiled.captured.graph)} "
            f"nodes ({compiled.capture_time_s:.1f} s)"
        )
        return plan_lines(
            self.module.plan,
            budget=self.budget,
            planner=self.planner,
            captured=captured,
            chunked_loss=self.built_with_chunked_loss,
        )

    def artifacts(self) -> dict[str, str]:
        """plan.json and graph.json (the captured graph in hbp's IR, the input of
        `python -m hbp.optimum graph=...`) for the run directory (empty before `apply`)."""
        if self.module is None or self.module.plan is None:
            return {}
        return {
            "plan.json": self.module.plan.to_json(),
            "graph.json": self.module.compiled.captured.graph.to_json(),
        }
