"""Fourth trial, finding: on ControlNet + frozen UNet (a graph planned in stages), budget="min"
is not the least peak the planner reaches, and a budget between the two raises a BudgetError
whose minimum is wrong.

"min" resolves to `min_feasible_peak(graph)`: the least-peak DP over the whole graph's
candidate cuts, without pins. `optimal_plan` under that budget may then plan in stages (other
cuts) and with pinned values, and reaches less: the "min" plan's prediction is below its own
budget (the trial's row: budget 3.41 MiB, predicted and measured 3.27 MiB). A byte budget
between the two fails, although `plan(graph, "min")` showed a plan under it.

    PYTHONPATH=$PWD:$PWD/experiments OMP_NUM_THREADS=1 \
        python experiments/trial_fourth_repros/controlnet_min_not_least.py
"""

import torch
import transformers
from trial_fourth_models import controlnet

import hbp
from hbp.graph.torch.capture import capture
from hbp.planner import min_feasible_peak
from hbp.planner import plan as make_plan
from hbp.units import MIB

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model, step = controlnet()
model.train()
args = (torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), torch.randn(2, 8, 32))
args += (torch.randn(2, 3, 32, 32),)
graph = capture(model, args).graph
graph.held_outputs = []  # the caller lets go of the output (a loss is made from it)
least, _ = min_feasible_peak(graph)
plan = make_plan(graph, "min")
print(
    f"{len(graph.nodes)} nodes; min_feasible_peak {least / MIB:.3f} MiB; plan('min'): budget "
    f"{plan.budget_bytes / MIB:.3f} MiB, predicted {plan.predicted_peak_bytes / MIB:.3f} MiB "
    f"(solved by {plan.meta.get('solved_by')!r})"
)
between = (least + plan.predicted_peak_bytes) // 2
try:
    got = make_plan(graph, between)
    print(f"plan({between / MIB:.3f} MiB): predicted {got.predicted_peak_bytes / MIB:.3f} MiB")
except hbp.BudgetError as err:
    print(f"plan({between / MIB:.3f} MiB): BudgetError: {err}")
