"""Fourth trial, finding: HCModule(budget="min") on MobileViT stays 24% above a plan the same
DP reaches with another choice of candidate cuts. Fixed since: "min" is the least over the cut
sets chosen for 1, 1.5 and 2 times max_cuts (NOTE [ Least peak over other cut choices ] in
hbp.planner.cuts), so both runs now measure 7.11 MiB.

`candidate_cuts(info, 1, max_cuts)` keeps about 55 cuts of MobileViT's 398 nodes whatever
`max_cuts` is (WORK_LIMIT stops it), but which 55 depends on `max_cuts` (the crossing-count
radius is `LOCAL_RADIUS * n // max_cuts`): the default 64 gives a least peak of 8.73 MiB, 96
and 128 give 7.11 MiB, 192 8.73 and 400 13.54 MiB (fewer cuts). The least-peak DP itself is
exact over a set: the union of the 96 and 192 sets gives 7.11 again. This script runs
HCModule at "min" twice, by the allocator: the default cuts, then with the planner's cut
choice asked for max_cuts=96.

    PYTHONPATH=$PWD:$PWD/experiments OMP_NUM_THREADS=1 \
        python experiments/trial_fourth_repros/mobilevit_min_cuts.py
"""

import torch
import transformers
from trial_fourth_models import mobilevit
from trial_models import MIB, _step, grad_error, measured

import hbp
import hbp.planner.dp.entry as entry

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
original = entry.candidate_cuts
for label, max_cuts in (("default cuts", None), ("cuts chosen as for max_cuts=96", 96)):
    if max_cuts:
        entry.candidate_cuts = lambda info, block_size, _=64, k=max_cuts: original(
            info, block_size, k
        )
    torch.manual_seed(0)
    model, step = mobilevit()
    model.train()
    _step(model, model, step)
    naive, _, ref = measured(model, model, step)
    hc = hbp.HCModule(model, budget="min")
    _step(model, hc, step)  # capture, calibrate, plan
    peak, _, grads = measured(model, hc, step)
    print(
        f"{label}: naive {naive / MIB:.2f} MiB; min plan predicted "
        f"{hc.plan.predicted_peak_bytes / MIB:.2f} MiB, measured {peak / MIB:.2f} MiB, "
        f"grad error {grad_error(grads, ref):.1e}"
    )
entry.candidate_cuts = original
