"""Fourth trial, by hand: variants of its models through `trial_models.trial` (budgets 0.5
and "min"): ModernBERT and OPT with right/left padding in the attention mask, Phi-3 under CPU
bf16 autocast, Flux under bf16 autocast with the backward inside the autocast block, and
MobileViT in channels-last.

    PYTHONPATH=$PWD:$PWD/experiments OMP_NUM_THREADS=1 \
        python experiments/trial_fourth_repros/variants.py modernbert_padded opt_padded \
        phi3_bf16 flux_bf16 mobilevit_cl
"""

import sys

import torch
import transformers
import trial_fourth_models as fourth
import trial_models

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()


def modernbert_padded():
    model, _ = fourth.modernbert()
    ids = fourth._tokens(4, 96)
    mask = torch.ones(4, 96, dtype=torch.long)
    mask[1, 60:], mask[3, 80:] = 0, 0
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    return model, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()


def opt_padded():
    model, _ = fourth.opt()
    ids = fourth._tokens(4, 96)
    mask = torch.ones(4, 96, dtype=torch.long)
    mask[0, :20] = 0
    return model, lambda m: m(
        input_ids=ids, attention_mask=mask, labels=ids, use_cache=False
    ).loss.backward()


def phi3_bf16():
    model, _ = fourth.phi3()
    ids = fourth._tokens(4, 96)

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    return model, step


def flux_bf16():
    """The trial's Flux step (forward, MSE and backward) inside a bf16 autocast block."""
    model, plain_step = fourth.flux()

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_step(m)

    return model, step


def mobilevit_cl():
    model, _ = fourth.mobilevit()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 64, 64).to(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (4,))
    return model, lambda m: m(pixel_values=x, labels=labels).loss.backward()


VARIANTS = {f.__name__: f for f in (modernbert_padded, opt_padded, phi3_bf16, flux_bf16)}
VARIANTS["mobilevit_cl"] = mobilevit_cl

if __name__ == "__main__":
    trial_models.MODELS.update(VARIANTS)
    rows = [trial_models.trial(name) for name in sys.argv[1:] or VARIANTS]
    print(trial_models.table(rows))
