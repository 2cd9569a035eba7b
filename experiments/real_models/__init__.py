"""Real models from their libraries' config classes (random weights, tiny sizes, nothing
downloads), one zoo per family, for `experiments/real_models/run.py`.

`MODELS` maps a name to a builder returning `(model, step)`; `FAMILIES` maps a family to its
names. docs/real-models.md gives the measured tables.
"""

from __future__ import annotations

from real_models import decoders, diffusion, encoders, multimodal, seq2seq, vision

FAMILIES = {
    module.__name__.rsplit(".", 1)[-1]: tuple(module.MODELS)
    for module in (decoders, encoders, seq2seq, vision, multimodal, diffusion)
}
MODELS = {
    **decoders.MODELS,
    **encoders.MODELS,
    **seq2seq.MODELS,
    **vision.MODELS,
    **multimodal.MODELS,
    **diffusion.MODELS,
}
assert sum(map(len, FAMILIES.values())) == len(MODELS), "a model name is in two families"
