"""Fourth trial, finding: on CPU by default (no `loss_fn`, `calibrate=None`), the caller's
loss memory the plan does not see takes an 8-layer MLP over its budget, in fp32 with the
README's own "safe" pattern (`out = model(x); loss_fn(out, y).backward()`) and under bf16
autocast with an upcast output.

The plan counts an output backward starts from as alive until backward ends, standing in for
the caller's loss (NOTE [ Outputs the caller lets go ]). CPU `mse_loss`'s 0-dim result keeps
its elementwise buffer (the output's size) until the loss tensor dies, i.e. after backward
returns. When the caller also holds `out`, both are alive and only one is counted; under
autocast the bf16 output (half the size) stands in for a float32 upcast plus the buffer. By
the allocator, each step's peak over HCModule's budget, then with `calibrate=True` (the
closed loop the README names for CPU).

    PYTHONPATH=$PWD:$PWD/experiments OMP_NUM_THREADS=1 \
        python experiments/trial_fourth_repros/caller_loss_not_counted.py
"""

import torch
import torch.nn.functional as F
from torch import nn
from trial_models import MIB, _step, grad_error, measured

import hbp

torch.set_num_threads(1)


def mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(128, 128), nn.GELU()]
    return nn.Sequential(*layers)


x, target = torch.randn(1024, 128), torch.randn(1024, 128)


def fp32_out_held(m):  # README: "the safe assumption"
    out = m(x)
    F.mse_loss(out, target).backward()


def fp32_out_let_go(m):
    F.mse_loss(m(x), target).backward()


def bf16_upcast(m):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(m(x).float(), target)
    loss.backward()


for step in (fp32_out_held, fp32_out_let_go, bf16_upcast):
    for calibrate in (None, True):
        for budget in (0.6, "min"):
            model = mlp()
            _step(model, model, step)
            naive, _, ref = measured(model, model, step)
            hc = hbp.HCModule(model, budget=budget, calibrate=calibrate)
            _step(model, hc, step)  # capture, calibrate, plan (and measure, with calibrate)
            peak, _, grads = measured(model, hc, step)
            print(
                f"{step.__name__}, calibrate={calibrate}, budget {budget}: plain step "
                f"{naive / MIB:.3f} MiB; budget {hc.plan.budget_bytes / MIB:.3f}, predicted "
                f"{hc.plan.predicted_peak_bytes / MIB:.3f}, measured {peak / MIB:.3f} "
                f"({peak / hc.plan.budget_bytes:.3f}x), grad error {grad_error(grads, ref):.1e}",
                flush=True,
            )
