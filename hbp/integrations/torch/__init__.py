"""hbp for PyTorch: make a module's training step fit a memory budget with the least recompute.

    hbp.enable(model, budget="50%act")             # in place; the model keeps its class
    model(**batch).loss.backward()                 # same outputs and gradients as before

    hc = hbp.HCModule(model, budget=0.3)           # or the wrapper form
    loss = loss_fn(hc(x), y); loss.backward()
    print(hc.plan)                                 # what is kept, what is recomputed

Files, one concern each: `module.py` (the `HCModule` class), `enable.py` (`enable` /
`disable`), `planning.py` (capture, plan and executor per input signature), `loss.py` (the step
with its loss), `closed_loop.py` (the first step measured by the allocator, planned again above
the budget), `outputs.py` (outputs the caller lets go), `compile.py` (torch.compile). The budget's
forms: `hbp.planner.budget`.
"""

from __future__ import annotations

from hbp.graph.torch.capture import MODULE
from hbp.integrations.torch.enable import disable, enable, engine_of, is_enabled
from hbp.integrations.torch.module import DEFAULT_BUDGET, HCModule
from hbp.integrations.torch.planning import Compiled, plan_summary

__all__ = [
    "DEFAULT_BUDGET",
    "MODULE",
    "Compiled",
    "HCModule",
    "disable",
    "enable",
    "engine_of",
    "is_enabled",
    "plan_summary",
]
