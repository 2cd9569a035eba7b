"""The libraries' models as workloads (workload=hf arch=..., workload=diffusers_unet) and
mode=library_checkpoint: built from config classes at profile tiny, the library computes the
loss, the library's checkpointing really recomputes and keeps loss and gradients, models
without one get a ConfigError, and `python run.py ...` runs them end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hbp.errors import ConfigError
from hbp.modes import build_mode
from hbp.modes.library_checkpoint import LibraryCheckpointMode
from hbp.runtime.flops import TotalFlopCounterMode
from hbp.workloads import build, describe

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("gpt2", "llama", "bert", "t5", "vit")
CASES = [("hf", {"arch": arch}) for arch in ARCHS] + [("diffusers_unet", {})]
IDS = [*ARCHS, "diffusers_unet"]


def step(workload, module=None):
    """(loss, [grad per parameter], FLOPs) of one forward + backward."""
    module = workload.model if module is None else module
    params = list(workload.model.parameters())
    for p in params:
        p.grad = None
    with TotalFlopCounterMode() as counter:
        loss = workload.step_loss(module, workload.make_batch(0))
        loss.backward()
    return loss.detach(), [p.grad for p in params], counter.get_total_flops()


@pytest.mark.parametrize("name, overrides", CASES, ids=IDS)
def test_tiny_model_computes_its_own_loss_with_a_gradient_for_every_parameter(name, overrides):
    wl = build(name, "tiny", **overrides)
    assert wl.library == ("diffusers" if name == "diffusers_unet" else "transformers")
    assert wl.config["n_blocks"] == len(wl.blocks) >= 2
    library_layers = {id(m) for m in wl.model.library_model.modules()}
    assert all(id(block) in library_layers for block in wl.blocks)
    loss, grads, _ = step(wl)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(bool(g.abs().sum() > 0) for g in grads) >= 0.9 * len(grads)


def test_the_loss_is_the_librarys_own():
    wl = build("hf", "tiny", arch="gpt2")
    batch = wl.make_batch(0)
    ids = batch.kwargs["input_ids"]
    with torch.no_grad():
        logits = wl.model.library_model(input_ids=ids).logits
        expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(wl.step_loss(wl.model, batch), expected)
    unet = build("diffusers_unet", "tiny")
    noisy, t, text, noise = unet.make_batch(0).args
    with torch.no_grad():
        prediction = unet.model.library_model(noisy, t, text).sample
        assert prediction.shape == noise.shape
        torch.testing.assert_close(unet.model(noisy, t, text, noise), F.mse_loss(prediction, noise))


@pytest.mark.parametrize("name, overrides", CASES, ids=IDS)
def test_library_checkpointing_recomputes_and_keeps_loss_and_gradients(name, overrides):
    plain, checkpointed = build(name, "tiny", **overrides), build(name, "tiny", **overrides)
    mode = LibraryCheckpointMode()
    module = mode.apply(checkpointed, checkpointed.make_batch(0))
    assert module is checkpointed.model
    assert mode.describe()["method"].split()[0] == checkpointed.library
    loss, grads, flops = step(plain)
    ckpt_loss, ckpt_grads, ckpt_flops = step(checkpointed, module)
    assert ckpt_flops > flops  # the layers' forward ran again in backward
    torch.testing.assert_close(ckpt_loss, loss, rtol=1e-6, atol=1e-6)
    for g, ref in zip(ckpt_grads, grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def test_models_without_library_checkpointing_and_chain_modes_on_library_models_are_errors():
    gpt2 = build("gpt2", "tiny")
    with pytest.raises(ConfigError, match="GPT2 has none; use mode=checkpoint") as info:
        build_mode("library_checkpoint").apply(gpt2, gpt2.make_batch(0))
    assert info.value.field == "mode" and "(workload gpt2)" in str(info.value)
    hf = build("hf", "tiny")
    for mode in ("checkpoint", "sac"):
        with pytest.raises(ConfigError, match="library_checkpoint") as info:
            build_mode(mode).apply(hf, hf.make_batch(0))
        assert info.value.value == mode and "not a chain" in str(info.value)
    with pytest.raises(ConfigError) as info:
        build("hf", "tiny", arch="gpt5")
    assert info.value.field == "workload.arch" and "llama" in str(info.value)
    with pytest.raises(ConfigError) as info:
        build("diffusers_unet", "tiny", image_size=9)
    assert info.value.field == "workload.image_size"


@pytest.mark.parametrize("profile", ["small", "medium", "large"])
def test_bigger_profiles_describe_without_allocating(profile):
    for name, overrides in CASES:
        facts = describe(name, profile, **overrides)
        assert facts["params"] > 0 and facts["n_blocks"] >= 2
    assert describe("hf", "medium", arch="bert")["params"] > 80_000_000  # BERT-base shapes


def run_py(*args: str, root: Path):
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    environ.pop("HYDRA_FULL_ERROR", None)
    fast = ("profile=tiny", "steps=1", "warmup=0", "logger=none", "verify=true")
    return subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args, *fast, f"output_root={root}"],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


def metrics(root: Path) -> dict:
    (path,) = root.glob("runs/*/*/metrics.json")
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    "args",
    [
        ("workload=hf", "workload.arch=llama", "mode=library_checkpoint"),
        pytest.param(
            ("workload=diffusers_unet", "mode=tiny", "mode.budget=min"), marks=pytest.mark.slow
        ),
    ],
    ids=["llama_library_checkpoint", "diffusers_unet_tiny_min"],
)
def test_run_py_end_to_end(args, tmp_path):
    result = run_py(*args, root=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    row = metrics(tmp_path)
    assert row["status"] == "ok" and row["verify_passed"] and row["grad_max_rel_error"] < 1e-4
    assert row["peak_bytes"] < row["naive_peak_bytes"]
    assert row["recompute_ratio"] > 0
    if row["mode"] == "library_checkpoint":
        assert row["mode_method"] == "transformers activation_checkpointing_enable"
        assert row["mode_library_class"] == "LlamaForCausalLM"
    else:
        assert row["mode_capture_granularity"] in ("op", "module")
