"""hbp.runtime.executors: run a captured module's training step under a plan.

`make_executor` picks the executor (`Executor` says what each offers):
- `segments`: a plan of segments at op level (`PlanExecutor`), with pinned values (`pins`) and
  compiled leaf segments (`compiled`);
- `module_calls`: a plan at module level, the capture's fallback (`ModuleCallExecutor`);
- `schedule`: an explicit schedule (`ScheduleExecutor`, `hbp.planner.schedules`).
"""

from hbp.runtime.executors.executor import Executor, make_executor

__all__ = ["Executor", "make_executor"]
