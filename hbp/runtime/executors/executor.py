"""What every executor offers (`Executor`) and the one that runs a given plan (`make_executor`)."""

from __future__ import annotations

import weakref
from typing import Any, Protocol

from torch import nn

from hbp.graph.torch.captured import MODULE, CapturedGraph
from hbp.planner.plan import Plan
from hbp.runtime.executors.module_calls import ModuleCallExecutor
from hbp.runtime.executors.schedule import ScheduleExecutor
from hbp.runtime.executors.segments import PlanExecutor

__all__ = ["Executor", "make_executor"]


class Executor(Protocol):
    """Runs a captured module's training step under a plan.

    Attributes:
        plan: the plan it runs.
        returned: (IR output name, weak reference to the tensor) of the last call's graph
            outputs, where the executor tracks them (NOTE [ Outputs the caller lets go ]);
            empty where it does not.
    """

    plan: Plan
    returned: list[tuple[str, weakref.ref]]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward as the plan says; returns what the module returns."""
        ...


def make_executor(
    captured: CapturedGraph, plan: Plan, module: nn.Module, compile_options: dict | None = None
) -> Executor:
    """The executor for `captured`'s granularity and `plan`'s kind: module calls (module
    level), an explicit schedule (`plan.schedule`), or segments. `compile_options` (segments
    only): run each leaf segment through `torch.compile(segment, **compile_options)` (NOTE
    [ Compiled segments ])."""
    if captured.granularity == MODULE:
        return ModuleCallExecutor(captured, plan, module)
    if plan.schedule:
        return ScheduleExecutor(captured, plan, module)
    return PlanExecutor(captured, plan, module, compile_options=compile_options)
