"""The real-model zoos of experiments/real_models/: every builder makes a model whose plain
training step gives every trainable parameter a gradient, and the runner refuses names it does
not know."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
from real_models import FAMILIES, MODELS  # noqa: E402

# Parameters a model's step does not use: DINOv2's mask token replaces masked patches only;
# LLaVA reads the vision tower's second-to-last layer (`vision_feature_layer=-2`), so its
# last layer and final norm get no gradient.
_LAST_CLIP_LAYER = "model.vision_tower.encoder.layers.2."
UNUSED = {
    "dinov2": {"dinov2.embeddings.mask_token"},
    "llava": {
        f"{_LAST_CLIP_LAYER}{m}.{p}"
        for m in (
            "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2", "self_attn.k_proj",
            "self_attn.out_proj", "self_attn.q_proj", "self_attn.v_proj",
        )
        for p in ("weight", "bias")
    }
    | {"model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"},
}  # fmt: skip


def test_every_model_is_in_exactly_one_family():
    names = [name for family in FAMILIES.values() for name in family]
    assert sorted(names) == sorted(MODELS)
    assert set(FAMILIES) == {"decoders", "encoders", "seq2seq", "vision", "multimodal", "diffusion"}


def test_runner_refuses_an_unknown_model():
    done = subprocess.run(
        [sys.executable, str(EXPERIMENTS / "real_models" / "run.py"), "no_such_model"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "unknown model(s) no_such_model" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_plain_step_trains_every_parameter(name):
    torch.manual_seed(0)
    model, step = MODELS[name]()
    model.train()
    step(model)
    missing = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
    assert missing == UNUSED.get(name, set())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
