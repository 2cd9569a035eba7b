"""JAX mode "tiny": hbp's planner through `hbp.jax.height_compressed_grad(loss, budget)`.

The loss is captured as a jaxpr, planned under `budget` (fraction of the simulated naive
peak, bytes, a size string or "min") and executed by the "fenced" executor inside the bench's
`jax.jit`: every recomputed segment is a custom_vjp whose backward recomputes it where XLA
cannot merge it back into the forward (NOTE [ Recomputation under the caller's jax.jit ] in
hbp/integrations/jax/remat.py).
"""

from __future__ import annotations

from hbp.errors import ConfigError
from hbp.modes.base import check_planner_options
from hbp.modes.jax.base import refuse_chunked_loss
from hbp.workloads.jax.base import JaxWorkload


class JaxTinyMode:
    """`height_compressed_grad(loss, budget, has_aux=True, block_size=..., planner=...)`,
    planned on the workload's arrays in `apply`. `chunked_loss` must be false
    (`refuse_chunked_loss`; conf/framework/jax.yaml sets it false)."""

    name = "tiny"

    def __init__(
        self,
        budget: float | int | str = "min",
        block_size: int = 1,
        planner: str = "optimal",
        chunked_loss: bool = False,
        plan_cache: str | None = None,
    ):
        refuse_chunked_loss(chunked_loss)
        if plan_cache is not None:  # the mode config group is shared with torch
            raise ConfigError(
                "mode.plan_cache", plan_cache, "null with framework=jax (plans are not kept)"
            )
        check_planner_options(budget, block_size, planner)
        self.budget = budget
        self.block_size = block_size
        self.planner = planner
        self.grad_fn = None
        self.graph = None

    def apply(self, workload: JaxWorkload):
        """The planned gradient function (raises `hbp.BudgetError` when no plan fits)."""
        import hbp.jax as hj
        from hbp.graph.jax_capture import capture_jaxpr

        self.grad_fn = hj.height_compressed_grad(
            workload.loss_and_aux,
            self.budget,
            has_aux=True,
            block_size=self.block_size,
            planner=self.planner,
        )
        args = (workload.params, *workload.batch)
        self.grad_fn.get_plan(*args)
        self.graph = capture_jaxpr(workload.loss_and_aux, *args, argnums=0)[0]
        return self.grad_fn

    @property
    def plan(self):
        return self.grad_fn.plan if self.grad_fn is not None else None

    def describe(self) -> dict:
        out = {
            "name": self.name,
            "budget": self.budget,
            "block_size": self.block_size,
            "planner": self.planner,
            "chunked_loss": False,
        }
        plan = self.plan
        if plan is None:
            return out
        out.update(
            {
                **plan.metrics(),
                "naive_predicted_peak_bytes": plan.naive_peak_bytes,
                "plan_time_s": plan.meta.get("solve_time_s"),
                "capture_granularity": "jaxpr",
                "graph_nodes": len(self.graph) if self.graph is not None else None,
            }
        )
        return out

    def summary(self) -> str:
        """The plan in three lines (`hbp.modes.plan_text`), printed by the bench before it
        measures; the whole plan is the run's plan.json."""
        if self.plan is None:
            return "tiny: not planned yet"
        from hbp.modes.plan_text import plan_lines

        nodes = len(self.graph) if self.graph is not None else len(self.plan.segments)
        return plan_lines(
            self.plan,
            budget=self.budget,
            planner=self.planner,
            captured=f"jaxpr capture, {nodes} nodes",
            chunked_loss=False,
        )

    def artifacts(self) -> dict[str, str]:
        """plan.json and graph.json (the captured jaxpr in hbp's IR; the plan's node indices
        refer to it) for the run directory (empty before `apply`)."""
        if self.plan is None or self.graph is None:
            return {}
        return {"plan.json": self.plan.to_json(), "graph.json": self.graph.to_json()}
