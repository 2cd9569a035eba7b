"""Fourth trial, finding: diffusers Flux under CPU bf16 autocast goes over its budget when the
loss's backward runs inside the `with torch.autocast(...)` block; the same step with the
backward after the block holds it. Plain autograd's gradients and peak are the same either
way (the loss is on a 2 x 64 x 16 output: its memory is negligible). The trial's Flux
builder, by the allocator; `double, single` are the numbers of double- and single-stream
blocks.

    PYTHONPATH=$PWD:$PWD/experiments OMP_NUM_THREADS=1 \
        python experiments/trial_fourth_repros/flux_backward_in_autocast.py
"""

import diffusers
import torch
import torch.nn.functional as F
from trial_models import MIB, _step, grad_error, measured

import hbp

torch.set_num_threads(1)


def flux(double, single, backward_inside, cache=True):
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    h = w = 8
    latents, target = torch.randn(2, h * w, 16), torch.randn(2, h * w, 16)
    text, pooled = torch.randn(2, 12, 32), torch.randn(2, 32)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    ids = dict(img_ids=img_ids.reshape(h * w, 3), txt_ids=torch.zeros(12, 3))
    step_t = torch.tensor([0.1, 0.7])

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache):
            out = m(latents, encoder_hidden_states=text, pooled_projections=pooled,
                    timestep=step_t, **ids).sample  # fmt: skip
            loss = F.mse_loss(out.float(), target)
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()

    return model, step


for double, single, inside, cache in (
    (1, 0, False, True),
    (1, 0, True, True),
    (0, 2, False, True),
    (0, 2, True, True),
    (1, 2, False, True),
    (1, 2, True, True),
    (1, 2, True, False),  # the same with autocast's weight-cast cache off
):
    model, step = flux(double, single, inside, cache)
    model.train()
    _step(model, model, step)
    naive, _, ref = measured(model, model, step)
    hc = hbp.HCModule(model, budget="min")
    _step(model, hc, step)  # capture, calibrate, plan
    peak, _, grads = measured(model, hc, step)
    print(
        f"double {double}, single {single}, backward {'inside' if inside else 'after'} "
        f"autocast{'' if cache else ' (cache off)'}: plain {naive / MIB:.3f} MiB; "
        f"budget {hc.plan.budget_bytes / MIB:.3f}, "
        f"predicted {hc.plan.predicted_peak_bytes / MIB:.3f}, measured {peak / MIB:.3f} "
        f"({peak / hc.plan.budget_bytes:.3f}x), grad error {grad_error(grads, ref):.1e}",
        flush=True,
    )
